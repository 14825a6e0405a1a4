"""The buyer API's edges (issue 12): nothing a buyer sends is silently ignored, and every answer,
down to the ones hypercorn writes before the app runs, has a JSON body in the dialect of the
route asked for (Anthropic's under /v1/messages, OpenAI's elsewhere).

Real hypercorn with the gateway's listener settings, the real store, the official SDKs where a
client would use them, and raw HTTP where no SDK would send such a request. None of these
requests gets as far as a miner, so the gateway runs without one.
"""

from __future__ import annotations

import os
import uuid

import anthropic
import httpx
import openai
import orjson
import pytest
import trio
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.routing import Route

from engy_node.asgi import MAX_JSON_DEPTH
from engy_node.config import load_config
from engy_node.gateway.api.app import ERROR_HANDLERS, MAX_HEADER_BYTES, hypercorn_config
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from tests.waiting import wait_until_async

MODEL = "smollm2-135m"
MAX_BODY_BYTES = 64 * 1024
BODY_BYTES_PER_ACCOUNT = 128 * 1024
BODY_BYTES_IN_FLIGHT = 256 * 1024
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
"""Valid for both chat routes."""
COUNT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class Edges:
    def __init__(self, urls, store: Store, hub: Hub) -> None:
        self.urls = urls
        self.store = store
        self.hub = hub
        self.base = urls.buyer_url
        _, self.key = store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.key, max_retries=0, timeout=60)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base, api_key=self.key, max_retries=0, timeout=60)


@pytest.fixture
async def edges(nursery, tmp_path, checkpoint):
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
                "max_body_bytes": MAX_BODY_BYTES,
                "body_bytes_in_flight_per_account": BODY_BYTES_PER_ACCOUNT,
                "body_bytes_in_flight": BODY_BYTES_IN_FLIGHT,
            }
        },
    )
    hub = Hub()
    urls = await nursery.start(run_gateway, config, hub)
    store = Store.open(store_path(config))
    yield Edges(urls, store, hub)
    store.close()


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status and response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == kind
    assert body["request_id"] == response.headers["x-request-id"]
    return body["error"]


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status and response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert body["request_id"] == response.headers["request-id"]
    return body["error"]


# ---- parameters ----------------------------------------------------------------------------


async def test_openai_parameters_the_gateway_cannot_honour_are_refused_through_the_sdk(edges):
    client = edges.openai()
    for extra, param in (
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 3}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
        ({"n": 2}, "n"),
        ({"extra_body": {"response_format": {"type": "yaml"}}}, "response_format.type"),
        ({"extra_body": {"top_k": 5}}, "top_k"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, **extra
                )
            )
        assert refused.value.param == param and refused.value.type == "invalid_request_error"
        assert refused.value.response.headers["x-should-retry"] == "false"
    assert "Unrecognized request argument supplied: top_k" in refused.value.message


async def test_anthropic_parameters_the_gateway_cannot_honour_are_refused_through_the_sdk(edges):
    client = edges.anthropic()
    for extra, says in (
        ({"extra_body": {"top_k": 5}}, "top_k: is not supported"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "output_config.format: is not supported",
        ),
        ({"extra_body": {"logprobs": True}}, "logprobs: Extra inputs are not permitted"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await trio.to_thread.run_sync(
                lambda: client.messages.create(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], **extra
                )
            )
        assert refused.value.body["error"]["type"] == "invalid_request_error" and says in refused.value.message
    with pytest.raises(anthropic.BadRequestError) as refused:
        await trio.to_thread.run_sync(
            lambda: client.messages.count_tokens(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"max_tokens": 8}
            )
        )
    assert "max_tokens: Extra inputs are not permitted" in refused.value.message


# ---- content type --------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
async def test_a_body_not_sent_as_json_is_refused_in_each_apis_shape(edges, http, content_type):
    headers = {"authorization": f"Bearer {edges.key}"} | ({"content-type": content_type} if content_type else {})
    response = await http.post(edges.base + "/v1/chat/completions", content=orjson.dumps(CHAT_BODY), headers=headers)
    error = assert_openai_error(response, 415, "invalid_request_error")
    assert error["code"] == "unsupported_content_type" and "application/json" in error["message"]
    for path, body in (("/v1/messages", CHAT_BODY), ("/v1/messages/count_tokens", COUNT_BODY)):
        response = await http.post(edges.base + path, content=orjson.dumps(body), headers=headers)
        error = assert_anthropic_error(response, 400, "invalid_request_error")
        assert error["message"].startswith("content-type: must be application/json")


