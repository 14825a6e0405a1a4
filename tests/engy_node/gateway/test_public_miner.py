"""Our gateway with the public one-file miner as its only miner (`public_peer.PublicMiner`).

The miner speaks the public release's exact frames — float capacity numbers, capacity in every
heartbeat, string hardware, `versions: {}`, always greedy, `finish_reason: "stop"` at the token
limit — and generates on the reference server. The gateway must admit it, keep it across several
heartbeats, serve streamed and plain requests through it, and correct what it gets wrong: the
buyer sees `length` (Anthropic `max_tokens`) at the limit and stop strings honoured, and pays
only up to the stop.
"""

from __future__ import annotations

import os
import sqlite3
import uuid

import anthropic
import httpx
import openai
import pytest
import trio

from engy_node.config import load_config
from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing import billing
from engy_node.gateway.role import store_path
from engy_node.gateway.store import Store
from engy_node.models import SMOLLM2_135M
from engy_node.serve.client import ServeClient
from engy_node.served_model import load_served_model

from .conftest import StoppableGateway
from .public_peer import PublicMiner

MODEL = SMOLLM2_135M.id
HEARTBEAT_S = 0.2
STALE_AFTER_S = 1.0
"""Five heartbeat intervals: a leg whose heartbeats the gateway refused would be gone by then."""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def gateway(nursery, tmp_path, checkpoint, reference_server, running):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={
            "gateway": {
                "port": 0,
                "miner_port": 0,
                "provider_port": 0,
                "qualification": False,
                "stale_after_s": STALE_AFTER_S,
            }
        },
    )
    urls = await nursery.start(running.run, config)
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    async with httpx.AsyncClient(timeout=120) as http:
        _, miner_key = store.register_miner("public-miner")
        miner = PublicMiner(
            url=urls.miner_url,
            miner_key=miner_key,
            model=served,
            serve=ServeClient(reference_server.url, http),
            heartbeat_s=HEARTBEAT_S,
        )
        await nursery.start(miner.run)
        yield urls, store, miner
    store.close()


def store_path_of(home) -> os.PathLike:
    return store_path(load_config(home=home, env={}))


def buyer(store: Store) -> tuple[int, str]:
    account_id, key = store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
    store.credit(account_id, micro_usd=1_000_000)
    return account_id, key


def openai_client(urls, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=urls.buyer_url + "/v1", api_key=key, max_retries=0, timeout=120)


def anthropic_client(urls, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=urls.buyer_url, api_key=key, max_retries=0, timeout=120)


async def test_it_is_admitted_and_stays_admitted_across_heartbeats(gateway):
    urls, store, miner = gateway
    while miner.heartbeats_sent < 3 * STALE_AFTER_S / HEARTBEAT_S:
        with trio.fail_after(5):
            await miner.heartbeat_sent.wait()
    assert not miner.closed.is_set(), f"the gateway closed the public miner's leg: {miner.close_reason}"
    async with httpx.AsyncClient() as http:
        health = (await http.get(urls.buyer_url + "/health")).json()
    assert health["miners"] == 1
    _, key = buyer(store)
    completion = await trio.to_thread.run_sync(
        lambda: openai_client(urls, key).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32)
    )
    assert "Paris" in completion.choices[0].message.content


