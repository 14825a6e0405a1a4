"""The keys panel (`?` or F1): every binding of the node manager, grouped by where it works, with
the id `keymap.toml` rebinds it by — as k9s's and lazygit's help screens list theirs.

A modal screen rather than Textual's docked help panel: it takes the keyboard while open, so
Esc, `?` and F1 close it on any tab (on the Logs tab Esc would otherwise close a search), and
it lists the keys of tabs that are not showing too. What it lists is decided by `key_groups`
and `key_label`, plain functions over `Binding`s and the user's keymap.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.keys import format_key
from textual.screen import ModalScreen
from textual.widgets import Static

__all__ = ["KeysScreen", "key_groups", "key_label"]

KeyRow = tuple[str, str, str]
"""(keys as typed, what they do, the binding id for keymap.toml; "" when it has none)."""

_WORDS = {"enter": "enter", "escape": "esc", "space": "space"}


def key_label(keys: str) -> str:
    """A binding's keys ("question_mark,f1") as a person types them ("? F1")."""
    labels = []
    for key in (part.strip() for part in keys.split(",")):
        if key in _WORDS:
            labels.append(_WORDS[key])
        elif re.fullmatch(r"f\d{1,2}", key):
            labels.append(key.upper())
        else:
            labels.append(format_key(key))
    return " ".join(labels)


def key_groups(
    groups: Iterable[tuple[str, Sequence[Binding]]], keymap: Mapping[str, str]
) -> list[tuple[str, list[KeyRow]]]:
    """Each group's bindings that say what they do, with the keys the user's keymap gives them."""
    listed = []
    for title, bindings in groups:
        rows = [
            (key_label(keymap.get(binding.id or "", binding.key)), binding.description, binding.id or "")
            for binding in bindings
            if binding.description
        ]
        if rows:
            listed.append((title, rows))
    return listed


class KeysScreen(ModalScreen[None]):
    """Every key, what it does and its keymap id; Esc, `?` or F1 close it."""

    BINDINGS = [Binding("escape,question_mark,f1,q", "close", "Close", id="keys.close")]
    DEFAULT_CSS = """
    KeysScreen {
        align: center middle;
        & > VerticalScroll {
            width: 90;
            max-width: 100%;
            height: auto;
            max-height: 90%;
            padding: 0 2;
            border: round $primary;
            border-title-style: bold;
            background: $surface;
        }
        & Static { width: 100%; }
    }
    """

    def __init__(self, groups: Sequence[tuple[str, list[KeyRow]]], *, keymap_file: str) -> None:
        super().__init__()
        self.groups = groups
        self.keymap_file = keymap_file

    def compose(self) -> ComposeResult:
        with VerticalScroll() as box:
            box.border_title = "Keys"
            box.border_subtitle = "esc ? F1 close"
            yield Static(self._body())

    def _body(self) -> Group:
        parts: list[Table | Text] = []
        for title, rows in self.groups:
            table = Table(title=title, title_justify="left", title_style="bold", box=None, padding=(0, 2, 0, 0))
            table.add_column("key", style="bold", no_wrap=True)
            table.add_column("does")
            table.add_column("id (keymap.toml)", style="dim", no_wrap=True)
            for row in rows:
                table.add_row(*row)
            parts.append(table)
        parts.append(Text(f'\nRebind by id in {self.keymap_file}:  [keys]  "app.quit" = "ctrl+q"', style="dim"))
        return Group(*parts)

    def action_close(self) -> None:
        self.dismiss(None)
