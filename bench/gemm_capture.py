"""What committing an answer's activations costs the reference server on SmolLM2 (issue 32 part 2).

    OMP_NUM_THREADS=1 .venv/bin/python bench/gemm_capture.py [--tokens 64] [--prompt-repeats 4]
        [--repeats 5] [--baseline REV] [--store-mb MB]

Greedy generations of `--tokens` tokens after a prompt, run in turn without and with the capture
(`engy_node.serve.capture`: the wrappers, the copy, the leaf hashing on the capture's thread and
the tree), on the calling thread as the engine runs them; with `--baseline REV`, also with the
capture as git revision REV wrote it (its `engy_node/gemm/merkle.py`, `activations.py` and
`serve/capture.py`, loaded beside this tree's), in the same rounds, and both must commit the same
root. Reports per variant the process's CPU seconds per generation (all threads: what the capture
adds in work, steadier than wall time on a shared machine) and wall seconds (what a buyer waits:
the hashing thread overlaps the engine's next forward call when a core is free), each the median
of `--repeats` with min–max, the overhead over plain in % and ms per generated token (and in %
between the minima, the runs least disturbed by other work on a shared machine), the
record's bytes per answer, and the JSON bytes of one opening of each group width with its Merkle
path. No thresholds: the figures go to docs/verification.md and docs/performance.md.

The records go to one opening store, as the server's do. With its default cap (2 GiB) a run's
records all stay, so every table is written into memory new to the process; a busy server's
store is full and evicts a record for each one it files, which frees memory the next records can
reuse. `--store-mb` caps the store lower to measure that steady state within a few generations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASELINE_MODULES = ("engy_node.gemm.merkle", "engy_node.gemm.activations", "engy_node.serve.capture")


def baseline_capture(rev: str) -> tuple[Any, Any]:
    """`ActivationCapture` and `llama_layout` as revision `rev` wrote them: its three modules
    executed from git under their own names, each seeing the previous ones as its imports, then
    this tree's put back."""
    saved = {name: sys.modules.get(name) for name in BASELINE_MODULES}
    try:
        for name in BASELINE_MODULES:
            path = name.replace(".", "/") + ".py"
            source = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
            ).stdout
            module = types.ModuleType(name)
            module.__file__ = f"{rev}:{path}"
            sys.modules[name] = module
            exec(compile(source, module.__file__, "exec"), module.__dict__)
        return module.ActivationCapture, sys.modules["engy_node.gemm.activations"].llama_layout
    finally:
        for name, kept in saved.items():
            if kept is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = kept


def identity(x: Any) -> Any:
    return x


