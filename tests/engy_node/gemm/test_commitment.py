"""Weight commitments over tiny safetensors checkpoints: what each root binds, and what is refused."""

from __future__ import annotations

import math

import pytest
import torch

from engy_node.errors import ModelError
from engy_node.gemm.checkpoint import commit_checkpoint
from engy_node.gemm.commitment import descriptor, matrix_root
from engy_node.gemm.layout import Matrix, TensorInfo
from engy_node.gemm.merkle import leaf_hash, merkle_root

from .synthetic import config, dense_tensors, moe_tensors, write_checkpoint

DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def expected_root(name: str, tensor: torch.Tensor, dtype: str) -> bytes:
    """A matrix's root from its rows' bytes, computed without the module's row splitting."""
    rows = tensor.reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)
    leaves = [leaf_hash(row.contiguous().view(torch.uint8).numpy().tobytes()) for row in rows]
    return matrix_root(Matrix(TensorInfo(name, dtype, tuple(tensor.shape))), merkle_root(leaves))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
def test_each_matrix_root_binds_its_stored_rows(tmp_path, dtype):
    tensors = dense_tensors(dtype=dtype)
    commitment = commit_checkpoint(write_checkpoint(tmp_path, tensors, config()))
    for name, tensor in tensors.items():
        assert commitment.matrix_roots[name] == expected_root(name, tensor, DTYPES[dtype]), name


def test_one_changed_element_changes_its_matrix_layer_and_weights_root_only(tmp_path):
    tensors = dense_tensors(n_layers=3)
    before = commit_checkpoint(write_checkpoint(tmp_path / "a", tensors, config(3)))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][5, 7] = tensors[name][5, 7] * 1.01 + 0.01
    after = commit_checkpoint(write_checkpoint(tmp_path / "b", tensors, config(3)))
    changed = {n for n in before.matrix_roots if before.matrix_roots[n] != after.matrix_roots[n]}
    assert changed == {name}
    assert [a == b for a, b in zip(before.layer_roots, after.layer_roots, strict=True)] == [True, False, True]
    assert before.lm_root == after.lm_root and before.weights_root != after.weights_root


def test_the_same_values_in_another_dtype_or_name_commit_differently(tmp_path):
    tensors = dense_tensors(dtype=torch.bfloat16)
    base = commit_checkpoint(write_checkpoint(tmp_path / "bf16", tensors, config()))
    widened = {n: t.float() for n, t in tensors.items()}  # the same values, stored as f32
    assert commit_checkpoint(write_checkpoint(tmp_path / "f32", widened, config())).weights_root != base.weights_root
    swapped = dict(tensors)
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    swapped[a], swapped[b] = tensors[a][:4].clone(), torch.cat([tensors[b], tensors[a][4:]])
    assert commit_checkpoint(write_checkpoint(tmp_path / "swap", swapped, config())).weights_root != base.weights_root


def test_the_root_does_not_depend_on_how_the_checkpoint_is_sharded(tmp_path):
    tensors = moe_tensors()
    one = commit_checkpoint(write_checkpoint(tmp_path / "one", tensors, config(num_experts=3)))
    three = commit_checkpoint(write_checkpoint(tmp_path / "three", tensors, config(num_experts=3), shards=3))
    assert one == three


def test_the_config_is_committed(tmp_path):
    tensors = dense_tensors()
    base = commit_checkpoint(write_checkpoint(tmp_path / "a", tensors, config()))
    other = commit_checkpoint(write_checkpoint(tmp_path / "b", tensors, config(vocab_size=17)))
    assert base.layer_roots == other.layer_roots and base.lm_root == other.lm_root
    assert base.weights_root != other.weights_root


def test_odd_shapes_commit_one_leaf_per_last_dimension_row(tmp_path):
    tensors = dense_tensors(dtype=torch.float32) | {
        "model.scalar": torch.tensor(3.0),
        "model.cube": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        "model.no_rows": torch.zeros(0, 4),
        "model.empty_rows": torch.zeros(3, 0),
        "model.flags": torch.tensor([True, False, True]),
    }
    commitment = commit_checkpoint(write_checkpoint(tmp_path, tensors, config()))
    for name in ("model.scalar", "model.cube", "model.no_rows", "model.empty_rows"):
        assert commitment.matrix_roots[name] == expected_root(name, tensors[name], "F32"), name
    assert commitment.matrix_roots["model.flags"] == expected_root("model.flags", tensors["model.flags"], "BOOL")
    assert [m.name for m in commitment.layout.lm] == sorted(n for n in tensors if ".layers." not in n)


def block_fp8_tensors(rows: int = 300) -> dict[str, torch.Tensor]:
    tensors = dense_tensors()
    generator = torch.Generator().manual_seed(2)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(rows, 256, generator=generator).to(torch.float8_e4m3fn)
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.rand(-(-rows // 128), 2, generator=generator)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].clone()
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] * 2
    return tensors


FP8_CONFIG = config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})


