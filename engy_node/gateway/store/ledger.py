"""Buyer accounts, their API keys and their money: credit, hold, settle, release, recovery of
holds a crash left open, balances and a check that the books agree.

Posture. Never double-charge, never lose a charge, never let concurrent requests spend money a
buyer does not have. A hold's balance check and reservation are one conditional UPDATE in one
transaction. Every hold is closed at most once, by exactly one `settle` and one
`release` row whose amounts sum to the hold; a unique index makes a second closure impossible,
so a retried settle after a crash is a no-op rather than a second charge. Ledger rows are
append-only (the schema's triggers refuse anything else), and each account's cached balance
moves in the same transaction as the rows that explain it.

Where ambiguity remains, it resolves toward the buyer: refunding an orphaned hold costs the
operator cents; charging it could cost a buyer dollars for an answer they never received. Holds
left open by a crash are therefore released in full by `recover_open_holds`, and a cost above its
hold is clamped to the hold (and logged: it means the worst case was mis-computed upstream).

Trust. The ledger trusts its own rows, not the objects callers hand back: `settle` re-reads the
hold from the ledger. Amounts are integer micro-USD; `billing.py` decides them. Unknown accounts
raise `StoreError`; gateway bugs (negative amounts, a hold that is not in this ledger) raise
`ValueError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Collection
from typing import Any

from engy_node.gateway.limits import RateView
from engy_node.gateway.store.checks import identifier, integer
from engy_node.gateway.store.connection import Cursor, Session, group_commit, serialised
from engy_node.gateway.store.key_limits import EXPIRED_KEY, KeyLimits, KeyRefused, KeyRevoked, iso_time
from engy_node.gateway.store.keys import BUYER_KEY_PREFIX, sha256
from engy_node.gateway.store.schema import StoreError

log = logging.getLogger("engy.gateway.store")

RECOVERED_IDS_LOGGED = 10
"""Request ids named in the recovery log line: enough to look a few up in the request log, few
enough that a crash under heavy load still logs one readable line (the full list is returned)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Account:
    account_id: int
    name: str
    key_id: int
    """The API key it was authenticated by (`api_keys.id`): a hold made with it checks that the
    key is still unrevoked (`Ledger.hold`)."""
    models: tuple[str, ...] | None = None
    """The models the key may use (None: any), so a request's fallbacks skip the others
    (`routing.fallbacks.pick_model`); the hold enforces them (`store.key_limits`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Balance:
    """Micro-USD. Always `credited == charged + available + held`."""

    available: int
    """What new holds can reserve."""
    held: int
    """Reserved by requests in flight."""
    credited: int
    """Everything ever credited."""
    charged: int
    """Everything ever charged."""


@dataclasses.dataclass(frozen=True, slots=True)
class AccountSummary:
    """One buyer account as the dashboards show it: who, and its money (micro-USD). No key."""

    account_id: int
    name: str
    available: int
    held: int
    charged: int


@dataclasses.dataclass(frozen=True, slots=True)
class Hold:
    """A reservation on an account's balance; `hold_id` is the ledger row that made it."""

    hold_id: int
    account_id: int
    amount: int
    request_id: str
    created_at: float
    rate: RateView | None = None
    """The key's limits as this hold left them (None: it has none), for the rate-limit headers."""


@dataclasses.dataclass(frozen=True, slots=True)
class Settlement:
    """How a hold was closed: `charged + released == hold.amount`."""

    hold_id: int
    charged: int
    released: int
    applied: bool
    """False when the hold was already closed: this call changed nothing, and `charged` and
    `released` report the earlier closure."""


