"""`kill -9` of a real gateway process at chosen points of its requests' lives, then a restart in
the same home: the ledger's invariants hold, every hold is closed, nothing is charged twice or
lost, the miners re-dial by themselves and the gateway serves again.

One gateway home for the module (its process is killed and started again by each test), with
short epochs signed by a master key, so that epochs close in the background of every fault and
one test kills the gateway in the middle of closing one. The chosen points are events of the
synthetic miner (`Gate`: the answer is held before a chunk or before its final response) and of
the buyer (the text that reached it), never a guessed sleep.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time

import httpx
import pytest
import trio
from bittensor.sp_core import Keypair

from engy_node import keys
from engy_node.gateway.billing import billing, epochs
from engy_node.gateway.store import Store
from engy_node.miner.link import Identity
from engy_node.models import SMOLLM2_135M
from engy_node.testing.faults import Gate, ProcessAccount, check_books, read_books
from engy_node.testing.synthetic_miner import SyntheticHandler, synthetic_link
from tests.faults.conftest import (
    FAST,
    BuyerCall,
    gate_by_content,
    new_buyer,
    plain_script,
    register_miner,
    start_synthetic_miner,
    words,
)
from tests.faults.nodes import GatewayProcess
from tests.waiting import Changes, logged, wait_until_async

EPOCH_S = 3
EPOCH_GRACE_S = 1
ANSWER = words(12)
LOAD_STREAMS = 8
"""Streams mid-answer beside the chosen points when the gateway is killed: load, not a lone request."""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway-crash")


@pytest.fixture(scope="module")
def account(home):
    return ProcessAccount(home)


@pytest.fixture(scope="module")
def epoch_clock() -> epochs.EpochClock:
    return epochs.EpochClock(genesis=int(time.time()) // EPOCH_S * EPOCH_S, epoch_s=EPOCH_S, grace_s=EPOCH_GRACE_S)


@pytest.fixture(scope="module")
def gateway(home, account, epoch_clock):
    wallets = home / "wallets"
    keys.create_wallet(wallets, "faults", "master")
    owner = keys.create_wallet(wallets, "faults", "owner")
    gateway = GatewayProcess(
        home,
        account,
        master_wallet="faults/master",
        wallets_path=wallets,
        owner_hotkey=owner,
        epoch_genesis=epoch_clock.genesis,
        epoch_s=EPOCH_S,
        epoch_grace_s=EPOCH_GRACE_S,
        gate_min_samples=1,
        # A request held before its first output must still be open when the gateway is killed:
        # past this wait its miner would be given up as silent, however slow the machine.
        first_byte_wait_s=45,
    )
    gateway.start()
    yield gateway
    if gateway.process.poll() is None:
        assert gateway.stop() == 0, gateway.text()
    account.note_marked()
    assert account.alive() == [], "every process of the gateway's home has exited"
    assert account.listening() == [], "no port the gateway used still listens"


@pytest.fixture
def running(gateway):
    """The module's gateway, started again if an earlier test left it killed."""
    if gateway.process is None or gateway.process.poll() is not None:
        gateway.start()
    return gateway


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


def hotkey(name: str) -> str:
    return Keypair.create_from_uri(f"//{name}").ss58_address


async def serve_again(gateway: GatewayProcess, key: str, *, killed_at: float) -> tuple[BuyerCall, float]:
    """The first request after a restart, and the seconds from the kill until it was answered."""
    call = BuyerCall(api=gateway.buyer_url + "/v1", key=key, content="are you back?", stream=True)
    await call.run()
    assert call.error is None and call.text == ANSWER, f"the restarted gateway did not serve: {call.error!r}"
    return call, call.ended_at - killed_at


