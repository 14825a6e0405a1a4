"""Widgets, one concern each: a snapshot reactive in, rendering in `watch_*`, no IO."""

from engy_tui.widgets.server_panel import ServerPanel

__all__ = ["ServerPanel"]
