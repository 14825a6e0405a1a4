"""Why a miner's epoch was zeroed: the settlement gates explained from a published row.

A gated row earns nothing for the whole epoch (docs/trust.md, "Settlement"), and until now the
only trace was the gateway's `gated …: ttft_p99` log line: the miner saw its incentive fall to 0
with no reason. Every number needed to explain it is public: the published `result_json` rows
carry the measurement (a p99, the 2xx count, the verdict counts) and the `gate_reason`, and the
model's ceiling is the catalog's. This module turns one row into what an operator reads —
which gate, the measured value against its bar, over how many samples, and what to change —
for the three readers that show it: the miner (from its gateway's `GET /gw/epoch/latest`), the
validator (from the payload it verified) and the alert rules.

It also defines the miner's view of its newest epoch (`MinerEpoch`), the wire answer of that
route (`epoch_answer`) and its reading (`miner_epoch`), so the gateway and the miner agree on one
shape without importing each other.

Pure and standard library only, like the settlement: plain data in and out, no IO, no clock
(callers pass `now`, and the chain's block time where blocks are counted). The settlement
(`engy_node.gateway.billing.settlement`) takes its gate names and percentages from here, so an
explanation cannot disagree with the gate that fired. Rows are read liberally: a field missing
or of the wrong type is unknown (None), never an exception, because the row came over a network.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from engy_node.durations import duration_text

GateReason = Literal["acceptance", "ttft_p99", "tpot_p99", "cheat"]
GATES: tuple[GateReason, ...] = ("acceptance", "ttft_p99", "tpot_p99", "cheat")
"""In the order settlement checks them; the first that fails is the row's `gate_reason`."""
ACCEPTANCE_PERCENT = 99
"""The acceptance gate fails a row whose 2xx answers are below this share of its attempts."""
CHEAT_PERCENT = 1
"""The cheat gate fails a miner whose `cheat` verdicts are above this share of its rendered ones."""

FIXES: Mapping[str, str] = {
    "acceptance": (
        "find why requests failed (the 502/504 counts above; the model server's log and restarts): "
        "keep the model server up and lower max_inflight if it times out under load"
    ),
    "ttft_p99": (
        "first tokens came too slowly: lower max_inflight (MAX_INFLIGHT), keep the model server "
        "warm (a restart's cold start counts) or serve on a faster GPU"
    ),
    "tpot_p99": "tokens streamed too slowly: lower max_inflight (MAX_INFLIGHT) or serve on a faster GPU",
    "cheat": (
        "audits judged answers as cheats: serve the catalog's checkpoint unmodified on a supported "
        "server, and read the verdict reasons in the Proofs block"
    ),
}
"""What to change, per gate: what the operator controls that moves the measurement."""


@dataclasses.dataclass(frozen=True, slots=True)
class GateTerms:
    """A model's latency ceilings (the catalog's `qual_ttft_p99_ms` / `qual_tpot_p99_ms`)."""

    qual_ttft_p99_ms: int | None = None
    qual_tpot_p99_ms: int | None = None

    @classmethod
    def of(cls, spec: Any) -> GateTerms:
        """The ceilings of a catalog `ModelSpec` (or anything with its two attributes)."""
        return cls(spec.qual_ttft_p99_ms, spec.qual_tpot_p99_ms)


@dataclasses.dataclass(frozen=True, slots=True)
class GateFinding:
    """One gated (miner, model) row, explained."""

    epoch: int | None = None
    """The epoch the row is from."""
    hotkey: str = ""
    model: str = ""
    gate: str = ""
    """A `GateReason`; kept a str so a newer gateway's new gate still shows."""
    measured: float | None = None
    """The row's value for the gate: a p99 in ms, or a percentage; None when not published."""
    limit: float | None = None
    """The bar it failed: the model's ceiling in ms, or the percentage; None when unknown."""
    unit: str = ""
    """`ms` or `%`."""
    samples: int | None = None
    """What the measurement is over (attempts, counted requests or rendered verdicts)."""
    text: str = ""
    """One sentence: the measurement against the bar."""
    fix: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class MinerEpoch:
    """A miner's newest published epoch, as its gateway answers `GET /gw/epoch/latest?hotkey=`."""

    index: int | None = None
    start: int | None = None
    end: int | None = None
    weight: int | None = None
    """This hotkey's u16 weight in the epoch (0 when it has none)."""
    rows: int = 0
    """Its (miner, model) rows: 0 means no paid traffic that epoch."""
    score: int = 0
    gated: tuple[GateFinding, ...] = ()
    next_index: int | None = None
    """The epoch whose result replaces this one."""
    next_end: int | None = None
    """When that epoch's traffic window ends (unix seconds)."""
    next_closes_at: int | None = None
    """When the gateway closes and publishes it (its end plus the grace for late verdicts)."""
    error: str | None = None
    """Why the last look failed (the gateway unreachable, no epoch published yet); None after one
    that succeeded."""
    checked_at: float | None = None
    block_time_s: float | None = None
    """The block time of the gateway's chain, in seconds, when the gateway tells it (one on a local
    network's dev chain does); None: it did not (an older gateway, or one on a public network), and
    blocks count in the node's own chain's, else subtensor's (`block_time_s`)."""


