"""The two screens the Logs view opens: the lines around a selected one, to read and copy
(`LogContextScreen`), and the component groups to show (`ComponentPicker`). Both take plain
values (rows as text, group names) and know nothing of the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import SelectionList, Static, TextArea

__all__ = [
    "ComponentPicker",
    "LogContextScreen",
]


class LogContextScreen(ModalScreen[None]):
    """The lines around a selected one, as plain text to read, select and copy."""

    BINDINGS = [
        Binding("y", "copy", "Copy all", id="logs.context.copy", tooltip="Copy these lines to the clipboard."),
        Binding("escape", "close", "Close", id="logs.context.close", tooltip="Back to the log."),
    ]
    DEFAULT_CSS = """
    LogContextScreen {
        align: center middle;
        & > Vertical { width: 95%; height: 90%; border: round $primary; background: $surface; }
        & TextArea, & TextArea:focus { height: 1fr; border: none; }
        & #context-hint { height: 1; color: $text-muted; }
    }
    """

    def __init__(self, rows: Sequence[str], selected: int) -> None:
        """`rows` are the lines as text, `selected` the index of the one asked about."""
        super().__init__()
        self.rows = list(rows)
        self.selected = selected
        self.text = "\n".join(self.rows)
        """What y copies."""

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"{len(self.rows)} lines around the selected one (all components and levels)"
            yield TextArea(self.text, read_only=True, soft_wrap=False, id="context-text")
            yield Static(
                "y copies all · select with the mouse or shift+arrows, ctrl+c copies that · escape closes",
                id="context-hint",
            )

    def on_mount(self) -> None:
        text_area = self.query_one(TextArea)
        text_area.move_cursor((self.selected, 0), center=True)
        text_area.focus()

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.notify(f"copied {len(self.rows)} lines", title="logs")

    def action_close(self) -> None:
        self.dismiss(None)


class ComponentPicker(ModalScreen[frozenset[str]]):
    """Tick the component groups to show; the screen returns the ones left unticked (hidden)."""

    BINDINGS = [
        Binding("escape", "done", "Done", id="logs.components.done", tooltip="Apply and go back to the log."),
        Binding("a", "show_all", "Show all", id="logs.components.all", tooltip="Tick every component."),
    ]
    DEFAULT_CSS = """
    ComponentPicker {
        align: center middle;
        & > Vertical { width: 50; height: auto; max-height: 80%; border: round $primary; background: $surface; }
        & SelectionList, & SelectionList:focus { height: auto; max-height: 20; border: none; }
        & #components-hint { height: 1; color: $text-muted; }
    }
    """

    def __init__(self, components: Sequence[str], hidden: frozenset[str]) -> None:
        super().__init__()
        self.components = list(components)
        self.hidden = hidden

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = "components shown"
            if self.components:
                yield SelectionList[str](*((name, name, name not in self.hidden) for name in self.components))
            else:
                yield Static("no components seen yet", id="components-none")
            yield Static("space toggles · a shows all · escape applies", id="components-hint")

    def action_show_all(self) -> None:
        for selection_list in self.query(SelectionList):
            selection_list.select_all()

    def action_done(self) -> None:
        shown: set[str] = set()
        for selection_list in self.query(SelectionList):
            shown.update(selection_list.selected)
        # Hidden components nobody could untick here (none seen yet) stay hidden.
        self.dismiss(
            frozenset(name for name in self.components if name not in shown) | (self.hidden - set(self.components))
        )
