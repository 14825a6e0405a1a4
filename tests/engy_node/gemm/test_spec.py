"""The spec file: written in the public spec's shape, read back only when its roots follow."""

from __future__ import annotations

import gzip
import json

import pytest

from engy_node.errors import ModelError
from engy_node.gemm.checkpoint import commit_checkpoint
from engy_node.gemm.spec import read_spec, spec_json, write_spec

from .synthetic import config, moe_tensors, write_checkpoint


@pytest.fixture
def commitment(tmp_path):
    return commit_checkpoint(write_checkpoint(tmp_path / "ckpt", moe_tensors(n_layers=3), config(3, num_experts=3)))


@pytest.mark.parametrize("name", ["spec.json", "spec.json.gz"])
def test_a_spec_file_reads_back_as_the_same_commitment(tmp_path, commitment, name):
    write_spec(tmp_path / name, commitment)
    assert read_spec(tmp_path / name) == commitment


def test_the_spec_has_the_public_shape_with_our_root_name(commitment):
    spec = spec_json(commitment)
    assert {"config", "lm_root", "layer_roots", "expert_roots_by_layer", "weights_root"} <= set(spec)
    assert "model_root" not in spec and spec["format"] == "engy-weights-v1"
    assert spec["config"] == {
        "arch": "llama",
        "n_layers": 3,
        "hidden": 8,
        "d_ff": 12,
        "n_experts": 3,
        "top_k": 0,
        "vocab": 16,
    }
    assert spec["weights_root"] == commitment.weights_root.hex()
    assert list(spec["expert_roots_by_layer"]) == ["1", "2"] and len(spec["expert_roots_by_layer"]["1"]) == 3


def test_the_gzip_file_is_reproducible(tmp_path, commitment):
    write_spec(tmp_path / "a.json.gz", commitment)
    write_spec(tmp_path / "b.json.gz", commitment)
    assert (tmp_path / "a.json.gz").read_bytes() == (tmp_path / "b.json.gz").read_bytes()


def edited(spec, path, value):
    *parents, last = path
    target = spec
    for key in parents:
        target = target[key]
    target[last] = value
    return spec


@pytest.mark.parametrize(
    "path",
    [
        ("weights_root",),
        ("lm_root",),
        ("layer_roots", 1),
        ("layers", 2, "experts", 0, 1, "rows_root"),
        ("lm", 0, "rows_root"),
    ],
)
def test_a_spec_whose_roots_do_not_follow_is_refused(tmp_path, commitment, path):
    spec = edited(spec_json(commitment), path, "00" * 32)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(ModelError, match="do not follow from its matrices"):
        read_spec(tmp_path / "spec.json")


def test_a_changed_shape_or_config_is_refused_too(tmp_path, commitment):
    for path, value in ((("layers", 0, "matrices", 0, "shape"), [8, 9]), (("config", "vocab"), 17)):
        (tmp_path / "spec.json").write_text(json.dumps(edited(spec_json(commitment), path, value)))
        with pytest.raises(ModelError, match="do not follow"):
            read_spec(tmp_path / "spec.json")


def test_other_files_are_refused_with_the_fix(tmp_path, commitment):
    public = {"config": {}, "model_root": "15ef", "lm_root": "99ec", "layer_roots": [], "expert_roots_by_layer": {}}
    (tmp_path / "public.json.gz").write_bytes(gzip.compress(json.dumps(public).encode()))
    with pytest.raises(ModelError, match="format is the public SN53 format, not engy-weights-v1"):
        read_spec(tmp_path / "public.json.gz")
    spec = spec_json(commitment)
    del spec["lm"]
    (tmp_path / "cut.json").write_text(json.dumps(spec))
    with pytest.raises(ModelError, match="malformed .*engy-node weights commit"):
        read_spec(tmp_path / "cut.json")
    for content in (b"not json", b"[1, 2]"):
        (tmp_path / "junk.json").write_bytes(content)
        with pytest.raises(ModelError, match="is not a spec file"):
            read_spec(tmp_path / "junk.json")