async def test_json_with_a_charset_is_json(edges, http):
    headers = {"authorization": f"Bearer {edges.key}", "content-type": "Application/JSON; charset=utf-8"}
    response = await http.post(
        edges.base + "/v1/messages/count_tokens", content=orjson.dumps(COUNT_BODY), headers=headers
    )
    assert response.status_code == 200 and response.json()["input_tokens"] > 0


# ---- answers no handler writes ---------------------------------------------------------------


async def test_an_unknown_route_is_a_json_404_that_lists_the_routes(edges, http):
    error = assert_openai_error(
        await http.post(edges.base + "/v1/chat/completion", json=CHAT_BODY), 404, "not_found_error"
    )
    assert (
        error["message"].startswith("Invalid URL (POST /v1/chat/completion)")
        and "POST /v1/chat/completions" in error["message"]
    )
    error = assert_anthropic_error(
        await http.post(edges.base + "/v1/messages/batches", json=CHAT_BODY), 404, "not_found_error"
    )
    assert "POST /v1/messages/count_tokens" in error["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        await trio.to_thread.run_sync(lambda: edges.openai().embeddings.create(model=MODEL, input="hi"))
    assert "Invalid URL (POST /v1/embeddings)" in missing.value.message


async def test_a_wrong_method_is_a_json_405_naming_the_right_one(edges, http):
    response = await http.get(edges.base + "/v1/chat/completions")
    error = assert_openai_error(response, 405, "invalid_request_error")
    assert (
        response.headers["allow"] == "POST"
        and error["message"] == "GET is not allowed on /v1/chat/completions; use POST"
    )
    assert_openai_error(await http.post(edges.base + "/v1/models"), 405, "invalid_request_error")
    assert_anthropic_error(await http.delete(edges.base + "/v1/messages"), 405, "invalid_request_error")


async def test_a_body_over_the_limit_is_a_json_413_in_each_apis_shape(edges, http):
    headers = {"authorization": f"Bearer {edges.key}"}
    huge = [{"role": "user", "content": "x" * MAX_BODY_BYTES}]
    error = assert_openai_error(
        await http.post(edges.base + "/v1/chat/completions", json={**CHAT_BODY, "messages": huge}, headers=headers),
        413,
        "invalid_request_error",
    )
    assert str(MAX_BODY_BYTES) in error["message"]
    for path, body in (("/v1/messages", CHAT_BODY), ("/v1/messages/count_tokens", COUNT_BODY)):
        assert_anthropic_error(
            await http.post(edges.base + path, json={**body, "messages": huge}, headers=headers),
            413,
            "request_too_large",
        )


async def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as it is on a new connection; the answer, read until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split(" ")[1]), headers, body


@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
async def test_headers_over_the_limit_are_a_json_431_in_the_paths_dialect(edges, path, shape):
    # h11 measures a head only while it is incomplete, so it must be larger than one read of the
    # server's (64 KiB) to be refused for certain.
    request = (
        f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"cookie: {'c' * 100_000}\r\ncontent-length: 2\r\n\r\n{{}}"
    ).encode()
    status, headers, body = await raw_exchange(edges.base, request)
    assert (
        status == 431 and headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    )
    error = orjson.loads(body)["error"]
    assert f"exceed {MAX_HEADER_BYTES} bytes" in error["message"]
    assert error["type"] == ("invalid_request_error" if shape == "openai" else "request_too_large")
    assert ("param" in error) == (shape == "openai")


async def test_a_request_the_server_cannot_parse_is_a_json_400(edges):
    status, headers, body = await raw_exchange(
        edges.base, b"POST /v1/chat/completions HTTP/1.1\r\nhost gateway\r\n\r\n"
    )
    assert status == 400 and headers["content-type"] == "application/json"
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"


