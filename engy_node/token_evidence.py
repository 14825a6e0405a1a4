"""The token check's decision: were these the tokens the canonical model would have served?
(docs/verification.md, the token check)

TOPLOC binds hidden states to tokens, not to how the tokens were chosen; this closes that gap
with the statistics `logit_stats.token_stats` takes from the verifier's recompute. Greedy and
seeded answers are judged by how far each served token trails the recompute's own choice, with
misses inside the measured drift band never counted; sampled answers by whether every token lies
in the request's nucleus and, together, are no less probable than honest sampling makes them.
Each test is an e-value bounded by Ville's inequality, so it has a stated false-positive rate.

Pure functions of plain numbers (no torch), apart from the logits that produced them, so the
thresholds can be studied and tested directly (`strictness.py`, `drift.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from engy_node.logit_stats import TILTS, TokenStats
from engy_node.models import TokenCheckParams


@dataclasses.dataclass(frozen=True, slots=True)
class TokenCheck:
    ok: bool
    reason: str
    misses: int
    max_gap: float
    mean_logprob: float
    worst_rank: int
    evidence: float = 0.0
    """The log of the e-value against honest serving: for greedy and seeded answers the misses
    beyond the drift band (`miss_evidence`), for the statistical test the tokens' improbability
    (`sampled_evidence`). The answer is a cheat when it reaches log(1 / false-positive rate)."""


def token_check(stats: TokenStats, *, greedy: bool, params: TokenCheckParams) -> TokenCheck:
    """Were these the tokens the canonical model would have served? (pure)

    Greedy and seeded answers are judged alike: each served token trails the token the
    recompute would have chosen (its argmax, or the replayed draw's winner) by a gap, and honest
    numeric drift makes small gaps. A gap past the margin is a cheat on its own; gaps inside the
    measured drift band are noise, however many; only gaps between the band and the margin are
    evidence, weighed together by `miss_evidence` at a stated false-positive rate."""
    n = len(stats.tokens)
    misses = sum(1 for r in stats.rank if r > 0)
    max_gap = max(stats.gap, default=0.0)
    mean_logprob = sum(stats.logprob) / n if n else 0.0
    worst_rank = max(stats.rank, default=0)
    limit = math.log(1 / params.miss_false_positive_rate)
    if greedy:
        if max_gap > params.greedy_logit_margin:
            return TokenCheck(False, "greedy-gap", misses, max_gap, mean_logprob, worst_rank)
        evidence = miss_evidence(stats.gap, band=params.greedy_drift_band, rate=params.greedy_drift_rate)
        if evidence >= limit:
            return TokenCheck(False, "greedy-misses", misses, max_gap, mean_logprob, worst_rank, evidence)
        return TokenCheck(True, "ok", misses, max_gap, mean_logprob, worst_rank, evidence)
    if stats.replay_gap:
        replay_misses = sum(1 for gap in stats.replay_gap if gap > 0)
        replay_max = max(stats.replay_gap)
        if replay_max > params.seeded_margin:
            return TokenCheck(False, "seeded-gap", replay_misses, replay_max, mean_logprob, worst_rank)
        evidence = miss_evidence(stats.replay_gap, band=params.seeded_drift_band, rate=params.seeded_drift_rate)
        if evidence >= limit:
            return TokenCheck(False, "seeded-misses", replay_misses, replay_max, mean_logprob, worst_rank, evidence)
        return TokenCheck(True, "ok", replay_misses, replay_max, mean_logprob, worst_rank, evidence)
    if not all(stats.in_nucleus):
        return TokenCheck(False, "sampled-outside-nucleus", misses, max_gap, mean_logprob, worst_rank)
    evidence = sampled_evidence(stats, drift_per_token=params.sampled_drift_per_token)
    if evidence >= math.log(1 / params.sampled_false_positive_rate):
        return TokenCheck(False, "sampled-improbable", misses, max_gap, mean_logprob, worst_rank, evidence)
    return TokenCheck(True, "ok", misses, max_gap, mean_logprob, worst_rank, evidence)


MISS_TILTS = (0.01, 0.03, 0.1, 0.3)
"""The stakes λ the miss test bets with: a small one pays off on a long answer with a few
misses beyond the band, a large one on a short answer full of them."""


def miss_evidence(gaps: Sequence[float], *, band: float, rate: float) -> float:
    """Log of an e-value against "these gaps are honest numeric drift" (pure).

    Honest serving chooses each token on its own numeric path, so a token trails the
    recompute's choice only by how far the two paths' logits disagree, whatever the text: if a
    served token t is the serving argmax and the recompute adds δ to every logit, its gap is at
    most max_j (δ_j − δ_t). The chance that a token trails by more than `band` is then a
    property of the numeric paths, measured (`engy_node/drift.py`) and bounded by `rate`, at
    every position whatever came before. For a stake λ in (0, 1], the product over tokens of
    (1 − λ + λ·[gap > band] / rate) has expectation at most 1 at every step under that bound,
    so it is a nonnegative supermartingale, and so is the average over the stakes: by Ville's
    inequality it reaches 1/α with probability at most α. Gaps inside the band are not
    evidence at all — a near-tie flips honestly with a chance that depends on the text, not the
    paths — so an answer full of near-ties, as short technical answers can be, is never judged
    on their count."""
    n = len(gaps)
    beyond = sum(1 for gap in gaps if gap > band)
    if n == 0:
        return 0.0
    logs = [(n - beyond) * math.log1p(-stake) + beyond * math.log(1 - stake + stake / rate) for stake in MISS_TILTS]
    top = max(logs)
    return top + math.log(sum(math.exp(value - top) for value in logs) / len(logs))


def sampled_evidence(stats: TokenStats, *, drift_per_token: float) -> float:
    """Log of an e-value against "these tokens were sampled from the canonical distribution".

    For each tilt λ, prod_i p_i(token_i)^-λ / E[p_i(X)^-λ] has expectation exactly 1 at every
    step under honest sampling, whatever the distributions (heavy tails included: one honest rare
    token moves it by λ times its surprisal less what was expected, not by an unbounded z-score),
    so it is a nonnegative martingale, and so is the average over the tilts. By Ville's
    inequality it reaches 1/α with probability at most α: judging `improbable` at log(1/α) has
    false-positive rate α. Tokens likelier than the canonical sampler's (a greedy answer) lower
    it: only too-improbable text is evidence. `drift_per_token` (nats) is taken off for the
    difference between serving's and the recompute's numerics.
    """
    if not stats.surprisal:
        return 0.0
    totals = [sum(tilt * s - row[j] for s, row in zip(stats.surprisal, stats.tilts)) for j, tilt in enumerate(TILTS)]
    top = max(totals)
    mixture = top + math.log(sum(math.exp(total - top) for total in totals) / len(totals))
    return mixture - drift_per_token * len(stats.surprisal)
