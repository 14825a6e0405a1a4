"""Activation commitments (``engy-activations-v2``): a Merkle root over what one answer's GEMMs
consumed and produced, so a verifier can later open any of them and check it against the
committed weights (`engy_node.verifier.gemm_check`).

What is committed. For one answer, every position the model computed (the prompt's and each
generated token fed back: prompt + output − 1 positions, the last output token is never fed) ×
every decoder layer × each group below, as the serving side's raw bytes (its dtype, little
endian, no conversion). The groups of a Llama layer are exactly what `gemm_check` needs, each
tensor once:

* ``residual_in``: the residual stream entering the layer (the input norm's input);
* ``attn_in``: the input q, k and v share (their x, bit-equal by construction);
* ``q``, ``k``, ``v``: their outputs;
* ``o_in``, ``o_out``: the o projection's input (attention's output) and output;
* ``mlp_in``: the input gate and up share; ``gate``, ``up``: their outputs;
* ``down_in``, ``down_out``: the down projection's input (silu(gate)·up) and output;
* ``residual_out`` of the LAST layer only: a layer's output is the next layer's input, the very
  same tensor, so ``residual_out`` of layer l < L−1 is committed once, as ``residual_in`` of
  l + 1 (`ActivationLayout.canonical` maps a pick of it there).

A position's values are one row, its columns (`ActivationLayout.columns`) layer by layer in the
order above, the last layer's ``residual_out`` closing it; the captures write rows in that order.

`GEMMS` names each projection's (x, y) groups, the pairs `gemm_check.freivalds` and `row_check`
take; ``residual_in``/``residual_out`` feed `replay_layer`. Attention itself (RoPE, softmax) has
no weights and stays in the trust region; the lm_head's product is judged by TOPLOC's logits.

Why every prompt position: the generated tokens attend to the prompt's keys and values, so a
miner that ran the prompt through a cheaper model and decoded honestly would pass every check on
generated positions; committing the prompt's GEMMs too lets the verifier challenge them. The
cost is memory, linear in positions (sizes below).

Except a cached prefix. A serve that takes the prompt's first positions from its prefix cache
(an agent's next turn, a shared system prompt) did not compute them in this request, and
recomputing them only to commit them would take prompt caching from every buyer. So a
commitment may start at ``start`` (the first position computed, at most the prompt's last):
its leaves are positions start … positions − 1, and the cached ones were committed by the answer
that computed them. The verifier draws only from the committed range; what it gives up — a
prefix computed by a cheaper model in an earlier answer the audit did not draw — is in
docs/verification.md's trust region.

Leaves and order. v2 has three kinds of leaf per position: each layer's ``residual_in``, the
layer's GEMM rows (``gemms``: ``attn_in`` … ``down_out`` back to back, the columns a layer's
projections read and write), and the last layer's ``residual_out``: 2 · layers + 1 leaves, in
column order. A leaf hashes as ``leaf_hash(tag ‖ position ‖ descriptor ‖ raw bytes)``
(`engy_node.gemm.merkle`, RFC 6962): the tag names the format, the position is a u32, and the
descriptor binds the layer (u16), the leaf's name, the dtype and the width (u32),
length-prefixed, so the same bytes at another place or under another name hash differently. The
leaves of a position are hashed as soon as the forward pass that computed it ends, and a
verifier derives a leaf's index and the tree's size from (positions, layout) alone:
`verify_opening` refuses an opening at any other index, so a tree with two candidate values for
one slot cannot be opened at the one that suits.

Why these leaves. A check of one (position, layer) reads all of the layer's groups and the
residual on either side of it (`engy_node.verifier.gemm_audit`), so that is what a leaf holds:
the check opens three leaves (``residual_in``, ``gemms``, and the layer's output: the next
layer's ``residual_in``, or the last layer's ``residual_out``), no more bytes than it reads, and
each residual stays one leaf shared by the layers on either side, so the chain from layer to
layer is still one committed value. ``engy-activations-v1`` had a leaf per group (12 · layers + 1):
the same bytes, six times the hashes. Leaf hashing is the capture's cost (SHA-256's per-call
overhead in Python, and a row under 2 KiB is hashed holding the GIL the engine thread needs): on
SmolLM2 361 leaves and 360 nodes a position became 61 and 60, and a verifier checks 3 openings
per audited layer instead of 13. This node still reads v1 (a miner running an earlier release)
and commits v2.

Sizes (values in bf16, plus 64 bytes of tree per leaf):

* SmolLM2-135M (30 layers, hidden 576, q 576, k/v 192, d_ff 1536): 9,024 values per layer-position,
  542,592 bytes per position (+ 3,904 of tree in v2, 23,104 in v1): about 0.55 MB per position,
  so a 300-position answer keeps 164 MB. The reference server's store defaults to 2 GiB and
  300 s (`capture.py`).
* Qwen3.6-35B-A3B (hidden 2048, 40 layers: 30 Gated DeltaNet and 10 gated-attention; MoE of 256
  routed experts, 8 per token, and 1 shared, d_ff 512): the captured expert GEMMs are those a
  token actually ran — its 8 routed experts and the shared one, each ``gate``/``up``/``down_in``
  (512 wide) and ``down_out`` (2048), sharing one ``mlp_in`` — plus the router's logits (256) and
  the projections into and out of the token mixer (DeltaNet's qkvz/ba and out, attention's gated
  q/k/v and o). About 56,400 values per layer-position, 4.5 MB per position in bf16 with v2's
  tree (81 leaves; v1's 1,811 would add 0.1 MB; tests/engy_node/gemm/test_activations.py derives
  both from the checkpoint's config): one 2,000-position answer is 9.0 GB, so on 4×4090 (host
  memory of order 128 GiB, a store of 32 GiB) the window holds about 7,600 positions — seconds
  of a busy node's traffic, not minutes. The challenge must follow the answer at once, and
  capture cannot be on for every request there.

Pure functions and classes over bytes; `OpeningStore` takes the time from its caller. The
reference server's capture (`engy_node.serve.capture`) feeds `RecordBuilder`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import pybase64

from engy_node.gemm.merkle import HASH_SIZE, LEAF_PREFIX, MerkleBuilder, MerkleTree, leaf_hash, verify, verify_all

FORMAT = "engy-activations-v2"
"""The format this node's servers commit in."""
FORMATS = ("engy-activations-v1", FORMAT)
"""The formats this node reads: v1's leaf per group, v2's leaves per layer (module doc)."""
GEMM_ROWS = "gemms"
"""v2's leaf of a layer's GEMM inputs and outputs: every group after ``residual_in``."""
MAX_LAYERS = 1024
MAX_GROUPS = 64
MAX_WIDTH = 1 << 22
MAX_POSITIONS = 1 << 20
"""Bounds on what a commitment may claim, far above any model's (a million-token context, a
4M-wide group, Qwen3.6's 40-odd groups a layer): a miner writes the commitment, and what the
verifier works out from it — draws over its positions, tables per layout — must not grow
without bound."""
LAYOUTS_CACHED = 64
"""Layouts whose derived tables are kept: a node judges a handful of models."""

ITEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per value of each activation dtype a record may hold."""

LLAMA_GROUPS = (
    "residual_in",
    "attn_in",
    "q",
    "k",
    "v",
    "o_in",
    "o_out",
    "mlp_in",
    "gate",
    "up",
    "down_in",
    "down_out",
)
RESIDUAL_OUT = "residual_out"

GEMMS = {
    "q_proj": ("attn_in", "q"),
    "k_proj": ("attn_in", "k"),
    "v_proj": ("attn_in", "v"),
    "o_proj": ("o_in", "o_out"),
    "gate_proj": ("mlp_in", "gate"),
    "up_proj": ("mlp_in", "up"),
    "down_proj": ("down_in", "down_out"),
}
"""Each projection of a Llama layer: the groups holding the x it consumed and the y it produced."""

TREE_BYTES_PER_LEAF = 2 * HASH_SIZE
"""A tree of n leaves keeps n leaf hashes and fewer than n inner ones."""


class CommitmentError(ValueError):
    """A commitment, pick or opening that does not fit its layout; the message names the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class ActivationLayout:
    """What one position of an answer commits: `layers` × `groups` (name, width), then the last
    layer's ``residual_out`` (as wide as ``residual_in``), each `dtype`, in leaves as `format`
    cuts them (module doc)."""

    layers: int
    groups: tuple[tuple[str, int], ...]
    dtype: str
    format: str = FORMAT

    def __post_init__(self) -> None:
        names = [name for name, _ in self.groups]
        if self.layers < 1 or "residual_in" not in names or len(set(names)) != len(names) or RESIDUAL_OUT in names:
            raise CommitmentError(f"a layout needs ≥ 1 layer and distinct groups with residual_in, got {names}")
        if self.dtype not in ITEM_SIZE:
            raise CommitmentError(f"activation dtype {self.dtype!r} is not one of {sorted(ITEM_SIZE)}")
        if any(width < 1 for _, width in self.groups):
            raise CommitmentError(f"every group needs a positive width, got {self.groups}")
        if self.layers > MAX_LAYERS or len(self.groups) > MAX_GROUPS or any(w > MAX_WIDTH for _, w in self.groups):
            raise CommitmentError(
                f"a layout of at most {MAX_LAYERS} layers and {MAX_GROUPS} groups of at most {MAX_WIDTH} values, "
                f"got {self.layers} layers and {len(self.groups)} groups"
            )
        if self.format not in FORMATS:
            raise CommitmentError(f"activation commitment format {self.format!r}; this node reads {', '.join(FORMATS)}")
        if self.format == FORMAT and (names[0] != "residual_in" or GEMM_ROWS in names):
            raise CommitmentError(
                f"an {FORMAT} layout starts with residual_in and has no group {GEMM_ROWS!r}, got {names}"
            )

    @property
    def tag(self) -> bytes:
        """What every leaf hash starts with: the format's name."""
        return self.format.encode() + b"\0"

    @property
    def leaves_per_position(self) -> int:
        return len(_leaves(self).slots)

    @property
    def item_size(self) -> int:
        return ITEM_SIZE[self.dtype]

    def columns(self) -> list[tuple[int, str]]:
        """Every (layer, group) of one position, in the order of its row's values."""
        return [(layer, name) for layer in range(self.layers) for name, _ in self.groups] + [
            (self.layers - 1, RESIDUAL_OUT)
        ]

    def slots(self) -> list[tuple[int, str]]:
        """Every leaf (layer, name) of one position, in leaf order."""
        return list(_leaves(self).slots)

    def width(self, group: str) -> int:
        """Values in a group, or in a leaf (``gemms``: the layer's groups after ``residual_in``)."""
        name = "residual_in" if group == RESIDUAL_OUT else group
        if name == GEMM_ROWS and self.format == FORMAT and len(self.groups) > 1:
            return sum(width for _, width in self.groups[1:])
        for candidate, width in self.groups:
            if candidate == name:
                return width
        raise CommitmentError(f"no group {group!r}; the layout has {[n for n, _ in self.groups]} and {RESIDUAL_OUT}")

    def canonical(self, layer: int, group: str) -> tuple[int, str]:
        """The leaf (layer, name) holding (layer, group): a ``residual_out`` before the last layer
        is the next layer's ``residual_in``, and in v2 each group after ``residual_in`` is in its
        layer's ``gemms``."""
        self.width(group)
        if not 0 <= layer < self.layers:
            raise CommitmentError(f"layer {layer} is outside 0..{self.layers - 1}")
        if group == RESIDUAL_OUT and layer < self.layers - 1:
            return layer + 1, "residual_in"
        if self.format == FORMAT and group not in ("residual_in", RESIDUAL_OUT):
            return layer, GEMM_ROWS
        return layer, group

    def locate(self, layer: int, group: str) -> tuple[tuple[int, str], int, int]:
        """Where (layer, group)'s values are: its leaf (`canonical`) and their byte range in it."""
        leaf = self.canonical(layer, group)
        leaves = _leaves(self)
        begin, end = leaves.ranges[leaves.offset[leaf]]
        column = leaves.columns.get((leaf[0], "residual_in") if leaf[1] == "residual_in" else (layer, group))
        if column is None:  # a leaf's own name: all of it
            return leaf, 0, end - begin
        return leaf, column[0] - begin, column[1] - begin

    def index(self, position: int, layer: int, group: str) -> int:
        """The leaf index of a leaf (layer, name) at `position` (a group's: `canonical` first)."""
        offset = _leaves(self).offset.get((layer, group))
        if offset is None:
            raise CommitmentError(
                f"no leaf {(layer, group)} in a {self.format} layout; its leaves are {self.slots()[:3]} …"
            )
        return position * self.leaves_per_position + offset

    @property
    def row_bytes(self) -> int:
        """One position's values, every column."""
        return (self.layers * sum(width for _, width in self.groups) + self.width(RESIDUAL_OUT)) * self.item_size

    def offsets(self) -> tuple[tuple[int, int], ...]:
        """Each leaf's byte range within one position's row, in leaf order."""
        return _leaves(self).ranges

    def bytes_per_position(self) -> int:
        """What a record keeps per position: its values and its share of the tree."""
        return self.row_bytes + TREE_BYTES_PER_LEAF * self.leaves_per_position

    def to_wire(self) -> dict[str, Any]:
        return {"layers": self.layers, "groups": [[name, width] for name, width in self.groups], "dtype": self.dtype}


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaves:
    slots: tuple[tuple[int, str], ...]
    ranges: tuple[tuple[int, int], ...]
    """Each leaf's bytes in a position's row."""
    descriptors: tuple[bytes, ...]
    """Each leaf's descriptor (`_descriptor`), which its hash binds after the position."""
    offset: dict[tuple[int, str], int]
    """A leaf's index within its position."""
    columns: dict[tuple[int, str], tuple[int, int]]
    """Each column's (`ActivationLayout.columns`) bytes in the row."""


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _leaves(layout: ActivationLayout) -> _Leaves:
    """How `layout.format` cuts a position's row into leaves, worked out once per layout."""
    columns, start = {}, 0
    for layer, group in layout.columns():
        end = start + layout.width(group) * layout.item_size
        columns[layer, group] = (start, end)
        start = end
    slots: list[tuple[int, str]] = []
    ranges: list[tuple[int, int]] = []
    for (layer, group), (begin, end) in columns.items():
        leaf = layout.canonical(layer, group)
        if slots and slots[-1] == leaf:
            ranges[-1] = (ranges[-1][0], end)
        else:
            slots.append(leaf)
            ranges.append((begin, end))
    descriptors = tuple(_descriptor(layout, *slot) for slot in slots)
    return _Leaves(tuple(slots), tuple(ranges), descriptors, {slot: i for i, slot in enumerate(slots)}, columns)


