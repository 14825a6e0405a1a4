"""The gateway's HTTP surface: the buyer API's route table and the miner endpoint's.

The two chat routes are `relay.ChatEndpoint`s over one `lifecycle.Gateway`; the other buyer
routes (models, token counting, health) are small handlers here.
"""

from __future__ import annotations

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router, WebSocketRoute

from engy_node.asgi import Receive, Send
from engy_node.gateway import anthropic_api, openai_api
from engy_node.gateway.chat import GatewayError
from engy_node.gateway.lifecycle import Gateway
from engy_node.gateway.pool import MinerPool
from engy_node.gateway.relay import ANTHROPIC, OPENAI, ChatEndpoint


class Handlers:
    """The buyer API's other routes over one `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def count_tokens(self, request: Request) -> Response:
        gateway = self.gateway
        request_id = gateway.new_id()
        try:
            await gateway.authenticate(ANTHROPIC.api_key(request.headers))
            chat = anthropic_api.parse_count_tokens_request(await gateway.read_body(request.receive), known_models=set(gateway.models),
                                                            max_output_tokens_for=gateway.max_output_tokens_for)
            model = gateway.models[chat.model]
            ids = await trio.to_thread.run_sync(model.render_prompt, gateway.serve_request(chat, request_id))
            return JSONResponse(anthropic_api.count_tokens_body(len(ids)))
        except GatewayError as err:
            return ANTHROPIC.error_response(err, request_id)

    async def models(self, request: Request) -> Response:
        return JSONResponse(openai_api.models_body([(model, self.gateway.created, "engy") for model in sorted(self.gateway.models)]))

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.gateway.models:
            return OPENAI.error_response(GatewayError("not_found", f"The model `{name}` does not exist", param="model"), self.gateway.new_id())
        return JSONResponse(openai_api.model_body((name, self.gateway.created, "engy")))

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "miners": len(self.gateway.pool.legs)})



class BuyerApp:
    """The buyer API. The two chat routes, nearly all of its traffic, are dispatched on their
    exact path; everything else (and anything else sent to those paths) goes through Starlette's
    router, which tries each route's pattern in turn."""

    def __init__(self, chat: dict[str, ChatEndpoint], router: Router) -> None:
        self.chat = chat
        self.router = router

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and (endpoint := self.chat.get(scope["path"])) is not None:
            await endpoint(scope, receive, send)
        else:
            await self.router(scope, receive, send)


def build_buyer_app(handlers: Handlers) -> BuyerApp:
    chat = {"/v1/chat/completions": ChatEndpoint(handlers.gateway, OPENAI), "/v1/messages": ChatEndpoint(handlers.gateway, ANTHROPIC)}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in chat.items()),
        Route("/v1/messages/count_tokens", handlers.count_tokens, methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{name:path}", handlers.model, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
    ]
    return BuyerApp(chat, Router(routes=routes))


def build_miner_app(pool: MinerPool, *, workers: int = 1) -> Starlette:
    async def meta(request: Request) -> Response:
        return JSONResponse({"workers": workers})

    return Starlette(routes=[Route("/gw/meta", meta, methods=["GET"]), WebSocketRoute("/gw", pool.endpoint),
                             WebSocketRoute("/gw/{worker:int}", pool.endpoint)])

