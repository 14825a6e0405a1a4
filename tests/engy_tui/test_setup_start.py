"""`engy-tui --setup` after the wizard (issue 34): Write asks before starting anything and says
where the node would connect (the public network by name); "Not now" quits with the commands;
Esc on the first screen quits saying nothing was written, and Esc from the palette's wizard goes
back to the manager; `--setup --fake-gpus` plans for simulated GPUs and starts nothing;
`--local --port-base` reaches the local network as `engy-node up --port-base` does.

Pilot tests are plain functions driving the app with `asyncio.run`, as in test_manager.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from textual.app import App
from textual.widgets import Button, Input, Static

from engy_node.control import Actions
from engy_node.errors import EngyError
from engy_node.hub import Hub
from engy_node.setup import DEFAULT_GATEWAY_URL, SetupAnswers
from engy_tui.app import build_app, main
from engy_tui.manager import NodeManager
from engy_tui.node_bridge import NodeBridge
from engy_tui.screens.setup import SetupScreen, open_setup
from engy_tui.screens.start import PUBLIC_GATEWAY_HOST, ConfirmStart, is_public, start_lines
from tests.engy_node.test_setup import MINER_KEY
from tests.engy_tui.test_setup_screen import QWEN, rig_facts, settle

SIZE = (130, 40)
WAIT_S = 20.0


async def wait_for(pilot, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {WAIT_S} s"
        await pilot.pause(0.05)


# ---- what would start (no terminal) -------------------------------------------------------------


def test_start_lines_name_the_role_where_it_connects_the_model_and_the_commands():
    miner = SetupAnswers(role="miner", model=QWEN, miner_key=MINER_KEY)
    assert start_lines(miner, home="/h") == [
        ("role", "miner"),
        (
            "gateway",
            f"{DEFAULT_GATEWAY_URL} — ⚠ the public engy network's gateway: real buyers' requests",
        ),
        ("model", QWEN),
        ("command", "$ engy-node --home /h plan"),
        ("command", "$ engy-node --home /h --role miner"),
    ]
    private = SetupAnswers(role="miner", gateway_url="wss://gw.example.com/gw")
    assert ("gateway", "wss://gw.example.com/gw — a private gateway (not the public network's)") in start_lines(private)
    validator = dict(start_lines(SetupAnswers(role="validator", wallet_name="v", wallet_hotkey="h")))
    assert validator["chain"] == "finney — ⚠ Bittensor's main network: the weights it sets are real"
    assert validator["provider"] == "https://provider.engy.ai — the public engy provider"
    assert dict(start_lines(SetupAnswers(role="local")))["network"] == (
        "loopback only: nothing reaches the public network"
    )
    simulated = dict(start_lines(miner, fake_gpus="2xRTX4090"))["GPUs"]
    assert simulated.startswith("⚠ simulated (--fake-gpus 2xRTX4090): nothing can run on them, so nothing starts")


@given(st.from_regex(r"wss://[a-z]{1,12}(\.[a-z]{2,6}){0,2}(:[0-9]{2,5})?/gw", fullmatch=True))
def test_only_the_public_gateways_host_is_called_public(url):
    host = url.removeprefix("wss://").split("/")[0].split(":")[0]
    assert is_public(url, PUBLIC_GATEWAY_HOST) == (host == PUBLIC_GATEWAY_HOST)


# ---- Write, then Start or Not now ---------------------------------------------------------------


def asking(app: App) -> bool:
    """The start question is shown (composed)."""
    return isinstance(app.screen, ConfirmStart) and bool(app.screen.query("#not-now"))


def running_node(started: list[str]) -> Callable[[str | None, str], NodeBridge]:
    async def start(hub: Hub, actions: Actions, *, task_status) -> None:
        hub.set_state("chain", block=9)
        task_status.started()
        await trio.sleep_forever()

    def build(home: str | None, role: str) -> NodeBridge:
        started.append(role)
        return NodeBridge.local(start)

    return build


async def write_a_public_miner(pilot) -> None:
    """The wizard on the 4×4090 + 5090 rig, every default kept (the public gateway), a miner key."""
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, SetupScreen), "the wizard open")
    await settle(pilot)
    for _ in range(3):
        await pilot.press("ctrl+n")
        await settle(pilot)
    pilot.app.screen.query_one("#miner-key", Input).value = MINER_KEY
    await pilot.press("ctrl+n")
    await settle(pilot)
    await pilot.click("#write")
    await wait_for(pilot, lambda: asking(pilot.app), "asked before starting")


def setup_manager(tmp_path: Path, monkeypatch, started: list[str]) -> NodeManager:
    facts = rig_facts(tmp_path)
    monkeypatch.setattr("engy_tui.screens.setup.gather_facts", lambda home, nvml=None: facts)
    return NodeManager(None, home=str(tmp_path / "home"), setup_first=True, start_after_setup=running_node(started))


def test_write_asks_first_naming_the_public_gateway_and_start_runs_the_miner(tmp_path, monkeypatch):
    started: list[str] = []
    app = setup_manager(tmp_path, monkeypatch, started)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await write_a_public_miner(pilot)
            assert (tmp_path / "home" / "node.toml").exists() and started == []
            shown = str(app.screen.query_one("#start-summary", Static).render())
            assert f"{DEFAULT_GATEWAY_URL} — ⚠ the public engy network's gateway" in shown
            assert f"model     {QWEN}" in shown
            assert f"$ engy-node --home {tmp_path}/home --role miner" in shown
            await wait_for(pilot, lambda: app.focused is not None, "a button focused")
            assert app.focused.id == "not-now"  # the first focus: Enter starts nothing
            await pilot.press("s")
            await wait_for(pilot, lambda: "block 9" in str(app.query_one("#node-header", Static).render()), "running")
            assert started == ["miner"]
            await pilot.press("q", "y")

    asyncio.run(scenario())


def test_not_now_keeps_node_toml_starts_nothing_and_quits_with_the_commands(tmp_path, monkeypatch):
    started: list[str] = []
    app = setup_manager(tmp_path, monkeypatch, started)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await write_a_public_miner(pilot)
            await pilot.press("n")
            await wait_for(pilot, lambda: app.return_code is not None, "quit")

    asyncio.run(scenario())
    assert started == [] and app.bridge is None and app.return_code == 0
    assert (tmp_path / "home" / "node.toml").exists()
    assert app.farewell == (
        "engy-tui: node.toml is written; nothing was started. When ready, run:\n"
        f"  $ engy-node --home {tmp_path}/home plan\n"
        f"  $ engy-node --home {tmp_path}/home --role miner"
    )


class Asking(App[None]):
    def on_mount(self) -> None:
        answers = SetupAnswers(role="miner", model=QWEN, miner_key=MINER_KEY)
        self.push_screen(ConfirmStart(answers, home=None, config_file="~/.config/engy/node.toml"))


def test_the_start_question_snapshot(snap_compare):
    assert snap_compare(Asking(), terminal_size=SIZE)


# ---- Esc ----------------------------------------------------------------------------------------


def test_esc_in_the_first_run_wizard_quits_saying_nothing_was_written(tmp_path):
    app = build_app(["--home", str(tmp_path), "--setup"])

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), "the wizard open")
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.return_code is not None, "quit")

    asyncio.run(scenario())
    assert app.farewell == (
        "engy-tui: setup closed without writing node.toml; nothing was started. "
        "Run `engy-tui --setup` again when ready, or `engy-tui --local` to try a local network first."
    )
    assert not (tmp_path / "node.toml").exists()


def test_esc_in_the_palettes_wizard_goes_back_to_the_manager(tmp_path):
    app = NodeManager(None, home=str(tmp_path))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await open_setup(app, home=str(tmp_path))
            await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), "the wizard open")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, SetupScreen), "the wizard closed")
            assert app.screen is app.screen_stack[0] and app.return_code is None

    asyncio.run(scenario())


# ---- --fake-gpus and --port-base ----------------------------------------------------------------


def test_setup_takes_fake_gpus_with_engy_nodes_forms_and_only_with_setup(capsys):
    assert build_app(["--setup", "--fake-gpus", "4xRTX4090,1xRTX5090"], poll=False).fake_gpus == ("4xRTX4090,1xRTX5090")
    with pytest.raises(SystemExit) as exited:
        build_app(["--setup", "--fake-gpus", "4xGTX1080"], poll=False)
    assert exited.value.code == 2
    assert "argument --fake-gpus: unknown GPU model 'GTX1080' in fake GPU spec '4xGTX1080'" in " ".join(
        capsys.readouterr().err.split()
    )
    with pytest.raises(SystemExit):
        build_app(["--local", "--fake-gpus", "4xRTX4090"], poll=False)
    assert "--fake-gpus goes with --setup" in capsys.readouterr().err


def test_setup_with_fake_gpus_shows_them_in_the_wizard_and_starts_nothing(tmp_path):
    app = build_app(["--home", str(tmp_path), "--setup", "--fake-gpus", "2xRTX4090"])

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), "the wizard open")
            await settle(pilot)
            machine = str(app.screen.query_one("#setup-machine", Static).render())
            assert machine.startswith("Welcome to engy. Simulated GPUs (--fake-gpus 2xRTX4090):  2 × RTX 4090 (24 GiB")
            assert app.screen.answers.role == "miner"
            app._setup_done(SetupAnswers(role="local"))
            await wait_for(pilot, lambda: asking(app), "the start question")
            assert not app.screen.query(Button).filter("#start")
            assert "⚠ simulated (--fake-gpus 2xRTX4090)" in str(app.screen.query_one("#start-summary", Static).render())

    asyncio.run(scenario())


def test_local_takes_port_base_as_engy_node_up_does(tmp_path, monkeypatch, capsys):
    with pytest.raises(EngyError, match="N must be 1..65532"):
        build_app(["--home", str(tmp_path), "--local", "--port-base", "65533"], poll=False)
    assert main(["--home", str(tmp_path), "--local", "--port-base", "-1"]) == 2
    assert "--port-base -1: the network takes ports N..N+3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_app(["--setup", "--port-base", "18080"], poll=False)
    assert "--port-base goes with --local" in capsys.readouterr().err

    seen: list[dict] = []

    async def run_up(config, hub, *, ports=None, traffic=False, actions=None, task_status) -> None:
        seen.append(ports)
        task_status.started()
        await trio.sleep_forever()

    monkeypatch.setattr("engy_node.local.up.run_up", run_up)
    app = build_app(["--home", str(tmp_path), "--local", "--port-base", "18400"])

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: bool(seen), "the local network started")
            await pilot.press("q", "y")

    asyncio.run(scenario())
    assert seen == [{"buyer": 18400, "miner": 18401, "provider": 18402, "control": 18403}]
