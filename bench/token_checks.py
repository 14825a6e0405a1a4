"""What the token check costs per output token — greedy, the statistical test and seeded replay —
in this tree and in a baseline tree, side by side, and what a whole verification costs with it.

    .venv/bin/python bench/token_checks.py --baseline 4f36b23 [--rounds 7] [--output-tokens 128]

On the embedded SmolLM2-135M-Instruct, CPU: one typical request (a ~200-token chat prompt,
`--output-tokens` output tokens, `ignore_eos` so every answer is full length), answered greedily
and seeded-sampled at T 0.7 top_p 1 and T 1 top_p 0.9 by the reference server's own draw (sglang's
rank path, as our miner asks for it). This process serves the answers and recomputes their
logits once (float32 and bfloat16 recomputes, the verifier's two precisions) and times the
recompute; each tree then times `logit_stats.token_stats` + `token_evidence.token_check` (both in
`proof.py` in trees from before its split) on those same logits in a process of its own, the
trees alternating round by round so the machine's drift falls on both. Prints, per recompute
dtype and check, ms per output token (median, min–max over rounds) in each tree, the ratio, and
the whole verification (recompute + check) per token both ways.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_ENV = "ENGY_BENCH_TREE"
"""Set for a tree's own run: the code tree it must import engy_node from."""
sys.path.insert(0, os.environ.get(TREE_ENV, str(ROOT)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

SAMPLED = ((0.7, 1.0), (1.0, 0.9))
DTYPES = ("float32", "bfloat16")


def serve_and_recompute(workdir: Path, *, output_tokens: int, prompt_tokens: int, repeats: int) -> dict:
    """Serve the answers, recompute each in both dtypes, save the logits; returns the cases and
    the recompute's seconds per output token."""
    import torch

    from bench.verifier import SEED, checkpoint_path, prompt_of, seeded_answer
    from engy_node.calibration import greedy_generation
    from engy_node.serve.engine import ModelRunner

    checkpoint = checkpoint_path("")
    server = ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")
    prompt_ids = prompt_of(server, prompt_tokens)
    answers = {"greedy": (greedy_generation(server, prompt_ids, output_tokens, ignore_eos=True).output_ids, None)}
    for temperature, top_p in SAMPLED:
        output = seeded_answer(server, prompt_ids, output_tokens, temperature, top_p).output_ids
        answers[f"T {temperature:g} top_p {top_p:g}"] = (output, (temperature, top_p))
    cases, recompute_s = [], {}
    for dtype in DTYPES:
        verifier = ModelRunner.load(checkpoint, device="cpu", dtype=dtype)
        for label, (output, sampling) in answers.items():
            ids = prompt_ids + output[:-1]
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                _, logits = verifier.prefill(ids, start=len(prompt_ids) - 1)
                samples.append((time.perf_counter() - started) / len(output))
            recompute_s[f"{dtype} {label}"] = samples
            path = workdir / f"{dtype}-{len(cases)}.pt"
            torch.save(logits, path)
            checks = ["greedy"] if sampling is None else ["statistical", "replay"]
            for check in checks:
                # Replay is told the seed the answer was drawn with; an honest draw judged against
                # another seed is a cheat, and its cost is not the cost of passing.
                cases.append(
                    {
                        "dtype": dtype,
                        "answer": label,
                        "check": check,
                        "logits": str(path),
                        "tokens": output,
                        "first_position": len(prompt_ids) - 1,
                        "sampling": sampling,
                        "seed": SEED,
                    }
                )
    return {"cases": cases, "recompute_s": recompute_s}


def one_run(cases_file: str, repeats: int) -> None:
    """In the tree being measured: seconds per output token of each case's token check."""
    import torch

    from engy_node.models import get_model

    try:  # the token check's own modules, since proof.py was split
        from engy_node import logit_stats, token_evidence
    except ImportError:  # a baseline tree from before: all of it in proof.py
        from engy_node import proof as logit_stats
        from engy_node import proof as token_evidence

    check_params = get_model("smollm2-135m").token_check
    # The edge tolerance was `rank_tolerance` (the rank window) before the one-draw replay.
    edge = (
        {"edge_band": check_params.nucleus_edge_band}
        if "edge_band" in inspect.signature(logit_stats.token_stats).parameters
        else {"rank_tolerance": check_params.seeded_rank_tolerance}
    )
    timings = {}
    for case in json.loads(Path(cases_file).read_text()):
        logits = torch.load(case["logits"])
        sampling = case["sampling"]
        terms = (
            None
            if sampling is None
            else logit_stats.SamplingTerms(*sampling, seed=case["seed"] if case["check"] == "replay" else None)
        )
        samples = []
        for attempt in range(repeats + 1):
            started = time.perf_counter()
            stats = logit_stats.token_stats(
                logits,
                case["tokens"],
                sampling=terms,
                nucleus_margin=check_params.nucleus_margin,
                first_position=case["first_position"],
                **edge,
            )
            verdict = token_evidence.token_check(stats, greedy=terms is None, params=check_params)
            if attempt:  # the first is a warm-up
                samples.append((time.perf_counter() - started) / len(case["tokens"]))
        timings[f"{case['dtype']}|{case['answer']}|{case['check']}"] = {"s": samples, "ok": verdict.ok}
    print(json.dumps({"engy_node": logit_stats.__file__, "timings": timings}))


def run_in_tree(tree: Path, cases_file: Path, repeats: int) -> dict:
    env = {**os.environ, TREE_ENV: str(tree), "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one-run", str(cases_file), "--repeats", str(repeats)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(figures["engy_node"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the run in {tree} imported {figures['engy_node']}, not that tree's code")
    return figures["timings"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--baseline", required=False, help="a commit or a code tree to measure side by side with this one"
    )
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds, each tree once per round")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per case within a round")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--one-run", metavar="CASES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        one_run(args.one_run, args.repeats)
        return
    if not args.baseline:
        raise SystemExit("name a baseline: --baseline REV (a commit of this repository) or --baseline DIR")

    import torch

    from bench.gateway_overhead import baseline_tree, describe

    with tempfile.TemporaryDirectory(prefix="engy-token-checks-") as tmp:
        workdir = Path(tmp)
        served = serve_and_recompute(
            workdir, output_tokens=args.output_tokens, prompt_tokens=args.prompt_tokens, repeats=args.rounds
        )
        cases_file = workdir / "cases.json"
        cases_file.write_text(json.dumps(served["cases"]))
        trees = {"ours": ROOT, "baseline": baseline_tree(args.baseline, workdir)}
        runs: dict[str, list[dict]] = {"ours": [], "baseline": []}
        for round_index in range(args.rounds):
            for name in ("ours", "baseline") if round_index % 2 == 0 else ("baseline", "ours"):
                runs[name].append(run_in_tree(trees[name], cases_file, args.repeats))
    print(
        f"token check per output token: SmolLM2-135M, {args.output_tokens}-token answers after a ~{args.prompt_tokens}-token "
        f"prompt, served in bf16; {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; median (min–max) of "
        f"{args.rounds} alternating rounds; ours: {describe(ROOT)}, baseline: {args.baseline}\n"
    )
    print(
        "| recompute | answer | check | baseline ms/token | ours ms/token | ours ÷ baseline | verdicts (baseline, ours) | "
        "recompute ms/token | whole verification ms/token, baseline → ours | ratio |"
    )
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    for key in runs["ours"][0]:
        dtype, answer, check = key.split("|")
        per = {name: [s for run in runs[name] for s in run[key]["s"]] for name in runs}
        base, ours = statistics.median(per["baseline"]), statistics.median(per["ours"])
        recompute = statistics.median(served["recompute_s"][f"{dtype} {answer}"])
        verdicts = f"{'pass' if runs['baseline'][0][key]['ok'] else 'cheat'}, {'pass' if runs['ours'][0][key]['ok'] else 'cheat'}"

        def cell(values: list[float]) -> str:
            return f"{statistics.median(values) * 1e3:,.2f} ({min(values) * 1e3:,.2f}–{max(values) * 1e3:,.2f})"

        print(
            f"| {dtype} | {answer} | {check} | {cell(per['baseline'])} | {cell(per['ours'])} | {ours / base:.2f}× | {verdicts} | "
            f"{recompute * 1e3:.2f} | {(recompute + base) * 1e3:.2f} → {(recompute + ours) * 1e3:.2f} | "
            f"{(recompute + ours) / (recompute + base):.2f}× |"
        )


if __name__ == "__main__":
    main()
