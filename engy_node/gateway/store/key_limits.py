"""Keys a team manages and the limits on them: named keys with an expiry and allowed models,
created, listed (masked), rotated and revoked; per-key and per-account-default limits; and the
atomic part of enforcing them (`admit_key`, `close_key`), which the ledger runs inside a hold's
and a closure's own transactions.

Why in the hold's transaction. A limit checked in a statement of its own could be passed by two
requests that both read the last free unit before either wrote; one checked after the hold could
leave money held for a request it refuses. So `Ledger.hold` reserves the balance, then calls
`admit_key`, which reads the key's counters under the row's lock (PostgreSQL `FOR UPDATE`;
SQLite's `BEGIN IMMEDIATE` already holds the file's write lock), asks the pure decision
(`gateway.limits.admit`) and writes its answer, or raises and so rolls the balance hold back.
Every worker and host serialises on that row: 100 requests at once against a limit of 10 admit
exactly 10, and a spend cap counts each hold's worst case before it is granted, so what is
charged never passes it by a µUSD. The lock order is the account row, then the key's row, in
holds and closures alike, so they cannot deadlock.

A key with no limits of its own and none from its account pays for one indexed read per hold
and one indexed delete per closure, and writes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from typing import Any

from engy_node.gateway import limits
from engy_node.gateway.store.checks import integer
from engy_node.gateway.store.connection import Connection, Session, serialised
from engy_node.gateway.store.keys import BUYER_KEY_PREFIX, new_key
from engy_node.gateway.store.schema import StoreError

LIMIT_COLUMNS = ("rpm", "tpm", "concurrent", "daily_micro", "monthly_micro")
COUNTER_COLUMNS = (
    "in_flight",
    "minute",
    "minute_requests",
    "minute_tokens",
    "day",
    "day_micro",
    "month",
    "month_micro",
)


class KeyRefused(Exception):
    """A key that may not make this request: `kind` is the error kind the buyer APIs render
    (`authentication`: revoked or expired, 401; `permission`: a model it may not use, 403;
    `rate_limit`: over a limit, 429, with `refusal` saying which)."""

    def __init__(self, kind: str, message: str, refusal: limits.Refusal | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.refusal = refusal


class KeyRevoked(KeyRefused):
    """A hold was asked for with an API key that has been revoked since it was authenticated."""

    def __init__(self, message: str) -> None:
        super().__init__("authentication", message)


EXPIRED_KEY = (
    "this API key expired at {at}; create a new one with `engy-node gateway key create` (or ask the gateway's operator)"
)
MODEL_NOT_ALLOWED = (
    "this API key may not use {model} (it may use: {allowed}); use one of those, or a key allowed to use "
    "{model} (`engy-node gateway key create --models`)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyInfo:
    """One API key as `key list` shows it: never the key itself, only its masked hint."""

    key_id: int
    account_id: int
    name: str | None
    hint: str | None
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    models: tuple[str, ...] | None
    limits: limits.Limits


class Unchanged:
    """The type of `UNCHANGED`: a field `update_key` leaves as it is (None means never, or all)."""


UNCHANGED = Unchanged()


def _hint(key: str) -> str:
    return f"{key[: len(BUYER_KEY_PREFIX) + 4]}…{key[-4:]}"


def iso_time(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _limits(row: Any) -> limits.Limits:
    return limits.Limits(*row)


class KeyLimits(Connection):
    """Named keys and their limits on the store's connection (`Ledger` builds on it)."""

    # -- keys a team manages ------------------------------------------------------------------

    def _insert_named_key(
        self,
        conn: Session,
        *,
        account_id: int,
        now: float,
        name: str | None = None,
        expires_at: float | None = None,
        models: tuple[str, ...] | None = None,
    ) -> tuple[int, str]:
        key, digest = new_key(BUYER_KEY_PREFIX)
        key_id = conn.execute(
            "INSERT INTO api_keys (account_id, key_sha256, created_at, name, hint, expires_at, models) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (
                account_id,
                digest,
                now,
                name,
                _hint(key),
                expires_at,
                None if models is None else json.dumps(list(models)),
            ),
        ).fetchone()[0]
        return key_id, key

    @serialised
    def create_key(
        self,
        account_id: int,
        *,
        name: str,
        expires_at: float | None = None,
        models: tuple[str, ...] | None = None,
    ) -> tuple[int, str]:
        """A new named key for the account: `(key_id, key)`; the key is shown once."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a key needs a non-empty name, got {name!r}")
        now = self._clock()
        with self._write() as conn:
            self._need_account(conn, account_id)
            return self._insert_named_key(
                conn, account_id=account_id, now=now, name=name, expires_at=expires_at, models=models
            )

    @serialised
    def list_keys(self, account_id: int) -> list[KeyInfo]:
        """The account's keys, revoked ones included, oldest first."""
        with self._snapshot() as conn:
            self._need_account(conn, account_id)
            return self._key_infos(conn, "k.account_id = ?", account_id)

    @staticmethod
    def _key_infos(conn: Session, condition: str, value: int) -> list[KeyInfo]:
        columns = ", ".join(f"l.{c}" for c in LIMIT_COLUMNS)
        rows = conn.execute(
            f"SELECT k.id, k.account_id, k.name, k.hint, k.created_at, k.expires_at, k.revoked_at, k.models, "
            f"{columns} FROM api_keys k LEFT JOIN key_limits l ON l.key_id = k.id WHERE {condition} ORDER BY k.id",
            (value,),
        ).fetchall()
        return [
            KeyInfo(
                key_id=row[0],
                account_id=row[1],
                name=row[2],
                hint=row[3],
                created_at=row[4],
                expires_at=row[5],
                revoked_at=row[6],
                models=None if row[7] is None else tuple(json.loads(row[7])),
                limits=_limits(row[8:]),
            )
            for row in rows
        ]

    @serialised
    def rotate_key(self, key_id: int) -> tuple[int, str]:
        """A new secret for key `key_id`, with its name, expiry, models and limits; the old one is
        revoked in the same transaction. `(new key_id, key)`. The new key takes over what the old
        one used in the current windows, so rotating never resets a spend cap or a rate; what the
        old one's requests in flight did not use is given back to the old key alone."""
        now = self._clock()
        with self._write() as conn:
            row = conn.execute(
                "SELECT account_id, name, expires_at, models FROM api_keys WHERE id = ? AND revoked_at IS NULL",
                (key_id,),
            ).fetchone()
            if row is None:
                raise StoreError(
                    f"no unrevoked API key {key_id} in {self.where}; `engy-node gateway key list` shows them"
                )
            account_id, name, expires_at, models = row
            new_id, key = self._insert_named_key(
                conn,
                account_id=account_id,
                now=now,
                name=name,
                expires_at=expires_at,
                models=None if models is None else tuple(json.loads(models)),
            )
            columns = ", ".join(LIMIT_COLUMNS + COUNTER_COLUMNS[1:])  # all but in_flight
            conn.execute(
                f"INSERT INTO key_limits (key_id, {columns}) SELECT ?, {columns} FROM key_limits WHERE key_id = ?",
                (new_id, key_id),
            )
            conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, key_id))
            return new_id, key

    @serialised
    def update_key(
        self,
        key_id: int,
        *,
        expires_at: float | None | Unchanged = UNCHANGED,
        models: tuple[str, ...] | None | Unchanged = UNCHANGED,
    ) -> KeyInfo:
        """Change an unrevoked key's expiry (None: never) or allowed models (None: all); what is
        not given stays. Returns the key as `list_keys` shows it. Every hold reads both from the
        key's row (`admit_key`), so the change holds from the key's next request on, on every
        worker and host sharing the store."""
        changes: dict[str, object] = {}
        if not isinstance(expires_at, Unchanged):
            changes["expires_at"] = expires_at
        if not isinstance(models, Unchanged):
            if models is not None and (not models or not all(isinstance(m, str) and m for m in models)):
                raise ValueError(f"a key's models are model ids, or None for all; got {models!r}")
            changes["models"] = None if models is None else json.dumps(list(models))
        if not changes:
            raise ValueError("nothing to change: give the expiry, the models, or both")
        with self._write() as conn:
            assignments = ", ".join(f"{column} = ?" for column in changes)  # names from this method only
            updated = conn.execute(
                f"UPDATE api_keys SET {assignments} WHERE id = ? AND revoked_at IS NULL", (*changes.values(), key_id)
            ).rowcount
            if updated != 1:
                raise StoreError(
                    f"no unrevoked API key {key_id} in {self.where}; `engy-node gateway key list` shows them"
                )
            (info,) = self._key_infos(conn, "k.id = ?", key_id)
        return info

    @serialised
    def revoke_key_id(self, key_id: int) -> bool:
        """Revoke key `key_id` (as `revoke_key` does a key by its secret); False when it was
        unknown or already revoked."""
        now = self._clock()
        with self._write() as conn:
            cursor = conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, key_id)
            )
            return cursor.rowcount == 1

    @serialised
    def set_key_limits(self, key_id: int, changes: dict[str, int | None]) -> limits.Limits:
        """Set (an int) or clear (None: the account's default applies) the key's limits named in
        `changes` (`LIMIT_COLUMNS`); returns the key's own limits after."""
        self._check_changes(changes)
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM api_keys WHERE id = ?", (key_id,)).fetchone() is None:
                raise StoreError(f"no API key {key_id} in {self.where}; `engy-node gateway key list` shows them")
            conn.execute("INSERT INTO key_limits (key_id) VALUES (?) ON CONFLICT (key_id) DO NOTHING", (key_id,))
            return self._set(conn, "key_limits", "key_id", key_id, changes)

    @serialised
    def set_account_limits(self, account_id: int, changes: dict[str, int | None]) -> limits.Limits:
        """Set or clear the account's default limits (those its keys leave unset)."""
        self._check_changes(changes)
        with self._write() as conn:
            self._need_account(conn, account_id)
            conn.execute(
                "INSERT INTO account_limits (account_id) VALUES (?) ON CONFLICT (account_id) DO NOTHING", (account_id,)
            )
            return self._set(conn, "account_limits", "account_id", account_id, changes)

    @serialised
    def account_limits(self, account_id: int) -> limits.Limits:
        """The account's default limits (none set: no limits)."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {', '.join(LIMIT_COLUMNS)} FROM account_limits WHERE account_id = ?", (account_id,)
            ).fetchone()
        return limits.Limits() if row is None else _limits(row)

    @staticmethod
    def _check_changes(changes: dict[str, int | None]) -> None:
        for column, value in changes.items():
            if column not in LIMIT_COLUMNS:
                raise ValueError(f"unknown limit {column!r}; the limits are {', '.join(LIMIT_COLUMNS)}")
            if value is not None:
                integer(column, value, minimum=0)

    @staticmethod
    def _set(conn: Session, table: str, id_column: str, row_id: int, changes: dict[str, int | None]) -> limits.Limits:
        for column, value in changes.items():  # names checked against LIMIT_COLUMNS
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE {id_column} = ?", (value, row_id))
        row = conn.execute(f"SELECT {', '.join(LIMIT_COLUMNS)} FROM {table} WHERE {id_column} = ?", (row_id,))
        return _limits(row.fetchone())

    def _need_account(self, conn: Session, account_id: int) -> None:
        if conn.execute("SELECT 1 FROM accounts WHERE id = ?", (account_id,)).fetchone() is None:
            raise StoreError(
                f"no buyer account {account_id} in {self.where}; use the id that creating the buyer printed"
            )

    # -- enforcement, inside the ledger's transactions ----------------------------------------

    def admit_key(
        self, conn: Session, key_id: int, *, hold_id: int, now: float, model: str | None, tokens: int, micro: int
    ) -> limits.RateView | None:
        """Count a hold against key `key_id`'s limits, in the caller's transaction, after its
        balance hold: the rate view for the headers, or None when the key has no limits.

        Raises:
            KeyRefused: the key is revoked, expired, not allowed `model`, or over a limit; the
                caller's transaction must then roll back (the balance hold with it).
        """
        key_columns = ", ".join(f"l.{c}" for c in LIMIT_COLUMNS)
        default_columns = ", ".join(f"d.{c}" for c in LIMIT_COLUMNS)
        row = conn.execute(
            f"SELECT k.revoked_at, k.expires_at, k.models, {key_columns}, {default_columns}, l.key_id FROM api_keys k "
            "LEFT JOIN key_limits l ON l.key_id = k.id LEFT JOIN account_limits d ON d.account_id = k.account_id "
            "WHERE k.id = ?",
            (key_id,),
        ).fetchone()
        if row is None or row[0] is not None:
            raise KeyRevoked(f"API key {key_id} has been revoked")
        expires_at, models = row[1], row[2]
        if expires_at is not None and expires_at <= now:
            raise KeyRefused("authentication", EXPIRED_KEY.format(at=iso_time(expires_at)))
        if models is not None and model is not None:
            allowed = json.loads(models)
            if model not in allowed:
                raise KeyRefused("permission", MODEL_NOT_ALLOWED.format(model=model, allowed=", ".join(allowed)))
        effective = _limits(row[3:8]).over(_limits(row[8:13]))
        if not effective.any:
            return None
        if row[13] is None:  # limited by its account's defaults alone, and never used till now
            conn.execute("INSERT INTO key_limits (key_id) VALUES (?) ON CONFLICT (key_id) DO NOTHING", (key_id,))
        counters = limits.Counters(
            *conn.execute(
                f"SELECT {', '.join(COUNTER_COLUMNS)} FROM key_limits WHERE key_id = ?" + self._db.for_update,
                (key_id,),
            ).fetchone()
        )
        decision = limits.admit(effective, counters, now, tokens=tokens, micro=micro)
        if isinstance(decision, limits.Refusal):
            raise KeyRefused("rate_limit", decision.message, decision)
        self._write_counters(conn, key_id, decision.counters)
        conn.execute(
            "INSERT INTO key_holds (hold_id, key_id, tokens, held_at) VALUES (?, ?, ?, ?)",
            (hold_id, key_id, tokens, now),
        )
        return decision.view

    def close_key(self, conn: Session, hold_id: int, *, released: int, used_tokens: int | None) -> None:
        """Give back to its key what a hold being closed did not use (`released` µUSD, and the
        tokens above `used_tokens`; None: unknown, so none), in the closure's transaction."""
        row = conn.execute("DELETE FROM key_holds WHERE hold_id = ? RETURNING key_id, tokens, held_at", (hold_id,))
        found = row.fetchone()
        if found is None:
            return
        key_id, tokens, held_at = found
        counters = limits.Counters(
            *conn.execute(
                f"SELECT {', '.join(COUNTER_COLUMNS)} FROM key_limits WHERE key_id = ?" + self._db.for_update,
                (key_id,),
            ).fetchone()
        )
        unused_tokens = 0 if used_tokens is None else max(0, tokens - used_tokens)
        after = limits.settle(counters, limits.windows(held_at), unused_tokens=unused_tokens, unused_micro=released)
        self._write_counters(conn, key_id, after)

    @staticmethod
    def _write_counters(conn: Session, key_id: int, counters: limits.Counters) -> None:
        assignments = ", ".join(f"{c} = ?" for c in COUNTER_COLUMNS)
        conn.execute(
            f"UPDATE key_limits SET {assignments} WHERE key_id = ?",
            # Not `dataclasses.astuple`, which deep-copies each field: a third of a limited hold's CPU.
            (*[getattr(counters, column) for column in COUNTER_COLUMNS], key_id),
        )


def expiry_from(text: str, now: float) -> float:
    """An expiry as the CLI takes it: a number of days from `now`, or an ISO 8601 date or time
    (UTC when it names no zone)."""
    try:
        days = float(text)
    except ValueError:
        pass
    else:
        if not (0 < days < math.inf):
            raise ValueError(f"--expires takes a positive number of days or an ISO date, got {text!r}")
        return now + days * limits.DAY_S
    try:
        at = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--expires takes a number of days or an ISO date such as 2027-01-31 or 2027-01-31T12:00Z, got {text!r}"
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return at.timestamp()
