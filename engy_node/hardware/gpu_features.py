"""GPUs as the planner sees them, and which sglang features they allow: an FP8 KV cache, the
custom all-reduce (which needs peer access between every pair of a tensor-parallel group) and
the attention backend on consumer Blackwell.

These choices depend only on what the cards are (compute capability, P2P), not on how much
memory the model leaves, so they stand apart from `plan.py`'s sizing. Like it, each is pure and
records its reason, one line per choice, in the plan's `reasons`. Ambiguity resolves to the
choice that runs: an unknown compute capability counts as too old for FP8 KV (a bf16 cache is
bigger but runs everywhere), unknown P2P as no P2P (sglang #4814: custom all-reduce without peer
access crashes the server at start).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from engy_node.hardware.model_shape import DTYPE_BYTES, ModelShape

__all__ = ["GpuLike", "GpuSpec", "extra_flags", "kv_cache_dtype"]

FP8_KV_MIN_COMPUTE_CAPABILITY = (8, 9)
"""FP8 (E4M3) arrives with Ada (cc 8.9, RTX 4090); the published config uses `fp8_e4m3` there."""

SM120_MAJOR = 12
"""Consumer Blackwell (RTX 50xx) is compute capability 12.x (sm_120)."""

KV_DTYPE_BYTES = {"fp8_e4m3": 1}


class GpuLike(Protocol):
    """What the planner reads of a GPU; `gpu.GpuInfo` and `GpuSpec` both qualify."""

    @property
    def name(self) -> str | None: ...
    @property
    def memory_total_bytes(self) -> int | None: ...
    @property
    def compute_capability(self) -> tuple[int, int] | None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU as plain data, for plans made without NVML."""

    name: str
    memory_total_bytes: int
    compute_capability: tuple[int, int] | None = None


def kv_cache_dtype(shape: ModelShape, gpus: Sequence[GpuLike], reasons: dict[str, str]) -> tuple[str, int]:
    """(sglang's --kv-cache-dtype, bytes per element): FP8 when every GPU has FP8 hardware."""
    capabilities = [gpu.compute_capability for gpu in gpus]
    if all(cc is not None and cc >= FP8_KV_MIN_COMPUTE_CAPABILITY for cc in capabilities):
        reasons["kv_cache_dtype"] = (
            "fp8_e4m3: half the bytes of a bf16 cache, so twice the tokens; every GPU has compute capability "
            "8.9 or newer (FP8 hardware) and the published config uses it"
        )
        return "fp8_e4m3", KV_DTYPE_BYTES["fp8_e4m3"]
    oldest = "unknown" if None in capabilities else ".".join(map(str, min(cc for cc in capabilities if cc)))
    reasons["kv_cache_dtype"] = (
        f"auto ({shape.dtype}): FP8 KV cache needs compute capability 8.9 or newer and the oldest GPU here is {oldest}"
    )
    return "auto", DTYPE_BYTES.get(shape.dtype, 2)


def extra_flags(
    *, gpus: Sequence[GpuLike], p2p: Sequence[Sequence[bool | None]] | None, tp: int, dp: int, reasons: dict[str, str]
) -> tuple[str, ...]:
    """sglang flags for the cards of a tp × dp plan: `--disable-custom-all-reduce` when a tp group
    lacks P2P, the triton attention backend on compute capability 12.x."""
    flags: list[str] = []
    if tp > 1:
        missing = [
            (a, b)
            for group in range(dp)
            for a in range(group * tp, (group + 1) * tp)
            for b in range(a + 1, (group + 1) * tp)
            if not _p2p_ok(p2p, a, b)
        ]
        if missing:
            a, b = missing[0]
            flags.append("--disable-custom-all-reduce")
            reasons["custom_all_reduce"] = (
                f"--disable-custom-all-reduce: GPU {a} and GPU {b} have no (or unknown) P2P access, as GeForce "
                "cards report; sglang's custom all-reduce needs peer access and fails without it (sglang #4814), "
                "so NCCL does the all-reduce"
            )
        else:
            reasons["custom_all_reduce"] = "kept: every pair of GPUs in each tp group has P2P access"
    capabilities = {gpus[i].compute_capability for i in range(tp * dp)}
    if any(cc is not None and cc[0] == SM120_MAJOR for cc in capabilities):
        flags += ["--attention-backend", "triton"]
        reasons["attention_backend"] = (
            "--attention-backend triton: compute capability 12.x (RTX 50xx, sm_120) lacks the FlashAttention-3 "
            "kernels (Hopper only), and on Blackwell sglang allows only trtllm_mha, triton or fa4 for hybrid "
            "linear-attention models (sglang #35080); triton compiles for the local GPU (needs CUDA 12.8+)"
        )
    return tuple(flags)


def _p2p_ok(p2p: Sequence[Sequence[bool | None]] | None, a: int, b: int) -> bool:
    if p2p is None or a >= len(p2p) or b >= len(p2p) or b >= len(p2p[a]) or a >= len(p2p[b]):
        return False
    return p2p[a][b] is True and p2p[b][a] is True