async def test_a_kill_with_requests_at_every_point_of_their_lives_refunds_each_open_hold_and_keeps_each_charge(
    nursery, running, http, served, figures
):
    gateway = running
    gates = {
        "held, nothing sent": Gate(before_chunk=0),
        "mid-stream": Gate(before_chunk=1),
        "fully relayed, not settled": Gate(before_response=True),
        "not streamed, waiting for the answer": Gate(before_response=True),
        **{f"load {index}": Gate(before_chunk=1) for index in range(LOAD_STREAMS)},
    }
    settled_first = "settled just before the kill"
    await start_synthetic_miner(
        nursery,
        store_path=gateway.store_path,
        miner_url=gateway.miner_url,
        served=served,
        http=http,
        script=lambda frame: plain_script(ANSWER),
        gate_for=gate_by_content(gates),
        hotkey=hotkey("fault-miner-1"),
    )
    buyers = {content: new_buyer(gateway.store_path) for content in [*gates, settled_first]}
    calls = {
        content: BuyerCall(
            api=gateway.buyer_url + "/v1",
            key=key,
            content=content,
            stream=content != "not streamed, waiting for the answer",
        )
        for content, (_, key) in buyers.items()
    }
    async with trio.open_nursery() as buyer_tasks:
        for call in calls.values():
            buyer_tasks.start_soon(call.run)
        with trio.fail_after(60):
            for gate in gates.values():
                await gate.reached.wait()
        for content, call in calls.items():
            if content == "mid-stream" or content.startswith("load"):
                await call.wait_for_text(ANSWER[:6])
        await calls["fully relayed, not settled"].wait_for_text(ANSWER)
        # A stream's last event goes out only after its settle committed (fsynced): this answer's
        # charge is durable once the buyer has it whole.
        await calls[settled_first].ended()
        assert calls[settled_first].error is None and calls[settled_first].text == ANSWER
        in_flight = read_books(gateway.store_path)
        assert len(in_flight.open_holds) == len(gates), "every chosen point holds its worst case when the gateway dies"
        killed_at = gateway.kill()
        for call in calls.values():
            await call.ended()
    for content in gates:
        assert calls[content].told_of_a_failure, (
            f"{content}: the buyer was told the gateway failed, not sent a complete answer"
        )

    await gateway.start_from_trio()
    books = check_books(gateway.store_path)
    with Store.open(gateway.store_path) as store:
        balances = {content: store.balance(account_id) for content, (account_id, _) in buyers.items()}
    for content in gates:
        balance = balances[content]
        assert (balance.held, balance.charged, balance.available) == (0, 0, balance.credited), (
            f"{content}: a hold the crash left open is refunded in full"
        )
    assert balances[settled_first].charged == charge_for(calls[settled_first]) > 0, "a settled charge stands, once"
    served_again, seconds = await serve_again(gateway, buyers["held, nothing sent"][1], killed_at=killed_at)
    check_books(gateway.store_path)
    with Store.open(gateway.store_path) as store:
        assert store.balance(buyers["held, nothing sent"][0]).charged == charge_for(served_again)
    figures.record(
        "gateway kill -9 with requests in flight",
        len(calls),
        f" requests: {len(gates)} open holds refunded in full, 1 settled charge kept once (its request-log row "
        f"{'lost' if len(books.unlogged_charges) else 'kept'})",
    )
    figures.record("gateway kill -9 -> restart -> first answer", seconds, " s")
    figures.record("books after the kill", f"{books.accounts} accounts, {books.holds} holds, none open, no problem")


def charge_for(call: BuyerCall) -> int:
    return billing.charge(
        price=SMOLLM2_135M.price,
        usage=billing.Usage(prompt_tokens=call.usage.prompt_tokens, completion_tokens=call.usage.completion_tokens),
    )


