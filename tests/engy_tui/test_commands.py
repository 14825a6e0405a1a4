"""The node manager's commands: which palette entries a node's actions and states give, the
keymap file, and the bindings and the palette running a node's action in-process."""

from __future__ import annotations

import asyncio
import time

import pytest
import trio

from engy_node.control import Actions
from engy_node.errors import EngyError
from engy_node.hub import Hub
from engy_node.snapshots import NodeStates, decode_states
from engy_tui.commands import KeymapError, command_specs, load_keymap
from engy_tui.manager import NodeManager
from engy_tui.node_bridge import NodeBridge

WAIT_S = 20.0


def test_a_nodes_actions_become_palette_entries_with_their_parameters():
    specs = command_specs(
        [
            {"id": "set-log-level", "description": "level"},
            {"id": "pause-traffic", "description": "pause"},
            {"id": "restart-model-server-miner-2", "description": "restart"},
            {"id": "flush-cache", "description": "x"},
        ],
        decode_states(
            {
                "model_server.miner-2": {"command": "python -m engy_node serve --port 1"},
                "miner-2": {"command": "the miner's own, not its server's"},
            },
            strict=True,
        ),
    )
    titles = [spec.title for spec in specs]
    assert titles == [
        "Log level: debug",
        "Log level: info",
        "Log level: warning",
        "Log level: error",
        "Pause demo traffic",
        "Restart model server (miner-2)",
        "Flush cache",
        "Copy model server launch command (miner-2)",
        "Export diagnostics bundle",
    ]
    assert specs[1].params == {"level": "info"} and specs[5].action_id == "restart-model-server-miner-2"
    assert specs[7].text == "python -m engy_node serve --port 1"


def test_a_node_with_nothing_registered_still_offers_diagnostics():
    assert [spec.kind for spec in command_specs([], NodeStates())] == ["diagnose"]
    no_command = decode_states({"model_server": "not an object", "model_server.miner-1": {"command": ""}})
    assert [spec.kind for spec in command_specs([{"description": "no id"}], no_command)] == ["diagnose"]


def test_the_keymap_file_rebinds_by_id_and_a_broken_one_names_itself(tmp_path):
    path = tmp_path / "keymap.toml"
    assert load_keymap(path) == {}
    path.write_text('[keys]\n"app.quit" = "ctrl+q"\n"logs.follow" = "F"\n')
    assert load_keymap(path) == {"app.quit": "ctrl+q", "logs.follow": "F"}
    path.write_text('[keys]\n"app.quit" = 3\n')
    with pytest.raises(KeymapError, match="keymap.toml"):
        load_keymap(path)
    path.write_text("[keys\n")
    with pytest.raises(KeymapError, match="not readable TOML"):
        load_keymap(path)


def small_node(ran: list[str]):
    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        async def restart(params):
            ran.append("restart")
            return {"restarted": True}

        actions.register("restart-model-server", "restart the model server", restart)
        hub.set_state("model_server", command="python -m engy_node serve --port 30000")
        task_status.started()
        await trio.sleep_forever()

    return start


def drive(app: NodeManager, script) -> None:
    async def body() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + WAIT_S
            while app.bridge is not None and not app.bridge.ready:
                assert time.monotonic() < deadline, "the node did not start"
                await pilot.pause(0.05)
            await script(pilot)

    asyncio.run(body())


async def wait_until(pilot, condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {WAIT_S} s"
        await pilot.pause(0.05)


def test_r_restarts_the_model_server_and_c_copies_its_command():
    ran: list[str] = []
    app = NodeManager(NodeBridge.local(small_node(ran)))
    copied: list[str] = []
    app.copy_to_clipboard = copied.append  # the terminal's clipboard is not the test's to read

    async def script(pilot) -> None:
        await wait_until(
            pilot,
            lambda: app.bridge.latest is not None and "miner" in app.bridge.latest.states.model_servers,
            "the node's state read",
        )
        await pilot.press("r")
        await wait_until(pilot, lambda: ran == ["restart"], "the restart action run")
        await pilot.press("c")
        await wait_until(pilot, lambda: copied == ["python -m engy_node serve --port 30000"], "the command copied")
        await pilot.press("q", "y")

    drive(app, script)


def test_the_palette_lists_and_runs_the_nodes_actions():
    ran: list[str] = []
    app = NodeManager(NodeBridge.local(small_node(ran)))

    async def script(pilot) -> None:
        await pilot.press("ctrl+p")
        await pilot.press(*"restart model")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_until(pilot, lambda: ran == ["restart"], "the palette's restart run")
        await pilot.press("q", "y")

    drive(app, script)


def test_a_user_keymap_rebinds_quit():
    app = NodeManager(NodeBridge.local(small_node([])), keymap={"app.quit": "x"})

    async def script(pilot) -> None:
        await pilot.press("q")  # no longer quits
        await pilot.pause(0.2)
        assert app.is_running
        await pilot.press("x", "y")

    drive(app, script)
    assert not app.bridge.running


def test_quitting_a_node_that_runs_inside_asks_first():
    app = NodeManager(NodeBridge.local(small_node([])))

    async def script(pilot) -> None:
        await pilot.press("q")
        await pilot.pause(0.2)
        await pilot.press("n")  # keep running
        await pilot.pause(0.2)
        assert app.is_running and app.bridge.running
        await pilot.press("q", "y")

    drive(app, script)
    assert not app.bridge.running


def trio_node(ran: list[str], *, fail: bool = False):
    """A node whose restart is real trio code (it sleeps, as a supervisor's restart waits for the
    server), so the action must run inside the guest run, not on the host's asyncio loop."""

    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        async def restart(params):
            await trio.sleep(0.01)
            if fail:
                raise EngyError("the model server is already restarting; wait for it")
            ran.append("restart")
            return {"restarted": True}

        actions.register("restart-model-server", "restart the model server", restart)
        hub.set_state("model_server", command="python -m engy_node serve --port 30000")
        task_status.started()
        await trio.sleep_forever()

    return start


def toasts(app: NodeManager) -> list[tuple[str, str]]:
    return [(note.severity, note.message) for note in app._notifications]


@pytest.mark.parametrize("fail", [False, True])
def test_r_runs_a_trio_restart_inside_the_node_and_reports_how_it_went(fail):
    ran: list[str] = []
    app = NodeManager(NodeBridge.local(trio_node(ran, fail=fail)))

    async def script(pilot) -> None:
        await wait_until(
            pilot,
            lambda: app.bridge.latest is not None and "miner" in app.bridge.latest.states.model_servers,
            "the node's state read",
        )
        await pilot.press("r")
        await wait_until(pilot, lambda: len(toasts(app)) >= 2, "the restart's outcome shown")
        if fail:
            assert toasts(app)[-1] == ("error", "the model server is already restarting; wait for it")
        else:
            assert ran == ["restart"]
            assert toasts(app)[-1] == ("information", "restarted: True")
        await pilot.press("q", "y")

    drive(app, script)
