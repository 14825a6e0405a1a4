"""A binary Merkle tree over leaf hashes: the commitment every GEMM-audit opening is checked against.

The tree is the Merkle Tree Hash of RFC 6962 §2.1 (Certificate Transparency), with sha256:

* a leaf hashes as ``sha256(0x00 || data)`` and an inner node as ``sha256(0x01 || left || right)``,
  so no inner node can be passed off as a leaf (or the reverse): the second-preimage trick of
  presenting two child hashes as leaf data fails on the first byte;
* an odd level is never padded by duplicating its last node (Bitcoin's rule, under which
  ``[a, b, c]`` and ``[a, b, c, c]`` share a root); the lone last node is promoted unchanged to the
  level above. Built bottom-up this gives exactly RFC 6962's recursive split at the largest power
  of two below the size, so the tree's shape depends on nothing but its number of leaves;
* the empty tree's root is ``sha256(b"")``, as in the RFC.

Because the shape depends on the size, `verify` takes the number of leaves (RFC 9162 §2.1.3.2's
audit-path check): a path alone does not say at which levels its node was promoted. Callers know
the size from what they committed to (a matrix's row count, a layer's matrix count).

The tree works on leaf hashes, not leaf data, so a commitment can hash a row of weights once, as
it streams past, and compose roots of smaller trees as the leaves of a larger one (a matrix's
root is a leaf of its layer's tree): an opening from a row to the model's root is then the paths
of each level, one after another. Pure functions over bytes; nothing here reads a file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()
_NODE_STATE = hashlib.sha256(NODE_PREFIX)
"""`node_hash`'s state after its prefix: each node is hashed from a copy of it, a fifth cheaper
than a new hasher per node (a serving thread hashes 360 nodes per position)."""


def leaf_hash(*data: bytes | memoryview) -> bytes:
    """The hash a leaf with this data (its parts concatenated) contributes to its tree."""
    digest = hashlib.sha256(LEAF_PREFIX)
    for part in data:
        digest.update(part)
    return digest.digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """The hash of an inner node over its two children."""
    node = _NODE_STATE.copy()
    node.update(left + right)
    return node.digest()


def _next_level(level: Sequence[bytes]) -> list[bytes]:
    paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
    if len(level) % 2:
        paired.append(level[-1])
    return paired


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """The root over these leaf hashes, keeping one level at a time."""
    if not leaves:
        return EMPTY_ROOT
    level = list(leaves)
    while len(level) > 1:
        level = _next_level(level)
    return level[0]


class MerkleTree:
    """Every level of the tree over `leaves` (leaf hashes), kept so any leaf can be opened."""

    def __init__(self, leaves: Sequence[bytes]) -> None:
        self.levels: list[list[bytes]] = [list(leaves)]
        while len(self.levels[-1]) > 1:
            self.levels.append(_next_level(self.levels[-1]))

    @classmethod
    def from_levels(cls, levels: list[list[bytes]]) -> MerkleTree:
        """The tree whose levels (`MerkleBuilder.tree`'s) are already hashed."""
        tree = cls.__new__(cls)
        tree.levels = levels
        return tree

    @property
    def size(self) -> int:
        return len(self.levels[0])

    @property
    def root(self) -> bytes:
        return self.levels[-1][0] if self.size else EMPTY_ROOT

    def path(self, index: int) -> list[bytes]:
        """The opening of leaf `index`: its siblings from the bottom up, skipping the levels where
        its node is the lone last one and is promoted."""
        if not 0 <= index < self.size:
            raise IndexError(f"leaf {index} is outside a tree of {self.size} leaves")
        siblings = []
        for level in self.levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):
                siblings.append(level[sibling])
            index //= 2
        return siblings


class MerkleBuilder:
    """The same tree as `MerkleTree`, built while its leaves arrive: each level's complete pairs
    are hashed as soon as both children exist, so what `tree` has left to hash at the end is the
    right edge (a node per level), not the whole tree. A lone last node is promoted only then,
    when no later leaf can pair with it, which is why the levels match `MerkleTree`'s exactly."""

    def __init__(self) -> None:
        self._levels: list[list[bytes]] = [[]]

    def extend(self, leaves: Sequence[bytes]) -> None:
        self._levels[0].extend(leaves)
        self._pair_up(0)

    def _pair_up(self, level: int) -> None:
        """Hash every complete pair of `level` not yet hashed, and the levels above in turn."""
        levels = self._levels
        while len(levels[level]) >= 2:
            below = levels[level]
            if level + 1 == len(levels):
                levels.append([])
            above = levels[level + 1]
            done = 2 * len(above)
            if done + 2 > len(below):
                return
            above.extend(node_hash(below[i], below[i + 1]) for i in range(done, len(below) - 1, 2))
            level += 1

    def tree(self) -> MerkleTree:
        """The finished tree; the builder takes no leaves after it."""
        levels = self._levels
        level = 0
        while len(levels[level]) > 1:
            self._pair_up(level)
            if len(levels[level]) % 2:
                levels[level + 1].append(levels[level][-1])
            level += 1
        del levels[level + 1 :]
        return MerkleTree.from_levels(levels)


def verify(root: bytes, index: int, leaf: bytes, path: Sequence[bytes], size: int) -> bool:
    """Whether `path` opens leaf hash `leaf` at `index` of a tree of `size` leaves with this `root`
    (RFC 9162 §2.1.3.2)."""
    return verify_all(root, size, [(index, leaf, path)])


def verify_all(root: bytes, size: int, openings: Iterable[tuple[int, bytes, Sequence[bytes]]]) -> bool:
    """Whether every (index, leaf, path) opens `root` of a tree of `size` leaves (`verify`), each
    inner node hashed once. Openings of nearby leaves (a layer's groups are adjacent leaves) meet
    below the root; where a path reaches a node an earlier one verified, with the same hash, it
    verifies exactly when its remaining siblings are the ones that path went on with: with them
    it would compute the same hashes to the same root, and with any others reach `root` only
    through a sha256 collision. So the part above the meeting point is compared, not hashed."""
    known: dict[tuple[int, int], tuple[bytes, tuple[bytes, ...], int]] = {}
    for index, leaf, siblings in openings:
        path = tuple(siblings)
        if not 0 <= index < size or len(leaf) != HASH_SIZE or not set(map(len, path)) <= {HASH_SIZE}:
            return False
        node, last, level = index, size - 1, 0
        current = leaf
        trail = []
        for step, sibling in enumerate(path):
            seen = known.get((level, node))
            if seen is not None and seen[0] == current:
                if path[step:] != seen[1][seen[2] :]:
                    return False
                break
            trail.append(((level, node), current, step))
            if last == 0:
                return False
            if node % 2 == 1 or node == last:
                current = node_hash(sibling, current)
                while node % 2 == 0 and node != 0:
                    node //= 2
                    last //= 2
                    level += 1
            else:
                current = node_hash(current, sibling)
            node //= 2
            last //= 2
            level += 1
        else:
            if last != 0 or current != root:
                return False
        for place, value, step in trail:
            known[place] = (value, path, step)
    return True
