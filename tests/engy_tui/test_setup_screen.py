"""The setup wizard under Pilot: a miner walks every step on the fake 4×4090 + 5090 rig with a
wallets directory holding one wallet and writes a private node.toml; CPU mode says so; Back and
Next keep answers; a new wallet is created in a worker; `c` copies the commands (and types a c
into a field); one SVG snapshot each of the model and review steps.

Pilot tests are plain functions driving the app with `asyncio.run`, as in `test_app.py`
(pytest-trio claims `async def` tests). Waits go through `settle`, which waits for the screen's
workers (planning, listing and creating wallets) instead of sleeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import stat
import tomllib
from pathlib import Path

from textual.app import App
from textual.pilot import Pilot
from textual.widgets import Button, Input, OptionList, RadioButton, Static

from engy_node.models import QWEN36_35B_A3B, SMOLLM2_135M
from engy_node.setup import DEFAULT_GATEWAY_URL, SetupAnswers, SetupFacts, WalletEntry
from engy_tui.screens import SetupScreen
from engy_tui.screens.setup import SetupCommand, open_setup, step_summary
from tests.engy_node.test_setup import ALICE, BOB, MINER_KEY, make_qwen_checkpoint, make_wallet, no_gpu, rig

SIZE = (130, 40)
QWEN = QWEN36_35B_A3B.id
RAM = 125 * 2**30


class Host(App[None]):
    """An app that opens the wizard at start and keeps what it dismissed with."""

    def __init__(self, facts: SetupFacts) -> None:
        super().__init__()
        self.facts = facts
        self.results: list[SetupAnswers | None] = []

    def on_mount(self) -> None:
        self.push_screen(SetupScreen(self.facts), callback=self.results.append)


async def settle(pilot: Pilot) -> None:
    """Until no worker runs: a worker's message may start another (a created wallet is listed)."""
    for _ in range(10):
        await pilot.pause()
        if all(worker.is_finished for worker in pilot.app.workers):
            return
        await pilot.app.workers.wait_for_complete()
    raise AssertionError("the wizard's workers kept starting each other")


def wizard(app: App) -> SetupScreen:
    assert isinstance(app.screen, SetupScreen)
    return app.screen


def text_of(app: App, selector: str) -> str:
    return str(wizard(app).query_one(selector, Static).content)


def options(app: App, selector: str) -> list[str]:
    option_list = wizard(app).query_one(selector, OptionList)
    return [str(option_list.get_option_at_index(i).prompt) for i in range(option_list.option_count)]


async def highlight(pilot: Pilot, selector: str, option_id: str) -> None:
    option_list = wizard(pilot.app).query_one(selector, OptionList)
    option_list.highlighted = option_list.get_option_index(option_id)
    await settle(pilot)


def rig_facts(tmp_path: Path, **changes) -> SetupFacts:
    wallets = tmp_path / "wallets"
    make_wallet(wallets, "default", {"miner1": ALICE})
    checkpoint = make_qwen_checkpoint(tmp_path / "qwen")
    facts = SetupFacts(
        inventory=rig(),
        config_file=tmp_path / "home" / "node.toml",
        wallets_path=str(wallets),
        checkpoints={QWEN: str(checkpoint)},
        ram_bytes=RAM,
    )
    return dataclasses.replace(facts, **changes)


# ---- one line per step (no terminal) ------------------------------------------------------------


def test_each_step_sums_up_its_answer_in_one_line(tmp_path):
    wallets = [WalletEntry("default", BOB, ())]
    answers = SetupAnswers(wallets_path="/w", wallet_name="default", wallet_hotkey="miner1", miner_key=MINER_KEY)

    def line(step, **kw):
        return step_summary(
            step,
            kw.pop("answers", answers),
            choices=(),
            wallets=wallets,
            config_file=Path("/etc/engy/node.toml"),
        )

    assert line("role") == "miner"
    assert line("model") == "smollm2-135m — planning…"
    assert line("wallet") == "/w/default · hotkey miner1 (address unknown)"
    assert line("wallet", answers=SetupAnswers()) == "no hotkey: the gateway admits this miner by its miner key"
    assert line("gateway") == f"{DEFAULT_GATEWAY_URL}   miner key ●●●●k3Pq"
    assert line("chain") == "finney · provider https://provider.engy.ai · master 5DXS…1uvJ"
    assert line("review") == "the exact commands (copy with c) · writes /etc/engy/node.toml"


