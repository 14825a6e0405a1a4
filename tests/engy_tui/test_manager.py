"""The node manager: its header as a plain function, attached to a real control API, running a
node in-process, and stopping that node (every trio task) when it quits.

As in test_app.py, Pilot tests are plain functions driving the app with `asyncio.run`, since
pytest-trio claims every `async def` test; the app hosts its own trio guest run exactly as it
does for a user, and waits are bounded loops over `pilot.pause()`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import trio
from textual.widgets import Static

from engy_node.control import Actions, serve_control
from engy_node.errors import EngyError
from engy_node.hub import Hub
from engy_node.snapshots import STATE_SCHEMA
from engy_tui.app import build_app, build_parser
from engy_tui.manager import NodeManager, header_text
from engy_tui.node_bridge import NodeBridge, NodeSnapshot, snapshot_of
from engy_tui.widgets.logs import LogsView

SIZE = (120, 40)
WAIT_S = 20.0
NOW = 1_800_000_000.0
STATES = {
    "chain": {
        "network": "dev chain",
        "netuid": 53,
        "block": 1234,
        "block_time_s": 1.0,
        "tempo": 30,
        "epochs_run": 7,
        "neurons": [
            {
                "uid": 2,
                "hotkey": "5Miner",
                "stake": 0.0,
                "permit": False,
                "last_update": 1000,
                "incentive": 0.75,
                "emission": 5.0,
            }
        ],
        "weights": {"1": {"2": 65535}},
    },
    "epochs": {"latest": 42, "digest": "ab" * 32, "weights": [["5Miner", 65535]]},
}


def snapshot(*, connected: bool = True, error: str | None = None) -> NodeSnapshot:
    node = {"roles": ["gateway", "validator"], "network": "local", "started_at": NOW - 300}
    return snapshot_of(node, {"states": STATES}, taken_at=NOW, connected=connected, error=error)


def test_the_header_says_when_the_node_speaks_a_newer_state_schema():
    node = {"roles": ["gateway"]}
    current = snapshot_of(node, {"schema": STATE_SCHEMA, "states": STATES}, taken_at=NOW, connected=True)
    assert "schema" not in header_text(current, mode="attached", now=NOW).plain
    newer = snapshot_of(node, {"schema": STATE_SCHEMA + 1, "states": STATES}, taken_at=NOW, connected=True)
    assert f"state schema {STATE_SCHEMA + 1} is newer than this TUI's {STATE_SCHEMA}: upgrade engy-tui" in (
        header_text(newer, mode="attached", now=NOW).plain
    )


def test_the_header_names_roles_block_epoch_uptime_and_a_state_word():
    text = header_text(snapshot(), mode="attached", now=NOW + 1).plain
    assert "gateway, validator" in text and "block 1,234" in text and "epoch 42" in text and "up 5 min" in text
    assert "● attached" in text


def test_the_header_says_why_a_node_is_not_connected_and_when_data_is_stale():
    assert (
        "✘ the node at x does not answer"
        in header_text(snapshot(connected=False, error="the node at x does not answer"), mode="attached", now=NOW).plain
    )
    assert "⚠ stale 30 s" in header_text(snapshot(), mode="attached", now=NOW + 30).plain
    assert "waiting for the node" in header_text(None, mode="local", now=NOW).plain


def test_the_parser_offers_local_attach_and_the_model_server_monitor():
    assert build_parser().parse_args(["--local", "--traffic"]).local
    assert build_parser().parse_args(["--attach"]).attach == ""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--local", "--attach", "http://127.0.0.1:1"])


def test_attach_without_a_running_node_says_how_to_start_one(tmp_path, capsys):
    from engy_tui.app import main

    assert main(["--home", str(tmp_path), "--attach"]) == 2
    assert "engy-tui:" in capsys.readouterr().err


def run_app(app: NodeManager, check: Callable[..., object]) -> None:
    async def body() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await check(pilot)

    asyncio.run(body())


async def wait_for(pilot, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {WAIT_S} s"
        await pilot.pause(0.05)


def static_text(app: NodeManager, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_attached_the_manager_shows_the_nodes_status_and_logs(tmp_path):
    """A real control API in a thread of its own (its own trio run), the manager attached to it."""
    import threading

    hub = Hub()
    for name, values in STATES.items():
        hub.set_state(name, **values)
    hub.emit("info", "validator", "epoch 42: weights for 1 uid(s) on chain at block 1230")
    port = free_port()
    stop = threading.Event()
    started = threading.Event()
    endpoint: list = []

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            endpoint.append(
                await nursery.start(
                    lambda task_status: serve_control(
                        hub,
                        data_dir=tmp_path,
                        actions=Actions(),
                        node_info={"roles": ["validator"], "network": "local", "started_at": time.time()},
                        port=port,
                        task_status=task_status,
                    )
                )
            )
            started.set()
            while not stop.is_set():
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    server = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    server.start()
    assert started.wait(WAIT_S)
    try:
        app = build_app(
            [
                "--home",
                str(tmp_path.parent / tmp_path.name),
                "--attach",
                endpoint[0].url,
                "--token-file",
                str(endpoint[0].token_file),
            ]
        )
        assert isinstance(app, NodeManager)

        async def check(pilot) -> None:
            await wait_for(pilot, lambda: "block 1,234" in static_text(app, "#node-header"), "the header filled in")
            assert "weights on chain from uid 1" in static_text(app, "#overview-text")
            await pilot.press("7")
            logs = app.query_one(LogsView)

            def logged() -> bool:
                buffer = logs.buffer
                return any(
                    "epoch 42: weights" in buffer.line(number).message
                    for number in range(buffer.first_number, buffer.first_number + len(buffer))
                )

            await wait_for(pilot, logged, "the log line in the logs view")
            await pilot.press("q")

        run_app(app, check)
        assert app.bridge is not None and not app.bridge.running
    finally:
        stop.set()
        server.join(WAIT_S)


def test_a_wrong_token_is_shown_in_the_header_not_crashed_on(tmp_path):
    import threading

    hub = Hub()
    port = free_port()
    stop = threading.Event()
    started = threading.Event()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: serve_control(
                    hub, data_dir=tmp_path, actions=Actions(), node_info={}, port=port, task_status=task_status
                )
            )
            started.set()
            while not stop.is_set():
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    server = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    server.start()
    assert started.wait(WAIT_S)
    try:
        app = NodeManager(NodeBridge.attach(f"http://127.0.0.1:{port}", "not-the-token"))

        async def check(pilot) -> None:
            await wait_for(pilot, lambda: "the node refused" in static_text(app, "#node-header"), "the refusal shown")
            await pilot.press("q")

        run_app(app, check)
    finally:
        stop.set()
        server.join(WAIT_S)


def test_local_the_node_runs_inside_and_quitting_stops_every_task():
    """The local mode with a small node: it publishes state, registers an action, and must have
    finished (its `finally` ran) by the time the app has quit."""
    finished: list[str] = []
    toggled: list[str] = []

    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        async def pause(params):
            toggled.append("pause")
            return {"paused": True}

        actions.register("pause-traffic", "pause", pause)
        hub.set_state("chain", block=77)
        hub.set_state("node", roles=["local network"], hotkeys={})
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                task_status.started()
                hub.emit("info", "local", "the small node is up")
        finally:
            finished.append("node stopped")

    bridge = NodeBridge.local(start, node_info={"network": "local", "started_at": time.time()})
    app = NodeManager(bridge)

    async def check(pilot) -> None:
        await wait_for(pilot, lambda: "block 77" in static_text(app, "#node-header"), "the local node's state shown")
        assert bridge.ready
        await pilot.press("p")
        await wait_for(pilot, lambda: toggled == ["pause"], "the pause action run in-process")
        await pilot.press("q", "y")

    run_app(app, check)
    assert finished == ["node stopped"] and not bridge.running


def test_a_local_node_that_fails_to_start_is_reported_not_fatal():
    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        raise EngyError("cannot listen on 127.0.0.1:8080 (address in use); choose another with --port-base")

    app = NodeManager(NodeBridge.local(start))

    async def check(pilot) -> None:
        await wait_for(pilot, lambda: "did not start" in static_text(app, "#node-header"), "the start failure shown")
        assert "--port-base" in static_text(app, "#node-header")
        await pilot.press("q", "y")

    run_app(app, check)


def test_an_unknown_action_names_what_the_node_offers():
    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        task_status.started()
        await trio.sleep_forever()

    bridge = NodeBridge.local(start)
    with pytest.raises(EngyError, match="no action 'launch-rocket'"):
        asyncio.run(bridge.run_action("launch-rocket"))


def test_quitting_a_local_node_stops_the_child_processes_it_started(tmp_path):
    """A node that supervises a child process (as miners supervise model servers): when the TUI
    quits, the child is gone before the app has returned."""
    import subprocess
    import sys

    import psutil

    pids: list[int] = []

    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                lambda task_status: trio.run_process(
                    [sys.executable, "-c", "import time; time.sleep(600)"],
                    task_status=task_status,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            pids.append(process.pid)
            hub.set_state("chain", block=5)
            task_status.started()

    app = NodeManager(NodeBridge.local(start))

    async def check(pilot) -> None:
        await wait_for(pilot, lambda: bool(pids) and psutil.pid_exists(pids[0]), "the child running")
        await pilot.press("q", "y")

    run_app(app, check)
    assert pids and not _alive(pids[0]), "the node's child outlived engy-tui"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_setup_opens_the_first_run_wizard(tmp_path):
    from engy_tui.screens.setup import SetupScreen

    app = build_app(["--home", str(tmp_path), "--setup"])

    async def check(pilot) -> None:
        await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), "the setup wizard open")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, SetupScreen), "the wizard closed")
        await pilot.press("q")

    run_app(app, check)


def test_a_role_without_its_settings_is_refused_before_the_tui_opens(tmp_path, capsys):
    from engy_tui.app import main

    assert main(["--home", str(tmp_path), "--role", "validator"]) == 2
    assert "--validator-wallet" in capsys.readouterr().err


def test_after_setup_the_configured_node_runs_inside_the_tui():
    from engy_node.setup import SetupAnswers

    started: list[str] = []

    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        hub.set_state("chain", block=9)
        task_status.started()
        await trio.sleep_forever()

    def build(home, role):
        started.append(role)
        return NodeBridge.local(start)

    app = NodeManager(None, start_after_setup=build)

    async def check(pilot) -> None:
        app._setup_done(SetupAnswers(role="miner"))
        await wait_for(pilot, lambda: bool(app.screen.query("#start")), "asked before starting")
        assert started == []
        await pilot.press("s")
        await wait_for(pilot, lambda: "block 9" in static_text(app, "#node-header"), "the configured node running")
        await pilot.press("q", "y")

    run_app(app, check)
    assert started == ["miner"] and not app.bridge.running
