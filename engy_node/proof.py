"""TOPLOC commitments and the verdicts built on them (docs/verification.md).

A miner keeps the final hidden state (post final norm) that produced each output token and
commits to it with TOPLOC: per 32-token chunk, the top-128 activations by magnitude encoded as a
polynomial (258 bytes). A verifier recomputes those hidden states with the canonical checkpoint
(one prefill over `prompt_ids + output_token_ids[:-1]`) and compares.

Trust: nothing in a commitment is trusted. Shape checks run before the math because
`toploc.verify_proofs*` zips proofs with chunks and silently checks only the shorter list — a
miner sending one proof for a thousand tokens must not pass on the strength of that one.

Verdicts, and which mistake is cheaper:
* `pass` — enough chunks pass and the token-consistency check passes.
* `cheat` — misbehaviour is *established*: too many failing chunks, served tokens the canonical
  model would not have chosen, a prompt that is not the one sent, output relayed to the buyer
  that is not what was proved, or output that goes on past the end-of-answer token or past
  `max_tokens`. It costs a miner its epoch, so it needs affirmative evidence.
* `unproven` — the proof could not be judged (malformed, wrong parameters, unknown model root,
  recompute failed). It never gates settlement, because it has honest causes; the traffic control
  plane watches its rate instead.

TOPLOC binds hidden states to tokens, not to how the tokens were chosen: a miner can decode with
a cheap model and prefill the real one to obtain valid proofs (the prefill attack). The token
check closes that gap with the logits the verifier's prefill produces anyway: greedy tokens must
be the argmax up to a small numeric margin; sampled tokens must lie inside the request's nucleus
and, taken together, be no less probable under the canonical sampling distribution than honest
sampling makes them (a bound with a stated false-positive rate, `token_check`).

Everything here except `build_proofs`/`verify_chunks` (which call toploc's C++ code) is a pure
function of plain data. Thresholds come from the model catalog; nothing is re-declared here.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from engy_node.models import ModelSpec, ProofParams, TokenCheckParams

VerdictKind = Literal["pass", "cheat", "unproven"]

PROOF_BYTES_PER_CHUNK_OVERHEAD = 2
"""A proof is a 2-byte modulus followed by 2 bytes per coefficient (topk coefficients)."""


class ProofFormatError(ValueError):
    """A commitment is not shaped as docs/protocol.md says; the message says which field."""


@dataclasses.dataclass(frozen=True, slots=True)
class Commitment:
    model_root: str
    output_token_ids: tuple[int, ...]
    proofs: tuple[str, ...]
    topk: int
    decode_batching_size: int
    skip_prefill: bool
    n_tokens: int
    prompt_ids: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "model_root": self.model_root,
            "output_token_ids": list(self.output_token_ids),
            "toploc": {
                "proofs": list(self.proofs),
                "topk": self.topk,
                "decode_batching_size": self.decode_batching_size,
                "skip_prefill": self.skip_prefill,
                "n_tokens": self.n_tokens,
                "prompt_ids": list(self.prompt_ids),
            },
        }

    @classmethod
    def from_wire(cls, wire: Any) -> Commitment:
        """Parse the `commitment` object (docs/protocol.md); `ProofFormatError` names the bad field."""
        if not isinstance(wire, Mapping):
            raise ProofFormatError("commitment must be an object")
        toploc = wire.get("toploc")
        if not isinstance(toploc, Mapping):
            raise ProofFormatError("commitment.toploc must be an object")
        model_root = wire.get("model_root")
        if not isinstance(model_root, str):
            raise ProofFormatError("commitment.model_root must be a string")
        proofs = toploc.get("proofs")
        if not isinstance(proofs, list) or not all(isinstance(p, str) for p in proofs):
            raise ProofFormatError("commitment.toploc.proofs must be a list of base64 strings")
        skip_prefill = toploc.get("skip_prefill")
        if not isinstance(skip_prefill, bool):
            raise ProofFormatError("commitment.toploc.skip_prefill must be a boolean")
        return cls(
            model_root=model_root,
            output_token_ids=_token_list(wire.get("output_token_ids"), "commitment.output_token_ids"),
            proofs=tuple(proofs),
            topk=_plain_int(toploc.get("topk"), "commitment.toploc.topk"),
            decode_batching_size=_plain_int(
                toploc.get("decode_batching_size"), "commitment.toploc.decode_batching_size"
            ),
            skip_prefill=skip_prefill,
            n_tokens=_plain_int(toploc.get("n_tokens"), "commitment.toploc.n_tokens"),
            prompt_ids=_token_list(toploc.get("prompt_ids"), "commitment.toploc.prompt_ids"),
        )


def _plain_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProofFormatError(f"{field} must be an integer")
    return value


MAX_TOKEN_ID = 2**31 - 1
"""Token ids are 32-bit in every tokenizer this project meets; a larger one cannot be decoded."""


def _token_list(value: Any, field: str) -> tuple[int, ...]:
    # Every response's commitment is checked on the gateway's event loop, so the check runs in C
    # (the set of the items' types, then their bounds) rather than a Python test per id. A bool
    # is its own type here, so it is refused like any other non-integer.
    if not isinstance(value, list) or (
        value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) > MAX_TOKEN_ID)
    ):
        raise ProofFormatError(f"{field} must be a list of token ids between 0 and 2**31-1")
    return tuple(value)


def expected_proof_count(n_tokens: int, decode_batching_size: int) -> int:
    return math.ceil(n_tokens / decode_batching_size) if n_tokens > 0 else 0


# ---- building (miner side) -----------------------------------------------------------------


def build_proofs(rows, params: ProofParams) -> list[str]:
    """TOPLOC proofs over `rows` ([n_tokens, hidden], one final hidden state per output token).

    toploc swallows its own errors and returns null proofs, which would only surface later as a
    failed verification on an honest miner; a null proof here raises instead."""
    import toploc
    import torch

    if rows.ndim != 2 or rows.shape[0] == 0:
        raise ValueError(f"proof rows must be a non-empty [n_tokens, hidden] matrix, got shape {tuple(rows.shape)}")
    activations = rows.detach().to("cpu", dtype=torch.bfloat16).contiguous()
    proofs = toploc.build_proofs_base64(
        list(activations), decode_batching_size=params.decode_batching_size, topk=params.topk, skip_prefill=True
    )
    null = toploc.ProofPoly.null(params.topk).to_base64()
    if len(proofs) != expected_proof_count(rows.shape[0], params.decode_batching_size) or null in proofs:
        raise ValueError("toploc could not build a proof for these hidden states")
    return proofs


def build_commitment(
    *, model_root: str, prompt_ids: Sequence[int], output_ids: Sequence[int], rows, params: ProofParams
) -> Commitment:
    if rows.shape[0] != len(output_ids):
        raise ValueError(f"{rows.shape[0]} hidden rows for {len(output_ids)} output tokens; need one per token")
    return Commitment(
        model_root=model_root,
        output_token_ids=tuple(output_ids),
        proofs=tuple(build_proofs(rows, params)),
        topk=params.topk,
        decode_batching_size=params.decode_batching_size,
        skip_prefill=True,
        n_tokens=len(output_ids),
        prompt_ids=tuple(prompt_ids),
    )


# ---- checking (verifier side) --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkResult:
    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float

    def passes(self, params: ProofParams) -> bool:
        return (
            self.exp_mismatches <= params.max_exp_mismatches
            and self.mant_err_mean <= params.max_mant_err_mean
            and self.mant_err_median <= params.max_mant_err_median
        )


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


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """How the gateway delivered an answer: what a proof must agree with (docs/verification.md, check 1)."""

    relayed_output_ids: tuple[int, ...]
    """The output the buyer received, as token ids: the committed ids when the relayed text is
    what they decode to, the shortest prefix of them that covers it when the answer ended at a
    stop string, otherwise the relayed text's own tokenisation (which then disagrees)."""
    ended_at_stop: bool
    """The answer ended at one of the request's stop strings (cut by the gateway or the miner),
    so the committed output may go on past what was relayed, into the stop string."""
    max_tokens: int
    defect: str | None = None
    """How the miner's text differed from its proven tokens in presentation only (a held-back
    tail, whitespace, U+FFFD; `gateway.lifecycle.Relayed.defect`): the buyer was given the proven
    text, and a verdict that passes says so (`defect:<kind>`), never a cheat."""


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    reason: str
    """Short code: `ok`, `chunks`, `tokens`, `prompt-mismatch`, `output-mismatch`, `past-eos`,
    `past-max-tokens`, `output-outside-vocabulary`, `shape:<field>`, `model-root`, `malformed-proof`, `recompute-failed`,
    `empty-output`."""
    path: Literal["toploc", "recompute"] = "toploc"
    """What judged it: the miner's TOPLOC commitment checked against the recompute, or, for an
    answer sent without one, the delivered tokens judged against the recompute alone
    (`judge_delivered`)."""
    chunks_total: int = 0
    chunks_passed: int = 0
    mean_exp_mismatches: float = 0.0
    max_exp_mismatches: int = 0
    max_mant_err_mean: float = 0.0
    max_mant_err_median: float = 0.0
    token_misses: int = 0
    max_logit_gap: float = 0.0
    token_evidence: float = 0.0
    """The token check's log e-value against honest serving (`TokenCheck.evidence`)."""

    @property
    def code(self) -> str:
        """The reason as posted and stored: prefixed `recompute:` when no commitment judged it."""
        return self.reason if self.path == "toploc" else f"{self.path}:{self.reason}"

    @property
    def score(self) -> float:
        """engy's normalised TOPLOC score: mean exponent mismatches over the top-k (0 = exact)."""
        return self.mean_exp_mismatches

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_shape(
    commitment: Commitment,
    *,
    params: ProofParams,
    canonical_root: str | None,
    expected_prompt_ids: Sequence[int] | None,
    delivery: Delivery | None = None,
    end_token_ids: frozenset[int] = frozenset(),
) -> Verdict | None:
    """The checks that come before any arithmetic; None when the commitment is well-formed."""
    if expected_prompt_ids is not None and tuple(expected_prompt_ids) != commitment.prompt_ids:
        return Verdict("cheat", "prompt-mismatch")
    if delivery is not None and (mistake := check_delivery(commitment.output_token_ids, delivery, end_token_ids)):
        return Verdict("cheat", mistake)
    if canonical_root is None or commitment.model_root != canonical_root:
        return Verdict("unproven", "model-root")
    if commitment.topk != params.topk:
        return Verdict("unproven", "shape:topk")
    if commitment.decode_batching_size != params.decode_batching_size:
        return Verdict("unproven", "shape:decode_batching_size")
    if not commitment.skip_prefill:
        return Verdict("unproven", "shape:skip_prefill")
    if commitment.n_tokens != len(commitment.output_token_ids):
        return Verdict("unproven", "shape:n_tokens")
    if not commitment.output_token_ids:
        return Verdict("unproven", "empty-output")
    if len(commitment.proofs) != expected_proof_count(commitment.n_tokens, params.decode_batching_size):
        return Verdict("unproven", "shape:proofs")
    expected_bytes = PROOF_BYTES_PER_CHUNK_OVERHEAD + 2 * params.topk
    for proof in commitment.proofs:
        try:
            raw = base64.b64decode(proof, validate=True)
        except (binascii.Error, ValueError):
            return Verdict("unproven", "malformed-proof")
        if len(raw) != expected_bytes:
            return Verdict("unproven", "malformed-proof")
    return None


