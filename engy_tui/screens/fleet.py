"""The fleet view (`engy-tui --fleet fleet.toml`): every node of a fleet file on one screen, a row
per node and a row per GPU under it, and Enter on a row opens that node's usual tabs; Esc there
comes back.

What a row says is decided by `fleet_rows`, a plain function over the watcher's `NodeWatch`es
and the render time, tested without a terminal; the screen copies its rows into a table at
`RENDER_INTERVAL_S`, so how many nodes answer, and how often, never decides the redraw rate.
Each figure comes from the same state or metric the node's own tabs read it from (the requests
panel's `latency_of` and `counters_of`, the gateway's lifetime tallies, the chain's neurons,
the alert task's firing list), so the fleet and a drilled-in tab never disagree.

Honesty rules, as on every panel: a figure a node does not report is "—", never 0; an
unreachable node's row says why, when it is tried again, and greys what it last said; colour is
never the only signal (● ✔ ⚠ ✘ and words carry it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from engy_node.snapshots import STATE_SCHEMA, GpuSample, NodeStates
from engy_tui.fleet_bridge import FleetBridge, NodeWatch
from engy_tui.manager import RENDER_INTERVAL_S, NodeManager
from engy_tui.widgets.cells import DASH, Cell, format_duration
from engy_tui.widgets.requests_panel import TPOT_METRIC, TTFT_METRIC, counters_of, latency_of
from engy_tui.widgets.server_panel import format_ms

COLUMNS = ("node", "roles", "state", "served", "pass", "TTFT p99", "TPOT p99", "incentive", "alerts", "note")
NOTE_CHARS = 60
"""The note column's width; the line under the table has the selected row's whole text."""
STYLES = {"ok": "green", "warning": "yellow", "error": "bold red", "na": "dim", "name": "bold", "": ""}
GIB = 1024**3
FLEET_SCREEN = "fleet"
NODE_ACTIONS = frozenset(
    {"show_tab", "toggle_traffic", "restart_model_server", "copy_command", "diagnostics", "back_to_fleet"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class FleetRow:
    key: str
    """Unique in the table: the node's name, or `name/gpu<index>`."""
    node: str
    tab: str
    """The node manager's tab Enter opens: the GPUs tab for a GPU's row."""
    cells: tuple[Cell, ...]
    detail: str
    """Everything the row stands for, shown under the table while it is selected."""


def fleet_rows(watches: Iterable[NodeWatch], *, now: float) -> list[FleetRow]:
    """The table: each node's row, then one row per GPU it reports."""
    rows: list[FleetRow] = []
    for watch in watches:
        rows.append(node_row(watch, now=now))
        if watch.snapshot is not None and watch.snapshot.states.gpus is not None:
            rows.extend(gpu_row(watch, sample, up=watch.up) for sample in watch.snapshot.states.gpus.samples)
    return rows


def node_row(watch: NodeWatch, *, now: float) -> FleetRow:
    name = watch.node.name
    snapshot = watch.snapshot
    if snapshot is None:
        roles = Cell(DASH, "na")
        figures: tuple[Cell, ...] = tuple(Cell(DASH, "na") for _ in range(5))
    else:
        roles = Cell(", ".join(snapshot.node.roles) or DASH, "" if snapshot.node.roles else "na")
        figures = _figures(snapshot.states, snapshot.metrics)
    if watch.up:
        state = Cell("● up", "ok")
        alerts = _alerts_cells(snapshot.states if snapshot is not None else None)
        detail = f"{name} · {watch.node.via} · " + (_alert_texts(snapshot.states) if snapshot else "")
        if snapshot is not None and snapshot.newer_schema:
            newer = f"⚠ its state schema {snapshot.schema} is newer than this TUI's {STATE_SCHEMA}: upgrade engy-tui"
            alerts = (alerts[0], alerts[1] if alerts[1].text else Cell(_clip(newer), "warning"))
            detail += f" · {newer} (some figures may be missing)"
    elif watch.error is None:
        state = Cell("… connecting", "na")
        alerts = (Cell(DASH, "na"), Cell(f"dialling {watch.node.via}", "na"))
        detail = f"{name} · {watch.node.via} · no answer yet"
    else:
        retry = "" if watch.retry_at is None else f", retry in {format_duration(max(0.0, watch.retry_at - now))}"
        state = Cell(f"✘ unreachable{retry}", "error")
        alerts = (Cell(DASH, "na"), Cell(_clip(watch.error), "error"))
        figures = tuple(Cell(cell.text, "na") for cell in figures)  # what it last said, greyed
        seen = ""
        if snapshot is not None:
            seen = f" · last answered {format_duration(max(0.0, now - snapshot.taken_at))} ago"
        detail = f"{name} · {watch.node.via} · {watch.failures} failed attempt(s){seen} · {watch.error}"
    return FleetRow(name, name, "overview", (Cell(name, "name"), roles, state, *figures, *alerts), detail)


