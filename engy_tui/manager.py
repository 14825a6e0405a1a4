"""The node manager: every role's state from one node, attached over its control API or run
inside this process (docs/architecture.md, "The TUI").

Data flows one way. `NodeBridge` (trio, guest mode) keeps the newest `NodeSnapshot` and the
events since the last frame; a timer here copies them into the widgets at `RENDER_INTERVAL_S`,
never once per event, so how fast the node talks never decides how often the screen redraws.
What each panel says is decided by plain functions (`header_text`, `engy_node.local.status`,
the widgets' own formatters), tested without a terminal; the app only routes snapshots.

The overview says exactly what `engy-node status` prints for the same node — the TUI is a view
plus actions over the control API, and everything it shows the CLI can show too.

Quitting stops the bridge first: attached, that ends the polling; local, it cancels the node's
root scope, so its services stop (model servers, the chain saved) before the asyncio loop ends.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Footer, Static, TabbedContent, TabPane, Tabs

from engy_node.config import resolve_paths
from engy_node.durations import duration_text
from engy_node.errors import EngyError
from engy_node.local.status import status_text
from engy_node.node import freeze_startup_objects
from engy_node.setup import SetupAnswers, commands
from engy_node.snapshots import STATE_SCHEMA, NodeStates, is_miner
from engy_tui.commands import CommandSpec, NodeCommands, command_specs
from engy_tui.node_bridge import NodeBridge, NodeSnapshot
from engy_tui.screens.keys import KeysScreen, key_groups
from engy_tui.screens.setup import SetupCommand, open_setup, tilde
from engy_tui.screens.start import ConfirmStart
from engy_tui.widgets.gateway_panel import GatewayPanel
from engy_tui.widgets.gpu_panel import GpuPanel
from engy_tui.widgets.logs import LogsView
from engy_tui.widgets.miner import MinerPanel
from engy_tui.widgets.requests_panel import RequestsPanel
from engy_tui.widgets.validator import ChainPanel, ValidatorPanel

RENDER_INTERVAL_S = 0.5
SERVER_LOG_LINES = 5
AGES_REFRESH_S = 2.0
"""An unchanged node's visible tab is redrawn this often, so ages ("12 s ago") keep moving."""
STALE_AFTER_S = 5.0
FOOTER_ALL_KEYS_FROM = 160
"""Narrower than this, the Logs tab's footer (its own keys first) is compact and leaves out the
app's `FOOTER_SPARE` keys, which still work and which the keys panel (?) and the palette list."""
FOOTER_SPARE = ("app.traffic", "app.restart_server", "app.copy_command", "app.diagnostics")


HEADER_DROPS = ("up", "epoch", "network")
"""What the header leaves out on a narrow terminal, first to last, after folding a local
network's miners into "N miners": the Overview shows the uptime, the Validator tab the epoch."""


def roles_text(roles: Sequence[str], *, fold_miners: bool = False) -> str:
    """The node's roles; `fold_miners`: a local network's miner-1, miner-2 … as "2 miners"."""
    miners = [role for role in roles if is_miner(role)]
    if not fold_miners or len(miners) < 2:
        return ", ".join(roles) or "no roles"
    first = roles.index(miners[0])
    rest = [role for role in roles if not is_miner(role)]
    return ", ".join([*rest[:first], f"{len(miners)} miners", *rest[first:]])