def test_a_block_fp8_row_leaf_binds_its_weight_row_and_the_scale_row_of_its_block(tmp_path):
    tensors = block_fp8_tensors()
    commitment = commit_checkpoint(write_checkpoint(tmp_path, tensors, FP8_CONFIG))
    name = "model.layers.0.mlp.up_proj.weight"
    weight, scale = tensors[name], tensors[name + "_scale_inv"]
    leaves = [
        leaf_hash(weight[i].view(torch.uint8).numpy().tobytes() + scale[i // 128].numpy().tobytes())
        for i in range(weight.shape[0])
    ]
    matrix = Matrix(
        TensorInfo(name, "F8_E4M3", (300, 256)), TensorInfo(name + "_scale_inv", "F32", (3, 2)), block_rows=128
    )
    assert commitment.matrix_roots[name] == matrix_root(matrix, merkle_root(leaves))
    assert b'"block_rows":128' in descriptor(matrix)
    assert name + "_scale_inv" not in commitment.matrix_roots
    # Same weight bytes, doubled scales: the layer's matrix root differs.
    assert commitment.matrix_roots[name] != commitment.matrix_roots[name.replace(".0.", ".1.")]


def test_block_fp8_checkpoints_that_cannot_be_committed_say_why(tmp_path):
    tensors = block_fp8_tensors()
    with pytest.raises(ModelError, match="weight_block_size; commit the checkpoint with its original config.json"):
        commit_checkpoint(write_checkpoint(tmp_path / "no_block", tensors, config()))
    bad = dict(tensors, **{"model.layers.0.mlp.up_proj.weight_scale_inv": torch.rand(2, 2)})
    with pytest.raises(ModelError, match="not one row per 128 rows of model.layers.0.mlp.up_proj.weight"):
        commit_checkpoint(write_checkpoint(tmp_path / "bad_scale", bad, FP8_CONFIG))
    orphan = dict(tensors, **{"model.layers.0.mlp.gate_proj.weight_scale_inv": torch.rand(1, 1)})
    del orphan["model.layers.0.mlp.gate_proj.weight"]
    with pytest.raises(ModelError, match="has no model.layers.0.mlp.gate_proj.weight to scale"):
        commit_checkpoint(write_checkpoint(tmp_path / "orphan", orphan, FP8_CONFIG))


def test_moe_layers_commit_each_expert(tmp_path):
    tensors = moe_tensors(n_layers=3, n_experts=3, first_dense=1)
    commitment = commit_checkpoint(write_checkpoint(tmp_path, tensors, config(3, num_experts=3, num_experts_per_tok=2)))
    assert [len(e) for e in commitment.expert_roots] == [0, 3, 3]
    assert commitment.layout.config["n_experts"] == 3 and commitment.layout.config["top_k"] == 2
    layer = commitment.layout.layers[1]
    assert [m.name for m in layer.matrices] == sorted(
        n for n in tensors if n.startswith("model.layers.1.") and "experts" not in n
    )
    expert = "model.layers.1.mlp.experts.2."
    assert commitment.expert_roots[1][2] == merkle_root(
        [commitment.matrix_roots[expert + "down_proj.weight"], commitment.matrix_roots[expert + "gate_proj.weight"]]
    )
    assert commitment.layer_roots[1] == merkle_root(
        [*(commitment.matrix_roots[m.name] for m in layer.matrices), *commitment.expert_roots[1]]
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"), r"model.layers.1 has no model.layers.\*.self_attn"),
        (lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.2.")], r"says 3 layers .* layers \[2\]"),
        (lambda t: t.pop("model.layers.2.mlp.experts.1.gate_proj.weight"), "expert 1 lacks tensors"),
        (
            lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.1.mlp.experts.1.")],
            r"model.layers.1 has no tensors for experts \[1\]",
        ),
        (
            lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.1.mlp.experts.2.")],
            "model.layers.1 has 2 experts, config.json says 3",
        ),
    ],
    ids=["tensor", "layer", "expert-tensor", "expert-gap", "expert-count"],
)
def test_an_incomplete_checkpoint_is_refused_by_name(tmp_path, edit, message):
    tensors = moe_tensors(n_layers=3, n_experts=3)
    edit(tensors)
    with pytest.raises(ModelError, match=message):
        commit_checkpoint(write_checkpoint(tmp_path, tensors, config(3, num_experts=3)))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        commit_checkpoint(tmp_path)
    directory = write_checkpoint(tmp_path / "sharded", dense_tensors(), config(), shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match=r"lacks shards \['model-00002-of-00002.safetensors'\]"):
        commit_checkpoint(directory)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no \\*.safetensors shards"):
        commit_checkpoint(empty)
