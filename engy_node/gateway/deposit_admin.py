"""Operator actions on deposits from the chain: link a buyer's coldkey, list an account's
deposits, and the one line `balance` and `usage` show about them (`engy-node gateway ...`).

Kept apart from `admin.py` so the deposit commands read as one unit; they print what the store
holds and decide nothing (`billing/deposits.py` decides what is credited).
"""

from __future__ import annotations

import time

from engy_node.errors import EngyError
from engy_node.gateway.store import Store

RAO_PER_TAO = 10**9


def link_coldkey(store: Store, *, account_id: int, coldkey: str) -> str:
    """Link `coldkey` (ss58) to the account; transfers from it to the deposit address are credited."""
    from bittensor.wallets import is_bittensor_address

    if not is_bittensor_address(coldkey):
        raise EngyError(f"{coldkey!r} is not an ss58 address; give the buyer's coldkey, e.g. 5F…")
    if store.link_coldkey(account_id, coldkey):
        return f"linked coldkey {coldkey} to account {account_id}: its transfers to the deposit address are credited"
    return f"coldkey {coldkey} was already linked to account {account_id}"


def deposits_line(store: Store, account_id: int) -> str:
    """`deposits  N from the chain, $X` for `balance` and `usage`."""
    from engy_node.gateway.admin import format_usd

    records = store.deposits_of(account_id)
    total = sum(record.micro_usd for record in records)
    return f"  deposits  {len(records)} from the chain, {format_usd(total)}  (included in credited)"


def list_deposits(store: Store, *, account_id: int) -> str:
    """The account's deposits, oldest first: extrinsic id, TAO, credit, coldkey, ledger row."""
    from engy_node.gateway.admin import format_usd

    records = store.deposits_of(account_id)
    if not records:
        return f"account {account_id}: no deposits from the chain"
    lines = [f"account {account_id}: {len(records)} deposit(s) from the chain"]
    for record in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.created_at))
        tao = f"{record.amount_rao // RAO_PER_TAO}.{record.amount_rao % RAO_PER_TAO:09d}"
        lines.append(
            f"  {when}  deposit {record.extrinsic_id}  {tao} TAO  {format_usd(record.micro_usd)}  "
            f"from {record.coldkey}  ledger #{record.ledger_id}  block {record.block_hash}"
        )
    return "\n".join(lines)
