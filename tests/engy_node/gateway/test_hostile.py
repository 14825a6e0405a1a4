"""The gateway under hostile and overloaded traffic, and while it stops (issue 12).

Real hypercorn, real websockets, the synthetic miner (the miner role's link with a scripted
answer, so a test controls how long an answer takes), the real SQLite store. Each test names the
failure it guards against: a huge prompt tokenised before it was refused, a trickled body held
open for ever, a burst answered 503 while a slot was about to free, streams cut without a word
on SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import httpx
import openai
import orjson
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from engy_node.config import load_config
from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing import billing
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.miner.link import Identity, LinkSettings
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import Capacity, Hello, encode, parse_gateway_frame
from engy_node.served_model import load_served_model
from engy_node.testing.faults import Gate, GatedHandler
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link
from tests.waiting import Changes, wait_until_async

MODEL = "smollm2-135m"
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Gateway:
    """One gateway role in its own cancel scope, so a test can stop it while requests run."""

    def __init__(
        self, config, urls, store: Store, served, hub: Hub, scope: trio.CancelScope, stopped: trio.Event
    ) -> None:
        self.config = config
        self.urls = urls
        self.store = store
        self.served = served
        self.hub = hub
        self.scope = scope
        self.stopped = stopped
        self.api = urls.buyer_url + "/v1"

    def buyer(self, micro_usd: int = 1_000_000) -> tuple[int, str]:
        account_id, key = self.store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
        if micro_usd:
            self.store.credit(account_id, micro_usd=micro_usd)
        return account_id, key

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.api, api_key=key, max_retries=0, timeout=120)

    async def add_miner(self, nursery, script, http, *, max_inflight: int = 256) -> SyntheticHandler:
        handler = SyntheticHandler(self.served, script)
        await self._connect(nursery, handler, http, max_inflight=max_inflight)
        return handler

    async def add_gated_miner(self, nursery, script, http, gate_for) -> tuple[str, GatedHandler]:
        """A synthetic miner whose answers pass through `gate_for`'s gates (`faults.GatedHandler`),
        once its leg is admitted: (its identity in the request log, its handler)."""
        handler = GatedHandler(SyntheticHandler(self.served, script), gate_for)
        return await self._connect(nursery, handler, http, max_inflight=256), handler

    async def _connect(self, nursery, handler, http, *, max_inflight: int) -> str:
        miner_id, miner_key = self.store.register_miner(f"synthetic-{uuid.uuid4().hex[:6]}")
        link = synthetic_link(
            gateway_url=self.urls.miner_url,
            model=self.served,
            identity=Identity(miner_key=miner_key),
            handler=handler,
            http=http,
            settings=FAST,
            max_inflight=max_inflight,
        )
        legs = Changes()
        link.on_state = legs.notify
        await nursery.start(link.run)
        await legs.wait_for(lambda: any(link.legs_up.values()), timeout_s=30, what="the miner's leg admitted")
        return f"key:{miner_id}"

    def queue_depth(self) -> float:
        family = self.hub.registry.snapshot().get("engy_gateway_queue_depth", {"children": []})
        return sum(child["value"] for child in family["children"])

    def queue_outcomes(self) -> dict[str, float]:
        family = self.hub.registry.snapshot().get("engy_gateway_queue_outcomes_total", {"children": []})
        return {child["labels"]["outcome"]: child["value"] for child in family["children"]}

    def books_balance(self, account_id: int) -> None:
        balance = self.store.balance(account_id)
        assert balance.held == 0
        assert balance.credited == balance.charged + balance.available


async def start_gateway(nursery, home, checkpoint, **gateway) -> Gateway:
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=home,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, **gateway}},
    )
    hub = Hub()
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await run_gateway(config, hub, task_status=task_status)
        finally:
            stopped.set()

    urls = await nursery.start(run)
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    return Gateway(config, urls, store, served, hub, scope, stopped)


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=120) as client:
        yield client


@pytest.fixture
async def gateway_factory(nursery, tmp_path, checkpoint):
    started: list[Gateway] = []

    async def start(**settings) -> Gateway:
        gateway = await start_gateway(nursery, tmp_path / f"home-{len(started)}", checkpoint, **settings)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.store.close()


def chat_body(content: str, *, max_tokens: int = 16, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


# ---- cheap checks before costly work ------------------------------------------------------------


async def test_a_prompt_too_large_for_the_model_is_refused_by_its_size_without_tokenising(gateway_factory, http):
    """Was: a 7.5 MB prompt was rendered and tokenised (9 s, every buyer stalled) before being
    refused with its exact token count."""
    gateway = await gateway_factory()
    _, key = gateway.buyer()
    huge = "lorem ipsum dolor sit amet " * 300_000  # 8.1 MB: under the body cap, far over 6,144 tokens
    response = await http.post(
        gateway.api + "/chat/completions",
        json=chat_body(huge.strip()[:7_500_000]),
        headers={"authorization": f"Bearer {key}"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    # "at least": a floor from its size, not a count the tokenizer produced.
    assert "the prompt is at least" in error["message"] and "accepts at most 6144" in error["message"]


async def test_counting_a_prompt_too_large_for_the_model_is_refused_the_same_way(gateway_factory, http):
    gateway = await gateway_factory()
    _, key = gateway.buyer()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    response = await http.post(
        gateway.urls.buyer_url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": key}
    )
    assert response.status_code == 400
    assert "the prompt is at least" in response.json()["error"]["message"]
    small = await http.post(
        gateway.urls.buyer_url + "/v1/messages/count_tokens",
        headers={"x-api-key": key},
        json={"model": MODEL, "messages": QUESTION},
    )
    assert small.status_code == 200 and small.json()["input_tokens"] > 5


async def test_an_account_that_cannot_pay_is_refused_before_its_large_prompt_is_tokenised(gateway_factory, http):
    gateway = await gateway_factory()
    _, key = gateway.buyer(micro_usd=0)
    large = "word " * 4_000  # 20,000 characters: tokenised off the loop, so the balance is read first
    response = await http.post(
        gateway.api + "/chat/completions", json=chat_body(large), headers={"authorization": f"Bearer {key}"}
    )
    assert response.status_code == 402
    message = response.json()["error"]["message"]
    assert "insufficient balance" in message and "at least" in message and "prompt" in message


async def test_a_trickled_body_is_cut_off_with_a_408_in_the_api_format(gateway_factory):
    """Was: a body sent a byte at a time held its connection and task for as long as it trickled."""
    gateway = await gateway_factory(body_timeout_s=0.5)
    _, key = gateway.buyer()
    host, port = gateway.urls.buyer_url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
            'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"model"'
        )
        await stream.send_all(head.encode())
        received = b""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    assert b" 408 " in status_line
    body = orjson.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert "did not arrive within 0.5 s" in body["error"]["message"]


# ---- the waiting room ---------------------------------------------------------------------------


async def test_a_burst_beyond_capacity_waits_for_a_slot_instead_of_503(nursery, gateway_factory, http):
    """Was: with every miner at capacity, requests were answered 503 at once (16 of 20 on a
    capacity-4 miner)."""
    gateway = await gateway_factory(queue_wait_s=60)
    await gateway.add_miner(nursery, lambda frame: Script(text="ok " * 5, delay_s=0.05), http, max_inflight=1)
    account, key = gateway.buyer()
    client = gateway.openai(key)
    results: list[object] = []

    async def one() -> None:
        try:
            results.append(
                await trio.to_thread.run_sync(
                    lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, stream=False)
                )
            )
        except openai.APIStatusError as error:
            results.append(error)

    async with trio.open_nursery() as burst:
        for _ in range(5):
            burst.start_soon(one)
    assert [type(result).__name__ for result in results] == ["ChatCompletion"] * 5
    outcomes = gateway.queue_outcomes()
    assert outcomes.get("served", 0) >= 1 and "timed_out" not in outcomes
    assert gateway.queue_depth() == 0
    gateway.books_balance(account)


async def test_a_full_queue_refuses_at_once_and_a_hang_up_leaves_the_queue(nursery, gateway_factory, http):
    gateway = await gateway_factory(queue_wait_s=60, queue_max=1)
    # The one slot is held by a stream its miner is slow to answer (it sleeps before each chunk).
    handler = await gateway.add_miner(
        nursery, lambda frame: Script(text="x" * 400, chunk_chars=1, delay_s=0.05), http, max_inflight=1
    )
    _, key = gateway.buyer()
    headers = {"authorization": f"Bearer {key}"}
    release = trio.Event()
    holder = trio.CancelScope()

    async def hold_the_slot() -> None:
        with holder:
            async with http.stream(
                "POST",
                gateway.api + "/chat/completions",
                json=chat_body("hold", max_tokens=400, stream=True),
                headers=headers,
            ) as response:
                async for _ in response.aiter_bytes():
                    pass
        release.set()

    nursery.start_soon(hold_the_slot)
    await wait_until_async(lambda: len(handler.served) == 1, timeout_s=30, what="the miner serving the first request")

    waiter = trio.CancelScope()

    async def wait_in_queue() -> None:
        with waiter:
            await http.post(gateway.api + "/chat/completions", json=chat_body("queued"), headers=headers)

    nursery.start_soon(wait_in_queue)
    await wait_until_async(
        lambda: gateway.queue_depth() == 1, timeout_s=30, what="the second request waiting in the queue"
    )

    refused = await http.post(gateway.api + "/chat/completions", json=chat_body("third"), headers=headers)
    assert refused.status_code == 503
    assert refused.headers["retry-after"]
    assert "already waiting" in refused.json()["error"]["message"]

    waiter.cancel()  # the buyer hangs up while waiting
    await wait_until_async(
        lambda: gateway.queue_depth() == 0, timeout_s=30, what="the hung-up request leaving the queue"
    )
    assert gateway.queue_outcomes().get("gone") == 1
    holder.cancel()
    await release.wait()


# ---- a miner that accepts a request and never answers ---------------------------------------------


def stream_text(client: openai.OpenAI, content: str) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=16, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


async def test_a_miner_that_accepts_and_never_answers_is_stopped_at_the_first_byte_limit_and_counted(
    nursery, gateway_factory, http
):
    """Was: a stream waited on a miner that stayed connected and sent nothing for the model's
    whole request limit (122 s seen) instead of retrying elsewhere at the first-byte limit, and
    the miner's silence was not counted against it."""
    gateway = await gateway_factory(first_byte_wait_s=3)
    gates: list[Gate] = []

    def never_answer(frame) -> Gate:
        gates.append(Gate(before_chunk=0))
        return gates[-1]

    stuck, stalling = await gateway.add_gated_miner(
        nursery, lambda frame: Script(text="never sent", coalesce_s=0), http, never_answer
    )
    account, key = gateway.buyer()
    client = gateway.openai(key)

    # Alone, it costs the buyer the first-byte limit, then a 504 that says so; the miner is told to stop.
    with trio.fail_after(60), pytest.raises(openai.APIStatusError) as alone:
        await trio.to_thread.run_sync(stream_text, client, "alone", abandon_on_cancel=True)
    assert alone.value.status_code == 504 and "nothing within 3 s" in str(alone.value)
    with trio.fail_after(30):
        await gates[0].cancelled.wait()
    gateway.books_balance(account)
    assert gateway.store.balance(account).charged == 0

    # Beside an honest miner, a request it takes first is answered by the other one, and the
    # buyer's stream holds nothing of the abandoned attempt.
    honest = await gateway.add_miner(nursery, lambda frame: Script(text="Paris is the capital."), http)
    for index in range(40):
        with trio.fail_after(60):
            answer = await trio.to_thread.run_sync(stream_text, client, f"question {index}", abandon_on_cancel=True)
        assert answer == "Paris is the capital."
        if len(stalling.served) == 2:
            break
    assert len(stalling.served) == 2, "no request went to the stalling miner first"
    with trio.fail_after(30):
        await gates[1].cancelled.wait()
    retried = stalling.served[1].request.engy_request_id

    async def logged() -> bool:
        rows = [entry for _, entry in gateway.store.requests_after(0, limit=100)]
        return len(rows) == 1 + len(honest.served) + 1

    await wait_until_async(logged, timeout_s=30, what="every attempt in the request log")
    rows = [entry for _, entry in gateway.store.requests_after(0, limit=100)]
    assert [row.status for row in rows if row.miner == stuck] == [504, 504], "each silence is the miner's failure"
    assert [(row.miner == stuck, row.status) for row in rows if row.request_id == retried] == [
        (True, 504),
        (False, 200),
    ]
    assert sum(row.cost_micro for row in rows) == gateway.store.balance(account).charged > 0
    gateway.books_balance(account)


