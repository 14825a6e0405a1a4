"""Store: holds atomic under contention from trio tasks and OS threads; every operation
awaitable through `Store.run`, atomic under cancellation; group commits; no content on disk."""

from __future__ import annotations

import functools
import random
import threading
import uuid
from pathlib import Path

import pytest
import trio
import trio.testing

from engy_node.gateway.api.chat import ChatRequest, Usage
from engy_node.gateway.billing.billing import billable_usage, charge, worst_case_hold
from engy_node.gateway.store import (
    BUYER_KEY_PREFIX,
    LOCAL_VERIFIER,
    MINER_KEY_PREFIX,
    Balance,
    EligibilityRow,
    Hold,
    RequestLogEntry,
    Store,
    ValidatorHeartbeat,
    VerdictRecord,
)
from engy_node.models import CATALOG
from tests.engy_node.gateway.store.support import INTEGRITY_ERRORS, assert_books_balance, entry, funded

# -- concurrency --------------------------------------------------------------------------------

BALANCE = 1_000
HOLD = 37  # does not divide BALANCE, so the last attempts find a remainder too small to hold
ATTEMPTS = 120


async def test_concurrent_trio_tasks_never_hold_more_than_the_balance(location):
    # Four stores (four connections or pools, four limiters) on one database, so holds really do
    # run at the same time in different threads and only the database's locking keeps them apart.
    stores = [Store(location) for _ in range(4)]
    account_id = funded(stores[0], BALANCE)
    holds: list[Hold] = []

    async def attempt(i: int) -> None:
        store = stores[i % len(stores)]
        hold = await store.run(store.hold, account_id, amount=HOLD, request_id=f"trio-{i}")
        if hold is not None:
            holds.append(hold)

    async with trio.open_nursery() as nursery:
        for i in range(ATTEMPTS):
            nursery.start_soon(attempt, i)
    assert len(holds) == BALANCE // HOLD
    assert sum(h.amount for h in holds) <= BALANCE

    rng = random.Random(53)
    costs = {h.hold_id: rng.randrange(HOLD + 1) for h in holds}

    async def close(i: int, hold: Hold) -> None:
        store = stores[i % len(stores)]
        if i % 3 == 0:
            await store.run(store.release, hold)
        else:
            await store.run(store.settle, hold, cost=costs[hold.hold_id])
        # A retry racing the first closure must not charge again.
        retrying = stores[(i + 1) % len(stores)]
        await retrying.run(retrying.settle, hold, cost=HOLD)

    async with trio.open_nursery() as nursery:
        for i, hold in enumerate(holds):
            nursery.start_soon(close, i, hold)
    balance = assert_books_balance(stores[0], account_id)
    expected_charged = sum(costs[h.hold_id] for i, h in enumerate(holds) if i % 3 != 0)
    assert balance == Balance(available=BALANCE - expected_charged, held=0, credited=BALANCE, charged=expected_charged)
    for store in stores:
        await store.aclose()


