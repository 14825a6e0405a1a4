"""The `[alerts]` config section: where notifications go and the thresholds the rules use.

Kept beside the rules rather than in `engy_node.config` (which lists it in its sections): the
thresholds mean what `rules` makes of them, and both change together. Only scalar settings, like
every section: the webhooks are one `KIND=URL,KIND=URL` string, so `ENGY_ALERTS__WEBHOOKS` can
carry them as well as `node.toml`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from engy_node.errors import ConfigError

WebhookKind = Literal["discord", "slack", "telegram", "json"]
WEBHOOK_KINDS: tuple[WebhookKind, ...] = ("discord", "slack", "telegram", "json")


@dataclasses.dataclass(frozen=True, slots=True)
class AlertsSection:
    webhooks: str = ""
    """Where notifications go: `KIND=URL` pairs, comma-separated; KIND is discord, slack, telegram
    (`https://api.telegram.org/bot<TOKEN>/sendMessage?chat_id=<CHAT>`) or json (any receiver: the
    alert as a JSON object). Empty: alerts show in the TUI and `engy-node status` only."""
    check_s: float = 15.0
    """How often the rules run over the node's states."""
    timeout_s: float = 10.0
    """One webhook post's limit, connect to answer."""
    retries: int = 2
    """Further tries of a failed post (1 s, then 2 s, … apart) before it is given up and logged."""
    renotify_s: float = 0.0
    """Repeat a still-firing alert this often; 0: once, then only its recovery."""
    weights_stale_blocks: int = 600
    """Validator: alert when its weights last landed this many blocks ago (about 2 h at 12 s a
    block; the validator resubmits every `validator.resubmit_blocks`)."""
    balance_low_usd_micro: int = 1_000_000
    """Gateway: alert when a buyer's available balance is below this many µUSD ($1)."""
    restart_window_s: float = 900.0
    """Miner: a model-server restart keeps its alert firing this long after it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Webhook:
    kind: WebhookKind
    url: str


def webhooks(section: AlertsSection) -> tuple[Webhook, ...]:
    """`alerts.webhooks` parsed; raises `ConfigError` naming the fix for a malformed entry."""
    found = []
    for item in (part.strip() for part in section.webhooks.split(",")):
        if not item:
            continue
        kind, sep, url = item.partition("=")
        kind, url = kind.strip().lower(), url.strip()
        if not sep or kind not in WEBHOOK_KINDS:
            raise ConfigError(
                f"alerts.webhooks entry {item[:40]!r}: write KIND=URL with KIND one of {', '.join(WEBHOOK_KINDS)}"
            )
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"alerts.webhooks {kind} URL must start with http:// or https://")
        if kind == "telegram" and "chat_id=" not in url:
            raise ConfigError(
                "alerts.webhooks telegram URL needs the chat: "
                "https://api.telegram.org/bot<TOKEN>/sendMessage?chat_id=<CHAT>"
            )
        found.append(Webhook(kind, url))
    return tuple(found)


def validate(section: AlertsSection) -> None:
    """What `engy_node.config` checks of this section when it loads."""
    webhooks(section)
    if section.check_s <= 0 or section.timeout_s <= 0:
        raise ConfigError("alerts.check_s and alerts.timeout_s must be positive")
    if section.retries < 0 or section.renotify_s < 0 or section.restart_window_s < 0:
        raise ConfigError("alerts.retries, alerts.renotify_s and alerts.restart_window_s must be 0 or more")
    if section.weights_stale_blocks < 1 or section.balance_low_usd_micro < 0:
        raise ConfigError("alerts.weights_stale_blocks must be at least 1, alerts.balance_low_usd_micro 0 or more")
