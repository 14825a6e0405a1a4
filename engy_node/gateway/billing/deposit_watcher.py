"""The deposit watcher: the gateway's first process reads the chain's blocks after the store's
deposit cursor and credits buyers for the TAO their linked coldkeys sent to
`gateway.deposit_address` (docs/billing.md, "Deposits from the chain"). It runs only when a
deposit address is configured.

Failure posture. Crediting late is cheap; crediting twice or crediting a transfer that a reorg
undid is not. So every decision is `deposits.scan`'s (pure: confirmations, reorgs, exactly once)
and the store's (`record_deposits`: the credits and the cursor move in one transaction, and a
deposit already in the store is never credited again), and this shell only reads and writes. A
pass that fails (the chain unreachable, a read past `PASS_TIMEOUT_S`, the store busy) is logged
and retried at the next poll from the same cursor; one the scan stalls on (a reorg deeper than
the confirmations) is logged at every poll, since it needs an operator. Every skipped transfer
to the deposit address is logged with its reason.

How it reads, with the bittensor SDK: one long-lived blocking `bt.SyncClient` (the SDK is
asyncio-only; the node runs on trio) called in a worker thread, every pass bounded by
`PASS_TIMEOUT_S`. Per block, in order: the header (`client.block_info`: number, hash, parent),
then its `System.Events` (`client.query(("System", "Events"), block=n)`), whose
`Balances.Transfer` records carry the `extrinsic_idx` that made them. Reading each block's
header after the previous block's events is what lets the scan's parent-hash check catch a reorg
that happened mid-read. `substrate=` replaces the websocket with an in-process chain
(`local/devchain.py`), as the validator's chain client does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from engy_node.gateway.billing import deposits
from engy_node.gateway.billing.deposits import Block, Cursor, Transfer
from engy_node.gateway.store import Store
from engy_node.gateway.store.schema import StoreError

log = logging.getLogger("engy.gateway.deposits")

POLL_S = 6.0
"""Half a finney block: a deposit is credited within a poll of its last confirmation."""
PASS_TIMEOUT_S = 60.0
"""One pass (connect or read up to `MAX_BLOCKS_PER_PASS` blocks) longer than this is abandoned
and retried: the SDK's transport answers a request within 60 s or fails it."""
MAX_BLOCKS_PER_PASS = 64
"""Blocks read per pass (two reads each): a watcher catching up after downtime moves in bounded
steps, each committed, instead of one read of hours of blocks."""


def transfers_from_events(events: list[Any]) -> tuple[Transfer, ...]:
    """The `Balances.Transfer` events of a block's decoded `System.Events`, each with the index of
    the extrinsic that made it; events outside an extrinsic (a block's initialisation) are not
    transfers a buyer signed and are left out."""
    found = []
    for entry in events:
        record = getattr(entry, "value", entry)
        if not isinstance(record, dict) or not isinstance(record.get("event"), dict):
            continue
        event = record["event"]
        if (event.get("module_id"), event.get("event_id")) != ("Balances", "Transfer"):
            continue
        index = record.get("extrinsic_idx")
        attributes = event.get("attributes")
        if isinstance(attributes, dict):
            sender, dest, amount = attributes.get("from"), attributes.get("to"), attributes.get("amount")
        elif isinstance(attributes, (list, tuple)) and len(attributes) == 3:
            sender, dest, amount = attributes
        else:
            continue
        if index is None or amount is None:
            continue
        found.append(Transfer(int(index), _address(sender), _address(dest), int(amount)))
    return tuple(found)


def _address(value: Any) -> str:
    """An account id as ss58: the SDK decodes it as ss58 text, a node's raw value is 32 bytes."""
    if isinstance(value, str) and not value.startswith("0x"):
        return value
    from bittensor.sp_core import ss58_encode

    raw = bytes.fromhex(value[2:]) if isinstance(value, str) else bytes(value)
    return ss58_encode(raw)


class ChainReader:
    """The blocks and events the scan reads, through one SDK client (blocking; call it in a thread)."""

    def __init__(self, network: str, *, substrate: Any = None) -> None:
        self.network = network
        self._substrate = substrate
        self._client: Any = None

    def open(self) -> None:
        import bittensor as bt

        if self._client is None:
            fallback: list[str] | None = [] if self._substrate is not None else None
            self._client = bt.SyncClient(self.network, substrate=self._substrate, fallback_endpoints=fallback)
            self._client.connect()

    def head(self) -> int:
        return int(self._client.block)

    def cursor_at(self, number: int) -> Cursor:
        info = self._client.block_info(number)
        if info is None:
            raise LookupError(f"the chain has no block {number}")
        return Cursor(number, info.hash)

    def blocks(self, first: int, last: int) -> list[Block]:
        """Blocks `first`..`last` (fewer if the chain has fewer), each with its transfers."""
        found = []
        for number in range(first, last + 1):
            info = self._client.block_info(number)
            if info is None:
                break
            events = self._client.query(("System", "Events"), block=number) or []
            transfers = transfers_from_events(list(events))
            found.append(Block(number, info.hash, info.header.get("parentHash", ""), transfers))
        return found

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