# ---- one miner key opening legs without end ------------------------------------------------------


async def test_legs_of_one_miner_past_what_its_rigs_may_open_are_denied_naming_the_setting(gateway_factory, caplog):
    """Was: one miner key could open any number of legs."""
    gateway = await gateway_factory(max_rigs_per_miner=1)  # one worker: a rig's leg, twice over
    _, miner_key = gateway.store.register_miner("many-legs")

    def hello(rig: str) -> str:
        return encode(
            Hello(
                miner_key=miner_key,
                model=MODEL,
                model_root=gateway.served.model_root,
                hw={},
                versions={},
                capacity=Capacity(1, 1, 6144, 2048, 600),
                worker_name=rig,
                worker_id=uuid.uuid4().hex,
            )
        )

    async with contextlib.AsyncExitStack() as legs:
        answers = []
        for rig in ("rig-a", "rig-b", "rig-c"):
            leg = await legs.enter_async_context(open_websocket_url(gateway.urls.miner_url))
            await leg.send_message(hello(rig))
            answers.append(parse_gateway_frame(await leg.get_message()))
        assert [type(answer).__name__ for answer in answers] == ["Admit", "Admit", "Deny"]
        assert "gateway.max_rigs_per_miner" in answers[2].reason
        with pytest.raises(ConnectionClosed) as closed:
            await leg.get_message()
        assert closed.value.reason.code == 1008
    assert "denied miner rig-c" in caplog.text and "already holds 2 legs" in caplog.text