async def test_a_handler_that_fails_is_a_json_500_in_the_routes_dialect(nursery, http, caplog):
    async def broken(request):
        raise RuntimeError("a bug")

    router = Starlette(
        routes=[Route("/v1/models", broken), Route("/v1/messages/count_tokens", broken, methods=["POST"])],
        exception_handlers=ERROR_HANDLERS,
    )
    url = (await nursery.start(serve, router, hypercorn_config("127.0.0.1:0")))[0]
    error = assert_openai_error(await http.get(url + "/v1/models"), 500, "api_error")
    assert "retry it" in error["message"]
    assert_anthropic_error(await http.post(url + "/v1/messages/count_tokens", json=COUNT_BODY), 500, "api_error")
    assert "RuntimeError: a bug" in caplog.text


async def test_the_miner_endpoint_answers_an_unknown_route_in_json(edges, http):
    response = await http.get(edges.urls.miner_url.replace("ws://", "http://").removesuffix("/gw") + "/gw/nothing")
    assert_openai_error(response, 404, "not_found_error")


# ---- deep nesting and authentication wording (issue 33, item 8) -----------------------------


def nested(depth: int) -> dict:
    """A JSON object `depth` levels deep, the object itself included."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


async def test_a_deeply_nested_body_is_a_400_naming_the_limit_in_each_api(edges, http):
    # Deep enough to pass the JSON parser and overflow Python's recursion limit in the chat
    # template that renders a tool's schema: it was a 400 quoting "maximum recursion depth exceeded".
    edges.store.credit(edges.store.authenticate(edges.key).account_id, micro_usd=1_000_000)
    openai_client, anthropic_client = edges.openai(), edges.anthropic()
    says = f"more than {MAX_JSON_DEPTH} levels deep; flatten it"
    with pytest.raises(openai.BadRequestError) as refused:
        await trio.to_thread.run_sync(
            lambda: openai_client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
                tools=[{"type": "function", "function": {"name": "f", "parameters": nested(900)}}],
            )
        )
    assert refused.value.type == "invalid_request_error" and says in refused.value.message
    for create in (anthropic_client.messages.create, anthropic_client.messages.count_tokens):
        with pytest.raises(anthropic.BadRequestError) as refused_there:
            await trio.to_thread.run_sync(
                lambda: create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    tools=[{"name": "f", "input_schema": {"type": "object", "properties": nested(900)}}],
                    **({"max_tokens": 8} if create == anthropic_client.messages.create else {}),
                )
            )
        assert refused_there.value.body["error"]["type"] == "invalid_request_error"
        assert says in refused_there.value.message
    # Deeper than the SDKs can encode (Python's json recursion) and than orjson parses.
    headers = {"authorization": f"Bearer {edges.key}", "content-type": "application/json"}
    deepest = b'{"model": "smollm2-135m", "messages": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    error = assert_openai_error(
        await http.post(edges.base + "/v1/chat/completions", content=deepest, headers=headers),
        400,
        "invalid_request_error",
    )
    assert says in error["message"]
    error = assert_anthropic_error(
        await http.post(edges.base + "/v1/messages", content=deepest, headers=headers), 400, "invalid_request_error"
    )
    assert says in error["message"]


async def test_a_missing_key_is_named_by_the_header_each_apis_clients_send(edges, http):
    # No SDK sends a request without a key (each refuses to, client-side): curl and hand-written
    # clients do, and follow the message.
    error = assert_openai_error(
        await http.post(edges.base + "/v1/chat/completions", json=CHAT_BODY), 401, "authentication_error"
    )
    assert "Authorization: Bearer <key>" in error["message"] and "x-api-key" not in error["message"]
    for path, body in (("/v1/messages", CHAT_BODY), ("/v1/messages/count_tokens", COUNT_BODY)):
        error = assert_anthropic_error(await http.post(edges.base + path, json=body), 401, "authentication_error")
        assert "x-api-key: <key>" in error["message"] and "Bearer" not in error["message"]


# ---- bodies being received, and answers given before a body arrived (issue 33, item 8) ------


def receiving(edges: Edges) -> float:
    family = edges.hub.registry.snapshot().get("engy_gateway_body_bytes_receiving", {"children": []})
    return sum(child["value"] for child in family["children"])


PADDED_HEAD = b'{"model": "smollm2-135m", "max_tokens": 8, "messages": [{"role": "user", "content": "'
PADDED_TAIL = b'"}]}'


class SlowUpload:
    """A chat request whose body httpx streams (chunked) up to `sent` bytes and then holds back
    until `finish` is set; `status` is the answer's once it has come."""

    def __init__(self, edges: Edges, key: str, sent: int) -> None:
        self.edges, self.key, self.sent = edges, key, sent
        self.finish = trio.Event()
        self.status: int | None = None

    async def body(self):
        yield PADDED_HEAD + b"x" * (self.sent - len(PADDED_HEAD))
        # The server passes a body on a piece behind (`hypercorn_edges`): this piece lets the one
        # above through to the gateway.
        yield b"x"
        await self.finish.wait()
        yield PADDED_TAIL

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as own:
            response = await own.post(
                self.edges.base + "/v1/chat/completions",
                content=self.body(),
                headers={"authorization": f"Bearer {self.key}", "content-type": "application/json"},
            )
        self.status = response.status_code