async def run_deposit_watcher(
    store: Store,
    *,
    address: str,
    usd_per_tao: str,
    confirmations: int,
    network: str,
    start_block: int = 0,
    substrate: Any = None,
    poll_s: float = POLL_S,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Watch for deposits to `address` until cancelled (reports started once it has its cursor)."""
    rate = deposits.parse_rate(usd_per_tao)
    reader = ChainReader(network, substrate=substrate)
    try:
        cursor = None
        while cursor is None:
            try:
                with trio.fail_after(PASS_TIMEOUT_S):
                    cursor = await _start(store, reader, address=address, start_block=start_block)
            except (trio.TooSlowError, StoreError, OSError, LookupError) as error:
                log.error("deposit watcher cannot start (%s); retrying in %g s", error, poll_s)
                await trio.sleep(poll_s)
            except Exception as error:  # the SDK's own errors (ChainError, connection errors)
                log.error("deposit watcher cannot reach the chain %s (%s); retrying in %g s", network, error, poll_s)
                await trio.sleep(poll_s)
        log.info(
            "deposit watcher: crediting transfers to %s at $%s per TAO after %d confirmations, from block %d on",
            address,
            usd_per_tao,
            confirmations,
            cursor.number + 1,
        )
        task_status.started(cursor)
        while True:
            try:
                with trio.fail_after(PASS_TIMEOUT_S):
                    await deposit_pass(store, reader, address=address, confirmations=confirmations, usd_per_tao=rate)
            except trio.TooSlowError:
                log.warning("deposit watcher: a pass took over %g s; retrying from the same block", PASS_TIMEOUT_S)
            except StoreError as error:
                log.warning("deposit watcher: the store refused (%s); retrying from the same block", error)
            except Exception as error:  # the SDK's own errors: the chain unreachable or a read refused
                log.warning("deposit watcher: reading the chain failed (%s); retrying from the same block", error)
            await trio.sleep(poll_s)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5.0):
            await trio.to_thread.run_sync(reader.close, abandon_on_cancel=True)


async def _start(store: Store, reader: ChainReader, *, address: str, start_block: int) -> Cursor:
    await _in_thread(reader.open)
    if start_block > 0:
        first = await _in_thread(reader.cursor_at, start_block - 1)
    else:
        first = await _in_thread(reader.cursor_at, await _in_thread(reader.head))
    cursor = await store.run(store.deposit_cursor, address, start=first)
    assert cursor is not None  # stored just now, or earlier
    return cursor


async def deposit_pass(
    store: Store,
    reader: ChainReader,
    *,
    address: str,
    confirmations: int,
    usd_per_tao: Any,
) -> list[deposits.Deposit]:
    """One scan from the stored cursor; returns the deposits it credited."""
    cursor = await store.run(store.deposit_cursor, address)
    if cursor is None:
        raise StoreError(f"the store has no deposit cursor for {address}; the watcher sets one when it starts")
    head = await _in_thread(reader.head)
    if head - cursor.number < confirmations:
        return []
    blocks = await _in_thread(reader.blocks, cursor.number + 1, min(head, cursor.number + MAX_BLOCKS_PER_PASS))
    links = await store.run(store.coldkey_links)
    result = deposits.scan(
        cursor=cursor,
        blocks=blocks,
        confirmations=confirmations,
        deposit_address=address,
        links=links,
        usd_per_tao=usd_per_tao,
    )
    for skipped in result.skipped:
        log.warning(
            "deposit watcher: not crediting extrinsic %d-%04d: %s",
            skipped.block_number,
            skipped.extrinsic_index,
            skipped.reason,
        )
    if result.stalled is not None:
        log.error("deposit watcher: stopped at block %d: %s", (result.cursor or cursor).number, result.stalled)
    if result.cursor is None:
        return []
    credited = await store.run(
        store.record_deposits, address, expected=cursor, moved=result.cursor, deposits=result.deposits
    )
    if credited is None:
        log.info("deposit watcher: another gateway host scanned these blocks first; nothing to do")
        return []
    for deposit in credited:
        log.info(
            "deposit %s: %d rao from %s credited to account %d as %d µUSD",
            deposit.extrinsic_id,
            deposit.amount_rao,
            deposit.coldkey,
            deposit.account_id,
            deposit.micro_usd,
        )
    for deposit in result.deposits:
        if deposit not in credited:
            log.info("deposit %s was credited before; not again", deposit.extrinsic_id)
    return credited


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    # Abandoned on cancel (the pass's deadline): the SDK call cannot be interrupted, and the
    # next pass starts again from the stored cursor whatever it returns.
    return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True)
