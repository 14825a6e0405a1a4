"""Grouping tensor names into layers, experts and the lm group, without any file."""

from __future__ import annotations

import pytest

from engy_node.errors import ModelError
from engy_node.gemm.layout import TensorInfo, committed_config, plan_layout, weight_block_rows


def infos(*names: str) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, "BF16", (4, 4)) for name in names}


def test_only_the_decoder_layers_are_layers():
    names = [f"model.language_model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    names += ["mtp.layers.0.mlp.down_proj.weight", "lm_head.weight", "model.visual.blocks.0.attn.qkv.weight"]
    layout = plan_layout(infos(*names), {"n_layers": 2, "n_experts": 0})
    assert [[m.name for m in layer.matrices] for layer in layout.layers] == [[names[0]], [names[1]]]
    assert [m.name for m in layout.lm] == sorted(names[2:])


def test_a_multimodal_config_commits_its_text_model():
    config = {
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 40,
            "hidden_size": 2048,
            "moe_intermediate_size": 512,
            "intermediate_size": 9999,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "vocab_size": 248320,
        },
        "quantization_config": {"weight_block_size": [128, 128]},
    }
    assert committed_config(config) == {
        "arch": "qwen3_5_moe_text",
        "n_layers": 40,
        "hidden": 2048,
        "d_ff": 512,
        "n_experts": 256,
        "top_k": 8,
        "vocab": 248320,
    }
    assert weight_block_rows(config) == 128 and weight_block_rows({}) is None


def test_a_config_without_the_committed_fields_is_refused():
    with pytest.raises(ModelError, match="no integer 'num_hidden_layers'"):
        committed_config({"model_type": "llama"})
    with pytest.raises(ModelError, match="no 'model_type'"):
        committed_config({"num_hidden_layers": 2})