# ---- the wizard ---------------------------------------------------------------------------------


def test_a_miner_walks_every_step_and_writes_a_private_node_toml(tmp_path):
    facts = rig_facts(tmp_path, existing={"serve": {"port": 8000}})
    facts.config_file.parent.mkdir()
    facts.config_file.write_text("[serve]\nport = 8000\n")

    async def scenario() -> None:
        app = Host(facts)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = wizard(app)
            assert text_of(app, "#setup-machine").startswith(
                "Welcome to engy. This machine:  4 × RTX 4090 (24 GiB, PCIe 4.0 x16) + 1 × RTX 5090 (32 GiB, PCIe 5.0 x16)"
            )
            assert screen.step == "role" and screen.query_one("#role-miner", RadioButton).value
            assert text_of(app, "#setup-summary").splitlines() == [
                "▶ 1 Role      miner",
                "  2 Model     qwen3.6-35b-a3b — fits: tp 4, mem-fraction 0.83, 8 concurrent, FP8 KV, 262144 context  ✔ recommended",
                f"  3 Wallet    {tmp_path}/wallets/default · hotkey miner1 (5Grw…utQY)",
                f"  4 Gateway   {DEFAULT_GATEWAY_URL}   miner key (empty)",
                f"  5 Review    the exact commands (copy with c) · writes {tmp_path}/home/node.toml",
            ]

            await pilot.press("ctrl+n")
            await settle(pilot)
            assert screen.step == "model"
            models = options(app, "#models")
            assert models[0].startswith("✔ smollm2-135m")
            assert models[1] == (
                "✔ qwen3.6-35b-a3b  — fits: tp 4, mem-fraction 0.83, 8 concurrent, FP8 KV, 262144 context  recommended"
            )
            assert models[2] == "? glm-5.2          — checkpoint needed: pass its directory"
            assert screen.answers.model == QWEN and screen.answers.checkpoint == str(tmp_path / "qwen")
            assert "· tp: 4: the smallest tensor-parallel size" in text_of(app, "#model-reasons")

            await pilot.press("ctrl+n")
            await settle(pilot)
            assert screen.step == "wallet"
            assert options(app, "#wallets") == [
                "default · hotkey miner1 (5Grw…utQY)",
                "no hotkey — the gateway admits this miner by its miner key",
                "create new wallet / hotkey…",
            ]
            assert (screen.answers.wallet_name, screen.answers.wallet_hotkey) == ("default", "miner1")

            await pilot.press("ctrl+n")
            await settle(pilot)
            assert screen.step == "gateway"
            key_field = screen.query_one("#miner-key", Input)
            assert key_field.password
            key_field.value = MINER_KEY
            await settle(pilot)
            assert text_of(app, "#key-shown") == "miner key ●●●●k3Pq"
            assert MINER_KEY not in text_of(app, "#setup-summary")

            await pilot.press("ctrl+n")
            await settle(pilot)
            assert screen.step == "review"
            assert text_of(app, "#review-problems") == "✔ ready to write"
            assert "$ engy-node plan\n  $ engy-node --role miner" in text_of(app, "#review-commands")
            preview = text_of(app, "#review-toml")
            assert 'miner_key = "●●●●k3Pq"' in preview and MINER_KEY not in preview and "port = 8000" in preview

            await pilot.press("c")
            assert app.clipboard == "engy-node plan\nengy-node --role miner"

            await pilot.click("#write")
            await settle(pilot)

        assert len(app.results) == 1 and app.results[0] == screen.answers
        written = tomllib.loads(facts.config_file.read_text())
        assert written["serve"] == {"port": 8000}
        assert written["miner"] == {
            "model": QWEN,
            "checkpoint": str(tmp_path / "qwen"),
            "gateway_url": DEFAULT_GATEWAY_URL,
            "miner_key": MINER_KEY,
            "wallets_path": str(tmp_path / "wallets"),
            "wallet_name": "default",
            "wallet_hotkey": "miner1",
        }
        assert stat.S_IMODE(facts.config_file.stat().st_mode) == 0o600
        assert facts.config_file.with_name("node.toml.bak").read_text() == "[serve]\nport = 8000\n"

    asyncio.run(scenario())