def own_cost(layout: Any, runner: Any, run: Callable[[Any], object]) -> tuple[float, float, float, int]:
    """The capture's own CPU seconds in one generation `run` serves with the capture class it is
    given, by thread: the engine thread's (setting the wrappers, the handoff, the commit, plus
    the wrappers' calls: their count times the cost of one, timed around a forward that returns
    its argument, so the wrapper's Python alone), the hashing thread's (`_hash_call`: the copy,
    the leaves, the tree pairs); then a wrapper call's cost and the forward calls' count.
    Indirect costs (caches, the threads' turns at the GIL) are not in it."""
    totals = {"engine": 0.0, "hashing": 0.0, "calls": 0}

    from engy_node.serve.capture import ActivationCapture

    class Timed(ActivationCapture):
        @contextlib.contextmanager
        def recording(self, model: Any) -> Any:
            inner = super().recording(model)
            start = time.thread_time()
            inner.__enter__()
            totals["engine"] += time.thread_time() - start
            yield
            start = time.thread_time()
            inner.__exit__(None, None, None)
            totals["engine"] += time.thread_time() - start
            totals["calls"] += 1

        def commit(self, rid: str) -> Any:
            start = time.thread_time()
            wire = super().commit(rid)
            totals["engine"] += time.thread_time() - start
            return wire

        def _hash_call(self, parts: list[Any]) -> None:
            start = time.thread_time()
            super()._hash_call(parts)
            totals["hashing"] += time.thread_time() - start

    run(Timed)
    probe = ActivationCapture(layout, None, weights_root="", arithmetic="bfloat16")  # type: ignore[arg-type]
    probe._seen = [None] * len(layout.columns())  # as inside a recorded call
    wrapped = probe._projection_forward(0, "q_proj", identity)

    def per_call(forward: Callable[[Any], Any]) -> float:
        best = float("inf")
        for _ in range(20):
            start = time.thread_time()
            for _ in range(20000):
                forward(probe)
            best = min(best, (time.thread_time() - start) / 20000)
        return best

    wrapper = max(0.0, per_call(wrapped) - per_call(identity))
    modules_per_call = len(probe._wrappers(runner.model))
    engine = totals["engine"] + wrapper * modules_per_call * totals["calls"]
    return engine, totals["hashing"], wrapper, int(totals["calls"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-repeats", type=int, default=4, help="copies of a 10-token sentence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", metavar="REV", help="also time the capture as this git revision wrote it")
    parser.add_argument("--store-mb", type=int, help="cap the opening store (default: the server's)")
    args = parser.parse_args()

    from engy_node.config import load_config
    from engy_node.gemm.activations import llama_layout
    from engy_node.serve.capture import ActivationCapture, SharedOpenings
    from engy_node.serve.checkpoint import embedded_checkpoint
    from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
    from engy_node.serve.sampling import parse_sampling_params

    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(home=Path(tempfile.mkdtemp()), env=env)
    checkpoint = embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
    runner = ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")
    layout = llama_layout(runner.model.config.to_dict(), "bfloat16")
    prompt = list(runner.tokenizer("The capital city of France is a place where " * args.prompt_repeats)["input_ids"])
    openings = SharedOpenings() if args.store_mb is None else SharedOpenings(max_bytes=args.store_mb * 1024**2)
    params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}
    captures = {"captured": (ActivationCapture, layout)}
    if args.baseline:
        capture_class, baseline_layout = baseline_capture(args.baseline)
        captures[args.baseline] = (capture_class, baseline_layout(runner.model.config.to_dict(), "bfloat16"))

    def generate(variant: str, capture_class: Any = None) -> tuple[float, float, Generation]:
        generation = Generation(rid=variant, input_ids=prompt, params=parse_sampling_params(params))
        capture_class, capture_layout = (
            (capture_class, layout) if capture_class else captures.get(variant, (None, None))
        )
        if capture_class is not None:
            generation.capture = capture_class(capture_layout, openings, weights_root="", arithmetic="bfloat16")
        cpu, wall = time.process_time(), time.perf_counter()
        run_to_completion(runner, generation)
        return time.process_time() - cpu, time.perf_counter() - wall, generation

    variants = ["plain", *captures]
    for variant in variants:
        generate(variant)
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    commitments: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for variant in variants:
            seconds, waited, generation = generate(variant)
            cpu[variant].append(seconds)
            wall[variant].append(waited)
            commitments[variant] = generation.gemm_commitment or {}
    print(
        f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, prompt {len(prompt)} + {args.tokens} tokens, "
        f"opening store {openings.max_bytes // 1024**2} MB"
    )
    for clock, times in (("CPU", cpu), ("wall", wall)):
        base = statistics.median(times["plain"])
        for variant in variants:
            median = statistics.median(times[variant])
            extra, least = median - base, min(times[variant]) - min(times["plain"])
            overhead = (
                f": overhead {100 * extra / base:.1f} %, {1000 * extra / args.tokens:.2f} ms/token"
                f" (of the minima {100 * least / min(times['plain']):.1f} %)"
            )
            print(
                f"{variant:10s} {clock:4s} {median:.3f} s (min {min(times[variant]):.3f}, "
                f"max {max(times[variant]):.3f}){overhead if variant != 'plain' else ''}"
            )
    engine, hashing, wrapper, calls = own_cost(layout, runner, lambda timed: generate("timed", timed))
    base = statistics.median(cpu["plain"])
    print(
        f"own CPU    engine thread {engine:.3f} s ({100 * engine / base:.1f} % of plain, "
        f"{1000 * engine / args.tokens:.2f} ms/token; {calls} forward calls, {1e6 * wrapper:.2f} µs a wrapper call), "
        f"hashing thread {hashing:.3f} s ({100 * hashing / base:.1f} %, {1000 * hashing / args.tokens:.2f} ms/token): "
        f"{100 * (engine + hashing) / base:.1f} % in all"
    )
    if args.baseline:
        ours, theirs = commitments["captured"], commitments[args.baseline]
        if ours["format"] != theirs["format"]:
            print(f"roots      not compared: {args.baseline} commits {theirs['format']}, this tree {ours['format']}")
        else:
            root, before = ours["activations_root"], theirs["activations_root"]
            print(f"roots      {'identical' if root == before else 'DIFFERENT'}: {root}")
    commitment = commitments["captured"]
    layer_leaves = list(dict.fromkeys(layout.canonical(0, group) for group, _ in layout.groups))
    opened = openings.open("captured", [(0, *leaf) for leaf in [*layer_leaves, layout.canonical(0, "residual_out")]])
    assert opened is not None
    record, picks = opened
    sizes = [len(json.dumps(o.to_wire(layout.dtype, layout.width(o.group)))) for o in picks]
    positions = commitment.get("positions", 0)
    print(
        f"record     {record.nbytes} bytes for {positions} positions ({record.nbytes // max(positions, 1)} per position)"
    )
    names = ", ".join(f"{o.group} {n}" for o, n in zip(picks, sizes, strict=True))
    print(f"opening    JSON bytes per leaf ({commitment.get('format')}): {names}; one audited layer {sum(sizes)}")


if __name__ == "__main__":
    main()
