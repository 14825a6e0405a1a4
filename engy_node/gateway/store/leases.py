"""Leases: which one of several gateway hosts does a job only one may do at a time (closing and
signing epochs), and for how long it may go on without renewing.

A lease is one row: its name, who holds it and until when. Taking or renewing it is one
conditional upsert — the row is written only when it is new, already ours, or expired — so two
hosts claiming at once cannot both win on either backend (SQLite's write lock; PostgreSQL's lock
on the conflicting row). A holder that dies simply stops renewing, and the lease passes on once
it expires; one that stops cleanly hands it back at once (`release_lease`).

Times are the store clock's (each host's wall clock). Hosts a few seconds apart would shorten or
lengthen a lease by that much, which the lease's length, minutes, absorbs; hosts minutes apart
need NTP before they share a store.
"""

from __future__ import annotations

import math

from engy_node.gateway.store.checks import identifier
from engy_node.gateway.store.connection import Connection, serialised


class Leases(Connection):
    """Leases on the store's database."""

    @serialised
    def claim_lease(self, name: str, *, holder: str, ttl_s: float) -> tuple[str, float]:
        """Take lease `name` for `holder`, or renew it, for `ttl_s` from now, unless someone
        else holds it unexpired. Returns `(holder, expires_at)` as the lease stands afterwards:
        the caller holds it when the first is its own name."""
        identifier("name", name)
        identifier("holder", holder)
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        now = self._clock()
        with self._write() as conn:
            conn.execute(
                "INSERT INTO leases (name, holder, expires_at) VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                "holder = excluded.holder, expires_at = excluded.expires_at "
                "WHERE leases.holder = excluded.holder OR leases.expires_at <= ?",
                (name, holder, now + ttl_s, now),
            )
            row = conn.execute("SELECT holder, expires_at FROM leases WHERE name = ?", (name,)).fetchone()
        return row[0], row[1]

    @serialised
    def release_lease(self, name: str, *, holder: str) -> bool:
        """Hand lease `name` back if `holder` holds it (so another host takes it at once)."""
        with self._write() as conn:
            return conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder)).rowcount == 1

    @serialised
    def lease_holder(self, name: str) -> tuple[str, float] | None:
        """`(holder, expires_at)` of lease `name`, or None when nobody has taken it (expired ones included)."""
        with self._read() as conn:
            row = conn.execute("SELECT holder, expires_at FROM leases WHERE name = ?", (name,)).fetchone()
        return None if row is None else (row[0], row[1])
