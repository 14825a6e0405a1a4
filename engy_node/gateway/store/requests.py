"""The request log: one metadata row per request attempt, usage summed from it, the reads that
settle an epoch (`requests_in`) and feed the traffic control loop (`requests_after`), and
retention.

Zero data retention (docs/reliability.md, "Data"). Nothing here accepts prompt or completion text. The request log
is metadata only, and `RequestLogEntry` validates every string field as an identifier or catalog
id, so free text cannot reach the disk through it even by mistake.

Unlike the ledger, the log is not the money's record: it is purged by age
(`purge_request_log`), and lifetime spend comes from the ledger (`Ledger.balance`). Rows are
written after the buyer has the answer, usually in batches by
`engy_node.gateway.request.request_log.RequestLogWriter`; a batch lands whole or not at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

from engy_node.gateway.store.checks import catalog_id, duration, identifier, integer, timestamp
from engy_node.gateway.store.connection import Connection, Session, group_commit, serialised


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLogEntry:
    """One request's metadata. Every field is a number, a closed choice, a catalog id or an
    identifier (validated on construction), so no prompt or completion text fits anywhere."""

    request_id: str
    """The gateway's id for the buyer request (an `IDENTIFIER`)."""
    account_id: int | None
    """The buyer; None for probes, which no buyer pays for."""
    miner: str | None
    """Hotkey or `key:<miner id>` of the miner that served it; None when none was reached."""
    model: str | None
    """Catalog id; None when the request named no catalog model (a 404)."""
    api: Literal["openai", "anthropic"]
    kind: Literal["paid", "probe"]
    status: int
    """HTTP status the buyer got (or would have got, for a probe)."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micro: int
    """Micro-USD charged; 0 for probes."""
    ttft_ms: float | None
    tpot_ms: float | None
    created_at: float
    """Unix seconds when the request arrived."""
    served_greedily: bool = False
    """The buyer asked to sample (temperature > 0) and a miner that answers greedily served it,
    because no miner that honours sampling had room."""
    key_id: int | None = None
    """The API key that sent it (`api_keys.id`); None for probes and rows logged before schema 5."""
    reasoning_tokens: int = 0
    """Of `completion_tokens`, those of the answer's reasoning."""
    finish_reason: str | None = None
    """Why the answer ended (`stop`, `length`, `tool_calls`); None when it did not end whole."""
    total_ms: float | None = None
    """From the request's arrival to its settlement."""
    audited: bool = False
    """The answer was offered to the audit, so a verdict on it is to come."""

    def __post_init__(self) -> None:
        identifier("request_id", self.request_id)
        if self.miner is not None:
            identifier("miner", self.miner)
        if self.model is not None:
            catalog_id("model", self.model)
        if self.api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {self.api!r}")
        if self.kind == "paid":
            integer("account_id", self.account_id, minimum=1)
        elif self.kind == "probe":
            if self.account_id is not None or self.cost_micro != 0:
                raise ValueError("a probe has no account and costs nothing")
        else:
            raise ValueError(f"kind must be 'paid' or 'probe', got {self.kind!r}")
        if integer("status", self.status, minimum=100) > 599:
            raise ValueError(f"status must be an HTTP status code, got {self.status!r}")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_micro"):
            integer(name, getattr(self, name))
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        duration("ttft_ms", self.ttft_ms)
        duration("tpot_ms", self.tpot_ms)
        timestamp("created_at", self.created_at)
        if not isinstance(self.served_greedily, bool):
            raise ValueError(f"served_greedily must be a boolean, got {self.served_greedily!r}")
        if self.key_id is not None:
            integer("key_id", self.key_id, minimum=1)
        integer("reasoning_tokens", self.reasoning_tokens)
        if self.reasoning_tokens > self.completion_tokens:
            raise ValueError(
                f"reasoning_tokens ({self.reasoning_tokens}) exceeds completion_tokens ({self.completion_tokens})"
            )
        if self.finish_reason not in (None, "stop", "length", "tool_calls"):
            raise ValueError(f"finish_reason must be stop, length, tool_calls or None, got {self.finish_reason!r}")
        duration("total_ms", self.total_ms)
        if not isinstance(self.audited, bool):
            raise ValueError(f"audited must be a boolean, got {self.audited!r}")


_COLUMNS = tuple(field.name for field in dataclasses.fields(RequestLogEntry))
COST_COLUMN = _COLUMNS.index("cost_micro")
"""Where `cost_micro` is in a `log_row`."""


def log_row(entry: RequestLogEntry) -> list[Any]:
    """The entry's values in the request log's column order, as `RequestLog._insert_rows` takes them."""
    return [getattr(entry, column) for column in _COLUMNS]


