"""What the alert task publishes to the hub (`alerts`): the alerts firing now and how delivery
went. Declared here rather than in `engy_node.snapshots` (which re-exports them) so that the alert
rules own their shape; this module imports nothing of the node, so the schema module can import
it without a cycle."""

from __future__ import annotations

import dataclasses
from typing import Literal

AlertLevel = Literal["warning", "error"]


@dataclasses.dataclass(frozen=True, slots=True)
class Alert:
    """One condition that holds now, with what to do about it in `text`."""

    key: str = ""
    """Stable identity, `<rule>:<subject>`: the same key on consecutive checks is the same alert
    (notified once), a key that disappears has recovered."""
    rule: str = ""
    """`miner_pulled`, `breaker_open`, `miner_gated`, `miner_link`, `weights_stale`, `gpu`, `server_restarts`,
    `server_down`, `balance_low` (docs/operations.md lists what each watches)."""
    level: AlertLevel = "warning"
    subject: str = ""
    """What it is about: a miner and model, a GPU, a buyer account, the validator."""
    text: str = ""
    since: float | None = None
    """When it started firing (Unix time)."""
    notified_at: float | None = None
    """When a notification for it was last produced (first, or a reminder)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AlertsState:
    """The alert task (`alerts`)."""

    firing: tuple[Alert, ...] = ()
    webhooks: int = 0
    """How many webhooks notifications go to (0: alerts show here and in the TUI only)."""
    sent: int = 0
    """Webhook posts that succeeded since the node started."""
    failed: int = 0
    """Webhook posts given up on after their retries."""
    last_error: str | None = None
    """Why the last failed post failed; None once one succeeds after it."""
    checked_at: float | None = None
