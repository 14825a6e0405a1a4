"""How to serve a model on this machine's GPUs: tensor/data parallel sizes, sglang's memory
fraction, concurrency, context, KV-cache dtype and extra flags, each with its reason.

`plan()` is pure: it takes the checkpoint's shape (parsed from config.json), its weight size, the
GPUs (NVML's `GpuInfo` or plain `GpuSpec`s) with their P2P matrix, and the target context and
concurrency; it reads no file and no clock. What the model is and costs per token lives in
`model_shape.py` (with `read_model_shape()`, the only IO in planning); what the cards allow
sglang to do (FP8 KV cache, custom all-reduce, attention backend) in `gpu_features.py`. This
module sizes memory and chooses tp, dp, concurrency and context with them.

What it trusts: the model's shape (`model_shape.py`) and each GPU's total VRAM. It decides with a memory model, not a measurement: per GPU, sglang's
static pool (`--mem-fraction-static` × VRAM) must hold the GPU's share of the weights, the KV
cache for `max_running_requests` requests of `context_length` tokens each, and the recurrent
state of linear-attention layers; the rest of the card is a fixed reserve for activations, CUDA
graphs and communication buffers (`ACTIVATION_RESERVE_BYTES`, derived from the published config).
Sizing the KV cache for every running request at full context is the worst case on purpose: a
plan that holds the worst case never retracts requests for lack of KV space.

Which way ambiguity resolves, and why:

* Unknown P2P counts as no P2P. Disabling sglang's custom all-reduce without need costs some
  all-reduce latency; leaving it on without peer access crashes the server at start (sglang
  #4814).
* An unknown compute capability counts as too old for FP8 KV: a bf16 cache is bigger but runs
  everywhere, while an unsupported FP8 cache fails.
* When the targets do not fit, concurrency goes down before context does. Fewer concurrent
  requests only lower the capacity the miner advertises (the gateway routes by it); a shorter
  context fails requests the gateway sends within the catalog's limits.
* Mixed GPUs are planned as if every card were the smallest one, and the plan says so: sglang
  sizes its pools by the smallest rank anyway.

A plan that does not fit says why in one plain sentence (`summary`), e.g. that the weights need
more GPUs than were found. CPU mode (no GPU) plans the reference server for the embedded model.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Literal

from engy_node.hardware.gpu_features import GpuLike, extra_flags, kv_cache_dtype
from engy_node.hardware.model_shape import (
    ModelShape,
    kv_bytes_per_token,
    legal_tp_sizes,
    linear_state_bytes_per_request,
    tp_problem,
)

__all__ = [
    "ACTIVATION_RESERVE_BYTES",
    "CHUNKED_PREFILL_SIZE",
    "CPU_MAX_RUNNING_REQUESTS",
    "DEFAULT_TARGET_CONCURRENCY",
    "MemoryEstimate",
    "Plan",
    "mem_fraction_static_for",
    "plan",
]

MIB = 1024 * 1024
GIB = 1024 * MIB

PUBLISHED_MEM_FRACTION_STATIC = 0.83
"""`--mem-fraction-static` of the published working launch: Qwen3.6-35B-A3B-FP8 on 4× RTX 4090
(docs/architecture.md, "The miner and its model server")."""
RTX_4090_MEMORY_MIB = 24564
"""Total VRAM NVML reports for an RTX 4090."""

ACTIVATION_RESERVE_BYTES = math.floor((1 - PUBLISHED_MEM_FRACTION_STATIC) * RTX_4090_MEMORY_MIB) * MIB
"""VRAM each GPU keeps outside sglang's static pool: 4175 MiB.

