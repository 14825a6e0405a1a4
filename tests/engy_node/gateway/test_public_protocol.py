"""The live SN53 protocol, frame by frame, with every public miner and ours on one gateway.

The peers are the public one-file miner at release 0.4.4 and at its newest version, the newest
public TEE miner (`scripted_peers`: raw websocket frames in the shapes their source sends), and
this project's miner (the real `GatewayLink` with a scripted handler). Each is driven through
the frames of the live protocol: hello and admission, periodic and event heartbeats with their
`kv` block, streamed and whole answers, reasoning and tool calls in each peer's parts, cached
tokens, a cut at `max_tokens`, errors with and without a status, `cancel`, `reconnect` with the
old connection draining, and a frame over the size the old protocol allowed. The buyers are the
official `openai` and `anthropic` SDKs, and every charge is checked against the price card to
the micro-dollar.
"""

from __future__ import annotations

import json
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
from engy_node.gateway.role import store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.miner.link import Identity, LinkSettings
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import parse_gateway_frame
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link
from tests.sdk_usage import anthropic_usage, openai_usage

from .conftest import StoppableGateway
from .scripted_peers import DIALECTS, ENGY_MINER_0_4_4, ENGY_MINER_NEWEST, TEE_MINER_NEWEST, Answer, ScriptedPeer

MODEL = SMOLLM2_135M.id
PRICE = SMOLLM2_135M.price
OURS = "engy-node"
PEERS = [dialect.name for dialect in DIALECTS] + [OURS]
STRUCTURED = [ENGY_MINER_NEWEST.name, TEE_MINER_NEWEST.name, OURS]
"""The peers that send reasoning and tool calls apart from the text."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
QUESTION = [
    {"role": "system", "content": "You answer questions about cities, briefly and accurately."},
    {"role": "user", "content": "What is the capital of France?"},
]
TOOL_TURN = Answer(
    reasoning="The user wants the weather.",
    text="Let me check.",
    calls=(("get_weather", {"city": "Paris", "days": 2}),),
)
FAST = LinkSettings(heartbeat_s=0.5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)


class OurMiner:
    """This project's miner on the same footing as the scripted peers: the real link, with a
    handler that answers each request's `Answer` as our miner sends answers (in parts)."""

    def __init__(self, served, answer) -> None:
        self.served = served
        self.answer = answer
        self.handler = SyntheticHandler(served, self._script)

    def _script(self, frame) -> Script:
        answer = self.answer(frame.request.to_wire())
        if answer.error is not None:
            message, status = answer.error
            return Script(refuse=(message, status or 500))
        raw = answer.raw()
        if answer.cut_at_max_tokens:
            ids = self.served.tokenizer.encode(raw, add_special_tokens=False)[: frame.request.max_tokens]
            return Script(
                text=self.served.tokenizer.decode(ids),
                finish_reason="length",
                in_parts=True,
                cached_tokens=answer.cached_tokens,
            )
        return Script(text=raw, in_parts=True, cached_tokens=answer.cached_tokens)


class Network:
    def __init__(self, nursery, urls, store: Store, served, hub: Hub, http) -> None:
        self.nursery = nursery
        self.urls = urls
        self.store = store
        self.served = served
        self.hub = hub
        self.http = http

    async def peer(self, name: str, answer=lambda request: Answer(), **options):
        _, miner_key = self.store.register_miner(f"{name.split()[0]}-{uuid.uuid4().hex[:6]}")
        if name == OURS:
            ours = OurMiner(self.served, answer)
            link = synthetic_link(
                gateway_url=self.urls.miner_url,
                model=self.served,
                identity=Identity(miner_key=miner_key),
                handler=ours.handler,
                http=self.http,
                settings=FAST,
                worker_name="ours",
            )
            await self.nursery.start(link.run)
            return ours
        dialect = next(dialect for dialect in DIALECTS if dialect.name == name)
        peer = ScriptedPeer(
            dialect, url=self.urls.miner_url, miner_key=miner_key, model=self.served, answer=answer, **options
        )
        await self.nursery.start(peer.run)
        return peer

    def buyer(self) -> tuple[int, str]:
        account_id, key = self.store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
        self.store.credit(account_id, micro_usd=1_000_000)
        return account_id, key

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls.buyer_url + "/v1", api_key=key, max_retries=0, timeout=60)

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.urls.buyer_url, api_key=key, max_retries=0, timeout=60)

    def charged_as_told(self, account_id: int, *usages: Usage) -> None:
        balance = self.store.balance(account_id)
        assert balance.charged == sum(billing.charge(price=PRICE, usage=usage) for usage in usages)
        assert balance.held == 0 and balance.credited == balance.charged + balance.available


