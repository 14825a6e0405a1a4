"""The gateway's HTTP surface: the buyer API's route table and the miner endpoint's.

The two chat routes are `relay.ChatEndpoint`s over one `lifecycle.Gateway`; the other buyer
routes (models, token counting, health) are small handlers here.

Every error the buyer API answers has a JSON body in the dialect of the route asked for:
Anthropic's shape under `/v1/messages` (and `/v1/messages/…`), OpenAI's everywhere else
(`api_for_path`). The chat routes write their own (`relay.ChatEndpoint`); the answers no handler
writes are made so here: an unknown route (404), a wrong method (405) and a handler's failure
(500) by the router's exception handlers or, on the chat routes, `BuyerApp`'s guard around them,
and a request hypercorn refuses before any app runs (an oversized head, 431, or an unparsable
one, 400) by `hypercorn_edges` with `protocol_error_body`. A chat or count_tokens body not
declared `application/json` is refused before it is read (415 in OpenAI's dialect, 400 in
Anthropic's; each API module says why).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from engy_node.asgi import Receive, Send
from engy_node.gateway.api import anthropic_api, model_list, openai_api
from engy_node.gateway.api.chat import GatewayError
from engy_node.gateway.api.generations import BuyerRecords
from engy_node.gateway.billing.miner_epoch import MinerEpochs
from engy_node.gateway.fleet.workers import LISTEN_BACKLOG
from engy_node.gateway.request.flight import new_request_id
from engy_node.gateway.request.lifecycle import Gateway
from engy_node.gateway.request.relay import ANTHROPIC, OPENAI, Api, ChatEndpoint
from engy_node.gateway.routing.fallbacks import announces_gemm
from engy_node.gateway.routing.pool import MinerPool
from engy_node.hypercorn_edges import EdgeConfig
from engy_node.protocol.miner import MAX_FRAME_BYTES

log = logging.getLogger("engy.gateway")

MAX_HEADER_BYTES = 16 * 1024
"""The largest request head (request line and headers) a listener buffers while the rest of it
is still to come: hypercorn's default, far above what SDKs send (well under 1 KiB). h11 measures
a head only while it is incomplete, so one that arrives whole in one read (hypercorn reads
64 KiB at a time) may be larger; one that does not is answered 431."""

ROUTES = (
    "POST /v1/chat/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /v1/generation?id=…",
    "GET /v1/usage",
    "GET /health",
)
"""What the buyer API serves, as a 404 lists it."""

INTERNAL_ERROR = GatewayError(
    "api_error", "the gateway failed on this request; retry it, and report the request id if it fails again"
)
"""A 500 for a failure of the gateway's own (the log has the cause; the buyer gets the request id)."""

_UNSUPPORTED_CONTENT_TYPE = {
    OPENAI.name: openai_api.unsupported_content_type,
    ANTHROPIC.name: anthropic_api.unsupported_content_type,
}


def api_for_path(path: str) -> Api:
    """The dialect an error on `path` is written in: Anthropic's for its routes, else OpenAI's."""
    return ANTHROPIC if path == "/v1/messages" or path.startswith("/v1/messages/") else OPENAI


def is_json(content_type: str | None) -> bool:
    """Whether a `Content-Type` declares JSON: `application/json`, with or without parameters."""
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