class Ledger(KeyLimits):
    """Accounts, keys and money on the store's connection."""

    # -- accounts and keys --------------------------------------------------------------------

    @serialised
    def create_buyer(self, name: str) -> tuple[int, str]:
        """A new account with no balance and its first API key: `(account_id, api_key)`.

        The key is returned once and stored only as its sha256; it cannot be shown again.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a buyer needs a non-empty name, got {name!r}")
        now = self._clock()
        with self._write() as conn:
            account_id = conn.execute(
                "INSERT INTO accounts (name, created_at) VALUES (?, ?) RETURNING id", (name, now)
            ).fetchone()[0]
            return account_id, self._insert_key(conn, account_id=account_id, now=now)

    @serialised
    def issue_key(self, account_id: int) -> str:
        """Another API key for an existing account (key rotation); shown once, stored hashed."""
        now = self._clock()
        with self._write() as conn:
            self._require_account(conn, account_id)
            return self._insert_key(conn, account_id=account_id, now=now)

    def _insert_key(self, conn: Session, *, account_id: int, now: float) -> str:
        return self._insert_named_key(conn, account_id=account_id, now=now)[1]

    @group_commit(durable=True)
    @serialised
    def authenticate(self, api_key: str) -> Account | None:
        """The account an unrevoked API key belongs to, or None.

        No constant-time comparison: the lookup is by the sha256 of the presented key, so
        whatever its timing leaks is about hashes of the attacker's own guesses, and learning
        how close a hash came to a stored one does not help find a key that hashes to it.
        """
        if not isinstance(api_key, str) or not api_key.startswith(BUYER_KEY_PREFIX):
            return None
        with self._read() as conn:
            row = conn.execute(
                "SELECT a.id, a.name, k.id, k.expires_at, k.models FROM api_keys k JOIN accounts a ON a.id = k.account_id "
                "WHERE k.key_sha256 = ? AND k.revoked_at IS NULL",
                (sha256(api_key),),
            ).fetchone()
        if row is not None and row[3] is not None and row[3] <= self._clock():
            raise KeyRefused("authentication", EXPIRED_KEY.format(at=iso_time(row[3])))
        if row is None:
            return None
        models = None if row[4] is None else tuple(json.loads(row[4]))
        return Account(account_id=row[0], name=row[1], key_id=row[2], models=models)

    @serialised
    def revoke_key(self, api_key: str) -> bool:
        """Stop accepting `api_key`: `authenticate` no longer finds it, and a hold made with it
        (`hold`'s `key_id`) is refused, in every process and host on this database from the
        next one on. False when it was unknown or already revoked."""
        now = self._clock()
        with self._write() as conn:
            cursor = conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE key_sha256 = ? AND revoked_at IS NULL", (now, sha256(api_key))
            )
            return cursor.rowcount == 1

    @staticmethod
    def _key_revoked(conn: Session, key_id: int) -> bool:
        row = conn.execute("SELECT revoked_at FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return row is None or row[0] is not None

    def _require_account(self, conn: Session, account_id: int) -> None:
        if conn.execute("SELECT 1 FROM accounts WHERE id = ?", (account_id,)).fetchone() is None:
            raise StoreError(
                f"no buyer account {account_id} in {self.where}; use the id that creating the buyer printed"
            )

    # -- money --------------------------------------------------------------------------------

    @serialised
    def credit(self, account_id: int, *, micro_usd: int, memo: str = "") -> int:
        """Add `micro_usd` (> 0) to the account; returns the available balance after it."""
        integer("micro_usd", micro_usd, minimum=1)
        now = self._clock()
        with self._write() as conn:
            row = conn.execute(
                "UPDATE accounts SET available = available + ?, credited = credited + ? WHERE id = ? RETURNING available",
                (micro_usd, micro_usd, account_id),
            ).fetchone()
            if row is None:
                self._require_account(conn, account_id)
            available = row[0]
            conn.execute(
                "INSERT INTO ledger (account_id, kind, amount, memo, available_after, created_at) VALUES (?, 'credit', ?, ?, ?, ?)",
                (account_id, micro_usd, memo, available, now),
            )
            return available

    @group_commit(durable=False)
    @serialised
    def hold(
        self,
        account_id: int,
        *,
        amount: int,
        request_id: str,
        key_id: int | None = None,
        model: str | None = None,
        tokens: int = 0,
    ) -> Hold | None:
        """Reserve `amount` for `request_id`, or None when the available balance cannot cover it
        (the caller answers 402).

        Atomic: the balance check and the reservation are one conditional UPDATE, which both
        databases apply to the row as it stands when the statement runs (SQLite under
        `BEGIN IMMEDIATE`'s write lock, PostgreSQL under the row's lock), so concurrent holds,
        from any thread, process or host, can never together reserve more than the balance.
        `request_id` may hold only once.

        With `key_id` (the `Account.key_id` the request was authenticated by), the same UPDATE
        also requires that key to be unrevoked, and a revoked one raises `KeyRevoked`: every
        paid request checks its key against the shared database at no cost of its own (no
        extra statement or round trip), however long its gateway process caches the key.

        The key's limits (`key_limits.py`) are counted in the same transaction: this hold's
        `amount` against its spend caps, `tokens` (prompt + max_tokens) against its tokens per
        minute, `model` against the models it may use; `Hold.rate` is what its headers report.

        Raises:
            KeyRevoked: `key_id` names a key that has been revoked.
            KeyRefused: the key is expired, may not use `model`, or is over a limit (nothing held).
        """
        integer("amount", amount)
        identifier("request_id", request_id)
        now = self._clock()
        try:
            with self._write(durable=False, pipelined=True) as conn:
                if key_id is None:
                    row = conn.execute(
                        "UPDATE accounts SET available = available - ?, held = held + ? "
                        "WHERE id = ? AND available >= ? RETURNING available",
                        (amount, amount, account_id, amount),
                    ).fetchone()
                else:
                    row = conn.execute(
                        "UPDATE accounts SET available = available - ?, held = held + ? "
                        "WHERE id = ? AND available >= ? "
                        "AND EXISTS (SELECT 1 FROM api_keys WHERE id = ? AND revoked_at IS NULL) RETURNING available",
                        (amount, amount, account_id, amount, key_id),
                    ).fetchone()
                if row is None:
                    self._require_account(conn, account_id)
                    if key_id is not None and self._key_revoked(conn, key_id):
                        raise KeyRevoked(f"API key {key_id} has been revoked")
                    return None
                # A second hold for the request fails on the one-hold-per-request index, which
                # rolls the reservation above back with it.
                hold_id = conn.execute(
                    "INSERT INTO ledger (account_id, kind, amount, request_id, available_after, created_at) "
                    "VALUES (?, 'hold', ?, ?, ?, ?) RETURNING id",
                    (account_id, amount, request_id, row[0], now),
                ).fetchone()[0]
                rate = None
                if key_id is not None:
                    rate = self.admit_key(
                        conn, key_id, hold_id=hold_id, now=now, model=model, tokens=tokens, micro=amount
                    )
        except self._db.errors as error:
            if self._db.is_unique_violation(error):
                raise ValueError(f"request {request_id} already has a hold; request ids must be unique") from None
            raise
        return Hold(
            hold_id=hold_id, account_id=account_id, amount=amount, request_id=request_id, created_at=now, rate=rate
        )

    @group_commit(durable=True)
    @serialised
    def settle(self, hold: Hold, *, cost: int) -> Settlement:
        """Charge `min(cost, hold.amount)` and release the rest of the hold.

        Idempotent per hold: if the hold is already closed (settled, released, or recovered
        after a crash) nothing changes and the earlier closure is reported with
        `applied=False`, so a retry never charges twice. A cost above the hold is clamped to it
        and logged as a bug upstream: the buyer agreed to the hold, not to more.
        """
        integer("cost", cost)
        return self._close(hold, cost=cost, durable=True)

    @group_commit(durable=False)
    @serialised
    def release(self, hold: Hold) -> Settlement:
        """Return the whole hold to the available balance (the request failed or was never
        served). Idempotent exactly like `settle`."""
        return self._close(hold, cost=0, durable=False, used_tokens=0)

    def _close(self, hold: Hold, *, cost: int, durable: bool, used_tokens: int | None = None) -> Settlement:
        now = self._clock()
        with self._write(durable=durable, pipelined=True) as conn:
            return self._close_in(conn, hold, cost=cost, now=now, used_tokens=used_tokens)

    def _close_in(
        self, conn: Session, hold: Hold, *, cost: int, now: float, used_tokens: int | None = None
    ) -> Settlement:
        """`settle`'s work inside the caller's transaction; `used_tokens`, when known, corrects
        the key's tokens per minute (`key_limits.close_key`)."""
        # The hold row first, locked (PostgreSQL; SQLite's write lock already covers it): two
        # closures of one hold, from any two hosts, then run one after the other, and the
        # second finds the first's rows below instead of failing on the unique index. The
        # closure's SELECT is sent before the hold row is read (one round trip for both) and
        # still runs after the lock is taken, so it sees a closure committed meanwhile.
        hold_row = conn.execute(
            "SELECT account_id, amount, request_id FROM ledger WHERE id = ? AND kind = 'hold'" + self._db.for_update,
            (hold.hold_id,),
        )
        closure_rows = self._closure_rows(conn, hold.hold_id)
        row = hold_row.fetchone()
        if row is None or (row[0], row[1]) != (hold.account_id, hold.amount):
            raise ValueError(f"{hold} is not a hold in {self.where}")
        earlier = self._settlement(hold.hold_id, closure_rows.fetchall())
        if earlier is not None:
            return earlier
        account_id, amount, request_id = row
        if cost > amount:
            log.warning(
                "request %s cost %d µUSD, above its %d µUSD hold; charged the hold (the worst case was "
                "under-estimated upstream: a bug)",
                request_id,
                cost,
                amount,
            )
        charged = min(cost, amount)
        self._write_closure(
            conn,
            account_id=account_id,
            hold_id=hold.hold_id,
            request_id=request_id,
            charged=charged,
            released=amount - charged,
            now=now,
            used_tokens=used_tokens,
        )
        return Settlement(hold_id=hold.hold_id, charged=charged, released=amount - charged, applied=True)

    @staticmethod
    def _open_holds(conn: Session, *, created_before: float) -> list[Hold]:
        # Only accounts with something held can have an open hold; that bounds the scan.
        rows = conn.execute(
            "SELECT h.id, h.account_id, h.amount, h.request_id, h.created_at FROM ledger h "
            "JOIN accounts a ON a.id = h.account_id AND a.held > 0 "
            "WHERE h.kind = 'hold' AND h.created_at < ? "
            "AND NOT EXISTS (SELECT 1 FROM ledger c WHERE c.hold_id = h.id) ORDER BY h.id",
            (created_before,),
        ).fetchall()
        return [Hold(hold_id=r[0], account_id=r[1], amount=r[2], request_id=r[3], created_at=r[4]) for r in rows]

    def _release(self, conn: Session, holds: list[Hold], *, now: float) -> list[Hold]:
        """Release those of `holds` still open; returns them. Every hold row is locked before
        any account is touched, in id order, the order `_close` can only ever hold one of: so a
        closure on another host waits or is waited for, and never deadlocks against this."""
        for hold in holds:
            conn.execute("SELECT id FROM ledger WHERE id = ?" + self._db.for_update, (hold.hold_id,))
        still_open = [hold for hold in holds if self._closure(conn, hold.hold_id) is None]
        for hold in still_open:
            self._write_closure(
                conn,
                account_id=hold.account_id,
                hold_id=hold.hold_id,
                request_id=hold.request_id,
                charged=0,
                released=hold.amount,
                now=now,
                used_tokens=0,
            )
        return still_open

    @classmethod
    def _closure(cls, conn: Session, hold_id: int) -> Settlement | None:
        return cls._settlement(hold_id, cls._closure_rows(conn, hold_id).fetchall())

    @staticmethod
    def _closure_rows(conn: Session, hold_id: int) -> Cursor:
        return conn.execute("SELECT kind, amount FROM ledger WHERE hold_id = ?", (hold_id,))

    @staticmethod
    def _settlement(hold_id: int, closure_rows: list[Any]) -> Settlement | None:
        """The earlier closure of the hold its rows record, or None if there are none."""
        rows = dict(closure_rows)
        if not rows:
            return None
        return Settlement(hold_id=hold_id, charged=rows["settle"], released=rows["release"], applied=False)

    def _write_closure(
        self,
        conn: Session,
        *,
        account_id: int,
        hold_id: int,
        request_id: str,
        charged: int,
        released: int,
        now: float,
        used_tokens: int | None,
    ) -> None:
        # Both rows are always written, zero amounts included, so "closed" has one meaning the
        # unique index can enforce: this hold has its settle row and its release row.
        conn.execute(
            "UPDATE accounts SET held = held - ? - ?, charged = charged + ?, available = available + ? WHERE id = ?",
            (charged, released, charged, released, account_id),
        )
        # The balance after that UPDATE is read by the INSERT itself, not sent back to the
        # client, so nothing waits between the two (the account row stays locked until commit).
        balance_now = "(SELECT available FROM accounts WHERE id = ?)"
        conn.execute(
            "INSERT INTO ledger (account_id, kind, amount, request_id, hold_id, available_after, created_at) "
            f"VALUES (?, 'settle', ?, ?, ?, {balance_now} - ?, ?), (?, 'release', ?, ?, ?, {balance_now}, ?)",
            (
                account_id,
                charged,
                request_id,
                hold_id,
                account_id,
                released,
                now,
                account_id,
                released,
                request_id,
                hold_id,
                account_id,
                now,
            ),
        )
        self.close_key(conn, hold_id, released=released, used_tokens=used_tokens)

    @serialised
    def recover_open_holds(self, *, older_than: float | None = None) -> list[Hold]:
        """Release every hold still open (created before `older_than`, when given) and return them.

        Run at start-up: a hold open then belongs to a request that died with the previous
        process, and whether its answer reached the buyer is unknowable. Refunding it costs
        the operator at most that request's price; charging it could bill a buyer for nothing.
        When several gateway processes share the file, pass `older_than = now - the longest
        request time (the catalog's max_request_s)` so holds of live siblings are left alone.
        A late `settle` of a recovered hold is a no-op.
        """
        now = self._clock()
        cutoff = math.inf if older_than is None else older_than
        with self._write() as conn:
            recovered = self._release(conn, self._open_holds(conn, created_before=cutoff), now=now)
        if recovered:
            named = ", ".join(h.request_id for h in recovered[:RECOVERED_IDS_LOGGED])
            more = len(recovered) - RECOVERED_IDS_LOGGED
            log.warning(
                "released %d hold(s) left open by an earlier run (%d µUSD refunded): %s%s",
                len(recovered),
                sum(h.amount for h in recovered),
                named,
                f" and {more} more" if more > 0 else "",
            )
        return recovered

    @serialised
    def open_hold_ids(self) -> list[int]:
        """Ids of the holds not yet settled or released, oldest first."""
        with self._read() as conn:
            return [hold.hold_id for hold in self._open_holds(conn, created_before=math.inf)]

    @serialised
    def release_holds(self, hold_ids: Collection[int]) -> list[Hold]:
        """Release those of `hold_ids` still open (the orphan sweep's verdict, `gateway.orphans`)
        and return them; a hold closed meanwhile is left as it was."""
        wanted = set(hold_ids)
        if not wanted:
            return []
        now = self._clock()
        with self._write() as conn:
            wanted_open = [hold for hold in self._open_holds(conn, created_before=math.inf) if hold.hold_id in wanted]
            released = self._release(conn, wanted_open, now=now)
        if released:
            log.warning(
                "released %d hold(s) no live request owns (%d µUSD refunded): %s",
                len(released),
                sum(h.amount for h in released),
                ", ".join(h.request_id for h in released[:RECOVERED_IDS_LOGGED]),
            )
        return released

    @serialised
    def balance(self, account_id: int) -> Balance:
        with self._read() as conn:
            row = conn.execute(
                "SELECT available, held, credited, charged FROM accounts WHERE id = ?", (account_id,)
            ).fetchone()
            if row is None:
                self._require_account(conn, account_id)
        return Balance(*row)

    @serialised
    def account_summaries(self, *, limit: int = 10) -> tuple[int, list[AccountSummary]]:
        """How many buyer accounts there are, and the `limit` that have spent the most."""
        with self._snapshot() as conn:
            count = conn.execute("SELECT count(*) FROM accounts").fetchone()[0]
            rows = conn.execute(
                "SELECT id, name, available, held, charged FROM accounts ORDER BY charged DESC, id LIMIT ?", (limit,)
            ).fetchall()
        return count, [AccountSummary(*row) for row in rows]

    @serialised
    def check_books(self) -> list[int]:
        """Ids of accounts whose cached balance disagrees with their ledger (empty: all agree)."""
        with self._snapshot() as conn:
            rows = conn.execute(
                """SELECT a.id FROM accounts a LEFT JOIN (
                       SELECT account_id,
                              sum(CASE WHEN kind IN ('credit', 'deposit') THEN amount ELSE 0 END) AS credited,
                              sum(CASE kind WHEN 'hold' THEN amount ELSE 0 END) AS held_ever,
                              sum(CASE kind WHEN 'settle' THEN amount ELSE 0 END) AS charged,
                              sum(CASE kind WHEN 'release' THEN amount ELSE 0 END) AS released
                       FROM ledger GROUP BY account_id) l ON l.account_id = a.id
                   WHERE a.credited != coalesce(l.credited, 0)
                      OR a.charged != coalesce(l.charged, 0)
                      OR a.held != coalesce(l.held_ever - l.charged - l.released, 0)
                      OR a.available != coalesce(l.credited - l.held_ever + l.released, 0)
                   ORDER BY a.id"""
            ).fetchall()
        return [row[0] for row in rows]
