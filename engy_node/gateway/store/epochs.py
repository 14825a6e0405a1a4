"""Published epoch results (docs/trust.md, "Epochs"): the exact bytes the gateway served for each closed epoch,
kept so that it serves the same bytes again after a restart and never publishes two different
results for one epoch.

Write once. An epoch's payload was signed and validators may already have put its weights on
chain, so a stored one is never replaced: saving the same bytes again is a no-op (a retry after
a crash, a second gateway process closing the same epoch), and saving other bytes for a stored
epoch is refused with a `StoreError`. The check and the insert are one transaction, serialised
per epoch (SQLite's write lock; on PostgreSQL an advisory lock on the epoch, so two hosts saving
one epoch take turns), and the schema's triggers refuse any update, delete or replacement,
whoever attempts it.

The payload is stored as given, not parsed: `engy_node.protocol.epoch` builds and checks it, and
re-encoding it here could change the bytes its signature covers.
"""

from __future__ import annotations

from engy_node.gateway.store.checks import hex_digest, integer, timestamp
from engy_node.gateway.store.connection import Connection, serialised
from engy_node.gateway.store.schema import StoreError

EPOCH_LOCK_SPACE = 0x45504F43
"""The advisory-lock namespace of `save_epoch`'s per-epoch lock (`Database.serialise_on`)."""


class Epochs(Connection):
    """Published epochs on the store's connection."""

    @serialised
    def save_epoch(self, epoch_index: int, payload: bytes, digest: str, *, closed_at: float) -> bool:
        """Store the published `payload` of epoch `epoch_index` and its `digest` (sha256 of its
        `result_json`, lowercase hex); `closed_at` is unix seconds. True when stored now, False
        when exactly these bytes were stored already. Other bytes for a stored epoch raise
        `StoreError`: a published epoch is never overwritten."""
        integer("epoch_index", epoch_index)
        if not isinstance(payload, bytes):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        hex_digest("digest", digest)
        timestamp("closed_at", closed_at)
        with self._write() as conn:
            # Read first, then insert: the schema refuses any insert over a stored epoch (even
            # one that would do nothing), and the lock keeps the two together.
            self._db.serialise_on(conn, EPOCH_LOCK_SPACE, epoch_index)
            stored = conn.execute("SELECT payload, digest FROM epochs WHERE epoch_index = ?", (epoch_index,)).fetchone()
            if stored is None:
                conn.execute(
                    "INSERT INTO epochs (epoch_index, payload, digest, closed_at) VALUES (?, ?, ?, ?)",
                    (epoch_index, payload, digest, closed_at),
                )
                return True
        if tuple(stored) != (payload, digest):
            raise StoreError(
                f"epoch {epoch_index} was already published with other bytes (digest {stored[1]}) in {self.where}; "
                "a published epoch is never overwritten, so serve the stored one"
            )
        return False

    @serialised
    def epoch_payload(self, epoch_index: int) -> bytes | None:
        """The bytes published for epoch `epoch_index`, or None."""
        with self._read() as conn:
            row = conn.execute("SELECT payload FROM epochs WHERE epoch_index = ?", (epoch_index,)).fetchone()
        return None if row is None else row[0]

    @serialised
    def published_epochs(self, *, limit: int = 20) -> list[tuple[int, bytes, float]]:
        """`(epoch_index, payload, closed_at)` of the latest `limit` epochs, newest first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT epoch_index, payload, closed_at FROM epochs ORDER BY epoch_index DESC LIMIT ?", (limit,)
            ).fetchall()
        return [(index, payload, closed_at) for index, payload, closed_at in rows]

    @serialised
    def latest_epoch(self) -> tuple[int, bytes] | None:
        """`(epoch_index, payload)` of the highest epoch published, or None before the first."""
        with self._read() as conn:
            row = conn.execute("SELECT epoch_index, payload FROM epochs ORDER BY epoch_index DESC LIMIT 1").fetchone()
        return None if row is None else (row[0], row[1])
