"""The alert rules: which conditions hold in a node's states, and what to tell the operator.

Pure decisions over plain data, no IO and no clock: `evaluate(book, states, limits, now)` returns
the next book and the notifications to send, and the task (`alerts.task`) does the sending. A
check therefore replays from its inputs, and the tests drive every rule and every sequence of
checks without a node.

The rules read only what the node already publishes (`engy_node.snapshots`):

* `miner_pulled` / `breaker_open` — a (miner, model) the gateway's traffic policy holds `pulled`;
  `breaker_open` when the pull was the circuit breaker's (its last change carries a breaker code),
  `miner_pulled` for a cheat verdict or a lost qualification round.
* `miner_gated` — a miner whose newest published epoch has a row a settlement gate zeroed (its
  TTFT p99 over the model's ceiling, say), as its gateway told it (`MinerState.epoch`): the gate,
  the measurement against its bar, the fix, and when the next epoch can restore it. It recovers
  when a newer epoch has no gated row.
* `miner_link` — a miner with no leg up that the gateway denied, or whose dial fails.
* `weights_stale` — a validator whose weights last landed `weights_stale_blocks` or more ago (or
  whose uid's last update is that old, when this process has not landed any yet; with the chain
  unreachable, counted on the wall clock since the last landing or the node's start).
* `gpu` — the GPU monitor's findings about throttling, temperature, a GPU lost from the bus or
  an Xid error (NVML's Xid events, `hardware.xids`: one alert per GPU and Xid number, recovered
  when the GPU has had no Xid for `hardware.xids.XID_RECENT_S`), and any finding at error level.
* `server_down` / `server_restarts` — a model server failed or restarting, or one that restarted
  within `restart_window_s` (the book remembers each server's restart count and when it rose).
* `balance_low` — a buyer among those the gateway publishes whose available balance is under
  `balance_low_usd_micro` (integer µUSD, like every amount).

Dedup: an alert is notified when it starts, then not again while it fires unless `renotify_s`
asks for reminders; when its condition no longer holds it is notified once as recovered. Its
text may change while it fires (a block count grows) without a new notification.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Literal

from engy_node.alerts.state import Alert, AlertLevel
from engy_node.money import format_usd
from engy_node.protocol.epoch import WEIGHT_MAX
from engy_node.protocol.gates import block_time_s, finding_text, restore_text
from engy_node.snapshots import GpusState, NodeStates, TrafficPolicyState, ValidatorState

RULES = (
    "miner_pulled",
    "breaker_open",
    "miner_gated",
    "miner_link",
    "weights_stale",
    "gpu",
    "server_down",
    "server_restarts",
    "balance_low",
)
"""Every rule, in the order `conditions` checks them (the `engy_alerts_firing` gauge has one series
each, 0 when quiet)."""
BREAKER_CODES = frozenset({"failures-in-a-row", "failure-rate", "slow-ttft", "slow-tpot", "unproven-rate"})
"""The traffic policy's transition codes for a pull by the circuit breaker
(`gateway.trust.traffic._judge_breaker`)."""
GPU_KINDS = frozenset({"throttling", "temperature", "lost", "xid"})
"""GPU monitor findings that alert at any level; other kinds alert only at error level."""
SERVER_DOWN_STATES = frozenset({"failed", "restarting"})


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The thresholds (`[alerts]`, `alerts.settings.AlertsSection`)."""

    weights_stale_blocks: int = 600
    balance_low_usd_micro: int = 1_000_000
    restart_window_s: float = 900.0
    renotify_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Condition:
    """A rule that holds now (an alert without its timing)."""

    rule: str
    level: AlertLevel
    subject: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.rule}:{self.subject}"


@dataclasses.dataclass(frozen=True, slots=True)
class Notification:
    kind: Literal["firing", "reminder", "resolved"]
    alert: Alert
    at: float