def check_delivery(output_ids: Sequence[int], delivery: Delivery, end_token_ids: frozenset[int]) -> str | None:
    """What is wrong between the committed output and its delivery, as a verdict reason, or None.

    * `output-mismatch`: the buyer received other tokens than were proved. The relayed ids must
      equal the committed ones, or, when the answer ended at a stop string, be a prefix of them
      (the stop string itself, and the token it starts in, are proved but not relayed).
    * `past-eos`: the committed output goes on after an end-of-answer token (a miner padding an
      answer it is paid per token for).
    * `past-max-tokens`: more output than the request allowed.
    """
    output_ids = tuple(output_ids)
    relayed = tuple(delivery.relayed_output_ids)
    if relayed != output_ids and not (delivery.ended_at_stop and output_ids[: len(relayed)] == relayed):
        return "output-mismatch"
    if any(token in end_token_ids for token in output_ids[:-1]):
        return "past-eos"
    if len(output_ids) > delivery.max_tokens:
        return "past-max-tokens"
    return None


def verify_chunks(commitment: Commitment, recomputed_rows, params: ProofParams) -> list[ChunkResult]:
    """Compare the commitment's proofs with recomputed hidden rows ([n_tokens, hidden])."""
    import toploc
    import torch

    if recomputed_rows.shape[0] != commitment.n_tokens:
        raise ValueError(f"recompute gave {recomputed_rows.shape[0]} rows for {commitment.n_tokens} tokens")
    activations = recomputed_rows.detach().to("cpu", dtype=torch.bfloat16).contiguous()
    results = toploc.verify_proofs_base64(
        activations,
        list(commitment.proofs),
        decode_batching_size=params.decode_batching_size,
        topk=params.topk,
        skip_prefill=True,
    )
    return [ChunkResult(int(r.exp_mismatches), float(r.mant_err_mean), float(r.mant_err_median)) for r in results]


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