def llama_layout(config: Mapping[str, Any], dtype: str, format: str = FORMAT) -> ActivationLayout:
    """The layout of a Llama-shaped model (SmolLM2) from its config.json fields."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    d_ff = int(config["intermediate_size"])
    widths = {"q": heads * head_dim, "k": kv, "v": kv, "o_in": heads * head_dim, "gate": d_ff, "up": d_ff}
    widths["down_in"] = d_ff
    groups = tuple((name, widths.get(name, hidden)) for name in LLAMA_GROUPS)
    return ActivationLayout(int(config["num_hidden_layers"]), groups, dtype, format)


def _descriptor(layout: ActivationLayout, layer: int, group: str) -> bytes:
    """The descriptor after the position: layer, leaf name, dtype, width (see the module doc)."""
    name, dtype = group.encode(), layout.dtype.encode()
    return (
        layer.to_bytes(2, "big")
        + len(name).to_bytes(1, "big")
        + name
        + len(dtype).to_bytes(1, "big")
        + dtype
        + layout.width(group).to_bytes(4, "big")
    )


def activation_leaf(layout: ActivationLayout, position: int, layer: int, group: str, data: bytes | memoryview) -> bytes:
    """The leaf hash of one leaf's bytes."""
    leaves = _leaves(layout)
    return leaf_hash(layout.tag, position.to_bytes(4, "big"), leaves.descriptors[leaves.offset[layer, group]], data)


