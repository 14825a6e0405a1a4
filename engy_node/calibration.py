"""Measure how far honest serving sits from the verdict thresholds, and known cheats beyond them.

A validator trusts `proof.py`'s thresholds only as far as they were measured on the numeric
paths that meet in production (served in bf16 on one device, recomputed in fp32 or bf16 on
another). This module runs that measurement on a real checkpoint: it serves a set of prompts
honestly and through each known cheat, builds the commitments a miner would send, verifies them
the way the verifier does (`proof.verify_commitment`, the same code path) and reports the
statistics behind each verdict.

The cheats are the ones SPEC §5 names:
* `quantised-4bit` — every linear layer re-quantised to 4 bits (symmetric, groups of 32) while
  claiming the canonical checkpoint: the cheaper-hardware cheat;
* `truncated` — the last layers dropped (a smaller model under the big one's name);
* `prefill-attack` — tokens decoded by the 4-bit model, proofs from a prefill of the real model
  over those tokens: TOPLOC passes by construction, only the token check can catch it;
* `malformed-proof`, `wrong-prompt`, `short-proof-list` — commitments a verifier must not
  trust, judged before any arithmetic;
* `swapped-after-proving` — an honest proof, but one relayed token differs from the proved ones
  (the miner changed the answer after proving it);
* `past-eos` — a real proof of an answer that goes on decoding after the end-of-answer token
  (padding an answer paid per token), on a question with a short answer.

`engy-node calibrate` prints the table; the calibration test asserts the verdicts; the numbers
in docs/verification.md come from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from engy_node import proof
from engy_node.models import ModelSpec, model_root
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
from engy_node.serve.sampling import parse_sampling_params
from engy_node.served_model import end_token_ids_of

DEFAULT_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about the sea.",
    "What are three benefits of regular exercise?",
    "Give me a simple recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet.",
)
SHORT_ANSWER_PROMPT = "What is the capital of France?"
"""Answered in a few tokens, so decoding on past the end-of-answer token fits any budget."""
QUANT_BITS = 4
QUANT_GROUP = 32
TRUNCATED_LAYERS_DROPPED = 4


@dataclasses.dataclass(frozen=True, slots=True)
class CaseResult:
    case: str
    expected: proof.VerdictKind
    prompt: int
    recompute_dtype: str
    n_tokens: int
    verdict: proof.Verdict


def quantise_linear_weights(runner: ModelRunner, *, bits: int = QUANT_BITS, group: int = QUANT_GROUP) -> ModelRunner:
    """Round every linear weight (except the tied lm_head) to `bits`-bit symmetric groups, in place."""
    import torch

    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for name, module in runner.model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                weight = module.weight.float()
                groups = weight.reshape(-1, group)
                scale = groups.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / levels
                quantised = (groups / scale).round().clamp(-levels - 1, levels) * scale
                module.weight.copy_(quantised.reshape(weight.shape).to(module.weight.dtype))
    return runner


def truncate_layers(runner: ModelRunner, *, drop: int = TRUNCATED_LAYERS_DROPPED) -> ModelRunner:
    """Drop the last `drop` decoder layers, in place (the final norm and lm_head stay)."""
    layers = runner.model.model.layers
    runner.model.model.layers = layers[: len(layers) - drop]
    runner.model.config.num_hidden_layers = len(layers) - drop
    return runner


def chat_ids(runner: ModelRunner, prompt: str) -> list[int]:
    ids = runner.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def greedy_generation(runner: ModelRunner, prompt_ids: Sequence[int], max_new_tokens: int, *,
                      ignore_eos: bool = False) -> Generation:
    generation = Generation(
        rid="calibration", input_ids=list(prompt_ids),
        params=parse_sampling_params({"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}),
        return_hidden_states=True,
    )
    return run_to_completion(runner, generation)


def run_calibration(
    checkpoint: Path,
    *,
    model: ModelSpec,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    max_new_tokens: int = 96,
    serve_dtype: str = "bfloat16",
    recompute_dtypes: Sequence[str] = ("float32", "bfloat16"),
    device: str = "cpu",
    recompute_device: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[CaseResult]:
    """Serve on `device`, recompute on `recompute_device` (default: the same). Serving on CUDA and
    recomputing on CPU measures the honest margin across numeric paths, which is what a
    validator without the miner's GPU relies on."""
    recompute_device = recompute_device or device
    root = model_root(checkpoint)
    honest = ModelRunner.load(checkpoint, device=device, dtype=serve_dtype)
    quantised = quantise_linear_weights(ModelRunner.load(checkpoint, device=device, dtype=serve_dtype))
    truncated = truncate_layers(ModelRunner.load(checkpoint, device=device, dtype=serve_dtype))
    verifiers = {
        dtype: (honest if dtype == serve_dtype and recompute_device == device
                else ModelRunner.load(checkpoint, device=recompute_device, dtype=dtype))
        for dtype in recompute_dtypes
    }
    results: list[CaseResult] = []
    end_tokens = end_token_ids_of(checkpoint, honest.tokenizer)

    def judge(case: str, expected: proof.VerdictKind, index: int, commitment: proof.Commitment, prompt_ids: Sequence[int],
              relayed: Sequence[int] | None = None) -> None:
        delivery = proof.Delivery(relayed_output_ids=tuple(commitment.output_token_ids if relayed is None else relayed),
                                  ended_at_stop=False, max_tokens=max_new_tokens)
        for dtype, verifier in verifiers.items():
            verdict = proof.verify_commitment(
                commitment, model=model, canonical_root=root, expected_prompt_ids=prompt_ids,
                recompute=verifier.prefill, greedy=True, delivery=delivery, end_token_ids=end_tokens,
            )
            label = dtype if recompute_device == device else f"{dtype} on {recompute_device}"
            results.append(CaseResult(case, expected, index, label, commitment.n_tokens, verdict))
            progress(f"prompt {index} {case:16} recompute {label:8} -> {verdict.kind} ({verdict.reason})")

    for index, prompt in enumerate(prompts):
        prompt_ids = chat_ids(honest, prompt)
        served = greedy_generation(honest, prompt_ids, max_new_tokens)
        honest_commitment = proof.build_commitment(
            model_root=root, prompt_ids=prompt_ids, output_ids=served.output_ids, rows=served.proof_rows(), params=model.proof)
        judge("honest", "pass", index, honest_commitment, prompt_ids)

        cheap = greedy_generation(quantised, prompt_ids, max_new_tokens)
        judge("quantised-4bit", "cheat", index, proof.build_commitment(
            model_root=root, prompt_ids=prompt_ids, output_ids=cheap.output_ids, rows=cheap.proof_rows(), params=model.proof), prompt_ids)

        short = greedy_generation(truncated, prompt_ids, max_new_tokens)
        judge("truncated", "cheat", index, proof.build_commitment(
            model_root=root, prompt_ids=prompt_ids, output_ids=short.output_ids, rows=short.proof_rows(), params=model.proof), prompt_ids)

        hidden, _ = honest.prefill(prompt_ids + cheap.output_ids[:-1])
        attack_rows = hidden[len(prompt_ids) - 1:]
        judge("prefill-attack", "cheat", index, proof.build_commitment(
            model_root=root, prompt_ids=prompt_ids, output_ids=cheap.output_ids, rows=attack_rows, params=model.proof), prompt_ids)

        swapped = list(served.output_ids)
        middle = len(swapped) // 2
        swapped[middle] = (swapped[middle] + 1) % honest.vocab_size
        judge("swapped-after-proving", "cheat", index, honest_commitment, prompt_ids, relayed=swapped)

        if index == 0:
            for case, expected, commitment, claimed_prompt in _malformed_cases(honest_commitment, prompt_ids):
                judge(case, expected, index, commitment, claimed_prompt)
            short_prompt = chat_ids(honest, SHORT_ANSWER_PROMPT)
            padded = greedy_generation(honest, short_prompt, max_new_tokens, ignore_eos=True)
            if any(token in end_tokens for token in padded.output_ids[:-1]):
                judge("past-eos", "cheat", index, proof.build_commitment(
                    model_root=root, prompt_ids=short_prompt, output_ids=padded.output_ids, rows=padded.proof_rows(),
                    params=model.proof), short_prompt)
            else:
                progress(f"past-eos skipped: the model did not end its answer to {SHORT_ANSWER_PROMPT!r} within {max_new_tokens} tokens")
    return results


