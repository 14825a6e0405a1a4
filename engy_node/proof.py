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
sampling makes them (a bound with a stated false-positive rate). The token check has modules of
its own: `logit_stats` reduces the recompute's logits to per-token numbers (torch) and
`token_evidence` decides on them (pure); this module puts them together with the commitment.

Everything here except `build_proofs`/`verify_chunks` (which call toploc's C++ code) and the
recompute and logit reduction that `verify_commitment` / `judge_delivered` drive is a pure
function of plain data. Thresholds come from the model catalog; nothing is re-declared here.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from engy_node.logit_stats import SamplingTerms, token_stats
from engy_node.models import ModelSpec, ProofParams
from engy_node.token_evidence import TokenCheck, token_check

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
    tail, whitespace, U+FFFD; `gateway.request.accounting.Relayed.defect`): the buyer was given the proven
    text, and a verdict that passes says so (`defect:<kind>`), never a cheat."""


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    reason: str
    """Short code: `ok`, `chunks`, `tokens`, `prompt-mismatch`, `output-mismatch`, `past-eos`,
    `past-max-tokens`, `output-outside-vocabulary`, `shape:<field>`, `model-root`, `malformed-proof`, `recompute-failed`,
    `empty-output`."""
    path: Literal["toploc", "recompute", "gemm"] = "toploc"
    """What judged it: the miner's TOPLOC commitment checked against the recompute, or, for an
    answer sent without one, the delivered tokens judged against the recompute alone
    (`judge_delivered`), or the GEMM audit of its committed activations
    (`engy_node.verifier.gemm_audit`: a cheat or unproven there, which then carries the reason)."""
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
        """The reason as posted and stored: prefixed `recompute:` when no commitment judged it,
        `gemm:` when the GEMM audit did (`gemm:no-opening`, `gemm:rows-down-proj`)."""
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