async def refused_upload(edges: Edges, key: str, path: str = "/v1/chat/completions") -> tuple[int, dict, dict]:
    """A body's first 32 KiB sent (chunked) and the rest held back: the answer, read while the
    client still owes the server most of its body, and the server's closing of the connection."""
    host, port = edges.base.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        piece = PADDED_HEAD + b"x" * (32 * 1024 - len(PADDED_HEAD))
        await stream.send_all(
            f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {key}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
            + b"%x\r\n%b\r\n" % (len(piece), piece)
            + b"1\r\nx\r\n"
        )
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split(" ")[1]), headers, orjson.loads(body)


async def test_slow_uploads_are_capped_per_account_and_in_all_and_refused_at_once(nursery, edges, http):
    # 60 slow 8 MB bodies from one key held 518 MB of the gateway. Here, at a test's scale: two
    # slow 60 KiB uploads fill most of an account's 128 KiB; its next upload is refused with a
    # 429 while another buyer's is not, and two more from that buyer fill the gateway's 256 KiB,
    # after which a third buyer's upload is refused with a 503 (529 on /v1/messages).
    keys = [edges.key] + [edges.store.create_buyer(f"buyer-{index}")[1] for index in range(2)]
    stalled = [SlowUpload(edges, keys[0], 60 * 1024), SlowUpload(edges, keys[0], 60 * 1024)]
    for upload in stalled:
        nursery.start_soon(upload.run)
    await wait_until_async(lambda: receiving(edges) >= 120 * 1024, timeout_s=30, what="two uploads under way")

    status, headers, body = await refused_upload(edges, keys[0])
    assert status == 429 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert (
        body["error"]["type"] == "rate_limit_error" and f"{BODY_BYTES_PER_ACCOUNT} at once" in body["error"]["message"]
    )
    status, headers, body = await refused_upload(edges, keys[0], "/v1/messages")
    assert status == 429 and body["error"]["type"] == "rate_limit_error"

    stalled += [SlowUpload(edges, keys[1], 60 * 1024), SlowUpload(edges, keys[1], 60 * 1024)]
    for upload in stalled[2:]:
        nursery.start_soon(upload.run)
    await wait_until_async(lambda: receiving(edges) >= 240 * 1024, timeout_s=30, what="four uploads under way")
    status, headers, body = await refused_upload(edges, keys[2])
    assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert "retry shortly" in body["error"]["message"]
    status, headers, body = await refused_upload(edges, keys[2], "/v1/messages")
    assert status == 529 and body["error"]["type"] == "overloaded_error"

    # The held-back bodies, once sent, are read and answered as any other (402: no credit), and
    # what they held is given back: the first buyer's next upload is read whole.
    for upload in stalled:
        upload.finish.set()
    await wait_until_async(lambda: all(upload.status is not None for upload in stalled), timeout_s=30, what="answers")
    assert [upload.status for upload in stalled] == [402] * 4 and receiving(edges) == 0
    response = await http.post(
        edges.base + "/v1/chat/completions", json=CHAT_BODY, headers={"authorization": f"Bearer {keys[0]}"}
    )
    assert response.status_code == 402 and "connection" not in response.headers


async def test_a_413_before_the_body_arrived_says_the_connection_closes(edges):
    host, port = edges.base.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        # Twice the limit: the server passes a body on a piece behind, so the gateway sees more
        # than the limit only once more than that has come.
        piece = b"x" * (2 * MAX_BODY_BYTES)
        await stream.send_all(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {edges.key}\r\ncontent-length: {10 * MAX_BODY_BYTES}\r\n\r\n".encode()
            + piece
        )
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                received += chunk
    head = received.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 413") and "\r\nconnection: close\r\n" in head + "\r\n"
