"""The weights check at load: a checkpoint's root against the catalog's pin."""

from __future__ import annotations

import dataclasses

import pytest

from engy_node.gemm.loaded import LoadedWeights, WeightsMismatch, check_checkpoint, judge
from engy_node.models import QWEN36_35B_A3B, SMOLLM2_135M
from tests.engy_node.gemm.synthetic import config, dense_tensors, write_checkpoint

OTHER = "cd" * 32


def test_the_pinned_root_passes_and_says_so():
    assert judge(SMOLLM2_135M, "/m", SMOLLM2_135M.weights_root) == LoadedWeights(SMOLLM2_135M.weights_root, True)


def test_a_model_without_a_pin_is_served_with_its_root_reported():
    assert not QWEN36_35B_A3B.weights_root
    assert judge(QWEN36_35B_A3B, "/m", OTHER) == LoadedWeights(OTHER, pinned=False)


def test_another_root_is_refused_naming_the_checkpoint_both_roots_and_the_fix():
    with pytest.raises(WeightsMismatch) as refused:
        judge(SMOLLM2_135M, "/home/op/models/smollm2-135m", OTHER)
    message = str(refused.value)
    assert "/home/op/models/smollm2-135m" in message
    assert OTHER in message and SMOLLM2_135M.weights_root in message
    assert "`engy-node checkpoint`" in message
    assert "`engy-node weights commit --checkpoint /home/op/models/smollm2-135m`" in message

    pinned = dataclasses.replace(QWEN36_35B_A3B, weights_root="ef" * 32)
    with pytest.raises(WeightsMismatch, match="download Qwen/Qwen3.6-35B-A3B-FP8 again"):
        judge(pinned, "/ckpt", OTHER)


def test_a_checkpoint_on_disk_is_checked_through_the_cache(tmp_path):
    tiny = write_checkpoint(tmp_path / "tiny", dense_tensors(), config())
    found = check_checkpoint(QWEN36_35B_A3B, tiny, tmp_path / "cache")
    assert not found.pinned
    pinned = dataclasses.replace(QWEN36_35B_A3B, weights_root=found.root)
    assert check_checkpoint(pinned, tiny, tmp_path / "cache") == LoadedWeights(found.root, True)
    with pytest.raises(WeightsMismatch, match=str(tiny)):
        check_checkpoint(dataclasses.replace(pinned, weights_root=OTHER), tiny, tmp_path / "cache")