STATISTICAL_MIN_TEMPERATURE = 0.5
TILTS = (0.1, 0.2, 0.35, 0.5, 0.75)
"""The tilts λ the sampled-request test bets with; their average adapts to how far off a cheat's
tokens are (a small λ for a subtle shift, a large one for a blatant one)."""


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


def judge(chunks: Sequence[ChunkResult], tokens: TokenCheck | None, params: ProofParams) -> Verdict:
    """Turn per-chunk results and the token check into a verdict (pure)."""
    if not chunks:
        return Verdict("unproven", "empty-output")
    passed = sum(1 for chunk in chunks if chunk.passes(params))
    kind: VerdictKind
    if passed / len(chunks) < params.min_pass_ratio:
        kind, reason = "cheat", "chunks"
    elif tokens is not None and not tokens.ok:
        kind, reason = "cheat", "tokens"
    else:
        kind, reason = "pass", "ok"
    return Verdict(
        kind,
        reason,
        chunks_total=len(chunks),
        chunks_passed=passed,
        mean_exp_mismatches=sum(c.exp_mismatches for c in chunks) / len(chunks) / params.topk,
        max_exp_mismatches=max(c.exp_mismatches for c in chunks),
        max_mant_err_mean=max(c.mant_err_mean for c in chunks),
        max_mant_err_median=max(c.mant_err_median for c in chunks),
        token_misses=tokens.misses if tokens else 0,
        max_logit_gap=tokens.max_gap if tokens else 0.0,
        token_evidence=tokens.evidence if tokens else 0.0,
    )


