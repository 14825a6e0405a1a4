"""The activation commitment (engy_node.gemm.activations): every opening verifies, any change to
its bytes, place or path does not, the root does not depend on how positions were batched into
forward calls, the store keeps records for its window and its bytes, and the sizes the module
states per model follow from the models' shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gemm import activations as ac

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
V2_ROOT = "0b14330c2fff2568ced382950d3955da743270c828b4ee5e5e41216bf9d45660"
"""`pinned_root`'s v2 root, as the first v2 implementation made it."""


@st.composite
def layouts(draw):
    extra = draw(st.lists(st.sampled_from(ac.LLAMA_GROUPS[1:]), max_size=3, unique=True))
    groups = tuple((name, draw(st.integers(1, 5))) for name in ("residual_in", *extra))
    dtype = draw(st.sampled_from(sorted(ac.ITEM_SIZE)))
    return ac.ActivationLayout(draw(st.integers(1, 3)), groups, dtype, draw(st.sampled_from(ac.FORMATS)))


@st.composite
def records(draw):
    """A layout, its per-position rows from the record's start (a cached prefix before it, or
    none), and a record built from them in random chunks."""
    layout = draw(layouts())
    positions = draw(st.integers(1, 6))
    rows = [draw(st.binary(min_size=layout.row_bytes, max_size=layout.row_bytes)) for _ in range(positions)]
    cuts = sorted(draw(st.sets(st.integers(1, positions - 1), max_size=positions - 1))) if positions > 1 else []
    builder = ac.RecordBuilder(layout, start=draw(st.integers(0, 3)))
    for start, end in zip([0, *cuts], [*cuts, positions], strict=True):
        builder.add_rows(end - start, b"".join(rows[start:end]))
    return layout, rows, builder.finish()


def every_pick(layout, record):
    return [(p, layer, group) for p in range(record.start, record.positions) for layer, group in layout.slots()]


@given(records())
def test_every_opening_verifies_and_holds_its_rows_bytes(built):
    layout, rows, record = built
    commitment = ac.Commitment.from_wire(json.loads(json.dumps(record.commitment.to_wire())))
    assert commitment == record.commitment
    for pick, opening in zip(every_pick(layout, record), ac.open_leaves(record, every_pick(layout, record))):
        assert (opening.position, opening.layer, opening.group) == pick
        start, end = layout.offsets()[layout.index(*pick) % layout.leaves_per_position]
        assert opening.data == rows[pick[0] - record.start][start:end]
        wire = opening.to_wire(layout.dtype, layout.width(opening.group))
        assert ac.Opening.from_wire(json.loads(json.dumps(wire))) == opening
        assert ac.verify_opening(commitment, opening)


@given(records(), st.data())
def test_a_flipped_byte_another_place_or_a_bent_path_fails(built, data):
    layout, _, record = built
    commitment = record.commitment
    pick = data.draw(st.sampled_from(every_pick(layout, record)))
    opening = record.open(*pick)
    byte = data.draw(st.integers(0, len(opening.data) - 1))
    flipped = bytearray(opening.data)
    flipped[byte] ^= 1 << data.draw(st.integers(0, 7))
    changed = [
        ac.Opening(opening.position, opening.layer, opening.group, bytes(flipped), opening.path),
        ac.Opening(opening.position + 1, opening.layer, opening.group, opening.data, opening.path),
        ac.Opening(opening.position - 1, opening.layer, opening.group, opening.data, opening.path),
        ac.Opening(opening.position, opening.layer + 1, opening.group, opening.data, opening.path),
        ac.Opening(opening.position, opening.layer, opening.group, opening.data + b"\0", opening.path),
    ]
    names = {name for _, name in layout.slots()} | {name for name, _ in layout.groups}
    others = [name for name in names - {opening.group} if layout.width(name) == layout.width(opening.group)]
    changed += [ac.Opening(opening.position, opening.layer, name, opening.data, opening.path) for name in others]
    if opening.path:
        node = data.draw(st.integers(0, len(opening.path) - 1))
        bent = list(opening.path)
        bent[node] = bytes(32)
        changed.append(ac.Opening(opening.position, opening.layer, opening.group, opening.data, tuple(bent)))
    for forged in changed:
        assert not ac.verify_opening(commitment, forged), forged


@given(records())
def test_the_root_depends_on_the_rows_not_on_how_forward_calls_batched_them(built):
    layout, rows, record = built
    one_call = ac.RecordBuilder(layout, start=record.start)
    one_call.add_rows(len(rows), b"".join(rows))
    assert one_call.finish().tree.root == record.tree.root


def pinned_root(format: str, groups=(("residual_in", 3), ("q", 2), ("k", 1))) -> bytes:
    layout = ac.ActivationLayout(2, groups, "bfloat16", format)
    data = bytes(i % 251 for i in range(3 * layout.row_bytes))
    builder = ac.RecordBuilder(layout, start=1)
    builder.add_rows(1, data[: layout.row_bytes])
    builder.add_rows(2, data[layout.row_bytes :])
    return builder.finish().tree.root


