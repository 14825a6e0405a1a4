"""Deposits from the chain, decided: given the blocks read after the store's cursor and the linked
coldkeys, which transfers to the gateway's deposit address to credit now, which to skip and why,
and how far the cursor may move. Pure: no chain, store or clock (`deposit_watcher.py` is the IO).

Posture. Money a buyer sent must be credited exactly once, and money that was never finally sent
(a block a reorg replaced) never. So:

* **Only confirmed blocks are credited.** A block has `c` confirmations when the view holds it
  and `c - 1` blocks built on it, each the parent of the next. Only blocks with at least
  `confirmations` (at least 2) are credited; the tail above them is read again next time, so a
  reorg of that tail replaces blocks nobody credited. Counting on blocks actually seen linked,
  not on a head number read separately, means a view read across a reorg cannot make a block
  look deeper than it is.
* **The view must extend the cursor.** The cursor is the last block credited through (its number
  and hash). The first block read must have the cursor's hash as its parent, and each next block
  the previous one's; the view is cut at the first break. A break at the first block means the
  chain replaced a block that had its confirmations: a reorg deeper than `confirmations`, which
  the watcher must not paper over: it stops there and says so (`Scan.stalled`) until an operator
  looks. A break further up is a reorg while the view was read: the linked prefix still counts.
* **Exactly once per extrinsic.** A deposit is identified by (block hash, extrinsic index); the
  store's UNIQUE constraint on that pair, and the cursor moving in the same transaction as the
  credits, make a repeated scan (a restart, two hosts) credit nothing twice.

What counts as a deposit: `Balances.Transfer` events to the deposit address from a coldkey
linked to a buyer account, summed per extrinsic (a batch of transfers in one extrinsic is one
deposit). A transfer from an unlinked coldkey, or from several senders in one extrinsic, is
skipped with the reason, and is not credited later (link first, then send).

The rate is `gateway.deposit_usd_per_tao`, an exact decimal; the credit is rounded down to the
µUSD (at most one µUSD less; a transfer worth less than one µUSD is skipped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction

RAO_PER_TAO = 10**9
MICRO_PER_USD = 10**6
MIN_CONFIRMATIONS = 2
"""A block is credited only with a block built on it in the same view: that successor's parent
hash is what proves the block's events (read by number) belong to the chain the view follows."""


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """One `Balances.Transfer` event of a block: `amount_rao` from `sender` to `dest`, made by the
    block's extrinsic `extrinsic_index`."""

    extrinsic_index: int
    sender: str
    dest: str
    amount_rao: int


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    number: int
    hash: str
    parent_hash: str
    transfers: tuple[Transfer, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Cursor:
    """The last block scanned and credited through."""

    number: int
    hash: str


@dataclasses.dataclass(frozen=True, slots=True)
class Deposit:
    """A deposit to credit: the extrinsic that made it, who sent it, and what it is worth."""

    block_number: int
    block_hash: str
    extrinsic_index: int
    account_id: int
    coldkey: str
    amount_rao: int
    micro_usd: int

    @property
    def extrinsic_id(self) -> str:
        """The chain's `block-index` name for the extrinsic (explorers and `ExtrinsicResult` use it)."""
        return f"{self.block_number}-{self.extrinsic_index:04d}"


@dataclasses.dataclass(frozen=True, slots=True)
class Skipped:
    block_number: int
    extrinsic_index: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Scan:
    deposits: tuple[Deposit, ...]
    skipped: tuple[Skipped, ...]
    cursor: Cursor | None
    """Where the cursor moves (the highest confirmed block), or None when it stays."""
    stalled: str | None
    """Why the view stopped short of what was read, or None."""


def parse_rate(text: str) -> Fraction:
    """`gateway.deposit_usd_per_tao` (e.g. `"412.5"`) as an exact fraction; ValueError names the fix."""
    try:
        rate = Decimal(text.strip())
    except (InvalidOperation, AttributeError):
        raise ValueError(
            f"gateway.deposit_usd_per_tao = {text!r}: write USD per TAO as a decimal, e.g. 412.5"
        ) from None
    if not rate.is_finite() or rate <= 0:
        raise ValueError(f"gateway.deposit_usd_per_tao = {text!r}: the rate must be a positive number of USD per TAO")
    return Fraction(rate)


def micro_usd(amount_rao: int, usd_per_tao: Fraction) -> int:
    """What `amount_rao` is worth at the rate, in µUSD, rounded down."""
    return int(amount_rao * usd_per_tao * MICRO_PER_USD // RAO_PER_TAO)


def scan(
    *,
    cursor: Cursor,
    blocks: Sequence[Block],
    confirmations: int,
    deposit_address: str,
    links: Mapping[str, int],
    usd_per_tao: Fraction,
) -> Scan:
    """What to credit from `blocks` (read in order from `cursor.number + 1`), given the coldkeys
    linked to accounts (`links`: coldkey -> account id)."""
    if confirmations < MIN_CONFIRMATIONS:
        raise ValueError(f"confirmations must be at least {MIN_CONFIRMATIONS}, got {confirmations}")
    linked: list[Block] = []
    previous = cursor
    stalled = None
    for block in blocks:
        if block.number != previous.number + 1 or block.parent_hash != previous.hash:
            if not linked:
                stalled = (
                    f"block {block.number} ({block.hash}) does not extend block {cursor.number} ({cursor.hash}), "
                    f"which had {confirmations} confirmations when it was credited: a reorg deeper than "
                    "gateway.deposit_confirmations. Nothing more is credited until an operator checks the "
                    "deposits after that block and moves the cursor"
                )
            else:
                stalled = f"the chain changed while it was read (block {block.number} does not extend the block read before it); read again next time"
            break
        linked.append(block)
        previous = Cursor(block.number, block.hash)
    top = linked[-1].number if linked else cursor.number
    confirmed = [block for block in linked if top - block.number + 1 >= confirmations]
    deposits: list[Deposit] = []
    skipped: list[Skipped] = []
    for block in confirmed:
        decided = _block_deposits(block, deposit_address=deposit_address, links=links, usd_per_tao=usd_per_tao)
        deposits.extend(item for item in decided if isinstance(item, Deposit))
        skipped.extend(item for item in decided if isinstance(item, Skipped))
    moved = Cursor(confirmed[-1].number, confirmed[-1].hash) if confirmed else None
    return Scan(deposits=tuple(deposits), skipped=tuple(skipped), cursor=moved, stalled=stalled)


def _block_deposits(
    block: Block, *, deposit_address: str, links: Mapping[str, int], usd_per_tao: Fraction
) -> list[Deposit | Skipped]:
    by_extrinsic: dict[int, list[Transfer]] = {}
    for transfer in block.transfers:
        if transfer.dest == deposit_address and transfer.amount_rao > 0:
            by_extrinsic.setdefault(transfer.extrinsic_index, []).append(transfer)
    decided: list[Deposit | Skipped] = []
    for index, transfers in sorted(by_extrinsic.items()):
        senders = {transfer.sender for transfer in transfers}
        amount = sum(transfer.amount_rao for transfer in transfers)
        if len(senders) != 1:
            decided.append(
                Skipped(block.number, index, f"transfers from several senders ({', '.join(sorted(senders))})")
            )
            continue
        (sender,) = senders
        if sender not in links:
            decided.append(
                Skipped(
                    block.number,
                    index,
                    f"{amount} rao from {sender}, a coldkey linked to no account (engy-node gateway link-coldkey)",
                )
            )
            continue
        worth = micro_usd(amount, usd_per_tao)
        if worth < 1:
            decided.append(Skipped(block.number, index, f"{amount} rao from {sender} is worth less than 1 µUSD"))
            continue
        decided.append(Deposit(block.number, block.hash, index, links[sender], sender, amount, worth))
    return decided
