"""Verifier verdicts: one per audited request, the input both the traffic control plane
(`verdicts_after`, a cursor) and epoch settlement (`verdict_counts`, a window) read.

One verdict per request, first one wins. A second verdict for the same request (a re-audit, a
replayed message, a second gateway process hearing the same verifier) changes nothing:
`record_verdict` says whether it agreed with the stored one (`duplicate`) or not (`conflict`),
so the caller can log a disagreement between verifiers instead of silently rewriting history a
control loop may already have acted on. The insert is conditional on the unique request id
(`ON CONFLICT DO NOTHING`), so two processes or hosts recording the same request cannot both
insert.

Zero data retention (docs/reliability.md, "Data"). A verdict carries ids, a catalog model id, closed choices and a
short reason code (`checks.CODE`, no spaces), so no prompt or completion text fits anywhere.

Windows use `request_created_at`, when the request was served, not when it was judged: a
verdict that arrives late still counts toward the epoch that paid for the request.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from engy_node.gateway.store.checks import catalog_id, identifier, integer, short_code, timestamp
from engy_node.gateway.store.connection import Connection, serialised

_COLUMNS = ("request_id", "miner", "model", "kind", "verdict", "reason", "verifier", "request_created_at", "judged_at")


@dataclasses.dataclass(frozen=True, slots=True)
class VerdictRecord:
    """A verifier's verdict on one served request, validated on construction."""

    request_id: str
    """The gateway's id for the request (an `IDENTIFIER`)."""
    miner: str
    """Hotkey or `key:<miner id>` of the miner that served it."""
    model: str
    """Catalog id."""
    kind: Literal["paid", "probe"]
    verdict: Literal["pass", "cheat", "unproven"]
    reason: str
    """Short code saying why (`chunk:exp-mismatch`, `past-eos`; `checks.CODE`)."""
    verifier: str
    """ss58 hotkey of the verifier that judged it, or `protocol.audit.LOCAL_VERIFIER`."""
    request_created_at: float
    """Unix seconds when the request was served; the epoch windows go by this."""
    judged_at: float
    """Unix seconds when the verdict was reached."""

    def __post_init__(self) -> None:
        identifier("request_id", self.request_id)
        identifier("miner", self.miner)
        catalog_id("model", self.model)
        if self.kind not in ("paid", "probe"):
            raise ValueError(f"kind must be 'paid' or 'probe', got {self.kind!r}")
        if self.verdict not in ("pass", "cheat", "unproven"):
            raise ValueError(f"verdict must be 'pass', 'cheat' or 'unproven', got {self.verdict!r}")
        short_code("reason", self.reason)
        identifier("verifier", self.verifier)
        timestamp("request_created_at", self.request_created_at)
        timestamp("judged_at", self.judged_at)


class Verdicts(Connection):
    """Verdicts on the store's connection."""

    @serialised
    def record_verdict(self, record: VerdictRecord) -> Literal["recorded", "duplicate", "conflict"]:
        """Store the verdict on `record.request_id` unless that request already has one:
        `recorded`; or, leaving the stored one as it is, `duplicate` when it has the same miner,
        verdict and reason, `conflict` when it does not."""
        if not isinstance(record, VerdictRecord):
            raise TypeError(f"record_verdict takes a VerdictRecord, got {type(record).__name__}")
        with self._write() as conn:
            inserted = conn.execute(
                f"INSERT INTO verdicts ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                "ON CONFLICT (request_id) DO NOTHING",
                [getattr(record, column) for column in _COLUMNS],
            ).rowcount
            if inserted == 1:
                return "recorded"
            stored = conn.execute(
                "SELECT miner, verdict, reason FROM verdicts WHERE request_id = ?", (record.request_id,)
            ).fetchone()
        return "duplicate" if tuple(stored) == (record.miner, record.verdict, record.reason) else "conflict"

    @serialised
    def verdict(self, request_id: str) -> VerdictRecord | None:
        """The verdict stored for `request_id`, or None."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM verdicts WHERE request_id = ?", (request_id,)
            ).fetchone()
        return None if row is None else VerdictRecord(*row)

    @serialised
    def verdicts_after(self, row_id: int, *, limit: int = 1000) -> list[tuple[int, VerdictRecord]]:
        """At most `limit` verdicts stored after row `row_id`, oldest first, each with its row
        id: a cursor that a control loop advances to the last id it was given (start at 0)."""
        integer("row_id", row_id)
        integer("limit", limit, minimum=1)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT id, {', '.join(_COLUMNS)} FROM verdicts WHERE id > ? ORDER BY id LIMIT ?", (row_id, limit)
            ).fetchall()
        return [(row[0], VerdictRecord(*row[1:])) for row in rows]

    @serialised
    def last_verdict_row(self) -> int:
        """The newest verdict's row id (0 when there is none)."""
        with self._read() as conn:
            return conn.execute("SELECT coalesce(max(id), 0) FROM verdicts").fetchone()[0]

    @serialised
    def verdict_counts(self, *, since: float, until: float) -> dict[str, tuple[int, int, int]]:
        """Per miner, `(passed, cheat, unproven)` over the verdicts on requests served in
        `[since, until)` (unix seconds); a miner with none there is absent."""
        timestamp("since", since)
        timestamp("until", until)
        with self._read() as conn:
            rows = conn.execute(
                "SELECT miner, sum(CASE WHEN verdict = 'pass' THEN 1 ELSE 0 END), "
                "sum(CASE WHEN verdict = 'cheat' THEN 1 ELSE 0 END), sum(CASE WHEN verdict = 'unproven' THEN 1 ELSE 0 END) "
                "FROM verdicts WHERE request_created_at >= ? AND request_created_at < ? GROUP BY miner",
                (since, until),
            ).fetchall()
        return {miner: (passed, cheat, unproven) for miner, passed, cheat, unproven in rows}

    @serialised
    def defect_counts(self, *, since: float, until: float) -> dict[str, int]:
        """Per miner, the passing verdicts on answers whose text the gateway repaired to the
        proven tokens (reason `defect:<kind>`, `proof.Delivery.defect`), over requests served in
        `[since, until)`: a peer's bug to report to its operator, never held against its pay."""
        timestamp("since", since)
        timestamp("until", until)
        with self._read() as conn:
            rows = conn.execute(
                "SELECT miner, count(*) FROM verdicts WHERE verdict = 'pass' AND reason LIKE ? "
                "AND request_created_at >= ? AND request_created_at < ? GROUP BY miner",
                ("%defect:%", since, until),
            ).fetchall()
        return {miner: count for miner, count in rows}
