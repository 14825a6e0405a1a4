"""Measure how far honest serving sits from the verdict thresholds, and known cheats beyond them.

A validator trusts `proof.py`'s thresholds only as far as they were measured on the numeric
paths that meet in production (served in bf16 on one device, recomputed in fp32 or bf16 on
another). This module runs that measurement on a real checkpoint: it serves a set of prompts
honestly and through each known cheat, builds the commitments a miner would send, verifies them
the way the verifier does (`proof.verify_commitment`, the same code path) and reports the
statistics behind each verdict.

The cheats are the ones docs/verification.md measures:
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

Sampled requests (`SAMPLED_SETTINGS`) are served honestly, by the 4-bit model, and through the
prefill attack, each judged both ways a verifier can: by replaying the seeded draw (a miner that
announced `seeded-sampling`) and by the statistical test (one that did not).

Detection power (`POWER_CASES`) measures smaller deviations from the canonical model — relative
weight noise, 8-bit weights, a layer replaced by its neighbour, the final norm scaled — with no
verdict expected: how far each lands from the thresholds is what is published.

`run_sampled_soundness` serves many honest sampled requests and counts how many each check
judges a cheat: the false-positive rate, with its 95 % interval (`proportion_interval`).

`engy-node calibrate` prints the tables; the calibration tests assert the verdicts; the numbers
in docs/verification.md come from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from engy_node import logit_stats, proof
from engy_node.models import ModelSpec, model_root
from engy_node.protocol.miner import SEEDED_TOP_K
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
from engy_node.serve.sampling import parse_sampling_params
from engy_node.served_model import end_token_ids_of
from engy_node.simulated_cheats import check_simulated_cheat

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
SAMPLED_SETTINGS = ((0.7, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 0.9))
"""(temperature, top_p) of the sampled cases: buyers' common settings, with and without a nucleus."""
NOISE_SEED = 20261201


@dataclasses.dataclass(frozen=True, slots=True)
class CaseResult:
    case: str
    expected: proof.VerdictKind | None
    """None for a detection-power case: measured and published, no verdict asserted."""
    prompt: int
    recompute_dtype: str
    n_tokens: int
    verdict: proof.Verdict
    sampling: str = "greedy"
    """`greedy`, or the request's `T 0.7 top_p 0.9`."""
    check: str = "greedy"
    """Which token check judged it: `greedy`, `replay` (seeded) or `statistical`."""


# ---- cheats: the canonical model, altered in place ---------------------------------------------


def _linear_weights(runner: ModelRunner):
    """Every linear layer's weight except the lm_head (tied to the embeddings in small models)."""
    import torch

    for name, module in runner.model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            yield module.weight


def quantise_linear_weights(runner: ModelRunner, *, bits: int = QUANT_BITS, group: int = QUANT_GROUP) -> ModelRunner:
    """Round every linear weight (except the tied lm_head) to `bits`-bit symmetric groups, in place."""
    import torch

    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for parameter in _linear_weights(runner):
            weight = parameter.float()
            groups = weight.reshape(-1, group)
            scale = groups.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / levels
            quantised = (groups / scale).round().clamp(-levels - 1, levels) * scale
            parameter.copy_(quantised.reshape(weight.shape).to(parameter.dtype))
    return runner


def add_weight_noise(runner: ModelRunner, relative: float, *, seed: int = NOISE_SEED) -> ModelRunner:
    """Add Gaussian noise to every linear weight, with a standard deviation of `relative` times
    that matrix's own: the smallest perturbations a verifier might be asked to tell apart."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in _linear_weights(runner):
            weight = parameter.float()
            noise = torch.randn(weight.shape, generator=generator) * (relative * float(weight.std()))
            parameter.copy_((weight + noise.to(weight.device)).to(parameter.dtype))
    return runner


def replace_layer_with_neighbour(runner: ModelRunner, index: int | None = None) -> ModelRunner:
    """Give decoder layer `index` (default: the middle one) the weights of the layer after it."""
    layers = runner.model.model.layers
    index = len(layers) // 2 if index is None else index
    layers[index].load_state_dict(layers[index + 1].state_dict())
    return runner


def scale_final_norm(runner: ModelRunner, factor: float = 1.05) -> ModelRunner:
    """Scale the final RMSNorm's weight: every output hidden state grows by `factor`."""
    import torch

    with torch.no_grad():
        runner.model.model.norm.weight.mul_(factor)
    return runner


