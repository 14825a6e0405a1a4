"""Measure the honest numeric drift between serving and recompute paths, token by token.

The greedy and seeded token checks (`token_evidence.miss_evidence`) tell numeric noise from a cheaper
model by how far each served token trails the recompute's choice. That needs to know how far an
honest token can trail when the miner and the verifier compute on different numeric paths —
bf16 decode against an fp32 or bf16 cold prefill, different thread counts (a different reduction
order), a prompt continued from the prefix cache (its KV computed by an earlier request's
prefill and decode steps, as under load), later a GPU against a CPU — and how often. This
module measures it: it serves greedy answers on each serving path (token by token, with a KV
cache, as the reference server does), recomputes each answer on each verifier path as
`proof.verify_commitment` does, and records every token's gap (the recompute's largest logit
minus the served token's).

The prompts are buyer-like conversations: the probe corpus the gateway qualifies miners with,
each conversation as it stands and, for those with more, its first user turn alone and without
its system message, so the set is larger than the corpus and still what miners really meet.

`summarise` turns the gaps into what `docs/verification.md` publishes and `models.py` encodes:
per path pair, how many tokens were not the recompute's argmax (near-ties), the 99.9th
percentile and the largest gap, and how often a token trails by more than a band.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engy_node import logit_stats
from engy_node.calibration import (
    SAMPLED_SETTINGS,
    chat_ids,
    greedy_generation,
    proportion_interval,
    sampling_label,
    seeded_generation,
)
from engy_node.models import ModelSpec
from engy_node.serve.engine import Generation, ModelRunner, PrefixCache, run_to_completion
from engy_node.serve.sampling import parse_sampling_params


@dataclasses.dataclass(frozen=True, slots=True)
class NumericPath:
    dtype: str
    threads: int
    prefix_cache: bool = False
    """Serve the conversation's next turn from the prefix cache (`cached_follow_up`), as a
    loaded server answers it, instead of prefilling the prompt cold."""

    @property
    def label(self) -> str:
        return f"{self.dtype} ×{self.threads}" + (" prefix cache" if self.prefix_cache else "")


SERVE_PATHS = (NumericPath("bfloat16", 2), NumericPath("float32", 1), NumericPath("bfloat16", 2, prefix_cache=True))
"""Serving as `engy-node serve` does (bf16), in fp32 on another thread count, and in bf16 from
the prefix cache: which prompts a server finds cached depends on what finished before them, so
under load the same request is computed either way."""
RECOMPUTE_PATHS = {
    SERVE_PATHS[0]: (NumericPath("float32", 2), NumericPath("bfloat16", 2), NumericPath("bfloat16", 1)),
    SERVE_PATHS[1]: (NumericPath("float32", 2), NumericPath("bfloat16", 2)),
    SERVE_PATHS[2]: (NumericPath("float32", 2), NumericPath("bfloat16", 2)),
}
"""For each serving path, the verifier paths it is recomputed on: the verifier's default (fp32),
the serving precision, and another thread count. The verifier always prefills cold."""


@dataclasses.dataclass(frozen=True, slots=True)
class DriftSample:
    """One answer served on one path and recomputed on another."""

    prompt: int
    serve: str
    recompute: str
    budget: int
    """The answer's max_new_tokens: short (≤ 40) and long answers are reported apart."""
    n_tokens: int
    gaps: tuple[float, ...]
    """Every positive gap (logits), in answer order; the other tokens were the argmax."""


def drift_conversations(limit: int | None = None) -> list[list[dict[str, str]]]:
    """The probe corpus's conversations, then, for those longer than one user message, the
    first user turn alone (with any system message), then every conversation that opens with a
    system message without it: distinct prompts, as buyers send them."""
    from engy_node.probe_corpus import load_probe_corpus

    corpus = [[dict(m) for m in prompt.messages] for prompt in load_probe_corpus()]
    first_turns = []
    for messages in corpus:
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        if first_user + 1 < len(messages):
            first_turns.append(messages[: first_user + 1])
    without_system = [messages[1:] for messages in corpus if messages[0]["role"] == "system" and len(messages) > 1]
    conversations, seen = [], set()
    for messages in (*corpus, *first_turns, *without_system):
        key = json.dumps(messages, sort_keys=True)
        if key not in seen:
            seen.add(key)
            conversations.append(messages)
    return conversations[:limit]


FOLLOW_UP = "Go on."
"""The next user turn `cached_follow_up` asks."""


