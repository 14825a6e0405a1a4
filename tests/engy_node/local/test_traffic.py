"""The demo buyer: `plan_request`'s bodies, and the generator against a real buyer API on loopback.

The buyer API is a Starlette app on hypercorn (as the gateway serves it) that answers both
dialects in both forms, with the real SSE event shapes, checks each dialect's auth header and
the request bodies, and can be told to fail: an HTTP 500 with a JSON error, a stream that ends
before its terminator, an error event in the stream, or an answer that is not JSON at all.
"""

from __future__ import annotations

import json
import logging
import random
import types

import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engy_node.asgi import start_listener
from engy_node.hub import Hub
from engy_node.local import traffic
from engy_node.local.traffic import MAX_PROMPT_CHARS, TrafficGenerator, plan_request
from engy_node.probe_corpus import load_probe_corpus

KEY = "engy-local-buyer-key"
MODELS = ("smollm2-135m", "tiny-chat")
PIECES = ("Hello", ", ", "world", "!")
ANSWER = "".join(PIECES)
WAIT_S = 10.0
"""Every wait is bounded by this; the runs themselves take a fraction of a second."""

PROMPTS = tuple(prompt for prompt in load_probe_corpus() if prompt.chars <= MAX_PROMPT_CHARS)
BY_MESSAGES = {json.dumps(prompt.messages): prompt for prompt in PROMPTS}


# ---- plan_request ------------------------------------------------------------------------------
def corpus_entry(plan: traffic.RequestPlan):
    """The corpus entry a plan was drawn from, rebuilt from its body (None if it matches none)."""
    messages = list(plan.body["messages"])
    if plan.dialect == "anthropic" and "system" in plan.body:
        messages.insert(0, {"role": "system", "content": plan.body["system"]})
    return BY_MESSAGES.get(json.dumps(messages))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(), max_tokens=st.integers(1, 4096), model=st.sampled_from(MODELS))
