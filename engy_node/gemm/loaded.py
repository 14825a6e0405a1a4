"""The weights check a server runs on the checkpoint it loads: its `weights_root` against the catalog's pin.

The reference server (`engy_node.serve.server`) and the miner (`engy_node.miner.role`, for the
checkpoint it hands sglang) both run it at start and report the root in their states, so
`engy-node status` shows what each serves.

A root that differs from the pin refuses the start. The gateway already refuses a miner whose
wire `model_root` (config and shard sizes) differs; a checkpoint with the right layout but other
bytes — a bad conversion, a stale download, a quantized or fine-tuned copy — would pass that and
be pulled by the first GEMM audit instead, after the operator had paid for the GPUs. Refusing at
start, with the checkpoint's path, both roots and the fix, turns that into an error the operator
sees at once. A model the catalog pins no root for (`ModelSpec.weights_root` empty) is served
with its root reported and `pinned` False.

`judge` is the pure decision; `check_checkpoint` finds the root (through the cache,
`engy_node.gemm.root_cache`), judges it and logs the verdict (a mismatch as an error).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from engy_node.errors import ModelError
from engy_node.gemm.root_cache import weights_root
from engy_node.models import ModelSpec

log = logging.getLogger("engy.gemm")


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedWeights:
    root: str
    """The loaded checkpoint's `weights_root`, hex."""
    pinned: bool
    """True: the catalog pins this model's root and this is it. False: the catalog pins none."""


class WeightsMismatch(ModelError):
    """The checkpoint's weights are not the ones the catalog pins for the model."""


def judge(spec: ModelSpec, checkpoint: str | os.PathLike[str], root: str) -> LoadedWeights:
    """The checkpoint's root held against the catalog's pin for `spec`; a mismatch raises
    `WeightsMismatch` with what to do."""
    if not spec.weights_root:
        return LoadedWeights(root, pinned=False)
    if root == spec.weights_root:
        return LoadedWeights(root, pinned=True)
    fix = (
        f"delete {checkpoint} and the conversion it links to in the model cache (ENGY_MODEL_CACHE), "
        "then run `engy-node checkpoint` to convert the embedded model again"
        if spec.embedded
        else f"download {spec.hf_repo} again"
    )
    raise WeightsMismatch(
        f"the checkpoint at {checkpoint} is not {spec.id}'s: its weights_root is {root}, the catalog pins "
        f"{spec.weights_root}. GEMM audits would find every answer it serves wrong, so it is not served; "
        f"{fix}, then check it with `engy-node weights commit --checkpoint {checkpoint}`"
    )


def check_checkpoint(spec: ModelSpec, checkpoint: str | os.PathLike[str], cache_dir: Path) -> LoadedWeights:
    """Find the checkpoint's root (cached, or computed: blocking) and judge it against the pin."""
    found = weights_root(checkpoint, cache_dir)
    how = "cached" if found.cached else "computed"
    log.info("weights_root of %s: %s (%s in %.2f s)", checkpoint, found.root, how, found.seconds)
    try:
        loaded = judge(spec, checkpoint, found.root)
    except WeightsMismatch as mismatch:
        # Into the node's log and the TUI too, not only the one line the CLI prints on exit.
        log.error("%s", mismatch)
        raise
    if loaded.pinned:
        log.info("the checkpoint's weights are %s's as the catalog pins them", spec.id)
    else:
        log.info("the catalog pins no weights_root for %s; serving the checkpoint as it is", spec.id)
    return loaded
