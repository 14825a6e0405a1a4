"""API and miner keys: minted from the OS's randomness, shown once, stored only as their sha256.

A leaked database therefore leaks no usable key. Lookups find the row by the hash of the
presented key (`Ledger.authenticate` says why that needs no constant-time comparison). Each kind
of key has its own prefix, and a key without the expected prefix is refused before any lookup,
so a buyer key never authenticates a miner or the other way round.
"""

from __future__ import annotations

import hashlib
import secrets

from engy_node.protocol.api_keys import BUYER_KEY_PREFIX, MINER_KEY_PREFIX

__all__ = ["BUYER_KEY_PREFIX", "KEY_ENTROPY_BYTES", "MINER_KEY_PREFIX", "new_key", "sha256"]

KEY_ENTROPY_BYTES = 32
"""Random bytes per API or miner key: 256 bits, the security level of the sha256 that stores
it. Guessing is hopeless at any request rate, which is also why a plain sha256 suffices: slow
hashes (bcrypt, argon2) protect low-entropy human passwords from offline guessing, and would
only add ~100 ms of CPU to every request here."""


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key(prefix: str) -> tuple[str, str]:
    """A fresh key and its sha256: `(key, digest)`."""
    key = prefix + secrets.token_urlsafe(KEY_ENTROPY_BYTES)
    return key, sha256(key)
