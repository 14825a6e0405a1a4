"""`engy-tui`: the Textual app and its command line. This first version monitors one model server.

Data flows one way: `bridge.StatusBridge` polls the server from a trio guest run hosted on
this app's asyncio loop and keeps the newest `ServerStatus`; a timer copies it into the
`ServerPanel` reactive at a fixed rate (`RENDER_INTERVAL_S`), never once per poll or event, so
how often data arrives never decides how often the screen redraws. The app holds no logic a
test would need a terminal for: what the panel says is decided by plain functions in
`widgets/server_panel.py`.

Quitting stops the trio side first (cancel its root scope, wait for the guest run to end) and
only then lets the asyncio loop go; `on_unmount` does the same for every other way out.

`EngyTui(poll=False)` starts without the bridge, showing whatever `show_status()` is given:
the way snapshot tests get a frame with no timing in it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header

from engy_tui.bridge import POLL_INTERVAL_S, POLL_TIMEOUT_S, ServerStatus, StatusBridge
from engy_tui.manager import NodeManager
from engy_tui.node_bridge import NodeBridge
from engy_tui.widgets import ServerPanel

__all__ = ["DEFAULT_SERVE_URL", "RENDER_INTERVAL_S", "EngyTui", "build_app", "build_parser", "main"]

# sglang's default --host/--port, and engy-node serve's.
DEFAULT_SERVE_URL = "http://127.0.0.1:30000"
# The design asks for 2-5 Hz (docs/architecture.md, "The TUI"). 2 Hz is half the poll interval,
# so a finished poll shows within half a second, and redraws stay cheap on a slow SSH link.
RENDER_INTERVAL_S = 0.5


class EngyTui(App[None]):
    """Monitors one sglang-compatible model server."""

    CSS_PATH = "app.tcss"
    TITLE = "engy-tui"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit", tooltip="Stop polling and leave engy-tui."),
        Binding(
            "r",
            "refresh",
            "Refresh",
            id="refresh",
            tooltip="Poll the model server now rather than at the next interval.",
        ),
    ]

    def __init__(
        self,
        serve_url: str = DEFAULT_SERVE_URL,
        *,
        poll: bool = True,
        poll_interval_s: float = POLL_INTERVAL_S,
        poll_timeout_s: float = POLL_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self.serve_url = serve_url
        self.bridge = StatusBridge(serve_url, interval_s=poll_interval_s, timeout_s=poll_timeout_s) if poll else None
        """The poller; None when the app was built with poll=False."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield ServerPanel()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.serve_url
        if self.bridge is not None:
            self.bridge.start(on_crash=self._poller_crashed)
            self.set_interval(RENDER_INTERVAL_S, self._render_latest)

    def show_status(self, status: ServerStatus | None) -> None:
        """Display this snapshot (None: no poll finished yet)."""
        self.query_one(ServerPanel).status = status

    def _render_latest(self) -> None:
        assert self.bridge is not None  # the timer runs only with a bridge
        if self.bridge.latest is not None:
            self.show_status(self.bridge.latest)

    def _poller_crashed(self, error: BaseException) -> None:
        self.exit(
            return_code=1,
            message=f"engy-tui: the status poller stopped unexpectedly ({type(error).__name__}: {error}). "
            "This is a bug; please report it with this message.",
        )

    def action_refresh(self) -> None:
        if self.bridge is not None:
            self.bridge.refresh()

    async def action_quit(self) -> None:
        await self._stop_polling()
        self.exit()

    async def on_unmount(self) -> None:
        # Every other way out (exit() after a crash, a test harness's teardown) passes here,
        # and the trio guest run must end before the asyncio loop does.
        await self._stop_polling()

    async def _stop_polling(self) -> None:
        if self.bridge is not None:
            await self.bridge.stop()