def protocol_error_body(status: int, path: str | None) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The answer to a request hypercorn refused before the app saw it (`EdgeConfig`), in the
    dialect of its path (OpenAI's when even the request line could not be read)."""
    if status == 431:
        err = GatewayError(
            "request_too_large",
            f"the request's headers exceed {MAX_HEADER_BYTES} bytes; send fewer or "
            "smaller headers (an oversized cookie or token is the usual cause)",
        )
    else:
        err = GatewayError(
            "invalid_request",
            f"the request is not valid HTTP/1.1 (the server's parser answered {status}); "
            "check the request line and headers your client sends",
        )
    response = api_for_path(path or "").error_response(err, new_request_id())
    return response.raw_headers, bytes(response.body)


def hypercorn_config(bind: str | None) -> EdgeConfig:
    """The settings every gateway listener runs with (miner endpoint, buyer API, provider API)."""
    config = EdgeConfig(protocol_error_body=protocol_error_body)
    if bind is not None:
        config.bind = [bind]
    config.accesslog = None
    config.errorlog = logging.getLogger("engy.gateway.http")
    config.graceful_timeout = 5.0
    config.backlog = LISTEN_BACKLOG
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.websocket_max_message_size = MAX_FRAME_BYTES
    return config


async def route_error(request: Request, exc: Exception) -> Response:
    """The router's 404 and 405 (an `HTTPException`), and any other failure as a 500, in the
    dialect of the path asked for."""
    path, method = request.url.path, request.method
    headers: dict[str, str] = {}
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        err = GatewayError("method_not_allowed", f"{method} is not allowed on {path}; use {allowed}")
        headers["allow"] = allowed
    elif isinstance(exc, HTTPException) and exc.status_code == 404:
        err = GatewayError("not_found", f"Invalid URL ({method} {path}); this gateway serves {', '.join(ROUTES)}")
    elif isinstance(exc, HTTPException):
        err = GatewayError("invalid_request", f"{exc.detail} ({method} {path})")
    else:
        err = INTERNAL_ERROR
    response = api_for_path(path).error_response(err, new_request_id())
    response.headers.update(headers)
    return response


ERROR_HANDLERS = {HTTPException: route_error, Exception: route_error}
"""Starlette's `exception_handlers` for every router here."""


class Handlers:
    """The buyer API's other routes over one `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def count_tokens(self, request: Request) -> Response:
        gateway = self.gateway
        request_id = gateway.new_id()
        try:
            content_type = request.headers.get("content-type")
            if not is_json(content_type):
                raise anthropic_api.unsupported_content_type(content_type)
            # Not from the cache: counting makes no hold, the check a revoked key meets on a chat route.
            account = await gateway.authenticate(ANTHROPIC.api_key(request.headers), ANTHROPIC.name, cached=False)
            chat = anthropic_api.parse_count_tokens_request(
                await gateway.read_body(request.receive, account),
                known_models=set(gateway.models),
                max_output_tokens_for=gateway.max_output_tokens_for,
            )
            return JSONResponse(anthropic_api.count_tokens_body(await gateway.count_prompt(chat, request_id)))
        except GatewayError as err:
            return ANTHROPIC.error_response(err, request_id)

    async def models(self, request: Request) -> Response:
        return JSONResponse(model_list.models_body([self._model_body(model) for model in sorted(self.gateway.models)]))

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.gateway.models:
            return OPENAI.error_response(
                GatewayError("not_found", f"The model `{name}` does not exist", param="model"), self.gateway.new_id()
            )
        return JSONResponse(self._model_body(name))

    def _model_body(self, name: str) -> dict[str, Any]:
        gateway = self.gateway
        gemm = announces_gemm(gateway.pool, name, gateway.eligible)
        return model_list.model_body(
            gateway.models[name].spec, created=gateway.created, verified_by=model_list.verification(gemm=gemm)
        )

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "miners": len(self.gateway.pool.legs)})


class BuyerApp:
    """The buyer API. The two chat routes, nearly all of its traffic, are dispatched on their
    exact path; everything else (and anything else sent to those paths) goes through Starlette's
    router, which tries each route's pattern in turn.

    A chat request whose body is not declared JSON is refused before it is read. The chat routes
    answer the errors they expect (`GatewayError`s) themselves; anything else that escapes one
    before it answered (a store that cannot write) is logged and answered with a JSON 500."""

    def __init__(self, chat: dict[str, ChatEndpoint], router: Starlette) -> None:
        self.chat = chat
        self.router = router

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and (endpoint := self.chat.get(scope["path"])) is not None
        ):
            await self._chat(endpoint, scope, receive, send)
        else:
            await self.router(scope, receive, send)

    async def _chat(self, endpoint: ChatEndpoint, scope: dict, receive: Receive, send: Send) -> None:
        api = endpoint.api
        content_type = Headers(scope=scope).get("content-type")
        if not is_json(content_type):
            await api.error_response(_UNSUPPORTED_CONTENT_TYPE[api.name](content_type), endpoint.gateway.new_id())(
                scope, receive, send
            )
            return
        answered = False

        async def send_watched(message) -> None:
            nonlocal answered
            answered = True
            await send(message)

        try:
            await endpoint(scope, receive, send_watched)
        except Exception:  # broad on purpose: whatever failed (a store that cannot write), the buyer gets a JSON 500
            log.exception("the %s chat route failed", api.name)
            if not answered:
                await api.error_response(INTERNAL_ERROR, endpoint.gateway.new_id())(scope, receive, send)


def build_buyer_app(handlers: Handlers) -> BuyerApp:
    records = BuyerRecords(handlers.gateway, clock=handlers.gateway.clock)
    chat = {
        "/v1/chat/completions": ChatEndpoint(handlers.gateway, OPENAI),
        "/v1/messages": ChatEndpoint(handlers.gateway, ANTHROPIC),
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in chat.items()),
        Route("/v1/messages/count_tokens", handlers.count_tokens, methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{name:path}", handlers.model, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/v1/generation", records.generation, methods=["GET"]),
        Route("/v1/usage", records.usage, methods=["GET"]),
    ]
    return BuyerApp(chat, Starlette(routes=routes, exception_handlers=ERROR_HANDLERS))


def build_miner_app(pool: MinerPool, *, workers: int = 1, epochs: MinerEpochs | None = None) -> Starlette:
    """The miner endpoint: `/gw/meta` (how many legs to open), the legs, and with `epochs` a
    miner's newest published epoch (`GET /gw/epoch/latest?hotkey=`, `billing.miner_epoch`)."""

    async def meta(request: Request) -> Response:
        return JSONResponse({"workers": workers})

    async def epoch(request: Request) -> Response:
        hotkey = request.query_params.get("hotkey", "")
        if not hotkey or len(hotkey) > 64 or not (hotkey.isascii() and hotkey.isalnum()):
            return JSONResponse(
                {"error": {"code": "invalid_request", "message": "name the miner's ss58 hotkey: ?hotkey=5…"}},
                status_code=400,
            )
        answer = None if epochs is None else await epochs.answer(hotkey)
        if answer is None:
            why = "this gateway publishes no epochs" if epochs is None else "no epoch has been published yet"
            return JSONResponse({"error": {"code": "no_epoch", "message": why}}, status_code=404)
        return JSONResponse(answer)

    return Starlette(
        routes=[
            Route("/gw/meta", meta, methods=["GET"]),
            Route("/gw/epoch/latest", epoch, methods=["GET"]),
            WebSocketRoute("/gw", pool.endpoint),
            WebSocketRoute("/gw/{worker:int}", pool.endpoint),
        ],
        exception_handlers=ERROR_HANDLERS,
    )