def gpu_row(watch: NodeWatch, sample: GpuSample, *, up: bool) -> FleetRow:
    """One GPU: its model, temperature, use and memory in the state column; its findings."""
    name = watch.node.name
    states = watch.snapshot.states if watch.snapshot is not None else NodeStates()
    findings = [f for f in (states.gpus.findings if states.gpus else ()) if f.gpu == sample.index]
    if sample.lost:
        state = Cell("✘ lost", "error")
    else:
        parts = [
            f"{sample.temperature_c}°C" if sample.temperature_c is not None else None,
            f"{sample.gpu_util_percent}%" if sample.gpu_util_percent is not None else None,
            _memory(sample),
        ]
        state = Cell(" · ".join(p for p in parts if p) or DASH, "" if up else "na")
    if findings:
        worst = "error" if any(f.level == "error" for f in findings) else "warning"
        alerts = Cell(f"{'✘' if worst == 'error' else '⚠'} {len(findings)}", worst)
        note = Cell(_clip(findings[0].text), worst)
    else:
        alerts, note = Cell("none ✔", "ok" if up else "na"), Cell("")
    blank = tuple(Cell("") for _ in range(5))
    detail = f"{name} GPU {sample.index} {sample.name or ''}: " + (
        " · ".join(f.text for f in findings) or "no findings"
    )
    return FleetRow(
        f"{name}/gpu{sample.index}",
        name,
        "gpus",
        (
            Cell(f"  └ GPU {sample.index}"),
            Cell(sample.name or DASH, "" if sample.name else "na"),
            state,
            *blank,
            alerts,
            note,
        ),
        detail,
    )


def _memory(sample: GpuSample) -> str | None:
    if sample.memory_used_bytes is None or sample.memory_total_bytes is None:
        return None
    return f"{sample.memory_used_bytes / GIB:.1f}/{sample.memory_total_bytes / GIB:.1f} GB"


def _figures(states: NodeStates, metrics: object) -> tuple[Cell, ...]:
    """served, pass, TTFT p99, TPOT p99, incentive."""
    served, judged = _served_and_verdicts(states, metrics)
    if judged is None:
        pass_rate = Cell(DASH, "na")
    elif judged[1] == 0:
        pass_rate = Cell("0 judged", "na")
    else:
        passed, total = judged
        pass_rate = Cell(f"{100 * passed / total:.1f}%", "ok" if passed == total else "warning")
    latencies = []
    for metric in (TTFT_METRIC, TPOT_METRIC):
        latency = latency_of(metrics, metric)
        if latency is None or latency.p99 is None:
            latencies.append(Cell(DASH, "na"))
        else:
            latencies.append(Cell(("≤" if latency.upper_bound else "") + format_ms(latency.p99)))
    return (
        Cell(DASH, "na") if served is None else Cell(f"{served:,}"),
        pass_rate,
        *latencies,
        _incentive(states),
    )


def _served_and_verdicts(states: NodeStates, metrics: object) -> tuple[int | None, tuple[int, int] | None]:
    """What the node served, and (passed, judged) of its proofs: a gateway's lifetime tallies over
    its miners (what it billed and audited); else a miner's own ok requests, and a verifier's
    verdicts. None where the node has no such figure."""
    if states.traffic is not None:
        lifetimes = [worker.lifetime for worker in states.traffic.workers if worker.lifetime is not None]
        passed = sum(life.passed for life in lifetimes)
        judged = sum(life.passed + life.cheat + life.unproven for life in lifetimes)
        return sum(life.served for life in lifetimes), (passed, judged)
    served = None
    if states.miners:
        counters = counters_of(metrics)
        if counters.requests is not None:
            served = int(counters.requests - (counters.errors or 0))
    verdicts = None
    if states.verifier is not None:
        verdicts = (states.verifier.verdicts.passed, states.verifier.verdicts.total)
    return served, verdicts


