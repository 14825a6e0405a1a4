"""A real miner (`engy-node --role miner`, CPU mode: the reference model server as its supervised
child) serving a real gateway, and the two processes under it killed outright mid-stream.

The model server killed: the buyer's stream ends in-band with an error, the buyer pays only for
the text that reached it, the miner takes a 502 in the request log, and the supervisor starts a
new server that serves the next request. The miner killed: the same for the buyer, and its model
server goes with it (the lifeline), so nothing of the miner's home is left running or listening;
the gateway serves on through another miner.
"""

from __future__ import annotations

import re
import signal

import httpx
import psutil
import pytest
import trio

from engy_node.gateway.store import Store
from engy_node.testing.faults import ProcessAccount, check_books, holds_of
from tests.faults.conftest import BuyerCall, new_buyer, plain_script, register_miner, start_synthetic_miner, words
from tests.faults.nodes import MinerProcess
from tests.waiting import wait_until_async

STORY = "Tell me a very long story about a dragon who learns to sail."
MAX_TOKENS = 400
CHUNKS_BEFORE_THE_KILL = 3
CONTENT = re.compile(r'"content":"[^"]')
"""An SSE data line carrying answer text (the stream's first event carries an empty content)."""


@pytest.fixture(scope="module")
def miner_home(tmp_path_factory):
    return tmp_path_factory.mktemp("miner")


@pytest.fixture(scope="module")
def miner_account(miner_home):
    return ProcessAccount(miner_home)


@pytest.fixture(scope="module")
def miner(shared_gateway, miner_home, miner_account):
    miner = MinerProcess(
        miner_home,
        miner_account,
        gateway_url=shared_gateway.miner_url,
        miner_key=register_miner(shared_gateway.store_path, "cpu-miner"),
    )
    miner.start()
    yield miner
    miner.stop()
    miner_account.note_marked()
    assert miner_account.alive() == [], "every process of the miner's home has exited"
    assert miner_account.listening() == [], "no port the miner or its model server used still listens"


async def stream_until_chunks(call: BuyerCall, nursery: trio.Nursery, chunks: int) -> None:
    """Start `call` and return once `chunks` pieces of text have reached the buyer."""
    nursery.start_soon(call.run)
    with trio.fail_after(120):
        pieces = 0
        while pieces < chunks:
            await call.text_changed.wait()
            pieces += 1


async def settled_for_what_was_relayed(store_path, account_id: int, *, status: int = 502) -> tuple[int, int]:
    """Wait for the cut-off request's settle and its log row with `status` (the miner's 502, or a
    buyer's hang-up, 499); (charged, the hold it was charged from)."""

    # The gateway settles and logs in its own process, which announces neither where a test can
    # listen: bounded polls of the store.
    def settled() -> bool:
        holds = holds_of(store_path, account_id)
        return len(holds) == 1 and holds[0].charged is not None

    await wait_until_async(settled, timeout_s=60, what="the cut-off stream settled")

    def logged() -> bool:
        with Store.open(store_path) as store:
            return any(
                entry.status == status and entry.miner
                for entry in store.requests_in(since=0, until=2e9)
                if entry.account_id == account_id
            )

    await wait_until_async(logged, timeout_s=60, what=f"the request's {status} in the request log")
    [hold] = holds_of(store_path, account_id)
    return hold.charged, hold.amount


async def test_a_model_server_killed_mid_stream_cuts_the_stream_in_band_and_is_restarted(
    nursery, shared_gateway, miner, served, figures
):
    account_id, key = new_buyer(shared_gateway.store_path)
    call = BuyerCall(api=shared_gateway.buyer_url + "/v1", key=key, content=STORY, max_tokens=MAX_TOKENS)
    await stream_until_chunks(call, nursery, CHUNKS_BEFORE_THE_KILL)
    server_pid = miner.model_server_pid()
    miner.account.note(miner.pid)
    killed_at = trio.current_time()
    psutil.Process(server_pid).send_signal(signal.SIGKILL)
    await call.ended()
    assert call.told_of_a_failure and call.text, "the buyer got part of the answer, then an error in the stream"
    assert "mid-stream" in str(call.error), f"the error came in-band, from the gateway: {call.error!r}"
    charged, hold = await settled_for_what_was_relayed(shared_gateway.store_path, account_id)
    assert 0 < charged < hold, f"charged {charged} µUSD for what was relayed, not the {hold} µUSD worst case"

    restarted = await miner.wait_for_from_trio(
        re.compile(rf"model server ready on \S+ \(pid (?!{server_pid}\))\d+\)"),
        timeout_s=120,
        what="the supervisor's new model server ready",
    )
    back_after = trio.current_time() - killed_at
    miner.account.note(miner.pid)
    again = BuyerCall(
        api=shared_gateway.buyer_url + "/v1", key=key, content="What is the capital of France?", max_tokens=16
    )
    await again.run()
    assert again.error is None and again.text, again.error
    check_books(shared_gateway.store_path)
    figures.record(
        "model server kill -9 mid-stream",
        "in-band error",
        f" after {len(call.text)} chars; charged {charged} of a {hold} µUSD hold; miner logged 502",
    )
    figures.record("model server kill -9 -> new server ready", back_after, f" s ({restarted.group(0)})")