def test_each_format_is_pinned_by_a_known_root():
    """What verifiers check: a change to how leaves or the tree are hashed (a faster capture
    included) must leave these roots as the first implementation of each format made them."""
    v1 = pinned_root("engy-activations-v1", (("residual_in", 3), ("q", 2)))
    assert v1.hex() == "3fa5cbba07eaf9b34a1d5a7c6526aa0078c956c0581c33a78da25a0f334cde3e"
    assert pinned_root("engy-activations-v2").hex() == V2_ROOT


def test_v2_leaves_are_what_the_module_doc_says():
    """The v2 root rebuilt from the module doc's words with hashlib alone: per position each
    layer's residual_in and its gemms (every later group back to back), then the last layer's
    residual_out; a leaf is sha256(0x00 ‖ tag ‖ u32 position ‖ u16 layer ‖ u8-prefixed name ‖
    u8-prefixed dtype ‖ u32 width ‖ bytes), a node sha256(0x01 ‖ left ‖ right), a lone last node
    promoted."""
    import hashlib

    def leaf(position, layer, name, width, data):
        descriptor = layer.to_bytes(2, "big") + bytes([len(name)]) + name.encode() + b"\x08bfloat16"
        head = b"\x00engy-activations-v2\x00" + position.to_bytes(4, "big")
        return hashlib.sha256(head + descriptor + width.to_bytes(4, "big") + data).digest()

    data = bytes(i % 251 for i in range(3 * 30))  # (2 layers × 6 values + 3) × 2 bytes a position
    leaves = []
    for row, position in enumerate((1, 2, 3)):
        values = data[30 * row : 30 * row + 30]
        for layer in (0, 1):
            layer_bytes = values[12 * layer : 12 * layer + 12]
            leaves.append(leaf(position, layer, "residual_in", 3, layer_bytes[:6]))
            leaves.append(leaf(position, layer, "gemms", 3, layer_bytes[6:]))
        leaves.append(leaf(position, 1, "residual_out", 3, values[24:]))
    while len(leaves) > 1:
        paired = [hashlib.sha256(b"\x01" + leaves[i] + leaves[i + 1]).digest() for i in range(0, len(leaves) - 1, 2)]
        leaves = paired + leaves[len(leaves) - len(leaves) % 2 :]
    assert leaves[0].hex() == V2_ROOT == pinned_root("engy-activations-v2").hex()