Recompute = Callable[..., tuple[Any, Any]]
"""`recompute(token_ids, start=k)` -> (final hidden states [n - k, H], logits [n - k, V]) at the
positions from k on: a prefill (`ModelRunner.prefill`). Only the positions that predict output
tokens are read, so only their logits need computing."""


def verify_commitment(
    commitment: Commitment,
    *,
    model: ModelSpec,
    canonical_root: str | None,
    expected_prompt_ids: Sequence[int] | None,
    recompute: Recompute,
    greedy: bool,
    delivery: Delivery | None = None,
    end_token_ids: frozenset[int] = frozenset(),
    sampling: SamplingTerms | None = None,
) -> Verdict:
    """The whole check of docs/verification.md: shape and delivery, recompute, chunk comparison, token check, verdict.
    `end_token_ids` are the canonical model's end-of-answer tokens; `sampling` how a request that
    was not `greedy` asked to be sampled (temperature 1, no nucleus, when not known)."""
    shape = check_shape(
        commitment,
        params=model.proof,
        canonical_root=canonical_root,
        expected_prompt_ids=expected_prompt_ids,
        delivery=delivery,
        end_token_ids=end_token_ids,
    )
    if shape is not None:
        return shape
    prompt, output = list(commitment.prompt_ids), list(commitment.output_token_ids)
    if not prompt:
        return Verdict("unproven", "shape:prompt_ids")
    first = len(prompt) - 1
    try:
        rows, row_logits = recompute(prompt + output[:-1], start=first)
    except Exception:  # broad on purpose: any recompute failure is "could not judge", never "cheat"
        return Verdict("unproven", "recompute-failed")
    if max(output) >= row_logits.shape[-1]:
        return Verdict("cheat", "output-outside-vocabulary")
    try:
        chunks = verify_chunks(commitment, rows, model.proof)
    except (ValueError, RuntimeError):
        return Verdict("unproven", "malformed-proof")
    terms = None if greedy else (sampling or SamplingTerms(temperature=1.0))
    stats = token_stats(
        row_logits,
        output,
        sampling=terms,
        nucleus_margin=model.token_check.nucleus_margin,
        first_position=first,
        edge_band=model.token_check.nucleus_edge_band,
    )
    tokens = token_check(stats, greedy=greedy, params=model.token_check)
    return judge(chunks, tokens, model.proof)


