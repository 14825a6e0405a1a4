"""The first-run setup wizard (docs/architecture.md, "The TUI"): one question per step, always showing
what it found.

Steps follow the role: a miner answers role, model, wallet, gateway and review; a validator
role, wallet, chain and review; a gateway role, model and review; a local network role and
review. The machine line (GPUs, or "no NVIDIA GPU — CPU mode") stays on top and the answers so
far stay listed under it, one line per step, so every step shows what the others decided.

Every decision is `engy_node.setup`'s: the screen holds the current `SetupAnswers`, shows what
those functions say about them, and writes `node.toml` through `write_node_toml`. Work that
touches the disk beyond that one write runs in thread workers that only post messages: planning
(`model_choices` reads checkpoints), listing wallets and creating one (`keys.create_wallet`,
which imports bittensor). A result that arrives after its input changed again is dropped.

Use: `await open_setup(app, home=home)` gathers the facts in a thread and pushes the wizard;
`SetupCommand` offers the same in the command palette ("Setup: run first-run setup"), so setup
can be run again at any time. Underneath, `app.push_screen(SetupScreen(facts), callback)`: the
callback gets the written `SetupAnswers`, or None when the user left without writing; `facts`
come from `engy_node.setup.gather_facts(home)` or, in tests, are made up.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, ContentSwitcher, Footer, Input, Label, OptionList, RadioButton, RadioSet, Static
from textual.widgets.option_list import Option

from engy_node import keys
from engy_node.diagnose import mask_value
from engy_node.errors import EngyError
from engy_node.hardware.fake_nvml import FakeNvml
from engy_node.models import CATALOG
from engy_node.setup import (
    ROLE_LABELS,
    ROLES,
    ModelChoice,
    Role,
    SetupAnswers,
    SetupFacts,
    WalletEntry,
    answers_from,
    commands,
    gather_facts,
    list_wallets,
    machine_line,
    model_choices,
    node_toml,
    preview_toml,
    short_ss58,
    validate,
    write_node_toml,
)

__all__ = ["STEPS", "SetupCommand", "SetupScreen", "open_setup", "step_summary"]

STEPS: dict[Role, tuple[str, ...]] = {
    "miner": ("role", "model", "wallet", "gateway", "review"),
    "validator": ("role", "wallet", "chain", "review"),
    "gateway": ("role", "model", "review"),
    "local": ("role", "review"),
}
"""The questions each role answers, in order."""
STEP_TITLES = {
    "role": "Role",
    "model": "Model",
    "wallet": "Wallet",
    "gateway": "Gateway",
    "chain": "Chain",
    "review": "Review",
}
NO_HOTKEY = "none"
CREATE = "create"
TEXT_FIELDS = {
    "gateway-url": "gateway_url",
    "miner-key": "miner_key",
    "network": "network",
    "provider-url": "provider_url",
    "master-hotkey": "master_hotkey",
}
"""Input id -> the answer it sets."""
MARK_STYLES = {"✔": "green", "✘": "red", "?": "yellow"}


def tilde(path: str | Path) -> str:
    """`path` with the home directory written as `~`, as people read paths."""
    text, home = str(path), str(Path.home())
    return "~" + text[len(home) :] if text == home or text.startswith(home + "/") else text


def hotkey_address(wallets: Sequence[WalletEntry], wallet: str, hotkey: str) -> str | None:
    return next(
        (entry.ss58 for found in wallets if found.name == wallet for entry in found.hotkeys if entry.name == hotkey),
        None,
    )


def step_summary(
    step: str,
    answers: SetupAnswers,
    *,
    choices: Sequence[ModelChoice],
    wallets: Sequence[WalletEntry],
    config_file: Path,
) -> str:
    """What a step has decided, in one line (the wizard lists one per step)."""
    if step == "role":
        return ROLE_LABELS[answers.role]
    if step == "model":
        choice = next((c for c in choices if c.id == answers.model), None)
        if choice is None:
            return f"{answers.model} — planning…"
        return f"{choice.id} — {choice.verdict}  {choice.mark}" + (" recommended" if choice.recommended else "")
    if step == "wallet":
        if not answers.wallet_name:
            return (
                "no hotkey: the gateway admits this miner by its miner key"
                if answers.role == "miner"
                else "none chosen"
            )
        address = short_ss58(hotkey_address(wallets, answers.wallet_name, answers.wallet_hotkey))
        return f"{tilde(answers.wallets_path.rstrip('/'))}/{answers.wallet_name} · hotkey {answers.wallet_hotkey} ({address})"
    if step == "gateway":
        return f"{answers.gateway_url or '(no URL)'}   miner key {mask_value(answers.miner_key)}"
    if step == "chain":
        return f"{answers.network} · provider {answers.provider_url} · master {short_ss58(answers.master_hotkey)}"
    return f"the exact commands (copy with c) · writes {tilde(config_file)}"


class SetupScreen(Screen[SetupAnswers | None]):
    """The setup wizard; dismisses with the written `SetupAnswers`, or None when cancelled."""

    DEFAULT_CSS = """
    SetupScreen { layout: vertical; }
    SetupScreen #setup-machine { padding: 0 1; text-style: bold; }
    SetupScreen #setup-summary { padding: 0 1; margin-bottom: 1; border-bottom: solid $primary; height: auto; }
    SetupScreen #setup-pages { height: 1fr; }
    SetupScreen #setup-pages > VerticalScroll { padding: 0 1; }
    SetupScreen .question { text-style: bold; margin-bottom: 1; }
    SetupScreen .field { margin-top: 1; color: $text-muted; }
    SetupScreen .note { color: $text-muted; margin-top: 1; }
    SetupScreen OptionList { height: auto; max-height: 12; }
    SetupScreen #create-wallet { height: auto; margin-top: 1; display: none; }
    SetupScreen #create-wallet Input { width: 1fr; }
    SetupScreen #review-problems { margin-bottom: 1; }
    SetupScreen #review-toml { border: round $primary; padding: 0 1; height: auto; }
    SetupScreen #setup-nav { height: auto; padding: 0 1; }
    SetupScreen #setup-nav Button { margin-right: 2; }
    """

    BINDINGS = [
        Binding(
            "ctrl+n", "next", "Next", id="setup.next", tooltip="Go to the next question (Enter in a field does too)."
        ),
        Binding("ctrl+b", "back", "Back", id="setup.back", tooltip="Go back one question; nothing is lost."),
        Binding(
            "c",
            "copy",
            "Copy commands",
            id="setup.copy",
            tooltip="Copy the exact commands that start this node to the clipboard.",
        ),
        Binding("escape", "cancel", "Cancel", id="setup.cancel", tooltip="Leave setup without writing node.toml."),
    ]

    class Planned(Message):
        """`model_choices` finished for these checkpoints."""

        def __init__(self, checkpoints: Mapping[str, str], choices: list[ModelChoice]) -> None:
            super().__init__()
            self.checkpoints, self.choices = dict(checkpoints), choices

    class WalletsListed(Message):
        """`list_wallets` finished for this path."""

        def __init__(self, wallets_path: str, wallets: list[WalletEntry]) -> None:
            super().__init__()
            self.wallets_path, self.wallets = wallets_path, wallets

    class WalletCreated(Message):
        def __init__(self, wallet: str, hotkey: str, ss58: str) -> None:
            super().__init__()
            self.wallet, self.hotkey, self.ss58 = wallet, hotkey, ss58

    class WalletCreateFailed(Message):
        def __init__(self, error: str) -> None:
            super().__init__()
            self.error = error

    def __init__(
        self, facts: SetupFacts, *, fake_gpus: str = "", name: str | None = None, id: str | None = None
    ) -> None:
        super().__init__(name=name, id=id)
        self.facts = facts
        self.fake_gpus = fake_gpus
        """The `--fake-gpus` spec `facts.inventory` was made from; the top line says so."""
        self.answers = dataclasses.replace(answers_from(facts.existing), wallets_path=facts.wallets_path)
        self.checkpoints: dict[str, str] = dict(facts.checkpoints)
        """Model id -> checkpoint directory, as entered; the answers carry the chosen model's."""
        if self.answers.checkpoint:
            self.checkpoints.setdefault(self.answers.model, self.answers.checkpoint)
        self.choices: list[ModelChoice] = []
        self.model_decided = isinstance(facts.existing.get("miner"), Mapping) and "model" in facts.existing["miner"]
        """False until a model is decided: on a first run the first plan picks the recommended one."""
        self.wallets: list[WalletEntry] = []
        self.step_index = 0

    # ---- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        answers = self.answers
        yield Static(id="setup-machine")
        yield Static(id="setup-summary")
        with ContentSwitcher(initial="step-role", id="setup-pages"):
            with VerticalScroll(id="step-role"):
                yield Label("What should this machine do?", classes="question")
                with RadioSet(id="role"):
                    for role in ROLES:
                        yield RadioButton(ROLE_LABELS[role], value=role == answers.role, id=f"role-{role}")
            with VerticalScroll(id="step-model"):
                yield Label(
                    "Which model? ✔ fits this machine · ✘ does not · ? needs its checkpoint", classes="question"
                )
                yield OptionList(id="models")
                yield Label("Checkpoint directory (config.json + *.safetensors, what sglang loads)", classes="field")
                yield Input(id="checkpoint")
                yield Static(id="model-reasons", classes="note")
            with VerticalScroll(id="step-wallet"):
                yield Label("Which hotkey signs for this node?", classes="question")
                yield Label("Wallets directory", classes="field")
                yield Input(answers.wallets_path, id="wallets-path")
                yield OptionList(id="wallets")
                with Horizontal(id="create-wallet"):
                    yield Input("default", placeholder="wallet name", id="new-wallet")
                    yield Input("miner1", placeholder="hotkey name", id="new-hotkey")
                    yield Button("Create", id="create")
                yield Static(id="wallet-note", classes="note")
            with VerticalScroll(id="step-gateway"):
                yield Label("Which gateway, and what key did its operator issue?", classes="question")
                yield Label("Gateway URL", classes="field")
                yield Input(answers.gateway_url, placeholder="wss://api.engy.ai/gw", id="gateway-url")
                yield Label("Miner key (hidden; leave empty to be admitted by the hotkey's signature)", classes="field")
                yield Input(answers.miner_key, password=True, id="miner-key")
                yield Static(id="key-shown", classes="note")
            with VerticalScroll(id="step-chain"):
                yield Label("Which chain and which provider's weights?", classes="question")
                yield Label("Network (finney, test, local or a ws(s):// URL)", classes="field")
                yield Input(answers.network, id="network")
                yield Label("Provider URL", classes="field")
                yield Input(answers.provider_url, id="provider-url")
                yield Label("Master hotkey (signs the provider's epoch results)", classes="field")
                yield Input(answers.master_hotkey, id="master-hotkey")
            with VerticalScroll(id="step-review"):
                yield Static(id="review-problems")
                yield Static(id="review-commands")
                yield Static(id="review-toml")
        with Horizontal(id="setup-nav"):
            yield Button("Back", id="back")
            yield Button("Next", id="next", variant="primary")
            yield Button("Write node.toml", id="write", variant="success")
        yield Footer()

    def on_mount(self) -> None:
        machine = Text(
            f"Welcome to engy. Simulated GPUs (--fake-gpus {self.fake_gpus}):  "
            if self.fake_gpus
            else "Welcome to engy. This machine:  ",
            style="bold",
        )
        machine.append(machine_line(self.facts.inventory, ram_bytes=self.facts.ram_bytes), style="not bold")
        self.query_one("#setup-machine", Static).update(machine)
        self._plan()
        self._list_wallets(self.answers.wallets_path)
        self._show_key()
        self._show_step()

    # ---- navigation ---------------------------------------------------------------------------

    @property
    def steps(self) -> tuple[str, ...]:
        return STEPS[self.answers.role]

    @property
    def step(self) -> str:
        return self.steps[self.step_index]

    def action_next(self) -> None:
        if self.step_index < len(self.steps) - 1:
            self.step_index += 1
            self._show_step()

    def action_back(self) -> None:
        if self.step_index > 0:
            self.step_index -= 1
            self._show_step()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_copy(self) -> None:
        lines = commands(self.answers, home=self.facts.home)
        self.app.copy_to_clipboard("\n".join(lines))
        self.notify("\n".join(lines), title=f"copied {len(lines)} command{'s' if len(lines) != 1 else ''}")

    def action_write(self) -> None:
        problems = validate(self.answers, self.choices)
        if problems:
            self.notify("\n".join(problems), title="fix these first", severity="error")
            return
        try:
            backup = write_node_toml(self.facts.config_file, node_toml(self.answers, self.facts.existing))
        except OSError as err:
            self.notify(
                f"cannot write {self.facts.config_file}: {err.strerror or err}; check the directory's permissions",
                title="node.toml not written",
                severity="error",
            )
            return
        kept = f" (the old one is {tilde(backup)})" if backup else ""
        self.notify(f"wrote {tilde(self.facts.config_file)}{kept}", title="setup")
        self.dismiss(self.answers)

    @on(Button.Pressed, "#next")
    def _next_pressed(self) -> None:
        self.action_next()

    @on(Button.Pressed, "#back")
    def _back_pressed(self) -> None:
        self.action_back()

    @on(Button.Pressed, "#write")
    def _write_pressed(self) -> None:
        self.action_write()

    @on(Input.Submitted)
    def _field_submitted(self, event: Input.Submitted) -> None:
        if event.input.id in ("new-wallet", "new-hotkey"):
            self._create_pressed()
        else:
            self.action_next()

    @on(OptionList.OptionSelected)
    def _option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option_id != CREATE:
            self.action_next()

    def _show_step(self) -> None:
        self.query_one(ContentSwitcher).current = f"step-{self.step}"
        self.query_one("#back", Button).disabled = self.step_index == 0
        self.query_one("#next", Button).display = self.step != "review"
        self.query_one("#write", Button).display = self.step == "review"
        if self.step == "review":
            self._show_review()
        self._show_summary()
        first = {
            "role": "#role",
            "model": "#models",
            "wallet": "#wallets",
            "gateway": "#gateway-url",
            "chain": "#network",
            "review": "#write",
        }[self.step]
        if first == "#write" and self.query_one("#write", Button).disabled:
            first = "#back"
        self.query_one(first).focus()

    def _show_summary(self) -> None:
        text = Text()
        for number, step in enumerate(self.steps, start=1):
            current = step == self.step
            line = step_summary(
                step, self.answers, choices=self.choices, wallets=self.wallets, config_file=self.facts.config_file
            )
            text.append(f"{'▶' if current else ' '} {number} {STEP_TITLES[step]:<9} ", style="bold" if current else "")
            text.append(line + "\n", style="" if current else "dim")
        text.rstrip()
        self.query_one("#setup-summary", Static).update(text)

    def _set(self, **changes: Any) -> None:
        """Change answers and show what that changes (`role` is a `Role`, the others text)."""
        self.answers = dataclasses.replace(self.answers, **changes)
        self._show_summary()
        if self.step == "review":
            self._show_review()

    # ---- role ---------------------------------------------------------------------------------

    @on(RadioSet.Changed, "#role")
    def _role_changed(self, event: RadioSet.Changed) -> None:
        role = str(event.pressed.id).removeprefix("role-")
        if role != self.answers.role:
            self._set(role=role)
            self._fill_wallets()

    # ---- model --------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="plan")
    def _plan(self) -> None:
        checkpoints = dict(self.checkpoints)
        self.post_message(self.Planned(checkpoints, model_choices(self.facts.inventory, checkpoints=checkpoints)))

    @on(Planned)
    def _planned(self, event: Planned) -> None:
        if event.checkpoints != self.checkpoints:
            return
        self.choices = event.choices
        recommended = next((choice.id for choice in self.choices if choice.recommended), None)
        if not self.model_decided and recommended is not None:
            self._set(model=recommended, checkpoint=self.checkpoints.get(recommended, ""))
        self.model_decided = True
        models = self.query_one("#models", OptionList)
        models.clear_options()
        models.add_options([Option(self._choice_prompt(choice), id=choice.id) for choice in self.choices])
        ids = [choice.id for choice in self.choices]
        models.highlighted = ids.index(self.answers.model) if self.answers.model in ids else 0
        self._show_reasons()
        self._set()

    @staticmethod
    def _choice_prompt(choice: ModelChoice) -> Text:
        text = Text()
        text.append(f"{choice.mark} ", style=MARK_STYLES[choice.mark])
        text.append(f"{choice.id:<16} — {choice.verdict}")
        if choice.recommended:
            text.append("  recommended", style="bold green")
        return text

    @on(OptionList.OptionHighlighted, "#models")
    def _model_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        model = str(event.option_id)
        checkpoint = self.checkpoints.get(model, "")
        field = self.query_one("#checkpoint", Input)
        field.placeholder = (
            "embedded: none needed (converted at first start)"
            if CATALOG[model].embedded
            else f"the directory holding {CATALOG[model].hf_repo}"
        )
        if field.value != checkpoint:
            field.value = checkpoint
        self._set(model=model, checkpoint=checkpoint)
        self._show_reasons()

    @on(Input.Changed, "#checkpoint")
    def _checkpoint_changed(self, event: Input.Changed) -> None:
        model = self.answers.model
        if event.value == self.checkpoints.get(model, ""):
            return
        if event.value:
            self.checkpoints[model] = event.value
        else:
            self.checkpoints.pop(model, None)
        self._set(checkpoint=event.value)
        self._plan()

    def _show_reasons(self) -> None:
        choice = next((c for c in self.choices if c.id == self.answers.model), None)
        reasons = "" if choice is None else "\n".join(f"· {reason}" for reason in choice.reasons)
        self.query_one("#model-reasons", Static).update(Text(reasons))

    # ---- wallet -------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="wallets")
    def _list_wallets(self, wallets_path: str) -> None:
        self.post_message(self.WalletsListed(wallets_path, list_wallets(wallets_path)))

    @on(WalletsListed)
    def _wallets_listed(self, event: WalletsListed) -> None:
        if event.wallets_path != self.answers.wallets_path:
            return
        self.wallets = event.wallets
        self._fill_wallets()

    def _fill_wallets(self) -> None:
        """The hotkeys found, "no hotkey" for a miner, and "create new"; the current answer
        highlighted, else the first usable hotkey."""
        options = [
            Option(
                f"{wallet.name} · hotkey {entry.name} ({short_ss58(entry.ss58)})"
                + (" — encrypted: the node signs unattended and cannot use it" if entry.encrypted else ""),
                id=f"hotkey:{wallet.name}/{entry.name}",
                disabled=entry.encrypted,
            )
            for wallet in self.wallets
            for entry in wallet.hotkeys
        ]
        if self.answers.role == "miner":
            options.append(Option("no hotkey — the gateway admits this miner by its miner key", id=NO_HOTKEY))
        options.append(Option("create new wallet / hotkey…", id=CREATE))
        wallets = self.query_one("#wallets", OptionList)
        wallets.clear_options()
        wallets.add_options(options)
        usable = [option.id for option in options if not option.disabled]
        current = f"hotkey:{self.answers.wallet_name}/{self.answers.wallet_hotkey}"
        chosen = current if current in usable else usable[0]
        wallets.highlighted = [option.id for option in options].index(chosen)
        found = sum(len(wallet.hotkeys) for wallet in self.wallets)
        self.query_one("#wallet-note", Static).update(
            f"{found} hotkey{'s' if found != 1 else ''} in {len(self.wallets)} wallet{'s' if len(self.wallets) != 1 else ''} "
            f"under {tilde(self.answers.wallets_path)}. Create makes an unencrypted coldkey and hotkey where missing "
            "(btcli's default for hotkeys); protect a coldkey that will hold funds with btcli."
        )

    @on(OptionList.OptionHighlighted, "#wallets")
    def _wallet_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        choice = str(event.option_id)
        self.query_one("#create-wallet").display = choice == CREATE
        if choice.startswith("hotkey:"):
            wallet, _, hotkey = choice.removeprefix("hotkey:").partition("/")
            self._set(wallet_name=wallet, wallet_hotkey=hotkey)
        elif choice == NO_HOTKEY:
            self._set(wallet_name="", wallet_hotkey="")

    @on(Input.Changed, "#wallets-path")
    def _wallets_path_changed(self, event: Input.Changed) -> None:
        if event.value != self.answers.wallets_path:
            self._set(wallets_path=event.value)
            self._list_wallets(event.value)

    @on(Button.Pressed, "#create")
    def _create_pressed(self) -> None:
        wallet = self.query_one("#new-wallet", Input).value.strip()
        hotkey = self.query_one("#new-hotkey", Input).value.strip()
        self.notify(f"creating wallet {wallet}, hotkey {hotkey}…", title="wallet")
        self._create_wallet(self.answers.wallets_path, wallet, hotkey)

    @work(thread=True, exclusive=True, group="create-wallet")
    def _create_wallet(self, wallets_path: str, wallet: str, hotkey: str) -> None:
        try:
            ss58 = keys.create_wallet(wallets_path, wallet, hotkey)
        except EngyError as err:
            self.post_message(self.WalletCreateFailed(str(err)))
            return
        self.post_message(self.WalletCreated(wallet, hotkey, ss58))

    @on(WalletCreated)
    def _wallet_created(self, event: WalletCreated) -> None:
        self.notify(f"wallet {event.wallet}, hotkey {event.hotkey} ({short_ss58(event.ss58)})", title="wallet created")
        self._set(wallet_name=event.wallet, wallet_hotkey=event.hotkey)
        self._list_wallets(self.answers.wallets_path)

    @on(WalletCreateFailed)
    def _wallet_create_failed(self, event: WalletCreateFailed) -> None:
        self.notify(event.error, title="wallet not created", severity="error")

    # ---- gateway and chain --------------------------------------------------------------------

    @on(Input.Changed, "#gateway-url, #miner-key, #network, #provider-url, #master-hotkey")
    def _field_changed(self, event: Input.Changed) -> None:
        field = TEXT_FIELDS[str(event.input.id)]
        if getattr(self.answers, field) != event.value:
            self._set(**{field: event.value})
            self._show_key()

    def _show_key(self) -> None:
        self.query_one("#key-shown", Static).update(f"miner key {mask_value(self.answers.miner_key)}")

    # ---- review -------------------------------------------------------------------------------

    def _show_review(self) -> None:
        problems = validate(self.answers, self.choices)
        shown = Text()
        if problems:
            shown.append("Fix these before writing (Back goes to the step):\n", style="bold")
            for problem in problems:
                shown.append(f"✘ {problem}\n", style="red")
        else:
            shown.append("✔ ready to write\n", style="green")
        shown.rstrip()
        self.query_one("#review-problems", Static).update(shown)
        lines = commands(self.answers, home=self.facts.home)
        listing = Text()
        listing.append("Then run (c copies them):\n", style="bold")
        for line in lines:
            listing.append(f"  $ {line}\n")
        if self.answers.role == "miner":
            listing.append(
                "  (engy-node plan prints the exact sglang command the miner launches and supervises)\n", style="dim"
            )
        listing.rstrip()
        self.query_one("#review-commands", Static).update(listing)
        preview = self.query_one("#review-toml", Static)
        preview.border_title = f"writes {tilde(self.facts.config_file)} (mode 0600)"
        preview.update(Text(preview_toml(self.answers, self.facts.existing).rstrip()))
        self.query_one("#write", Button).disabled = bool(problems)


