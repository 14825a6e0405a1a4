"""Weight commitments: Merkle roots that bind a checkpoint's own bytes, one leaf per matrix row.

A sampled GEMM audit (Freivalds, docs/verification.md) challenges single rows of a weight matrix:
the served output ``y_i = W_i · x`` of a row, or ``rᵀW`` precomputed from rows. So the leaf is a
row — the last dimension of the tensor as stored (dtype as stored, no conversion) — and opening
one costs a row of bytes plus ``log2(rows)`` hashes. A block-FP8 row's leaf also carries the row of
``weight_scale_inv`` that dequantizes it (one f32 per 128×128 tile), so the weight and its scales
are bound together as the public SN53 spec binds them, yet a single row still opens alone.

The tree, bottom up (every node hashed as in `engy_node.gemm.merkle`; a lower root is a leaf hash
of the tree above, so an opening from a row to the top is each level's path in turn):

* a matrix's root is ``node(leaf(descriptor), rows_root)``: the descriptor, canonical JSON of
  the tensor's name, stored dtype and shape (and its scale's), says what the rows are, so the
  same bytes under another name, dtype or shape commit differently;
* an expert's root is the tree over its matrices' roots in name order;
* a layer's root is the tree over its own matrices' roots in name order, then its routed
  experts' roots by index;
* ``lm_root`` is the tree over the roots of every matrix outside the decoder layers;
* ``weights_root`` is the tree over ``leaf(canonical config JSON)``, the layer roots in order,
  then ``lm_root``.

NAMING: the public SN53 spec calls its top root ``model_root``. Ours is ``weights_root``, because
the wire protocol already has a ``model_root`` (`engy_node.models.model_root`: config.json and
shard sizes, announced in every miner hello) which must not change. Our roots cannot reproduce the
public Qwen3.6 ``model_root`` either: that spec publishes the tree's shape (config, layer roots,
per-expert roots, the block-FP8 leaf binding ``weight`` + ``weight_scale_inv``) but not its leaf
hashing (what a leaf covers, byte order, domain separation), so this format is our own, named
``engy-weights-v1`` in every spec file.

Pure functions over bytes and `engy_node.gemm.layout`'s plain data; `engy_node.gemm.checkpoint`
feeds it a checkpoint's tensors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from engy_node.errors import ModelError
from engy_node.gemm.layout import Layout, Matrix
from engy_node.gemm.merkle import leaf_hash, merkle_root, node_hash

FORMAT = "engy-weights-v1"
"""The leaf hashing and tree shape described above; a spec file in another format is refused."""


def canonical_json(value: object) -> bytes:
    """Sorted keys, no spaces: one byte string per value, whoever writes it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def descriptor(matrix: Matrix) -> bytes:
    """What the matrix's rows are: name, stored dtype and shape, and its block-FP8 scale's."""
    scale = matrix.scale
    return canonical_json(
        {
            "name": matrix.name,
            "dtype": matrix.weight.dtype,
            "shape": list(matrix.weight.shape),
            "scale": None
            if scale is None
            else {
                "name": scale.name,
                "dtype": scale.dtype,
                "shape": list(scale.shape),
                "block_rows": matrix.block_rows,
            },
        }
    )


def _row_size(name: str, data: memoryview, rows: int) -> int:
    if rows == 0:
        if len(data):
            raise ModelError(f"{name} has no rows but {len(data)} bytes; the checkpoint's header is corrupt")
        return 0
    if len(data) % rows:
        raise ModelError(
            f"{name}'s {len(data)} bytes do not split into {rows} rows; the checkpoint's header is corrupt"
        )
    return len(data) // rows


def row_leaves(matrix: Matrix, weight: memoryview, scale: memoryview | None = None) -> list[bytes]:
    """One leaf hash per row of the matrix's stored bytes (`weight`, flat), each with the scale row
    that dequantizes it when the matrix has block-FP8 scales (`scale`, flat)."""
    rows = matrix.weight.rows
    size = _row_size(matrix.name, weight, rows)
    if matrix.scale is None:
        return [leaf_hash(weight[i * size : (i + 1) * size]) for i in range(rows)]
    if scale is None:
        raise ValueError(f"{matrix.name} is block-FP8: pass its scale bytes")
    scale_size = _row_size(matrix.scale.name, scale, matrix.scale.rows)
    block = matrix.block_rows
    return [
        leaf_hash(weight[i * size : (i + 1) * size], scale[(i // block) * scale_size : (i // block + 1) * scale_size])
        for i in range(rows)
    ]


def matrix_root(matrix: Matrix, rows_root: bytes) -> bytes:
    """The matrix's root: its descriptor beside the tree over its row leaves."""
    return node_hash(leaf_hash(descriptor(matrix)), rows_root)


@dataclasses.dataclass(frozen=True, slots=True)
class WeightsCommitment:
    """Every root of a checkpoint's weight commitment, with the layout they were built over."""

    layout: Layout
    rows_roots: dict[str, bytes]
    """The root of each matrix's row tree, by its weight tensor's name."""
    matrix_roots: dict[str, bytes]
    """Each matrix's root (its descriptor beside its row tree), by its weight tensor's name."""
    expert_roots: tuple[tuple[bytes, ...], ...]
    """Per layer, its routed experts' roots by index (empty for a dense layer)."""
    layer_roots: tuple[bytes, ...]
    lm_root: bytes
    weights_root: bytes


def compose(layout: Layout, rows_roots: Mapping[str, bytes]) -> WeightsCommitment:
    """The matrix, expert, layer, lm and weights roots over these matrices' row-tree roots (see
    the module doc)."""
    matrices = layout.matrices()
    missing = [m.name for m in matrices if m.name not in rows_roots]
    if missing:
        raise ValueError(f"no row-tree root for {len(missing)} matrices, {missing[0]} first")
    matrix_roots = {m.name: matrix_root(m, rows_roots[m.name]) for m in matrices}
    expert_roots = tuple(
        tuple(merkle_root([matrix_roots[m.name] for m in expert]) for expert in layer.experts)
        for layer in layout.layers
    )
    layer_roots = tuple(
        merkle_root([*(matrix_roots[m.name] for m in layer.matrices), *experts])
        for layer, experts in zip(layout.layers, expert_roots, strict=True)
    )
    lm_root = merkle_root([matrix_roots[m.name] for m in layout.lm])
    weights_root = merkle_root([leaf_hash(canonical_json(layout.config)), *layer_roots, lm_root])
    return WeightsCommitment(
        layout=layout,
        rows_roots={m.name: rows_roots[m.name] for m in matrices},
        matrix_roots=matrix_roots,
        expert_roots=expert_roots,
        layer_roots=layer_roots,
        lm_root=lm_root,
        weights_root=weights_root,
    )