@dataclasses.dataclass(frozen=True, slots=True)
class Book:
    """What the rules remember between checks."""

    firing: Mapping[str, Alert] = dataclasses.field(default_factory=dict)
    """By key, in the order they started."""
    restarts: Mapping[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    """Miner -> (its model server's restart count, when that count last rose)."""


def evaluate(book: Book, states: NodeStates, limits: Limits, now: float) -> tuple[Book, tuple[Notification, ...]]:
    """One check: the conditions holding in `states`, then `step`."""
    restarts = _restart_book(book.restarts, states, now)
    found = conditions(states, limits, restarts=restarts, now=now)
    firing, notes = step(book.firing, found, now=now, renotify_s=limits.renotify_s)
    return Book(firing=firing, restarts=restarts), notes


def step(
    firing: Mapping[str, Alert], found: Iterable[Condition], *, now: float, renotify_s: float = 0.0
) -> tuple[dict[str, Alert], tuple[Notification, ...]]:
    """Dedup and recovery: the alerts firing after this check and the notifications it causes.
    A condition already firing keeps its `since` and is notified again only after `renotify_s`
    (0: never); one firing before and absent now is resolved. Two conditions with one key count
    once (the first)."""
    current: dict[str, Condition] = {}
    for condition in found:
        current.setdefault(condition.key, condition)
    after: dict[str, Alert] = {}
    notes: list[Notification] = []
    for key, alert in firing.items():
        if key not in current:
            notes.append(Notification("resolved", alert, now))
    for key, condition in current.items():
        before = firing.get(key)
        if before is None:
            alert = Alert(key, condition.rule, condition.level, condition.subject, condition.text, now, now)
            notes.append(Notification("firing", alert, now))
        else:
            due = renotify_s > 0 and (before.notified_at is None or now - before.notified_at >= renotify_s)
            alert = dataclasses.replace(
                before,
                level=condition.level,
                text=condition.text,
                notified_at=now if due else before.notified_at,
            )
            if due:
                notes.append(Notification("reminder", alert, now))
        after[key] = alert
    return after, tuple(notes)


def conditions(
    states: NodeStates, limits: Limits, *, restarts: Mapping[str, tuple[int, float]], now: float
) -> list[Condition]:
    """Every rule's conditions that hold in `states`."""
    found: list[Condition] = []
    if states.traffic is not None:
        found += _pulled(states.traffic)
    found += _gated(states, now=now)
    for name, link in sorted(states.miners.items()):
        why = link.link_down
        if why:
            found.append(Condition("miner_link", "error", name, f"{name} has no leg up at the gateway: {why}"))
    if states.validator is not None:
        found += _weights(states.validator, limits, now=now, started_at=states.node.started_at)
    if states.gpus is not None:
        found += _gpus(states.gpus)
    for miner, server in sorted(states.model_servers.items()):
        where = f"model server of {miner}"
        failure = server.last_failure
        why = f": {failure.summary} — {failure.fix}" if failure is not None and failure.summary else ""
        if server.state in SERVER_DOWN_STATES:
            found.append(Condition("server_down", "error", miner, f"{where} is {server.state}{why}"))
        seen = restarts.get(miner)
        if seen is not None and seen[0] > 0 and now - seen[1] < limits.restart_window_s:
            found.append(
                Condition("server_restarts", "warning", miner, f"{where} restarted ({seen[0]} since start){why}")
            )
    if states.buyers is not None:
        for account in states.buyers.top:
            if account.available < limits.balance_low_usd_micro:
                who = account.name or f"account {account.account_id}"
                found.append(
                    Condition(
                        "balance_low",
                        "warning",
                        who,
                        f"buyer {who} has {format_usd(account.available)} available (under "
                        f"{format_usd(limits.balance_low_usd_micro)}): add credit with `engy-node gateway credit`",
                    )
                )
    return found


def _pulled(traffic: TrafficPolicyState) -> list[Condition]:
    found = []
    for worker in traffic.workers:
        if worker.state != "pulled":
            continue
        subject = f"{worker.miner} {worker.model}"
        code = worker.history[-1].code if worker.history else None
        rule = "breaker_open" if code in BREAKER_CODES else "miner_pulled"
        what = "breaker open" if rule == "breaker_open" else "pulled from traffic"
        found.append(
            Condition(rule, "error", subject, f"{subject}: {what}: {worker.reason or code or 'no reason given'}")
        )
    return found


def _gated(states: NodeStates, *, now: float) -> list[Condition]:
    """One condition per miner (so a next gated epoch updates it rather than firing anew)."""
    found = []
    for name, miner in sorted(states.miners.items()):
        epoch = miner.epoch
        if epoch is None or not epoch.gated:
            continue
        gates = "; ".join(f"{finding_text(finding)} — fix: {finding.fix}" for finding in epoch.gated)
        # Blocks of the gateway's chain where it told them, else of the chain this node reads.
        restore = restore_text(epoch, now=now, block_s=block_time_s(epoch, states.chain, states.validator))
        weight = "n/a" if epoch.weight is None else f"{epoch.weight:,}"
        text = f"{name} gated in epoch {epoch.index} (weight {weight} of {WEIGHT_MAX:,}): {gates}" + (
            f"; next chance: {restore}" if restore else ""
        )
        found.append(Condition("miner_gated", "error", name, text))
    return found


def _weights(validator: ValidatorState, limits: Limits, *, now: float, started_at: float | None) -> list[Condition]:
    """Blocks since weights last landed, from the best source there is: the validator's own
    count, else the chain's last update of its uid, else (the chain unreachable) the wall clock
    since the last landing or, none yet, since the node started, at the chain's block time."""
    blocks = validator.blocks_since_submit
    source = "landed"
    block_s = block_time_s(validator)  # subtensor's 12 s before it has read the chain's
    if blocks is None and validator.block is not None and validator.last_update is not None:
        blocks, source = validator.block - validator.last_update, "updated on chain"
    elif blocks is None and validator.last_submit_ts is not None:
        blocks = int((now - validator.last_submit_ts) / block_s)
    elif blocks is None and validator.last_submit_block is None and started_at is not None:
        blocks, source = int((now - started_at) / block_s), "landed: none since the node started"
    if blocks is None or blocks < limits.weights_stale_blocks:
        return []
    why = validator.chain_error or validator.provider_error or validator.last_outcome or "see the validator's log"
    return [
        Condition(
            "weights_stale",
            "error",
            validator.hotkey or "validator",
            f"validator weights last {source} {blocks} blocks ago (limit {limits.weights_stale_blocks}): {why}",
        )
    ]


def _gpus(gpus: GpusState) -> list[Condition]:
    """One condition per GPU and finding kind; an Xid's names the Xid too, so a different one on
    the same GPU is notified as new rather than folded into the first."""
    xid_numbers = {record.gpu: f" {record.xid}" for record in gpus.xids}
    return [
        Condition(
            "gpu",
            finding.level,
            f"gpu{finding.gpu} {finding.kind}" + (xid_numbers.get(finding.gpu, "") if finding.kind == "xid" else ""),
            f"GPU {finding.gpu}: {finding.text}",
        )
        for finding in gpus.findings
        if finding.kind in GPU_KINDS or finding.level == "error"
    ]


def _restart_book(
    before: Mapping[str, tuple[int, float]], states: NodeStates, now: float
) -> dict[str, tuple[int, float]]:
    """Each model server's restart count and when it last rose. A server first seen with
    restarts already counted is remembered as of now: a restart this process did not witness
    rising is still recent news to an operator who just started the alerts."""
    after: dict[str, tuple[int, float]] = {}
    for miner, server in states.model_servers.items():
        count = server.restarts
        seen = before.get(miner)
        if seen is None:
            after[miner] = (count, now if count > 0 else -float("inf"))
        elif count > seen[0]:
            after[miner] = (count, now)
        else:
            after[miner] = (count, seen[1])
    return after
