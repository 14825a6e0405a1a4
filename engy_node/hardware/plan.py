"""How to serve a model on this machine's GPUs: tensor/data parallel sizes, sglang's memory
fraction, concurrency, context, KV-cache dtype and extra flags, each with its reason.

`plan()` is pure: it takes the checkpoint's shape (parsed from config.json), its weight size, the
GPUs (NVML's `GpuInfo` or plain `GpuSpec`s) with their P2P matrix, and the target context and
concurrency; it reads no file and no clock. `read_model_shape()` is the only IO here, kept apart
and tiny: it reads config.json and sums the shard sizes.

What it trusts: the config's head counts, layer types, MoE sizes and FP8 block, the shard sizes,
and each GPU's total VRAM. It decides with a memory model, not a measurement: per GPU, sglang's
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
import json
import math
import os
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from engy_node.errors import ModelError

__all__ = [
    "ACTIVATION_RESERVE_BYTES",
    "CHUNKED_PREFILL_SIZE",
    "CPU_MAX_RUNNING_REQUESTS",
    "DEFAULT_TARGET_CONCURRENCY",
    "GpuLike",
    "GpuSpec",
    "MemoryEstimate",
    "ModelShape",
    "Plan",
    "legal_tp_sizes",
    "mem_fraction_static_for",
    "model_shape_from_config",
    "plan",
    "read_model_shape",
    "tp_problem",
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

FP8_KV_MIN_COMPUTE_CAPABILITY = (8, 9)
"""FP8 (E4M3) arrives with Ada (cc 8.9, RTX 4090); the published config uses `fp8_e4m3` there."""

SM120_MAJOR = 12
"""Consumer Blackwell (RTX 50xx) is compute capability 12.x (sm_120)."""

KV_DTYPE_BYTES = {"fp8_e4m3": 1}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a checkpoint's config.json the planner needs."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    full_attention_layers: int
    """Layers with softmax attention, which keep a KV cache per token."""
    linear_attention_layers: int
    """Layers with linear attention (Gated DeltaNet in Qwen3.5/3.6), which keep a fixed-size
    recurrent state per request instead."""
    max_position_embeddings: int
    dtype: str = "bfloat16"
    """Activation dtype; the KV cache uses it unless an FP8 cache is chosen."""
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    linear_state_dtype: str = "float32"
    """dtype of the linear-attention recurrent state (`mamba_ssm_dtype`)."""
    intermediate_size: int | None = None
    """Dense MLP width (unused by all-MoE models)."""
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    quant_method: str | None = None
    quant_block: tuple[int, int] | None = None
    """`quantization_config.weight_block_size` as (block_n, block_k): FP8 block quantisation."""

    def block_quantized_widths(self) -> tuple[tuple[str, int], ...]:
        """The MLP widths tensor parallelism splits and FP8 blocks must tile: expert and shared
        expert widths for MoE models, the dense width otherwise."""
        widths: tuple[tuple[str, int | None], ...]
        if self.num_experts:
            widths = (
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
            )
        else:
            widths = (("intermediate_size", self.intermediate_size),)
        return tuple((label, width) for label, width in widths if width)


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


def model_shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """Parse a config.json dict. Multimodal wrappers (Qwen3.5/3.6) nest the language model under
    `text_config`; its fields win, and `quantization_config` is read from either level.

    Errors: `ModelError` naming the missing or malformed key.
    """
    text = config.get("text_config")
    merged: dict[str, Any] = {**config, **(text if isinstance(text, Mapping) else {})}

    def optional(key: str) -> int | None:
        value = merged.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"config.json has {key}={value!r}; expected a positive integer")
        return value

    def required(key: str) -> int:
        value = optional(key)
        if value is None:
            raise ModelError(f"config.json has no {key!r}; point the miner at a causal-LM checkpoint directory")
        return value

    heads = required("num_attention_heads")
    layers = required("num_hidden_layers")
    hidden = required("hidden_size")
    full_layers, linear_layers = _attention_layer_counts(merged, layers)
    quant = merged.get("quantization_config")
    quant = quant if isinstance(quant, Mapping) else {}
    block = quant.get("weight_block_size")
    if block is not None and not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelError(f"config.json has weight_block_size={block!r}; expected two positive integers")
    architectures = config.get("architectures")
    return ModelShape(
        architecture=str(architectures[0]) if isinstance(architectures, list) and architectures else "unknown",
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=optional("num_key_value_heads") or heads,
        head_dim=optional("head_dim") or hidden // heads,
        full_attention_layers=full_layers,
        linear_attention_layers=linear_layers,
        max_position_embeddings=required("max_position_embeddings"),
        dtype=str(merged.get("dtype") or merged.get("torch_dtype") or "bfloat16"),
        linear_num_key_heads=optional("linear_num_key_heads"),
        linear_num_value_heads=optional("linear_num_value_heads"),
        linear_key_head_dim=optional("linear_key_head_dim"),
        linear_value_head_dim=optional("linear_value_head_dim"),
        linear_conv_kernel_dim=optional("linear_conv_kernel_dim"),
        linear_state_dtype=str(merged.get("mamba_ssm_dtype") or "float32"),
        intermediate_size=optional("intermediate_size"),
        num_experts=optional("num_experts"),
        num_experts_per_tok=optional("num_experts_per_tok"),
        moe_intermediate_size=optional("moe_intermediate_size"),
        shared_expert_intermediate_size=optional("shared_expert_intermediate_size"),
        quant_method=str(quant["quant_method"]) if quant.get("quant_method") else None,
        quant_block=None if block is None else (block[0], block[1]),
    )


def _attention_layer_counts(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """(KV-caching layers, linear-attention layers). `layer_types` is authoritative; else every
    `full_attention_interval`-th layer is full attention; else all are. Any layer type other than
    linear attention (sliding windows included) is counted as caching, the larger estimate."""
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) != layers:
            raise ModelError(f"config.json lists {len(layer_types)} layer_types for {layers} layers")
        linear = sum(1 for kind in layer_types if kind == "linear_attention")
        return layers - linear, linear
    interval = config.get("full_attention_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        full = layers // interval
        return full, layers - full
    return layers, 0


def read_model_shape(checkpoint_dir: str | os.PathLike[str]) -> tuple[ModelShape, int]:
    """(shape from config.json, total bytes of the `*.safetensors` shards) of a checkpoint.

    Errors: `ModelError` when config.json is missing or unreadable or there are no shards.
    """
    directory = Path(checkpoint_dir)
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{directory} has no config.json; point the miner at a model directory") from None
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read {config_path}: {err}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_path} is not a JSON object")
    weight_bytes = sum(shard.stat().st_size for shard in directory.glob("*.safetensors"))
    if weight_bytes == 0:
        raise ModelError(f"{directory} has no *.safetensors shards; download or convert the checkpoint first")
    return model_shape_from_config(config), weight_bytes


def tp_problem(shape: ModelShape, tp: int) -> str | None:
    """Why `tp` cannot shard this model, or None when it can.

    Attention heads must split evenly; KV heads must split evenly or, past their count, replicate
    evenly (sglang replicates them); linear-attention heads must split evenly; and with FP8 block
    quantisation every MLP width split by tp must stay a multiple of the block (sglang #26107:
    "... is not divisible by weight quantization block_n = 128").
    """
    if tp < 1:
        return "tp must be at least 1"
    if shape.num_attention_heads % tp:
        return f"{shape.num_attention_heads} attention heads do not split {tp} ways"
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        return f"{kv} KV heads neither split {tp} ways nor replicate evenly over {tp} GPUs"
    for label, count in (
        ("linear-attention key heads", shape.linear_num_key_heads),
        ("linear-attention value heads", shape.linear_num_value_heads),
    ):
        if shape.linear_attention_layers and count and count % tp:
            return f"{count} {label} do not split {tp} ways"
    if shape.quant_block:
        for label, width in shape.block_quantized_widths():
            for block in sorted(set(shape.quant_block)):
                if width % tp or (width // tp) % block:
                    return f"{label} {width} / {tp} = {width / tp:g} is not a multiple of the FP8 block {block}"
    return None


def legal_tp_sizes(shape: ModelShape, *, max_tp: int) -> tuple[int, ...]:
    """Every tp in 1..max_tp that `tp_problem` accepts, ascending."""
    return tuple(tp for tp in range(1, max_tp + 1) if tp_problem(shape, tp) is None)


def mem_fraction_static_for(*, vram_bytes: int) -> float | None:
    """`--mem-fraction-static` that leaves `ACTIVATION_RESERVE_BYTES` free, floored to 0.01 (so
    the reserve is never smaller than derived) and capped at `MAX_MEM_FRACTION_STATIC`; None when
    the card is smaller than the reserve."""
    if vram_bytes <= ACTIVATION_RESERVE_BYTES:
        return None
    hundredths = (vram_bytes - ACTIVATION_RESERVE_BYTES) * 100 // vram_bytes
    return min(hundredths / 100, MAX_MEM_FRACTION_STATIC)


def kv_bytes_per_token(shape: ModelShape, *, tp: int, kv_dtype_bytes: int) -> int:
    """KV-cache bytes one token costs on one GPU: K and V for each caching layer's share of the
    KV heads (at least one head per GPU: past the head count they are replicated, not split)."""
    heads_per_gpu = max(1, shape.num_kv_heads // tp)
    return shape.full_attention_layers * heads_per_gpu * shape.head_dim * 2 * kv_dtype_bytes


def linear_state_bytes_per_request(shape: ModelShape, *, tp: int) -> int:
    """Recurrent state one request holds on one GPU across the linear-attention layers: the
    (value heads × key dim × value dim) state plus the convolution window (kernel − 1 steps of
    the q/k/v channels), both split by tp."""
    if not shape.linear_attention_layers:
        return 0
    k_heads, v_heads = shape.linear_num_key_heads, shape.linear_num_value_heads
    k_dim, v_dim, kernel = shape.linear_key_head_dim, shape.linear_value_head_dim, shape.linear_conv_kernel_dim
    if not (k_heads and v_heads and k_dim and v_dim):
        return 0
    state = (v_heads // tp) * k_dim * v_dim * DTYPE_BYTES.get(shape.linear_state_dtype, 4)
    conv_channels = (2 * k_heads * k_dim + v_heads * v_dim) // tp
    conv = conv_channels * max(0, (kernel or 1) - 1) * DTYPE_BYTES.get(shape.dtype, 2)
    return shape.linear_attention_layers * (state + conv)


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
    kv_dtype, kv_dtype_bytes = _kv_cache_dtype(shape, gpus, reasons)

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
    flags = _extra_flags(gpus=gpus, p2p=p2p, tp=tp, dp=dp, reasons=reasons)
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


def _kv_cache_dtype(shape: ModelShape, gpus: Sequence[GpuLike], reasons: dict[str, str]) -> tuple[str, int]:
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


def _extra_flags(
    *, gpus: Sequence[GpuLike], p2p: Sequence[Sequence[bool | None]] | None, tp: int, dp: int, reasons: dict[str, str]
) -> tuple[str, ...]:
    flags: list[str] = []
    reasons["chunked_prefill_size"] = (
        f"--chunked-prefill-size {CHUNKED_PREFILL_SIZE}: the published config; the activation reserve behind "
        "mem_fraction_static is sized for prefill chunks of this many tokens"
    )
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
