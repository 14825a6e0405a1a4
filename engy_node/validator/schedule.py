"""When the light loop puts weights on chain (docs/validator.md). Pure decisions: no IO, no chain, no
clock reads; the block number and the time come in as arguments.

Why resubmit at all. The provider closes an epoch and the validator submits its vector at once.
On-chain weights do not expire, but the chain's evidence that this validator is alive does: once
its `last_update` is older than the subnet's activity cutoff (about 5000 blocks) Yuma consensus
counts it inactive, its weights drop out and it earns nothing. So the same vector goes back on
chain every `RESUBMIT_BLOCKS` for as long as the epoch lasts.

What is authoritative. The block number. The wall clock only lets the loop skip opening a chain
connection when it is clearly too early (`pregate_skip`), and stands in for the block number when
the chain cannot report one.

Which way ambiguity resolves. Toward submitting. A missed submission costs consensus membership;
an extra one costs at most a refusal from the chain's rate limit, which the next tick recovers.
Every case `decide` cannot settle from a sane block gap (no block number, a clock that went
backwards, a chain behind the recorded anchor) therefore submits. The one refusal that is never
relaxed is the replay guard: an epoch older than the last one applied is not submitted, whatever
else holds.

These are the public light validator's rules (hanlinai/engy `validator/schedule.py`), with one
deliberate difference, "chain-behind", explained at `decide`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

RESUBMIT_BLOCKS = 120
"""Blocks between resubmissions of the same vector (about 24 minutes at 12 s blocks).

SN53's `weights_rate_limit` is 100 blocks, and the interval has to clear it with room to spare
rather than equal it: our anchor is the block read *before* submitting, while the chain anchors
the limit on the block the extrinsic executes in, which is always read later. At exactly 100 the
first attempt of every cycle would be refused as too fast and succeed only a poll later, a
recurring false alarm that would hide a real failure. The margin covers that inclusion lag (20
blocks, about 4 minutes, far beyond what waiting for inclusion normally sees); the poll interval
needs no margin, since polling only ever makes a submission later, and late is safe. 120 is
still about 40 times inside the 5000-block activity cutoff."""

BLOCK_S = 12.0
"""Nominal seconds per block, used only to turn a block interval into wall-clock time."""

PREGATE_FRACTION = 0.8
"""The pre-gate skips a tick only before this fraction of the interval has passed by the clock,
so clock drift or a slow chain can never make it skip a tick that is already due."""

MIN_STALL_S = 900
"""The shortest watchdog limit: a tick slowed by a retrying chain call must not trip it."""

Reason = Literal["new-epoch", "replay", "due", "not-due", "chain-behind", "clock-due", "clock-not-due"]
REASONS: tuple[Reason, ...] = get_args(Reason)
"""Every reason `decide` can give; stable, so logs and tests can match on them."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Whether to submit on this tick, and why."""

    submit: bool
    reason: Reason
    blocks_left: int | None
    """Blocks until the resubmission is due; set only for "not-due"."""


def decide(
    *,
    epoch_index: int,
    last_applied: int | None,
    current_block: int | None,
    last_submit_block: int | None,
    now: float,
    last_submit_ts: float | None,
    interval_blocks: int = RESUBMIT_BLOCKS,
    block_s: float = BLOCK_S,
) -> Decision:
    """Submit a new epoch at once, the applied epoch again every `interval_blocks`, and an older
    epoch never.

    `current_block` is None when the chain could not report it, and `last_submit_block` when the
    last submission was recorded without one; either falls back to the wall clock.

    "chain-behind": a current block below the recorded anchor means the state was written against
    another chain (a wiped local chain, a switched network), or the node reports a stale head. The
    public validator would compute a negative gap and wait until the chain caught up with a block
    number it may never reach again, silent all the while. We submit: on a stale head the worst
    case is one rate-limit refusal, and the submission re-anchors the state on this chain.
    """
    _require_positive(interval_blocks=interval_blocks, block_s=block_s)
    if last_applied is None or epoch_index > last_applied:
        return Decision(True, "new-epoch", None)
    if epoch_index < last_applied:
        # Load-bearing, not defensive. The loop does not know which epoch is current and the
        # payload check has no freshness test, so this guard is all that stops a genuinely signed
        # old payload, served by a compromised provider, from being replayed onto the chain.
        return Decision(False, "replay", None)
    if current_block is None or last_submit_block is None:
        return _decide_by_clock(
            now=now, last_submit_ts=last_submit_ts, interval_blocks=interval_blocks, block_s=block_s
        )
    if current_block < last_submit_block:
        return Decision(True, "chain-behind", None)
    gap = current_block - last_submit_block
    if gap >= interval_blocks:
        return Decision(True, "due", None)
    return Decision(False, "not-due", interval_blocks - gap)