def cached_follow_up(
    runner: ModelRunner, conversation: Sequence[dict[str, str]], budget: int
) -> tuple[list[int], Generation]:
    """(prompt ids, greedy generation) of the conversation's next turn, served as a server with a
    prefix cache serves it: the conversation is answered first, and the next turn — the
    conversation, that answer and `FOLLOW_UP` — continues from the KV the first request left
    (its prompt prefilled, its answer decoded a token at a time) instead of a cold prefill."""
    cache = PrefixCache(runner, max_tokens=runner.context_length)

    def served(prompt_ids: list[int]) -> Generation:
        generation = Generation(
            rid="drift",
            input_ids=prompt_ids,
            params=parse_sampling_params({"temperature": 0, "max_new_tokens": budget}),
        )
        hit = cache.take(prompt_ids)
        if hit is not None:
            generation.resume_from(*hit)
        generation.on_finish = cache.keep
        return run_to_completion(runner, generation)

    first = served(chat_ids(runner, conversation))
    follow_up = [*conversation, {"role": "assistant", "content": first.text}, {"role": "user", "content": FOLLOW_UP}]
    prompt_ids = chat_ids(runner, follow_up)
    return prompt_ids, served(prompt_ids)


def gaps_of(logits, tokens: Sequence[int]) -> list[float]:
    """Per token, the recompute's largest logit minus the served token's (0 for the argmax)."""
    import torch

    target = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    logits = logits.float()
    return (logits.max(dim=1).values - logits.gather(1, target[:, None])[:, 0]).tolist()


def run_greedy_drift(
    checkpoint: Path,
    *,
    prompts: int = 500,
    short_tokens: int = 40,
    long_prompts: int = 60,
    long_tokens: int = 128,
    other_prompts: int = 100,
    other_long_prompts: int = 20,
    serve_paths: Sequence[NumericPath] = SERVE_PATHS,
    recompute_paths: Mapping[NumericPath, Sequence[NumericPath]] = RECOMPUTE_PATHS,
    progress: Callable[[str], None] = lambda line: None,
) -> list[DriftSample]:
    """Serve `prompts` conversations with `short_tokens` and the first `long_prompts` with
    `long_tokens` on the first serving path (production's), `other_prompts` and
    `other_long_prompts` on the others, greedily, and recompute each answer on that path's verifier paths."""
    import torch

    runners: dict[str, ModelRunner] = {}

    def runner_for(path: NumericPath) -> ModelRunner:
        if path.dtype not in runners:
            runners[path.dtype] = ModelRunner.load(checkpoint, device="cpu", dtype=path.dtype)
        torch.set_num_threads(path.threads)
        return runners[path.dtype]

    conversations = drift_conversations(prompts)
    if len(conversations) < prompts:
        progress(f"only {len(conversations)} distinct prompts; measuring those")
    samples: list[DriftSample] = []
    threads_before = torch.get_num_threads()
    try:
        for order, serve_path in enumerate(serve_paths):
            count, long_count = (prompts, long_prompts) if order == 0 else (other_prompts, other_long_prompts)
            budgets = [(index, short_tokens) for index in range(min(count, len(conversations)))]
            budgets += [(index, long_tokens) for index in range(min(long_count, len(conversations)))]
            for done, (index, budget) in enumerate(budgets, start=1):
                server = runner_for(serve_path)
                if serve_path.prefix_cache:
                    prompt_ids, follow_up = cached_follow_up(server, conversations[index], budget)
                    output = follow_up.output_ids
                else:
                    prompt_ids = chat_ids(server, conversations[index])
                    output = greedy_generation(server, prompt_ids, budget).output_ids
                for recompute_path in recompute_paths[serve_path]:
                    verifier = runner_for(recompute_path)
                    _, logits = verifier.prefill(prompt_ids + output[:-1], start=len(prompt_ids) - 1)
                    gaps = gaps_of(logits, output)
                    samples.append(
                        DriftSample(
                            index,
                            serve_path.label,
                            recompute_path.label,
                            budget,
                            len(output),
                            tuple(gap for gap in gaps if gap > 0),
                        )
                    )
                if done % 50 == 0:
                    progress(f"{serve_path.label}: {done}/{len(budgets)} answers served and recomputed")
    finally:
        torch.set_num_threads(threads_before)
    return samples


