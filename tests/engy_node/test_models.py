"""Tests for engy_node.models: the catalog's facts, lookups, and the `model_root` checkpoint
identity (computed here independently with hashlib)."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.errors import EngyError, ModelError
from engy_node.models import (
    CATALOG,
    DEFAULT_LOCAL_MODEL,
    ModelSpec,
    get_model,
    model_root,
    model_root_from,
)

CONFIG_JSON = b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 576}'


def reference_root(config_json: bytes, shards: list[tuple[str, int]]) -> str:
    """docs/protocol.md: sha256 of config.json's bytes, then for each shard in name order its basename
    and its size in decimal."""
    digest = hashlib.sha256()
    digest.update(config_json)
    for name, size in sorted(shards, key=lambda shard: shard[0]):
        digest.update(name.encode("utf-8"))
        digest.update(str(size).encode("ascii"))
    return digest.hexdigest()


# --- the catalog ------------------------------------------------------------------------------


def test_qwen36_has_the_limits_and_proof_parameters_from_the_spec():
    spec = get_model("qwen3.6-35b-a3b")
    assert spec.id == "qwen3.6-35b-a3b"
    assert spec.max_input_tokens == 229_376
    assert spec.max_output_tokens == 32_768
    assert spec.max_request_s == 1800
    assert spec.proof.topk == 128
    assert spec.proof.max_exp_mismatches == 40
    assert spec.proof.min_pass_ratio == 0.99
    assert spec.embedded is False


def test_smollm2_is_the_embedded_model_and_the_default_for_local_use():
    spec = get_model("smollm2-135m")
    assert spec.embedded is True
    assert DEFAULT_LOCAL_MODEL == "smollm2-135m"
    assert get_model(DEFAULT_LOCAL_MODEL) is spec
    assert [s.id for s in CATALOG.values() if s.embedded] == ["smollm2-135m"]


def test_every_catalog_entry_is_keyed_by_its_own_id():
    for model_id, spec in CATALOG.items():
        assert spec.id == model_id
        assert get_model(model_id) is spec


def test_every_catalog_entry_has_consistent_limits_and_integer_prices():
    for spec in CATALOG.values():
        assert spec.max_input_tokens > 0 and spec.max_output_tokens > 0
        # A full-length prompt plus a full-length answer fits the model's context.
        assert spec.max_input_tokens + spec.max_output_tokens <= spec.context_length
        assert spec.max_request_s > 0
        assert 0 < spec.proof.min_pass_ratio <= 1
        assert 0 <= spec.proof.max_exp_mismatches <= spec.proof.topk
        for price in dataclasses.astuple(spec.price):
            assert isinstance(price, int) and price >= 0
        assert spec.price.cached_input_per_m <= spec.price.input_per_m
        assert isinstance(spec.score_rate, int) and spec.score_rate > 0


def test_catalog_entries_cannot_be_modified():
    spec = get_model("qwen3.6-35b-a3b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_output_tokens = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.proof.topk = 1  # type: ignore[misc]
    assert isinstance(spec, ModelSpec)


def test_an_unknown_model_id_raises_a_model_error_listing_the_known_ids():
    with pytest.raises(ModelError) as caught:
        get_model("gpt-5")
    message = str(caught.value)
    assert "'gpt-5'" in message
    for model_id in CATALOG:
        assert model_id in message
    assert isinstance(caught.value, EngyError)
    assert caught.value.title == "model"


def test_model_ids_are_matched_exactly():
    with pytest.raises(ModelError):
        get_model("SmolLM2-135M")
    with pytest.raises(ModelError):
        get_model(" smollm2-135m")


# --- model_root_from --------------------------------------------------------------------------


def test_model_root_from_matches_a_hashlib_reference():
    shards = [("model-00002-of-00002.safetensors", 1000), ("model-00001-of-00002.safetensors", 4_000_000_000)]
    expected = hashlib.sha256(
        CONFIG_JSON
        + b"model-00001-of-00002.safetensors"
        + b"4000000000"
        + b"model-00002-of-00002.safetensors"
        + b"1000"
    ).hexdigest()
    assert model_root_from(CONFIG_JSON, shards) == expected
    assert len(expected) == 64


def test_model_root_from_uses_only_the_basename_of_each_shard():
    assert model_root_from(CONFIG_JSON, [("/some/dir/model.safetensors", 5)]) == model_root_from(
        CONFIG_JSON, [("model.safetensors", 5)]
    )


SHARD_NAMES = st.from_regex(r"[a-z0-9_\-]{1,12}\.safetensors", fullmatch=True)
SHARDS = st.lists(
    st.tuples(SHARD_NAMES, st.integers(min_value=0, max_value=2**40)),
    min_size=1,
    max_size=8,
    unique_by=lambda shard: shard[0],
)


@given(st.binary(max_size=200), SHARDS, st.randoms(use_true_random=False))
@settings(max_examples=150)
def test_model_root_from_equals_the_reference_and_ignores_the_order_shards_are_listed_in(config, shards, rng):
    shuffled = list(shards)
    rng.shuffle(shuffled)
    root = model_root_from(config, shards)
    assert root == reference_root(config, shards)
    assert model_root_from(config, shuffled) == root


@given(st.binary(max_size=200), SHARDS, st.data())
@settings(max_examples=150)
def test_model_root_from_changes_when_a_shard_size_changes(config, shards, data):
    index = data.draw(st.integers(min_value=0, max_value=len(shards) - 1))
    name, size = shards[index]
    new_size = data.draw(st.integers(min_value=0, max_value=2**40).filter(lambda s: s != size))
    changed = list(shards)
    changed[index] = (name, new_size)
    assert model_root_from(config, changed) != model_root_from(config, shards)


@given(st.binary(max_size=200), st.binary(max_size=200), SHARDS)
@settings(max_examples=150)
def test_model_root_from_changes_when_the_config_changes(config, other, shards):
    if config != other:
        assert model_root_from(config, shards) != model_root_from(other, shards)


def test_model_root_from_changes_when_a_shard_is_renamed_added_or_dropped():
    base = [("a.safetensors", 10), ("b.safetensors", 20)]
    root = model_root_from(CONFIG_JSON, base)
    assert model_root_from(CONFIG_JSON, [("a.safetensors", 10), ("c.safetensors", 20)]) != root
    assert model_root_from(CONFIG_JSON, [*base, ("c.safetensors", 0)]) != root
    assert model_root_from(CONFIG_JSON, base[:1]) != root


# --- model_root on a directory ----------------------------------------------------------------


def make_checkpoint(directory, shards: dict[str, int], config: bytes = CONFIG_JSON):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_bytes(config)
    for name, size in shards.items():
        (directory / name).write_bytes(b"\0" * size)
    return directory


def test_model_root_of_a_directory_hashes_its_config_and_shards(tmp_path):
    shards = {"model-00001-of-00002.safetensors": 300, "model-00002-of-00002.safetensors": 17}
    checkpoint = make_checkpoint(tmp_path / "ckpt", shards)
    # Files that are not shards do not count.
    (checkpoint / "tokenizer.json").write_text("{}")
    (checkpoint / "model.safetensors.index.json").write_text("{}")
    expected = reference_root(CONFIG_JSON, list(shards.items()))
    assert model_root(checkpoint) == expected
    assert model_root(str(checkpoint)) == expected
    assert model_root(checkpoint) == model_root_from(CONFIG_JSON, list(shards.items()))


def test_model_root_is_the_same_for_a_copy_in_another_directory(tmp_path):
    shards = {"model.safetensors": 64}
    assert model_root(make_checkpoint(tmp_path / "a", shards)) == model_root(
        make_checkpoint(tmp_path / "deeper" / "b", shards)
    )


def test_model_root_changes_when_a_shard_grows(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 64})
    before = model_root(checkpoint)
    with (checkpoint / "model.safetensors").open("ab") as shard:
        shard.write(b"\0")
    assert model_root(checkpoint) != before


def test_model_root_without_config_json_says_to_point_at_a_model_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(ModelError) as caught:
        model_root(tmp_path)
    message = str(caught.value)
    assert str(tmp_path) in message
    assert "config.json" in message
    assert "--checkpoint" in message


def test_model_root_of_a_directory_that_does_not_exist_reports_the_missing_config(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        model_root(tmp_path / "nowhere")


def test_model_root_without_shards_says_to_convert_the_checkpoint(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", {})
    (checkpoint / "model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelError) as caught:
        model_root(checkpoint)
    message = str(caught.value)
    assert str(checkpoint) in message
    assert "*.safetensors" in message
    assert "convert" in message


def test_model_root_counts_an_empty_shard(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 0})
    assert model_root(checkpoint) == reference_root(CONFIG_JSON, [("model.safetensors", 0)])
    assert os.path.getsize(checkpoint / "model.safetensors") == 0
