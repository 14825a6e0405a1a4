"""Full screens pushed over the node manager: one view each, composing widgets and routing events."""

from engy_tui.screens.setup import SetupScreen

__all__ = ["SetupScreen"]