SUBTENSOR_BLOCK_S = 12.0
"""Subtensor's block time (finney and the testnet), for a node that knows no chain's (a standalone
miner whose gateway does not tell it). A node that reads its chain (a validator; a local network's
dev chain, whose blocks come every second), or a miner whose gateway tells its chain's with the
epoch (`MinerEpoch.block_time_s`), counts in that chain's (`block_time_s`)."""


def block_time_s(*states: Any) -> float:
    """The chain's block time as the node knows it: the `block_time_s` of the first of `states`
    (best first: a miner's `MinerEpoch`, as its gateway told it, then the node's published chain
    and validator states, `snapshots.ChainState` and `ValidatorState`; None for one it has not)
    that is a positive, finite number of seconds, else subtensor's."""
    for state in states:
        seconds = _seconds(getattr(state, "block_time_s", None))
        if seconds is not None:
            return seconds
    return SUBTENSOR_BLOCK_S


def _seconds(value: Any) -> float | None:
    """`value` as a positive, finite number of seconds; None when it is not one (a bool is not)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
        return float(value)
    return None


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@dataclasses.dataclass(frozen=True, slots=True)
class NextChance:
    """The first epoch that can still restore a gated miner: its index, when its traffic window
    ends and when its result is published (None: the gateway did not say)."""

    index: int
    end: int
    closes_at: int | None


def next_chance(epoch: MinerEpoch, *, now: float) -> NextChance | None:
    """The first epoch after `epoch` that closes (publishes its result) after `now`, or None when
    the gateway did not say when the next one ends.

    The gateway names the epoch after its newest published one. After the gateway was down, or
    when this answer is old (the miner's last looks failed), that epoch may have closed already:
    a gateway catching up settles the epochs it missed from the traffic it logged, none while it
    was down, and one down for longer than `gateway.billing.epochs.MAX_CATCH_UP_EPOCHS` never
    publishes some of them. So the epoch named moves on by whole epochs of the gateway's length
    (its `next_end` less its `end`) to the first that closes after `now`: one in its grace (its
    traffic served, its result to come) or the one serving now."""
    index, end, closes_at = epoch.next_index, epoch.next_end, epoch.next_closes_at
    if index is None or end is None:
        return None
    epoch_s = end - epoch.end if epoch.end is not None else 0
    deadline = closes_at if closes_at is not None else end
    if epoch_s > 0 and deadline <= now:
        skipped = math.floor((now - deadline) / epoch_s) + 1
        index, end = index + skipped, end + skipped * epoch_s
        closes_at = None if closes_at is None else closes_at + skipped * epoch_s
    return NextChance(index, end, closes_at)


def restore_text(epoch: MinerEpoch, *, now: float, block_s: float) -> str | None:
    """When a gated epoch's zero can be replaced (`next_chance`): that epoch's end, how far off
    in time and in blocks of `block_s` seconds (the chain's block time, `block_time_s`), and when
    its result is published; None when the gateway did not say."""
    if not (0 < block_s < math.inf):
        raise ValueError(f"block_s must be a positive number of seconds, got {block_s!r}")
    chance = next_chance(epoch, now=now)
    if chance is None:
        return None
    left = chance.end - now
    if left > 0:
        blocks = math.ceil(left / block_s)
        text = f"epoch {chance.index} ends {utc(chance.end)} (in {duration_text(left)}, ~{blocks:,} blocks)"
    else:
        text = f"epoch {chance.index} ended {utc(chance.end)}"
    if chance.closes_at is not None:
        text += f", its result published at {utc(chance.closes_at)}"
    return text


def measure_text(finding: GateFinding) -> str:
    """The measurement against its bar, short: `14,250 ms > 10,000 ms`, `95.0 % < 99 %`."""
    if finding.measured is None:
        return "not published"
    if finding.unit == "ms":
        bar = "" if finding.limit is None else f" > {finding.limit:,.0f} ms"
        return f"{finding.measured:,.0f} ms{bar}"
    if finding.unit == "%":
        sign = "<" if finding.gate == "acceptance" else ">"
        bar = "" if finding.limit is None else f" {sign} {finding.limit:g} %"
        return f"{finding.measured:.1f} %{bar}"
    return f"{finding.measured:g}"


def finding_text(finding: GateFinding) -> str:
    """`ttft_p99 on smollm2-135m: TTFT p99 45,000 ms over 120 requests (ceiling 30,000 ms)`."""
    return f"{finding.gate} on {finding.model or '?'}: {finding.text}"


def _int(row: Mapping[str, Any], key: str) -> int | None:
    value = row.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _str(row: Mapping[str, Any], key: str) -> str:
    value = row.get(key)
    return value if isinstance(value, str) else ""


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _percent(part: int, whole: int) -> float:
    return part * 100 / whole


def explain(row: Mapping[str, Any], terms: GateTerms | None = None, *, epoch: int | None = None) -> GateFinding | None:
    """The finding for a published settlement row (`RowAggregate.to_json()`) of `epoch`, or None
    when no gate failed. `terms`: the model's ceilings, for the latency gates' bar (None: unknown)."""
    gate = row.get("gate_reason")
    if not isinstance(gate, str) or not gate:
        return None
    model, hotkey = _str(row, "model"), _str(row, "hotkey")
    terms = terms or GateTerms()
    if gate == "acceptance":
        requests, ok = _int(row, "requests"), _int(row, "ok_2xx")
        excluded = (_int(row, "status_499") or 0) + (_int(row, "buyer_faults") or 0)
        attempts = None if requests is None else requests - excluded
        if attempts is None or ok is None or attempts <= 0:
            return _finding(
                epoch, hotkey, model, gate, None, ACCEPTANCE_PERCENT, "%", attempts, "2xx share not published"
            )
        share = _percent(ok, attempts)
        failures = ", ".join(
            f"{count} × {label}"
            for label, count in (
                ("502", _int(row, "status_502")),
                ("504", _int(row, "status_504")),
                ("other", _int(row, "other_failures")),
            )
            if count
        )
        text = f"answered {ok:,} of {_count(attempts, 'attempt')} ({share:.1f} %; minimum {ACCEPTANCE_PERCENT} %)" + (
            f": {failures}" if failures else ""
        )
        return _finding(epoch, hotkey, model, gate, share, ACCEPTANCE_PERCENT, "%", attempts, text)
    if gate in ("ttft_p99", "tpot_p99"):
        label = "TTFT" if gate == "ttft_p99" else "TPOT"
        p99 = _int(row, f"{gate}_ms")
        ceiling = terms.qual_ttft_p99_ms if gate == "ttft_p99" else terms.qual_tpot_p99_ms
        counted = _int(row, "counted")
        bar = f"ceiling {ceiling:,} ms" if ceiling is not None else "ceiling unknown to this node"
        measured = f"{p99:,} ms" if p99 is not None else "not published"
        over = f" over {_count(counted, 'request')}" if counted is not None else ""
        text = f"{label} p99 {measured}{over} ({bar})"
        return _finding(epoch, hotkey, model, gate, p99, ceiling, "ms", counted, text)
    if gate == "cheat":
        passed, cheat = _int(row, "verdict_pass"), _int(row, "verdict_cheat")
        if passed is None or cheat is None or passed + cheat == 0:
            return _finding(epoch, hotkey, model, gate, None, CHEAT_PERCENT, "%", None, "verdict counts not published")
        rendered = passed + cheat
        share = _percent(cheat, rendered)
        text = f"{_count(cheat, 'cheat verdict')} of {rendered:,} rendered ({share:.1f} %; maximum {CHEAT_PERCENT} %)"
        return _finding(epoch, hotkey, model, gate, share, CHEAT_PERCENT, "%", rendered, text)
    return _finding(epoch, hotkey, model, gate, None, None, "", None, f"gate {gate} (unknown to this node's version)")


def _finding(
    epoch: int | None,
    hotkey: str,
    model: str,
    gate: str,
    measured: float | None,
    limit: float | None,
    unit: str,
    samples: int | None,
    text: str,
) -> GateFinding:
    return GateFinding(
        epoch=epoch,
        hotkey=hotkey,
        model=model,
        gate=gate,
        measured=None if measured is None else float(measured),
        limit=None if limit is None else float(limit),
        unit=unit,
        samples=samples,
        text=text,
        fix=FIXES.get(gate, "upgrade engy-node to read this gate"),
    )


def explain_rows(
    rows: Sequence[Any], terms: Mapping[str, GateTerms], *, epoch: int | None = None
) -> tuple[GateFinding, ...]:
    """Every gated row of `rows` (of `epoch`) explained, in their order; rows that are not objects
    are skipped."""
    found = []
    for row in rows:
        if isinstance(row, Mapping):
            model = row.get("model")
            finding = explain(row, terms.get(model) if isinstance(model, str) else None, epoch=epoch)
            if finding is not None:
                found.append(finding)
    return tuple(found)


def epoch_answer(
    result: Mapping[str, Any],
    *,
    hotkey: str,
    terms: Mapping[str, GateTerms],
    epoch_s: int,
    grace_s: int,
    block_time_s: float | None = None,
) -> dict[str, Any]:
    """The gateway's answer to `GET /gw/epoch/latest?hotkey=`: `hotkey`'s rows and weight from the
    published `result` (the parsed `result_json`), the ceilings of those rows' models, and when
    the next epoch ends and closes (its window follows this one's `end`). With `block_time_s`, the
    block time of the gateway's chain, so a miner counts the blocks to that end in its chain's; a
    gateway that does not know it leaves the field out, and the answer is what it always was."""
    rows = [row for row in result.get("rows") or () if isinstance(row, Mapping) and row.get("hotkey") == hotkey]
    weights = {pair[0]: pair[1] for pair in result.get("weights") or () if isinstance(pair, list) and len(pair) == 2}
    end = _int(result, "end")
    index = _int(result, "epoch_index")
    models = {_str(row, "model") for row in rows}
    answer: dict[str, Any] = {
        "v": 1,
        "epoch_index": index,
        "start": _int(result, "start"),
        "end": end,
        "hotkey": hotkey,
        "weight": weights.get(hotkey, 0),
        "rows": rows,
        "terms": {model: dataclasses.asdict(terms[model]) for model in sorted(models & set(terms))},
        "next_index": None if index is None else index + 1,
        "next_end": None if end is None else end + epoch_s,
        "next_closes_at": None if end is None else end + epoch_s + grace_s,
    }
    if block_time_s is not None:
        answer["block_time_s"] = block_time_s
    return answer


def miner_epoch(answer: Mapping[str, Any], *, now: float) -> MinerEpoch:
    """`epoch_answer`'s JSON read back (liberally) as the miner's view of its epoch at `now`."""
    raw_terms = answer.get("terms")
    if not isinstance(raw_terms, Mapping):
        raw_terms = {}
    terms = {
        str(model): GateTerms(_int(value, "qual_ttft_p99_ms"), _int(value, "qual_tpot_p99_ms"))
        for model, value in raw_terms.items()
        if isinstance(value, Mapping)
    }
    rows = [row for row in answer.get("rows") or () if isinstance(row, Mapping)]
    index = _int(answer, "epoch_index")
    return MinerEpoch(
        index=index,
        start=_int(answer, "start"),
        end=_int(answer, "end"),
        weight=_int(answer, "weight"),
        rows=len(rows),
        score=sum(_int(row, "score") or 0 for row in rows),
        gated=explain_rows(rows, terms, epoch=index),
        next_index=_int(answer, "next_index"),
        next_end=_int(answer, "next_end"),
        next_closes_at=_int(answer, "next_closes_at"),
        checked_at=now,
        block_time_s=_seconds(answer.get("block_time_s")),
    )
