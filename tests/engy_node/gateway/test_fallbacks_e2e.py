"""Fallback models and `/v1/models` through the real gateway, with the official SDKs as clients.

The catalog serves one model a CPU can run, so a second one is registered for these tests: the
same embedded checkpoint (its tokenizer and identity) under another id and another price card,
so a charge at the wrong model's price shows. Synthetic miners (the real link and protocol, a
scripted answer) serve each; the first model's miner takes one request at a time and holds it
until the test lets go, which is how "no room" is made without timing anything.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import anthropic
import httpx
import openai
import pytest
import trio

from engy_node.config import load_config
from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing import billing
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.miner.link import Identity, LinkSettings
from engy_node.models import CATALOG, SMOLLM2_135M, PriceCard
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link

FIRST = SMOLLM2_135M
SECOND = dataclasses.replace(
    SMOLLM2_135M,
    id="smollm2-135m-fallback",
    display_name="SmolLM2-135M (fallback test twin)",
    price=PriceCard(input_per_m=40_000, cached_input_per_m=9_000, output_per_m=70_000),
)
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
MESSAGES = [{"role": "user", "content": "Say hello."}]


class Held(SyntheticHandler):
    """A miner that takes a request and answers it only once `release` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.arrived = trio.Event()
        self.release = trio.Event()

    async def handle(self, frame, send) -> None:
        self.arrived.set()
        with trio.fail_after(60):
            await self.release.wait()
        await super().handle(frame, send)


class Network:
    def __init__(self, urls, store: Store, served) -> None:
        self.urls = urls
        self.store = store
        self.served = served
        """model id -> its ServedModel (the same checkpoint under each spec)."""

    def buyer(self) -> tuple[int, str]:
        account_id, key = self.store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
        self.store.credit(account_id, micro_usd=1_000_000)
        return account_id, key

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls.buyer_url + "/v1", api_key=key, max_retries=0, timeout=120)

    async def miner(self, nursery, http, model: str, handler_class=SyntheticHandler, **link) -> SyntheticHandler:
        _, miner_key = self.store.register_miner(f"miner-{uuid.uuid4().hex[:6]}")
        handler = handler_class(self.served[model], lambda frame: Script(text=f"Hello from {model}."))
        await nursery.start(
            synthetic_link(
                gateway_url=self.urls.miner_url,
                model=self.served[model],
                identity=Identity(miner_key=miner_key),
                handler=handler,
                http=http,
                settings=FAST,
                worker_name=model,
                **link,
            ).run
        )
        return handler

    async def until_listed(self, client: openai.OpenAI, condition) -> list:
        """`/v1/models` once `condition` holds of it (a miner's leg is admitted asynchronously)."""
        with trio.fail_after(30):
            while not condition(listed := await trio.to_thread.run_sync(lambda: list(client.models.list()))):
                await trio.sleep(0.05)
        return listed


@pytest.fixture
async def network(nursery, tmp_path, checkpoint, monkeypatch):
    monkeypatch.setitem(CATALOG, SECOND.id, SECOND)
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
                "models": f"{FIRST.id},{SECOND.id}",
            }
        },
    )
    urls = await nursery.start(run_gateway, config, Hub())
    store = Store.open(store_path(config))
    first = await trio.to_thread.run_sync(load_served_model, FIRST, checkpoint)
    yield Network(urls, store, {FIRST.id: first, SECOND.id: dataclasses.replace(first, spec=SECOND)})
    store.close()


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=120) as client:
        yield client


def usage_of(completion) -> Usage:
    details = completion.usage.prompt_tokens_details
    return Usage(
        prompt_tokens=completion.usage.prompt_tokens,
        completion_tokens=completion.usage.completion_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
    )


def ask(client: openai.OpenAI, **fields):
    """A completion with its raw response, so the test reads headers too."""
    raw = client.chat.completions.with_raw_response.create(messages=MESSAGES, max_tokens=16, **fields)
    return raw.headers.get("x-engy-model"), raw.parse()


