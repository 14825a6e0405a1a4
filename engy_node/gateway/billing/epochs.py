"""Epochs in time, and from the store's rows to a signed-ready `result_json` (docs/trust.md, "Epochs").

Epoch `i` covers `[genesis + i·epoch_s, genesis + (i + 1)·epoch_s)` and closes `grace_s` after it
ends, so verdicts on its last requests can still arrive (a verifier leases, recomputes, posts).
A verdict counts in the epoch its request was served in, whenever it arrives before the close.

Which epochs a gateway publishes. Every epoch from the first one it was running in, each exactly
once and in order: a gateway that was down catches up on the epochs it missed (each settles from
the request log it still holds; an epoch with no traffic burns to the owner). It never publishes
epochs from before it first ran: their traffic went through some other gateway or none.

Pure: the store's rows in, plain data out; the publisher (`publisher.py`) owns the clock, the
store and the master key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from engy_node.gateway.billing import settlement
from engy_node.gateway.store import RequestLogEntry
from engy_node.protocol.epoch import build_result_json

MAX_CATCH_UP_EPOCHS = 64
"""Most missed epochs one close settles: a gateway down for longer publishes the latest ones
(validators apply only the newest anyway) rather than grinding through months of empty epochs."""


@dataclasses.dataclass(frozen=True, slots=True)
class EpochClock:
    genesis: int
    """Unix seconds where epoch 0 starts."""
    epoch_s: int
    grace_s: int

    def __post_init__(self) -> None:
        for name in ("genesis", "epoch_s", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"epoch {name} must be whole seconds >= 0, got {value!r}")
        if self.epoch_s < 1:
            raise ValueError("epoch_s must be at least one second")

    def index_at(self, t: float) -> int:
        """The epoch `t` falls in; -1 before genesis."""
        return -1 if t < self.genesis else int((t - self.genesis) // self.epoch_s)

    def window(self, index: int) -> tuple[int, int]:
        start = self.genesis + index * self.epoch_s
        return start, start + self.epoch_s

    def closes_at(self, index: int) -> int:
        return self.window(index)[1] + self.grace_s

    def due(self, *, now: float, last_published: int | None, first_seen: float) -> list[int]:
        """The epochs to close now, oldest first: those past their close that come after the last
        one published (or, for a gateway that has published none, from the one it first ran in)."""
        first = self.index_at(first_seen) if last_published is None else last_published + 1
        first = max(first, 0)
        last = self.index_at(now - self.grace_s) - 1
        if last < first:
            return []
        return list(range(max(first, last - MAX_CATCH_UP_EPOCHS + 1), last + 1))


def settlement_records(
    entries: Iterable[RequestLogEntry], hotkeys: Mapping[str, str]
) -> list[settlement.RequestRecord]:
    """The request log's rows as settlement reads them. A row that reached no miner or named no
    catalog model says nothing about any miner and is left out; so is a miner admitted by key
    without a registered hotkey (`hotkeys` maps identity to hotkey), which cannot hold weight."""
    records = []
    for entry in entries:
        if entry.miner is None or entry.model is None:
            continue
        hotkey = hotkeys.get(entry.miner)
        if hotkey is None:
            continue
        records.append(
            settlement.RequestRecord(
                hotkey=hotkey,
                model=entry.model,
                status=entry.status,
                cost_micro=entry.cost_micro,
                prompt_tokens=entry.prompt_tokens,
                completion_tokens=entry.completion_tokens,
                ttft_ms=None if entry.ttft_ms is None else int(round(entry.ttft_ms)),
                tpot_ms=None if entry.tpot_ms is None else int(round(entry.tpot_ms)),
                probe=entry.kind == "probe",
            )
        )
    return records


def verdict_totals(
    counts: Mapping[str, tuple[int, int, int]], hotkeys: Mapping[str, str]
) -> dict[str, settlement.VerdictCounts]:
    """Per-identity (passed, cheat, unproven) summed per hotkey."""
    totals: dict[str, list[int]] = {}
    for identity, (passed, cheat, unproven) in counts.items():
        hotkey = hotkeys.get(identity)
        if hotkey is None:
            continue
        total = totals.setdefault(hotkey, [0, 0, 0])
        total[0] += passed
        total[1] += cheat
        total[2] += unproven
    return {hotkey: settlement.VerdictCounts(*values) for hotkey, values in totals.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class SettledEpoch:
    index: int
    settlement: settlement.EpochSettlement
    result_json: bytes


def settlement_of(
    *,
    entries: Sequence[RequestLogEntry],
    verdicts: Mapping[str, tuple[int, int, int]],
    hotkeys: Mapping[str, str],
    models: Mapping[str, settlement.ScoringTerms],
    owner_hotkey: str,
    minimums: settlement.GateMinimums = settlement.GateMinimums(),
) -> settlement.EpochSettlement:
    """Settle an epoch (or the part of one so far) from its request-log rows and verdict counts."""
    return settlement.settle_epoch(
        records=settlement_records(entries, hotkeys),
        verdicts=verdict_totals(verdicts, hotkeys),
        models=models,
        owner_hotkey=owner_hotkey,
        uids={},
        minimums=minimums,
    )


def settle(
    *,
    clock: EpochClock,
    index: int,
    netuid: int,
    entries: Sequence[RequestLogEntry],
    verdicts: Mapping[str, tuple[int, int, int]],
    hotkeys: Mapping[str, str],
    models: Mapping[str, settlement.ScoringTerms],
    owner_hotkey: str,
    minimums: settlement.GateMinimums = settlement.GateMinimums(),
) -> SettledEpoch:
    """Settle closed epoch `index` into canonical `result_json`, carrying the epoch's window as
    `start`/`end` (unix seconds) so anyone can recompute it from the rows."""
    outcome = settlement_of(
        entries=entries, verdicts=verdicts, hotkeys=hotkeys, models=models, owner_hotkey=owner_hotkey, minimums=minimums
    )
    start, end = clock.window(index)
    result_json = build_result_json(
        netuid=netuid, epoch_index=index, settlement_json=outcome.to_json(), extra={"start": start, "end": end}
    )
    return SettledEpoch(index=index, settlement=outcome, result_json=result_json)