async def open_network(nursery, home: Path, checkpoint: Path, running: StoppableGateway, **gateway):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=home,
        env=env,
        overrides={
            "gateway": {
                "port": 0,
                "miner_port": 0,
                "provider_port": 0,
                "qualification": False,
                "queue_wait_s": 0.5,
                "drain_s": 5.0,
                **gateway,
            }
        },
    )
    hub = Hub()
    urls = await nursery.start(running.run, config, hub)
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    async with httpx.AsyncClient(timeout=60) as http:
        yield Network(nursery, urls, store, served, hub, http)
    store.close()


@pytest.fixture
async def network(nursery, tmp_path, checkpoint, running):
    async for opened in open_network(nursery, tmp_path, checkpoint, running):
        yield opened


TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{%- if call.function.arguments is string %}{{ call.function.arguments }}{% else %}{{ call.function.arguments | tojson }}{% endif %}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
"""A chat template in the manner of Qwen3's: it renders the tools, each history tool call's
arguments (an object with its own spacing), and an empty think block when thinking is off."""


@pytest.fixture
async def tools_network(nursery, tmp_path, checkpoint, running):
    """The gateway serving the embedded model under `TOOLS_TEMPLATE` (the same weights and
    model root: only the chat template differs), as it serves the catalog's Qwen models."""
    variant = tmp_path / "smollm2-135m-tools"
    variant.mkdir()
    for item in checkpoint.iterdir():
        if item.name != "chat_template.jinja":
            (variant / item.name).symlink_to(item.resolve())
    (variant / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    async for opened in open_network(nursery, tmp_path / "home", variant, running, checkpoints=f"{MODEL}={variant}"):
        yield opened


def ask_openai(client: openai.OpenAI, *, stream: bool, **request):
    request = {"model": MODEL, "max_tokens": 128, **request}
    if not stream:
        return client.chat.completions.create(**request)
    with client.chat.completions.stream(stream_options={"include_usage": True}, **request) as events:
        try:
            return events.get_final_completion()
        except openai.LengthFinishReasonError as cut:  # the helper's way of handing over a cut answer
            return cut.completion


def ask_anthropic(client: anthropic.Anthropic, *, stream: bool, **request):
    request = {"model": MODEL, "max_tokens": 128, **request}
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("peer", PEERS)
async def test_a_plain_answer_is_relayed_and_charged_as_told(network, peer, stream):
    await network.peer(peer)
    account, key = network.buyer()
    completion = await trio.to_thread.run_sync(
        lambda: ask_openai(network.openai(key), stream=stream, messages=QUESTION)
    )
    choice = completion.choices[0]
    assert choice.message.content == "Paris is the capital of France." and choice.finish_reason == "stop"
    message = await trio.to_thread.run_sync(
        lambda: ask_anthropic(
            network.anthropic(key), stream=stream, messages=QUESTION[1:], system=QUESTION[0]["content"]
        )
    )
    assert [block.text for block in message.content] == ["Paris is the capital of France."]
    assert message.stop_reason == "end_turn"
    network.charged_as_told(account, openai_usage(completion.usage), anthropic_usage(message.usage))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("peer", STRUCTURED)
async def test_a_two_step_tool_call_loop_with_thinking_completes_on_both_sdks(network, peer, stream):
    def answer(request: dict) -> Answer:
        if request["messages"][-1]["role"] == "tool":
            return Answer(reasoning="The tool says sunny.", text="It is sunny in Paris for the next 2 days.")
        return TOOL_TURN

    await network.peer(peer, answer)
    account, key = network.buyer()
    question = [{"role": "user", "content": "What's the weather in Paris for two days?"}]
    client = network.openai(key)
    first = await trio.to_thread.run_sync(lambda: ask_openai(client, stream=stream, messages=question, tools=[WEATHER]))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert getattr(choice.message, "reasoning_content", None) == "The user wants the weather."
    assert 0 < first.usage.completion_tokens_details.reasoning_tokens < first.usage.completion_tokens
    history = question + [
        {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    second = await trio.to_thread.run_sync(lambda: ask_openai(client, stream=stream, messages=history, tools=[WEATHER]))
    assert second.choices[0].message.content == "It is sunny in Paris for the next 2 days."
    assert second.choices[0].finish_reason == "stop" and second.usage.completion_tokens_details.reasoning_tokens > 0

    tools = [
        {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER["function"]["parameters"]}
    ]
    claude = network.anthropic(key)
    turn = await trio.to_thread.run_sync(lambda: ask_anthropic(claude, stream=stream, messages=question, tools=tools))
    assert [block.type for block in turn.content] == ["thinking", "text", "tool_use"] and turn.stop_reason == "tool_use"
    use = turn.content[2]
    assert use.input == {"city": "Paris", "days": 2} and turn.content[0].thinking == "The user wants the weather."
    history = question + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in turn.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    done = await trio.to_thread.run_sync(lambda: ask_anthropic(claude, stream=stream, messages=history, tools=tools))
    assert [block.type for block in done.content] == ["thinking", "text"] and done.stop_reason == "end_turn"
    assert done.content[1].text == "It is sunny in Paris for the next 2 days."
    network.charged_as_told(
        account, *(openai_usage(c.usage) for c in (first, second)), *(anthropic_usage(m.usage) for m in (turn, done))
    )


@pytest.mark.parametrize("peer", [ENGY_MINER_0_4_4.name, ENGY_MINER_NEWEST.name])
async def test_a_public_miner_proving_the_prompt_as_it_renders_it_is_served_and_billed_for_that_prompt(
    tools_network, peer
):
    # Release 0.4.4 drops the tools and the template's variables; the newest renders a history
    # tool call's arguments as an object. Either proves its own rendering of the buyer's
    # request, honestly: the answer is relayed, billed for the prompt it computed, not refused.
    network = tools_network
    miner = await network.peer(peer)
    account, key = network.buyer()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    completion = await trio.to_thread.run_sync(
        lambda: ask_openai(network.openai(key), stream=False, messages=history, tools=[WEATHER])
    )
    assert completion.choices[0].message.content == "Paris is the capital of France."
    assert completion.usage.prompt_tokens == len(miner.sent[0].prompt_ids)
    message = await trio.to_thread.run_sync(
        lambda: ask_anthropic(network.anthropic(key), stream=True, messages=QUESTION[1:], thinking={"type": "disabled"})
    )
    assert message.content[0].text == "Paris is the capital of France."
    assert message.usage.input_tokens == len(miner.sent[1].prompt_ids)
    rendered_by_gateway = network.served.render_prompt(
        parse_gateway_frame(json.dumps(miner.frames("serve")[0])).request
    )
    assert rendered_by_gateway != miner.sent[0].prompt_ids, "the miner rendered this request as the gateway does"
    network.charged_as_told(account, openai_usage(completion.usage), anthropic_usage(message.usage))


@pytest.mark.parametrize("peer", PEERS)
async def test_cached_prompt_tokens_reach_both_sdks_at_the_cache_read_price(network, peer):
    await network.peer(peer, lambda request: Answer(cached_tokens=16))
    account, key = network.buyer()
    completion = await trio.to_thread.run_sync(lambda: ask_openai(network.openai(key), stream=True, messages=QUESTION))
    assert completion.usage.prompt_tokens_details.cached_tokens == 16
    message = await trio.to_thread.run_sync(
        lambda: ask_anthropic(
            network.anthropic(key), stream=False, messages=QUESTION[1:], system=QUESTION[0]["content"]
        )
    )
    assert message.usage.cache_read_input_tokens == 16
    network.charged_as_told(account, openai_usage(completion.usage), anthropic_usage(message.usage))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("peer", PEERS)
async def test_an_answer_cut_at_max_tokens_finishes_with_length(network, peer, stream):
    # Release 0.4.4 says "stop" even then: the gateway knows better from the token count.
    await network.peer(
        peer,
        lambda request: Answer(
            text="Paris is the capital of France, and its largest city by far.", cut_at_max_tokens=True
        ),
    )
    account, key = network.buyer()
    completion = await trio.to_thread.run_sync(
        lambda: ask_openai(network.openai(key), stream=stream, messages=QUESTION, max_tokens=5)
    )
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    message = await trio.to_thread.run_sync(
        lambda: ask_anthropic(network.anthropic(key), stream=stream, messages=QUESTION[1:], max_tokens=5)
    )
    assert message.stop_reason == "max_tokens"
    network.charged_as_told(account, openai_usage(completion.usage), anthropic_usage(message.usage))


@pytest.mark.parametrize("peer", [TEE_MINER_NEWEST.name, OURS])
async def test_a_refusal_with_a_4xx_status_reaches_the_buyer_and_is_not_the_miners_failure(network, peer):
    refusing = {"on": True}

    def answer(request: dict) -> Answer:
        if refusing["on"]:
            return Answer(error=("cannot identify image file <_io.BytesIO object>", 400))
        return Answer()

    await network.peer(peer, answer)
    account, key = network.buyer()
    with pytest.raises(openai.BadRequestError, match="cannot identify image file"):
        await trio.to_thread.run_sync(lambda: ask_openai(network.openai(key), stream=True, messages=QUESTION))
    with pytest.raises(anthropic.BadRequestError, match="cannot identify image file"):
        await trio.to_thread.run_sync(
            lambda: ask_anthropic(network.anthropic(key), stream=False, messages=QUESTION[1:])
        )
    refusing["on"] = False
    completion = await trio.to_thread.run_sync(lambda: ask_openai(network.openai(key), stream=False, messages=QUESTION))
    assert completion.choices[0].message.content == "Paris is the capital of France."
    network.charged_as_told(account, openai_usage(completion.usage))


@pytest.mark.parametrize("peer", [ENGY_MINER_0_4_4.name, ENGY_MINER_NEWEST.name])
async def test_an_error_without_a_status_is_a_failed_upstream_and_nothing_is_charged(network, peer):
    failing = await network.peer(peer, lambda request: Answer(error=("CUDA out of memory", None)))
    account, key = network.buyer()
    with pytest.raises(openai.APIStatusError) as failed:
        await trio.to_thread.run_sync(lambda: ask_openai(network.openai(key), stream=False, messages=QUESTION))
    assert failed.value.status_code == 502 and "CUDA out of memory" in str(failed.value)
    assert len(failing.frames("serve")) == 1  # no other miner to retry on
    assert network.store.balance(account).charged == 0


@pytest.mark.parametrize("peer", [dialect.name for dialect in DIALECTS])
async def test_a_buyer_hanging_up_mid_stream_sends_the_miner_cancel(network, peer, holds_closed):
    release = trio.Event()
    miner = await network.peer(peer, lambda request: Answer(text="Paris is the capital of France. " * 8, pause=release))
    account, key = network.buyer()

    def first_chunk_then_hang_up() -> str:
        with network.openai(key).chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=128, stream=True
        ) as events:
            for event in events:
                if event.choices and event.choices[0].delta.content:
                    return event.choices[0].delta.content
        raise AssertionError("the stream ended without text")

    assert (await trio.to_thread.run_sync(first_chunk_then_hang_up)).startswith("Paris")
    await miner.wait_for(lambda: miner.frames("cancel"), what="sent cancel")
    assert miner.frames("cancel")[0]["corr_id"] == miner.frames("serve")[0]["corr_id"]
    release.set()
    await holds_closed.wait_for(lambda: not network.store.balance(account).held, timeout_s=10, what="the hold settled")
    balance = network.store.balance(account)
    assert 0 < balance.charged < billing.charge(price=PRICE, usage=Usage(64, 128, 0))


async def test_heartbeats_carry_the_serves_state_into_status_and_routing(network):
    tee = await network.peer(TEE_MINER_NEWEST.name, heartbeat_s=0.2, context_length=4096, kv_frac=0.25)

    def shown() -> dict:
        legs = network.hub.states().get("gateway", {}).get("legs") or []
        return legs[0] if legs else {}

    async def heard_twice() -> None:
        # Two periodic heartbeats sent after the change: the gateway has read at least one.
        sent = tee.heartbeats_sent
        await tee.wait_for(lambda: tee.heartbeats_sent >= sent + 2, what="sent two heartbeats")

    with trio.fail_after(30):  # the gateway publishes its legs to status every STALE_SWEEP_S
        while shown().get("kv_used") != 0.25:
            await trio.sleep(0.2)
    assert {k: shown()[k] for k in ("region", "tee", "context_length", "worker")} == {
        "region": "eu-north",
        "tee": "on",
        "context_length": 4096,
        "worker": tee.worker_name,
    }
    _, key = network.buyer()
    client = network.openai(key)
    await trio.to_thread.run_sync(lambda: ask_openai(client, stream=False, messages=QUESTION))
    served = len(tee.frames("serve"))

    tee.kv_frac = 0.99  # its serve's KV cache is full: a request would only queue there
    await heard_twice()
    with pytest.raises(openai.APIStatusError) as full:
        await trio.to_thread.run_sync(lambda: ask_openai(client, stream=False, messages=QUESTION))
    assert full.value.status_code == 503 and len(tee.frames("serve")) == served

    tee.kv_frac = 0.5
    await heard_twice()
    with pytest.raises(openai.APIStatusError):  # longer than the serve's 4096-token context
        await trio.to_thread.run_sync(
            lambda: ask_openai(client, stream=False, messages=[{"role": "user", "content": "Paris " * 4200}])
        )
    assert len(tee.frames("serve")) == served
    await trio.to_thread.run_sync(lambda: ask_openai(client, stream=False, messages=QUESTION))
    assert len(tee.frames("serve")) == served + 1


async def test_a_frame_over_the_old_limit_is_taken(network):
    tee = await network.peer(TEE_MINER_NEWEST.name, heartbeat_s=0.2)
    tee.padding_bytes = 9 << 20  # past the 7 MiB our gateway once stopped at, well inside the live 64 MiB
    await tee.wait_for(lambda: tee.padding_bytes == 0 and tee.heartbeats_sent >= 2, what="sent the padded heartbeat")
    _, key = network.buyer()
    completion = await trio.to_thread.run_sync(lambda: ask_openai(network.openai(key), stream=False, messages=QUESTION))
    assert completion.choices[0].message.content == "Paris is the capital of France."
    assert tee.legs_opened == 1


async def test_a_tee_miner_that_redials_finishes_its_requests_on_the_old_connection(network):
    release = trio.Event()
    tee = await network.peer(TEE_MINER_NEWEST.name, lambda request: Answer(pause=None if release.is_set() else release))
    account, key = network.buyer()
    results: list = []

    async def ask() -> None:
        results.append(
            await trio.to_thread.run_sync(lambda: ask_openai(network.openai(key), stream=True, messages=QUESTION))
        )

    async with trio.open_nursery() as buyers:
        buyers.start_soon(ask)
        await tee.wait_for(lambda: tee.inflight == 1, what="serving")
        tee.redial()
        await tee.wait_for(lambda: tee.admitted == 2, what="admitted again")
        release.set()
    assert tee.legs_opened == 2 and tee.inflight == 0
    buyers_answer = results[0].choices[0].message.content
    await ask()  # on the new leg
    assert [r.choices[0].message.content for r in results] == [buyers_answer, "Paris is the capital of France."]
    assert buyers_answer == "Paris is the capital of France."
    network.charged_as_told(account, *(openai_usage(r.usage) for r in results))


async def test_a_stopping_gateway_tells_every_miner_to_reconnect(network, running):
    peers = [await network.peer(dialect.name) for dialect in DIALECTS]
    await running.stop()
    for peer in peers:
        await peer.wait_for(lambda: peer.frames("reconnect"), what="told to reconnect")
