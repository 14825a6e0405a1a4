"""Commit a checkpoint directory: read its safetensors shards and hash every row as stored.

The IO shell around `engy_node.gemm.commitment`: it finds the shards (``model.safetensors.index.json``
when the checkpoint has one, else every ``*.safetensors``), reads each tensor's dtype and shape
from the safetensors headers, and hands each tensor's bytes, viewed as raw bytes without any
dtype conversion, to the pure row hashing. safetensors memory-maps the shards and one tensor is
in memory at a time, so it streams a 35B checkpoint's shards as it does the embedded model's one
file. Needs the model stack (safetensors and torch, ``engy-node[model]``): torch is the one
framework safetensors reads bf16 and fp8 tensors into.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from engy_node.errors import ModelError
from engy_node.gemm.commitment import WeightsCommitment, compose, row_leaves
from engy_node.gemm.layout import Matrix, TensorInfo, committed_config, plan_layout, weight_block_rows
from engy_node.gemm.merkle import merkle_root

INDEX = "model.safetensors.index.json"


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelError(f"{directory} has no config.json; point --checkpoint at a model directory")
    config: dict[str, Any] = json.loads(path.read_bytes())
    return config


def tensor_shards(directory: Path) -> dict[str, Path]:
    """Which shard holds each tensor: the index's weight map, or every shard's own names."""
    from safetensors import safe_open

    index = directory / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_bytes()).get("weight_map", {})
        missing = sorted({shard for shard in weight_map.values() if not (directory / shard).is_file()})
        if missing:
            raise ModelError(f"{directory} lacks shards {missing[:4]} that {INDEX} names; download them")
        return {name: directory / shard for name, shard in weight_map.items()}
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"{directory} has no *.safetensors shards; convert the checkpoint first")
    located: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                if name in located:
                    raise ModelError(f"{name} is in both {located[name].name} and {shard.name}; remove the stray shard")
                located[name] = shard
    return located


def _tensor_infos(handles: dict[Path, Any], located: dict[str, Path]) -> dict[str, TensorInfo]:
    infos = {}
    for name, shard in located.items():
        handle = handles[shard]
        try:
            view = handle.get_slice(name)
        except Exception as error:  # safetensors raises its own SafetensorError for a missing name
            raise ModelError(f"{shard.name} has no tensor {name} though {INDEX} says so; re-download it") from error
        infos[name] = TensorInfo(name=name, dtype=view.get_dtype(), shape=tuple(view.get_shape()))
    return infos


def _raw_bytes(handle: Any, name: str) -> memoryview:
    """The tensor's bytes as stored in the shard (little-endian, its own dtype), flat."""
    import torch

    tensor = handle.get_tensor(name).reshape(-1)
    return memoryview(tensor.view(torch.uint8).numpy())


def _rows_root(handles: dict[Path, Any], located: dict[str, Path], matrix: Matrix) -> bytes:
    weight = _raw_bytes(handles[located[matrix.name]], matrix.name)
    scale = None if matrix.scale is None else _raw_bytes(handles[located[matrix.scale.name]], matrix.scale.name)
    return merkle_root(row_leaves(matrix, weight, scale))


def commit_checkpoint(checkpoint_dir: str | Path) -> WeightsCommitment:
    """The weight commitment of a checkpoint directory (engy_node.gemm.commitment)."""
    from safetensors import safe_open

    directory = Path(checkpoint_dir)
    config = read_config(directory)
    located = tensor_shards(directory)
    with contextlib.ExitStack() as stack:
        handles = {
            shard: stack.enter_context(safe_open(shard, framework="pt")) for shard in sorted(set(located.values()))
        }
        layout = plan_layout(_tensor_infos(handles, located), committed_config(config), weight_block_rows(config))
        roots = {matrix.name: _rows_root(handles, located, matrix) for matrix in layout.matrices()}
    return compose(layout, roots)