async def test_a_model_server_that_hangs_mid_stream_leaves_the_buyer_a_live_stream_and_a_hang_up_pays_what_was_relayed(
    nursery, shared_gateway, miner, figures
):
    """A hang is the server alive and silent: stopped (SIGSTOP), it holds its socket and produces
    nothing. Its supervisor restarts it once three health probes in a row have failed (each
    times out after 10 s at the defaults; tests/engy_node/miner/sglang/test_supervisor.py covers
    that); until then the buyer must keep a live stream and be able to give up without paying
    for tokens never produced."""
    account_id, key = new_buyer(shared_gateway.store_path)
    body = {
        "model": "smollm2-135m",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "messages": [{"role": "user", "content": STORY}],
    }
    server = psutil.Process(miner.model_server_pid())
    hung = False
    keepalives = 0
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream(
                "POST",
                shared_gateway.buyer_url + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
            ) as response:
                assert response.status_code == 200
                with trio.fail_after(120):
                    async for line in response.aiter_lines():
                        if not hung and CONTENT.search(line):
                            server.suspend()  # the first text reached the buyer: the server hangs now
                            hung = True
                        elif hung and line.startswith(": keep-alive"):
                            keepalives += 1
                            if keepalives >= 2:
                                break  # the buyer gives up, its connection closes
        # Settled while the server is still hung: a hang-up does not wait on the miner.
        charged, hold = await settled_for_what_was_relayed(shared_gateway.store_path, account_id, status=499)
    finally:
        if hung:
            server.resume()
    assert 0 < charged < hold, f"charged {charged} µUSD for what was relayed, not the {hold} µUSD worst case"
    again = BuyerCall(
        api=shared_gateway.buyer_url + "/v1", key=key, content="What is the capital of France?", max_tokens=16
    )
    await again.run()
    assert again.error is None and again.text, f"the server, going again, serves: {again.error!r}"
    check_books(shared_gateway.store_path)
    figures.record(
        "model server hang (SIGSTOP) mid-stream",
        f"{keepalives} keepalives to the buyer while hung",
        f"; hang-up charged {charged} of a {hold} µUSD hold",
    )


async def test_a_miner_killed_mid_stream_takes_its_model_server_with_it_and_the_gateway_serves_on(
    nursery, shared_gateway, miner, miner_account, served, figures
):
    account_id, key = new_buyer(shared_gateway.store_path)
    call = BuyerCall(api=shared_gateway.buyer_url + "/v1", key=key, content=STORY, max_tokens=MAX_TOKENS)
    await stream_until_chunks(call, nursery, CHUNKS_BEFORE_THE_KILL)
    miner_account.note(miner.pid)
    killed_at = trio.current_time()
    miner.kill()
    await call.ended()
    assert call.told_of_a_failure and call.text, "the buyer got part of the answer, then an error in the stream"
    assert "mid-stream" in str(call.error), f"the error came in-band, from the gateway: {call.error!r}"
    charged, hold = await settled_for_what_was_relayed(shared_gateway.store_path, account_id)
    assert 0 < charged < hold

    # The model server's lifeline watcher stops its group when the miner is gone; it is another
    # process that tells no one, so this is a bounded poll of the process table.
    miner_account.note_marked()
    await wait_until_async(
        lambda: miner_account.alive() == [], timeout_s=60, what="the model server gone with its miner"
    )
    gone_after = trio.current_time() - killed_at
    assert miner_account.listening() == [], "the model server's port is closed"

    async with httpx.AsyncClient(timeout=60) as http:
        await start_synthetic_miner(
            nursery,
            store_path=shared_gateway.store_path,
            miner_url=shared_gateway.miner_url,
            served=served,
            http=http,
            script=lambda frame: plain_script(words(6)),
        )
        again = BuyerCall(api=shared_gateway.buyer_url + "/v1", key=key, content="anyone else there?")
        await again.run()
        assert again.error is None and again.text == words(6), again.error
    check_books(shared_gateway.store_path)
    figures.record(
        "miner kill -9 mid-stream", "in-band error", f"; charged {charged} of a {hold} µUSD hold; miner logged 502"
    )
    figures.record("miner kill -9 -> its model server gone too", gone_after, " s")