def test_a_plan_is_a_valid_request_for_its_dialect(seed, max_tokens, model):
    plan = plan_request(random.Random(seed), PROMPTS, model, max_tokens=max_tokens)
    body = plan.body
    assert body["model"] == model and body["max_tokens"] == max_tokens and body["stream"] is plan.stream
    entry = corpus_entry(plan)
    assert entry is not None, "the conversation must be a corpus entry, unchanged"
    messages = body["messages"]
    assert messages and messages[-1]["role"] == "user" and all(message["content"] for message in messages)
    if plan.dialect == "openai":
        assert plan.path == "/chat/completions"
        assert set(body) <= {"model", "messages", "max_tokens", "stream", "temperature"}
        assert messages == list(entry.messages)
        if "temperature" in body:
            assert 0.2 <= body["temperature"] <= 1.0
    else:
        assert plan.dialect == "anthropic" and plan.path == "/messages"
        assert set(body) <= {"model", "messages", "max_tokens", "stream", "system"}
        assert all(message["role"] in ("user", "assistant") for message in messages)
        had_system = entry.messages[0]["role"] == "system"
        assert ("system" in body) is had_system
        if had_system:
            assert body["system"] == entry.messages[0]["content"]
        # The turns as the corpus has them: user first, then alternating.
        assert [message["role"] for message in messages] == [
            message["role"] for message in entry.messages if message["role"] != "system"
        ]
        assert [message["role"] for message in messages] == ["user", "assistant"] * (len(messages) // 2) + ["user"]
    # The body holds copies: a caller may change it without touching the shared corpus.
    assert all(mine is not theirs for mine in messages for theirs in entry.messages)


def test_plans_cover_both_dialects_both_stream_modes_and_system_prompts():
    rng = random.Random(7)
    plans = [plan_request(rng, PROMPTS, MODELS[0], max_tokens=48) for _ in range(400)]
    assert {(plan.dialect, plan.stream) for plan in plans} == {
        (d, s) for d in ("openai", "anthropic") for s in (False, True)
    }
    assert any(plan.dialect == "anthropic" and "system" in plan.body for plan in plans)
    assert any(plan.dialect == "openai" and plan.body["messages"][0]["role"] == "system" for plan in plans)
    assert any("temperature" in plan.body for plan in plans) and any("temperature" not in plan.body for plan in plans)


def test_a_plan_leaves_the_corpus_unchanged():
    before = json.dumps([prompt.messages for prompt in PROMPTS])
    rng = random.Random(3)
    for _ in range(100):
        plan = plan_request(rng, PROMPTS, MODELS[0], max_tokens=48)
        for message in plan.body["messages"]:
            message["content"] = "changed"
    assert json.dumps([prompt.messages for prompt in PROMPTS]) == before


# ---- a buyer API on loopback -------------------------------------------------------------------
STREAM_FAILURES = {"cut", "error_event"}
"""Ways only a streamed answer can fail; a non-streamed request in these modes is answered."""


class BuyerApi:
    """Both dialects, both forms; `fail` says how to answer the next requests (None: properly)."""

    def __init__(self) -> None:
        self.fail: str | None = None
        self.requests: list[dict] = []
        """Per request received: dialect, stream, and whether its answer is a failure."""
        self.problems: list[str] = []
        """What was wrong with a request (asserting in a handler would only become a 500)."""

    def failing(self, stream: bool) -> bool:
        return self.fail is not None and (stream or self.fail not in STREAM_FAILURES)

    async def chat_completions(self, request: Request) -> Response:
        body = await request.json()
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return self._refuse(
                "openai", body, {"error": {"message": "invalid api key", "type": "authentication_error"}}
            )
        messages = body.get("messages") or [{}]
        if (
            body.get("model") not in MODELS
            or not isinstance(body.get("max_tokens"), int)
            or messages[-1].get("role") != "user"
        ):
            self.problems.append(f"openai: {body}")
        return self._answer("openai", bool(body.get("stream")))

    async def messages(self, request: Request) -> Response:
        body = await request.json()
        if request.headers.get("x-api-key") != KEY or not request.headers.get("anthropic-version"):
            return self._refuse(
                "anthropic",
                body,
                {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}},
            )
        if "authorization" in request.headers:
            self.problems.append("anthropic: a bearer token sent as well")
        roles = [message.get("role") for message in body.get("messages") or ()]
        if (
            body.get("model") not in MODELS
            or not isinstance(body.get("max_tokens"), int)
            or "system" in roles
            or not roles
            or roles[-1] != "user"
            or ("system" in body and not isinstance(body["system"], str))
        ):
            self.problems.append(f"anthropic: {body}")
        return self._answer("anthropic", bool(body.get("stream")))

    def _refuse(self, dialect: str, body: dict, error: dict) -> Response:
        self.requests.append({"dialect": dialect, "stream": bool(body.get("stream")), "failed": True})
        return JSONResponse(error, 401)

    def _answer(self, dialect: str, stream: bool) -> Response:
        fail = self.fail
        self.requests.append({"dialect": dialect, "stream": stream, "failed": self.failing(stream)})
        if fail == "http":
            error = (
                {"error": {"message": "upstream exploded", "type": "server_error"}}
                if dialect == "openai"
                else {"type": "error", "error": {"type": "api_error", "message": "upstream exploded"}}
            )
            return JSONResponse(error, 500)
        if fail == "garbage":
            if stream:
                return StreamingResponse(iter(["data: <html>bad gateway</html>\n\n"]), media_type="text/event-stream")
            return Response("<html>bad gateway</html>", 200, media_type="text/html")
        if fail == "shape":
            if stream:
                return StreamingResponse(
                    iter([sse([1, 2]), sse("[DONE]"), sse({"type": "message_stop"})]), media_type="text/event-stream"
                )
            return JSONResponse([1, 2])
        if not stream:
            if dialect == "openai":
                return JSONResponse(
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "model": MODELS[0],
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}
                        ],
                        "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24},
                    }
                )
            return JSONResponse(
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": MODELS[0],
                    "content": [{"type": "text", "text": ANSWER}],
                    "stop_reason": "end_turn",
                    "usage": {"input_tokens": 20, "output_tokens": 4},
                }
            )
        events = openai_events(fail) if dialect == "openai" else anthropic_events(fail)
        return StreamingResponse(iter(events), media_type="text/event-stream")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
            ]
        )


def sse(data: dict | str, event: str | None = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def openai_events(fail: str | None) -> list[str]:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODELS[0]}
    events = [
        ": keep-alive\n\n",
        sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    ]
    events += [
        sse({**chunk, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        for piece in PIECES
    ]
    if fail == "error_event":
        return events[:3] + [sse({"error": {"message": "overloaded", "type": "server_error"}})]
    events += [
        sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        sse({**chunk, "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}}),
    ]
    return events if fail == "cut" else events + [sse("[DONE]")]


def anthropic_events(fail: str | None) -> list[str]:
    events = [
        sse(
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": MODELS[0],
                    "usage": {"input_tokens": 20, "output_tokens": 1},
                },
            },
            "message_start",
        ),
        sse(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            "content_block_start",
        ),
        sse({"type": "ping"}, "ping"),
    ]
    events += [
        sse(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
            "content_block_delta",
        )
        for piece in PIECES
    ]
    if fail == "error_event":
        return events[:4] + [
            sse({"type": "error", "error": {"type": "overloaded_error", "message": "overloaded"}}, "error")
        ]
    events += [
        sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        sse(
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 4}},
            "message_delta",
        ),
    ]
    return events if fail == "cut" else events + [sse({"type": "message_stop"}, "message_stop")]