def run_seeded_drift(
    checkpoint: Path,
    *,
    model: ModelSpec,
    prompts: int = 200,
    answer_tokens: int = 40,
    long_prompts: int = 30,
    long_tokens: int = 128,
    settings: Sequence[tuple[float, float]] = SAMPLED_SETTINGS,
    serve_path: NumericPath = SERVE_PATHS[0],
    recompute_paths: Sequence[NumericPath] = RECOMPUTE_PATHS[SERVE_PATHS[0]][:2],
    progress: Callable[[str], None] = lambda line: None,
) -> list[DriftSample]:
    """Serve `prompts` conversations with `answer_tokens` and the first `long_prompts` with
    `long_tokens`, each at every sampling setting with its own seed, as our miner does (the
    reference server's seeded draw on sglang's rank path), and replay each draw on the verifier
    paths as `proof.verify_commitment` does: every positive replay gap, per token. A seeded draw
    reaches deep into the distribution's tail, whose logits drift further between numeric paths
    than the argmax's do, so its gaps are measured apart from the greedy ones."""
    import torch

    runners: dict[str, ModelRunner] = {}

    def runner_for(path: NumericPath) -> ModelRunner:
        if path.dtype not in runners:
            runners[path.dtype] = ModelRunner.load(checkpoint, device="cpu", dtype=path.dtype)
        torch.set_num_threads(path.threads)
        return runners[path.dtype]

    conversations = drift_conversations(prompts)
    if len(conversations) < prompts:
        progress(f"only {len(conversations)} distinct prompts; measuring those")
    budgets = [(index, answer_tokens) for index in range(len(conversations))]
    budgets += [(index, long_tokens) for index in range(min(long_prompts, len(conversations)))]
    samples: list[DriftSample] = []
    threads_before = torch.get_num_threads()
    check = model.token_check
    try:
        for done, (index, budget) in enumerate(budgets, start=1):
            for setting, (temperature, top_p) in enumerate(settings):
                seed = 7919 * index + 31 * budget + setting
                server = runner_for(serve_path)
                prompt_ids = chat_ids(server, conversations[index])
                output = seeded_generation(
                    server, prompt_ids, budget, temperature=temperature, top_p=top_p, seed=seed
                ).output_ids
                for recompute_path in recompute_paths:
                    verifier = runner_for(recompute_path)
                    _, logits = verifier.prefill(prompt_ids + output[:-1], start=len(prompt_ids) - 1)
                    stats = logit_stats.token_stats(
                        logits,
                        output,
                        sampling=logit_stats.SamplingTerms(temperature, top_p, seed=seed),
                        nucleus_margin=check.nucleus_margin,
                        first_position=len(prompt_ids) - 1,
                        edge_band=check.nucleus_edge_band,
                    )
                    samples.append(
                        DriftSample(
                            index,
                            f"{serve_path.label} {sampling_label(temperature, top_p)}",
                            recompute_path.label,
                            budget,
                            len(output),
                            tuple(gap for gap in stats.replay_gap if gap > 0),
                        )
                    )
            if done % 25 == 0:
                progress(f"seeded: {done}/{len(budgets)} answers served at every setting and replayed")
    finally:
        torch.set_num_threads(threads_before)
    return samples


@dataclasses.dataclass(frozen=True, slots=True)
class DriftRow:
    serve: str
    recompute: str
    answers: str
    """`short` (budget ≤ 40 tokens), `long`, or `all`."""
    count: int
    tokens: int
    misses: int
    p999: float
    """The 99.9th percentile of every token's gap (most are 0)."""
    largest: float
    beyond: dict[float, int]
    """For each band, how many tokens trail by more than it."""


BANDS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


def summarise(samples: Sequence[DriftSample], *, short_budget: int = 40) -> list[DriftRow]:
    groups: dict[tuple[str, str, str], list[DriftSample]] = {}
    for sample in samples:
        kind = "short" if sample.budget <= short_budget else "long"
        for answers in (kind, "all"):
            groups.setdefault((sample.serve, sample.recompute, answers), []).append(sample)
    rows = []
    for (serve, recompute, answers), members in groups.items():
        tokens = sum(m.n_tokens for m in members)
        gaps = [gap for m in members for gap in m.gaps]
        # The 99.9th percentile over all tokens: the zeros are the tokens not listed.
        rank = math.ceil(0.999 * tokens)
        p999 = sorted(gaps, reverse=True)[tokens - rank] if tokens - rank < len(gaps) else 0.0
        rows.append(
            DriftRow(
                serve,
                recompute,
                answers,
                len(members),
                tokens,
                len(gaps),
                p999,
                max(gaps, default=0.0),
                {band: sum(1 for gap in gaps if gap > band) for band in BANDS},
            )
        )
    order = {"short": 0, "long": 1, "all": 2}
    return sorted(rows, key=lambda row: (row.serve, row.recompute, order[row.answers]))


def format_drift(rows: Sequence[DriftRow]) -> str:
    """A Markdown table of `summarise`'s rows, with exact 95 % intervals on the per-token rates."""
    bands = " | ".join(f"> {band:g}" for band in BANDS)
    header = (
        f"| serve | recompute | answers | count | tokens | non-argmax tokens (95 % interval) | 99.9th pct gap | "
        f"largest gap | tokens trailing by {bands} |\n|" + "---|" * (8 + len(BANDS))
    )
    lines = [header]
    for row in rows:
        low, high = proportion_interval(row.misses, row.tokens)
        rate = f"{row.misses} ({100 * row.misses / max(1, row.tokens):.2f} %, {100 * low:.2f}–{100 * high:.2f} %)"
        counts = " | ".join(str(row.beyond[band]) for band in BANDS)
        lines.append(
            f"| {row.serve} | {row.recompute} | {row.answers} | {row.count} | {row.tokens} | {rate} | "
            f"{row.p999:.3f} | {row.largest:.3f} | {counts} |"
        )
    return "\n".join(lines)


def save_samples(samples: Sequence[DriftSample], path: Path) -> None:
    path.write_text(json.dumps([dataclasses.asdict(s) for s in samples]), encoding="utf-8")


def load_samples(path: Path) -> list[DriftSample]:
    raw: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return [DriftSample(**{**item, "gaps": tuple(item["gaps"])}) for item in raw]