# ---- graceful drain -----------------------------------------------------------------------------


async def read_sse(response: httpx.Response, first_chunk: trio.Event) -> list[bytes]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append(line[6:].encode())
            first_chunk.set()
    return events


async def test_stopping_lets_a_stream_in_flight_finish_and_takes_no_new_requests(nursery, gateway_factory, http):
    gateway = await gateway_factory(drain_s=60)
    answer = "finishing in peace " * 6
    await gateway.add_miner(nursery, lambda frame: Script(text=answer, chunk_chars=4, delay_s=0.05, coalesce_s=0), http)
    account, key = gateway.buyer()
    first_chunk, events = trio.Event(), []

    async def stream() -> None:
        async with http.stream(
            "POST",
            gateway.api + "/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={**chat_body("go", max_tokens=200, stream=True), "stream_options": {"include_usage": True}},
        ) as response:
            assert response.status_code == 200
            events.extend(await read_sse(response, first_chunk))

    async with trio.open_nursery() as buyer:
        buyer.start_soon(stream)
        await first_chunk.wait()
        gateway.scope.cancel()  # what SIGTERM does to the node's services

        async def refused() -> bool:
            try:
                await http.get(gateway.api + "/models")
            except httpx.ConnectError:
                return True
            return False

        # The listener stops accepting while the stream goes on.
        with trio.fail_after(30):
            while not await refused():
                await trio.sleep(0.05)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == answer
    usage = chunks[-1]["usage"]
    await gateway.stopped.wait()
    charged = billing.charge(
        price=SMOLLM2_135M.price,
        usage=Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"]),
    )
    assert gateway.store.balance(account).charged == charged
    gateway.books_balance(account)