async def test_a_kill_in_the_middle_of_closing_an_epoch_publishes_it_once_after_the_restart(
    nursery, running, http, served, epoch_clock, figures
):
    gateway = running
    miner_hotkey = hotkey("fault-miner-3")
    await start_synthetic_miner(
        nursery,
        store_path=gateway.store_path,
        miner_url=gateway.miner_url,
        served=served,
        http=http,
        script=lambda frame: plain_script(ANSWER),
        hotkey=miner_hotkey,
    )
    buyer, key = new_buyer(gateway.store_path)
    for index in range(3):
        call = BuyerCall(api=gateway.buyer_url + "/v1", key=key, content=f"paid traffic {index}")
        await call.run()
        assert call.error is None, call.error

    def logged_rows() -> list:
        with Store.open(gateway.store_path) as store:
            return [
                entry
                for entry in store.requests_in(since=0, until=time.time() + 1)
                if entry.account_id == buyer and entry.cost_micro > 0
            ]

    # The request log is written by a task of the gateway process after each answer; its rows must
    # be in before the write lock is taken below, or the lock would make that write fail instead.
    await wait_until_async(lambda: len(logged_rows()) >= 3, timeout_s=30, what="the paid requests in the request log")
    served_in = epoch_clock.index_at(logged_rows()[-1].created_at)
    # The next close must not commit: this test holds the store's write lock across it, so the
    # publisher settles and signs the epoch in memory, then its write waits out the busy timeout
    # and fails, which it logs. The gateway dies right after that line.
    lock = sqlite3.connect(gateway.store_path, timeout=10, isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")
        await gateway.wait_for_from_trio(
            r"could not close epochs \(.*locked by another process",
            timeout_s=60,
            what="the publisher's epoch close failing on the held write lock",
        )
        killed_at = gateway.kill()
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    with Store.open(gateway.store_path) as store:
        latest = store.latest_epoch()
    interrupted = latest[0] + 1 if latest is not None else served_in
    assert epoch_clock.closes_at(interrupted) <= time.time(), "the interrupted close was due"

    await gateway.start_from_trio()

    def published_through(index: int) -> bool:
        with Store.open(gateway.store_path) as store:
            last = store.latest_epoch()
        return last is not None and last[0] >= index

    # The publisher closes the due epochs at once after the restart, in the gateway process; the
    # store is where it says so.
    await wait_until_async(
        lambda: published_through(max(interrupted, served_in)),
        timeout_s=60,
        what="the interrupted epoch and the traffic's epoch published",
    )
    recovered_in = time.monotonic() - killed_at
    with Store.open(gateway.store_path) as store:
        stored = store.epoch_payload(served_in)
        published_indices = [index for index, _, _ in store.published_epochs(limit=1000)]
    assert len(published_indices) == len(set(published_indices)) and stored is not None
    published = (await http.get(f"{gateway.provider_url}/api/subnet/v1/epoch/{served_in}")).json()
    assert json.loads(stored) == published, "the provider serves exactly the stored bytes"
    assert keys.epoch_digest(published["result_json"].encode()) == published["digest"]
    rows = [row for row in json.loads(published["result_json"])["rows"] if row["hotkey"] == miner_hotkey]
    window = epoch_clock.window(served_in)
    served_there = [entry for entry in logged_rows() if window[0] <= entry.created_at < window[1]]
    assert sum(row["requests"] for row in rows) == len(served_there) > 0, (
        "the epoch settles the paid requests its log holds"
    )
    check_books(gateway.store_path)
    figures.record("gateway kill -9 mid epoch close -> epoch published after the restart", recovered_in, " s")


async def test_a_miner_whose_event_loop_stalls_while_its_gateway_dies_re_dials_instead_of_stopping(
    running, http, served
):
    """Last in the module: it leaves the gateway killed (the module's teardown expects that)."""
    gateway = running
    key = register_miner(gateway.store_path, "stalling")
    link = synthetic_link(
        gateway_url=gateway.miner_url,
        model=served,
        identity=Identity(miner_key=key),
        handler=SyntheticHandler(served, lambda frame: plain_script(ANSWER)),
        http=http,
        settings=dataclasses.replace(FAST, heartbeat_s=0.2),
    )
    legs = Changes()
    link.on_state = legs.notify
    ended: list[BaseException] = []
    link_ended = trio.Event()

    async def run_link(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await link.run(task_status=task_status)
        except Exception as error:  # broad on purpose: whatever ends the link is the finding
            ended.append(error)
        finally:
            link_ended.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(run_link)
        await legs.wait_for(lambda: sum(link.legs_up.values()) == 1, timeout_s=30, what="the miner's leg admitted")
        with logged("engy.miner.link", "re-dialling") as re_dialling:
            gateway.kill()
            # The miner's event loop stalls (a long GC pause, a starved CPU) past its next heartbeat
            # while the gateway dies: the heartbeat and the dead connection are then handled in one tick.
            time.sleep(4 * 0.2)
            with trio.fail_after(30):
                async with trio.open_nursery() as either:
                    for event in (link_ended, re_dialling.seen):
                        either.start_soon(_cancel_when_set, event, either.cancel_scope)
        nursery.cancel_scope.cancel()
    assert not ended, f"the miner's link ended: {ended[0]!r}"


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