def _incentive(states: NodeStates) -> Cell:
    """The chain's incentive of this node's miners (summed over them); — without a chain state."""
    hotkeys = {miner.hotkey for miner in states.miners.values() if miner.hotkey}
    if not hotkeys or states.chain is None:
        return Cell(DASH, "na")
    values = [n.incentive for n in states.chain.neurons if n.hotkey in hotkeys and n.incentive is not None]
    if not values:
        return Cell("not registered", "warning")
    total = sum(values)
    return Cell(f"{total:.4f}", "ok" if total > 0 else "warning")


def _alerts_cells(states: NodeStates | None) -> tuple[Cell, Cell]:
    """(count with its worst level, the first alert's text)."""
    alerts = states.alerts if states is not None else None
    if alerts is None:
        return Cell(DASH, "na"), Cell("")
    if not alerts.firing:
        return Cell("none ✔", "ok"), Cell("")
    worst = "error" if any(alert.level == "error" for alert in alerts.firing) else "warning"
    first = alerts.firing[0]
    return (
        Cell(f"{'✘' if worst == 'error' else '⚠'} {len(alerts.firing)}", worst),
        Cell(_clip(f"{first.subject}: {first.text}" if first.subject else first.text), worst),
    )


def _alert_texts(states: NodeStates) -> str:
    if states.alerts is None:
        return "runs no alert task"
    if not states.alerts.firing:
        return "no alert firing"
    return " · ".join(f"{alert.subject}: {alert.text}" for alert in states.alerts.firing)


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= NOTE_CHARS else line[: NOTE_CHARS - 1] + "…"


def row_texts(row: FleetRow) -> list[Text]:
    return [Text(cell.text, style=STYLES.get(cell.style, "")) for cell in row.cells]


class FleetScreen(Screen[None]):
    """The fleet's table; Enter opens the selected node's tabs (`FleetManager.open_node`)."""

    DEFAULT_CSS = """
    FleetScreen > DataTable {
        height: 1fr;
    }
    FleetScreen > #fleet-header, FleetScreen > #fleet-detail {
        height: auto;
        padding: 0 1;
    }
    """
    BINDINGS = [
        Binding("enter", "open_row", "Open node", id="fleet.open", tooltip="Show the selected node's tabs."),
    ]

    def __init__(self, fleet: FleetBridge, *, clock: Callable[[], float] = time.time, source: str = "") -> None:
        super().__init__()
        self.fleet = fleet
        self.clock = clock
        self.source = source
        """The fleet file, for the header."""
        self._rows: list[FleetRow] = []

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-header")
        table: DataTable[Text] = DataTable(cursor_type="row", zebra_stripes=True, id="fleet-table")
        yield table
        yield Static(id="fleet-detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for column in COLUMNS:
            table.add_column(column, key=column)
        self.render_rows()
        self.set_interval(RENDER_INTERVAL_S, self.render_rows)
        table.focus()

    def render_rows(self) -> None:
        watches = list(self.fleet.watches.values())
        rows = fleet_rows(watches, now=self.clock())
        table = self.query_one(DataTable)
        keys = [row.key for row in rows]
        if keys != [row.key for row in self._rows]:
            selected = self.selected
            table.clear()
            for row in rows:
                table.add_row(*row_texts(row), key=row.key)
            if selected is not None and selected.key in keys:
                table.move_cursor(row=keys.index(selected.key))
        else:
            for row, old in zip(rows, self._rows, strict=True):
                if row.cells != old.cells:
                    for column, text in zip(COLUMNS, row_texts(row), strict=True):
                        table.update_cell(row.key, column, text)
        self._rows = rows
        up = sum(watch.up for watch in watches)
        header = Text()
        header.append("engy-tui fleet", style="bold")
        header.append(f"  {self.source} · {len(watches)} nodes · ")
        header.append(f"{up} up", style="green" if up else "")
        if up < len(watches):
            header.append(f" · ✘ {len(watches) - up} not answering", style="bold red")
        header.append("   enter: open a node's tabs · esc there: back here · q: quit", style="dim")
        self.query_one("#fleet-header", Static).update(header)
        self._show_detail()

    @property
    def selected(self) -> FleetRow | None:
        table = self.query_one(DataTable)
        if not self._rows or not 0 <= table.cursor_row < len(self._rows):
            return None
        return self._rows[table.cursor_row]

    def _show_detail(self) -> None:
        row = self.selected
        self.query_one("#fleet-detail", Static).update(Text(row.detail if row is not None else ""))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open_row()

    def action_open_row(self) -> None:
        row = self.selected
        if row is not None and isinstance(self.app, FleetManager):
            self.app.run_worker(self.app.open_node(row.node, tab=row.tab), exclusive=True)


class FleetCommands(Provider):
    """The palette's fleet entries: open any node's tabs by name, and go back to the fleet."""

    async def startup(self) -> None:
        app = self.app
        self.entries: list[tuple[str, str, Callable[[], Awaitable[None]]]] = []
        if not isinstance(app, FleetManager):
            return
        for name, watch in app.fleet.watches.items():
            state = "up" if watch.up else (watch.error or "not answered yet")
            self.entries.append((f"Open node {name}", f"{watch.node.via} · {state}", partial(app.open_node, name)))
        if app.opened is not None:
            self.entries.append(("Back to the fleet", "every node on one screen (esc)", app.action_back_to_fleet))

    async def discover(self) -> Hits:
        for title, help_text, run in self.entries:
            yield DiscoveryHit(title, run, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, run in self.entries:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), run, help=help_text)