@pytest.fixture
async def buyer_api(nursery):
    api = BuyerApi()
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    api.url = (await start_listener(nursery, api.app(), config, what="test buyer API", flag="-"))[0]
    return api


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def failures(self, containing: str = "") -> list[str]:
        return [
            message
            for record in self.records
            if "demo request failed" in (message := record.getMessage()) and containing in message
        ]


@pytest.fixture
def logged():
    """The generator's log records, taken at its own logger (whatever `install_logging` did to
    propagation in an earlier test)."""
    records = Records()
    logger = logging.getLogger("engy.local.traffic")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(records)
    logger.setLevel(level)


def generator(api: BuyerApi, hub: Hub, **overrides) -> TrafficGenerator:
    settings = {"buyer_api": f"{api.url}/v1", "buyer_key": KEY, "models": MODELS, "hub": hub, "gap_s": 0.01, "seed": 11}
    return TrafficGenerator(**{**settings, **overrides})


async def until(condition, what: str) -> None:
    try:
        with trio.fail_after(WAIT_S):
            while not condition():
                await trio.sleep(0.005)
    except trio.TooSlowError:
        pytest.fail(f"no {what} within {WAIT_S:g} s")


async def settle(gen: TrafficGenerator, api: BuyerApi) -> None:
    """Pause, and wait until every request sent has its answer counted."""
    gen.pause()
    await until(
        lambda: gen.stats.sent == gen.stats.succeeded + gen.stats.failed == len(api.requests), "requests settle"
    )


def all_combinations(api: BuyerApi) -> bool:
    return len({(request["dialect"], request["stream"]) for request in api.requests}) == 4


@pytest.mark.parametrize(
    "fail, reasons",
    [
        (None, set()),
        ("http", {"HTTP 500: upstream exploded"}),
        ("cut", {"the stream ended without its terminator"}),
        ("error_event", {"error event: overloaded"}),
    ],
)
async def test_successes_and_failures_are_counted_and_published(buyer_api, logged, fail, reasons):
    hub = Hub()
    buyer_api.fail = fail
    async with trio.open_nursery() as nursery:
        gen = generator(buyer_api, hub)
        await nursery.start(gen.run)
        assert hub.states()["traffic_generator"]["paused"] is False
        await until(lambda: len(buyer_api.requests) >= 16 and all_combinations(buyer_api), "every kind of request")
        await settle(gen, buyer_api)
        nursery.cancel_scope.cancel()

    assert buyer_api.problems == []
    failed = sum(request["failed"] for request in buyer_api.requests)
    stats = gen.stats
    assert (stats.sent, stats.failed, stats.succeeded) == (
        len(buyer_api.requests),
        failed,
        len(buyer_api.requests) - failed,
    )
    assert stats.output_chars == len(ANSWER) * stats.succeeded
    assert stats.last_error == (next(iter(reasons)) if reasons else None)
    if fail in STREAM_FAILURES:
        assert 0 < stats.failed < stats.sent  # the streamed requests failed, the others were answered
    assert hub.states()["traffic_generator"] == {
        "paused": True,
        "sent": stats.sent,
        "succeeded": stats.succeeded,
        "failed": stats.failed,
        "output_chars": stats.output_chars,
        "last_error": stats.last_error,
    }
    # One warning per distinct reason, however many requests failed for it.
    assert len(logged.failures()) == len(reasons)
    for reason in reasons:
        assert len(logged.failures(reason)) == 1


@pytest.mark.parametrize("fail, reason", [("garbage", "the answer is not JSON"), ("shape", "the answer is not in the")])
async def test_an_answer_that_is_not_an_answer_is_a_failure_not_a_crash(buyer_api, logged, fail, reason):
    hub = Hub()
    buyer_api.fail = fail
    async with trio.open_nursery() as nursery:
        gen = generator(buyer_api, hub)
        await nursery.start(gen.run)
        await until(lambda: len(buyer_api.requests) >= 8 and all_combinations(buyer_api), "every kind of request")
        buyer_api.fail = None
        await until(lambda: gen.stats.succeeded >= 4, "answers once the API recovers")
        await settle(gen, buyer_api)
        nursery.cancel_scope.cancel()
    failed = sum(request["failed"] for request in buyer_api.requests)
    assert failed >= 8
    assert (gen.stats.failed, gen.stats.succeeded) == (failed, len(buyer_api.requests) - failed)
    assert len(logged.failures()) == len(logged.failures(reason)) >= 1  # each distinct parse error said once
    assert len(logged.failures()) <= 4


