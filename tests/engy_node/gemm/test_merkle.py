"""The Merkle tree: RFC 6962's shape, every opening verifies, any changed bit does not."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.gemm.merkle import (
    EMPTY_ROOT,
    MerkleBuilder,
    MerkleTree,
    leaf_hash,
    merkle_root,
    node_hash,
    verify,
    verify_all,
)

leaf_lists = st.lists(st.binary(max_size=40), min_size=1, max_size=70).map(lambda data: [leaf_hash(d) for d in data])


def rfc6962_root(leaves: list[bytes]) -> bytes:
    """RFC 6962 §2.1's recursive definition, split at the largest power of two below the size."""
    if len(leaves) == 1:
        return leaves[0]
    split = 1
    while split * 2 < len(leaves):
        split *= 2
    return node_hash(rfc6962_root(leaves[:split]), rfc6962_root(leaves[split:]))


def flip(data: bytes, bit: int) -> bytes:
    bit %= len(data) * 8
    changed = bytearray(data)
    changed[bit // 8] ^= 1 << (bit % 8)
    return bytes(changed)


def test_leaves_and_nodes_hash_in_separate_domains():
    left, right = leaf_hash(b"a"), leaf_hash(b"b")
    assert leaf_hash(b"a") == hashlib.sha256(b"\x00a").digest()
    assert node_hash(left, right) == hashlib.sha256(b"\x01" + left + right).digest()
    # The second-preimage trick: two child hashes presented as one leaf's data.
    assert leaf_hash(left + right) != node_hash(left, right)


def test_the_empty_tree_and_a_single_leaf():
    assert merkle_root([]) == MerkleTree([]).root == EMPTY_ROOT == hashlib.sha256(b"").digest()
    only = leaf_hash(b"x")
    tree = MerkleTree([only])
    assert tree.root == merkle_root([only]) == only
    assert tree.path(0) == [] and verify(only, 0, only, [], 1)


def test_an_odd_last_node_is_promoted_not_duplicated():
    a, b, c = (leaf_hash(x) for x in (b"a", b"b", b"c"))
    assert merkle_root([a, b, c]) == node_hash(node_hash(a, b), c)
    assert merkle_root([a, b, c]) != merkle_root([a, b, c, c])


@given(leaf_lists)
def test_the_root_is_rfc6962s(leaves):
    assert MerkleTree(leaves).root == merkle_root(leaves) == rfc6962_root(leaves)


@given(st.lists(st.binary(max_size=8), max_size=140).map(lambda data: [leaf_hash(d) for d in data]), st.data())
def test_a_tree_built_as_its_leaves_arrive_is_the_same_tree(leaves, data):
    """However the leaves are split into batches (a forward call's positions each), the builder
    ends with `MerkleTree`'s levels, so its root and every path are the same."""
    builder = MerkleBuilder()
    at = 0
    while at < len(leaves):
        step = data.draw(st.integers(1, len(leaves) - at))
        builder.extend(leaves[at : at + step])
        at += step
    assert builder.tree().levels == MerkleTree(leaves).levels


@given(leaf_lists)
def test_every_path_verifies(leaves):
    tree = MerkleTree(leaves)
    for index, leaf in enumerate(leaves):
        assert verify(tree.root, index, leaf, tree.path(index), len(leaves))


@settings(max_examples=300)
@given(leaf_lists, st.data())
def test_any_flipped_bit_fails(leaves, data):
    tree = MerkleTree(leaves)
    index = data.draw(st.integers(0, len(leaves) - 1))
    path = tree.path(index)
    bit = data.draw(st.integers(0, 255))
    assert not verify(tree.root, index, flip(leaves[index], bit), path, len(leaves))
    assert not verify(flip(tree.root, bit), index, leaves[index], path, len(leaves))
    if path:
        at = data.draw(st.integers(0, len(path) - 1))
        changed = [*path[:at], flip(path[at], bit), *path[at + 1 :]]
        assert not verify(tree.root, index, leaves[index], changed, len(leaves))
    other = index ^ (1 << data.draw(st.integers(0, 7)))
    if leaves[other % len(leaves)] != leaves[index]:
        assert not verify(tree.root, other, leaves[index], path, len(leaves))


@given(leaf_lists, st.data())
def test_a_path_with_a_sibling_more_or_less_fails(leaves, data):
    tree = MerkleTree(leaves)
    index = data.draw(st.integers(0, len(leaves) - 1))
    path = tree.path(index)
    assert not verify(tree.root, index, leaves[index], [*path, leaves[index]], len(leaves))
    if path:
        assert not verify(tree.root, index, leaves[index], path[:-1], len(leaves))


def test_the_size_fixes_the_shape():
    """The same leaf and siblings, read as a leaf of a tree of another size, climb another way:
    the size is part of what the verifier must already trust (RFC 9162)."""
    leaves = [leaf_hash(bytes([i])) for i in range(3)]
    tree = MerkleTree(leaves)
    assert verify(tree.root, 2, leaves[2], tree.path(2), 3)
    assert not verify(tree.root, 2, leaves[2], tree.path(2), 4)


def test_openings_outside_the_tree_are_refused():
    leaves = [leaf_hash(bytes([i])) for i in range(5)]
    tree = MerkleTree(leaves)
    with pytest.raises(IndexError, match="outside a tree of 5 leaves"):
        tree.path(5)
    assert not verify(tree.root, 5, leaves[4], tree.path(4), 5)
    assert not verify(tree.root, -1, leaves[0], tree.path(0), 5)
    assert not verify(tree.root, 0, leaves[0][:31], tree.path(0), 5)


@settings(max_examples=200)
@given(leaf_lists, st.data())
def test_verifying_openings_together_is_verifying_each(leaves, data):
    """`verify_all`, which hashes the nodes paths share once, accepts exactly when every opening
    passes `verify` alone: honest openings of any leaves, in any order, and the same with one
    leaf, sibling or index changed, or one path a sibling short or long."""
    tree = MerkleTree(leaves)
    indices = data.draw(st.lists(st.integers(0, len(leaves) - 1), min_size=1, max_size=12, unique=True))
    openings = [(index, leaves[index], tree.path(index)) for index in indices]
    assert verify_all(tree.root, len(leaves), openings)
    at = data.draw(st.integers(0, len(openings) - 1))
    index, leaf, path = openings[at]
    change = data.draw(st.sampled_from(["leaf", "sibling", "index", "longer", "shorter"]))
    if change == "leaf":
        leaf = flip(leaf, data.draw(st.integers(0, 255)))
    elif change == "sibling" and path:
        place = data.draw(st.integers(0, len(path) - 1))
        path = [*path[:place], flip(path[place], data.draw(st.integers(0, 255))), *path[place + 1 :]]
    elif change == "index":
        index = data.draw(st.integers(0, len(leaves) - 1))
    elif change == "longer":
        path = [*path, leaf]
    elif path:
        path = path[:-1]
    changed = [*openings[:at], (index, leaf, path), *openings[at + 1 :]]
    each = all(verify(tree.root, i, node, p, len(leaves)) for i, node, p in changed)
    assert verify_all(tree.root, len(leaves), changed) == each
    assert verify_all(tree.root, len(leaves), changed[::-1]) == each
