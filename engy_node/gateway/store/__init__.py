"""The gateway's durable state: buyer accounts and keys, the money ledger, the request log, miner
registrations, verifier verdicts, published epochs, validator heartbeats, traffic eligibility and
leases; never buyer content (docs/reliability.md, "Data"). One SQLite file for a gateway on one
host (the default); one PostgreSQL database, named by `gateway.store_url`, for several hosts.
Both run the same operations, the same SQL and the same test suite; the invariants below hold on
either.

Posture. The ledger must never double-charge, lose a charge or let concurrent requests spend
money a buyer does not have, across crashes and across processes or hosts sharing the store. So
every write is one explicit transaction (on SQLite `BEGIN IMMEDIATE`, which takes the write lock
before anything is read; on PostgreSQL the rows it depends on are locked by the statements
themselves), and a balance check and the hold it allows are one conditional UPDATE; ledger rows
are append-only, refused by triggers in the database itself; and every hold is closed at most
once, by exactly one `settle` and one `release` row whose amounts sum to the hold — a unique
index makes a second closure impossible, and a closure locks its hold first, so a retried or
concurrent settle is a no-op rather than a second charge. Commits wait for the disk: a charge
the buyer was told about survives a power cut. The gateway's holds and releases are the
exception (`hold` and `release`, marked `group_commit(durable=False)`): they commit without
waiting for the flush (SQLite `synchronous=NORMAL` in WAL mode, PostgreSQL
`synchronous_commit = off`: still atomic and at once visible to every connection, durable with
the next flush). Losing one to a power cut leaves what recovery produces anyway (a hold that
never was, or an open hold that start-up releases in full), and it takes the disk's flush (0.2 ms
here, milliseconds on network block storage) out of every request's time to first token. Where
ambiguity remains, it resolves toward the buyer (`ledger.py`).

Layout: one module per concern, all on the same database.

    connection.py  the rules every operation follows, and how a location picks its backend
    schema.py      the SQLite file: tables, version stamp, transactions, what each SQLite failure means; `StoreError`
    postgres.py    the PostgreSQL database: tables, migrations, the connection pool, what each server failure means
    checks.py      identifiers, codes, digests, catalog ids, amounts, durations and times callers hand in
    keys.py        API and miner keys: minted, shown once, stored as sha256
    key_limits.py  named keys (expiry, allowed models), per-key limits, and their atomic enforcement
    ledger.py      accounts, API keys and money: credit, hold, settle, release, recovery, balances, books check
    requests.py    the request log (metadata only), usage, epoch windows and a cursor over it, retention
    miners.py      miner registrations and key lookup
    verdicts.py    verifier verdicts, one per request: recorded once, a cursor, counts per miner over a window
    epochs.py      published epoch payloads, byte for byte: written once, never changed
    validators.py  each validator's latest heartbeat
    eligibility.py the traffic control plane's current state per (miner, model)
    leases.py      which host does a one-at-a-time job (closing epochs), until when
    deposits.py    deposits from the chain: coldkey links, the watcher's cursor, each deposit credited once
    store.py       `Store`: the concerns above composed; `Store.run`, the one way trio awaits them (group commit)

Errors. A corrupt, foreign, newer-schema, locked or unwritable database, or one that cannot be
reached, raises `StoreError` naming where it is (never a password) and the fix. Unknown
accounts, and other bytes for an epoch already published, raise `StoreError`; gateway bugs
(negative amounts, a hold that is not in this ledger, a reason code with a space in it) raise
`ValueError`.
"""

from engy_node.gateway.store.checks import CODE, IDENTIFIER
from engy_node.gateway.store.eligibility import MAX_REASON_CHARS, EligibilityRow
from engy_node.gateway.store.key_limits import KeyInfo, KeyRefused
from engy_node.gateway.store.keys import BUYER_KEY_PREFIX, KEY_ENTROPY_BYTES, MINER_KEY_PREFIX
from engy_node.gateway.store.ledger import (
    RECOVERED_IDS_LOGGED,
    Account,
    AccountSummary,
    Balance,
    Hold,
    KeyRevoked,
    Settlement,
)
from engy_node.gateway.store.miners import MinerRecord
from engy_node.gateway.store.requests import RequestLogEntry, UsageSummary
from engy_node.gateway.store.schema import APPLICATION_ID, BUSY_TIMEOUT_S, SCHEMA_VERSION, StoreError
from engy_node.gateway.store.store import Store
from engy_node.gateway.store.validators import ValidatorHeartbeat
from engy_node.gateway.store.verdicts import VerdictRecord
from engy_node.protocol.audit import LOCAL_VERIFIER

__all__ = [
    "APPLICATION_ID",
    "BUSY_TIMEOUT_S",
    "BUYER_KEY_PREFIX",
    "CODE",
    "IDENTIFIER",
    "KEY_ENTROPY_BYTES",
    "LOCAL_VERIFIER",
    "MAX_REASON_CHARS",
    "MINER_KEY_PREFIX",
    "RECOVERED_IDS_LOGGED",
    "SCHEMA_VERSION",
    "Account",
    "AccountSummary",
    "Balance",
    "EligibilityRow",
    "Hold",
    "KeyInfo",
    "KeyRefused",
    "KeyRevoked",
    "MinerRecord",
    "RequestLogEntry",
    "Settlement",
    "Store",
    "StoreError",
    "UsageSummary",
    "ValidatorHeartbeat",
    "VerdictRecord",
]
