"""How many rows the GEMM audit's row check must recompute (`gemm_audit.ROWS_CHECKED`): for each
cheat that alters every layer, the fraction of a projection's rows that fail their own bound.

    OMP_NUM_THREADS=1 .venv/bin/python bench/gemm_rows.py [--answers 2] [--tokens 16]
        [--positions 4] [--cases 8-bit,4-bit,noise-1e-2,noise-1e-3] [--rows 4,8,16,32]

Answers are served as `bench/gemm_audit.py` serves them (the reference server's engine, bf16 on
the CPU, the activation capture on, each case's weights altered the same way), on the same
conversations. For `--positions` positions of each answer and every layer, the opened ``gemms``
leaf gives each projection's committed x and y; every row of the verifier's float32 weights is
recomputed in float64 and held to its own bound δ_i (`gemm_check.row_ratios`' rule), and the
fraction g of rows beyond it is recorded per (position, layer, projection).

An audit recomputes R rows, drawn after the commitment from the verifier's secret, of each of the
7 projections of each of its 8 (position, layer) pairs, so it misses a cheat with probability
Π (1 − g)^R over those 56 projections. The table gives, per case and R, that product for the 8
pairs whose projections moved fewest rows (the worst any draw could meet among those measured)
and its mean over 2,000 draws of 8 measured pairs (what an audit meets). Honest answers are a
case too: any failing row there would be a false accusation (none is expected: the bound is never
exceeded honestly). No thresholds; the figures go to docs/verification.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PAIRS_PER_AUDIT = 8
"""The default `AuditPlan`: 4 positions × 2 layers."""


def failing_fractions(args: argparse.Namespace, case: str, say) -> list[list[float]]:
    """Per measured (position, layer): the fraction of each projection's rows beyond their bound."""
    import gemm_audit as audit_bench
    import numpy as np
    import torch

    from engy_node.calibration import chat_ids
    from engy_node.config import load_config
    from engy_node.drift import drift_conversations
    from engy_node.gemm.activations import GEMM_ROWS, GEMMS, group_values, llama_layout
    from engy_node.serve.capture import SharedOpenings
    from engy_node.serve.checkpoint import embedded_checkpoint
    from engy_node.serve.engine import ModelRunner
    from engy_node.verifier import gemm_audit, gemm_check
    from engy_node.verifier.gemm_calibration import Serving

    torch.set_num_threads(1)
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(home=Path(tempfile.mkdtemp(prefix="gemm-rows-bench-")), env=env)
    checkpoint = embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
    runner = ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")
    alter = audit_bench._cases()[case][1]
    if alter is not None:
        runner = alter(runner)
    layout = llama_layout(runner.model.config.to_dict(), "bfloat16")
    model = gemm_audit.gemm_model_of(ModelRunner.load(checkpoint, device="cpu", dtype="float32"))
    weights = {key: np.asarray(value, np.float64) for key, value in model.weights.items()}
    store = SharedOpenings(max_bytes=1024**3)
    serving = Serving(runner, layout, store, "", args.tokens)
    arithmetic = gemm_check.BF16_SERVE
    draw = np.random.default_rng(args.seed)
    pairs = []
    for answer, conversation in enumerate(drift_conversations(args.answers)):
        served = serving.serve(answer, chat_ids(runner, conversation), None)
        committed = len(served.prompt_ids) + len(served.output_ids) - 1
        rid = served.gemm_commitment["rid"]
        for position in sorted(draw.choice(committed, min(args.positions, committed), replace=False).tolist()):
            opened = store.open(rid, [(position, layer, GEMM_ROWS) for layer in range(layout.layers)])
            assert opened is not None
            for layer, opening in enumerate(opened[1]):
                fractions = []
                for name, (x_group, y_group) in GEMMS.items():
                    x = group_values(layout, opening, layer, x_group)
                    y = group_values(layout, opening, layer, y_group)
                    matrix = weights[layer, name]
                    slack = arithmetic.growth(x.size) + gemm_check._gamma(x.size + 1, gemm_check.FLOAT64_UNIT_ROUNDOFF)
                    bound = arithmetic.activations.half_ulp(y) + slack * (np.abs(matrix) @ np.abs(x))
                    fractions.append(float(np.mean(np.abs(y - matrix @ x) > bound)))
                pairs.append(fractions)
        say(f"{case}: answer {answer + 1} of {args.answers}")
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--positions", type=int, default=4, help="positions measured per answer, every layer each")
    parser.add_argument("--cases", default="honest,8-bit,4-bit,noise-1e-2,noise-1e-3")
    parser.add_argument("--rows", default="4,8,16,32", help="rows recomputed per projection, to compare")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import numpy as np

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"`bench/gemm_rows.py {' '.join(sys.argv[1:])}`: fraction of a projection's rows beyond their own bound "
        f"(SmolLM2-135M, bf16 serve); an audit's miss probability at R rows per projection, "
        f"{PAIRS_PER_AUDIT} (position, layer) pairs × 7 projections.\n"
    )
    header = "| case | projections | rows failing: min / 1st pct / median | " + " | ".join(
        f"miss at R = {r}: worst 8 pairs / mean draw" for r in rows
    )
    print(header + " |\n|" + "---|" * (3 + len(rows)))
    draws = np.random.default_rng(args.seed + 1)
    for case in args.cases.split(","):
        pairs = np.array(failing_fractions(args, case, say))
        flat = pairs.ravel()
        log_stay = np.log1p(-np.minimum(pairs, 1 - 1e-300)).sum(axis=1)
        worst = np.sort(log_stay)[-PAIRS_PER_AUDIT:].sum()
        sampled = log_stay[draws.integers(0, len(pairs), (2000, PAIRS_PER_AUDIT))].sum(axis=1)
        cells = []
        for r in rows:
            mean = np.exp(r * sampled).mean()
            cells.append(f"{np.exp(r * worst):.2g} / {mean:.2g}")
        print(
            f"| {case} | {flat.size} | {flat.min():.4f} / {np.percentile(flat, 1):.4f} / {np.median(flat):.4f} | "
            + " | ".join(cells)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
