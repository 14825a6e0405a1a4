"""After `engy-tui --setup` writes node.toml: what would start, and Start or Not now.

Write used to start the configured node at once — a miner straight onto the public gateway,
serving real buyers — before the user had seen where it connects. Now the wizard's result is
followed by this question, which names the role, where it connects (saying plainly when that is
the public network), the model, and the exact commands; "Not now" leaves node.toml written and
nothing running. The words are decided by `start_lines`, a plain function; `ConfirmStart` only
shows them and returns the answer (True: start).

A node that cannot run here is not offered: with `--fake-gpus` nothing can run on simulated GPUs
(as `engy-node --fake-gpus` launches nothing), and the dialogue says so instead.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from engy_node.config import ValidatorSection
from engy_node.setup import DEFAULT_GATEWAY_URL, SetupAnswers, commands

__all__ = ["ConfirmStart", "is_public", "start_lines"]

PUBLIC_GATEWAY_HOST = urlsplit(DEFAULT_GATEWAY_URL).hostname
PUBLIC_PROVIDER_HOST = urlsplit(ValidatorSection().provider_url).hostname
PUBLIC_CHAIN = ValidatorSection().network
"""Bittensor's main network, where SN53's validators set real weights."""


def is_public(url: str, public_host: str | None) -> bool:
    """Whether `url` points at the public network's server of that kind (by host name)."""
    try:
        return urlsplit(url.strip()).hostname == public_host
    except ValueError:
        return False


def start_lines(answers: SetupAnswers, *, home: str | None = None, fake_gpus: str = "") -> list[tuple[str, str]]:
    """(label, text) rows saying what starting this setup does; a text starting with ⚠ is a
    warning the dialogue shows as one."""
    role = answers.role
    rows = [("role", {"local": "a whole local network on this machine"}.get(role, role))]
    if role == "miner":
        url = answers.gateway_url
        where = (
            "⚠ the public engy network's gateway: real buyers' requests"
            if is_public(url, PUBLIC_GATEWAY_HOST)
            else "a private gateway (not the public network's)"
        )
        rows += [("gateway", f"{url} — {where}"), ("model", answers.model)]
    elif role == "validator":
        chain = (
            "⚠ Bittensor's main network: the weights it sets are real"
            if answers.network == PUBLIC_CHAIN
            else "not the main network"
        )
        provider = (
            "the public engy provider"
            if is_public(answers.provider_url, PUBLIC_PROVIDER_HOST)
            else "a private provider"
        )
        rows += [("chain", f"{answers.network} — {chain}"), ("provider", f"{answers.provider_url} — {provider}")]
    elif role == "gateway":
        rows += [
            ("serves", "buyers and miners from this machine (no public gateway involved)"),
            ("model", answers.model),
        ]
    else:
        rows.append(("network", "loopback only: nothing reaches the public network"))
    rows += [("command", f"$ {line}") for line in commands(answers, home=home)]
    if fake_gpus:
        rows.append(
            (
                "GPUs",
                f"⚠ simulated (--fake-gpus {fake_gpus}): nothing can run on them, so nothing starts here; "
                "run the commands on the machine that has these GPUs",
            )
        )
    return rows


class ConfirmStart(ModalScreen[bool]):
    """ "Start the node now?" after setup wrote node.toml; dismisses True to start."""

    DEFAULT_CSS = """
    ConfirmStart { align: center middle; }
    ConfirmStart > Vertical {
        width: 90%; max-width: 120; height: auto;
        padding: 1 2; border: thick $warning; background: $surface;
    }
    ConfirmStart #start-buttons { height: auto; margin-top: 1; }
    ConfirmStart #start-buttons Button { margin-right: 2; }
    """
    AUTO_FOCUS = "#not-now"
    """Not Start, and from the screen's first moment (a focus set on mount comes a message later,
    after the default had focused Start): an Enter meant for "Write node.toml" must not start a
    node."""
    BINDINGS = [
        Binding("s", "answer(True)", "Start", id="start.confirm"),
        Binding("n,escape", "answer(False)", "Not now", id="start.cancel"),
    ]

    def __init__(
        self, answers: SetupAnswers, *, home: str | None, config_file: str, fake_gpus: str = "", can_start: bool = True
    ) -> None:
        super().__init__()
        self.rows = start_lines(answers, home=home, fake_gpus=fake_gpus)
        self.config_file = config_file
        self.can_start = can_start and not fake_gpus

    def compose(self) -> ComposeResult:
        text = Text()
        text.append(f"✔ wrote {self.config_file}\n\n", style="bold")
        text.append(
            "Start this node inside engy-tui now?\n" if self.can_start else "Nothing starts here:\n", style="bold"
        )
        for label, value in self.rows:
            text.append(f"  {label:<9} ")
            text.append(value + "\n", style="bold yellow" if value.startswith("⚠") else "")
        text.append(
            "\nStart: runs it here (quitting engy-tui stops it).  Not now: starts nothing; run the commands when ready."
            if self.can_start
            else "\nClose leaves node.toml written; run the commands when ready.",
            style="dim",
        )
        with Vertical():
            yield Static(text, id="start-summary")
            with Horizontal(id="start-buttons"):
                if self.can_start:
                    yield Button("Start (s)", id="start", variant="warning")
                yield Button("Not now (n)" if self.can_start else "Close (n)", id="not-now", variant="primary")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.action_answer(event.button.id == "start")

    def action_answer(self, start: bool) -> None:
        self.dismiss(start and self.can_start)