def test_without_a_gpu_the_wizard_says_cpu_mode_and_recommends_the_embedded_model(tmp_path):
    facts = rig_facts(tmp_path, inventory=no_gpu())

    async def scenario() -> None:
        app = Host(facts)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert "no NVIDIA GPU — CPU mode: no NVIDIA driver found" in text_of(app, "#setup-machine")
            await pilot.press("ctrl+n")
            await settle(pilot)
            models = options(app, "#models")
            assert models[0].startswith("✔ smollm2-135m") and models[0].endswith("recommended")
            assert models[1].startswith("✘ qwen3.6-35b-a3b  — does not fit: no NVIDIA GPU found")
            assert wizard(app).answers.model == SMOLLM2_135M.id

    asyncio.run(scenario())


def test_back_and_next_move_between_steps_and_the_role_decides_which(tmp_path):
    async def scenario() -> None:
        app = Host(rig_facts(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = wizard(app)
            await pilot.press("ctrl+b")
            assert screen.step == "role" and screen.query_one("#back", Button).disabled
            await pilot.click("#next")
            await pilot.click("#next")
            assert screen.step == "wallet"
            await pilot.press("ctrl+b")
            assert screen.step == "model"
            await pilot.click("#back")
            assert screen.step == "role"

            screen.query_one("#role-validator", RadioButton).value = True
            await settle(pilot)
            assert screen.answers.role == "validator" and screen.steps == ("role", "wallet", "chain", "review")
            assert "no hotkey — the gateway admits this miner by its miner key" not in options(app, "#wallets")
            for expected in ("wallet", "chain", "review", "review"):
                await pilot.press("ctrl+n")
                assert screen.step == expected
            assert not screen.query_one("#next", Button).display and screen.query_one("#write", Button).display
            assert "engy-node --role validator --validator-wallet default --validator-hotkey miner1" in text_of(
                app, "#review-commands"
            )

            await pilot.press("escape")
            await settle(pilot)
        assert app.results == [None]

    asyncio.run(scenario())


def test_unfinished_answers_are_listed_on_review_and_nothing_is_written(tmp_path):
    facts = rig_facts(tmp_path)

    async def scenario() -> None:
        app = Host(facts)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            for _ in range(2):
                await pilot.press("ctrl+n")
            await settle(pilot)
            await highlight(pilot, "#wallets", "none")
            for _ in range(2):
                await pilot.press("ctrl+n")
            await settle(pilot)
            problems = text_of(app, "#review-problems")
            assert "✘ a miner needs a miner key (issued by the gateway operator) or a registered hotkey" in problems
            assert wizard(app).query_one("#write", Button).disabled
            wizard(app).action_write()
            await settle(pilot)
        assert app.results == [] and not facts.config_file.exists()

    asyncio.run(scenario())


def test_a_checkpoint_typed_for_a_model_replans_it(tmp_path):
    async def scenario() -> None:
        app = Host(rig_facts(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("ctrl+n")
            await highlight(pilot, "#models", "glm-5.2")
            field = wizard(app).query_one("#checkpoint", Input)
            assert field.value == "" and wizard(app).answers.model == "glm-5.2"
            field.value = str(tmp_path / "nowhere")
            await settle(pilot)
            assert options(app, "#models")[2].startswith("? glm-5.2          — checkpoint unreadable: ")
            assert wizard(app).answers.checkpoint == str(tmp_path / "nowhere")
            await highlight(pilot, "#models", QWEN)
            assert field.value == str(tmp_path / "qwen") and wizard(app).answers.checkpoint == str(tmp_path / "qwen")

    asyncio.run(scenario())


def test_create_new_makes_a_wallet_and_selects_its_hotkey(tmp_path):
    wallets = tmp_path / "empty-wallets"

    async def scenario() -> None:
        app = Host(rig_facts(tmp_path, wallets_path=str(wallets)))
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = wizard(app)
            for _ in range(2):
                await pilot.press("ctrl+n")
            await settle(pilot)
            assert options(app, "#wallets") == [
                "no hotkey — the gateway admits this miner by its miner key",
                "create new wallet / hotkey…",
            ]
            assert not screen.query_one("#create-wallet").display
            await pilot.press("down")
            await settle(pilot)
            assert screen.query_one("#create-wallet").display
            screen.query_one("#new-hotkey", Input).value = "rig-a"
            await pilot.click("#create")
            await settle(pilot)

            assert (screen.answers.wallet_name, screen.answers.wallet_hotkey) == ("default", "rig-a")
            assert (wallets / "default" / "hotkeys" / "rig-a").is_file()
            listed = options(app, "#wallets")
            assert listed[0].startswith("default · hotkey rig-a (5") and listed[0].endswith(")")
            assert screen.query_one("#wallets", OptionList).highlighted == 0
            assert f"{wallets}/default · hotkey rig-a (5" in text_of(app, "#setup-summary")

    asyncio.run(scenario())


def test_c_in_a_field_types_a_c_and_copies_nothing(tmp_path):
    async def scenario() -> None:
        app = Host(rig_facts(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            for _ in range(3):
                await pilot.press("ctrl+n")
            await settle(pilot)
            assert wizard(app).focused is wizard(app).query_one("#gateway-url", Input)
            await pilot.press("end", "c")
            assert wizard(app).answers.gateway_url == DEFAULT_GATEWAY_URL + "c"
            assert app.clipboard == ""

    asyncio.run(scenario())


# ---- opening it from the palette ---------------------------------------------------------------


class PaletteHost(App[None]):
    """An app with the setup command in its palette and a node home, as the node manager has."""

    COMMANDS = App.COMMANDS | {SetupCommand}

    def __init__(self, home: str) -> None:
        super().__init__()
        self.home = home
        self.notices: list[tuple[str, str]] = []

    def notify(self, message: str, *, title: str = "", **kwargs) -> None:
        self.notices.append((title, message))
        super().notify(message, title=title, **kwargs)


async def until(pilot: Pilot, condition) -> None:
    for _ in range(200):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("the condition never held")


def test_the_palette_runs_setup_again_for_the_apps_home(tmp_path):
    (tmp_path / "node.toml").write_text('[miner]\nmodel = "smollm2-135m"\nworker_name = "rig-a"\n')

    async def scenario() -> None:
        app = PaletteHost(str(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+p", *"first-run")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, SetupScreen))
            await settle(pilot)
            screen = wizard(app)
            assert screen.facts.config_file == tmp_path.resolve() / "node.toml"
            assert screen.facts.existing["miner"]["worker_name"] == "rig-a"
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, SetupScreen))

    asyncio.run(scenario())


def test_a_broken_node_toml_is_reported_and_setup_does_not_open(tmp_path):
    (tmp_path / "node.toml").write_text("[miner\n")

    async def scenario() -> None:
        app = PaletteHost(str(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await open_setup(app, home=str(tmp_path))
            await pilot.pause()
            assert not isinstance(app.screen, SetupScreen)
            [(title, message)] = app.notices
            assert title == "setup" and "node.toml: not valid TOML" in message

    asyncio.run(scenario())


# ---- snapshots ----------------------------------------------------------------------------------


def snapshot_facts(tmp_path: Path, monkeypatch) -> SetupFacts:
    """The rig with relative paths under a fixed working directory, so no temporary path shows."""
    monkeypatch.chdir(tmp_path)
    make_wallet(Path("wallets"), "default", {"miner1": ALICE})
    make_qwen_checkpoint(Path("qwen"))
    return SetupFacts(
        inventory=rig(),
        config_file=Path("/home/miner/.config/engy/node.toml"),
        wallets_path="wallets",
        checkpoints={QWEN: "qwen"},
        ram_bytes=RAM,
    )


async def steps_forward(pilot: Pilot, count: int) -> None:
    await settle(pilot)
    for field in pilot.app.screen.query(Input):
        field.cursor_blink = False
    for _ in range(count):
        await pilot.press("ctrl+n")
        await settle(pilot)


def test_model_step_snapshot(snap_compare, tmp_path, monkeypatch):
    app = Host(snapshot_facts(tmp_path, monkeypatch))
    assert snap_compare(app, terminal_size=SIZE, run_before=lambda pilot: steps_forward(pilot, 1))


def test_review_step_snapshot(snap_compare, tmp_path, monkeypatch):
    app = Host(snapshot_facts(tmp_path, monkeypatch))

    async def to_review(pilot: Pilot) -> None:
        await steps_forward(pilot, 3)
        pilot.app.screen.query_one("#miner-key", Input).value = MINER_KEY
        await steps_forward(pilot, 1)

    assert snap_compare(app, terminal_size=SIZE, run_before=to_review)