def _serve_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL; pass e.g. --serve-url {DEFAULT_SERVE_URL}")
    return value.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engy-tui",
        description=(
            "The engy node manager. --local runs the whole local network (engy-node up) inside it; "
            "--attach watches a running node through its control API; --serve-url monitors one "
            "sglang-compatible model server (real sglang, or `engy-node serve`)."
        ),
        epilog="Keys: 1 overview, 2 miner, 3 validator, 4 gateway, 5 chain, 6 GPUs, 7 logs, p pause/resume demo traffic, r restart model server, c copy its "
        "command, d diagnostics bundle, ctrl+p every command (setup too), q quit (a local network stops with it).",
    )
    parser.add_argument("--home", help="the node's home (as engy-node --home; also $ENGY_HOME)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--setup",
        action="store_true",
        help="first-run setup: GPUs, role, model, wallet, gateway; writes node.toml and shows the commands",
    )
    mode.add_argument("--local", action="store_true", help="run the local network inside the TUI (engy-node up)")
    mode.add_argument(
        "--role",
        action="append",
        choices=("miner", "validator", "gateway", "verifier"),
        help="run this node role inside the TUI, as engy-node --role does (repeatable; settings from node.toml)",
    )
    mode.add_argument(
        "--attach",
        nargs="?",
        const="",
        metavar="URL",
        help="watch a running node: its control API URL (default: the one in the home's control.json)",
    )
    mode.add_argument(
        "--fleet",
        metavar="FILE",
        help="watch many nodes over their control APIs, directly or through SSH tunnels: a fleet file of "
        '[[node]] tables (docs/operations.md, "Fleet view"); enter opens a node\'s tabs, esc comes back',
    )
    mode.add_argument(
        "--serve-url",
        type=_serve_url,
        metavar="URL",
        help=f"monitor one model server (e.g. {DEFAULT_SERVE_URL}); sglang needs --enable-metrics for latencies",
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help="the control API token file (default: the one control.json names)"
    )
    parser.add_argument("--traffic", action="store_true", help="with --local: a demo buyer keeps requests flowing")
    parser.add_argument(
        "--port-base",
        type=int,
        metavar="N",
        help="with --local, as engy-node up --port-base: buyer API on N, miner websocket N+1, provider API N+2, "
        "control API N+3 (0: free ports)",
    )
    parser.add_argument(
        "--fake-gpus",
        type=_fake_gpus,
        metavar="SPEC",
        help="with --setup, as engy-node --fake-gpus: plan for simulated GPUs, e.g. 4xRTX4090; nothing is started",
    )
    return parser


def _fake_gpus(value: str) -> str:
    from engy_node.errors import EngyError
    from engy_node.hardware.fake_nvml import parse_fake_gpu_spec

    try:
        parse_fake_gpu_spec(value)
    except EngyError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def build_app(argv: Sequence[str] | None = None, *, poll: bool = True) -> App[None]:
    """The app as `engy-tui ARGV` builds it; tests use this too, so they run what users run.
    Bad `--port-base` values raise `EngyError`, as `engy-node up`'s do."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fake_gpus is not None and not args.setup:
        parser.error(
            "--fake-gpus goes with --setup (engy-tui --setup --fake-gpus 4xRTX4090); "
            "to print a miner's plan for simulated GPUs: engy-node plan --fake-gpus SPEC"
        )
    if args.port_base is not None and not args.local:
        parser.error("--port-base goes with --local (engy-tui --local --port-base 18080)")
    if args.setup:
        return NodeManager(
            None,
            home=args.home,
            keymap=_user_keymap(args.home),
            setup_first=True,
            start_after_setup=start_after_setup if poll else None,
            fake_gpus=args.fake_gpus or "",
        )
    if args.fleet:
        from engy_node.fleet_view import load_fleet
        from engy_tui.fleet_bridge import FleetBridge
        from engy_tui.screens.fleet import FleetManager

        fleet = FleetBridge(load_fleet(args.fleet))
        return FleetManager(fleet, source=args.fleet, dial=poll, home=args.home, keymap=_user_keymap(args.home))
    if args.role:
        return NodeManager(
            roles_bridge(args.home, args.role) if poll else None, home=args.home, keymap=_user_keymap(args.home)
        )
    if args.local or args.attach is not None:
        ports = None
        if args.port_base is not None:
            from engy_node.local.up import port_plan

            ports = port_plan(args.port_base, buyer=None, miner=None, provider=None, control=None)
        bridge = None
        if poll:
            bridge = (
                _local_bridge(args.home, traffic=args.traffic, ports=ports)
                if args.local
                else _attached_bridge(args.home, args.attach, args.token_file)
            )
        return NodeManager(bridge, home=args.home, keymap=_user_keymap(args.home))
    return EngyTui(args.serve_url or DEFAULT_SERVE_URL, poll=poll)


def _user_keymap(home: str | None) -> dict[str, str]:
    """The user's `keymap.toml` beside node.toml; a broken file is an error naming it."""
    from engy_node.config import load_config
    from engy_node.errors import ConfigError
    from engy_tui.commands import KeymapError, load_keymap

    try:
        return load_keymap(load_config(home=home).paths.config_file.parent / "keymap.toml")
    except KeymapError as err:
        raise ConfigError(str(err)) from None