async def test_the_first_model_with_room_serves_and_the_buyer_pays_that_models_price(nursery, network, http):
    held = await network.miner(nursery, http, FIRST.id, Held, max_inflight=1)
    await network.miner(nursery, http, SECOND.id)
    fallback = {"models": [FIRST.id, SECOND.id]}

    # The first model's only slot is taken: the fallback serves, at its own price.
    occupier_account, occupier_key = network.buyer()
    occupied: list = []

    async def occupy() -> None:
        occupied.append(await trio.to_thread.run_sync(lambda: ask(network.openai(occupier_key), model=FIRST.id)))

    nursery.start_soon(occupy)
    with trio.fail_after(30):
        await held.arrived.wait()
    account, key = network.buyer()
    header, completion = await trio.to_thread.run_sync(
        lambda: ask(network.openai(key), model=FIRST.id, extra_body=fallback)
    )
    assert (header, completion.model) == (SECOND.id, SECOND.id)
    assert completion.choices[0].message.content == f"Hello from {SECOND.id}."
    balance = network.store.balance(account)
    assert balance.charged == billing.charge(price=SECOND.price, usage=usage_of(completion)) > 0
    assert balance.held == 0

    # Its slot free again, the first model serves, at its own price.
    held.release.set()
    with trio.fail_after(60):
        while not occupied:
            await trio.sleep(0.05)
    header, first = occupied[0]
    assert (header, first.model) == (FIRST.id, FIRST.id)
    again_account, again_key = network.buyer()
    header, completion = await trio.to_thread.run_sync(
        lambda: ask(network.openai(again_key), model=FIRST.id, extra_body=fallback)
    )
    assert (header, completion.model) == (FIRST.id, FIRST.id)
    assert network.store.balance(again_account).charged == billing.charge(price=FIRST.price, usage=usage_of(completion))
    assert network.store.balance(occupier_account).charged == billing.charge(price=FIRST.price, usage=usage_of(first))


async def test_a_stream_falls_back_when_the_first_model_has_no_miner(nursery, network, http):
    await network.miner(nursery, http, SECOND.id)
    client = network.openai(network.buyer()[1])

    def stream():
        with client.chat.completions.with_streaming_response.create(
            model=FIRST.id,
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"models": [FIRST.id, SECOND.id]},
        ) as response:
            return response.headers.get("x-engy-model"), list(response.parse())

    header, chunks = await trio.to_thread.run_sync(stream)
    assert header == SECOND.id and {chunk.model for chunk in chunks} == {SECOND.id}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"Hello from {SECOND.id}."


async def test_the_anthropic_route_takes_the_same_models(nursery, network, http):
    await network.miner(nursery, http, SECOND.id)
    account, key = network.buyer()
    client = anthropic.Anthropic(base_url=network.urls.buyer_url, api_key=key, max_retries=0, timeout=120)
    raw = await trio.to_thread.run_sync(
        lambda: client.messages.with_raw_response.create(
            model=FIRST.id, max_tokens=16, messages=MESSAGES, extra_body={"models": [FIRST.id, SECOND.id]}
        )
    )
    message = raw.parse()
    assert (raw.headers.get("x-engy-model"), message.model) == (SECOND.id, SECOND.id)
    usage = Usage(
        prompt_tokens=message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0),
        completion_tokens=message.usage.output_tokens,
        cached_tokens=message.usage.cache_read_input_tokens or 0,
    )
    assert network.store.balance(account).charged == billing.charge(price=SECOND.price, usage=usage)


async def test_a_bad_models_field_is_refused_naming_the_fix(nursery, network, http):
    client = network.openai(network.buyer()[1])
    with pytest.raises(openai.NotFoundError) as caught:
        await trio.to_thread.run_sync(lambda: ask(client, model=FIRST.id, extra_body={"models": [FIRST.id, "gpt-9"]}))
    assert "name only served models" in caught.value.message
    assert caught.value.body["param"] == "models[1]"


async def test_the_model_list_shows_context_prices_and_which_proofs_verify_each(nursery, network, http):
    client = network.openai(network.buyer()[1])
    listed = {model.id: model for model in await trio.to_thread.run_sync(lambda: list(client.models.list()))}
    assert set(listed) == {FIRST.id, SECOND.id}
    second = listed[SECOND.id].model_extra
    assert second["context_length"] == SECOND.context_length
    assert second["pricing"] == {"prompt": "0.00000004", "completion": "0.00000007", "input_cache_read": "0.000000009"}
    assert second["price_micro_usd_per_million"] == {"input": 40_000, "cached_input": 9_000, "output": 70_000}
    assert second["verification"] == ["toploc"]

    # A miner of the second model that takes GEMM audits connects: its answers can be GEMM-audited.
    await network.miner(nursery, http, SECOND.id, gemm_audits=True)
    listed = await network.until_listed(
        client, lambda listed: any(m.id == SECOND.id and "gemm" in m.model_extra["verification"] for m in listed)
    )
    verification = {model.id: model.model_extra["verification"] for model in listed}
    assert verification == {FIRST.id: ["toploc"], SECOND.id: ["toploc", "gemm"]}
    retrieved = await trio.to_thread.run_sync(lambda: client.models.retrieve(SECOND.id))
    assert retrieved.model_extra["verification"] == ["toploc", "gemm"]
