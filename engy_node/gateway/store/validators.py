"""Validator heartbeats: the latest report from each validator of which engy-node version it
runs, which epoch it has synced and what it sees as consensus, for the operator's view of
whether the validators keep up with the published epochs.

Latest only. One row per validator hotkey, replaced by each newer heartbeat; a heartbeat that
arrives after a newer one from the same validator (two gateway processes, a delayed retry)
leaves the newer one in place, so the row is the latest report whatever order they land in.
The history is the log's, not the store's.

Every field is a hotkey, a short version code, an epoch index, a digest or a time, so a
heartbeat cannot carry free text to the disk.
"""

from __future__ import annotations

import dataclasses

from engy_node.gateway.store.checks import hex_digest, identifier, integer, timestamp, version_text
from engy_node.gateway.store.connection import Connection, serialised

_COLUMNS = ("hotkey", "version", "synced_epoch", "consensus_epoch", "consensus_digest", "received_at")


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorHeartbeat:
    """One validator's report, validated on construction."""

    hotkey: str
    """The validator's ss58 hotkey (an `IDENTIFIER`)."""
    version: str
    """The software it runs, as it says (`checks.VERSION`, e.g. `engy-lv 0.4.4`)."""
    synced_epoch: int | None
    """The newest epoch it has fetched and verified; None before its first."""
    consensus_epoch: int | None
    """The epoch of the consensus it sees on chain; None when it sees none."""
    consensus_digest: str | None
    """That consensus's digest (64 lowercase hex); None when it sees none."""
    received_at: float
    """Unix seconds when the gateway received the heartbeat."""

    def __post_init__(self) -> None:
        identifier("hotkey", self.hotkey)
        version_text("version", self.version)
        if self.synced_epoch is not None:
            integer("synced_epoch", self.synced_epoch)
        if self.consensus_epoch is not None:
            integer("consensus_epoch", self.consensus_epoch)
        if self.consensus_digest is not None:
            hex_digest("consensus_digest", self.consensus_digest)
        timestamp("received_at", self.received_at)


class Validators(Connection):
    """Validator heartbeats on the store's connection."""

    @serialised
    def record_heartbeat(self, hb: ValidatorHeartbeat) -> None:
        """Keep `hb` as its validator's latest heartbeat, unless a later one is stored already."""
        if not isinstance(hb, ValidatorHeartbeat):
            raise TypeError(f"record_heartbeat takes a ValidatorHeartbeat, got {type(hb).__name__}")
        updates = ", ".join(f"{column} = excluded.{column}" for column in _COLUMNS[1:])
        with self._write() as conn:
            conn.execute(
                f"INSERT INTO validator_heartbeats ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                f"ON CONFLICT (hotkey) DO UPDATE SET {updates} WHERE excluded.received_at >= validator_heartbeats.received_at",
                [getattr(hb, column) for column in _COLUMNS],
            )

    @serialised
    def validator_heartbeats(self) -> list[ValidatorHeartbeat]:
        """Each validator's latest heartbeat, by hotkey."""
        with self._read() as conn:
            rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM validator_heartbeats ORDER BY hotkey").fetchall()
        return [ValidatorHeartbeat(*row) for row in rows]
