"""The gateway's durable state in one SQLite file: buyer accounts and keys, the money ledger, the
request log, miner registrations, verifier verdicts, published epochs, validator heartbeats and
traffic eligibility (SPEC §8.3).

Posture. The ledger must never double-charge, lose a charge or let concurrent requests spend
money a buyer does not have, across crashes and across processes sharing the file. So every
write is one explicit `BEGIN IMMEDIATE` transaction (the write lock is taken before anything is
read, so a balance check and the hold it allows cannot be split by another writer, in this
process or another); ledger rows are append-only, refused by triggers in the database itself;
and every hold is closed at most once, by exactly one `settle` and one `release` row whose
amounts sum to the hold — a unique index makes a second closure impossible, so a retried settle
after a crash is a no-op rather than a second charge. Commits are fsynced (`synchronous=FULL`):
a charge the buyer was told about survives a power cut. The gateway's holds and releases are the
exception (`hold` and `release` awaited through `Store.run`, marked
`group_commit(durable=False)`): they commit without waiting for the disk
(`synchronous=NORMAL`, which in WAL mode is still atomic and at once visible to every
connection, and becomes durable with the next fsynced commit). Losing one to a power cut leaves
what recovery produces anyway (a hold that never was, or an open hold that start-up releases in
full), and it takes the disk's flush (0.2 ms here, milliseconds on network block storage) out of
every request's time to first token. Where ambiguity remains, it resolves toward the buyer
(`ledger.py`).

Layout: one module per concern, all on the same connection.

    schema.py      the file: tables, version stamp, opening it; `StoreError` and what each SQLite failure means
    connection.py  the connection, its lock and transactions (one at a time, BEGIN IMMEDIATE, fsync levels)
    checks.py      identifiers, codes, digests, catalog ids, amounts, durations and times callers hand in
    keys.py        API and miner keys: minted, shown once, stored as sha256
    ledger.py      accounts, API keys and money: credit, hold, settle, release, recovery, balances, books check
    requests.py    the request log (metadata only), usage, epoch windows and a cursor over it, retention
    miners.py      miner registrations and key lookup
    verdicts.py    verifier verdicts, one per request: recorded once, a cursor, counts per miner over a window
    epochs.py      published epoch payloads, byte for byte: written once, never changed
    validators.py  each validator's latest heartbeat
    eligibility.py the traffic control plane's current state per (miner, model)
    store.py       `Store`: the concerns above composed; `Store.run`, the one way trio awaits them (group commit)

Errors. A corrupt, foreign, newer-schema, locked or unwritable file raises `StoreError` naming
the file and the fix. Unknown accounts, and other bytes for an epoch already published, raise
`StoreError`; gateway bugs (negative amounts, a hold that is not in this ledger, a reason code
with a space in it) raise `ValueError`.
"""

from engy_node.gateway.store.checks import CODE, IDENTIFIER
from engy_node.gateway.store.eligibility import MAX_REASON_CHARS, EligibilityRow
from engy_node.gateway.store.keys import BUYER_KEY_PREFIX, KEY_ENTROPY_BYTES, MINER_KEY_PREFIX
from engy_node.gateway.store.ledger import RECOVERED_IDS_LOGGED, Account, AccountSummary, Balance, Hold, Settlement
from engy_node.gateway.store.miners import MinerRecord
from engy_node.gateway.store.requests import RequestLogEntry, UsageSummary
from engy_node.gateway.store.schema import APPLICATION_ID, BUSY_TIMEOUT_S, SCHEMA_VERSION, StoreError
from engy_node.gateway.store.store import Store
from engy_node.gateway.store.validators import ValidatorHeartbeat
from engy_node.gateway.store.verdicts import LOCAL_VERIFIER, VerdictRecord

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
    "MinerRecord",
    "RequestLogEntry",
    "Settlement",
    "Store",
    "StoreError",
    "UsageSummary",
    "ValidatorHeartbeat",
    "VerdictRecord",
]