async def test_plain_and_streamed_answers_are_relayed(gateway):
    urls, store, miner = gateway
    _, key = buyer(store)
    client = openai_client(urls, key)
    plain = await trio.to_thread.run_sync(
        lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32)
    )

    def stream() -> tuple[str, str | None]:
        text, finish = "", None
        for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    streamed, finish = await trio.to_thread.run_sync(stream)
    assert streamed == plain.choices[0].message.content
    assert "Paris" in streamed
    assert finish == plain.choices[0].finish_reason == "stop"
    assert len(miner.served) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_cut_by_max_tokens_finishes_with_length(gateway, stream):
    urls, store, _ = gateway
    _, key = buyer(store)

    def ask_openai() -> str | None:
        client = openai_client(urls, key)
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3).choices[0].finish_reason
        finish = None
        for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, stream=True):
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        return finish

    def ask_anthropic() -> str | None:
        client = anthropic_client(urls, key)
        if not stream:
            return client.messages.create(model=MODEL, messages=QUESTION, max_tokens=3).stop_reason
        with client.messages.stream(model=MODEL, messages=QUESTION, max_tokens=3) as events:
            return events.get_final_message().stop_reason

    assert await trio.to_thread.run_sync(ask_openai) == "length"
    assert await trio.to_thread.run_sync(ask_anthropic) == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_it_ignores_are_honoured_and_billing_stops_there(gateway, stream):
    urls, store, miner = gateway
    account, key = buyer(store)
    client = openai_client(urls, key)
    whole = await trio.to_thread.run_sync(
        lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32)
    )
    assert "Paris" in whole.choices[0].message.content
    before = store.balance(account).charged

    def ask() -> tuple[str, str | None, Usage]:
        if not stream:
            reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, stop=["Paris"])
            return (
                reply.choices[0].message.content,
                reply.choices[0].finish_reason,
                Usage(reply.usage.prompt_tokens, reply.usage.completion_tokens),
            )
        text, finish, usage = "", None, None
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=32,
            stop=["Paris"],
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = Usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        return text, finish, usage

    text, finish, usage = await trio.to_thread.run_sync(ask)
    assert miner.served[-1]["sampling"]["stop"] == ["Paris"], "the gateway still tells the miner"
    expected = whole.choices[0].message.content.split("Paris")[0]
    assert text == expected
    assert finish == "stop"
    assert usage.completion_tokens < whole.usage.completion_tokens
    assert store.balance(account).charged - before == billing.charge(price=SMOLLM2_135M.price, usage=usage)
    balance = store.balance(account)
    assert balance.held == 0 and balance.credited == balance.charged + balance.available

    reply = await trio.to_thread.run_sync(
        lambda: anthropic_client(urls, key).messages.create(
            model=MODEL, messages=QUESTION, max_tokens=32, stop_sequences=["Paris"]
        )
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "Paris"
    assert reply.content[0].text == expected


async def request_log(running: StoppableGateway, path) -> list[tuple]:
    """(miner, status, served_greedily) of every logged request, once the gateway has stopped."""
    await running.stop()
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT miner, status, served_greedily FROM request_log ORDER BY id").fetchall()


async def test_a_sampled_request_it_answers_greedily_is_served_and_recorded(gateway, running, tmp_path):
    urls, store, miner = gateway
    _, key = buyer(store)
    reply = await trio.to_thread.run_sync(
        lambda: openai_client(urls, key).chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=16, temperature=0.8, seed=7
        )
    )
    assert reply.choices[0].message.content
    assert miner.served[-1]["sampling"]["temperature"] == 0.8
    assert miner.served[-1]["sampling"]["seed"] == 7, "the buyer's seed is kept"
    await trio.to_thread.run_sync(
        lambda: openai_client(urls, key).chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, temperature=0.8
        )
    )
    drawn = miner.served[-1]["sampling"]["seed"]
    assert isinstance(drawn, int) and 0 <= drawn < 2**63, "the gateway seeds every sampled request, for replay"
    rows = await request_log(running, store_path_of(tmp_path))
    assert [row[1:] for row in rows] == [(200, 1), (200, 1)], (
        "recorded as served greedily although the buyer asked to sample"
    )


async def test_requests_that_sample_or_pass_tools_go_to_a_miner_that_honours_them(
    gateway, running, nursery, tmp_path, checkpoint
):
    from engy_node.miner.link import Identity, LinkSettings
    from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link

    urls, store, miner = gateway
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    _, miner_key = store.register_miner("samples")
    handler = SyntheticHandler(served, lambda frame: Script(text="A sampled answer."))
    async with httpx.AsyncClient(timeout=30) as http:
        link = synthetic_link(
            gateway_url=urls.miner_url,
            model=served,
            identity=Identity(miner_key=miner_key),
            handler=handler,
            http=http,
            settings=LinkSettings(heartbeat_s=HEARTBEAT_S),
            worker_name="samples",
        )
        await nursery.start(link.run)
        _, key = buyer(store)
        client = openai_client(urls, key)
        for _ in range(4):
            reply = await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0.7)
            )
            assert reply.choices[0].message.content == "A sampled answer."
        tool = {
            "type": "function",
            "function": {
                "name": "capital",
                "description": "The capital of a country",
                "parameters": {"type": "object", "properties": {"country": {"type": "string"}}},
            },
        }
        reply = await trio.to_thread.run_sync(
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, tools=[tool])
        )
        assert reply.choices[0].message.content == "A sampled answer."
        assert len(handler.served) == 5 and not miner.served, "the public miner renders no tools into its prompt"
        rows = await request_log(running, store_path_of(tmp_path))
        assert [row[2] for row in rows] == [0, 0, 0, 0, 0]