class FleetManager(NodeManager):
    """The node manager over a fleet: the fleet screen on top, a node's tabs under it while one
    is open. Esc on the tabs goes back to the fleet."""

    COMMANDS = NodeManager.COMMANDS | {FleetCommands}
    BINDINGS = [
        *NodeManager.BINDINGS,
        Binding("escape", "back_to_fleet", "Fleet", id="fleet.back", tooltip="Back to the fleet view."),
    ]

    def __init__(
        self,
        fleet: FleetBridge,
        *,
        source: str = "",
        dial: bool = True,
        clock: Callable[[], float] = time.time,
        home: str | None = None,
        keymap: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(None, clock=clock, home=home, keymap=keymap)
        self.fleet = fleet
        self.source = source
        self.dial = dial
        """False: show `fleet.watches` as they are (snapshot tests), dialling nothing."""
        self.opened: str | None = None
        """The node whose tabs show, or None while the fleet shows."""

    def on_mount(self) -> None:
        # NodeManager.on_mount runs too (Textual calls each class's handler): the fleet screen
        # goes on top once it has drawn the empty tabs.
        if self.dial:
            self.fleet.start(on_crash=self._fleet_crashed)
        self.call_later(self._show_fleet)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A node's keys (tabs, restart, traffic, diagnostics) work while its tabs show, not over
        the fleet; quit, the keys panel and the palette work everywhere."""
        if self.opened is None and action in NODE_ACTIONS:
            return False
        return super().check_action(action, parameters)

    def _show_fleet(self) -> None:
        self.sub_title = self.source
        # Installed, so that it outlives each drill-in: back from a node, its cursor is where it was.
        if not self.is_screen_installed(FLEET_SCREEN):
            self.install_screen(FleetScreen(self.fleet, clock=self.clock, source=self.source), FLEET_SCREEN)
        self.push_screen(FLEET_SCREEN)

    async def open_node(self, name: str, *, tab: str = "overview") -> None:
        """Show `name`'s tabs, or say why they cannot show (it does not answer)."""
        bridge = self.fleet.hosted_bridge(name)
        if bridge is None:
            error = self.fleet.watches[name].error or "it has not answered yet"
            self.notify(f"{name} does not answer: {error}", title="fleet", severity="warning")
            return
        if self.opened is None:
            await self.pop_screen()  # the fleet's screen; from the palette a node's tabs may show instead
        self.opened = name
        await self.show_node(bridge)
        self.sub_title = f"{name} · {bridge.url}"
        self.action_show_tab(tab)

    async def action_back_to_fleet(self) -> None:
        if self.opened is None:
            return
        self.opened = None
        await self.show_node(None)
        self._show_fleet()

    async def on_unmount(self) -> None:
        # NodeManager.on_unmount then stops the node bridge, already ended with the fleet's run.
        await self.fleet.stop()

    def _fleet_crashed(self, error: BaseException) -> None:
        self.exit(
            return_code=1,
            message=f"engy-tui: the fleet watcher stopped unexpectedly ({type(error).__name__}: "
            f"{error}). This is a bug; please report it with this message.",
        )
