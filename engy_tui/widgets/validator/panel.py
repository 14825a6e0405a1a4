"""The validator and chain tabs' widgets: they lay the blocks out, turn each block's cells into
content and skip the repaint when the view did not change.

They are handed the typed states (the hub's "validator" and "chain" states as
`engy_node.snapshots` decodes them, the node's `hotkeys`) with the render time through
`update_state`, by the app's fixed-rate render timer; they never poll, read the clock or decide
what a line says (the block modules do, tested without a terminal).
"""

from __future__ import annotations

from collections.abc import Mapping

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Static

from engy_node.snapshots import ChainState, ValidatorState
from engy_tui.widgets.validator.chain import ChainPanelView, chain_view
from engy_tui.widgets.validator.common import lines_content
from engy_tui.widgets.validator.view import ValidatorView, validator_view

__all__ = [
    "ChainPanel",
    "ValidatorPanel",
]

SIDE_BY_SIDE_FROM = 140
"""Narrower than this, the weights and the next action stack (each gets the whole width) rather
than cut every line of both in half."""

_BOX_CSS = """
    border: round $primary;
    border-title-color: $text-primary;
    border-title-style: bold;
    padding: 0 1;
    height: auto;
    text-wrap: nowrap;
    text-overflow: ellipsis;
"""


class ValidatorPanel(Widget):
    """Weights on chain and next action side by side (stacked below `SIDE_BY_SIDE_FROM`
    columns), warnings under the next action, the submissions across the bottom. Call
    `update_state` with the hub's "validator" state."""

    DEFAULT_CSS = f"""
    ValidatorPanel {{
        height: auto;
    }}
    ValidatorPanel > #validator-top {{
        height: auto;
    }}
    ValidatorPanel #validator-side {{
        width: 1fr;
        height: auto;
    }}
    ValidatorPanel #validator-weights {{
        width: 1fr;
    }}
    ValidatorPanel.-stacked > #validator-top {{
        layout: vertical;
    }}
    ValidatorPanel .box {{{_BOX_CSS}}}
    ValidatorPanel #validator-warnings {{
        text-wrap: wrap;
    }}
    ValidatorPanel #validator-warnings.-warning {{
        border: round $warning;
    }}
    ValidatorPanel #validator-warnings.-error {{
        border: round $error;
    }}
    """

    def __init__(
        self, *, poll_s: float | None = None, name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.poll_s = poll_s
        self._shown: ValidatorView | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="validator-top"):
            yield Static(id="validator-weights", classes="box")
            with Vertical(id="validator-side"):
                yield Static(id="validator-next", classes="box")
                yield Static(id="validator-warnings", classes="box")
        yield Static(id="validator-submissions", classes="box")

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def on_resize(self, event: events.Resize) -> None:
        self.set_class(event.size.width < SIDE_BY_SIDE_FROM, "-stacked")

    def update_state(
        self,
        state: ValidatorState | None,
        *,
        now: float,
        names: Mapping[str, str] | None = None,
        chain: ChainState | None = None,
    ) -> None:
        """Show the hub's "validator" state as of wall-clock `now`; `names` is the node's
        `hotkeys` ({name: ss58}), `chain` its "chain" state, when it has them."""
        view = validator_view(state, now=now, chain=chain, names=names, poll_s=self.poll_s)
        if view == self._shown:
            return
        self._shown = view
        for widget_id, title, lines in (
            ("validator-weights", view.weights_title, view.weights),
            ("validator-next", "Next action", view.next_action),
            ("validator-warnings", view.warnings_title, view.warnings),
            ("validator-submissions", view.submissions_title, view.submissions),
        ):
            box = self.query_one(f"#{widget_id}", Static)
            box.border_title = title
            box.update(lines_content(lines))
        warnings = self.query_one("#validator-warnings", Static)
        warnings.set_class(view.worst == "warning", "-warning")
        warnings.set_class(view.worst == "error", "-error")


class ChainPanel(Widget):
    """The subnet's neurons and the weights on chain. Call `update_state` with the hub's
    "chain" state."""

    DEFAULT_CSS = f"""
    ChainPanel {{{_BOX_CSS}}}
    ChainPanel > Static {{
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }}
    ChainPanel > #chain-weights {{
        margin-top: 1;
    }}
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._shown: ChainPanelView | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="chain-summary")
        yield Static(id="chain-neurons")
        yield Static(id="chain-weights")

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def update_state(self, state: ChainState | None, *, now: float, names: Mapping[str, str] | None = None) -> None:
        """Show the hub's "chain" state; `names` is the node's `hotkeys` ({name: ss58})."""
        view = chain_view(state, now=now, names=names)
        if view == self._shown:
            return
        self._shown = view
        self.border_title = view.title
        for widget_id, lines in (
            ("chain-summary", (view.summary,)),
            ("chain-neurons", view.neurons),
            ("chain-weights", view.weights),
        ):
            static = self.query_one(f"#{widget_id}", Static)
            static.update(lines_content(lines))
            static.display = bool(lines)