def _malformed_cases(commitment: proof.Commitment, prompt_ids: Sequence[int]):
    garbage = dataclasses.replace(commitment, proofs=("not base64!",) + commitment.proofs[1:])
    yield "malformed-proof", "unproven", garbage, prompt_ids
    yield "short-proof-list", "unproven", dataclasses.replace(commitment, proofs=commitment.proofs[:1]), prompt_ids
    yield "wrong-prompt", "cheat", commitment, list(prompt_ids[:-1]) + [(prompt_ids[-1] + 1) % 1000]


def format_table(results: Sequence[CaseResult]) -> str:
    """A Markdown table: one row per (case, recompute dtype). Statistics are per request (its
    worst chunk, its largest token gap), shown as the range over requests: for honest serving
    the top of the range is the margin that matters, for a cheat the bottom."""
    header = ("| case | recompute | requests | verdicts | worst-chunk exp mismatches /128 | worst-chunk mant err mean | "
              "max token gap (logits) | non-argmax tokens |\n|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for result in results:
        groups.setdefault((result.case, result.recompute_dtype), []).append(result)
    rows = []
    for (case, dtype), members in groups.items():
        judged = [m.verdict for m in members if m.verdict.chunks_total]
        verdicts = ", ".join(sorted({f"{m.verdict.kind}/{m.verdict.reason}" for m in members}))
        if not judged:
            rows.append(f"| {case} | {dtype} | {len(members)} | {verdicts} | – | – | – | – |")
            continue
        exp = _span([v.max_exp_mismatches for v in judged], "{:d}")
        mant = _span([v.max_mant_err_mean for v in judged], "{:.1f}")
        gap = _span([v.max_logit_gap for v in judged], "{:.2f}")
        misses = sum(v.token_misses for v in judged)
        tokens = sum(m.n_tokens for m in members if m.verdict.chunks_total)
        rows.append(f"| {case} | {dtype} | {len(members)} | {verdicts} | {exp} | {mant} | {gap} | {misses}/{tokens} |")
    return "\n".join([header, *rows])


def _span(values: Sequence[float], fmt: str) -> str:
    def show(value: float) -> str:
        return "∞" if value > 1e18 or not math.isfinite(value) else fmt.format(value)

    low, high = min(values), max(values)
    return show(low) if low == high else f"{show(low)}–{show(high)}"
