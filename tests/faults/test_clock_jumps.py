"""Wall-clock steps (an NTP correction, a VM resumed, an RTC wrong at boot) against the code that
reads wall time: the epoch publisher and the sweep of holds no live request can own.

Request deadlines, first-byte waits and time to first token are measured on the monotonic clock,
which a wall-clock step does not move; what uses wall time is the store's timestamps, the epoch
schedule and the orphaned-hold sweep. Each is run in this process with its clock injected (the
publisher's `wall`, the store's `clock`) and trio's clock under the test's control for their
sleeps, so a step of a year costs nothing.
"""

from __future__ import annotations

import time

import trio

from engy_node.gateway import role
from engy_node.gateway.billing.epochs import MAX_CATCH_UP_EPOCHS, EpochClock
from engy_node.gateway.billing.publisher import MAX_SLEEP_S, EpochPublisher
from engy_node.gateway.billing.settlement import GateMinimums
from engy_node.gateway.store import RequestLogEntry, Store
from engy_node.hub import Hub
from engy_node.models import SMOLLM2_135M
from engy_node.testing.faults import check_books
from tests.waiting import wait_until_async

GENESIS = 1_000_000
EPOCH = EpochClock(genesis=GENESIS, epoch_s=60, grace_s=10)


class Wall:
    """A wall clock the test steps; it counts its reads, which is how the test knows the
    publisher has looked at the time since the last step."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def serve(store: Store, *, at: float, request_id: str, hotkey: str) -> None:
    miner_id, _ = store.register_miner(f"m-{request_id}", hotkey=hotkey)
    store.log_request(
        RequestLogEntry(
            request_id=request_id,
            account_id=store.create_buyer(f"b-{request_id}")[0],
            miner=f"key:{miner_id}",
            model=SMOLLM2_135M.id,
            api="openai",
            kind="paid",
            status=200,
            prompt_tokens=100,
            completion_tokens=100,
            cached_tokens=0,
            cost_micro=10,
            ttft_ms=100.0,
            tpot_ms=10.0,
            created_at=at,
        )
    )


async def test_wall_clock_steps_forward_and_back_publish_each_epoch_once_and_in_order(mock_clock, tmp_path, alice, bob):
    # Trio's clock runs at real speed (every wait below is bounded in real seconds) and is jumped
    # past the publisher's sleep after each step of the wall clock, so that it looks at once.
    mock_clock.rate = 1.0
    wall = Wall(GENESIS + 5.0)

    async def step(to: float) -> None:
        """Set the wall clock and wait until the publisher has been through its loop with it."""
        wall.now = to
        reads = wall.reads
        mock_clock.jump(MAX_SLEEP_S)
        await wait_until_async(
            lambda: wall.reads >= reads + 2, timeout_s=30, what="the publisher reading the stepped clock"
        )

    with Store.open(tmp_path / "gateway.sqlite3") as store:
        serve(store, at=GENESIS + 5, request_id="r0", hotkey=bob.ss58_address)
        publisher = EpochPublisher(
            store=store,
            clock=EPOCH,
            netuid=53,
            master=alice,
            owner_hotkey=alice.ss58_address,
            models={SMOLLM2_135M.id: SMOLLM2_135M},
            minimums=GateMinimums(1, 1, 1),
            hub=Hub(),
            wall=wall,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            await step(EPOCH.closes_at(3) + 1)  # forward over four epoch closes
            await wait_until_async(lambda: len(publisher.published) == 4, timeout_s=30, what="the four closed epochs")
            assert publisher.published == [0, 1, 2, 3]
            stored = {index: store.epoch_payload(index) for index in range(4)}

            await step(GENESIS + 65)  # back into epoch 1, before the close it already had
            await step(GENESIS + 66)
            assert publisher.published == [0, 1, 2, 3], "nothing is closed again after a step back"
            assert {index: store.epoch_payload(index) for index in range(4)} == stored

            await step(EPOCH.closes_at(5) + 1)  # forward again: on from the last one published
            await wait_until_async(lambda: len(publisher.published) == 6, timeout_s=30, what="epochs 4 and 5")
            assert publisher.published == [0, 1, 2, 3, 4, 5]

            await step(EPOCH.closes_at(100_000) + 1)  # a year or more ahead: the latest epochs, not all of them
            await wait_until_async(
                lambda: len(publisher.published) == 6 + MAX_CATCH_UP_EPOCHS,
                timeout_s=60,
                what="the catch-up after a long step",
            )
            assert publisher.published[6:] == list(range(100_000 - MAX_CATCH_UP_EPOCHS + 1, 100_001))
            nursery.cancel_scope.cancel()
        published = [index for index, _, _ in store.published_epochs(limit=1000)]
    assert len(published) == len(set(published)) == 6 + MAX_CATCH_UP_EPOCHS


async def test_a_wall_clock_step_forward_during_a_request_does_not_cost_its_charge(autojump_clock, tmp_path):
    longest_request_s = 15.0 + SMOLLM2_135M.max_request_s
    step_s = 3600.0
    # The hold was stamped just before the wall clock stepped an hour forward; the sweep then
    # reads the stepped clock (`time.time()`), as it does in the gateway's first process.
    stamped_before_the_step = [time.time() - step_s]
    with Store(tmp_path / "gateway.sqlite3", clock=lambda: stamped_before_the_step[0]) as store:
        account, _ = store.create_buyer("buyer")
        store.credit(account, micro_usd=1_000)
        live = store.hold(account, amount=100, request_id="streaming-through-the-step")
        with trio.move_on_after(role.ORPHAN_SWEEP_S + 1):
            await role._release_orphaned_holds(store, longest_request_s=longest_request_s)
        settlement = store.settle(live, cost=60)  # the answer finished: what the buyer received costs 60
        balance = store.balance(account)
    check_books(tmp_path / "gateway.sqlite3")
    assert settlement.applied and balance.charged == 60, f"the served answer was charged {balance.charged}, not 60"
