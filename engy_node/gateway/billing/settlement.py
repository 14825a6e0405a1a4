"""Epoch settlement (docs/trust.md, "Settlement"): per-(miner, model) scores, quality gates and the u16 weights.

Pure integer arithmetic over plain data: no IO, no clock reads, no floats, stdlib only. The
gateway feeds it the closed epoch's request log and verdict counts; validators, and anyone else,
can recompute the same weights from the published `result_json`, so every number here must come
out bit-identical on any machine and in any input order. That is why there are no floats (a
percentile or a share computed in floating point can differ in the last place between
platforms), why every sum is over Python ints, and why every tie is broken by a fixed order.

What counts. Probe records are dropped on entry: they never mint weight, never make a row and
never enter a gate, so the gateway can probe a miner as often as it likes without moving the
epoch. Of the remaining (paid-kind) records:

* an *attempt* is any non-probe record. The attempt set is chosen by kind, not by
  `cost_micro > 0`, because a failed attempt is never billed: selecting by cost would drop
  every failure and the acceptance gate could never fail;
* the acceptance denominator is every attempt whose status is not 499 nor a buyer's fault the
  miner passed on (`BUYER_FAULTS`: 400, 413, 422). A 499 means the buyer hung up, a passed-on
  4xx that the request itself was at fault; neither says anything about the miner, so both leave
  the denominator (they are still reported in the row). Every other non-2xx status counts against the miner: 502 and 504 are the
  miner-attributable failures docs/trust.md names, and anything else (a 500, a 503 after dispatch) is
  counted too, because the request log names a miner only once a request reached one;
* a *counted* request is a 2xx attempt with `cost_micro > 0`. Only counted requests earn tokens
  and only they supply latency samples.

Free traffic (a 2xx that cost nothing) therefore earns nothing, but it does count as a success in
the acceptance gate. The gate must see unbilled failures (all failures are unbilled), and
counting free requests when they fail but not when they succeed would bias the gate against the
miner.

Gates, in order; the first failure is the row's `gate_reason` and zeroes its score. Each gate
passes while its sample is smaller than its minimum (`GateMinimums`):

* `acceptance`: 2xx attempts below 99 % of the denominator;
* `ttft_p99` and `tpot_p99`: the nearest-rank p99 of the row's counted samples above the model's
  `qual_ttft_p99_ms` / `qual_tpot_p99_ms`;
* `cheat`: the miner's `cheat` verdicts above 1 % of its rendered verdicts (`pass` + `cheat`).
  Verdicts are judged per miner, so this gate fails every row of that miner together.
  `unproven` has honest causes and never gates (docs/verification.md). The verdict counts arrive already
  summed; which audited requests they cover is the caller's decision.

Weights. A row's score is `Σ tokens · score_rate // 1000` when every gate passes, else 0. The
rows of one hotkey are summed first and normalised once onto 65535, so a miner's rounding loss
does not grow with the number of models it serves. Each share is floored; the remainder goes to
the top-scoring hotkey. With no score anywhere the owner hotkey receives everything (burn), so a
quiet epoch never spreads weight by accident.

Failure posture: malformed input (a negative count, a float where an int belongs, a model the
terms do not cover) raises `ValueError`. Those are gateway bugs, and publishing a wrong
settlement is worse than publishing none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypedDict

from engy_node.percentile import nearest_rank
from engy_node.protocol.gates import ACCEPTANCE_PERCENT, CHEAT_PERCENT, GateReason

WEIGHT_TOTAL = 65535
"""Weights are u16 on chain; one epoch's weights always sum to exactly this."""

TOKENS_PER_SCORE_UNIT = 1000
"""`score_rate` is score per this many tokens."""

HUNG_UP = 499
"""The buyer closed the connection: no verdict on the miner, so not an acceptance attempt."""
BUYER_FAULTS = frozenset({400, 413, 422})
"""Statuses a miner answers a request with when the request itself was at fault (a prompt past
the model's context, a tool schema the chat template rejects). The gateway refuses its own such
requests before any miner sees them, so with a miner named these are the miner passing the
buyer's fault on: like a 499 they say nothing about the miner and are not acceptance attempts."""


class ScoringTerms(Protocol):
    """The three per-model numbers settlement needs. `engy_node.models.ModelSpec` satisfies
    this as is; recomputing a published epoch can use any object with the same attributes."""

    @property
    def score_rate(self) -> int: ...

    @property
    def qual_ttft_p99_ms(self) -> int: ...

    @property
    def qual_tpot_p99_ms(self) -> int: ...


