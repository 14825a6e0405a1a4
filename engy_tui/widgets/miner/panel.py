"""The miner tab's widget: it lays the blocks out and turns their lines into content, and skips the
repaint when the view did not change.

It is handed the node's typed states (`NodeStates`) with the render time through
`update_state` by the app's fixed-rate render timer, with node info's `hotkeys` and the last
few model-server log lines the app kept from the events it drains; it never polls, reads the
clock or reads events itself, and decides nothing a line says (the block modules do, tested
without a terminal).

One miner gets the full layout (model server and proofs side by side, gateway link and chain
under them); several (a local network runs miner-1 and miner-2 in one process) get one compact
box each, and the node's proofs once under them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_node.snapshots import NodeStates
from engy_tui.widgets.cells import Cell
from engy_tui.widgets.miner.common import SEP, Line, lines_content
from engy_tui.widgets.miner.view import MinerView, PanelView, panel_view
from engy_tui.widgets.validator.panel import SIDE_BY_SIDE_FROM

__all__ = [
    "MinerPanel",
]


def _title(text: str) -> Content:
    return Content(text)  # not markup: a model name or URL with "[" must show as it is


def _frame(widget: Widget, level: str) -> None:
    for name in ("error", "warning", "na"):
        widget.set_class(level == name, f"-{name}")


def _show(static: Static, lines: Sequence[Sequence[Cell]]) -> None:
    static.update(lines_content(lines))
    static.display = bool(lines)


class _FullBlock(Vertical):
    """One miner, the full layout: model server | proofs, gateway link | chain."""

    def __init__(self, view: MinerView, proofs: tuple[Line, ...]) -> None:
        super().__init__(classes="miner-block")
        self._view, self._proofs = view, proofs
        self._composed = False

    def compose(self) -> ComposeResult:
        with Horizontal(classes="row"):
            with Vertical(classes="box main server"):
                yield Static(classes="cmd line")
                yield Static(classes="plan line")
                yield Static(classes="load line")
                yield Static(classes="failure")
                yield Static(classes="log line")
            yield Static(classes="box side proofs")
        with Horizontal(classes="row"):
            with Vertical(classes="box main link"):
                yield Static(classes="link-lines")
                yield Static(classes="link-notes")
            yield Static(classes="box side chain")

    def on_mount(self) -> None:
        self._composed = True
        self.show(self._view, self._proofs)

    def show(self, view: MinerView, proofs: tuple[Line, ...]) -> None:
        self._view, self._proofs = view, proofs
        if not self._composed:
            return  # on_mount shows it
        server = self.query_one(".server", Vertical)
        server.border_title = _title(f"Model server · {view.server_title}")
        _frame(server, view.server_level)
        _show(self.query_one(".cmd", Static), [view.command])
        _show(self.query_one(".plan", Static), [view.plan] if view.plan else [])
        _show(self.query_one(".load", Static), [view.load])
        _show(self.query_one(".failure", Static), view.failure)
        _show(self.query_one(".log", Static), view.log)
        side = (*view.proofs, *proofs)
        box = self.query_one(".proofs", Static)
        box.border_title = _title("Proofs")
        _show(box, side)
        box.display = True
        # The side box stretches to the main box (height 100%); the main box is at least as
        # tall as the side box's lines, so neither is cut and both frames line up.
        server.styles.min_height = len(side) + 2
        link = self.query_one(".link", Vertical)
        link.border_title = _title(f"Gateway link · {view.link_title}")
        _frame(link, view.link_level)
        _show(self.query_one(".link-lines", Static), view.link)
        _show(self.query_one(".link-notes", Static), view.link_notes)
        chain = self.query_one(".chain", Static)
        chain.border_title = _title(f"Chain · {view.chain_title}")
        _show(chain, view.chain)
        chain.display = True
        link.styles.min_height = len(view.chain) + 2


class _CompactBlock(Vertical):
    """One miner of several: one box, a line each for its command, load, link, what it served
    and had audited, chain and log, then what is wrong and its fix."""

    def __init__(self, view: MinerView) -> None:
        super().__init__(classes="box miner-compact")
        self._view = view
        self._composed = False

    def compose(self) -> ComposeResult:
        yield Static(classes="lines line")
        yield Static(classes="notes")

    def on_mount(self) -> None:
        self._composed = True
        self.show(self._view)

    def show(self, view: MinerView) -> None:
        self._view = view
        if not self._composed:
            return  # on_mount shows it
        self.border_title = _title(f"{view.name} · {view.server_title}")
        level = (
            "error"
            if "error" in (view.server_level, view.link_level)
            else ("warning" if "warning" in (view.server_level, view.link_level) else view.server_level)
        )
        _frame(self, level)
        chain: list[Cell] = [Cell("chain: ", "header")]
        for index, line in enumerate(view.chain):
            chain += [*([Cell(SEP)] if index and not line[0].text.startswith("  →") else []), *line]
        work = [(Cell("work: ", "header"), *view.work_summary)] if view.work_summary else []
        lines = [
            view.command,
            view.load,
            (Cell("gateway: ", "header"), *view.link_summary),
            *work,
            tuple(chain),
            *view.log,
        ]
        _show(self.query_one(".lines", Static), lines)
        _show(self.query_one(".notes", Static), (*view.failure, *view.link_notes))


_BOX_CSS = """
        border: round $primary;
        border-title-color: $text-primary;
        border-title-style: bold;
        padding: 0 1;
        height: auto;
