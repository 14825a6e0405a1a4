"""A miner that stalls after its first chunk: its leg stays alive (heartbeats go on), the request
it holds produces nothing more. The buyer keeps getting keepalives rather than a dead socket,
other requests, to the same miner too, are served meanwhile, and when the buyer gives up the
miner is told to cancel and the buyer pays only for what reached it.

The gateway is a real process; the stalling miner is the synthetic one, held by a `Gate` that is
never released (the stall) before its second chunk.
"""

from __future__ import annotations

import httpx
import trio

from engy_node.gateway.billing import billing
from engy_node.models import SMOLLM2_135M
from engy_node.testing.faults import Gate, account_row, check_books
from tests.faults.conftest import BuyerCall, gate_by_content, new_buyer, plain_script, start_synthetic_miner, words
from tests.waiting import wait_until_async

ANSWER = words(10)
KEEPALIVE = b": keep-alive"
MAX_TOKENS = 2000
"""A large worst case, so that paying for one relayed chunk is visibly a small part of the hold."""


async def test_a_miner_stalling_after_its_first_chunk_keeps_the_buyer_alive_and_a_hang_up_pays_only_what_was_relayed(
    nursery, shared_gateway, served, figures
):
    gateway = shared_gateway
    stalled = Gate(before_chunk=1)
    async with httpx.AsyncClient(timeout=60) as http:
        miner = await start_synthetic_miner(
            nursery,
            store_path=gateway.store_path,
            miner_url=gateway.miner_url,
            served=served,
            http=http,
            script=lambda frame: plain_script(ANSWER),
            gate_for=gate_by_content({"stall after the first chunk": stalled}),
        )
        account_id, key = new_buyer(gateway.store_path)
        _, other_key = new_buyer(gateway.store_path)
        body = {
            "model": SMOLLM2_135M.id,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "messages": [{"role": "user", "content": "stall after the first chunk"}],
        }
        keepalives = 0
        relayed = b""
        async with http.stream(
            "POST", gateway.buyer_url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as response:
            assert response.status_code == 200
            with trio.fail_after(30):
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        relayed += line.encode()
                    keepalives += line.encode().startswith(KEEPALIVE)
                    # Two keepalives after the stall: the gateway is still there for this buyer.
                    if stalled.reached.is_set() and keepalives >= 2:
                        break
            others = [
                BuyerCall(api=gateway.buyer_url + "/v1", key=other_key, content=f"meanwhile {index}")
                for index in range(3)
            ]
            for call in others:
                await call.run()
                assert call.error is None and call.text == ANSWER, "the stalled request holds up no one else"
        # The buyer hung up (the stream is closed): the gateway tells the miner to stop at once.
        with trio.fail_after(30):
            await stalled.cancelled.wait()

    hold = billing.worst_case_hold(
        price=SMOLLM2_135M.price,
        prompt_tokens=len(served.render_prompt(miner.handler.served[0].request)),
        max_tokens=MAX_TOKENS,
    )

    def settled() -> bool:
        return account_row(gateway.store_path, account_id).held == 0

    # The settle happens in the gateway process, which announces it nowhere this test can listen.
    await wait_until_async(settled, timeout_s=30, what="the hung-up request settled")
    charged = account_row(gateway.store_path, account_id).charged
    assert 0 < charged < hold, f"charged {charged} µUSD for the first chunk relayed, not the whole {hold} µUSD hold"
    books = check_books(gateway.store_path, open_holds_allowed=False)
    assert ANSWER[:6].encode() in relayed, "the first chunk reached the buyer before the stall"
    figures.record(
        "miner stalling after its first chunk",
        f"{keepalives} keepalives to the buyer",
        f", {len(others)} other requests served meanwhile, hang-up charged {charged} of a {hold} µUSD hold; "
        f"books: {books.holds} holds, none open",
    )