def truncate_layers(runner: ModelRunner, *, drop: int = TRUNCATED_LAYERS_DROPPED) -> ModelRunner:
    """Drop the last `drop` decoder layers, in place (the final norm and lm_head stay)."""
    layers = runner.model.model.layers
    runner.model.model.layers = layers[: len(layers) - drop]
    runner.model.config.num_hidden_layers = len(layers) - drop
    return runner


POWER_CASES: tuple[tuple[str, Callable[[ModelRunner], ModelRunner]], ...] = (
    ("noise-0.1%", lambda runner: add_weight_noise(runner, 1e-3)),
    ("noise-0.3%", lambda runner: add_weight_noise(runner, 3e-3)),
    ("noise-1%", lambda runner: add_weight_noise(runner, 1e-2)),
    ("noise-3%", lambda runner: add_weight_noise(runner, 3e-2)),
    ("quantised-8bit", lambda runner: quantise_linear_weights(runner, bits=8)),
    ("neighbour-layer", replace_layer_with_neighbour),
    ("final-norm-x1.05", scale_final_norm),
)
"""Deviations measured for detection power, mildest first."""

SIMULATED_CHEATS: dict[str, Callable[[ModelRunner], ModelRunner]] = {
    **dict(POWER_CASES),
    "quantised-4bit": quantise_linear_weights,
}
"""The weight cheats a reference server can be told to commit (`serve.simulate_cheat`, for
demos and tests of the audits): each alters the loaded weights in place and keeps the model's
shape, so the server still answers and commits like an honest one. `truncated` is not among
them: a model with fewer layers is the smaller-model cheat, which the gateway's `model_root`
check refuses before any audit."""


def simulated_cheat(name: str, *, where: str) -> Callable[[ModelRunner], ModelRunner]:
    """The cheat `name` of `SIMULATED_CHEATS`; an unknown one raises `ConfigError` naming
    `where` (the setting or flag) and the names there are."""
    return SIMULATED_CHEATS[check_simulated_cheat(name, where=where)]


# ---- serving -----------------------------------------------------------------------------------


def chat_ids(runner: ModelRunner, prompt: str | Sequence[dict[str, str]]) -> list[int]:
    """The prompt ids of a user message, or of a whole conversation, under the chat template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    ids = runner.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def greedy_generation(
    runner: ModelRunner, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False
) -> Generation:
    generation = Generation(
        rid="calibration",
        input_ids=list(prompt_ids),
        params=parse_sampling_params({"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}),
        return_hidden_states=True,
    )
    return run_to_completion(runner, generation)


def seeded_generation(
    runner: ModelRunner, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float, top_p: float, seed: int
) -> Generation:
    """A sampled request as our miner sends it: every knob explicit, a seed from the gateway."""
    generation = Generation(
        rid="calibration",
        input_ids=list(prompt_ids),
        return_hidden_states=True,
        params=parse_sampling_params(
            {
                "temperature": temperature,
                "top_p": top_p,
                "top_k": SEEDED_TOP_K,
                "min_p": 0.0,
                "sampling_seed": seed,
                "max_new_tokens": max_new_tokens,
            }
        ),
    )
    return run_to_completion(runner, generation)


def sampling_label(temperature: float, top_p: float) -> str:
    return f"T {temperature:g} top_p {top_p:g}"


class CachedPrefill:
    """A recompute that remembers its last answer: one request judged several ways (replay and
    statistical, by several checks) costs one prefill."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._last: tuple[tuple[tuple[int, ...], int], tuple] | None = None

    def __call__(self, token_ids: Sequence[int], *, start: int = 0):
        key = (tuple(token_ids), start)
        if self._last is None or self._last[0] != key:
            self._last = (key, self.runner.prefill(key[0], start=start))
        return self._last[1]