# ---- opening it ---------------------------------------------------------------------------------

COMMAND_TITLE = "Setup: run first-run setup"
COMMAND_HELP = (
    "choose role, model, wallet and gateway again and rewrite node.toml (the old one is kept as node.toml.bak)"
)


async def open_setup(
    app: App,
    *,
    home: str | None = None,
    on_done: Callable[[SetupAnswers | None], None] | None = None,
    fake_gpus: str = "",
) -> None:
    """Gather this machine's facts in a thread (NVML, node.toml, memory) and push the wizard.
    `on_done` gets its result; by default a written setup is answered with the commands to run.
    With `fake_gpus` (a `--fake-gpus` spec) the wizard plans for those simulated GPUs instead.
    A node.toml that is not TOML is reported, not overwritten."""
    try:
        nvml = FakeNvml.from_spec(fake_gpus) if fake_gpus else None
        facts = await asyncio.to_thread(gather_facts, home, nvml=nvml)
    except EngyError as err:
        app.notify(str(err), title="setup", severity="error")
        return

    def announce(answers: SetupAnswers | None) -> None:
        if answers is not None:
            app.notify("now run:\n" + "\n".join(commands(answers, home=home)), title="node.toml written", timeout=20)

    app.push_screen(SetupScreen(facts, fake_gpus=fake_gpus), callback=on_done or announce)


class SetupCommand(Provider):
    """The palette's setup command. It opens setup for the app's `home` attribute (the node's
    `--home`, as `NodeManager` keeps it; None: the user dirs)."""

    async def discover(self) -> Hits:
        yield DiscoveryHit(COMMAND_TITLE, self._open, help=COMMAND_HELP)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        score = matcher.match(COMMAND_TITLE)
        if score > 0:
            yield Hit(score, matcher.highlight(COMMAND_TITLE), self._open, help=COMMAND_HELP)

    async def _open(self) -> None:
        await open_setup(self.app, home=getattr(self.app, "home", None))
