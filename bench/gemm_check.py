"""What the GEMM audit's check costs per challenged token, against recomputing the GEMVs it checks.

    .venv/bin/python bench/gemm_check.py [--vectors 1,32] [--tokens 32] [--rows 16] [--repeats 5] [--skip-70b]

On the CPU, numpy with one BLAS thread (a verifier shares its machine; OpenBLAS's thread pool on
a busy machine makes these small products tens of times slower). Two models' shapes:

* SmolLM2-135M (hidden 576, 9 q / 3 kv heads of 64, intermediate 1536, 30 layers): all 210
  projections of one token — `gemm_check.freivalds` with each `--vectors` count of secret vectors
  (1: the default scheme; 32: bound (a) for adversarial outputs), and
  `gemm_check.row_check` of `--rows` opened rows per matrix — against recomputing each GEMV in
  fp32 (`W @ x`, the baseline: what a verifier without Freivalds does). Per token with one token
  per call, and per token with `--tokens` tokens batched in each call. Also the one-off key
  precompute (σᵀW for every matrix) and the keys' memory, per vector count.
* Llama-3-70B (hidden 8192, 64 q / 8 kv heads of 128, intermediate 28672): one layer's 7
  projections for one token, the same three ways (its keys are random arrays of the key's shape:
  the check's cost does not depend on their values, and making real ones takes 27 GFLOP).

Prints µs per token (median over `--repeats`, min–max) for ours and the baseline, and the ratio.
No thresholds: the figures go to docs/verification.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engy_node.verifier import gemm_check as gc  # noqa: E402


def llama_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, inner: int) -> list[tuple[int, int]]:
    """(out, in) of a Llama layer's q, k, v, o, gate, up, down projections."""
    kv = kv_heads * head_dim
    return [
        (heads * head_dim, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, heads * head_dim),
        (inner, hidden),
        (inner, hidden),
        (hidden, inner),
    ]


SMOLLM2 = llama_shapes(576, 9, 3, 64, 1536)
LLAMA_70B = llama_shapes(8192, 64, 8, 128, 28672)


def timed(run, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of `run()` over `repeats`, after one warm-up."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples), max(samples)


def line(label: str, seconds: tuple[float, float, float], per: int) -> str:
    median, low, high = (value / per * 1e6 for value in seconds)
    return f"  {label:<48} {median:10.1f} µs  ({low:.1f}–{high:.1f})"


def compare(title: str, matrices, keys_by_count, args, rng: np.random.Generator) -> None:
    print(title)
    for tokens in (1, args.tokens):
        xs = [rng.standard_normal((tokens, m.shape[1])).astype(np.float32) for m in matrices]
        ys = [(x @ m.T).astype(np.float32) for x, m in zip(xs, matrices)]
        xs64, ys64 = [x.astype(np.float64) for x in xs], [y.astype(np.float64) for y in ys]
        rows = [np.linspace(0, m.shape[0] - 1, args.rows).astype(int) for m in matrices]
        opened = [m[r].astype(np.float64) for m, r in zip(matrices, rows)]

        def recompute():
            for m, x in zip(matrices, xs):
                x @ m.T

        def row_checks():
            for w, r, x, y in zip(opened, rows, xs64, ys64):
                gc.row_check(w, x, y[:, r], gc.BF16_SERVE)

        baseline = timed(recompute, args.repeats)
        print(f" {tokens} token(s) per call, per token:")
        print(line("full recompute, fp32 (baseline)", baseline, tokens))
        for count, keys in keys_by_count.items():

            def freivalds(keys=keys):
                for key, x, y in zip(keys, xs64, ys64):
                    gc.freivalds(key, x, y, gc.BF16_SERVE)

            ours = timed(freivalds, args.repeats)
            print(
                line(f"freivalds, {count} vector(s)", ours, tokens) + f"   baseline ÷ this {baseline[0] / ours[0]:.1f}×"
            )
        print(line(f"row check, {args.rows} rows per matrix", timed(row_checks, args.repeats), tokens))


def key_memory(keys) -> float:
    return sum(k.signs.nbytes + k.projected.nbytes + k.column_abs.nbytes for k in keys) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", default="1,32", help="vector counts to time, comma-separated")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-70b", action="store_true")
    args = parser.parse_args()
    counts = [int(count) for count in args.vectors.split(",")]
    rng = np.random.default_rng(0)

    matrices = [(rng.standard_normal(shape) * 0.05).astype(np.float32) for _ in range(30) for shape in SMOLLM2]
    keys_by_count = {}
    for count in counts:
        start = time.perf_counter()
        keys_by_count[count] = [
            gc.verifier_key(m, gc.draw_signs(b"bench", str(i), count, m.shape[0])) for i, m in enumerate(matrices)
        ]
        made = time.perf_counter() - start
        print(
            f"SmolLM2-135M, {count} vector(s): keys for 210 matrices in {made:.2f} s, {key_memory(keys_by_count[count]):.1f} MiB"
        )
    compare("SmolLM2-135M, all 30 layers × 7 projections:", matrices, keys_by_count, args, rng)

    if args.skip_70b:
        return
    big = [rng.standard_normal(shape, dtype=np.float32) * 0.02 for shape in LLAMA_70B]
    big_keys = {
        count: [
            gc.VerifierKey(
                signs=gc.draw_signs(b"bench", f"70b {m}x{n}", count, m),
                projected=rng.standard_normal((count, n)),
                column_abs=np.abs(rng.standard_normal(n)),
                frobenius=1.0,
            )
            for m, n in LLAMA_70B
        ]
        for count in counts
    }
    for count, keys in big_keys.items():
        print(f"Llama-3-70B, {count} vector(s): one layer's keys {key_memory(keys):.1f} MiB, ×80 layers")
    compare("Llama-3-70B, one layer's 7 projections:", big, big_keys, args, rng)


if __name__ == "__main__":
    main()
