"""`engy-node weights commit`: a checkpoint's weight commitment, for the sampled GEMM audits.

Hashes every row of every tensor as stored into the Merkle roots of `engy_node.gemm` and prints
the top one (`weights_root`) and the lm root; `--out` writes the spec file a verifier opens rows
against (``.gz`` compresses it, as the public SN53 specs are). A root the catalog pins for a
model is named when it matches, so an operator can see the checkpoint is the one the network
expects. Apart from `cli.py`'s dispatch because `weights` is a group with a parser of its own.
"""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `weights` and its actions to the sub-command parsers."""
    weights = sub.add_parser("weights", help="weight commitments for the sampled GEMM audits")
    weights_sub = weights.add_subparsers(dest="weights_command", metavar="ACTION", required=True)
    commit = weights_sub.add_parser(
        "commit",
        help="print a checkpoint's weights_root and write its spec file",
        description="Merkle-commit every row of every tensor of a safetensors checkpoint as stored "
        "(docs/verification.md, 'GEMM audits: weight commitments').",
    )
    commit.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint directory (config.json, shards)")
    commit.add_argument("--out", metavar="SPEC", help="write the spec file here (.json, or .json.gz compressed)")


def run(args: argparse.Namespace) -> int:
    """Commit the checkpoint `args.checkpoint`, print its roots and write the spec if asked."""
    from engy_node.gemm.checkpoint import commit_checkpoint
    from engy_node.gemm.spec import write_spec
    from engy_node.models import CATALOG

    started = time.perf_counter()
    commitment = commit_checkpoint(args.checkpoint)
    elapsed = time.perf_counter() - started
    root = commitment.weights_root.hex()
    layers = commitment.layout.layers
    print(f"weights_root  {root}")
    print(f"lm_root       {commitment.lm_root.hex()}")
    print(f"layers        {len(layers)} ({sum(1 for layer in layers if layer.experts)} MoE)")
    print(f"matrices      {len(commitment.matrix_roots)}, committed in {elapsed:.1f} s")
    pinned = [spec.id for spec in CATALOG.values() if spec.weights_root == root]
    print(f"catalog       {'matches ' + ', '.join(pinned) if pinned else 'no catalog model pins this root'}")
    if args.out:
        write_spec(args.out, commitment)
        print(f"spec          {args.out}")
    return 0
