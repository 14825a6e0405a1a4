"""The gateway end to end with the official OpenAI and Anthropic SDKs as clients.

Real hypercorn, real websockets, a real miner (the miner role's link and handler on the
reference server with SmolLM2), the real SQLite store. Balances are checked to the micro-dollar
against `billing.charge` of the usage the buyer was told. Paths a small model will not produce
on demand (tool calls, a miner dying mid-stream) use the synthetic miner — the same link and
protocol with a scripted answer.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

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
from engy_node.miner.serving import RequestHandler
from engy_node.models import SMOLLM2_135M
from engy_node.serve.client import ServeClient
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import MinerCrashed, Script, SyntheticHandler, synthetic_link
from tests.waiting import wait_until_async

MODEL = "smollm2-135m"
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
PRICE = SMOLLM2_135M.price


class Network:
    def __init__(self, config, urls, store: Store, served) -> None:
        self.config = config
        self.urls = urls
        self.store = store
        self.served = served
        self.api = urls.buyer_url + "/v1"

    def buyer(self, dollars: float = 1.0) -> tuple[int, str]:
        account_id, key = self.store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
        if dollars:
            self.store.credit(account_id, micro_usd=int(dollars * 1_000_000))
        return account_id, key

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.api, api_key=key, max_retries=0, timeout=120)

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.urls.buyer_url, api_key=key, max_retries=0, timeout=120)

    async def add_real_miner(self, nursery, serve_url: str, http) -> None:
        _, miner_key = self.store.register_miner(f"miner-{uuid.uuid4().hex[:6]}")
        from engy_node.miner.link import GatewayLink
        from engy_node.protocol.miner import Capacity

        handler = RequestHandler(model=self.served, serve=lambda: ServeClient(serve_url, http))
        link = GatewayLink(
            gateway_url=self.urls.miner_url,
            identity=Identity(miner_key=miner_key),
            http=http,
            handler=handler,
            settings=FAST,
            limits=Capacity(0, 4, 6144, 2048, 600),
            hello={
                "model": MODEL,
                "model_root": self.served.model_root,
                "hw": {},
                "versions": {},
                "worker_name": "real",
                "worker_id": uuid.uuid4().hex,
            },
        )
        await nursery.start(link.run)

    async def add_synthetic_miner(self, nursery, script, http, *, name="synthetic") -> SyntheticHandler:
        _, miner_key = self.store.register_miner(f"{name}-{uuid.uuid4().hex[:6]}")
        handler = SyntheticHandler(self.served, script)
        link = synthetic_link(
            gateway_url=self.urls.miner_url,
            model=self.served,
            identity=Identity(miner_key=miner_key),
            handler=handler,
            http=http,
            settings=FAST,
            worker_name=name,
        )
        await nursery.start(link.run)
        return handler

    def books_balance(self, account_id: int) -> None:
        balance = self.store.balance(account_id)
        assert balance.held == 0
        assert balance.credited == balance.charged + balance.available


@pytest.fixture
async def network(nursery, tmp_path, checkpoint):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False}},
    )
    urls = await nursery.start(run_gateway, config, Hub())
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    yield Network(config, urls, store, served)
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


async def test_an_openai_completion_is_served_and_billed_to_the_micro_dollar(nursery, network, http, reference_server):
    await network.add_real_miner(nursery, reference_server.url, http)
    account, key = network.buyer(1.0)
    client = network.openai(key)
    completion = await trio.to_thread.run_sync(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        )
    )
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    usage = usage_of(completion)
    assert usage.prompt_tokens > 10 and usage.completion_tokens > 3
    assert network.store.balance(account).charged == billing.charge(price=PRICE, usage=usage)
    network.books_balance(account)


async def test_an_openai_stream_with_usage_matches_the_non_stream_answer(nursery, network, http, reference_server):
    await network.add_real_miner(nursery, reference_server.url, http)
    account, key = network.buyer(1.0)
    client = network.openai(key)
    messages = [{"role": "user", "content": "Name three colours."}]

    def stream():
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        return chunks

    chunks = await trio.to_thread.run_sync(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    whole = await trio.to_thread.run_sync(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    )
    assert text == whole.choices[0].message.content
    charged = network.store.balance(account).charged
    assert charged == billing.charge(price=PRICE, usage=usage_of(chunks[-1])) + billing.charge(
        price=PRICE, usage=usage_of(whole)
    )


async def test_anthropic_messages_stream_and_count_tokens(nursery, network, http, reference_server):
    await network.add_real_miner(nursery, reference_server.url, http)
    account, key = network.buyer(1.0)
    client = network.anthropic(key)
    message = await trio.to_thread.run_sync(
        lambda: client.messages.create(
            model=MODEL,
            max_tokens=32,
            system="You are terse.",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    )
    # What the 135M model says here depends on the CPU's bf16 kernels (on an EPYC without
    # AVX512-BF16 it is not "Paris"); the stream must say exactly the same, checked below.
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.stop_reason == "end_turn"

    def streamed():
        with client.messages.stream(
            model=MODEL,
            max_tokens=32,
            system="You are terse.",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        ) as stream:
            return stream.get_final_message()

    final = await trio.to_thread.run_sync(streamed)
    assert final.content[0].text == message.content[0].text
    # The second time the prompt is read from the serve's prefix cache; Anthropic's input_tokens
    # counts only what was not.
    prompt_tokens = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert (
        final.usage.cache_read_input_tokens
        and final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt_tokens
    )
    count = await trio.to_thread.run_sync(
        lambda: client.messages.count_tokens(
            model=MODEL,
            system="You are terse.",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    )
    assert count.input_tokens == prompt_tokens
    spent = sum(
        billing.charge(
            price=PRICE,
            usage=Usage(prompt_tokens, answer.usage.output_tokens, answer.usage.cache_read_input_tokens or 0),
        )
        for answer in (message, final)
    )
    assert network.store.balance(account).charged == spent
    network.books_balance(account)


async def test_errors_come_back_in_each_apis_shape(nursery, network, http):
    account, key = network.buyer(1.0)
    client = network.openai(key)

    def ask(**kw):
        return trio.to_thread.run_sync(
            lambda: client.chat.completions.create(
                model=kw.get("model", MODEL),
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=kw.get("max_tokens", 8),
            )
        )

    with pytest.raises(openai.AuthenticationError):
        await trio.to_thread.run_sync(
            lambda: network.openai("engy-sk-nope").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        )
    with pytest.raises(openai.NotFoundError):
        await ask(model="gpt-9")
    with pytest.raises(openai.BadRequestError):
        await ask(max_tokens=10**6)
    with pytest.raises(openai.InternalServerError) as no_miner:
        await ask()
    assert no_miner.value.status_code == 503 and no_miner.value.response.headers["retry-after"]
    with pytest.raises(anthropic.InternalServerError) as overloaded:
        await trio.to_thread.run_sync(
            lambda: network.anthropic(key).messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        )
    assert overloaded.value.status_code == 529
    _, broke = network.buyer(0)
    with pytest.raises(openai.APIStatusError) as billing_error:
        await trio.to_thread.run_sync(
            lambda: network.openai(broke).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        )
    assert billing_error.value.status_code == 402
    assert (await http.get(network.api + "/chat/completions")).status_code == 405
    assert (await http.post(network.api + "/models")).status_code == 405
    assert (await http.post(network.api + "/chat/completion")).status_code == 404
    network.books_balance(account)


async def test_concurrent_requests_racing_a_small_balance_never_overspend(nursery, network, http):
    await network.add_synthetic_miner(nursery, lambda frame: Script(text="ok " * 20, delay_s=0.01), http)
    hold = billing.worst_case_hold(price=PRICE, prompt_tokens=40, max_tokens=1000)
    account, key = network.buyer(0)
    network.store.credit(account, micro_usd=int(hold * 2.5))
    client = network.openai(key)
    outcomes: list[str] = []

    async def one():
        try:
            await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=1000, stream=False
                )
            )
            outcomes.append("ok")
        except openai.APIStatusError as error:
            outcomes.append(str(error.status_code))

    async with trio.open_nursery() as burst:
        for _ in range(8):
            burst.start_soon(one)
    assert "402" in outcomes and "ok" in outcomes
    balance = network.store.balance(account)
    assert balance.charged <= int(hold * 2.5)
    network.books_balance(account)


async def test_tool_calls_and_reasoning_reach_both_sdks(nursery, network, http):
    answer = (
        "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    await network.add_synthetic_miner(nursery, lambda frame: Script(text=answer), http)
    _, key = network.buyer(1.0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    completion = await trio.to_thread.run_sync(
        lambda: network.openai(key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=64
        )
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris"}'

    def streamed():
        with network.anthropic(key).messages.stream(
            model=MODEL,
            max_tokens=64,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
        ) as stream:
            return stream.get_final_message()

    message = await trio.to_thread.run_sync(streamed)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == {"city": "Paris"} and message.stop_reason == "tool_use"


PARTS_ANSWER = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
"""A Qwen3-Coder-style answer: reasoning, text, and a call in the XML format."""
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_sent_in_parts_reaches_both_sdks_as_its_proof_says_it(nursery, network, http, stream):
    # The newest public miner: reasoning_content, whole tool_calls, content null or alone.
    await network.add_synthetic_miner(nursery, lambda frame: Script(text=PARTS_ANSWER, in_parts=True), http)
    account, key = network.buyer(1.0)

    def openai_call():
        client = network.openai(key)
        request = dict(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, max_tokens=128
        )
        if not stream:
            return client.chat.completions.create(**request)
        with client.chat.completions.stream(stream_options={"include_usage": True}, **request) as events:
            return events.get_final_completion()

    completion = await trio.to_thread.run_sync(openai_call)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris", "days": 2}'
    assert getattr(choice.message, "reasoning_content", None) == "The user wants the weather."
    assert 0 < completion.usage.completion_tokens_details.reasoning_tokens < completion.usage.completion_tokens

    def anthropic_call():
        client = network.anthropic(key)
        request = dict(
            model=MODEL,
            max_tokens=128,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[
                {"name": "get_weather", "description": "Weather", "input_schema": WEATHER[0]["function"]["parameters"]}
            ],
        )
        if not stream:
            return client.messages.create(**request)
        with client.messages.stream(**request) as events:
            return events.get_final_message()

    message = await trio.to_thread.run_sync(anthropic_call)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Paris", "days": 2} and message.stop_reason == "tool_use"
    assert network.store.balance(account).charged > 0
    network.books_balance(account)


async def test_parts_that_say_something_the_proof_does_not_are_refused_uncharged(nursery, network, http):
    def lie(message: dict) -> dict:
        call = message["tool_calls"][0]
        return {
            **message,
            "tool_calls": [{**call, "function": {**call["function"], "arguments": '{"city": "Lyon", "days": 2}'}}],
        }

    await network.add_synthetic_miner(
        nursery, lambda frame: Script(text=PARTS_ANSWER, in_parts=True, lie_in_parts=lie), http
    )
    account, key = network.buyer(1.0)
    with pytest.raises(openai.APIStatusError) as refused:
        await trio.to_thread.run_sync(
            lambda: network.openai(key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, max_tokens=128
            )
        )
    assert refused.value.status_code == 502 and "not what it proved" in str(refused.value)
    assert network.store.balance(account).charged == 0


async def test_a_request_the_model_cannot_serve_reaches_the_buyer_with_the_miners_status_and_is_not_the_miners_failure(
    nursery, network, http
):
    refused = await network.add_synthetic_miner(
        nursery, lambda frame: Script(refuse=("the prompt is 9000 tokens; this model's context is 8192", 400)), http
    )
    account, key = network.buyer(1.0)
    with pytest.raises(openai.BadRequestError) as openai_refusal:
        await trio.to_thread.run_sync(
            lambda: network.openai(key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        )
    assert "this model's context is 8192" in str(openai_refusal.value)
    with pytest.raises(anthropic.BadRequestError) as anthropic_refusal:
        await trio.to_thread.run_sync(
            lambda: network.anthropic(key).messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        )
    assert anthropic_refusal.value.status_code == 400
    assert len(refused.served) == 2, "a request at fault is not retried on another miner"
    assert network.store.balance(account).charged == 0

    async def logged() -> bool:
        return len(network.store.requests_after(0, limit=10)) == 2

    await wait_until_async(logged, timeout_s=30, what="both refusals in the request log")
    rows = [entry for _, entry in network.store.requests_after(0, limit=10)]
    assert [row.status for row in rows] == [400, 400] and all(row.miner for row in rows)


async def test_a_buyer_hanging_up_cancels_the_miner_and_pays_only_for_what_was_relayed(
    nursery, network, http, reference_server, holds_closed
):
    await network.add_real_miner(nursery, reference_server.url, http)
    account, key = network.buyer(1.0)
    received = []

    def hang_up_early():
        stream = network.openai(key).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a very long story about a dragon."}],
            max_tokens=1500,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
            if len(received) >= 3:
                stream.close()
                return

    await trio.to_thread.run_sync(hang_up_early)

    async def none_running() -> bool:
        info = (await http.get(f"{reference_server.url}/server_info")).json()
        return info["internal_states"][0]["num_running_reqs"] == 0

    # The server is another process and says nothing when it drops a generation: its request
    # counter is the only view of that, so this wait is a bounded poll.
    await wait_until_async(none_running, timeout_s=30, what="the abandoned generation aborted on the server")
    await holds_closed.wait_for(
        lambda: not network.store.balance(account).held, timeout_s=30, what="the hung-up request settled"
    )
    charged = network.store.balance(account).charged
    full_hold = billing.worst_case_hold(price=PRICE, prompt_tokens=60, max_tokens=1500)
    assert 0 < charged < full_hold / 5, "charged for a few relayed tokens, not the whole budget"
    network.books_balance(account)


async def test_a_miner_dying_mid_stream_gives_an_in_band_error_and_a_partial_charge(
    nursery, network, http, holds_closed
):
    crashing = Script(text="partial answer that never finishes " * 4, chunk_chars=6, fail_after_chunks=3, delay_s=0.05)

    _, miner_key = network.store.register_miner("crashy")
    link = synthetic_link(
        gateway_url=network.urls.miner_url,
        model=network.served,
        identity=Identity(miner_key=miner_key),
        handler=SyntheticHandler(network.served, lambda frame: crashing),
        http=http,
        settings=FAST,
    )

    async def crashing_miner(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await link.run(task_status=task_status)
        except* MinerCrashed:
            pass

    async with trio.open_nursery() as nursery_inner:
        await nursery_inner.start(crashing_miner)
        account, key = network.buyer(1.0)
        received = []

        def consume():
            stream = network.openai(key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=200, stream=True
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received.append(chunk.choices[0].delta.content)

        with pytest.raises(openai.APIError):
            await trio.to_thread.run_sync(consume)
        nursery_inner.cancel_scope.cancel()
    assert "".join(received) == "partial answer that never finishes "[:18]
    await holds_closed.wait_for(
        lambda: not network.store.balance(account).held, timeout_s=10, what="the broken stream settled"
    )
    balance = network.store.balance(account)
    assert 0 < balance.charged < billing.worst_case_hold(price=PRICE, prompt_tokens=30, max_tokens=200)
    network.books_balance(account)


async def test_no_prompt_or_completion_text_reaches_the_disk(nursery, network, http, reference_server):
    marker = "zebra-" + uuid.uuid4().hex[:10]
    await network.add_synthetic_miner(nursery, lambda frame: Script(text=f"reply {marker[::-1]} done"), http)
    _, key = network.buyer(1.0)
    await trio.to_thread.run_sync(
        lambda: network.openai(key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"please remember {marker}"}], max_tokens=32
        )
    )
    network.store.close()
    for path in Path(network.config.paths.data_dir).rglob("*"):
        if path.is_file() and path.suffix not in (".safetensors",):
            data = path.read_bytes()
            assert marker.encode() not in data and marker[::-1].encode() not in data, f"content found in {path}"