def _count(name: str, value: object) -> int:
    # bool is an int subclass; a True token count is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request attempt from the epoch's request log, reduced to what settlement reads."""

    hotkey: str
    """The miner that served (or failed) it."""
    model: str
    """Catalog id."""
    status: int
    """HTTP status the buyer got (or would have got, for a probe)."""
    cost_micro: int
    """Micro-USD charged; 0 for failures, probes and free traffic."""
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: int | None
    """Time to first token in whole milliseconds; None when not measured."""
    tpot_ms: int | None
    """Time per output token in whole milliseconds; None when not measured."""
    probe: bool
    """Sent by the gateway's traffic control plane, not by a buyer."""

    def __post_init__(self) -> None:
        for name in ("hotkey", "model"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if not 100 <= _count("status", self.status) <= 599:
            raise ValueError(f"status must be an HTTP status code, got {self.status!r}")
        for name in ("cost_micro", "prompt_tokens", "completion_tokens"):
            _count(name, getattr(self, name))
        # Milliseconds arrive as ints so the percentile is exact; the caller rounds the log's floats.
        for name in ("ttft_ms", "tpot_ms"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name))
        if not isinstance(self.probe, bool):
            raise ValueError(f"probe must be a bool, got {self.probe!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class VerdictCounts:
    """One miner's audit verdicts over the epoch (docs/verification.md), across all its models."""

    passed: int = 0
    cheat: int = 0
    unproven: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _count(field.name, getattr(self, field.name))


@dataclasses.dataclass(frozen=True, slots=True)
class GateMinimums:
    """Sample sizes below which a gate passes unexamined.

    Each default is 100 because that is the smallest sample in which the gate's 1 % tolerance
    admits a single bad event: below it, 99 % acceptance means "no failure at all", a nearest-rank
    p99 is the maximum, and one cheat verdict exceeds 1 %. One cold start, one network blip or
    one false verdict would then cost an honest miner the whole epoch. The cheaper mistake is to
    let a small row through: its failed requests earn nothing anyway, and the traffic control
    plane (docs/trust.md) pulls a flaky or slow miner within minutes, long before the epoch closes."""

    acceptance_attempts: int = 100
    """Attempts in the acceptance denominator (499s excluded)."""
    latency_samples: int = 100
    """Counted requests carrying the measurement, per latency gate."""
    cheat_verdicts: int = 100
    """Rendered verdicts (`pass` + `cheat`) of the miner."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _count(field.name, getattr(self, field.name))


@dataclasses.dataclass(frozen=True, slots=True)
class RowAggregate:
    """One (miner, model) row of the epoch, as published in `result_json`."""

    hotkey: str
    model: str
    requests: int
    """Non-probe attempts, 499s included."""
    ok_2xx: int
    status_499: int
    buyer_faults: int
    """Attempts the miner answered with a 4xx the request itself caused (`BUYER_FAULTS`); not
    acceptance attempts."""
    status_502: int
    status_504: int
    other_failures: int
    """Non-2xx attempts other than 499, 502, 504 and buyer faults; they count against acceptance."""
    counted: int
    """2xx attempts with `cost_micro > 0`: the requests that earn."""
    tokens: int
    """Prompt plus completion tokens over counted requests."""
    ttft_p99_ms: int | None
    tpot_p99_ms: int | None
    verdict_pass: int
    verdict_cheat: int
    verdict_unproven: int
    """The miner's verdict counts, repeated on each of its rows."""
    score: int
    gate_reason: GateReason | None
    """The first gate that failed, or None when all passed."""

    def to_json(self) -> dict[str, int | str | None]:
        """The row as plain JSON values under fixed keys (the field names)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


class SettlementJson(TypedDict):
    """`EpochSettlement.to_json()`: its weights as [hotkey, u16] pairs and its rows' `to_json()`."""

    weights: list[list[str | int]]
    rows: list[dict[str, int | str | None]]


@dataclasses.dataclass(frozen=True, slots=True)
class EpochSettlement:
    """The outcome of one epoch: what goes on chain and the rows that justify it."""

    weights: tuple[tuple[str, int], ...]
    """(hotkey, u16) in hotkey order, zero weights omitted; sums to `WEIGHT_TOTAL`."""
    rows: tuple[RowAggregate, ...]
    """Ordered by hotkey order, then model id."""

    def to_json(self) -> SettlementJson:
        """Weights and rows as plain JSON values, ready for the canonical `result_json`."""
        return {
            "weights": [[hotkey, weight] for hotkey, weight in self.weights],
            "rows": [row.to_json() for row in self.rows],
        }


HotkeyOrder = Callable[[str], tuple[int, int, str]]


def _hotkey_order(uids: Mapping[str, int]) -> HotkeyOrder:
    # Registered hotkeys by uid, then the rest; the hotkey string settles every remaining tie so
    # the order is total and independent of input order.
    def key(hotkey: str) -> tuple[int, int, str]:
        uid = uids.get(hotkey)
        return (0, uid, hotkey) if uid is not None else (1, 0, hotkey)

    return key


def _latency_fails(samples: Sequence[int], p99: int | None, ceiling: int, minimum: int) -> bool:
    return p99 is not None and len(samples) >= minimum and p99 > ceiling


def _row(
    hotkey: str,
    model: str,
    records: Sequence[RequestRecord],
    *,
    verdicts: VerdictCounts,
    terms: ScoringTerms,
    minimums: GateMinimums,
) -> RowAggregate:
    statuses = [record.status for record in records]
    ok = sum(1 for status in statuses if 200 <= status <= 299)
    status_499, status_502, status_504 = (statuses.count(code) for code in (HUNG_UP, 502, 504))
    buyer_faults = sum(1 for status in statuses if status in BUYER_FAULTS)
    counted = [record for record in records if 200 <= record.status <= 299 and record.cost_micro > 0]
    tokens = sum(record.prompt_tokens + record.completion_tokens for record in counted)
    ttft = [record.ttft_ms for record in counted if record.ttft_ms is not None]
    tpot = [record.tpot_ms for record in counted if record.tpot_ms is not None]
    ttft_p99 = nearest_rank(sorted(ttft), 99) if ttft else None
    tpot_p99 = nearest_rank(sorted(tpot), 99) if tpot else None
    attempts = len(records) - status_499 - buyer_faults
    rendered = verdicts.passed + verdicts.cheat

    gate_reason: GateReason | None = None
    if attempts >= minimums.acceptance_attempts and ok * 100 < ACCEPTANCE_PERCENT * attempts:
        gate_reason = "acceptance"
    elif _latency_fails(ttft, ttft_p99, terms.qual_ttft_p99_ms, minimums.latency_samples):
        gate_reason = "ttft_p99"
    elif _latency_fails(tpot, tpot_p99, terms.qual_tpot_p99_ms, minimums.latency_samples):
        gate_reason = "tpot_p99"
    elif rendered >= minimums.cheat_verdicts and verdicts.cheat * 100 > CHEAT_PERCENT * rendered:
        gate_reason = "cheat"

    return RowAggregate(
        hotkey=hotkey,
        model=model,
        requests=len(records),
        ok_2xx=ok,
        status_499=status_499,
        buyer_faults=buyer_faults,
        status_502=status_502,
        status_504=status_504,
        other_failures=len(records) - ok - status_499 - buyer_faults - status_502 - status_504,
        counted=len(counted),
        tokens=tokens,
        ttft_p99_ms=ttft_p99,
        tpot_p99_ms=tpot_p99,
        verdict_pass=verdicts.passed,
        verdict_cheat=verdicts.cheat,
        verdict_unproven=verdicts.unproven,
        score=0 if gate_reason else tokens * terms.score_rate // TOKENS_PER_SCORE_UNIT,
        gate_reason=gate_reason,
    )


def _weights(scores: Mapping[str, int], *, owner_hotkey: str, order: HotkeyOrder) -> tuple[tuple[str, int], ...]:
    total = sum(scores.values())
    if total == 0:
        return ((owner_hotkey, WEIGHT_TOTAL),)
    shares = {hotkey: score * WEIGHT_TOTAL // total for hotkey, score in scores.items()}
    top = min(scores, key=lambda hotkey: (-scores[hotkey], order(hotkey)))
    shares[top] += WEIGHT_TOTAL - sum(shares.values())
    return tuple((hotkey, shares[hotkey]) for hotkey in sorted(shares, key=order) if shares[hotkey] > 0)


def settle_epoch(
    *,
    records: Iterable[RequestRecord],
    verdicts: Mapping[str, VerdictCounts],
    models: Mapping[str, ScoringTerms],
    owner_hotkey: str,
    uids: Mapping[str, int],
    minimums: GateMinimums = GateMinimums(),
) -> EpochSettlement:
    """Settle one closed epoch: a row per (miner, model) with non-probe traffic, and the weights.

    Args:
        records: every request attempt of the epoch, probes included (they are dropped here).
        verdicts: hotkey -> that miner's verdict counts; a miner absent from it has none.
        models: catalog id -> scoring terms, covering every model in `records`.
        owner_hotkey: receives all of `WEIGHT_TOTAL` when nothing scores (burn).
        uids: hotkey -> uid, used only to order hotkeys for ties and output; a hotkey without
            one sorts after every hotkey with one.
        minimums: per-gate sample sizes below which the gate passes.

    The result depends only on the multiset of records, never on their order.

    Raises:
        ValueError: a record names a model missing from `models`, or a scoring term is not a
            non-negative integer.
    """
    order = _hotkey_order(uids)
    by_row: dict[tuple[str, str], list[RequestRecord]] = {}
    for record in records:
        if not record.probe:
            by_row.setdefault((record.hotkey, record.model), []).append(record)
    missing = sorted({model for _, model in by_row} - set(models))
    if missing:
        raise ValueError(f"no scoring terms for model(s) {', '.join(missing)}; pass the catalog entry for each")
    for model in {model for _, model in by_row}:
        for name in ("score_rate", "qual_ttft_p99_ms", "qual_tpot_p99_ms"):
            _count(f"{model}.{name}", getattr(models[model], name))
    rows = tuple(
        _row(
            hotkey,
            model,
            by_row[hotkey, model],
            verdicts=verdicts.get(hotkey, VerdictCounts()),
            terms=models[model],
            minimums=minimums,
        )
        for hotkey, model in sorted(by_row, key=lambda row: (order(row[0]), row[1]))
    )
    scores: dict[str, int] = {}
    for row in rows:
        scores[row.hotkey] = scores.get(row.hotkey, 0) + row.score
    return EpochSettlement(weights=_weights(scores, owner_hotkey=owner_hotkey, order=order), rows=rows)