def header_text(snapshot: NodeSnapshot | None, *, mode: str, now: float, width: int | None = None) -> Text:
    """The one line that says what this node is and whether it is well: roles, network, block,
    epoch, uptime and a state word (never colour alone). Given the `width` it has, it folds the
    miners and leaves out `HEADER_DROPS` until it fits on one line; the state word always stays."""
    text = Text()
    text.append("engy-tui", style="bold")
    if snapshot is None:
        text.append(f"  {mode} · waiting for the node's first snapshot…", style="dim")
        return text
    node, states = snapshot.node, snapshot.states
    parts = {"network": node.network or None}
    block = states.chain.block if states.chain is not None else None
    if block is None and states.validator is not None:
        block = states.validator.block
    parts["block"] = None if block is None else f"block {block:,}"
    latest = states.epochs.latest if states.epochs is not None else None
    parts["epoch"] = None if latest is None else f"epoch {latest}"
    parts["up"] = None if node.started_at is None else f"up {duration_text(now - node.started_at)}"
    age = now - snapshot.taken_at
    word = Text()
    if not snapshot.connected:
        word.append(f"   ✘ {snapshot.error or 'not connected'}", style="bold red")
    elif age > STALE_AFTER_S:
        word.append(f"   ⚠ stale {duration_text(age)}", style="yellow")
    else:
        word.append(f"   ● {mode}", style="green")
    tries = [(False, ())] + [(True, HEADER_DROPS[:n]) for n in range(len(HEADER_DROPS) + 1)]
    for fold, dropped in tries:
        shown = [roles_text(node.roles, fold_miners=fold)]
        shown += [value for name, value in parts.items() if value and name not in dropped]
        line = "  " + " · ".join(shown)
        if width is None or text.cell_len + cell_len(line) + word.cell_len <= width:
            break
    text.append(line)
    text.append_text(word)
    if snapshot.newer_schema:
        text.append(
            f"   ⚠ the node's state schema {snapshot.schema} is newer than this TUI's {STATE_SCHEMA}: "
            "upgrade engy-tui (some figures may be missing)",
            style="yellow",
        )
    return text


def overview_text(snapshot: NodeSnapshot | None, *, now: float) -> str:
    if snapshot is None:
        return "Waiting for the node…"
    return status_text(snapshot.node, snapshot.states, now=now)


