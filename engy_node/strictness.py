"""How strict the token checks are where TOPLOC cannot help: sampling cheats, and answers that
came with no commitment at all.

TOPLOC binds hidden states to tokens, not to how the tokens were chosen, so a miner that proves
with the canonical model can still choose its tokens more cheaply than the request asked: serve
a cached greedy answer for a sampled request, a narrower nucleus or a top-k, a lower
temperature, or tokens from a cheaper model proved by a canonical prefill. For seeded requests
only the replayed draw (`logit_stats._replay_gaps`) can tell; `run_sampling_cheats` measures how often
it does. Each answer is served with `ignore_eos`, so every one is exactly as long as asked, and
judged on the verifier's path (the float32 recompute by default against bf16 serving); the gaps
are kept per token, so the catch rate within the first n tokens of an answer is read from the
same run for every n (a check's verdict on a prefix is its verdict on that shorter answer: the
draw at a position depends on nothing after it).

A miner that sends no commitment (a TEE miner relying on attestation) is judged on its delivered
tokens alone (`proof.judge_delivered`): greedy by the argmax rule, sampled by the statistical
test, or by replay when it is seeded. `run_recompute_judged` measures that path against the
honest model and a 4-bit copy of it.

The cheats are served from the verifier's own model class on this machine, so each is the
strongest of its kind: the same seed as the request where the cheat could use it, canonical
weights everywhere but where the cheat is in the weights.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engy_node import logit_stats, proof, token_evidence
from engy_node.calibration import chat_ids, proportion_interval, quantise_linear_weights
from engy_node.models import ModelSpec, TokenCheckParams
from engy_node.protocol.miner import SEEDED_TOP_K
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
from engy_node.serve.sampling import parse_sampling_params

ASKED = {"temperature": 1.0, "top_p": 1.0}
"""What every request of the sampling-cheat run asked for, with its own seed: a buyer's default
sampling, the setting a cheaper draw departs from most profitably."""

SAMPLING_CHEATS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("honest", {}),
    ("greedy claimed as sampled", {"temperature": 0}),
    ("top_p 0.5 for 1", {"top_p": 0.5}),
    ("top_k 5 for none", {"top_k": 5}),
    ("T 0.3 for 1", {"temperature": 0.3}),
    ("T 0.5 for 1", {"temperature": 0.5}),
    ("T 0.8 for 1", {"temperature": 0.8}),
    ("prefill attack", {"model": "quantised", "seeded": False}),
    ("seeded prefill attack", {"model": "quantised"}),
)
"""(case, how it departs from `ASKED`): knobs the serving draw uses instead of the request's
(with the request's seed), `model: quantised` for tokens from the 4-bit copy (proved by a
canonical prefill: only the tokens can give it away), `seeded: False` for the miner's own
randomness instead of the seed."""

PREFIXES = (16, 32, 64, 128, 256, 512, 1024)
"""Answer lengths the catch rate is read at (those up to the run's answer length)."""


@dataclasses.dataclass(frozen=True, slots=True)
class JudgedAnswer:
    case: str
    answer: int
    stats: logit_stats.TokenStats

    @property
    def gaps(self) -> tuple[float, ...]:
        """Per token, the replayed draw's gap (logits)."""
        return self.stats.replay_gap

    def verdict_within(self, tokens: int, params: TokenCheckParams) -> token_evidence.TokenCheck:
        """The token check's verdict on the answer's first `tokens` tokens."""
        cut = {
            field.name: getattr(self.stats, field.name)[:tokens]
            for field in dataclasses.fields(logit_stats.TokenStats)
            if getattr(self.stats, field.name)
        }
        return token_evidence.token_check(dataclasses.replace(self.stats, **cut), greedy=False, params=params)


def _serve(runner: ModelRunner, prompt_ids: Sequence[int], tokens: int, knobs: dict[str, Any]) -> list[int]:
    params = parse_sampling_params({"max_new_tokens": tokens, "ignore_eos": True, **knobs})
    return run_to_completion(runner, Generation(rid="strictness", input_ids=list(prompt_ids), params=params)).output_ids


def run_sampling_cheats(
    checkpoint: Path,
    *,
    model: ModelSpec,
    conversations: Sequence[Sequence[dict[str, str]]],
    answer_tokens: int = 64,
    cases: Sequence[tuple[str, dict[str, Any]]] = SAMPLING_CHEATS,
    serve_dtype: str = "bfloat16",
    recompute_dtype: str = "float32",
    progress: Callable[[str], None] = lambda line: None,
) -> list[JudgedAnswer]:
    """One answer per conversation and case, `answer_tokens` long, each asked as `ASKED` with its
    own seed and judged by replaying that seed's draw."""
    honest = ModelRunner.load(checkpoint, device="cpu", dtype=serve_dtype)
    runners = {"honest": honest}
    if any(knobs.get("model") == "quantised" for _, knobs in cases):
        runners["quantised"] = quantise_linear_weights(ModelRunner.load(checkpoint, device="cpu", dtype=serve_dtype))
    verifier = (
        honest if recompute_dtype == serve_dtype else ModelRunner.load(checkpoint, device="cpu", dtype=recompute_dtype)
    )
    check = model.token_check
    judged: list[JudgedAnswer] = []
    for answer, messages in enumerate(conversations):
        prompt_ids = chat_ids(honest, messages)
        seed = 104_729 * (answer + 1)
        asked = logit_stats.SamplingTerms(ASKED["temperature"], ASKED["top_p"], seed=seed)
        for case, departure in cases:
            knobs = {key: value for key, value in departure.items() if key not in ("model", "seeded")}
            drawn = {**ASKED, "top_k": SEEDED_TOP_K, **knobs}
            if departure.get("seeded", True):
                drawn["sampling_seed"] = seed
            output = _serve(runners[departure.get("model", "honest")], prompt_ids, answer_tokens, drawn)
            _, logits = verifier.prefill(prompt_ids + output[:-1], start=len(prompt_ids) - 1)
            stats = logit_stats.token_stats(
                logits,
                output,
                sampling=asked,
                first_position=len(prompt_ids) - 1,
                nucleus_margin=check.nucleus_margin,
                edge_band=check.nucleus_edge_band,
            )
            judged.append(JudgedAnswer(case, answer, stats))
        if (answer + 1) % 10 == 0:
            progress(
                f"sampling cheats: {answer + 1}/{len(conversations)} conversations served in every case and replayed"
            )
    return judged


def catch_rates(judged: Sequence[JudgedAnswer], *, params: TokenCheckParams) -> list[tuple[str, int, int, int]]:
    """(case, tokens, answers, caught) for every case and every prefix length up to the answers'."""
    rows = []
    for case, grouped in itertools.groupby(sorted(judged, key=lambda j: j.case), key=lambda j: j.case):
        members = list(grouped)
        longest = min(len(m.gaps) for m in members)
        for tokens in [n for n in PREFIXES if n <= longest]:
            caught = sum(1 for m in members if not m.verdict_within(tokens, params).ok)
            rows.append((case, tokens, len(members), caught))
    return rows


def format_catch_rates(judged: Sequence[JudgedAnswer], *, params: TokenCheckParams) -> str:
    """A Markdown table: per case, the share of answers judged a cheat within their first n
    tokens (exact 95 % interval), for each n; and the largest gap of honest answers."""
    order = {case: index for index, (case, _) in enumerate(SAMPLING_CHEATS)}
    rates = sorted(catch_rates(judged, params=params), key=lambda row: (order.get(row[0], len(order)), row[0], row[1]))
    lengths = sorted({tokens for _, tokens, _, _ in rates})
    header = (
        "| case | answers | "
        + " | ".join(f"judged cheat within {n} tokens (95 % interval)" for n in lengths)
        + " |\n|---|---|"
        + "---|" * len(lengths)
    )
    lines = [header]
    for case, grouped_rows in itertools.groupby(rates, key=lambda row: row[0]):
        group = list(grouped_rows)
        cells = []
        for _, _, answers, caught in group:
            low, high = proportion_interval(caught, answers)
            cells.append(f"{caught}/{answers} ({100 * low:.1f}–{100 * high:.1f} %)")
        lines.append(f"| {case} | {group[0][2]} | " + " | ".join(cells) + " |")
    honest = [gap for j in judged if j.case == "honest" for gap in j.gaps]
    if honest:
        lines.append("")
        lines.append(
            f"Honest answers: {len(honest)} tokens, largest replay gap {max(honest):.3f} logits, "
            f"{sum(1 for gap in honest if gap > params.seeded_drift_band)} beyond the seeded band "
            f"({params.seeded_drift_band:g})."
        )
    return "\n".join(lines)


# ---- answers with no commitment ----------------------------------------------------------------

RECOMPUTE_SETTINGS: tuple[tuple[str, float, float], ...] = (
    ("greedy", 0.0, 1.0),
    ("T 0.7 top_p 1", 0.7, 1.0),
    ("T 1 top_p 1", 1.0, 1.0),
    ("T 1 top_p 0.9", 1.0, 0.9),
)


@dataclasses.dataclass(frozen=True, slots=True)
class RecomputeJudged:
    served_by: str
    """`honest` or `quantised-4bit`."""
    setting: str
    check: str
    """`greedy`, `statistical` (an unseeded miner) or `replay` (a seeded one)."""
    answer: int
    n_tokens: int
    verdict: proof.Verdict


def run_recompute_judged(
    checkpoint: Path,
    *,
    model: ModelSpec,
    conversations: Sequence[Sequence[dict[str, str]]],
    answer_tokens: int = 64,
    settings: Sequence[tuple[str, float, float]] = RECOMPUTE_SETTINGS,
    serve_dtype: str = "bfloat16",
    recompute_dtype: str = "float32",
    progress: Callable[[str], None] = lambda line: None,
) -> list[RecomputeJudged]:
    """Answers sent with no commitment, judged through `proof.judge_delivered` as the verifier
    does: served by the canonical model and by its 4-bit copy, greedy and sampled, sampled ones
    both unseeded (statistical test) and seeded (replay). Answers end where the model ends them."""
    runners = {
        "honest": ModelRunner.load(checkpoint, device="cpu", dtype=serve_dtype),
        "quantised-4bit": quantise_linear_weights(ModelRunner.load(checkpoint, device="cpu", dtype=serve_dtype)),
    }
    verifier = ModelRunner.load(checkpoint, device="cpu", dtype=recompute_dtype)
    results: list[RecomputeJudged] = []
    for answer, messages in enumerate(conversations):
        prompt_ids = chat_ids(runners["honest"], messages)
        for (label, temperature, top_p), (served_by, runner) in itertools.product(settings, runners.items()):
            seed = 7_919 * (answer + 1)
            greedy = temperature == 0
            checks = [("greedy", None)] if greedy else [("statistical", False), ("replay", True)]
            for check, seeded in checks:
                knobs: dict[str, Any] = {"temperature": temperature, "top_p": top_p}
                if seeded:
                    knobs.update(top_k=SEEDED_TOP_K, sampling_seed=seed)
                params = parse_sampling_params({"max_new_tokens": answer_tokens, **knobs})
                output = run_to_completion(
                    runner, Generation(rid="recompute", input_ids=list(prompt_ids), params=params)
                ).output_ids
                terms = None if greedy else logit_stats.SamplingTerms(temperature, top_p, seed=seed if seeded else None)
                verdict = proof.judge_delivered(
                    prompt_ids, output, model=model, recompute=verifier.prefill, greedy=greedy, sampling=terms
                )
                results.append(RecomputeJudged(served_by, label, check, answer, len(output), verdict))
        if (answer + 1) % 10 == 0:
            progress(f"no commitment: {answer + 1}/{len(conversations)} conversations served and judged")
    return results


def format_recompute_judged(results: Sequence[RecomputeJudged]) -> str:
    """A Markdown table: per (served by, setting, check), answers, judged cheat with its exact 95 %
    interval, and the answers' lengths."""
    header = (
        "| served by | sampling | check | answers | judged cheat (95 % interval) | tokens per answer |\n"
        "|---|---|---|---|---|---|"
    )
    groups: dict[tuple[str, str, str], list[RecomputeJudged]] = {}
    for result in results:
        groups.setdefault((result.served_by, result.setting, result.check), []).append(result)
    lines = [header]
    for (served_by, setting, check), members in groups.items():
        cheats = sum(1 for m in members if m.verdict.kind == "cheat")
        low, high = proportion_interval(cheats, len(members))
        lengths = sorted(m.n_tokens for m in members)
        lines.append(
            f"| {served_by} | {setting} | {check} | {len(members)} | {cheats} ({100 * low:.1f}–{100 * high:.1f} %) | "
            f"{lengths[0]}–{lengths[-1]} (median {lengths[len(lengths) // 2]}) |"
        )
    return "\n".join(lines)
