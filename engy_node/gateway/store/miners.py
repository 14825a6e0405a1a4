"""Miner registrations: the miners an operator allows to connect with a key, and the lookup that
admits them (`pool.py` asks it for every miner that dials in with a key rather than a hotkey).

Like a buyer key, a miner key is shown once and stored only as its sha256 (`keys.py`). A second
registration of a name or hotkey is refused with a `StoreError` naming the miner that holds it.
"""

from __future__ import annotations

import dataclasses

from engy_node.gateway.store.checks import identifier
from engy_node.gateway.store.connection import Connection, serialised
from engy_node.gateway.store.keys import MINER_KEY_PREFIX, new_key, sha256
from engy_node.gateway.store.schema import StoreError


@dataclasses.dataclass(frozen=True, slots=True)
class MinerRecord:
    miner_id: int
    name: str
    hotkey: str | None
    created_at: float


class Miners(Connection):
    """Miner registrations on the store's connection."""

    @serialised
    def register_miner(self, name: str, *, hotkey: str | None = None) -> tuple[int, str]:
        """Register a miner allowed to connect with a key: `(miner_id, miner_key)`. The key is
        shown once and stored only as its sha256. Names and hotkeys are unique `IDENTIFIER`s
        (a name shows up in logs and the TUI, so it stays short and printable)."""
        identifier("name", name)
        if hotkey is not None:
            identifier("hotkey", hotkey)
        now = self._clock()
        key, digest = new_key(MINER_KEY_PREFIX)
        with self._write() as conn:
            clash = conn.execute("SELECT name FROM miners WHERE name = ? OR hotkey = ?", (name, hotkey)).fetchone()
            if clash is not None:
                raise StoreError(
                    f"miner {clash[0]!r} already has that name or hotkey; choose another name, or keep using its key"
                )
            miner_id = conn.execute(
                "INSERT INTO miners (name, hotkey, key_sha256, created_at) VALUES (?, ?, ?, ?) RETURNING id",
                (name, hotkey, digest, now),
            ).fetchone()[0]
        return miner_id, key

    @serialised
    def authenticate_miner(self, miner_key: str) -> MinerRecord | None:
        """The miner a key was issued to, or None (hash lookup: see `Ledger.authenticate`)."""
        if not isinstance(miner_key, str) or not miner_key.startswith(MINER_KEY_PREFIX):
            return None
        with self._read() as conn:
            row = conn.execute(
                "SELECT id, name, hotkey, created_at FROM miners WHERE key_sha256 = ?", (sha256(miner_key),)
            ).fetchone()
        return None if row is None else MinerRecord(*row)

    @serialised
    def list_miners(self) -> list[MinerRecord]:
        with self._read() as conn:
            return [
                MinerRecord(*row) for row in conn.execute("SELECT id, name, hotkey, created_at FROM miners ORDER BY id")
            ]