@dataclasses.dataclass(frozen=True, slots=True)
class Commitment:
    """What the answer carries: the root and what it was built over."""

    root: bytes
    layout: ActivationLayout
    positions: int
    start: int = 0
    """The first committed position: those before it came from the serve's prefix cache."""

    @property
    def size(self) -> int:
        return (self.positions - self.start) * self.layout.leaves_per_position

    def leaf_index(self, position: int, layer: int, group: str) -> int:
        """The tree index of a canonical committed (position, layer, group)."""
        return self.layout.index(position, layer, group) - self.start * self.layout.leaves_per_position

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "format": self.layout.format,
            "activations_root": self.root.hex(),
            "positions": self.positions,
            **self.layout.to_wire(),
        }
        if self.start:
            wire["start"] = self.start
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Commitment:
        if wire.get("format") not in FORMATS:
            raise CommitmentError(
                f"activation commitment format {wire.get('format')!r}; this node reads {', '.join(FORMATS)}"
            )
        try:
            root = bytes.fromhex(str(wire["activations_root"]))
            groups = tuple((str(name), int(width)) for name, width in wire["groups"])
            layout = ActivationLayout(int(wire["layers"]), groups, str(wire["dtype"]), str(wire["format"]))
            positions = int(wire["positions"])
            start = int(wire.get("start", 0))
        except (KeyError, TypeError, ValueError) as error:
            raise CommitmentError(f"malformed activation commitment: {error}") from None
        if len(root) != HASH_SIZE or not 0 <= positions <= MAX_POSITIONS:
            raise CommitmentError(
                f"an activation commitment needs a 32-byte root and a count of positions in 0..{MAX_POSITIONS}"
            )
        if not 0 <= start < max(positions, 1):
            raise CommitmentError(f"an activation commitment's start {start} must lie in 0..positions − 1")
        return cls(root, layout, positions, start)


