"""Deposits from the chain, decided (engy_node/gateway/billing/deposits.py): confirmations, reorgs of
the unconfirmed tail, a view read across a reorg, exactly once per extrinsic, what is skipped, and
the rate's exact arithmetic."""

from __future__ import annotations

import itertools
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.config import load_config
from engy_node.errors import ConfigError
from engy_node.gateway.billing.deposit_watcher import transfers_from_events
from engy_node.gateway.billing.deposits import Block, Cursor, Transfer, micro_usd, parse_rate, scan

ADDRESS = "5Deposit"
BUYER = "5Buyer"
LINKS = {BUYER: 7}
RATE = Fraction(400)
TAO = 10**9


def chain(start: int, hashes: list[str], parent: str, transfers: dict[int, tuple[Transfer, ...]] | None = None):
    blocks = []
    for offset, block_hash in enumerate(hashes):
        number = start + offset
        blocks.append(Block(number, block_hash, parent, (transfers or {}).get(number, ())))
        parent = block_hash
    return blocks


def deposit(index: int = 1, amount: int = TAO, sender: str = BUYER) -> Transfer:
    return Transfer(index, sender, ADDRESS, amount)


def run(cursor: Cursor, blocks: list[Block], confirmations: int = 3, links=LINKS):
    return scan(
        cursor=cursor,
        blocks=blocks,
        confirmations=confirmations,
        deposit_address=ADDRESS,
        links=links,
        usd_per_tao=RATE,
    )


def test_a_deposit_is_credited_only_once_it_has_its_confirmations():
    cursor = Cursor(10, "h10")
    blocks = chain(11, ["h11", "h12", "h13"], "h10", {11: (deposit(),)})
    early = run(cursor, blocks[:2])
    assert early.deposits == () and early.cursor is None, "block 11 has 2 of 3 confirmations: the cursor stays"
    ready = run(cursor, blocks)
    assert [d.extrinsic_id for d in ready.deposits] == ["11-0001"]
    assert ready.deposits[0].account_id == 7 and ready.deposits[0].micro_usd == 400_000_000
    assert ready.cursor == Cursor(11, "h11"), "the cursor moves to the highest confirmed block only"
    again = run(ready.cursor, blocks[1:])
    assert again.deposits == (), "a scan from the moved cursor never sees the deposit again"


def test_a_reorg_of_the_unconfirmed_tail_credits_the_new_block_and_never_the_old():
    cursor = Cursor(10, "h10")
    old = chain(11, ["h11", "h12"], "h10", {12: (deposit(amount=5 * TAO),)})
    first = run(cursor, old)
    assert first.deposits == () and first.cursor is None
    new = chain(11, ["h11", "x12", "x13", "x14"], "h10", {12: (deposit(amount=2 * TAO),)})
    second = run(cursor, new)
    assert [(d.block_hash, d.amount_rao) for d in second.deposits] == [("x12", 2 * TAO)]


def test_a_reorg_below_the_cursor_stalls_and_credits_nothing():
    result = run(Cursor(10, "h10"), chain(11, ["y11", "y12", "y13", "y14"], "y10", {11: (deposit(),)}))
    assert result.deposits == () and result.cursor is None
    assert "reorg deeper than gateway.deposit_confirmations" in result.stalled


def test_a_view_read_across_a_reorg_counts_only_its_linked_prefix():
    # Blocks 11..12 read from the old fork, 13..15 from a new one that replaced 12.
    view = chain(11, ["h11", "h12"], "h10") + chain(13, ["x13", "x14", "x15"], "x12", {13: (deposit(),)})
    result = run(Cursor(10, "h10"), view, confirmations=2)
    assert result.deposits == () and result.cursor == Cursor(11, "h11")
    assert "changed while it was read" in result.stalled


def test_skipped_transfers_say_why():
    transfers = (
        deposit(1, sender="5Stranger"),
        Transfer(2, BUYER, ADDRESS, TAO),
        Transfer(2, "5Other", ADDRESS, TAO),
        deposit(3, amount=1),
        Transfer(4, BUYER, "5Elsewhere", TAO),
    )
    result = run(Cursor(10, "h10"), chain(11, ["h11", "h12", "h13"], "h10", {11: transfers}))
    reasons = {skip.extrinsic_index: skip.reason for skip in result.skipped}
    assert "linked to no account" in reasons[1] and "several senders" in reasons[2]
    assert "less than 1 µUSD" in reasons[3] and 4 not in reasons
    assert result.deposits == () and result.cursor == Cursor(11, "h11")


def test_transfers_of_one_extrinsic_are_one_deposit():
    transfers = (deposit(5, amount=TAO), deposit(5, amount=2 * TAO))
    result = run(Cursor(10, "h10"), chain(11, ["h11", "h12", "h13"], "h10", {11: transfers}))
    assert [(d.extrinsic_index, d.amount_rao) for d in result.deposits] == [(5, 3 * TAO)]


def test_fewer_than_two_confirmations_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        run(Cursor(0, "g"), [], confirmations=1)


def test_the_rate_is_exact_and_the_credit_rounds_down():
    assert parse_rate(" 412.5 ") == Fraction(825, 2)
    assert micro_usd(TAO, parse_rate("0.1")) == 100_000
    assert micro_usd(1, parse_rate("0.999")) == 0
    assert micro_usd(2, Fraction(1000, 3)) == 0 and micro_usd(3, Fraction(1000, 3)) == 1
    for text in ("", "abc", "0", "-1", "NaN", "Infinity"):
        with pytest.raises(ValueError, match="deposit_usd_per_tao"):
            parse_rate(text)