def test_concurrent_os_threads_with_their_own_stores_never_hold_more_than_the_balance(location):
    with Store(location) as setup:
        account_id = funded(setup, BALANCE)
    threads_n = 6
    start = threading.Barrier(threads_n)
    holds: list[Hold] = []
    charged: list[int] = []
    errors: list[BaseException] = []
    appending = threading.Lock()

    def worker(n: int) -> None:
        try:
            with Store(location) as store:
                start.wait()
                mine = [
                    store.hold(account_id, amount=HOLD, request_id=f"thread-{n}-{i}")
                    for i in range(ATTEMPTS // threads_n)
                ]
                mine = [h for h in mine if h is not None]
                with appending:
                    holds.extend(mine)
                start.wait()  # every hold attempt is in before anything is returned
                for i, hold in enumerate(mine):
                    if i % 2:
                        store.release(hold)
                    else:
                        with appending:
                            charged.append(store.settle(hold, cost=HOLD - n).charged)
        except BaseException as error:  # broad on purpose: re-raised in the main thread below
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(holds) == BALANCE // HOLD
    with Store(location) as store:
        balance = assert_books_balance(store, account_id)
    assert balance == Balance(available=BALANCE - sum(charged), held=0, credited=BALANCE, charged=sum(charged))


async def test_an_async_hold_cancelled_before_it_starts_reserves_nothing(store):
    account_id = funded(store, 1_000)
    with trio.CancelScope() as scope:
        scope.cancel()
        await store.run(store.hold, account_id, amount=500, request_id="never")
    assert scope.cancelled_caught
    assert store.balance(account_id).held == 0


# -- awaiting from trio: one thread hop, group commits ------------------------------------------


async def test_every_operation_is_awaitable(store):
    account_id, api_key = await store.run(store.create_buyer, "async")
    assert (await store.run(store.authenticate, api_key)).account_id == account_id
    assert await store.run(store.credit, account_id, micro_usd=100) == 100
    hold = await store.run(store.hold, account_id, amount=60, request_id="a1")
    assert (await store.run(store.settle, hold, cost=10)).charged == 10
    await store.run(store.release, await store.run(store.hold, account_id, amount=10, request_id="a2"))
    await store.run(store.log_request, entry(account_id=account_id))
    assert (await store.run(store.usage, account_id)).requests == 1
    assert await store.run(store.balance, account_id) == Balance(available=90, held=0, credited=100, charged=10)
    assert await store.run(store.recover_open_holds) == []
    assert await store.run(store.check_books) == []
    miner_id, miner_key = await store.run(store.register_miner, "rig")
    assert (await store.run(store.authenticate_miner, miner_key)).miner_id == miner_id
    assert len(await store.run(store.list_miners)) == 1
    second_key = await store.run(store.issue_key, account_id)
    assert await store.run(store.revoke_key, second_key)
    verdict = VerdictRecord(
        request_id="a1",
        miner="key:1",
        model="smollm2-135m",
        kind="paid",
        verdict="pass",
        reason="ok",
        verifier=LOCAL_VERIFIER,
        request_created_at=1_000.0,
        judged_at=1_001.0,
    )
    assert await store.run(store.record_verdict, verdict) == "recorded"
    assert await store.run(store.verdict, "a1") == verdict
    assert [v for _, v in await store.run(store.verdicts_after, 0)] == [verdict]
    assert await store.run(store.verdict_counts, since=0.0, until=2_000.0) == {"key:1": (1, 0, 0)}
    assert len(await store.run(store.requests_in, since=0.0, until=2_000.0)) == 1
    assert len(await store.run(store.requests_after, 0)) == 1
    assert await store.run(store.save_epoch, 0, b"{}", "0" * 64, closed_at=1_000.0)
    assert await store.run(store.epoch_payload, 0) == b"{}"
    assert await store.run(store.latest_epoch) == (0, b"{}")
    heartbeat = ValidatorHeartbeat(
        hotkey="5Val", version="0.1.0", synced_epoch=0, consensus_epoch=None, consensus_digest=None, received_at=1_000.0
    )
    await store.run(store.record_heartbeat, heartbeat)
    assert await store.run(store.validator_heartbeats) == [heartbeat]
    row = EligibilityRow(
        miner="key:1", model="smollm2-135m", state="active", reason="qualified", since=1_000.0, updated_at=1_000.0
    )
    await store.run(store.save_eligibility, [row])
    assert await store.run(store.eligibility) == [row]
    # The newest row stays (see purge_request_log), so one more is logged first.
    await store.run(store.log_requests, [entry(account_id=account_id)])
    assert await store.run(store.purge_request_log, older_than=float("inf")) == 1


async def test_run_awaits_only_methods_of_its_own_store(store, location):
    with Store(location) as other:
        with pytest.raises(TypeError, match="method of this store"):
            await store.run(other.list_miners)
    with pytest.raises(TypeError, match="method of this store"):
        await store.run(lambda: None)


async def test_operations_awaited_together_share_one_commit_and_one_failure_stays_its_own(store):
    account_id, _ = store.create_buyer("grouped")
    store.credit(account_id, micro_usd=1_000)
    store.hold(account_id, amount=10, request_id="taken")
    outcomes: dict[str, object] = {}

    async def hold(request_id: str, amount: int) -> None:
        try:
            outcomes[request_id] = await store.run(store.hold, account_id, amount=amount, request_id=request_id)
        except ValueError as error:
            outcomes[request_id] = error

    async with trio.open_nursery() as nursery:
        for request_id, amount in (("a", 100), ("taken", 5), ("b", 200), ("c", 10_000)):
            nursery.start_soon(hold, request_id, amount)
    assert isinstance(outcomes["taken"], ValueError), "a reused request id is refused"
    assert outcomes["a"].amount == 100 and outcomes["b"].amount == 200
    assert outcomes["c"] is None, "a hold the balance cannot cover is refused without touching the others"
    balance = store.balance(account_id)
    assert balance.held == 310 and balance.available == 690
    assert store.check_books() == []


async def test_an_operation_failing_alone_in_its_group_leaves_nothing_written(store):
    account_id, _ = store.create_buyer("alone")
    store.credit(account_id, micro_usd=1_000)
    store.hold(account_id, amount=10, request_id="taken")
    with pytest.raises(ValueError, match="already has a hold"):
        # The reservation's UPDATE runs before the INSERT that fails; the group's rollback takes it back.
        await store.run(store.hold, account_id, amount=500, request_id="taken")
    assert store.balance(account_id) == Balance(available=990, held=10, credited=1_000, charged=0)
    assert store.check_books() == []


async def test_a_group_that_succeeds_is_written_without_savepoints_and_one_that_fails_with_them(path):
    """Savepoints cost two statements per operation; they are taken only to isolate a failure."""
    with Store(path) as store:
        account_id, _ = store.create_buyer("traced")
        store.credit(account_id, micro_usd=1_000)
        statements: list[str] = []
        store._db._conn.set_trace_callback(statements.append)

        async def hold_in_one_group(request_ids: list[str]) -> dict[str, object]:
            """Hold for each id, all in one group: queued behind a first hold that waits for the
            store's thread (taken here) in a group of its own."""
            outcomes: dict[str, object] = {}

            async def hold(request_id: str) -> None:
                try:
                    outcomes[request_id] = await store.run(store.hold, account_id, amount=10, request_id=request_id)
                except ValueError as error:
                    outcomes[request_id] = error

            async with trio.open_nursery() as nursery:
                async with store._limiter:
                    for request_id in [f"before-{request_ids[0]}", *request_ids]:
                        nursery.start_soon(hold, request_id)
                        await trio.testing.wait_all_tasks_blocked()
                    statements.clear()
            return outcomes

        await hold_in_one_group(["a", "b", "c"])
        assert statements.count("COMMIT") == 2, "the first hold's group, then the three holds'"
        assert not [s for s in statements if s.startswith(("SAVEPOINT", "RELEASE", "ROLLBACK"))]
        outcomes = await hold_in_one_group(["d", "a", "e"])
        assert isinstance(outcomes["a"], ValueError) and outcomes["d"].amount == outcomes["e"].amount == 10
        assert statements.count("ROLLBACK") == 1 and statements.count("COMMIT") == 2
        assert statements.count("SAVEPOINT operation") == 3, "written again, each hold in its own savepoint"
        assert store.balance(account_id).held == 70
        assert store.check_books() == []


async def queue_holds(
    store: Store, account_id: int, request_ids: list[str], outcomes: dict, nursery
) -> dict[str, trio.CancelScope]:
    """Start a hold for each id, one after the other, each queued behind the one before while the
    store's thread is taken (the caller holds the limiter); returns each caller's cancel scope."""
    scopes = {}

    async def hold(request_id: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scopes[request_id]:
            task_status.started()
            outcomes[request_id] = await store.run(store.hold, account_id, amount=10, request_id=request_id)
            return
        outcomes[request_id] = "cancelled"

    for request_id in request_ids:
        await nursery.start(hold, request_id)
        await trio.testing.wait_all_tasks_blocked()
    return scopes


async def test_calls_cancelled_while_their_group_waits_for_the_thread_are_written_or_withdrawn_never_dropped(path):
    """Whoever writes a group writes it for every call in it: cancelled before the store's thread
    was free, it must still write it, or the calls in it would be told nothing was done (a hold
    refused, a settlement without an answer) when it was not. Each call either returns its real
    result or raises the cancellation having done nothing."""
    store = Store(path)
    account_id = funded(store, 1_000)
    outcomes: dict[str, object] = {}
    await store._limiter.acquire()  # the store's one thread is busy with something else

    async def hold(request_id: str) -> None:
        try:
            outcomes[request_id] = await store.run(store.hold, account_id, amount=10, request_id=request_id)
        except trio.Cancelled:
            outcomes[request_id] = "cancelled"
            raise

    async with trio.open_nursery() as nursery:
        for request_id in ("first", "second", "third"):
            nursery.start_soon(hold, request_id)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
        store._limiter.release()
    assert outcomes.keys() == {"first", "second", "third"}
    assert all(isinstance(outcome, Hold) or outcome == "cancelled" for outcome in outcomes.values()), outcomes
    assert any(isinstance(outcome, Hold) for outcome in outcomes.values()), "the group being written was written"
    assert store.balance(account_id).held == 10 * sum(isinstance(outcome, Hold) for outcome in outcomes.values())
    assert store.check_books() == []
    store.close()


async def test_a_call_still_queued_when_cancelled_is_withdrawn_and_the_rest_of_its_group_is_written(path):
    store = Store(path)
    account_id = funded(store, 1_000)
    outcomes: dict[str, object] = {}
    await store._limiter.acquire()
    async with trio.open_nursery() as nursery:
        scopes = await queue_holds(store, account_id, ["writer", "a", "b", "c"], outcomes, nursery)
        scopes["b"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        store._limiter.release()
    assert outcomes["b"] == "cancelled"
    assert all(isinstance(outcomes[name], Hold) for name in ("writer", "a", "c")), outcomes
    assert store.balance(account_id).held == 30
    store.close()


async def test_calls_queued_behind_a_group_being_written_are_written_in_the_next_one_even_if_the_first_of_them_goes(
    path,
):
    """While a group is written, later calls queue for the next; whoever of them is first writes
    it, and if that one is cancelled before its turn comes, the next one does."""
    store = Store(path)
    account_id = funded(store, 1_000)
    outcomes: dict[str, object] = {}
    commits: list[int] = []
    first_written = threading.Event()
    commit_group = store._commit_group

    def gated(group) -> None:
        commits.append(len(group))
        if len(commits) == 1:
            first_written.wait(10)  # the first group is in the thread until the test lets it go
        commit_group(group)

    store._commit_group = gated
    async with trio.open_nursery() as nursery:
        scopes = await queue_holds(store, account_id, ["writer"], outcomes, nursery)
        scopes.update(await queue_holds(store, account_id, ["next", "a", "b"], outcomes, nursery))
        scopes["next"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        first_written.set()
    assert outcomes["next"] == "cancelled"
    assert all(isinstance(outcomes[name], Hold) for name in ("writer", "a", "b")), outcomes
    assert commits == [1, 2]
    assert store.balance(account_id).held == 30
    store.close()


async def test_holds_and_releases_skip_the_disk_flush_and_charges_wait_for_it(path):
    """A hold or release lost to a power cut is what recovery would produce anyway; a charge is not."""
    store = Store(path)
    account_id, _ = store.create_buyer("flush")
    store.credit(account_id, micro_usd=1_000)
    synchronous = lambda: store._db._conn.execute("PRAGMA synchronous").fetchone()[0]  # noqa: E731  1 NORMAL, 2 FULL

    hold = await store.run(store.hold, account_id, amount=100, request_id="r1")
    assert synchronous() == 1
    with Store.open(path) as other:
        assert other.balance(account_id).held == 100, "committed and visible to every connection at once"
    await store.run(store.settle, hold, cost=40)
    assert synchronous() == 2
    second = await store.run(store.hold, account_id, amount=50, request_id="r2")
    await store.run(store.release, second)
    assert synchronous() == 1
    store.credit(account_id, micro_usd=5)
    assert synchronous() == 2
    assert assert_books_balance(store, account_id).charged == 40
    store.close()


# -- zero data retention ------------------------------------------------------------------------


def database_bytes(path: Path) -> bytes:
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    return b"".join(f.read_bytes() for f in files if f.exists())


def test_no_prompt_or_completion_text_and_no_key_ever_reaches_the_disk(path, clock):
    marker = f"ZDR canary {uuid.uuid4().hex}: the heron sings at midnight"
    chat = ChatRequest(
        api="openai",
        model="smollm2-135m",
        messages=({"role": "user", "content": f"Repeat this: {marker}"},),
        max_tokens=64,
        stream=True,
    )
    completion_text = f"Sure. {marker}"
    price = CATALOG[chat.model].price
    request_id = uuid.uuid4().hex
    store = Store(path, clock=clock)

    account_id, api_key = store.create_buyer("zdr-visible-buyer-name")
    store.credit(account_id, micro_usd=5_000_000, memo="prepaid")
    account = store.authenticate(api_key)
    miner_id, miner_key = store.register_miner("rig-zdr")
    assert store.authenticate_miner(miner_key).miner_id == miner_id
    prompt_tokens = len(chat.messages[0]["content"].split())  # a whitespace tokenizer stands in for the model's
    hold = store.hold(
        account.account_id,
        amount=worst_case_hold(price=price, prompt_tokens=prompt_tokens, max_tokens=chat.max_tokens),
        request_id=request_id,
    )
    relayed = len(completion_text.split())
    usage = billable_usage(
        claimed=Usage(prompt_tokens=prompt_tokens, completion_tokens=relayed),
        committed_prompt=prompt_tokens,
        committed_completion=relayed,
        relayed_completion=relayed,
    )
    cost = charge(price=price, usage=usage)
    store.settle(hold, cost=cost)
    store.log_request(
        RequestLogEntry(
            request_id=request_id,
            account_id=account.account_id,
            miner=f"key:{miner_id}",
            model=chat.model,
            api=chat.api,
            kind="paid",
            status=200,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            cost_micro=cost,
            ttft_ms=80.0,
            tpot_ms=12.0,
            created_at=clock.now,
        )
    )
    store.usage(account_id)
    store.record_verdict(
        VerdictRecord(
            request_id=request_id,
            miner=f"key:{miner_id}",
            model=chat.model,
            kind="paid",
            verdict="pass",
            reason="ok",
            verifier=LOCAL_VERIFIER,
            request_created_at=clock.now,
            judged_at=clock.now,
        )
    )
    failed = store.hold(account_id, amount=10, request_id=uuid.uuid4().hex)
    store.release(failed)

    secrets_ = [
        marker.encode(),
        marker.split()[2].encode(),
        api_key.encode(),
        miner_key.encode(),
        api_key[len(BUYER_KEY_PREFIX) :].encode(),
        miner_key[len(MINER_KEY_PREFIX) :].encode(),
    ]
    live = database_bytes(path)
    # The scan sees what was written (operator-chosen names are stored), so its silence means something.
    assert b"zdr-visible-buyer-name" in live and request_id.encode() in live
    assert not [s for s in secrets_ if s in live]
    store.close()
    closed = database_bytes(path)
    assert b"zdr-visible-buyer-name" in closed
    assert not [s for s in secrets_ if s in closed]


# -- a request's one write after its answer -----------------------------------------------------


def test_settling_and_logging_a_request_is_one_write_that_logs_what_was_charged(store):
    account_id = funded(store, 1_000)
    hold = store.hold(account_id, amount=100, request_id="r1")
    settlement = store.settle_and_log(hold, cost=250, entry=entry(request_id="r1", account_id=account_id, cost_micro=0))
    assert (settlement.charged, settlement.applied) == (100, True), "clamped to the hold"
    assert [e.cost_micro for e in store.requests_in(since=0.0, until=2_000.0)] == [100]
    assert_books_balance(store, account_id)


def test_a_log_row_that_cannot_be_written_leaves_the_hold_open(store):
    account_id = funded(store, 1_000)
    hold = store.hold(account_id, amount=100, request_id="r1")
    nobody = entry(request_id="r1", account_id=999)  # no such account: the foreign key refuses the row
    with pytest.raises(INTEGRITY_ERRORS):
        store.settle_and_log(hold, cost=40, entry=nobody)
    assert store.balance(account_id).held == 100 and store.requests_in(since=0.0, until=2_000.0) == []
    with pytest.raises(ValueError, match="the log row is for request other"):
        store.settle_and_log(hold, cost=40, entry=entry(request_id="other", account_id=account_id))
    with pytest.raises(ValueError, match="settles a paid request"):
        store.settle_and_log(hold, cost=40, entry=entry(request_id="r1", account_id=None, kind="probe", cost_micro=0))
    settled = store.settle_and_log(hold, cost=40, entry=entry(request_id="r1", account_id=account_id))
    assert (settled.charged, settled.applied) == (40, True), "the failed attempts left nothing behind"
    assert_books_balance(store, account_id)


async def test_settle_and_log_is_awaitable_and_joins_the_group_commit(store):
    account_id = funded(store, 1_000)
    holds = [store.hold(account_id, amount=50, request_id=f"r{i}") for i in range(4)]
    async with trio.open_nursery() as nursery:
        for hold in holds:
            nursery.start_soon(
                functools.partial(
                    store.run,
                    store.settle_and_log,
                    hold,
                    cost=10,
                    entry=entry(request_id=hold.request_id, account_id=account_id),
                )
            )
    assert sorted(e.request_id for e in store.requests_in(since=0.0, until=2_000.0)) == ["r0", "r1", "r2", "r3"]
    assert assert_books_balance(store, account_id).charged == 40