@dataclasses.dataclass(frozen=True, slots=True)
class Opening:
    """One committed row and its Merkle path; the verifier derives its index and the tree's size."""

    position: int
    layer: int
    group: str
    data: bytes
    path: tuple[bytes, ...]

    def to_wire(self, dtype: str, width: int) -> dict[str, Any]:
        """With the values as the server's `encode_array` writes arrays: dtype, shape, base64."""
        return {
            "position": self.position,
            "layer": self.layer,
            "group": self.group,
            "values": {"dtype": dtype, "shape": [width], "data": pybase64.b64encode(self.data).decode()},
            "path": [node.hex() for node in self.path],
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Opening:
        try:
            return cls(
                int(wire["position"]),
                int(wire["layer"]),
                str(wire["group"]),
                pybase64.b64decode(wire["values"]["data"], validate=True),
                tuple(map(bytes.fromhex, wire["path"])),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise CommitmentError(f"malformed opening: {error}") from None


def _placed_leaf(commitment: Commitment, opening: Opening) -> tuple[int, bytes] | None:
    """The leaf index and hash `opening` claims, or None when its slot is not canonical or
    inside the commitment, or its bytes do not fill the group's width."""
    layout = commitment.layout
    leaves = _leaves(layout)
    offset = leaves.offset.get((opening.layer, opening.group))
    if offset is None:
        return None
    begin, end = leaves.ranges[offset]
    if not commitment.start <= opening.position < commitment.positions or len(opening.data) != end - begin:
        return None
    leaf = activation_leaf(layout, opening.position, opening.layer, opening.group, opening.data)
    return (opening.position - commitment.start) * layout.leaves_per_position + offset, leaf


def verify_opening(commitment: Commitment, opening: Opening) -> bool:
    """Whether `opening` is the leaf committed at its (position, layer, name): the leaf is one of
    the format's and inside the commitment, the bytes fill its width, and the path leads from
    their hash at the leaf's own index to the root."""
    placed = _placed_leaf(commitment, opening)
    return placed is not None and verify(commitment.root, *placed, opening.path, commitment.size)


def verify_openings(commitment: Commitment, openings: Iterable[Opening]) -> bool:
    """Whether every opening passes `verify_opening`; the paths' shared nodes are hashed once
    (`merkle.verify_all`)."""
    placed = []
    for opening in openings:
        leaf = _placed_leaf(commitment, opening)
        if leaf is None:
            return False
        placed.append((*leaf, opening.path))
    return verify_all(commitment.root, commitment.size, placed)


def decode_values(dtype: str, data: bytes) -> npt.NDArray[np.float64]:
    """Committed values (raw little-endian bytes of an `ITEM_SIZE` dtype, any number of rows
    back to back) as float64, exactly."""
    if dtype == "bfloat16":
        bits = np.frombuffer(data, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return np.frombuffer(data, "<f2" if dtype == "float16" else "<f4").astype(np.float64)


def group_values(layout: ActivationLayout, opening: Opening, layer: int, group: str) -> npt.NDArray[np.float64]:
    """(layer, group)'s values, as float64, out of the opening of the leaf holding them (a v2
    ``gemms`` holds a layer's every group after ``residual_in``)."""
    leaf, start, end = layout.locate(layer, group)
    if (opening.layer, opening.group) != leaf:
        raise CommitmentError(
            f"layer {layer} {group} is in leaf {leaf}, not the opening's {(opening.layer, opening.group)}"
        )
    return decode_values(layout.dtype, opening.data[start:end])


@dataclasses.dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    rows: int
    data: memoryview
    """rows × `ActivationLayout.row_bytes`: each position's `ActivationLayout.columns` in order."""


class RecordBuilder:
    """One answer's record, built as its forward passes end (prefill chunks, decode steps), from
    position `start` (the first one the serve computed rather than took from its prefix cache)."""

    def __init__(self, layout: ActivationLayout, start: int = 0) -> None:
        self.layout = layout
        self.start = start
        self.positions = start
        self._tree = MerkleBuilder()
        self._chunks: list[_Chunk] = []
        leaves = _leaves(layout)
        self._slices = [
            (descriptor, start, end) for descriptor, (start, end) in zip(leaves.descriptors, leaves.ranges, strict=True)
        ]
        self._prefix = hashlib.sha256(LEAF_PREFIX + layout.tag)
        """`leaf_hash`'s state after the bytes every leaf starts with, copied per leaf."""

    def add_rows(self, rows: int, data: bytes | memoryview) -> None:
        """The next `rows` positions, one after another, each position's columns in order
        (`ActivationLayout.columns`), and hash their leaves (`activation_leaf`'s hashes of the
        `ActivationLayout.offsets` ranges, from a copy of the hash state after the prefix and
        position they share) and the tree's complete pairs above them."""
        view = memoryview(data).cast("B")
        size = self.layout.row_bytes
        if view.nbytes != rows * size:
            raise CommitmentError(f"{view.nbytes} bytes for {rows} positions of {size}")
        leaves = []
        for row in range(rows):
            at_position = self._prefix.copy()
            at_position.update((self.positions + row).to_bytes(4, "big"))
            base = row * size
            for descriptor, start, end in self._slices:
                leaf = at_position.copy()
                leaf.update(descriptor)
                leaf.update(view[base + start : base + end])
                leaves.append(leaf.digest())
        self._tree.extend(leaves)
        self._chunks.append(_Chunk(self.positions, rows, view))
        self.positions += rows

    def finish(self) -> ActivationRecord:
        """The record; only the tree's right edge is left to hash. The builder is spent."""
        return ActivationRecord(self.layout, self.positions, tuple(self._chunks), self._tree.tree(), self.start)


@dataclasses.dataclass(frozen=True, slots=True)
class ActivationRecord:
    """A finished answer's committed rows and tree, kept to answer openings."""

    layout: ActivationLayout
    positions: int
    chunks: tuple[_Chunk, ...]
    tree: MerkleTree
    start: int = 0

    @property
    def commitment(self) -> Commitment:
        return Commitment(self.tree.root, self.layout, self.positions, self.start)

    @property
    def nbytes(self) -> int:
        values = sum(chunk.data.nbytes for chunk in self.chunks)
        return values + HASH_SIZE * sum(len(level) for level in self.tree.levels)

    def open(self, position: int, layer: int, group: str) -> Opening:
        """The opening of the leaf holding (position, layer, group) (`ActivationLayout.canonical`:
        a ``residual_out`` before the last layer is the next layer's ``residual_in``, a v2 group
        after ``residual_in`` its layer's ``gemms``)."""
        layout = self.layout
        layer, group = layout.canonical(layer, group)
        if not self.start <= position < self.positions:
            raise CommitmentError(
                f"position {position} is outside the answer's committed {self.start}..{self.positions - 1}"
            )
        chunk = self.chunks[bisect.bisect_right([c.start for c in self.chunks], position) - 1]
        index = self.commitment.leaf_index(position, layer, group)
        start, end = layout.offsets()[index % layout.leaves_per_position]
        base = (position - chunk.start) * layout.row_bytes
        data = bytes(chunk.data[base + start : base + end])
        return Opening(position, layer, group, data, tuple(self.tree.path(index)))


class OpeningStore:
    """Finished answers' records for the challenge window, by request id: a record leaves after
    `window_s`, or earlier, oldest first, when the records together pass `max_bytes`. The caller
    passes the time (monotonic seconds) and keeps it to one thread."""

    def __init__(self, *, max_bytes: int, window_s: float) -> None:
        self.max_bytes = max_bytes
        self.window_s = window_s
        self._records: collections.OrderedDict[str, tuple[float, ActivationRecord]] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, rid: str, record: ActivationRecord, now: float) -> bool:
        """Keep `record` (replacing one under the same id); False when it alone passes the cap."""
        self._drop(rid)
        if record.nbytes > self.max_bytes:
            self.evict(now)
            return False
        self._records[rid] = (now, record)
        self.nbytes += record.nbytes
        self.evict(now)
        return True

    def get(self, rid: str, now: float) -> ActivationRecord | None:
        self.evict(now)
        kept = self._records.get(rid)
        return None if kept is None else kept[1]

    def evict(self, now: float) -> None:
        while self._records:
            rid, (filed, _) = next(iter(self._records.items()))
            if now - filed <= self.window_s and self.nbytes <= self.max_bytes:
                return
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        kept = self._records.pop(rid, None)
        if kept is not None:
            self.nbytes -= kept[1].nbytes


def parse_picks(picks: object, limit: int) -> list[tuple[int, int, str]]:
    """A challenge's ``[{position, layer, group}, …]`` as tuples; at most `limit` of them."""
    if not isinstance(picks, list) or not picks:
        raise CommitmentError("picks must be a non-empty list of {position, layer, group}")
    if len(picks) > limit:
        raise CommitmentError(f"{len(picks)} picks; ask for at most {limit} per call")
    parsed = []
    for pick in picks:
        if not isinstance(pick, dict):
            raise CommitmentError("each pick must be an object {position, layer, group}")
        position, layer, group = pick.get("position"), pick.get("layer"), pick.get("group")
        if (
            isinstance(position, int)
            and isinstance(layer, int)
            and not isinstance(position, bool)
            and not isinstance(layer, bool)
            and isinstance(group, str)
        ):
            parsed.append((position, layer, group))
        else:
            raise CommitmentError(f"pick {pick!r} needs integer position and layer and a group name")
    return parsed


def open_leaves(record: ActivationRecord, picks: Iterable[tuple[int, int, str]]) -> list[Opening]:
    """The openings of every pick, in order."""
    return [record.open(*pick) for pick in picks]