def test_a_residual_out_is_opened_where_the_next_layer_reads_it():
    layout = ac.ActivationLayout(3, (("residual_in", 2), ("q", 3)), "float32")
    builder = ac.RecordBuilder(layout)
    builder.add_rows(2, np.arange(2 * layout.row_bytes // 4, dtype="<f4").tobytes())
    record = builder.finish()
    middle = record.open(1, 0, ac.RESIDUAL_OUT)
    assert (middle.layer, middle.group) == (1, "residual_in")
    assert ac.verify_opening(record.commitment, middle)
    last = record.open(1, 2, ac.RESIDUAL_OUT)
    assert (last.layer, last.group) == (2, ac.RESIDUAL_OUT) and ac.verify_opening(record.commitment, last)
    # The same bytes claimed as layer 0's residual_out (not where it is committed) do not verify.
    assert not ac.verify_opening(record.commitment, ac.Opening(1, 0, ac.RESIDUAL_OUT, middle.data, middle.path))
    # Position 1 starts at value 17 (3 layers of 2 + 3, then 2); its residual_out closes it.
    np.testing.assert_array_equal(ac.decode_values(layout.dtype, last.data), [32.0, 33.0])


def test_bf16_values_read_exactly():
    layout = ac.ActivationLayout(1, (("residual_in", 3),), "bfloat16")
    values = np.array([1.5, -(2.0**-130), 1.5 * 2.0**127], np.float32)  # each a bf16 value
    raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    np.testing.assert_array_equal(ac.decode_values(layout.dtype, raw), values)


def test_picks_are_checked_before_anything_is_opened():
    assert ac.parse_picks([{"position": 0, "layer": 1, "group": "q"}], 4) == [(0, 1, "q")]
    for picks, message in (
        ([], "non-empty"),
        ([{"position": 0, "layer": 0, "group": "q"}] * 5, "at most 4"),
        ([{"position": True, "layer": 0, "group": "q"}], "integer position"),
        (["q"], "object"),
    ):
        with pytest.raises(ac.CommitmentError, match=message):
            ac.parse_picks(picks, 4)
    layout = ac.ActivationLayout(2, (("residual_in", 2),), "float32")
    builder = ac.RecordBuilder(layout)
    builder.add_rows(1, bytes(layout.row_bytes))
    record = builder.finish()
    with pytest.raises(ac.CommitmentError, match="outside the answer"):
        record.open(1, 0, "residual_in")
    with pytest.raises(ac.CommitmentError, match="no group 'gate'"):
        record.open(0, 0, "gate")
    with pytest.raises(ac.CommitmentError, match="layer 2"):
        record.open(0, 2, "residual_in")


def record_of(positions: int, width: int = 4) -> ac.ActivationRecord:
    builder = ac.RecordBuilder(ac.ActivationLayout(1, (("residual_in", width),), "float32"))
    builder.add_rows(positions, bytes(positions * 2 * width * 4))
    return builder.finish()


@given(st.lists(st.tuples(st.integers(1, 8), st.floats(0, 50)), min_size=1, max_size=12), st.integers(200, 4000))
def test_the_store_keeps_what_fits_its_window_and_bytes_oldest_out_first(arrivals, max_bytes):
    store = ac.OpeningStore(max_bytes=max_bytes, window_s=60.0)
    now, filed = 0.0, []
    for number, (positions, wait) in enumerate(arrivals):
        now += wait
        record = record_of(positions)
        kept = store.put(f"r{number}", record, now)
        assert kept is (record.nbytes <= max_bytes)
        if kept:
            filed.append((f"r{number}", now, record.nbytes))
        assert store.nbytes <= max_bytes
        # What is kept is the newest run of records that fits and is in the window.
        alive = [(rid, at, size) for rid, at, size in filed if now - at <= 60.0]
        expected, total = [], 0
        for rid, _, size in reversed(alive):
            if total + size > max_bytes:
                break
            expected.append(rid)
            total += size
        assert {rid for rid, _, _ in filed if store.get(rid, now) is not None} == set(expected)
        assert store.nbytes == total


def test_the_store_drops_a_record_after_its_window_and_replaces_one_filed_again():
    store = ac.OpeningStore(max_bytes=10**6, window_s=30.0)
    first, second = record_of(2), record_of(3)
    assert store.put("a", first, 0.0)
    assert store.get("a", 30.0) is first
    assert store.put("a", second, 10.0)
    assert store.get("a", 35.0) is second and store.nbytes == second.nbytes
    assert store.get("a", 40.1) is None and len(store) == 0 and store.nbytes == 0


def test_smollm2_keeps_about_half_a_megabyte_per_position():
    config = {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
    }
    layout = ac.llama_layout(config, "bfloat16")
    assert layout.leaves_per_position == 61
    assert layout.row_bytes == 30 * 9024 * 2 + 576 * 2 == 542_592
    assert layout.bytes_per_position() == 542_592 + 61 * 64 == 546_496
    v1 = ac.llama_layout(config, "bfloat16", "engy-activations-v1")
    assert v1.leaves_per_position == 361 and v1.bytes_per_position() == 542_592 + 361 * 64


def test_qwen36_would_keep_about_four_and_a_half_megabytes_per_position():
    """The module doc's estimate, from the checkpoint's config: per layer, the residual, the
    token mixer's input projections and its output projection, the router's logits and the
    shared expert's gate, and the 8 routed plus 1 shared experts a token runs; cut into leaves
    as v2 cuts a layer (its residual, then everything else as one leaf)."""
    text = json.loads((FIXTURES / "qwen3.6-35b-a3b-fp8" / "config.json").read_text())["text_config"]
    hidden, d_ff = text["hidden_size"], text["moe_intermediate_size"]
    experts = text["num_experts_per_tok"] + 1
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    heads, head_dim = text["num_attention_heads"], text["head_dim"]
    mixers = {
        # Gated DeltaNet: in_proj_qkvz, in_proj_ba, out_proj's input.
        "linear_attention": 2 * key_dim + 2 * value_dim + 2 * text["linear_num_value_heads"] + value_dim,
        # Gated attention: q with its gate, k, v, o's input.
        "full_attention": 2 * heads * head_dim + 2 * text["num_key_value_heads"] * head_dim + heads * head_dim,
    }
    common = 4 * hidden + text["num_experts"] + 1 + experts * (3 * d_ff + hidden)
    values = sum(common + mixers[kind] for kind in text["layer_types"]) + hidden
    assert len(text["layer_types"]) == 40
    assert (values - hidden) / 40 == pytest.approx(56_369, abs=1)
    leaves = 2 * len(text["layer_types"]) + 1
    per_position = 2 * values + 64 * leaves
    assert per_position == pytest.approx(4.52e6, rel=0.01)
    assert 32 * 1024**3 // per_position == pytest.approx(7_600, rel=0.01)
    v1_leaves = sum(6 + 4 * experts + (3 if kind == "linear_attention" else 4) for kind in text["layer_types"]) + 1
    assert 2 * values + 64 * v1_leaves == pytest.approx(4.63e6, rel=0.01)


@given(records())
def test_positions_before_a_records_start_are_neither_opened_nor_verified(built):
    layout, _, record = built
    wire = record.commitment.to_wire()
    assert wire.get("start", 0) == record.start
    if record.start:
        with pytest.raises(ac.CommitmentError):
            record.open(record.start - 1, 0, "residual_in")
    with pytest.raises(ac.CommitmentError):
        ac.Commitment.from_wire({**wire, "start": record.positions})
