"""The GEMM audit against TOPLOC, side by side, on the embedded SmolLM2 (issue 32 item 6).

    .venv/bin/python bench/gemm_audit.py [--honest 1000] [--answers 50] [--tokens 32] [--cases ...]
    .venv/bin/python bench/gemm_audit.py --quick

For each case, answers are served in this process on the reference server's own engine
(`serve.engine`, bf16 on the CPU) with the activation capture on (`serve.capture`, what a
request with ``return_gemm_commitment`` gets), exactly as a miner would: the answer's TOPLOC
commitment (`proof.build_commitment`) and its ``gemm_commitment`` (with the rid its record is
filed under). Then, per answer, the verifier's side: a fresh 256-bit secret, `gemm_audit.draw_picks`
after the commitment, the openings as the server's ``POST /gemm/openings`` writes them (as the
miner would relay them in ``gemm_openings``), and `gemm_audit.judge_openings`; and the same
answer judged by TOPLOC as the verifier does (`proof.verify_commitment` on a float32 recompute,
greedy answers by the miss rule, sampled ones by seeded replay). Answer i of every case is the
same conversation (`drift.drift_conversations`, the probe corpus) at the same sampling setting
(cycling greedy, T 0.7, T 1, T 1 top_p 0.9; seed i), so the cases differ only in who served.

The cases (`CASES`; the weight changes are `engy_node.calibration`'s, as `engy-node calibrate`
measures them for TOPLOC):

* ``honest``: the canonical checkpoint, bf16 serve, judged on float32 (TOPLOC) and float64
  (GEMM, against the checkpoint's bf16 weights);
* ``8-bit``, ``4-bit``: every projection re-quantised to 8 / 4-bit symmetric groups of 32;
* ``noise-1e-2``, ``noise-1e-3``: Gaussian noise of that fraction of each matrix's own standard
  deviation added to every projection;
* ``neighbour-layer``: layer 15 of 30 runs with layer 16's weights;
* ``smaller-model``: the last 4 of 30 decoder layers dropped (calibration's ``truncated``; no
  other checkpoint exists here without a download), run as layers whose projections are zero —
  each adds nothing to the residual stream, exactly the 26-layer model — so the commitment still
  names 30 layers, their projections' outputs committed as the zeros the cheat computed;
* ``cheap-prompt``: the prefill attack on the GEMM audit — the prompt's positions run through the
  4-bit copy (a long prompt's prefill is most of the work), the answer decoded by the canonical
  model on that KV cache, every position committed as computed;
* ``prefill-attack``: calibration's prefill attack — tokens decoded by the 4-bit copy, then one
  canonical forward pass over prompt + output that builds both the TOPLOC proofs and the
  activation commitment. The GEMM audit cannot see it (every committed GEMM is the canonical
  model's, on these tokens); the token check is what catches it.

Costs, from the same run: the verifier's CPU per audited answer (`draw_picks` and
`judge_openings` over the decoded openings frame; key precompute and model load excluded)
against TOPLOC's (`verify_commitment`: the float32 prefill replay and the checks); the capture's
overhead on generation, on the first ``--overhead`` honest answers served both ways
(alternately, CPU seconds: the capture's hooks, copies and leaf hashing); and the bytes of the
``gemm_challenge`` and ``gemm_openings`` frames and of one opening. Everything runs on one
thread (torch and BLAS), CPU time per process, so other work on the machine moves the figures
little. Intervals are exact (Clopper-Pearson, `calibration.proportion_interval`). No thresholds:
the figures go to docs/verification.md.

The cases confined to some layers (``neighbour-layer``, ``smaller-model``: `ALTERED_LAYERS`) are
caught only by an audit whose draw opens one of those layers, so their catch rate is a sample of
the draw's reach, not the checks' power. The reach table sorts their audits by that: how many
reached an altered layer beside the plan's exact reach (`draw_reach`), and the catches among
those that did and those that did not, apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The serving and the audit are `engy-node calibrate --gemm-audits`' too: they live there once.
from engy_node.verifier.gemm_calibration import (  # noqa: E402
    DROPPED_LAYERS,
    PrefillAttack,
    Served,
    Serving,
    Toploc,
    caught,
    gemm_audit_of,
    rate,
    reasons,
    zero_last_layers,
)

MODEL_ID = "smollm2-135m"
SETTINGS: tuple[tuple[float, float] | None, ...] = (None, (0.7, 1.0), (1.0, 1.0), (1.0, 0.9))
"""Answer i is served at SETTINGS[i % 4]: greedy, or (temperature, top_p) with seed i."""
NEIGHBOUR_LAYER = 15
LAYERS = 30
ALTERED_LAYERS = {
    "neighbour-layer": frozenset({NEIGHBOUR_LAYER}),
    "smaller-model": frozenset(range(LAYERS - DROPPED_LAYERS, LAYERS)),
}
"""The cases confined to some layers: an audit can catch them only when its draw opens one of
these in full, so their catch rate is the draw's reach times the checks' catch rate, and the
reach table shows the two apart."""


def settings_label(setting: tuple[float, float] | None) -> str:
    return "greedy" if setting is None else f"T {setting[0]:g} top_p {setting[1]:g}"


# ---- the cases: how each serving side differs from the canonical model -------------------------


def _cases() -> dict[str, tuple[str, Callable[[Any], Any] | None]]:
    """name → (what serves it, how the serving weights are altered; None: canonical)."""
    from engy_node import calibration as cal

    four_bit = lambda runner: cal.quantise_linear_weights(runner, bits=4)  # noqa: E731
    return {
        "honest": ("canonical weights, bf16", None),
        "8-bit": ("projections re-quantised to 8-bit groups of 32", lambda r: cal.quantise_linear_weights(r, bits=8)),
        "4-bit": ("projections re-quantised to 4-bit groups of 32", four_bit),
        "noise-1e-2": ("Gaussian noise, 1e-2 of each matrix's std", lambda r: cal.add_weight_noise(r, 1e-2)),
        "noise-1e-3": ("Gaussian noise, 1e-3 of each matrix's std", lambda r: cal.add_weight_noise(r, 1e-3)),
        "neighbour-layer": (
            f"layer {NEIGHBOUR_LAYER} runs layer {NEIGHBOUR_LAYER + 1}'s weights",
            lambda r: cal.replace_layer_with_neighbour(r, NEIGHBOUR_LAYER),
        ),
        "smaller-model": (f"last {DROPPED_LAYERS} of 30 layers dropped (26-layer model)", zero_last_layers),
        "cheap-prompt": ("prompt through the 4-bit copy, decoded by the canonical model", four_bit),
        "prefill-attack": ("decoded by the 4-bit copy, proved and committed by a canonical prefill", four_bit),
    }


# ---- serving -----------------------------------------------------------------------------------


class CheapPrompt(Serving):
    """The prompt prefilled with the cheap weights, then decoding on the canonical ones: one
    runner whose projections are swapped in place between the two (the capture follows the
    same modules)."""

    def __init__(self, runner, cheap_state: dict[str, Any], honest_state: dict[str, Any], *args) -> None:
        super().__init__(runner, *args)
        self.cheap_state, self.honest_state = cheap_state, honest_state

    def _load(self, state: dict[str, Any]) -> None:
        import torch

        parameters = dict(self.runner.model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                parameters[name].copy_(value)

    def serve(self, answer: int, prompt_ids: list[int], setting) -> Served:
        from engy_node.serve.engine import run_to_completion

        generation = self.generation(prompt_ids, setting, answer)
        self._load(self.cheap_state)
        # The step that finishes the prompt's prefill also picks the first token.
        while not generation.output_ids and not generation.finished:
            generation.step(self.runner)
        self._load(self.honest_state)
        run_to_completion(self.runner, generation)
        return self.served_of(answer, prompt_ids, setting, generation)


def projection_state(runner) -> dict[str, Any]:
    """A copy of every projection's weight (what the cases alter), by parameter name."""
    import torch

    return {
        f"{name}.weight": module.weight.detach().clone()
        for name, module in runner.model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }


# ---- judging -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Judged:
    case: str
    answer: int
    setting: str
    positions: int
    tokens: int
    gemm: tuple[str, ...]
    """Each audit's verdict on the answer, as `kind` or `kind/code` (first: the one reported)."""
    reached: tuple[bool, ...]
    """Per audit: whether its draw opened one of the case's `ALTERED_LAYERS` in full (always
    true for a case that alters every layer)."""
    toploc: str
    audit_cpu: float
    """CPU seconds of the first audit: draw_picks + judge_openings."""
    toploc_cpu: float
    challenge_bytes: int
    openings_bytes: int
    openings: int


# ---- the run -----------------------------------------------------------------------------------


def capture_overhead(serving: Serving, conversations: list[list[int]], count: int) -> list[tuple[float, float]]:
    """(plain, captured) CPU seconds of the same answer served without and with the capture,
    alternating which goes first; greedy and seeded draws make the two the same tokens."""
    from engy_node.serve.engine import run_to_completion

    pairs = []
    for answer in range(count):
        prompt_ids, setting = conversations[answer % len(conversations)], SETTINGS[answer % len(SETTINGS)]
        seconds = {}
        for capture in (False, True) if answer % 2 == 0 else (True, False):
            generation = serving.generation(prompt_ids, setting, answer, capture=capture)
            started = time.process_time()
            run_to_completion(serving.runner, generation)
            seconds[capture] = time.process_time() - started
        pairs.append((seconds[False], seconds[True]))
    return pairs