"""


class MinerPanel(Widget):
    """The miners of this node: call `update_state(states, now=..., names=..., server_log=...)`
    with each hub snapshot. One miner gets model server | proofs over gateway link | chain;
    several get a compact box each and the node's proofs once."""

    DEFAULT_CSS = f"""
    MinerPanel {{
        height: auto;
    }}
    MinerPanel .miner-block, MinerPanel #miner-blocks {{
        height: auto;
    }}
    MinerPanel .row {{
        height: auto;
    }}
    MinerPanel .box {{{_BOX_CSS}}}
    MinerPanel .main {{
        width: 3fr;
    }}
    MinerPanel .side {{
        width: 2fr;
        height: 100%;
    }}
    MinerPanel .line, MinerPanel .side, MinerPanel #miner-proofs {{
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }}
    MinerPanel.-stacked .row {{
        layout: vertical;
    }}
    MinerPanel.-stacked .main, MinerPanel.-stacked .side {{
        width: 1fr;
        height: auto;
    }}
    MinerPanel.-stacked .miner-compact > .lines, MinerPanel.-stacked .plan {{
        text-wrap: wrap;
    }}
    MinerPanel .box.-warning {{
        border: round $warning;
    }}
    MinerPanel .box.-error {{
        border: round $error;
    }}
    MinerPanel .box.-na {{
        border: round $foreground-muted;
    }}
    MinerPanel #miner-empty {{
        color: $foreground-muted;
        padding: 0 1;
    }}
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._shown: PanelView | None = None
        self._layout: tuple[str, tuple[str, ...]] | None = None
        self._blocks: list[_FullBlock | _CompactBlock] = []

    def compose(self) -> ComposeResult:
        yield Static(id="miner-empty")
        yield Vertical(id="miner-blocks")
        yield Static(id="miner-proofs", classes="box")

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def on_resize(self, event: events.Resize) -> None:
        # Narrow: the boxes stack and a miner's lines wrap, rather than cut what it served.
        self.set_class(event.size.width < SIDE_BY_SIDE_FROM, "-stacked")

    def update_state(
        self,
        states: NodeStates | None,
        *,
        now: float,
        names: Mapping[str, str] | None = None,
        server_log: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Show the node's states (None: no snapshot yet) as of wall-clock `now`; `names` is node
        info's `hotkeys` {name: ss58}; `server_log` the newest model-server log lines by
        component ("model_server", "model_server.miner-1", …) that the app kept."""
        view = panel_view(states, now=now, names=names, server_log=server_log)
        if view == self._shown:
            return
        self._shown = view
        empty = self.query_one("#miner-empty", Static)
        _show(empty, [view.empty] if view.empty else [])
        blocks = self.query_one("#miner-blocks", Vertical)
        layout = (view.mode, tuple(m.name for m in view.miners))
        if layout != self._layout:
            # Another miner, or one more: new blocks (each shows its view once mounted).
            self._layout = layout
            blocks.remove_children()
            if view.mode == "full":
                self._blocks = [_FullBlock(view.miners[0], view.proofs)]
            else:
                self._blocks = [_CompactBlock(miner) for miner in view.miners]
            if self._blocks:
                blocks.mount_all(self._blocks)
        else:
            for block, miner in zip(self._blocks, view.miners):
                if isinstance(block, _FullBlock):
                    block.show(miner, view.proofs)
                else:
                    block.show(miner)
        proofs = self.query_one("#miner-proofs", Static)
        proofs.border_title = _title("Proofs on this node")
        _show(proofs, view.proofs if view.mode == "compact" else [])