# ---- the calibration run -----------------------------------------------------------------------


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
    sampled_settings: Sequence[tuple[float, float]] = SAMPLED_SETTINGS,
    power_cases: Sequence[tuple[str, Callable[[ModelRunner], ModelRunner]]] = POWER_CASES,
    power_prompts: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[CaseResult]:
    """Serve on `device`, recompute on `recompute_device` (default: the same). Serving on CUDA and
    recomputing on CPU measures the honest margin across numeric paths, which is what a
    validator without the miner's GPU relies on. `power_prompts` limits the detection-power
    cases to the first few prompts (default: all)."""
    recompute_device = recompute_device or device
    root = model_root(checkpoint)

    def load() -> ModelRunner:
        return ModelRunner.load(checkpoint, device=device, dtype=serve_dtype)

    honest = load()
    quantised = quantise_linear_weights(load())
    truncated = truncate_layers(load())
    verifiers = {
        dtype: CachedPrefill(
            honest
            if dtype == serve_dtype and recompute_device == device
            else ModelRunner.load(checkpoint, device=recompute_device, dtype=dtype)
        )
        for dtype in recompute_dtypes
    }
    results: list[CaseResult] = []
    end_tokens = end_token_ids_of(checkpoint, honest.tokenizer)

    def commit(prompt_ids: Sequence[int], output_ids: Sequence[int], rows) -> proof.Commitment:
        return proof.build_commitment(
            model_root=root, prompt_ids=prompt_ids, output_ids=output_ids, rows=rows, params=model.proof
        )

    def judge(
        case: str,
        expected: proof.VerdictKind | None,
        index: int,
        commitment: proof.Commitment,
        prompt_ids: Sequence[int],
        *,
        relayed: Sequence[int] | None = None,
        sampling: logit_stats.SamplingTerms | None = None,
    ) -> None:
        delivery = proof.Delivery(
            relayed_output_ids=tuple(commitment.output_token_ids if relayed is None else relayed),
            ended_at_stop=False,
            max_tokens=max_new_tokens,
        )
        label = "greedy" if sampling is None else sampling_label(sampling.temperature, sampling.top_p)
        check = "greedy" if sampling is None else "replay" if sampling.seed is not None else "statistical"
        for dtype, verifier in verifiers.items():
            verdict = proof.verify_commitment(
                commitment,
                model=model,
                canonical_root=root,
                expected_prompt_ids=prompt_ids,
                recompute=verifier,
                greedy=sampling is None,
                delivery=delivery,
                end_token_ids=end_tokens,
                sampling=sampling,
            )
            where = dtype if recompute_device == device else f"{dtype} on {recompute_device}"
            results.append(CaseResult(case, expected, index, where, commitment.n_tokens, verdict, label, check))
            progress(
                f"prompt {index} {case:22} {label:18} {check:11} recompute {where:8} -> {verdict.kind} ({verdict.reason})"
            )

    prompt_ids_of = [chat_ids(honest, prompt) for prompt in prompts]
    for index, prompt_ids in enumerate(prompt_ids_of):
        served = greedy_generation(honest, prompt_ids, max_new_tokens)
        honest_commitment = commit(prompt_ids, served.output_ids, served.proof_rows())
        judge("honest", "pass", index, honest_commitment, prompt_ids)

        cheap = greedy_generation(quantised, prompt_ids, max_new_tokens)
        judge("quantised-4bit", "cheat", index, commit(prompt_ids, cheap.output_ids, cheap.proof_rows()), prompt_ids)

        short = greedy_generation(truncated, prompt_ids, max_new_tokens)
        judge("truncated", "cheat", index, commit(prompt_ids, short.output_ids, short.proof_rows()), prompt_ids)

        hidden, _ = honest.prefill(prompt_ids + cheap.output_ids[:-1], start=len(prompt_ids) - 1)
        judge("prefill-attack", "cheat", index, commit(prompt_ids, cheap.output_ids, hidden), prompt_ids)

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
                judge(
                    "past-eos",
                    "cheat",
                    index,
                    commit(short_prompt, padded.output_ids, padded.proof_rows()),
                    short_prompt,
                )
            else:
                progress(
                    f"past-eos skipped: the model did not end its answer to {SHORT_ANSWER_PROMPT!r} within {max_new_tokens} tokens"
                )

        for setting, (temperature, top_p) in enumerate(sampled_settings):
            seed = 1000 * index + setting
            seeded = logit_stats.SamplingTerms(temperature, top_p, seed=seed)
            unseeded = logit_stats.SamplingTerms(temperature, top_p)
            sampled = seeded_generation(
                honest, prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
            sampled_commitment = commit(prompt_ids, sampled.output_ids, sampled.proof_rows())
            cheap = seeded_generation(
                quantised, prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
            cheap_commitment = commit(prompt_ids, cheap.output_ids, cheap.proof_rows())
            hidden, _ = honest.prefill(prompt_ids + cheap.output_ids[:-1], start=len(prompt_ids) - 1)
            attack_commitment = commit(prompt_ids, cheap.output_ids, hidden)
            # In this order each answer's recompute is shared by both checks (`CachedPrefill`).
            for terms in (seeded, unseeded):
                judge("honest", "pass", index, sampled_commitment, prompt_ids, sampling=terms)
            for case, commitment in (("quantised-4bit", cheap_commitment), ("prefill-attack", attack_commitment)):
                for terms in (seeded, unseeded):
                    judge(
                        case,
                        _sampled_expectation(case, terms, len(cheap.output_ids), model),
                        index,
                        commitment,
                        prompt_ids,
                        sampling=terms,
                    )

    for case, alter in power_cases:
        altered = alter(load())
        for index, prompt_ids in enumerate(prompt_ids_of[:power_prompts]):
            served = greedy_generation(altered, prompt_ids, max_new_tokens)
            judge(case, None, index, commit(prompt_ids, served.output_ids, served.proof_rows()), prompt_ids)
        del altered
    return results


def _sampled_expectation(
    case: str, terms: logit_stats.SamplingTerms, n_tokens: int, model: ModelSpec
) -> proof.VerdictKind | None:
    """What is promised for a cheat's sampled answer. The 4-bit model's own proofs fail TOPLOC
    whatever the tokens. The prefill attack's proofs are genuine, so only its tokens can give it
    away: without a seed the statistical test's power on a 4-bit copy is measured, not promised;
    with one, replay is promised to catch it once the answer fills a proof chunk — a shorter one
    may differ from the canonical draw in a single token by less than the margin."""
    if case != "prefill-attack":
        return "cheat"
    if terms.seed is None or n_tokens < model.proof.decode_batching_size:
        return None
    return "cheat"


def _malformed_cases(commitment: proof.Commitment, prompt_ids: Sequence[int]):
    garbage = dataclasses.replace(commitment, proofs=("not base64!",) + commitment.proofs[1:])
    yield "malformed-proof", "unproven", garbage, prompt_ids
    yield "short-proof-list", "unproven", dataclasses.replace(commitment, proofs=commitment.proofs[:1]), prompt_ids
    yield "wrong-prompt", "cheat", commitment, list(prompt_ids[:-1]) + [(prompt_ids[-1] + 1) % 1000]


def unexpected(results: Iterable[CaseResult]) -> list[CaseResult]:
    """The results whose verdict is not the one expected (detection-power cases never are)."""
    return [r for r in results if r.expected is not None and r.verdict.kind != r.expected]


# ---- many honest sampled requests: the false-positive rate -------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SoundnessResult:
    request: int
    temperature: float
    top_p: float
    check: str
    """`replay` or `statistical`."""
    recompute_dtype: str
    n_tokens: int
    verdict: proof.Verdict


def run_sampled_soundness(
    checkpoint: Path,
    *,
    model: ModelSpec,
    requests: int,
    answer_tokens: int = 32,
    prompts: Sequence[str | Sequence[dict[str, str]]] = DEFAULT_PROMPTS,
    settings: Sequence[tuple[float, float]] = SAMPLED_SETTINGS,
    serve_dtype: str = "bfloat16",
    recompute_dtypes: Sequence[str] = ("bfloat16",),
    runner: ModelRunner | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[SoundnessResult]:
    """Serve `requests` honest sampled answers (cycling through prompts × settings, a fresh seed
    each) as our miner would, and judge each by replay and by the statistical test, once per
    recompute dtype. Every `cheat` among them is a false positive."""
    root = model_root(checkpoint)
    runner = runner or ModelRunner.load(checkpoint, device="cpu", dtype=serve_dtype)
    verifiers = {
        dtype: CachedPrefill(
            runner
            if dtype == serve_dtype and runner.dtype == serve_dtype
            else ModelRunner.load(checkpoint, device="cpu", dtype=dtype)
        )
        for dtype in recompute_dtypes
    }
    prompt_ids_of = [chat_ids(runner, prompt) for prompt in prompts]
    results: list[SoundnessResult] = []
    cases = itertools.islice(itertools.cycle(itertools.product(prompt_ids_of, settings)), requests)
    for request, (prompt_ids, (temperature, top_p)) in enumerate(cases):
        seed = NOISE_SEED + request
        served = seeded_generation(runner, prompt_ids, answer_tokens, temperature=temperature, top_p=top_p, seed=seed)
        commitment = proof.build_commitment(
            model_root=root,
            prompt_ids=prompt_ids,
            output_ids=served.output_ids,
            rows=served.proof_rows(),
            params=model.proof,
        )
        for dtype, verifier in verifiers.items():
            for check, terms in (
                ("replay", logit_stats.SamplingTerms(temperature, top_p, seed=seed)),
                ("statistical", logit_stats.SamplingTerms(temperature, top_p)),
            ):
                verdict = proof.verify_commitment(
                    commitment,
                    model=model,
                    canonical_root=root,
                    expected_prompt_ids=prompt_ids,
                    recompute=verifier,
                    greedy=False,
                    sampling=terms,
                )
                results.append(SoundnessResult(request, temperature, top_p, check, dtype, commitment.n_tokens, verdict))
                if verdict.kind != "pass":
                    progress(
                        f"request {request} ({sampling_label(temperature, top_p)}, {check}, {dtype}): "
                        f"{verdict.kind}/{verdict.reason}"
                    )
        if (request + 1) % 50 == 0:
            progress(f"{request + 1}/{requests} sampled requests judged")
    return results


def format_soundness(results: Sequence[SoundnessResult]) -> str:
    """A Markdown table: per (setting, check, recompute dtype), requests, how many were judged
    `cheat` with the 95 % interval of the rate, and the largest replay gap / e-value seen."""
    header = (
        "| sampling | check | recompute | requests | judged cheat | 95 % interval | largest replay gap (logits) | "
        "largest log e-value |\n|---|---|---|---|---|---|---|---|"
    )
    groups: dict[tuple[str, str, str], list[SoundnessResult]] = {}
    for result in results:
        groups.setdefault(
            (sampling_label(result.temperature, result.top_p), result.check, result.recompute_dtype), []
        ).append(result)
    by_check: dict[tuple[str, str, str], list[SoundnessResult]] = {}
    for result in results:
        by_check.setdefault(("all", result.check, result.recompute_dtype), []).append(result)
    rows = []
    for (label, check, dtype), members in [*sorted(groups.items()), *sorted(by_check.items())]:
        cheats = sum(1 for m in members if m.verdict.kind == "cheat")
        low, high = proportion_interval(cheats, len(members))
        gap = max(m.verdict.max_logit_gap for m in members) if check == "replay" else None
        evidence = max(m.verdict.token_evidence for m in members) if check == "statistical" else None
        rows.append(
            f"| {label} | {check} | {dtype} | {len(members)} | {cheats} | {100 * low:.2f}–{100 * high:.2f} % | "
            f"{'–' if gap is None else f'{gap:.2f}'} | {'–' if evidence is None else f'{evidence:.1f}'} |"
        )
    return "\n".join([header, *rows])


def proportion_interval(successes: int, trials: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval for a binomial proportion: conservative, and right at
    0 of n, where the normal approximation collapses to a point."""
    if not 0 <= successes <= trials or trials == 0:
        raise ValueError(f"need 0 <= successes <= trials and trials > 0, got {successes} of {trials}")
    tail = (1 - confidence) / 2

    def at_most(p: float) -> float:
        return _binomial_cdf(successes, trials, p)

    def at_least(p: float) -> float:
        return 1.0 - _binomial_cdf(successes - 1, trials, p) if successes else 1.0

    low = 0.0 if successes == 0 else _bisect(lambda p: at_least(p) >= tail)
    high = 1.0 if successes == trials else _bisect(lambda p: at_most(p) < tail)
    return low, high


def _binomial_cdf(k: int, n: int, p: float) -> float:
    if k < 0:
        return 0.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _bisect(reached: Callable[[float], bool]) -> float:
    """The smallest p in [0, 1] where the monotone predicate `reached` turns true."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if reached(middle):
            high = middle
        else:
            low = middle
    return high


# ---- tables ------------------------------------------------------------------------------------


def format_table(results: Sequence[CaseResult]) -> str:
    """A Markdown table: one row per (case, sampling, check, recompute dtype). Statistics are per
    request (its worst chunk, its largest token gap), shown as the range over requests: for
    honest serving the top of the range is the margin that matters, for a cheat the bottom.
    The token gap is from the argmax for greedy checks, from the replayed draw's winner for
    replay; the statistical test shows its log e-value instead."""
    header = (
        "| case | sampling | check | recompute | requests | verdicts | worst-chunk exp mismatches /128 | "
        "worst-chunk mant err mean | worst-chunk mant err median | max token gap (logits) or log e-value | "
        "missed tokens |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    groups: dict[tuple[str, str, str, str], list[CaseResult]] = {}
    for result in results:
        groups.setdefault((result.case, result.sampling, result.check, result.recompute_dtype), []).append(result)
    rows = []
    for (case, sampling, check, dtype), members in groups.items():
        judged = [m.verdict for m in members if m.verdict.chunks_total]
        verdicts = ", ".join(
            f"{kind} {count}" for kind, count in _counts(f"{m.verdict.kind}/{m.verdict.reason}" for m in members)
        )
        prefix = f"| {case} | {sampling} | {check} | {dtype} | {len(members)} | {verdicts} |"
        if not judged:
            rows.append(f"{prefix} – | – | – | – | – |")
            continue
        exp = _span([v.max_exp_mismatches for v in judged], "{:d}")
        mant = _span([v.max_mant_err_mean for v in judged], "{:.1f}")
        median = _span([v.max_mant_err_median for v in judged], "{:.1f}")
        if check == "statistical":
            token = "e " + _span([v.token_evidence for v in judged], "{:.1f}")
        else:
            token = _span([v.max_logit_gap for v in judged], "{:.2f}")
        misses = sum(v.token_misses for v in judged)
        tokens = sum(m.n_tokens for m in members if m.verdict.chunks_total)
        rows.append(f"{prefix} {exp} | {mant} | {median} | {token} | {misses}/{tokens} |")
    return "\n".join([header, *rows])


def _counts(labels: Iterable[str]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return sorted(counts.items())


def _span(values: Sequence[float], fmt: str) -> str:
    def show(value: float) -> str:
        return "∞" if value > 1e18 or not math.isfinite(value) else fmt.format(value)

    low, high = min(values), max(values)
    return show(low) if low == high else f"{show(low)}–{show(high)}"