def run(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[list[Judged], list[tuple[float, float]]]:
    import torch

    from engy_node.calibration import chat_ids
    from engy_node.config import load_config
    from engy_node.drift import drift_conversations
    from engy_node.gemm.activations import llama_layout
    from engy_node.models import get_model, model_root
    from engy_node.serve.capture import SharedOpenings
    from engy_node.serve.checkpoint import embedded_checkpoint
    from engy_node.serve.engine import ModelRunner
    from engy_node.served_model import end_token_ids_of
    from engy_node.verifier import gemm_audit

    torch.set_num_threads(1)
    begun = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(home=Path(tempfile.mkdtemp(prefix="gemm-audit-bench-")), env=env)
    checkpoint = embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
    spec = get_model(MODEL_ID)

    def load() -> Any:
        return ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")

    honest = load()
    layout = llama_layout(honest.model.config.to_dict(), "bfloat16")
    store = SharedOpenings(max_bytes=512 * 1024**2)
    toploc = Toploc(
        checkpoint, spec, model_root(checkpoint), end_token_ids_of(checkpoint, honest.tokenizer), args.tokens
    )
    started = time.process_time()
    model = gemm_audit.gemm_model_of(toploc.runner)
    say(f"GEMM model (weights and Freivalds keys): {time.process_time() - started:.2f} s CPU")
    conversations = [chat_ids(honest, c) for c in drift_conversations(args.offset + max(args.honest, args.answers))]
    say(
        f"{len(conversations)} conversations, prompts of {min(map(len, conversations))}–{max(map(len, conversations))} tokens"
    )
    cases = _cases()
    judged: list[Judged] = []
    overhead: list[tuple[float, float]] = []
    for case in args.cases:
        label, alter = cases[case]
        common = (layout, store, spec.weights_root, args.tokens)
        if case == "honest":
            serving = Serving(honest, *common)
            if args.overhead:
                say(f"capture overhead: {args.overhead} answers served both ways")
                overhead = capture_overhead(serving, conversations, args.overhead)
        elif case == "cheap-prompt":
            cheap = projection_state(alter(load()))  # type: ignore[misc]
            serving = CheapPrompt(load(), cheap, projection_state(honest), *common)
        elif case == "prefill-attack":
            serving = PrefillAttack(alter(load()), honest, *common)  # type: ignore[misc]
        else:
            serving = Serving(alter(load()), *common)  # type: ignore[misc]
        count = args.honest if case == "honest" else args.answers
        started = time.monotonic()
        for answer in range(args.offset, args.offset + count):
            if args.max_minutes and time.monotonic() - begun > 60 * args.max_minutes:
                say(f"{case}: --max-minutes {args.max_minutes:g} reached at answer {answer}")
                break
            prompt_ids = conversations[answer % len(conversations)]
            served = serving.serve(answer, prompt_ids, SETTINGS[answer % len(SETTINGS)])
            gemm, audit_cpu, challenge, frame, opened, layers = gemm_audit_of(served, store, model, audits=args.audits)
            altered = ALTERED_LAYERS.get(case)
            reached = tuple(altered is None or bool(audited & altered) for audited in layers)
            verdict, toploc_cpu = toploc.judge(served)
            judged.append(
                Judged(
                    case,
                    answer,
                    settings_label(served.setting),
                    served.gemm_commitment.get("positions", 0),
                    len(served.output_ids),
                    tuple(gemm),
                    reached,
                    verdict,
                    audit_cpu,
                    toploc_cpu,
                    challenge,
                    frame,
                    opened,
                )
            )
            if gemm[0] != "pass" or verdict != "pass" or (answer + 1) % 50 == 0:
                say(f"{case} answer {answer} ({settings_label(served.setting)}): GEMM {gemm[0]}, TOPLOC {verdict}")
        say(
            f"{case}: {sum(1 for j in judged if j.case == case)} answers in {time.monotonic() - started:.0f} s ({label})"
        )
    return judged, overhead


# ---- the tables --------------------------------------------------------------------------------


def to_reach_99(k: int, n: int) -> str:
    """Audited answers until a cheat is caught with probability ≥ 99 %, at the interval's lower
    bound of the per-answer rate (independent draws of picks)."""
    from engy_node.calibration import proportion_interval

    low, _ = proportion_interval(k, n)
    if low >= 0.99:
        return "1"
    if low <= 0:
        return "–"
    return str(math.ceil(math.log(0.01) / math.log1p(-low)))


def detection_table(judged: list[Judged], audits: int) -> str:
    cases = _cases()
    extra = f" | GEMM, all {audits} audits per answer" if audits > 1 else ""
    lines = [
        "| case | served | answers | GEMM audit: judged cheat (95 % interval) | GEMM reasons | audited answers to 99 % "
        f"| TOPLOC: judged cheat (95 % interval) | TOPLOC reasons{extra} |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if audits > 1 else ""),
    ]
    for case in dict.fromkeys(j.case for j in judged):
        rows = [j for j in judged if j.case == case]
        first = [j.gemm[0] for j in rows]
        every = [v for j in rows for v in j.gemm]
        toploc = [j.toploc for j in rows]
        line = (
            f"| {case} | {cases[case][0]} | {len(rows)} | {rate(caught(first), len(rows))} | {reasons(first)} | "
            f"{'–' if case == 'honest' else to_reach_99(caught(every), len(every))} | "
            f"{rate(caught(toploc), len(rows))} | {reasons(toploc)} |"
        )
        if audits > 1:
            line += f" {rate(caught(every), len(every))} |"
        lines.append(line)
    return "\n".join(lines)


def draw_reach(altered: int) -> float:
    """The probability that one audit's draw opens at least one of `altered` layers of
    `LAYERS`: each of the default plan's positions draws its layers without repeats,
    independently (`gemm_audit.draw_picks`; every answer here commits more positions than the
    plan draws)."""
    from engy_node.verifier.gemm_audit import DEFAULT_PLAN as plan

    missed = math.comb(LAYERS - altered, plan.layers) / math.comb(LAYERS, plan.layers)
    return 1 - missed**plan.positions


def reach_table(judged: list[Judged]) -> str:
    """For the cases confined to some layers: how often the draw reached them, against the
    plan's exact reach, and the verdicts of the audits that did and did not, apart: a sound audit
    catches every one that did and none that did not."""
    lines = [
        "| case | altered layers | audits | draw reached one (95 % interval) | the plan's reach "
        "| judged cheat, of those that reached | judged cheat, of those that did not |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(j.case for j in judged if j.case in ALTERED_LAYERS):
        altered = ALTERED_LAYERS[case]
        audits = [(verdict, reached) for j in judged if j.case == case for verdict, reached in zip(j.gemm, j.reached)]
        hit = [verdict for verdict, reached in audits if reached]
        missed = [verdict for verdict, reached in audits if not reached]
        lines.append(
            f"| {case} | {', '.join(map(str, sorted(altered)))} | {len(audits)} | {rate(len(hit), len(audits))} | "
            f"{100 * draw_reach(len(altered)):.1f} % | {rate_of(caught(hit), len(hit))} | "
            f"{rate_of(caught(missed), len(missed))} |"
        )
    return "\n".join(lines)


def rate_of(k: int, n: int) -> str:
    """`rate`, or "none" where there were none to count (a short run whose draws all missed)."""
    return rate(k, n) if n else "none"


def spread(values: list[float], scale: float, unit: str) -> str:
    values = sorted(v * scale for v in values)
    p95 = values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]
    return f"{statistics.median(values):.1f} {unit} (95th pct {p95:.1f}, max {values[-1]:.1f})"


def cost_table(judged: list[Judged], overhead: list[tuple[float, float]]) -> str:
    honest = [j for j in judged if j.case == "honest"]
    which = "honest answers" if honest else "answers"
    honest = honest or judged
    lines = ["| measure | value |", "|---|---|"]
    lines.append(
        f"| {which} | {len(honest)}: prompts {min(j.positions - j.tokens + 1 for j in honest)}–"
        f"{max(j.positions - j.tokens + 1 for j in honest)} tokens, outputs {min(j.tokens for j in honest)}–"
        f"{max(j.tokens for j in honest)} tokens, committed positions median {statistics.median(j.positions for j in honest):.0f} |"
    )
    lines.append(f"| GEMM audit CPU per audited answer | {spread([j.audit_cpu for j in judged], 1e3, 'ms')} |")
    lines.append(
        f"| TOPLOC CPU per answer (float32 prefill replay + checks) | {spread([j.toploc_cpu for j in judged], 1e3, 'ms')} |"
    )
    lines.append(
        "| TOPLOC ÷ GEMM audit, CPU (sums) | "
        f"{sum(j.toploc_cpu for j in judged) / max(sum(j.audit_cpu for j in judged), 1e-9):.0f}× |"
    )
    if overhead:
        ratios = [100 * (captured - plain) / plain for plain, captured in overhead]
        plain, captured = sum(p for p, _ in overhead), sum(c for _, c in overhead)
        lines.append(
            f"| capture + hashing overhead of generation ({len(overhead)} answers, CPU) | median "
            f"{statistics.median(ratios):.1f} %, total {100 * (captured - plain) / plain:.1f} % "
            f"({plain:.1f} s plain, {captured:.1f} s captured) |"
        )
    openings = sum(j.openings for j in judged)
    lines.append(f"| openings per audit | {statistics.median(j.openings for j in judged):.0f} (median) |")
    lines.append(
        f"| bytes per opening (gemm_openings JSON ÷ openings) | {sum(j.openings_bytes for j in judged) / openings:.0f} |"
    )
    lines.append(f"| gemm_openings frame per audit | {spread([j.openings_bytes for j in judged], 1e-3, 'kB')} |")
    lines.append(f"| gemm_challenge frame per audit | {spread([j.challenge_bytes for j in judged], 1e-3, 'kB')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = list(_cases())
    parser.add_argument("--honest", type=int, default=1000, help="honest answers (default 1000)")
    parser.add_argument("--answers", type=int, default=50, help="answers per cheating case (default 50)")
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens per answer (default 32)")
    parser.add_argument("--audits", type=int, default=1, help="audits per answer, each with a fresh secret")
    parser.add_argument("--overhead", type=int, default=20, help="honest answers served with and without capture")
    parser.add_argument(
        "--offset", type=int, default=0, help="number answers from here (a later run goes on where one stopped)"
    )
    parser.add_argument(
        "--max-minutes", type=float, default=0, help="stop serving new answers after this long (0: no limit)"
    )
    parser.add_argument("--cases", default=",".join(names), help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--quick", action="store_true", help="8 honest answers, 4 per cheat, 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.honest, args.answers, args.tokens, args.overhead = 8, 4, 16, 2
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(args.cases) - set(names)
    if unknown:
        parser.error(f"unknown cases {', '.join(sorted(unknown))}; the cases are {', '.join(names)}")
    if min(args.honest, args.answers, args.tokens, args.audits) < 1 or min(args.overhead, args.offset) < 0:
        parser.error("--honest, --answers, --tokens and --audits must be ≥ 1, --overhead and --offset ≥ 0")
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    started = time.monotonic()
    judged, overhead = run(args, say)
    print(f"`{' '.join(['bench/gemm_audit.py', *sys.argv[1:]])}`: embedded SmolLM2-135M, bf16 serve on the CPU,")
    print(
        f"one thread, {args.tokens} new tokens at most, {args.audits} audit(s) per answer; {time.monotonic() - started:.0f} s wall.\n"
    )
    print(detection_table(judged, args.audits))
    print()
    if any(j.case in ALTERED_LAYERS for j in judged):
        print(reach_table(judged))
        print()
    print(cost_table(judged, overhead))


if __name__ == "__main__":
    main()