def _attached_bridge(home: str | None, url: str, token_file: str | None) -> NodeBridge:
    from engy_node.config import load_config
    from engy_node.control import read_endpoint, read_token

    if not url or not token_file:
        endpoint = read_endpoint(load_config(home=home).paths.data_dir)
        url = url or endpoint.url
        token_file = token_file or str(endpoint.token_file)
    return NodeBridge.attach(url, read_token(Path(token_file)))


def start_after_setup(home: str | None, role: str) -> NodeBridge:
    """The node setup just configured, to run inside the TUI at once."""
    return _local_bridge(home, traffic=True) if role == "local" else roles_bridge(home, [role])


def roles_bridge(home: str | None, roles: Sequence[str]) -> NodeBridge:
    """`engy-node --role …` inside the TUI: the same services, with its control API too (so
    `engy-node status` and `diagnose` work while the TUI hosts the node)."""
    import os
    import time

    import trio

    from engy_node import __version__
    from engy_node.config import load_config
    from engy_node.control import serve_control
    from engy_node.hub import Hub, install_logging
    from engy_node.roles import check_roles, role_services

    config = load_config(home=home, public_miner_env="miner" in roles)
    check_roles(config, roles)
    hub = Hub(ring_size=config.node.log_ring_size)
    install_logging(hub, level=config.node.log_level, log_dir=config.paths.log_dir, stderr=False)
    info = {
        "version": __version__,
        "pid": os.getpid(),
        "roles": list(roles),
        "home": str(config.paths.data_dir),
        "started_at": time.time(),
        "netuid": config.node.netuid,
    }

    async def start(hub: Hub, actions, *, task_status) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: serve_control(
                    hub,
                    data_dir=config.paths.data_dir,
                    actions=actions,
                    node_info=info,
                    host=config.control.host,
                    port=config.control.port,
                    task_status=task_status,
                )
            )
            for _, service in role_services(config, hub, roles, actions):
                await nursery.start(service)
            task_status.started()

    return NodeBridge.local(start, node_info=info, hub=hub)


def _local_bridge(home: str | None, *, traffic: bool, ports: dict[str, int | None] | None = None) -> NodeBridge:
    import functools
    import os
    import time

    from engy_node import __version__
    from engy_node.config import load_config
    from engy_node.hub import Hub, install_logging
    from engy_node.local.up import run_up

    config = load_config(home=home)
    hub = Hub(ring_size=config.node.log_ring_size)
    install_logging(hub, level=config.node.log_level, log_dir=config.paths.log_dir, stderr=False)

    async def start(hub: Hub, actions, *, task_status) -> None:
        await run_up(config, hub, ports=ports, traffic=traffic, actions=actions, task_status=task_status)

    info = {
        "version": __version__,
        "pid": os.getpid(),
        "roles": ["local network"],
        "network": "local",
        "home": str(config.paths.data_dir),
        "started_at": time.time(),
    }
    return NodeBridge.local(functools.partial(start), node_info=info, hub=hub)


def main(argv: Sequence[str] | None = None) -> int:
    from engy_node.errors import EngyError

    try:
        app = build_app(argv)
    except EngyError as err:
        print(f"engy-tui: {err}", file=sys.stderr)
        return err.exit_code
    app.run()
    if isinstance(app, NodeManager) and app.farewell:
        print(app.farewell)
    return app.return_code or 0