def _decide_by_clock(*, now: float, last_submit_ts: float | None, interval_blocks: int, block_s: float) -> Decision:
    if last_submit_ts is None:
        # Nothing to measure from: the cheaper mistake is one extra submission.
        return Decision(True, "clock-due", None)
    elapsed = now - last_submit_ts
    # Written as "not inside the waiting window" so that a negative elapsed time (the clock
    # jumped back, not a submission from the future) and NaN both count as due.
    if not 0 <= elapsed < interval_blocks * block_s:
        return Decision(True, "clock-due", None)
    return Decision(False, "clock-not-due", None)


def pregate_skip(
    *, now: float, last_submit_ts: float | None, interval_blocks: int = RESUBMIT_BLOCKS, block_s: float = BLOCK_S
) -> float | None:
    """Seconds until the resubmission is due when it is clearly too early to open the chain,
    else None (go and ask the chain).

    Consult it only for the epoch already applied: a new epoch goes straight to the chain. It is
    conservative by construction: it skips only while less than `PREGATE_FRACTION` of the
    interval has passed by the clock, and as long as blocks come no faster than `block_s`, fewer
    than `interval_blocks` blocks can have passed by then, so `decide` would refuse the tick too.
    The one case it can delay is "chain-behind" (the chain went backwards), and by less than the
    pre-gate window. A clock that jumped back (negative elapsed) never skips.
    """
    _require_positive(interval_blocks=interval_blocks, block_s=block_s)
    if last_submit_ts is None:
        return None
    elapsed = now - last_submit_ts
    interval_s = interval_blocks * block_s
    if 0 <= elapsed < interval_s * PREGATE_FRACTION:
        return interval_s - elapsed
    return None


def stall_limit(poll_s: float) -> float:
    """Seconds without a completed tick after which the loop counts as wedged: three polls, and
    never less than `MIN_STALL_S`, so only a loop that missed several polls in a row trips it."""
    return float(max(3 * poll_s, MIN_STALL_S))


def check_interval(interval_blocks: int, weights_rate_limit: int) -> str | None:
    """A warning for the operator when the resubmit interval does not clear the chain's
    `weights_rate_limit`, else None.

    An interval equal to the limit is already too short (see `RESUBMIT_BLOCKS`): the chain counts
    from the block the last extrinsic executed in, a little after the block the loop anchored on.
    It is a warning, not a refusal: the loop still works, with one refused attempt per cycle.
    """
    if interval_blocks > weights_rate_limit:
        return None
    return (
        f"resubmit interval of {interval_blocks} blocks does not clear the chain's weights_rate_limit "
        f"of {weights_rate_limit} blocks: the chain counts from the block each submission executes in, "
        f"later than the block read before it, so resubmissions will be refused as too fast; set it "
        f"above {weights_rate_limit} with room for inclusion lag (the default is {RESUBMIT_BLOCKS})"
    )


def _require_positive(*, interval_blocks: int, block_s: float) -> None:
    # A non-positive interval, or a block time that is not a positive finite number, would turn
    # the schedule into "submit on every tick": a configuration mistake to surface, not follow.
    if not interval_blocks >= 1:
        raise ValueError(f"interval_blocks must be at least 1, got {interval_blocks!r}")
    if not (block_s > 0 and math.isfinite(block_s)):
        raise ValueError(f"block_s must be a positive number of seconds, got {block_s!r}")