def judge_delivered(
    prompt_ids: Sequence[int],
    delivered_ids: Sequence[int],
    *,
    model: ModelSpec,
    recompute: Recompute,
    greedy: bool,
    sampling: SamplingTerms | None = None,
    resegment: Callable[[Sequence[int], Sequence[int]], Sequence[int] | None] | None = None,
) -> Verdict:
    """Judge an answer that came with no TOPLOC commitment (a TEE miner relies on attestation;
    any miner may send `commitment: {}`) on its delivered tokens alone: the verifier holds the
    canonical model, so one prefill over the prompt and the delivered tokens gives the logits
    every token was chosen from, and the token check applies as it does to a proven answer —
    greedy by the argmax rule, sampled by replay when seeded and by the statistical test when
    not. Only the hidden-state comparison is missing, so a miner that decodes with the real
    model is judged exactly as one that proves, and one that serves a cheaper model is caught
    as far as its tokens give it away.

    The delivered tokens are the gateway's tokenisation of the text the buyer received, which
    is the model's own segmentation nearly always but not always (a model may write "c" + "ul"
    where the tokenizer writes "cul"), and a word in other pieces puts every later token in a
    context the model never saw: the tokens right after it trail by logits, not by drift. So an
    answer the check rejects is judged once more on `resegment(prompt_ids, delivered_ids)`: the
    same text in the pieces the canonical model itself would most likely have written it in
    (`verifier.model_segmentation`), when they differ. A cheat's text is its own in any pieces.
    """
    prompt, delivered = list(prompt_ids), list(delivered_ids)
    if not delivered:
        return Verdict("unproven", "empty-output", path="recompute")
    if not prompt:
        return Verdict("unproven", "shape:prompt_ids", path="recompute")
    verdict = _judge_tokens(prompt, delivered, model=model, recompute=recompute, greedy=greedy, sampling=sampling)
    if verdict.kind != "cheat" or resegment is None:
        return verdict
    try:
        pieces = resegment(prompt, delivered)
    except Exception:  # broad on purpose: the first verdict stands when the pieces cannot be found
        return verdict
    if not pieces or list(pieces) == delivered:
        return verdict
    return _judge_tokens(prompt, list(pieces), model=model, recompute=recompute, greedy=greedy, sampling=sampling)


def _judge_tokens(
    prompt: list[int],
    delivered: list[int],
    *,
    model: ModelSpec,
    recompute: Recompute,
    greedy: bool,
    sampling: SamplingTerms | None,
) -> Verdict:
    first = len(prompt) - 1
    try:
        _, row_logits = recompute(prompt + delivered[:-1], start=first)
    except Exception:  # broad on purpose: any recompute failure is "could not judge", never "cheat"
        return Verdict("unproven", "recompute-failed", path="recompute")
    if max(delivered) >= row_logits.shape[-1]:
        return Verdict("unproven", "output-outside-vocabulary", path="recompute")
    terms = None if greedy else (sampling or SamplingTerms(temperature=1.0))
    stats = token_stats(
        row_logits,
        delivered,
        sampling=terms,
        nucleus_margin=model.token_check.nucleus_margin,
        first_position=first,
        edge_band=model.token_check.nucleus_edge_band,
    )
    tokens = token_check(stats, greedy=greedy, params=model.token_check)
    kind: VerdictKind
    kind, reason = ("pass", "ok") if tokens.ok else ("cheat", "tokens")
    return Verdict(
        kind,
        reason,
        path="recompute",
        token_misses=tokens.misses,
        max_logit_gap=tokens.max_gap,
        token_evidence=tokens.evidence,
    )