@given(
    st.integers(1, 21_000_000 * TAO), st.decimals(min_value=Decimal("0.000001"), max_value=Decimal(100_000), places=6)
)
def test_the_credit_is_the_exact_value_rounded_down(amount, rate):
    credit = micro_usd(amount, parse_rate(str(rate)))
    exact = Fraction(amount) * Fraction(rate) * 10**6 / 10**9
    assert credit <= exact < credit + 1


def test_transfer_events_are_read_with_their_extrinsic():
    events = [
        {
            "event": {
                "module_id": "Balances",
                "event_id": "Transfer",
                "attributes": {"from": "a", "to": "b", "amount": 5},
            },
            "extrinsic_idx": 2,
        },
        {"event": {"module_id": "Balances", "event_id": "Transfer", "attributes": ["c", "d", 6]}, "extrinsic_idx": 3},
        {
            "event": {
                "module_id": "Balances",
                "event_id": "Transfer",
                "attributes": {"from": "e", "to": "f", "amount": 7},
            }
        },
        {"event": {"module_id": "System", "event_id": "ExtrinsicSuccess", "attributes": {}}, "extrinsic_idx": 2},
        "undecodable",
    ]
    assert transfers_from_events(events) == (Transfer(2, "a", "b", 5), Transfer(3, "c", "d", 6))


# A chain that grows and reorganises its unconfirmed tail, scanned at random moments, sometimes
# across a reorg: every deposit credited is on the final chain, none twice, and all the final
# chain's confirmed deposits are credited in the end.

CONFIRMATIONS = 3
_names = itertools.count()


def _new_block(number: int, parent: str, with_deposit: bool) -> Block:
    block_hash = f"b{number}-{next(_names)}"
    transfers = (Transfer(1, BUYER, ADDRESS, TAO),) if with_deposit else ()
    return Block(number, block_hash, parent, transfers)


actions = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("reorg"), st.integers(1, CONFIRMATIONS - 1), st.booleans()),
        st.tuples(st.just("scan"), st.integers(1, 6), st.booleans()),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(actions)
def test_credits_across_growth_reorgs_and_torn_reads_are_exactly_the_final_chains_confirmed_deposits(steps):
    genesis = Block(0, "genesis", "none")
    canonical = [genesis]
    cursor = Cursor(0, "genesis")
    credited: list[tuple[str, int]] = []

    def do_scan(limit: int, torn: bool, previous: list[Block]) -> None:
        nonlocal cursor
        view = canonical[cursor.number + 1 : cursor.number + 1 + limit]
        if torn and previous is not canonical:
            # The first half read before a reorg, the rest after it.
            half = len(view) // 2
            view = previous[cursor.number + 1 : cursor.number + 1 + half] + view[half:]
        result = run(cursor, view, confirmations=CONFIRMATIONS)
        keys = [(d.block_hash, d.extrinsic_index) for d in result.deposits]
        assert not set(keys) & set(credited), "a deposit offered twice"
        credited.extend(keys)
        if result.cursor is not None:
            cursor = result.cursor

    previous = canonical
    for action, size, flag in steps:
        if action == "grow":
            for _ in range(size):
                canonical.append(_new_block(len(canonical), canonical[-1].hash, flag))
        elif action == "reorg":
            # Replace only blocks that have fewer than CONFIRMATIONS confirmations.
            depth = min(size, len(canonical) - 1, CONFIRMATIONS - 1)
            if depth:
                previous = list(canonical)
                del canonical[-depth:]
                for _ in range(depth + 1):
                    canonical.append(_new_block(len(canonical), canonical[-1].hash, flag))
        else:
            do_scan(size, flag, previous)
            previous = canonical
    for _ in range(CONFIRMATIONS):
        canonical.append(_new_block(len(canonical), canonical[-1].hash, False))
    for _ in range(len(canonical)):  # bounded: each scan moves the cursor at least one block
        if cursor.number >= len(canonical) - CONFIRMATIONS:
            break
        do_scan(6, False, canonical)
    final = {(block.hash, 1) for block in canonical if block.transfers}
    confirmed = {(block.hash, 1) for block in canonical[: len(canonical) - CONFIRMATIONS + 1] if block.transfers}
    assert set(credited) <= final, "a deposit in a block a reorg replaced was credited"
    assert set(credited) == confirmed
    assert len(credited) == len(set(credited))


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"deposit_usd_per_tao": ""}, "deposit_usd_per_tao"),
        ({"deposit_usd_per_tao": "-3"}, "deposit_usd_per_tao"),
        ({"deposit_usd_per_tao": "400", "deposit_confirmations": 1}, "deposit_confirmations must be at least 2"),
    ],
)
def test_a_deposit_address_needs_a_positive_rate_and_two_confirmations(tmp_path, settings, fragment):
    overrides = {"gateway": {"deposit_address": ADDRESS, **settings}}
    with pytest.raises(ConfigError, match=fragment):
        load_config(home=tmp_path, env={}, overrides=overrides)
    gateway = load_config(
        home=tmp_path, env={}, overrides={"gateway": {"deposit_address": ADDRESS, "deposit_usd_per_tao": "412.5"}}
    ).gateway
    assert parse_rate(gateway.deposit_usd_per_tao) == Fraction(825, 2) and gateway.deposit_confirmations == 12
