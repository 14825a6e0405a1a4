"""What the canonical model's recomputed logits say about each token an answer served: the
statistics the token check judges (docs/verification.md, the token check).

A verifier's prefill over the prompt and the served tokens yields, at every output position,
the logits the canonical model chose that token from. `token_stats` reduces them to plain
numbers per position (`TokenStats`): the served token's gap to the argmax and its rank; for a
sampled request its surprisal under the distribution the request asked for (temperature, then
the top_p nucleus, widened by what numeric paths disagree on) and the expected values the
e-value needs; for a seeded request how far serving's numerics would have to differ for the
served token to have won the replayed draw. This is the imperative half, in torch and in
bounded blocks whatever the answer's length; the decision on those numbers is
`token_evidence`'s, a pure function, so it can be tested and benchmarked without a model.

Importing this module imports no torch: the functions that compute import it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingTerms:
    """How a sampled request asked to be sampled (what the token check replays)."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    """Set when the miner samples deterministically from it on sglang's rank path (sglang's
    `--enable-deterministic-inference` with `protocol.miner.SEEDED_TOP_K`; the reference server
    takes the same path for the same knobs): the verifier then replays that one draw on the
    canonical logits, as strictly as a greedy answer."""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenStats:
    """Per output position, what the canonical model's logits say about the served token."""

    tokens: tuple[int, ...]
    argmax: tuple[int, ...]
    gap: tuple[float, ...]
    """max logit minus the served token's logit (0 when the served token is the argmax)."""
    rank: tuple[int, ...]
    """0-based rank of the served token among all logits (0 = argmax)."""
    logprob: tuple[float, ...]
    surprisal: tuple[float, ...] = ()
    """Sampled requests: -log of the served token's probability under the distribution the
    request was sampled from (temperature, then the nucleus, renormalised). Empty when greedy."""
    tilts: tuple[tuple[float, ...], ...] = ()
    """Sampled requests: per position, log E[p(X)^-λ] under that distribution for each λ in
    `TILTS`: what honest sampling's surprisal is expected to contribute, exactly (`token_check`)."""
    in_nucleus: tuple[bool, ...] = ()
    """Sampled requests: whether the served token lies inside the top_p nucleus (with the margin)."""
    replay_gap: tuple[float, ...] = ()
    """Seeded requests: how far, in logits, serving's numerics would have to differ from the
    recompute's for the served token to win the replayed seeded draw (0 when it wins it;
    infinite when no rank it could hold was in the draw). `_replay_gaps`."""


STATISTICAL_MIN_TEMPERATURE = 0.5
TILTS = (0.1, 0.2, 0.35, 0.5, 0.75)
"""The tilts λ the sampled-request test (`token_evidence.sampled_evidence`) bets with; their average adapts to how far off a cheat's
tokens are (a small λ for a subtle shift, a large one for a blatant one)."""


TOKEN_STATS_BLOCK_ELEMENTS = 1 << 24
"""Logits judged at once: 16M values, 128 MB in float64 (sorting doubles it). A 4,096-token
answer over Qwen's 151k vocabulary would otherwise hold ~5 GB per working copy."""


