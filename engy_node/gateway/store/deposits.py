"""Deposits from the chain in the store: which coldkey belongs to which buyer account, how far the
deposit watcher has scanned, and each deposit credited, with the ledger's credit row for it.

Posture: a deposit is credited exactly once. `deposits` has a UNIQUE (block_hash,
extrinsic_index), its rows are append-only (triggers), and `record_deposits` writes a scan's
credits and moves the cursor in one transaction, after checking the cursor is still where the
scan started: a restart that scans the same blocks again, or a second gateway host scanning at
the same time, finds the deposit or the moved cursor and credits nothing. What to credit is
decided in `gateway/billing/deposits.py`; this only writes it.

The ledger row of a deposit is of its own kind, `deposit` (memo `deposit <extrinsic id> from
<coldkey>`; store schema 8, which relabelled the `credit` rows earlier deposits made), so the
ledger tells money from the chain from the operator's credits, while a deposit moves `credited`
and `available` like any credit and the books' check counts it as one; `deposits.ledger_id`
names that row, so the ledger's row and the deposit it came from are one join apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engy_node.gateway.billing.deposits import Cursor, Deposit
from engy_node.gateway.store.checks import identifier, integer, timestamp
from engy_node.gateway.store.connection import Connection, serialised
from engy_node.gateway.store.schema import StoreError


@dataclasses.dataclass(frozen=True, slots=True)
class DepositRecord:
    """A deposit as credited."""

    extrinsic_id: str
    block_number: int
    block_hash: str
    extrinsic_index: int
    account_id: int
    coldkey: str
    amount_rao: int
    micro_usd: int
    ledger_id: int
    created_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class CreditRecord:
    """Money into an account: an operator's credit, or a deposit from the chain (with its
    extrinsic id, sender and TAO)."""

    kind: str
    """`credit` or `deposit`."""
    micro_usd: int
    created_at: float
    ledger_id: int
    memo: str
    extrinsic_id: str | None = None
    coldkey: str | None = None
    amount_rao: int | None = None


class Deposits(Connection):
    """Coldkey links, the deposit cursor and credited deposits on the store's connection."""

    @serialised
    def link_coldkey(self, account_id: int, coldkey: str) -> bool:
        """Link `coldkey` to the account: transfers from it to the deposit address are credited to
        it from then on. False when it was already linked to this account; a coldkey linked to
        another account raises `StoreError` (one sender, one account)."""
        identifier("coldkey", coldkey)
        now = self._clock()
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM accounts WHERE id = ?", (account_id,)).fetchone() is None:
                raise StoreError(
                    f"no buyer account {account_id} in {self.where}; use the id creating the buyer printed"
                )
            row = conn.execute("SELECT account_id FROM coldkey_links WHERE coldkey = ?", (coldkey,)).fetchone()
            if row is not None:
                if row[0] == account_id:
                    return False
                raise StoreError(
                    f"coldkey {coldkey} is already linked to account {row[0]}; a coldkey pays into one account, "
                    "so send from another coldkey"
                )
            conn.execute(
                "INSERT INTO coldkey_links (coldkey, account_id, linked_at) VALUES (?, ?, ?)",
                (coldkey, account_id, now),
            )
            return True

    @serialised
    def coldkey_links(self) -> dict[str, int]:
        """Every linked coldkey and its account."""
        with self._read() as conn:
            return {row[0]: row[1] for row in conn.execute("SELECT coldkey, account_id FROM coldkey_links").fetchall()}

    @serialised
    def deposit_cursor(self, address: str, *, start: Cursor | None = None) -> Cursor | None:
        """Where the watcher for `address` has scanned through. With `start`, a store without a
        cursor stores that one first; without, such a store answers None."""
        now = self._clock()
        with self._write() as conn:
            if start is not None:
                conn.execute(
                    "INSERT INTO deposit_cursor (address, block_number, block_hash, updated_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (address) DO NOTHING",
                    (address, start.number, start.hash, now),
                )
            row = conn.execute(
                "SELECT block_number, block_hash FROM deposit_cursor WHERE address = ?", (address,)
            ).fetchone()
        return None if row is None else Cursor(row[0], row[1])

    @serialised
    def record_deposits(
        self, address: str, *, expected: Cursor, moved: Cursor, deposits: Sequence[Deposit]
    ) -> list[Deposit] | None:
        """Credit `deposits` and move `address`'s cursor from `expected` to `moved`, in one
        transaction. Returns the deposits credited now (one already in the store is not credited
        again), or None when the cursor is no longer at `expected` (another host scanned
        meanwhile; nothing was written)."""
        now = self._clock()
        with self._write() as conn:
            row = conn.execute(
                "SELECT block_number, block_hash FROM deposit_cursor WHERE address = ?" + self._db.for_update,
                (address,),
            ).fetchone()
            if row is None or Cursor(row[0], row[1]) != expected:
                return None
            credited = []
            for deposit in deposits:
                seen = conn.execute(
                    "SELECT 1 FROM deposits WHERE block_hash = ? AND extrinsic_index = ?",
                    (deposit.block_hash, deposit.extrinsic_index),
                ).fetchone()
                if seen is not None:
                    continue
                available = conn.execute(
                    "UPDATE accounts SET available = available + ?, credited = credited + ? WHERE id = ? "
                    "RETURNING available",
                    (deposit.micro_usd, deposit.micro_usd, deposit.account_id),
                ).fetchone()[0]
                memo = f"deposit {deposit.extrinsic_id} from {deposit.coldkey}"
                ledger_id = conn.execute(
                    "INSERT INTO ledger (account_id, kind, amount, memo, available_after, created_at) "
                    "VALUES (?, 'deposit', ?, ?, ?, ?) RETURNING id",
                    (deposit.account_id, deposit.micro_usd, memo, available, now),
                ).fetchone()[0]
                conn.execute(
                    "INSERT INTO deposits (block_hash, extrinsic_index, block_number, account_id, coldkey, amount_rao, "
                    "micro_usd, ledger_id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        deposit.block_hash,
                        deposit.extrinsic_index,
                        deposit.block_number,
                        deposit.account_id,
                        deposit.coldkey,
                        deposit.amount_rao,
                        deposit.micro_usd,
                        ledger_id,
                        now,
                    ),
                )
                credited.append(deposit)
            conn.execute(
                "UPDATE deposit_cursor SET block_number = ?, block_hash = ?, updated_at = ? WHERE address = ?",
                (moved.number, moved.hash, now, address),
            )
        return credited

    @serialised
    def deposits_of(self, account_id: int) -> list[DepositRecord]:
        """The account's deposits, oldest first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT block_number, block_hash, extrinsic_index, account_id, coldkey, amount_rao, micro_usd, "
                "ledger_id, created_at FROM deposits WHERE account_id = ? ORDER BY id",
                (account_id,),
            ).fetchall()
        return [DepositRecord(f"{row[0]}-{row[2]:04d}", *row) for row in rows]

    @serialised
    def credits_between(self, account_id: int, *, since: float, until: float) -> list[CreditRecord]:
        """The account's credits and deposits made in `[since, until)` (unix seconds), oldest
        first: what a usage report shows beside the charges, so that credits − charges is what
        the balance moved by."""
        integer("account_id", account_id, minimum=1)
        with self._read() as conn:
            rows = conn.execute(
                "SELECT l.kind, l.amount, l.created_at, l.id, coalesce(l.memo, ''), d.block_number, d.extrinsic_index, "
                "d.coldkey, d.amount_rao FROM ledger l LEFT JOIN deposits d ON d.ledger_id = l.id "
                "WHERE l.account_id = ? AND l.kind IN ('credit', 'deposit') AND l.created_at >= ? AND l.created_at < ? "
                "ORDER BY l.id",
                (account_id, timestamp("since", since), timestamp("until", until)),
            ).fetchall()
        return [
            CreditRecord(
                kind,
                int(amount),
                created_at,
                ledger_id,
                memo,
                None if block is None else f"{block}-{index:04d}",
                coldkey,
                None if rao is None else int(rao),
            )
            for kind, amount, created_at, ledger_id, memo, block, index, coldkey, rao in rows
        ]