def _entry(row: Sequence[object]) -> RequestLogEntry:
    # SQLite hands the flag back as 0 or 1 (PostgreSQL as a bool); the entry insists on a bool.
    values: dict[str, Any] = dict(zip(_COLUMNS, row, strict=True))
    values["served_greedily"] = bool(values["served_greedily"])
    values["audited"] = bool(values["audited"])
    return RequestLogEntry(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class UsageSummary:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micro: int
    """Micro-USD, summed over the logged requests."""


class RequestLog(Connection):
    """The request log on the store's connection."""

    @group_commit(durable=True)
    def log_request(self, entry: RequestLogEntry) -> None:
        """Append one request's metadata (no content; see `RequestLogEntry`)."""
        self.log_requests([entry])

    @group_commit(durable=True)
    @serialised
    def log_requests(self, entries: Sequence[RequestLogEntry]) -> None:
        """Append several requests' metadata in one transaction: all of them, or none."""
        for entry in entries:
            if not isinstance(entry, RequestLogEntry):
                raise TypeError(f"log_requests takes RequestLogEntry rows, got {type(entry).__name__}")
        with self._write() as conn:
            self._insert_rows(conn, [log_row(entry) for entry in entries])

    @staticmethod
    def _insert_rows(conn: Session, rows: Sequence[Sequence[Any]]) -> None:
        """Append `log_row`s (of entries, so each value has been checked)."""
        conn.executemany(
            f"INSERT INTO request_log ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", rows
        )

    @serialised
    def requests_in(self, *, since: float, until: float) -> list[RequestLogEntry]:
        """The rows created in `[since, until)` (unix seconds), in the order they were logged:
        what an epoch's settlement reads, as far back as the log is retained."""
        timestamp("since", since)
        timestamp("until", until)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM request_log WHERE created_at >= ? AND created_at < ? ORDER BY id",
                (since, until),
            ).fetchall()
        return [_entry(row) for row in rows]

    @serialised
    def requests_after(self, row_id: int, *, limit: int = 1000) -> list[tuple[int, RequestLogEntry]]:
        """At most `limit` rows logged after row `row_id`, oldest first, each with its row id: a
        cursor that a control loop advances to the last id it was given (start at 0)."""
        integer("row_id", row_id)
        integer("limit", limit, minimum=1)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT id, {', '.join(_COLUMNS)} FROM request_log WHERE id > ? ORDER BY id LIMIT ?", (row_id, limit)
            ).fetchall()
        return [(row[0], _entry(row[1:])) for row in rows]

    @serialised
    def last_request_row(self) -> int:
        """The newest row's id (0 for an empty log): where a cursor starts that wants only what
        is logged from now on."""
        with self._read() as conn:
            return conn.execute("SELECT coalesce(max(id), 0) FROM request_log").fetchone()[0]

    @serialised
    def first_request_at(self) -> float | None:
        """When the oldest retained row was logged (None: the log is empty)."""
        with self._read() as conn:
            return conn.execute("SELECT min(created_at) FROM request_log").fetchone()[0]

    @serialised
    def usage(self, account_id: int, *, since: float | None = None) -> UsageSummary:
        """Paid requests of the account logged at or after `since` (unix seconds), as far back
        as the request log is retained (`purge_request_log`); lifetime spend is `balance().charged`."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT count(DISTINCT request_id), coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0), "
                "coalesce(sum(cached_tokens), 0), coalesce(sum(cost_micro), 0) FROM request_log "
                "WHERE account_id = ? AND kind = 'paid' AND created_at >= ?",
                (account_id, -math.inf if since is None else since),
            ).fetchone()
        return UsageSummary(*row)

    @serialised
    def request_rows(self, request_id: str, account_id: int) -> list[RequestLogEntry]:
        """The rows (one per attempt, oldest first) of the account's request `request_id`: a
        buyer's generation lookup, which never sees another account's requests."""
        identifier("request_id", request_id)
        integer("account_id", account_id, minimum=1)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM request_log WHERE request_id = ? AND account_id = ? "
                "AND kind = 'paid' ORDER BY id",
                (request_id, account_id),
            ).fetchall()
        return [_entry(row) for row in rows]

    @serialised
    def account_requests(self, account_id: int, *, since: float, until: float) -> list[RequestLogEntry]:
        """The account's paid rows created in `[since, until)` (unix seconds), in the order they
        were logged: what a buyer's usage report sums (`billing.usage`)."""
        integer("account_id", account_id, minimum=1)
        timestamp("since", since)
        timestamp("until", until)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM request_log WHERE account_id = ? AND kind = 'paid' "
                "AND created_at >= ? AND created_at < ? ORDER BY id",
                (account_id, since, until),
            ).fetchall()
        return [_entry(row) for row in rows]

    @serialised
    def charged_between(self, account_id: int, *, since: float, until: float) -> int:
        """µUSD the ledger charged the account by settlements made in `[since, until)`: the
        figure a usage report's cost is checked against (`billing.usage`). Read here, beside the
        log it is compared with; the ledger itself is `ledger.py`'s."""
        integer("account_id", account_id, minimum=1)
        with self._read() as conn:
            # int(): PostgreSQL sums BIGINTs as NUMERIC, which its driver reads as a Decimal.
            return int(
                conn.execute(
                    "SELECT coalesce(sum(amount), 0) FROM ledger WHERE account_id = ? AND kind = 'settle' "
                    "AND created_at >= ? AND created_at < ?",
                    (account_id, timestamp("since", since), timestamp("until", until)),
                ).fetchone()[0]
            )

    @serialised
    def purge_request_log(self, *, older_than: float) -> int:
        """Delete request-log rows created before `older_than` (unix seconds) and give the freed
        pages back to the filesystem; returns how many rows went. The ledger is never purged.

        The newest row stays even when it is older: SQLite numbers a new row one past the
        highest id in the table, so emptying it would restart ids at 1 and a `requests_after`
        cursor would skip every row until the ids passed it again (PostgreSQL's identity never
        goes back, but one rule for both keeps them alike)."""
        with self._write() as conn:
            deleted = conn.execute(
                "DELETE FROM request_log WHERE created_at < ? AND id < (SELECT max(id) FROM request_log)", (older_than,)
            ).rowcount
        self._db.reclaim_space()
        return deleted