def token_stats(
    logits,
    tokens: Sequence[int],
    *,
    sampling: SamplingTerms | None = None,
    nucleus_margin: float = 0.0,
    first_position: int = 0,
    edge_band: float = 0.0,
) -> TokenStats:
    """Summarise recomputed logits ([n, vocab], row i predicts tokens[i]) for the token check;
    with `sampling` (a sampled request), also each token's surprisal under the distribution the
    request was sampled from (temperature, then the top_p nucleus, renormalised), and with a
    seed the replayed draw at each position (row i is drawn at `first_position + i`: the
    position of the last token the model had seen). Rows are taken in blocks so the working
    copies stay bounded whatever the answer's length."""
    tokens = list(tokens)
    rows_per_block = max(1, TOKEN_STATS_BLOCK_ELEMENTS // max(1, logits.shape[-1]))
    blocks = [
        _token_stats_block(
            logits[start : start + rows_per_block],
            tokens[start : start + rows_per_block],
            sampling=sampling,
            nucleus_margin=nucleus_margin,
            first_position=first_position + start,
            edge_band=edge_band,
        )
        for start in range(0, len(tokens), rows_per_block)
    ]
    if len(blocks) == 1:
        return blocks[0]
    return TokenStats(
        **{
            field.name: tuple(itertools.chain.from_iterable(getattr(block, field.name) for block in blocks))
            for field in dataclasses.fields(TokenStats)
        }
    )


def _token_stats_block(
    logits,
    tokens: Sequence[int],
    *,
    sampling: SamplingTerms | None,
    nucleus_margin: float,
    first_position: int,
    edge_band: float,
) -> TokenStats:
    import torch

    logits = logits.float()
    target = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    token_logit = logits.gather(1, target[:, None])[:, 0]
    max_logit, argmax = logits.max(dim=1)
    # No logit exceeds the maximum, so the rank is 0 wherever the served token holds it (nearly
    # every token of an honest greedy answer); only the other rows are read again to count.
    rank = torch.zeros_like(target)
    behind = (token_logit != max_logit).nonzero()[:, 0]
    rank[behind] = (logits[behind] > token_logit[behind, None]).sum(dim=1, dtype=torch.int32).long()
    logprob = torch.log_softmax(logits, dim=1).gather(1, target[:, None])[:, 0]
    surprisal: tuple[float, ...] = ()
    tilts: tuple[tuple[float, ...], ...] = ()
    in_nucleus: tuple[bool, ...] = ()
    replay_gap: tuple[float, ...] = ()
    if sampling is not None:
        # The statistical test judges at no less than `STATISTICAL_MIN_TEMPERATURE`: at a lower
        # one a numeric near-tie flip between serving and recompute would look improbable, while
        # honest draws at the lower temperature are only likelier under the flatter distribution
        # (the test stays a supermartingale).
        judged_at = max(sampling.temperature, STATISTICAL_MIN_TEMPERATURE)
        logp = torch.log_softmax(logits.double() / judged_at, dim=1)
        if sampling.top_p < 1.0:
            # sglang keeps, in descending order, every token whose preceding mass is below top_p;
            # the margin widens the nucleus for what serving and recompute disagree on: by mass,
            # and by logits, as tied or nearly tied tokens at the edge stand in either order
            # between numeric paths (one honest answer's token had an exact bf16 twin, whose mass
            # the recompute counted before it and the miner after). Every token inside the
            # nucleus is at least as likely as its edge, so widening by logits (a margin, never
            # negative) takes in the whole nucleus.
            margin = edge_mass_margin(sampling.top_p, judged_at, floor=nucleus_margin, band=edge_band)
            edge = _nucleus_edge(logp, min(1.0, sampling.top_p + margin))
            kept = logp >= edge[:, None] - edge_band / judged_at
            in_nucleus = tuple(kept.gather(1, target[:, None])[:, 0].tolist())
            logp = torch.log_softmax(logp.masked_fill(~kept, -math.inf), dim=1)
        else:
            in_nucleus = (True,) * len(tokens)
        token_logp = logp.gather(1, target[:, None])[:, 0]
        surprisal = tuple((-token_logp).clamp(max=1e6).tolist())
        tilts = _tilts(logp)
        if sampling.seed is not None:
            replay_gap = _replay_gaps(
                logits, tokens, sampling, first_position, edge_band=edge_band, nucleus_margin=nucleus_margin
            )
    return TokenStats(
        tokens=tuple(tokens),
        argmax=tuple(argmax.tolist()),
        gap=tuple((max_logit - token_logit).tolist()),
        rank=tuple(rank.tolist()),
        logprob=tuple(logprob.tolist()),
        surprisal=surprisal,
        tilts=tilts,
        in_nucleus=in_nucleus,
        replay_gap=replay_gap,
    )


def edge_mass_margin(top_p: float, temperature: float, *, floor: float, band: float) -> float:
    """How far, in probability mass, a nucleus edge at `top_p` may move between serving and
    recompute. The mass S before a rank moves with the logits by dS = Σ p_j (1[j before] − S)
    dl_j / T, so logits that disagree by at most `band` between the two sides (each by half of
    it, in opposite directions at worst) move it by at most S (1 − S) band / T: little where one
    token holds nearly all the mass or none, most at a low temperature. One honest answer, T 0.7
    top_p 0.9 recomputed in bf16, had its top token's logit 0.25 apart, which moved the edge by
    0.024 of mass; a fixed 0.02 judged it a cheat. `floor` keeps the margin for rounding and ties."""
    return max(floor, top_p * (1 - top_p) * band / temperature)


NUCLEUS_CANDIDATES = 1024
"""Most probable tokens per row sorted first when cutting a top_p nucleus; a row whose nucleus
reaches past them is taken again with eight times as many (at most the whole vocabulary)."""


def _nucleus_edge(logp, threshold: float):
    """Per row of float64 log-probabilities, the least log-probability inside the nucleus: among
    the tokens whose preceding mass in descending order (float64, as `torch.cumsum` adds it) is
    below `threshold`. Sorting a whole 49k-token row costs ~2 ms; only the candidates are sorted,
    which decides the cut once their mass reaches the threshold: a float64 running sum of
    non-negative terms never falls, so every later token's preceding mass is at least theirs,
    less a rounding far below the 1e-12 asked beyond it."""
    import torch

    vocab = logp.shape[1]
    edge = torch.empty(logp.shape[0], dtype=logp.dtype, device=logp.device)
    rows = torch.arange(logp.shape[0], device=logp.device)
    count = min(NUCLEUS_CANDIDATES, vocab)
    while len(rows):
        top = (logp if len(rows) == len(logp) else logp[rows]).topk(count, dim=1).values
        ordered = top.exp()
        mass = ordered.cumsum(dim=1)
        decided = (mass[:, -1] >= threshold + 1e-12) | (count == vocab)
        inside = (mass - ordered)[decided] < threshold
        edge[rows[decided]] = top[decided].masked_fill(~inside, math.inf).min(dim=1).values
        rows, count = rows[~decided], min(8 * count, vocab)
    return edge


def _tilts(logp) -> tuple[tuple[float, ...], ...]:
    """Per row, log E[p(X)^-λ] = logsumexp((1 - λ) log p) for each λ in `TILTS`, in float64 (the
    e-value's guarantee rests on them): `torch.logsumexp`'s own steps, bit for bit, in one buffer
    and with one maximum for all five — scaling by a positive number keeps the maximum's place,
    and rounding is monotone, so each tilt's maximum is the scaled maximum."""
    import torch

    top = logp.max(dim=1).values
    scaled = torch.empty_like(logp)
    sums = []
    for tilt in TILTS:
        peak = top * (1 - tilt)
        torch.mul(logp, 1 - tilt, out=scaled)
        sums.append(scaled.sub_(peak[:, None]).exp_().sum(dim=1).log_().add_(peak))
    return tuple(zip(*(column.tolist() for column in sums)))


REPLAY_BLOCK_ELEMENTS = 1 << 21
"""Logits replayed at once: a dozen float64/int64 working copies of 2M values (~200 MB at most)."""


def _replay_gaps(
    logits,
    tokens: Sequence[int],
    sampling: SamplingTerms,
    first_position: int,
    *,
    edge_band: float,
    nucleus_margin: float,
) -> tuple[float, ...]:
    """Per position, how far (in logits) the numeric paths would have to disagree for the served
    token to have won the seeded draw the miner announced: sglang's rank path (`serve/sampling.py`,
    the miner sends `protocol.miner.SEEDED_TOP_K`), where the Gumbel noise goes by rank in
    descending probability, not by token id.

    Serving and recompute order tokens of nearly equal probability differently, so which token
    held which rank (and so which noise) is not known exactly — but the sorted values are: a
    sorted list moves no further than its entries do, so if every log-weight differs by at most
    ε between the two paths, the r-th largest does too, whichever token holds it. The draw is
    therefore decided by ranks, values known to ±ε, and noise known exactly; the served token t
    can have won at rank r only if its own log-weight is within 2ε of the r-th value, and that
    rank's value plus noise beat every other rank's less 2ε. The gap is the least 2ε (times T:
    log-weights are logits / T, and numeric drift is in logits at any temperature) for which
    some rank satisfies both — 0 when the recompute's own draw picks t. That is the greedy
    check's gap with the argmax replaced by the draw: an honest token trails by the paths'
    drift, a token the draw did not pick by how far it lost, with no window of ranks to hide in.

    The nucleus edge moves between numeric paths too, both ways: t may have held a rank just
    outside the request's nucleus (widened by `edge_mass_margin` of mass, or by `edge_band` in
    logits), and a rank inside the nucleus only by those margins cannot be the one it lost to.
    Without top_p every rank competes."""
    import torch

    from engy_node.serve.sampling import seeded_gumbels

    assert sampling.seed is not None, "a seeded draw only"  # token_stats calls it only then

    n, vocab = len(tokens), logits.shape[-1]
    temperature = torch.tensor(sampling.temperature, dtype=torch.float32)
    cut = torch.tensor(sampling.top_p, dtype=torch.float32)
    margin = edge_mass_margin(sampling.top_p, sampling.temperature, floor=nucleus_margin, band=edge_band)
    widened = torch.tensor(min(1.0, sampling.top_p + margin), dtype=torch.float32)
    narrowed = torch.tensor(max(0.0, sampling.top_p - margin), dtype=torch.float32)
    band = edge_band / sampling.temperature
    gaps: list[float] = []
    rows_per_block = max(1, REPLAY_BLOCK_ELEMENTS // vocab)
    for start in range(0, n, rows_per_block):
        block = logits[start : start + rows_per_block]
        served = torch.tensor(list(tokens[start : start + rows_per_block]), dtype=torch.long, device=logits.device)
        # As sglang: float32 softmax of logits / T, sorted descending, float32 mass before each rank.
        probs = torch.softmax(block.float() / temperature, dim=1)
        # Non-negative float32 values sort as their bit patterns, and an integer sort takes the
        # radix path: 4x a float sort's speed, the same values.
        ordered = torch.sort(probs.view(torch.int32), dim=1).values.flip(1).view(torch.float32)
        mass_before = torch.cumsum(ordered, dim=1) - ordered
        weights = torch.log(ordered.to(torch.float64))
        own = torch.log(probs.gather(1, served[:, None]).to(torch.float64))
        if sampling.top_p < 1.0:
            inside = mass_before <= cut
            edge = weights.masked_fill(~inside, math.inf).min(dim=1, keepdim=True).values
            could_hold = (mass_before <= widened) | (weights >= edge - band)
            rivals = (mass_before <= narrowed) & (weights >= edge + band)
            rivals[:, 0] = True
        else:
            could_hold = torch.ones_like(weights, dtype=torch.bool)
            rivals = mass_before <= cut
        could_hold &= torch.isfinite(weights)
        positions = range(first_position + start, first_position + start + len(served))
        noise = seeded_gumbels(sampling.seed, positions, vocab, logits.device)
        scores = (weights + noise).masked_fill_(~rivals, -math.inf)
        best, leader = scores.topk(2, dim=1)
        # What rank r must beat: the best other rank, i.e. the leader unless r is the leader.
        beat = best[:, :1].expand(-1, vocab).clone()
        beat.scatter_(1, leader[:, :1], best[:, 1:2])
        apart = (weights - own).abs_()
        short = beat.sub_(torch.minimum(weights, own)).sub_(noise)
        need = torch.maximum(apart, short).masked_fill_(~could_hold, math.inf)
        gaps.extend((need.min(dim=1).values.clamp_(min=0.0) * sampling.temperature).tolist())
    return tuple(gaps)
