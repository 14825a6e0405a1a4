"""`kill -9` of one gateway worker process (`gateway.workers = 2`) while it streams: its buyers are
told at once, the other worker's buyers are served to the end and charged exactly, the first
process restarts the dead worker, and the gateway serves on. The holds the dead worker left open
stay held (no live process can tell them from a slow request) until the first process's sweep
releases them, after twice the longest request, or until the next start does: this test kills
the first process too, restarts the gateway, and checks that start-up refunded them in full.
"""

from __future__ import annotations

import httpx
import psutil
import pytest
import trio

from engy_node.gateway.billing import billing
from engy_node.models import SMOLLM2_135M
from engy_node.testing.faults import Gate, ProcessAccount, account_row, check_books
from tests.faults.conftest import BuyerCall, gate_by_content, new_buyer, plain_script, start_synthetic_miner, words
from tests.faults.nodes import GatewayProcess
from tests.waiting import Changes

ANSWER = words(10)
ROUNDS = 4
STREAMS_PER_ROUND = 6
"""Streams are opened in rounds, each on a new connection, until worker 1 holds at least one: the
kernel spreads connections over the workers by a hash, so six at a time land on both nearly
always, and four rounds make missing worker 1 a one-in-sixteen-million chance."""


@pytest.fixture
def account(tmp_path):
    return ProcessAccount(tmp_path)


@pytest.fixture
def gateway(tmp_path, account):
    gateway = GatewayProcess(tmp_path, account, workers=2)
    gateway.start()
    yield gateway
    gateway.stop()
    account.note_marked()
    assert account.alive() == [], "every process of the gateway's home has exited"
    assert account.listening() == [], "no port the gateway used still listens"


def worker_process(gateway: GatewayProcess) -> psutil.Process:
    [worker] = [
        child for child in psutil.Process(gateway.pid).children() if "engy_node.gateway" in " ".join(child.cmdline())
    ]
    return worker


def buyer_connections(process: psutil.Process, buyer_port: int) -> int:
    return sum(
        1
        for c in process.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == buyer_port
    )


async def test_a_worker_killed_mid_stream_fails_only_its_own_buyers_and_its_holds_are_refunded_by_the_next_start(
    nursery, gateway, served, figures
):
    gates: dict[str, Gate] = {}
    calls: dict[str, BuyerCall] = {}
    buyers: dict[str, tuple[int, str]] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        miner = await start_synthetic_miner(
            nursery,
            store_path=gateway.store_path,
            miner_url=gateway.miner_url,
            served=served,
            http=http,
            script=lambda frame: plain_script(ANSWER),
            gate_for=gate_by_content(gates),
        )
        await miner.wait_legs(2)
        worker = worker_process(gateway)
        async with trio.open_nursery() as buyer_tasks:
            on_worker_1 = 0
            for round_index in range(ROUNDS):
                for index in range(STREAMS_PER_ROUND):
                    content = f"stream {round_index}.{index}"
                    gates[content] = Gate(before_chunk=1)
                    buyers[content] = new_buyer(gateway.store_path)
                    calls[content] = BuyerCall(api=gateway.buyer_url + "/v1", key=buyers[content][1], content=content)
                    buyer_tasks.start_soon(calls[content].run)
                with trio.fail_after(60):
                    for content, gate in gates.items():
                        await gate.reached.wait()
                        await calls[content].wait_for_text(ANSWER[:6])
                on_worker_1 = buyer_connections(worker, gateway.buyer_port)
                if on_worker_1:
                    break
            assert on_worker_1, f"none of {len(calls)} streams landed on worker 1"

            gateway.account.note(gateway.pid)
            killed_worker_at = trio.current_time()
            worker.kill()
            worker.wait(timeout=30)
            # Worker 1's buyers are cut off with it; worker 0's are still held, then let go.
            await ended(calls.values(), count=on_worker_1)
            for gate in gates.values():
                gate.release()
            await ended(calls.values(), count=len(calls))
        failed = [content for content, call in calls.items() if call.error is not None]
        assert all(calls[content].told_of_a_failure for content in failed), "cut off, not left hanging"
        assert len(failed) == on_worker_1, "exactly the dead worker's streams failed"
        for content, call in calls.items():
            if content not in failed:
                assert call.text == ANSWER and account_row(
                    gateway.store_path, buyers[content][0]
                ).charged == charge_for(call)
        await gateway.wait_for_from_trio("gateway worker 1 serves again", timeout_s=60, what="worker 1 restarted")
        gateway.account.note(gateway.pid)
        # Its buyers are served again once the miners' legs to it are back (they re-dial on their own).
        await miner.wait_legs(2, timeout_s=60)
        leg_back_after = trio.current_time()
        books = check_books(gateway.store_path, open_holds_allowed=True)
        assert len(books.open_holds) == len(failed), "the dead worker's holds stay held: no live process can own them"
        assert all(account_row(gateway.store_path, buyers[content][0]).held > 0 for content in failed)
        _, later_key = new_buyer(gateway.store_path)
        for index in range(4):
            again = BuyerCall(api=gateway.buyer_url + "/v1", key=later_key, content=f"after the worker died {index}")
            await again.run()
            assert again.error is None and again.text == ANSWER, again.error

        # Start-up recovery is the other way those holds close: kill the first process as well
        # (its worker stops once it sees its parent gone), then start the gateway again.
        killed_at = gateway.kill()
        await trio.to_thread.run_sync(
            lambda: gateway.output.wait_ended(timeout_s=60, what="worker 1 gone with its parent")
        )
        await gateway.start_from_trio()
        check_books(gateway.store_path)
        for content in failed:
            row = account_row(gateway.store_path, buyers[content][0])
            assert (row.held, row.charged, row.available) == (0, 0, row.credited), (
                f"{content}: its hold refunded in full"
            )
        await miner.wait_legs(2, timeout_s=60)
        back = BuyerCall(api=gateway.buyer_url + "/v1", key=later_key, content="after the restart")
        await back.run()
        assert back.error is None, back.error
    figures.record(
        "gateway worker kill -9 mid-stream",
        f"{len(failed)} of {len(calls)} streams cut (the dead worker's)",
        f", {len(calls) - len(failed)} finished and charged exactly; its holds refunded at the next start",
    )
    figures.record(
        "gateway worker kill -9 -> worker restarted and the miner's leg back", leg_back_after - killed_worker_at, " s"
    )
    figures.record("gateway (2 workers) kill -9 -> restart -> first answer", back.ended_at - killed_at, " s")


async def ended(calls, *, count: int) -> None:
    """Until `count` of `calls` have ended."""
    finished = Changes()
    done = 0

    async def one(call: BuyerCall) -> None:
        nonlocal done
        await call.done.wait()
        done += 1
        finished.notify()

    async with trio.open_nursery() as waiting:
        for call in calls:
            waiting.start_soon(one, call)
        await finished.wait_for(lambda: done >= count, timeout_s=60, what=f"{count} buyer calls ended")
        waiting.cancel_scope.cancel()


def charge_for(call: BuyerCall) -> int:
    return billing.charge(
        price=SMOLLM2_135M.price,
        usage=billing.Usage(prompt_tokens=call.usage.prompt_tokens, completion_tokens=call.usage.completion_tokens),
    )