class NodeManager(App[None]):
    """One node's dashboards: overview, GPUs and logs, fed by a `NodeBridge`.

    The tabs carry their number keys in their labels, not in the footer: the footer then keeps
    room for the actions and, on the Logs tab, the log's own keys at 160 columns."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "engy-tui"
    COMMANDS = App.COMMANDS | {NodeCommands, SetupCommand}
    BINDINGS = [
        Binding("q", "quit", "Quit", id="app.quit", tooltip="Leave engy-tui (a local network stops with it)."),
        Binding("question_mark,f1", "show_keys", "Keys", id="app.keys", tooltip="List every key and its keymap id."),
        Binding("1", "show_tab('overview')", "Overview", id="app.tab.overview", show=False),
        Binding("2", "show_tab('miner')", "Miner", id="app.tab.miner", show=False),
        Binding("3", "show_tab('validator')", "Validator", id="app.tab.validator", show=False),
        Binding("4", "show_tab('gateway')", "Gateway", id="app.tab.gateway", show=False),
        Binding("5", "show_tab('chain')", "Chain", id="app.tab.chain", show=False),
        Binding("6", "show_tab('gpus')", "GPUs", id="app.tab.gpus", show=False),
        Binding("7", "show_tab('logs')", "Logs", id="app.tab.logs", show=False),
        Binding("p", "toggle_traffic", "Traffic on/off", id="app.traffic", tooltip="Pause or resume the demo traffic."),
        Binding(
            "r",
            "restart_model_server",
            "Restart server",
            id="app.restart_server",
            tooltip="Restart the model server (the first, on a node with several; the palette has each).",
        ),
        Binding(
            "c",
            "copy_command",
            "Copy command",
            id="app.copy_command",
            tooltip="Copy the model server's launch command.",
        ),
        Binding(
            "d",
            "diagnostics",
            "Diagnostics",
            id="app.diagnostics",
            tooltip="Write a diagnostics bundle (.tar.gz) to the current directory, as engy-node diagnose does.",
        ),
    ]

    def __init__(
        self,
        bridge: NodeBridge | None,
        *,
        clock: Callable[[], float] = time.time,
        home: str | None = None,
        keymap: Mapping[str, str] | None = None,
        setup_first: bool = False,
        start_after_setup: Callable[[str | None, str], NodeBridge] | None = None,
        fake_gpus: str = "",
    ) -> None:
        super().__init__()
        self.setup_first = setup_first
        self.start_after_setup = start_after_setup
        """With `setup_first`: builds the node the wizard configured, which runs here once the
        user says Start."""
        self.fake_gpus = fake_gpus
        """With `setup_first`: the wizard plans for these simulated GPUs (`--fake-gpus`), and
        nothing is started."""
        self.bridge = bridge
        self.clock = clock
        self.home = home
        self.user_keymap = dict(keymap or {})
        self._traffic_paused = False
        self._missed_seen = 0
        self._frozen = False
        self._shown: NodeSnapshot | None = None
        self._drawn_at: dict[str, float] = {}
        """When each tab was last drawn from `_shown`; a change of state clears it."""
        self._narrow_footer = False
        """Whether the footer is fitted to a narrow Logs tab (`_fit_footer`)."""
        self._server_log: dict[str, collections.deque[str]] = {}
        """The last lines of each model server's output, from the events, for the miner tab."""
        self.farewell: str | None = None
        """What to print after the app has quit (what was done, what to run next), or None."""
        self._render_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="node-header")
        with TabbedContent(initial="overview"):
            with TabPane("1 Overview", id="overview"):
                yield RequestsPanel()
                yield Static(id="overview-text")
            with TabPane("2 Miner", id="miner"):
                yield MinerPanel()
            with TabPane("3 Validator", id="validator"):
                yield ValidatorPanel()
            with TabPane("4 Gateway", id="gateway"):
                yield GatewayPanel()
            with TabPane("5 Chain", id="chain"):
                yield ChainPanel()
            with TabPane("6 GPUs", id="gpus"):
                yield GpuPanel()
            with TabPane("7 Logs", id="logs"):
                yield LogsView(id="logs-view", min_level="info")
        yield Footer()

    def on_mount(self) -> None:
        if self.user_keymap:
            self.set_keymap(self.user_keymap)
        self.show_snapshot(None, events=[])
        if self.bridge is not None:
            self._start_bridge(self.bridge)
        if self.setup_first:
            self.run_worker(
                open_setup(self, home=self.home, on_done=self._setup_done, fake_gpus=self.fake_gpus), exclusive=True
            )

    def _start_bridge(self, bridge: NodeBridge) -> None:
        self.bridge = bridge
        self.sub_title = bridge.url or "this node"
        bridge.start(on_crash=self._bridge_crashed)
        if self._render_timer is None:
            self._render_timer = self.set_interval(RENDER_INTERVAL_S, self.render_frame)

    async def show_node(self, bridge: NodeBridge | None) -> None:
        """Show another node in this one's place (the fleet view's drill-in, and back to it): stop
        the bridge shown now, forget all it showed (the tabs are rebuilt, so its log lines go
        too), and start `bridge` (None: show none). Call it while the tabs' screen is on top."""
        await self._stop_bridge()
        self.bridge = None
        self._traffic_paused, self._missed_seen = False, 0
        self._shown = None
        self._drawn_at.clear()
        self._server_log.clear()
        await self.recompose()
        self.show_snapshot(None, events=[])
        if bridge is not None:
            self._start_bridge(bridge)

    def _setup_done(self, answers: SetupAnswers | None) -> None:
        """The first-run wizard closed. Written: say what would start and where it connects, and
        ask (`ConfirmStart`). Left with Esc: nothing else is open, so quit saying so, rather than
        leave an empty "Waiting for the node…" behind."""
        if answers is None:
            self._quit_saying(
                "engy-tui: setup closed without writing node.toml; nothing was started. "
                "Run `engy-tui --setup` again when ready, or `engy-tui --local` to try a local network first."
            )
            return
        config_file = tilde(resolve_paths(self.home, os.environ).config_file)
        confirm = ConfirmStart(
            answers,
            home=self.home,
            config_file=config_file,
            fake_gpus=self.fake_gpus,
            can_start=self.start_after_setup is not None,
        )
        self.push_screen(confirm, lambda start: self._start_confirmed(answers, bool(start)))

    def _start_confirmed(self, answers: SetupAnswers, start: bool) -> None:
        """Start the configured node here, or quit leaving the commands to run later."""
        if not start or self.start_after_setup is None:
            later = "\n".join(f"  $ {line}" for line in commands(answers, home=self.home))
            self._quit_saying(f"engy-tui: node.toml is written; nothing was started. When ready, run:\n{later}")
            return
        try:
            bridge = self.start_after_setup(self.home, answers.role)
        except EngyError as err:
            self._quit_saying(
                f"engy-tui: node.toml is written, but the node cannot start yet: {err}", return_code=err.exit_code
            )
            return
        self.notify(f"starting the {answers.role} node…", title="setup")
        self._start_bridge(bridge)

    def _quit_saying(self, message: str, *, return_code: int = 0) -> None:
        """Quit; `engy-tui` prints `message` once the terminal is back (`farewell`), as plain
        lines: Textual's exit message would wrap the commands in it mid-line."""
        self.farewell = message
        self.exit(return_code=return_code)

    def render_frame(self) -> None:
        if self.bridge is None:  # between nodes (`show_node(None)`)
            return
        if not self._frozen and self.bridge.ready:
            # Everything start-up made (the node's models and apps, Textual's widgets) lives as
            # long as the app: keep it out of full collections, which otherwise walked ~150,000
            # objects and stretched a frame past 50 ms (bench/tui_frames.py).
            freeze_startup_objects()
            self._frozen = True
        missed, self._missed_seen = self.bridge.missed_events - self._missed_seen, self.bridge.missed_events
        self.show_snapshot(self.bridge.latest, events=self.bridge.drain_events(), missed=missed)

    def show_snapshot(
        self, snapshot: NodeSnapshot | None, *, events: Sequence[dict[str, Any]], missed: int = 0
    ) -> None:
        """Display one frame (tests call this with fixed data and no bridge).

        Only the visible tab is drawn, and only when the node's state changed or its ages are due
        for a refresh: redrawing every panel from an unchanged snapshot twice a second was most
        of an idle TUI's CPU. The header (uptime, staleness) and the logs (new lines) update on
        every frame; a tab that becomes visible is drawn at once."""
        now = self.clock()
        mode = self.bridge.mode if self.bridge is not None else "snapshot"
        self.query_one("#node-header", Static).update(header_text(snapshot, mode=mode, now=now, width=self.size.width))
        for event in events:
            component = str(event.get("component", ""))
            if component.startswith("model_server"):
                self._server_log.setdefault(component, collections.deque(maxlen=SERVER_LOG_LINES)).append(
                    str(event.get("message", ""))
                )
        if events or missed:
            self.query_one(LogsView).append(events, missed=missed)
        changed = (
            snapshot is None
            or self._shown is None
            or (snapshot.states, snapshot.metrics, snapshot.node)
            != (self._shown.states, self._shown.metrics, self._shown.node)
        )
        self._shown = snapshot
        if changed:
            self._drawn_at.clear()
        active = self.query_one(TabbedContent).active
        if changed or now - self._drawn_at.get(active, float("-inf")) >= AGES_REFRESH_S:
            self._draw_tab(active, now)
        self._fit_footer()

    def _fit_footer(self) -> None:
        """At `FOOTER_ALL_KEYS_FROM` columns the footer holds every key of every tab; narrower,
        the Logs tab's keys, q and ? stay whole and the app's spare keys leave the footer."""
        narrow = self.query_one(TabbedContent).active == "logs" and self.size.width < FOOTER_ALL_KEYS_FROM
        if narrow == self._narrow_footer:
            return  # a wide terminal never gets here, so its footer is never recomposed
        self._narrow_footer = narrow
        self.query_one(Footer).compact = narrow
        for key, bindings in self._bindings.key_to_bindings.items():
            self._bindings.key_to_bindings[key] = [
                dataclasses.replace(binding, show=not narrow) if binding.id in FOOTER_SPARE else binding
                for binding in bindings
            ]
        self.refresh_bindings()

    def _draw_tab(self, tab: str, now: float) -> None:
        snapshot = self._shown
        names = (snapshot.node.hotkeys if snapshot is not None else None) or None
        if tab == "overview":
            self.query_one(RequestsPanel).update_metrics(
                snapshot.metrics if snapshot is not None else None,
                now=now,
                states=snapshot.states if snapshot is not None else None,
                roles=snapshot.node.roles if snapshot is not None else (),
            )
            self.query_one("#overview-text", Static).update(overview_text(snapshot, now=now))
        elif tab == "miner":
            self.query_one(MinerPanel).update_state(
                snapshot.states if snapshot is not None else None,
                now=now,
                names=names,
                server_log={name: list(lines) for name, lines in self._server_log.items()},
            )
        elif tab == "validator":
            self.query_one(ValidatorPanel).update_state(
                snapshot.states.validator if snapshot is not None else None,
                now=now,
                names=names,
                chain=snapshot.states.chain if snapshot is not None else None,
            )
        elif tab == "gateway":
            self.query_one(GatewayPanel).update_state(
                snapshot.states if snapshot is not None else None, now=now, names=names
            )
        elif tab == "chain":
            self.query_one(ChainPanel).update_state(
                snapshot.states.chain if snapshot is not None else None, now=now, names=names
            )
        elif tab == "gpus":
            self.query_one(GpuPanel).update_state(snapshot.states.gpus if snapshot is not None else None, now)
        self._drawn_at[tab] = now

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        tab = event.pane.id or ""
        if tab not in self._drawn_at:
            self._draw_tab(tab, self.clock())
        self._fit_footer()
        # The Logs tab's keys (/ f l c …) belong to its view: give it focus as it shows, and take
        # it back as another tab shows, so a hidden log never answers that tab's keys (c, r).
        event.tabbed_content.set_class(tab == "logs", "-fill")
        logs = self.query_one(LogsView)
        if tab == "logs":
            logs.take_focus()
        elif self.focused is not None and logs in self.focused.ancestors_with_self:
            event.tabbed_content.query_one(Tabs).focus()

    def action_show_keys(self) -> None:
        import os

        from engy_node.config import resolve_paths
        from engy_tui.screens.setup import tilde

        groups = [
            ("Everywhere", [*self.BINDINGS, Binding("ctrl+p", "command_palette", "Every command (palette)")]),
            ("Logs tab", LogsView.BINDINGS),
        ]
        bindings = [(title, [binding for binding in group if isinstance(binding, Binding)]) for title, group in groups]
        keymap_file = tilde(resolve_paths(self.home, os.environ).config_file.parent / "keymap.toml")
        self.push_screen(KeysScreen(key_groups(bindings, self.user_keymap), keymap_file=keymap_file))

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    async def action_toggle_traffic(self) -> None:
        if self.bridge is None:
            return
        action = "resume-traffic" if self._traffic_paused else "pause-traffic"
        try:
            await self.bridge.run_action(action)
        except EngyError as err:
            self.notify(str(err), title="traffic", severity="warning")
            return
        self._traffic_paused = not self._traffic_paused
        self.notify("demo traffic paused" if self._traffic_paused else "demo traffic resumed", title="traffic")

    # ---- commands: the palette and the bindings run the same specs ---------------------------

    async def palette_commands(self) -> list[CommandSpec]:
        if self.bridge is None:
            return command_specs([], NodeStates())
        try:
            actions = await self.bridge.list_actions()
        except EngyError as err:
            self.notify(str(err), title="commands", severity="warning")
            actions = []
        states = self.bridge.latest.states if self.bridge.latest is not None else NodeStates()
        return command_specs(actions, states)

    async def run_command(self, spec: CommandSpec) -> None:
        if spec.kind == "copy":
            self.copy_to_clipboard(spec.text or "")
            self.notify(spec.text or "", title="copied")
        elif spec.kind == "diagnose":
            await self._diagnostics()
        elif self.bridge is not None and spec.action_id is not None:
            self.notify(f"{spec.title}…", title="running")
            try:
                result = await self.bridge.run_action(spec.action_id, spec.params)
            except EngyError as err:
                self.notify(str(err), title=spec.title, severity="error")
                return
            self.notify(", ".join(f"{key}: {value}" for key, value in result.items()) or "done", title=spec.title)

    async def _first(self, kind: str, prefix: str = "") -> CommandSpec | None:
        return next(
            (
                spec
                for spec in await self.palette_commands()
                if spec.kind == kind and (spec.action_id or "").startswith(prefix)
            ),
            None,
        )

    async def action_restart_model_server(self) -> None:
        spec = await self._first("action", "restart-model-server")
        if spec is None:
            self.notify("this node supervises no model server", title="restart", severity="warning")
            return
        await self.run_command(spec)

    async def action_copy_command(self) -> None:
        spec = await self._first("copy")
        if spec is None:
            self.notify("this node reports no model server command", title="copy", severity="warning")
            return
        await self.run_command(spec)

    async def action_diagnostics(self) -> None:
        await self._diagnostics()

    async def _diagnostics(self) -> None:
        import asyncio
        from pathlib import Path

        from engy_node.config import load_config
        from engy_node.diagnose import collect

        self.notify("collecting versions, config, GPUs, logs and status…", title="diagnostics")
        try:
            config = load_config(home=self.home)
            bundle = await asyncio.to_thread(collect, config, output=str(Path.cwd()))
        except EngyError as err:
            self.notify(str(err), title="diagnostics", severity="error")
            return
        self.notify(f"{bundle.path}\n{bundle.summary()}", title="diagnostics bundle written", timeout=15)

    async def action_quit(self) -> None:
        # A node running inside the TUI stops with it: say so and ask, once.
        if self.bridge is not None and self.bridge.mode == "local" and self.bridge.running:
            self.push_screen(ConfirmQuit(), self._quit_confirmed)
        else:
            self.run_worker(self._quit(), exclusive=True)

    def _quit_confirmed(self, confirmed: bool | None) -> None:
        if confirmed:
            self.notify("stopping the node and everything it started…", title="quit")
            self.run_worker(self._quit(), exclusive=True)

    async def _quit(self) -> None:
        await self._stop_bridge()
        self.exit()

    async def on_unmount(self) -> None:
        await self._stop_bridge()

    async def _stop_bridge(self) -> None:
        if self.bridge is not None:
            await self.bridge.stop()

    def _bridge_crashed(self, error: BaseException) -> None:
        self.exit(
            return_code=1,
            message=f"engy-tui: the node link stopped unexpectedly ({type(error).__name__}: "
            f"{error}). This is a bug; please report it with this message.",
        )


class ConfirmQuit(ModalScreen[bool]):
    """ "Stop the node and quit?" — the node runs inside this TUI, so quitting stops it."""

    DEFAULT_CSS = """
    ConfirmQuit {
        align: center middle;
    }
    ConfirmQuit > Static {
        width: auto;
        padding: 1 3;
        border: thick $warning;
        background: $surface;
    }
    """
    BINDINGS = [
        Binding("y,enter", "answer(True)", "Stop and quit", id="quit.confirm"),
        Binding("n,escape", "answer(False)", "Keep running", id="quit.cancel"),
    ]

    def compose(self) -> ComposeResult:
        yield Static(
            "The node runs inside engy-tui: quitting stops it and every process it started.\n\n"
            "Stop it and quit?   y / enter: yes   n / escape: keep running"
        )

    def action_answer(self, confirmed: bool) -> None:
        self.dismiss(confirmed)