async def test_a_stream_still_running_at_the_drain_deadline_ends_with_an_error_event_and_done(
    nursery, gateway_factory, http
):
    """Was: SIGTERM cut streams in flight with no error event and no [DONE]."""
    gateway = await gateway_factory(drain_s=0.5)
    await gateway.add_miner(
        nursery, lambda frame: Script(text="slow " * 200, chunk_chars=5, delay_s=0.1, coalesce_s=0), http
    )
    account, key = gateway.buyer()
    first_chunk, events = trio.Event(), []

    async def stream() -> None:
        async with http.stream(
            "POST",
            gateway.api + "/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json=chat_body("go", max_tokens=1000, stream=True),
        ) as response:
            assert response.status_code == 200
            events.extend(await read_sse(response, first_chunk))

    async with trio.open_nursery() as buyer:
        buyer.start_soon(stream)
        await first_chunk.wait()
        gateway.scope.cancel()
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert "shutting down" in error["message"] and error["type"] == "service_unavailable_error"
    relayed = "".join(
        orjson.loads(event)["choices"][0]["delta"].get("content") or ""
        for event in events[:-2]
        if orjson.loads(event).get("choices")
    )
    assert relayed
    await gateway.stopped.wait()
    # Charged for what was relayed, nothing held, the books balanced.
    prompt = len(gateway.served.render_prompt(_serve_request("go")))
    relayed_tokens = len(gateway.served.tokenizer.encode(relayed, add_special_tokens=False))
    assert gateway.store.balance(account).charged == billing.charge(
        price=SMOLLM2_135M.price, usage=Usage(prompt_tokens=prompt, completion_tokens=relayed_tokens)
    )
    gateway.books_balance(account)


def _serve_request(content: str):
    from engy_node.protocol.miner import Message, ServeRequest

    return ServeRequest(messages=(Message(role="user", content=content, extra={}),), max_tokens=1, engy_request_id="x")
