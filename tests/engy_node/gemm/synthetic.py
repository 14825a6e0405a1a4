"""Tiny checkpoints written with safetensors, for the commitment's edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, D_FF, VOCAB = 8, 12, 16


def dense_tensors(n_layers: int = 2, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    tensors = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN), "model.norm.weight": weight(HIDDEN)}
    for i in range(n_layers):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "input_layernorm.weight": weight(HIDDEN),
            prefix + "self_attn.q_proj.weight": weight(HIDDEN, HIDDEN),
            prefix + "self_attn.k_proj.weight": weight(4, HIDDEN),
            prefix + "mlp.gate_proj.weight": weight(D_FF, HIDDEN),
            prefix + "mlp.down_proj.weight": weight(HIDDEN, D_FF),
        }
    return tensors


def moe_tensors(n_layers: int = 2, n_experts: int = 3, first_dense: int = 1) -> dict[str, torch.Tensor]:
    """Layers below `first_dense` dense, the rest MoE: a router and `n_experts` routed experts."""
    tensors = dense_tensors(n_layers)
    generator = torch.Generator().manual_seed(1)
    for i in range(first_dense, n_layers):
        prefix = f"model.layers.{i}.mlp."
        del tensors[prefix + "gate_proj.weight"], tensors[prefix + "down_proj.weight"]
        tensors[prefix + "gate.weight"] = torch.randn(n_experts, HIDDEN, generator=generator).bfloat16()
        for j in range(n_experts):
            tensors[f"{prefix}experts.{j}.gate_proj.weight"] = torch.randn(4, HIDDEN, generator=generator).bfloat16()
            tensors[f"{prefix}experts.{j}.down_proj.weight"] = torch.randn(HIDDEN, 4, generator=generator).bfloat16()
    return tensors


def config(n_layers: int = 2, **extra: object) -> dict[str, object]:
    return {
        "model_type": "llama",
        "num_hidden_layers": n_layers,
        "hidden_size": HIDDEN,
        "intermediate_size": D_FF,
        "vocab_size": VOCAB,
        **extra,
    }


def write_checkpoint(
    directory: Path, tensors: dict[str, torch.Tensor], config_json: dict[str, object], shards: int = 1
) -> Path:
    """`tensors` in `shards` files (with an index when more than one) beside `config_json`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_json))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors")
        return directory
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[k::shards]}
        save_file(part, directory / file)
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory
