"""What the planner knows of a checkpoint: its shape, read from config.json, which tensor-parallel
sizes can shard it, and what one token's KV cache and one request's recurrent state cost per GPU.

These are facts of the model, the same whatever GPUs it lands on, so they stand apart from the
choices `plan.py` makes with them. `read_model_shape()` is the only IO in planning, kept tiny:
it reads config.json and sums the shard sizes; everything else here is a pure function of the
parsed `ModelShape`.

What it trusts: the config's head counts, layer types, MoE sizes and FP8 block, and the shard
sizes. Any layer type other than linear attention is counted as caching (the larger estimate).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engy_node.errors import ModelError

__all__ = [
    "DTYPE_BYTES",
    "ModelShape",
    "kv_bytes_per_token",
    "legal_tp_sizes",
    "linear_state_bytes_per_request",
    "model_shape_from_config",
    "read_model_shape",
    "tp_problem",
]

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