async def test_a_wrong_key_fails_with_the_apis_message(buyer_api, logged):
    hub = Hub()
    async with trio.open_nursery() as nursery:
        gen = generator(buyer_api, hub, buyer_key="not-the-key")
        await nursery.start(gen.run)
        await until(lambda: gen.stats.failed >= 6 and all_combinations(buyer_api), "refusals of every kind of request")
        await settle(gen, buyer_api)
        nursery.cancel_scope.cancel()
    assert gen.stats.succeeded == 0 and gen.stats.failed == gen.stats.sent == len(buyer_api.requests)
    assert {message.split("(")[1].split(")")[0] for message in logged.failures()} <= {
        "HTTP 401: invalid api key",
        "HTTP 401: invalid x-api-key",
    }
    assert 1 <= len(logged.failures()) <= 2


async def test_failures_are_logged_once_a_minute_per_reason(buyer_api, logged, monkeypatch):
    clock = [1_000.0]
    monkeypatch.setattr(traffic, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    hub = Hub()
    buyer_api.fail = "http"
    async with trio.open_nursery() as nursery:
        gen = generator(buyer_api, hub)
        await nursery.start(gen.run)
        await until(lambda: gen.stats.failed >= 6, "HTTP failures")
        assert len(logged.failures()) == 1

        buyer_api.fail = "cut"
        before = gen.stats.failed
        await until(lambda: gen.stats.failed >= before + 4, "cut streams")
        assert len(logged.failures("HTTP 500")) == 1
        assert len(logged.failures("without its terminator")) == 1

        clock[0] += traffic.FAILURE_LOG_EVERY_S - 1  # not yet a minute
        before = gen.stats.failed
        await until(lambda: gen.stats.failed >= before + 3, "more cut streams")
        assert len(logged.failures("without its terminator")) == 1

        clock[0] += 1  # a minute since the first one
        before = gen.stats.failed
        await until(lambda: gen.stats.failed >= before + 3, "more cut streams")
        assert len(logged.failures("without its terminator")) == 2
        assert len(logged.failures()) == 3
        nursery.cancel_scope.cancel()
    last = logged.failures("without its terminator")[-1]
    assert "failed so far" in last


async def test_pause_stops_new_requests_and_resume_restarts_them(buyer_api):
    hub = Hub()
    async with trio.open_nursery() as nursery:
        gen = generator(buyer_api, hub, concurrency=2)
        await nursery.start(gen.run)
        await until(lambda: len(buyer_api.requests) >= 6, "requests")
        await settle(gen, buyer_api)
        assert gen.paused and hub.states()["traffic_generator"]["paused"] is True
        gen.pause()  # idempotent
        # Each slot comes round to the pause once its gap is over, and waits there for a resume (one
        # already past its look at the pause when it came sends that request first: settle again).
        await until(lambda: gen._running.statistics().tasks_waiting == gen.concurrency, "pause holding every slot")
        await settle(gen, buyer_api)
        held = len(buyer_api.requests)
        assert gen._running.statistics().tasks_waiting == gen.concurrency and gen.stats.sent == held

        gen.resume()
        assert not gen.paused and hub.states()["traffic_generator"]["paused"] is False
        await until(lambda: len(buyer_api.requests) >= held + 6, "requests after resuming")
        gen.resume()  # idempotent
        await settle(gen, buyer_api)
        nursery.cancel_scope.cancel()
    assert gen.stats.failed == 0 and gen.stats.succeeded == len(buyer_api.requests)
    assert buyer_api.problems == []


async def test_a_proxy_in_the_environment_is_not_used_for_the_loopback_api(buyer_api, monkeypatch):
    """The buyer key goes to the node's own API on loopback; a proxy set for the user's browsing
    must neither see it nor stand in the way (as the CLI's control client does, `trust_env=False`)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    hub = Hub()
    async with trio.open_nursery() as nursery:
        gen = generator(buyer_api, hub)
        await nursery.start(gen.run)
        await until(lambda: gen.stats.succeeded + gen.stats.failed >= 3, "answers")
        gen.pause()
        await until(lambda: gen.stats.sent == gen.stats.succeeded + gen.stats.failed, "requests to settle")
        nursery.cancel_scope.cancel()
    assert (gen.stats.failed, gen.stats.last_error) == (0, None)
    assert gen.stats.succeeded == len(buyer_api.requests) >= 3