Everything that is not weights, KV cache or linear-attention state lives here: the CUDA
context, cuBLAS and NCCL workspaces, custom all-reduce buffers, CUDA graphs for decode batches up
to `max_running_requests`, and the activations of one `--chunked-prefill-size` chunk. The
published config runs 0.83 on a 24564 MiB card, which leaves (1 − 0.83) × 24564 = 4175.9 MiB,
taken in whole MiB rounded down so that the published 0.83 comes out exactly on a 4090. The reserve is
kept constant in bytes for other cards, because what fills it depends on the model, the batch
and the chunk size, not on the card: on an RTX 5090 (32607 MiB) it gives
⌊(32607 − 4175) / 32607⌋₀.₀₁ = 0.87. It is sized for `CHUNKED_PREFILL_SIZE`; a larger chunk needs
a larger reserve."""

MAX_MEM_FRACTION_STATIC = 0.90
"""Ceiling on large cards, sglang's documented default (`--mem-fraction-static` "default value
is 0.9"): a bigger static pool on an 80 GB card buys little and leaves less room for spikes."""

DEFAULT_TARGET_CONCURRENCY = 8
"""The published config's `--max-running-requests 8`, the concurrency it is known to serve at."""

CHUNKED_PREFILL_SIZE = 8192
"""The published config's `--chunked-prefill-size`; `ACTIVATION_RESERVE_BYTES` is sized for it."""

MIN_CONTEXT_LENGTH = 8192
"""The context is halved from the target while nothing fits, down to this floor: below 8192
tokens a prompt plus a useful answer no longer fits for the catalog's GPU models."""

