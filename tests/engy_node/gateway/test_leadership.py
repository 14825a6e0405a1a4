"""leadership: one host of a fleet leads at a time; a leader that dies is replaced once its lease
lapses, one that stops hands the lease back at once; jobs run only while their host leads.

Real stores on one file and real time, with a lease of seconds instead of `LEASE_TTL_S`: the
claims run in the store's worker threads, which a mock clock would skip past."""

from __future__ import annotations

import functools
import sqlite3

import pytest
import trio

from engy_node.gateway.fleet.leadership import LEADER_LEASE, Leadership
from engy_node.gateway.store import Store

TTL_S, RENEW_S, SAFETY_S = 2.0, 0.25, 0.5
lease = functools.partial(Leadership, ttl_s=TTL_S, renew_s=RENEW_S, safety_s=SAFETY_S)


@pytest.fixture
def shared(tmp_path):
    stores = [Store(tmp_path / "gateway.sqlite3") for _ in range(2)]
    yield stores
    for store in stores:
        store.close()


async def wait_until(predicate, *, timeout_s: float = 10.0) -> float:
    """Seconds until `predicate()` holds (polled every 50 ms), failing after `timeout_s`."""
    started = trio.current_time()
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)
    return trio.current_time() - started


async def test_one_host_leads_and_the_other_takes_over_only_once_a_dead_leaders_lease_lapses(shared):
    a, b = lease(shared[0], holder="gw-a"), lease(shared[1], holder="gw-b")
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as a_nursery:
            a_nursery.start_soon(a.run)
            await wait_until(lambda: a.leading)
            nursery.start_soon(b.run)
            await wait_until(lambda: b.leader == "gw-a")
            assert not b.leading
            # gw-a's process dies: it stops renewing and never hands its lease back.
            a._valid_until = -float("inf")
            a_nursery.cancel_scope.cancel()
        waited = await wait_until(lambda: b.leading)
        assert TTL_S - 2 * RENEW_S <= waited <= TTL_S + 4 * RENEW_S
        nursery.cancel_scope.cancel()


async def test_a_host_that_stops_hands_the_lease_back_at_once(shared):
    a, b = lease(shared[0], holder="gw-a"), lease(shared[1], holder="gw-b")
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as a_nursery:
            a_nursery.start_soon(a.run)
            await wait_until(lambda: a.leading)
            nursery.start_soon(b.run)
            await wait_until(lambda: b.leader == "gw-a")
            a_nursery.cancel_scope.cancel()  # a clean stop: its finally hands the lease back
        assert shared[0].lease_holder(LEADER_LEASE) is None
        assert await wait_until(lambda: b.leading) <= 3 * RENEW_S, (
            "taken at the next renewal, not after the lease lapses"
        )
        nursery.cancel_scope.cancel()


async def test_a_job_runs_only_while_its_host_leads(shared):
    shared[1].claim_lease(LEADER_LEASE, holder="gw-b", ttl_s=TTL_S)
    a = lease(shared[0], holder="gw-a")
    terms: list[float] = []

    async def job() -> None:
        terms.append(trio.current_time())
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.run)
        nursery.start_soon(a.while_leading, job)
        await wait_until(lambda: a.leader == "gw-b")
        assert terms == [] and not a.leading, "gw-b's lease is still good"
        await wait_until(lambda: terms)
        assert a.leading, "gw-b never renewed: gw-a took over and started the job"
        nursery.cancel_scope.cancel()


async def test_a_host_cut_off_from_the_store_stops_leading_before_its_lease_could_pass_on(tmp_path):
    store = Store(tmp_path / "gateway.sqlite3", busy_timeout_s=0.05)
    a = lease(store, holder="gw-a")
    stopped: list[float] = []

    async def job() -> None:
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.run)
        nursery.start_soon(a.while_leading, job)
        await wait_until(lambda: a.leading)
        await trio.sleep(2 * RENEW_S)
        # Another process sits on the store's write lock: every later claim fails (StoreError).
        with sqlite3.connect(tmp_path / "gateway.sqlite3", isolation_level=None) as blocker:
            blocker.execute("BEGIN IMMEDIATE")
            cut_at = trio.current_time()
            await wait_until(lambda: stopped)
            assert not a.leading
            assert stopped[0] - cut_at < TTL_S - SAFETY_S + RENEW_S, "stopped before anyone else could hold the lease"
            blocker.execute("ROLLBACK")
        nursery.cancel_scope.cancel()
    store.close()


def test_a_lease_too_short_for_its_renewals_is_refused(shared):
    with pytest.raises(ValueError, match="well inside it"):
        Leadership(shared[0], holder="gw-a", ttl_s=10.0, renew_s=9.0, safety_s=5.0)