CPU_MAX_RUNNING_REQUESTS = 4
"""The reference server on CPU decodes its running requests round-robin in one worker thread, so
each added request slows every other one's TPOT; a small batch keeps a laptop responsive."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-GPU bytes of a plan (on the smallest GPU when they differ)."""

    vram_bytes: int
    budget_bytes: int
    """sglang's static pool: `mem_fraction_static` × `vram_bytes`."""
    weights_bytes: int
    kv_cache_bytes: int
    linear_state_bytes: int
    reserve_bytes: int
    """Kept outside the static pool (`ACTIVATION_RESERVE_BYTES`)."""

    @property
    def static_bytes(self) -> int:
        """What must fit in `budget_bytes`."""
        return self.weights_bytes + self.kv_cache_bytes + self.linear_state_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer. When `fits` is False the numbers are zero and `summary` says why."""

    fits: bool
    summary: str
    """One plain line: the plan, or why nothing fits."""
    server: Literal["sglang", "reference"]
    """sglang on GPUs, or the reference server (transformers) on CPU."""
    device: Literal["cuda", "cpu"]
    tp: int
    dp: int
    mem_fraction_static: float | None
    """None for the reference server, which has no static pool."""
    max_running_requests: int
    """Per data-parallel replica."""
    context_length: int
    kv_cache_dtype: str
    """`fp8_e4m3`, or `auto` (the model's dtype)."""
    chunked_prefill_size: int | None
    """sglang's --chunked-prefill-size (None: the reference server, which chunks on its own)."""
    extra_flags: tuple[str, ...]
    """sglang flags beyond the fields above (which the command builder renders itself)."""
    reasons: Mapping[str, str]
    """One line per choice, keyed by what it explains (`tp`, `dp`, `mem_fraction_static`, ...)."""
    memory: MemoryEstimate | None = None
    gpu_indices: tuple[int, ...] = ()
    """Positions in the GPU list the plan uses: replica r runs on [r·tp, (r+1)·tp)."""

    @property
    def max_inflight(self) -> int:
        """The concurrency the miner advertises (docs/architecture.md): max_running_requests × dp."""
        return self.max_running_requests * self.dp


def mem_fraction_static_for(*, vram_bytes: int) -> float | None:
    """`--mem-fraction-static` that leaves `ACTIVATION_RESERVE_BYTES` free, floored to 0.01 (so
    the reserve is never smaller than derived) and capped at `MAX_MEM_FRACTION_STATIC`; None when
    the card is smaller than the reserve."""
    if vram_bytes <= ACTIVATION_RESERVE_BYTES:
        return None
    hundredths = (vram_bytes - ACTIVATION_RESERVE_BYTES) * 100 // vram_bytes
    return min(hundredths / 100, MAX_MEM_FRACTION_STATIC)


@dataclasses.dataclass(frozen=True, slots=True)
class _Option:
    """One legal tp at one context: what fits per GPU."""

    tp: int
    weights: int
    per_request: int
    """KV for one full-context request plus its linear-attention state."""
    free: int
    """Static budget left after the weights."""

    @property
    def requests(self) -> int:
        return self.free // self.per_request if self.free > 0 else 0


def plan(
    *,
    shape: ModelShape,
    weight_bytes: int,
    gpus: Sequence[GpuLike],
    p2p: Sequence[Sequence[bool | None]] | None = None,
    target_context: int | None = None,
    target_concurrency: int = DEFAULT_TARGET_CONCURRENCY,
    cpu_capable: bool = False,
) -> Plan:
    """Choose how to serve the model; see the module docstring for the rules.

    `p2p[a][b]` says whether GPU a reads GPU b's memory directly (None: unknown; no matrix: all
    unknown). `target_context` defaults to the model's maximum. `cpu_capable` marks the model
    the reference server can run on CPU (the catalog's embedded model); with no GPUs it gets a
    CPU plan, any other model a plan that does not fit.

    Errors: `ValueError` for a target below 1 or non-positive weights (caller bugs, not
    situations); every situation, fitting or not, is a `Plan`.
    """
    if target_concurrency < 1:
        raise ValueError(f"target_concurrency must be at least 1, got {target_concurrency}")
    if target_context is not None and target_context < 1:
        raise ValueError(f"target_context must be at least 1, got {target_context}")
    if weight_bytes < 1:
        raise ValueError(f"weight_bytes must be positive, got {weight_bytes}")
    reasons: dict[str, str] = {}
    context = _target_context(shape, target_context, reasons)
    if not gpus:
        if cpu_capable:
            return _cpu_plan(shape=shape, context=context, target_concurrency=target_concurrency, reasons=reasons)
        return _no_fit(
            f"no NVIDIA GPU found, and {_gib(weight_bytes)} of weights need GPUs "
            "(in CPU mode only the embedded model runs)",
            reasons,
        )
    return _gpu_plan(
        shape=shape,
        weight_bytes=weight_bytes,
        gpus=gpus,
        p2p=p2p,
        context=context,
        target_concurrency=target_concurrency,
        reasons=reasons,
    )


def _target_context(shape: ModelShape, target: int | None, reasons: dict[str, str]) -> int:
    limit = shape.max_position_embeddings
    if target is None:
        reasons["context_length"] = f"{limit}: the model's maximum (max_position_embeddings)"
        return limit
    if target > limit:
        reasons["context_length"] = (
            f"{limit}: the model's maximum; the target {target} is longer than the model supports"
        )
        return limit
    reasons["context_length"] = f"{target}: the target context"
    return target


def _cpu_plan(*, shape: ModelShape, context: int, target_concurrency: int, reasons: dict[str, str]) -> Plan:
    running = min(target_concurrency, CPU_MAX_RUNNING_REQUESTS)
    reasons.update(
        {
            "server": "no NVIDIA GPU: the reference server (transformers) runs the model on CPU; sglang needs a GPU",
            "tp": "1: one CPU process, no tensor parallelism",
            "dp": "1: one reference server",
            "mem_fraction_static": "not used: the reference server has no static GPU memory pool",
            "max_running_requests": (
                f"{running}: requests decode round-robin in one CPU worker thread, so each added one slows the others"
                + (
                    ""
                    if running == target_concurrency
                    else f" (target {target_concurrency} capped at {CPU_MAX_RUNNING_REQUESTS})"
                )
            ),
            "kv_cache_dtype": "auto: the model's own dtype; FP8 KV cache is a GPU feature",
        }
    )
    return Plan(
        fits=True,
        summary=f"CPU mode: the reference server runs {shape.architecture} on CPU "
        f"({running} concurrent requests of up to {context} tokens)",
        server="reference",
        device="cpu",
        tp=1,
        dp=1,
        mem_fraction_static=None,
        max_running_requests=running,
        context_length=context,
        kv_cache_dtype="auto",
        chunked_prefill_size=None,
        extra_flags=(),
        reasons=types.MappingProxyType(reasons),
    )


def _no_fit(summary: str, reasons: dict[str, str]) -> Plan:
    # Choices made before the plan failed (context, KV dtype) describe a plan that does not
    # exist; only what was found and why it fails remain.
    reasons = {key: reasons[key] for key in ("gpus",) if key in reasons}
    reasons["fit"] = summary
    return Plan(
        fits=False,
        summary=summary,
        server="sglang",
        device="cuda",
        tp=0,
        dp=0,
        mem_fraction_static=None,
        max_running_requests=0,
        context_length=0,
        kv_cache_dtype="auto",
        chunked_prefill_size=None,
        extra_flags=(),
        reasons=types.MappingProxyType(reasons),
    )


def _gpu_plan(
    *,
    shape: ModelShape,
    weight_bytes: int,
    gpus: Sequence[GpuLike],
    p2p: Sequence[Sequence[bool | None]] | None,
    context: int,
    target_concurrency: int,
    reasons: dict[str, str],
) -> Plan:
    count = len(gpus)
    unknown = [str(i) for i, gpu in enumerate(gpus) if not gpu.memory_total_bytes]
    if unknown:
        return _no_fit(
            f"GPU {', '.join(unknown)} did not report its memory size; the plan cannot size anything", reasons
        )
    vram = min(gpu.memory_total_bytes or 0 for gpu in gpus)
    reasons["gpus"] = _describe_gpus(gpus, vram)
    fraction = mem_fraction_static_for(vram_bytes=vram)
    if fraction is None:
        return _no_fit(
            f"GPUs of {_gib(vram)} are smaller than the {_gib(ACTIVATION_RESERVE_BYTES)} "
            "sglang needs outside its static pool",
            reasons,
        )
    budget = vram * round(fraction * 100) // 100
    reasons["mem_fraction_static"] = (
        f"{fraction:.2f}: keeps {_gib(vram - budget)} of each {_gib(vram)} GPU for activations, CUDA graphs "
        f"and communication buffers; the published 4× RTX 4090 config runs {PUBLISHED_MEM_FRACTION_STATIC}"
        + (f" (capped at sglang's default {MAX_MEM_FRACTION_STATIC})" if fraction == MAX_MEM_FRACTION_STATIC else "")
    )
    kv_dtype, kv_dtype_bytes = kv_cache_dtype(shape, gpus, reasons)

    if not legal_tp_sizes(shape, max_tp=shape.num_attention_heads):
        return _no_fit(
            f"no tensor-parallel size can shard this model: tp 1 fails because {tp_problem(shape, 1)}", reasons
        )
    legal = legal_tp_sizes(shape, max_tp=count)
    weight_tps = [tp for tp in legal if math.ceil(weight_bytes / tp) <= budget]
    if not weight_tps:
        return _no_fit(
            _weights_do_not_fit(
                shape=shape, weight_bytes=weight_bytes, vram=vram, budget=budget, fraction=fraction, count=count
            ),
            reasons,
        )

    choice = _choose(
        shape=shape,
        weight_bytes=weight_bytes,
        tps=weight_tps,
        gpu_count=count,
        context=context,
        target_concurrency=target_concurrency,
        budget=budget,
        kv_dtype_bytes=kv_dtype_bytes,
    )
    if choice is None:
        shortest = _context_candidates(context)[-1]
        largest = _option(
            shape=shape,
            weight_bytes=weight_bytes,
            tp=weight_tps[-1],
            context=shortest,
            budget=budget,
            kv_dtype_bytes=kv_dtype_bytes,
        )
        return _no_fit(
            f"the weights fit with tp {largest.tp} ({_gib(largest.weights)} per GPU) but leave {_gib(largest.free)} "
            f"of the {_gib(budget)} budget, less than the KV cache of one {shortest}-token request "
            f"({_gib(largest.per_request)}); use more or larger GPUs",
            reasons,
        )

    chosen, running, ctx = choice
    tp, dp = chosen.tp, count // chosen.tp
    if ctx != context:
        reasons["context_length"] = (
            f"{ctx}: reduced from {context}, because not even one {context}-token request's KV cache fits "
            "next to the weights on any legal tp"
        )
    reasons["tp"] = _tp_reason(
        shape=shape,
        weight_bytes=weight_bytes,
        chosen=chosen,
        running=running,
        context=ctx,
        budget=budget,
        kv_dtype_bytes=kv_dtype_bytes,
        count=count,
        full=running == target_concurrency,
    )
    idle = [str(i) for i in range(tp * dp, count)]
    reasons["dp"] = f"{dp}: {count} GPU{'s' if count != 1 else ''} / tp {tp}" + (
        f"; GPU {', '.join(idle)} {'stays' if len(idle) == 1 else 'stay'} idle (not enough for another tp group)"
        if idle
        else ""
    )
    reasons["max_running_requests"] = (
        f"{running}: the target concurrency; the KV cache holds {_requests(running)} of {ctx} tokens per replica"
        if running == target_concurrency
        else f"{running} (target {target_concurrency}): the {_gib(chosen.free)} per GPU left after the weights holds the "
        f"KV cache of {_requests(running)} of {ctx} tokens, not {running + 1}"
        + ("; context is kept, concurrency gives" if ctx == context else "")
    )
    reasons["server"] = "sglang on the GPUs"
    reasons["chunked_prefill_size"] = (
        f"--chunked-prefill-size {CHUNKED_PREFILL_SIZE}: the published config; the activation reserve behind "
        "mem_fraction_static is sized for prefill chunks of this many tokens"
    )
    flags = extra_flags(gpus=gpus, p2p=p2p, tp=tp, dp=dp, reasons=reasons)
    memory = MemoryEstimate(
        vram_bytes=vram,
        budget_bytes=budget,
        weights_bytes=chosen.weights,
        kv_cache_bytes=running * ctx * kv_bytes_per_token(shape, tp=tp, kv_dtype_bytes=kv_dtype_bytes),
        linear_state_bytes=running * linear_state_bytes_per_request(shape, tp=tp),
        reserve_bytes=vram - budget,
    )
    used = tuple(range(tp * dp))
    name = gpus[0].name or "GPU"
    mixed = len({gpus[i].name for i in used}) > 1
    return Plan(
        fits=True,
        summary=(
            f"tp {tp} × dp {dp} on {f'{len(used)} mixed GPUs' if mixed else f'{len(used)}× {name}'}: "
            f"{_requests(running)} of up to {ctx} tokens per replica, {running * dp} in flight"
        ),
        server="sglang",
        device="cuda",
        tp=tp,
        dp=dp,
        mem_fraction_static=fraction,
        max_running_requests=running,
        context_length=ctx,
        kv_cache_dtype=kv_dtype,
        chunked_prefill_size=CHUNKED_PREFILL_SIZE,
        extra_flags=flags,
        reasons=types.MappingProxyType(reasons),
        memory=memory,
        gpu_indices=used,
    )


def _choose(
    *,
    shape: ModelShape,
    weight_bytes: int,
    tps: Sequence[int],
    gpu_count: int,
    context: int,
    target_concurrency: int,
    budget: int,
    kv_dtype_bytes: int,
) -> tuple[_Option, int, int] | None:
    """(option, max_running_requests, context) or None. At the longest context that serves at
    least one request: the smallest tp that serves the target concurrency, else the tp that serves
    the most full-context requests across its replicas (ties: the smaller tp, less communication)."""
    for ctx in _context_candidates(context):
        options = [
            _option(
                shape=shape, weight_bytes=weight_bytes, tp=tp, context=ctx, budget=budget, kv_dtype_bytes=kv_dtype_bytes
            )
            for tp in tps
        ]
        full = [o for o in options if o.requests >= target_concurrency]
        if full:
            return full[0], target_concurrency, ctx
        partial = [o for o in options if o.requests >= 1]
        if partial:
            best = max(partial, key=lambda o: (o.requests * (gpu_count // o.tp), -o.tp))
            return best, best.requests, ctx
    return None


def _context_candidates(context: int) -> list[int]:
    """The target, then halvings down to `MIN_CONTEXT_LENGTH` (or the target, if shorter)."""
    candidates = [context]
    while candidates[-1] // 2 >= MIN_CONTEXT_LENGTH:
        candidates.append(candidates[-1] // 2)
    return candidates


def _option(
    *, shape: ModelShape, weight_bytes: int, tp: int, context: int, budget: int, kv_dtype_bytes: int
) -> _Option:
    weights = math.ceil(weight_bytes / tp)
    per_request = context * kv_bytes_per_token(
        shape, tp=tp, kv_dtype_bytes=kv_dtype_bytes
    ) + linear_state_bytes_per_request(shape, tp=tp)
    return _Option(tp=tp, weights=weights, per_request=max(1, per_request), free=budget - weights)


def _tp_reason(
    *,
    shape: ModelShape,
    weight_bytes: int,
    chosen: _Option,
    running: int,
    context: int,
    budget: int,
    kv_dtype_bytes: int,
    count: int,
    full: bool,
) -> str:
    kv = running * context * kv_bytes_per_token(shape, tp=chosen.tp, kv_dtype_bytes=kv_dtype_bytes)
    state = running * linear_state_bytes_per_request(shape, tp=chosen.tp)
    fit = (
        f"{_gib(chosen.weights)} of weights + {_gib(kv)} KV cache for {running} × {context} tokens"
        + (f" + {_gib(state)} linear-attention state" if state else "")
        + f" fit in {_gib(budget)} per GPU"
    )
    if full:
        head = f"{chosen.tp}: the smallest tensor-parallel size that fits the targets ({fit})"
    else:
        head = f"{chosen.tp}: the size that serves the most full-context requests ({fit})"
    # Smaller legal sizes say what they would need; sizes that would use whole groups of the GPUs
    # (2 and 4 on 4 GPUs, 8 on 8) but cannot shard the model say why not.
    legal = ", ".join(map(str, legal_tp_sizes(shape, max_tp=count)))
    notes = [f"legal sizes on {count} GPU{'s' if count != 1 else ''}: {legal}"]
    for tp in range(1, count + 1):
        problem = tp_problem(shape, tp)
        if problem and count % tp == 0:
            notes.append(f"tp {tp} is not allowed ({problem})")
        elif not problem and full and tp < chosen.tp:
            option = _option(
                shape=shape,
                weight_bytes=weight_bytes,
                tp=tp,
                context=context,
                budget=budget,
                kv_dtype_bytes=kv_dtype_bytes,
            )
            notes.append(f"tp {tp} would need {_gib(option.weights + running * option.per_request)}")
    return head + "; " + "; ".join(notes)


def _weights_do_not_fit(
    *, shape: ModelShape, weight_bytes: int, vram: int, budget: int, fraction: float, count: int
) -> str:
    any_count = legal_tp_sizes(shape, max_tp=shape.num_attention_heads)
    needed = next((tp for tp in any_count if math.ceil(weight_bytes / tp) <= budget), None)
    holds = f"each holds {_gib(budget)} of weights and KV cache at --mem-fraction-static {fraction:.2f}"
    if needed is None:
        return (
            f"{_gib(weight_bytes)} of weights do not fit on GPUs of {_gib(vram)} even at the largest tensor-parallel "
            f"size this model allows (tp {any_count[-1]}; {holds})"
        )
    return f"{_gib(weight_bytes)} of weights need at least {needed} GPUs of {_gib(vram)} ({holds}); found {count}"


def _describe_gpus(gpus: Sequence[GpuLike], vram: int) -> str:
    kinds: dict[tuple[str | None, int | None, tuple[int, int] | None], int] = {}
    for gpu in gpus:
        key = (gpu.name, gpu.memory_total_bytes, gpu.compute_capability)
        kinds[key] = kinds.get(key, 0) + 1
    listed = ", ".join(f"{n}× {name or 'GPU'} ({_gib(memory or 0)})" for (name, memory, _), n in kinds.items())
    if len(kinds) == 1:
        return listed
    return (
        f"mixed GPUs ({listed}): planning every GPU as the smallest ({_gib(vram)}), "
        "as sglang sizes its pools by the smallest rank"
    )


def _gib(value: int) -> str:
    """Sizes for reasons: GiB with one decimal, or whole MiB below 1 GiB (so 30 MiB of state
    does not read as "0.0 GiB")."""
    if abs(value) < GIB:
        return f"{value // MIB} MiB"
    return f"{value / GIB:.1f} GiB"


def _requests(count: int) -> str:
    return f"{count} request{'' if count == 1 else 's'}"
