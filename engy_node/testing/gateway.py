"""A protocol-level gateway for miner tests and benchmarks: docs/protocol.md exactly, nothing more.

It serves `GET /gw/meta` and one websocket endpoint per worker on real hypercorn (the stack the
gateway role uses), parses every miner frame with the protocol module's parser, and lets a
test drive each leg: send `serve`/`cancel`/`ping`/`reconnect`/`gemm_challenge`, drop a
connection, and collect the `chunk`s and the `response` for a request and the `gemm_openings`
for a challenge. Nothing here judges proofs or openings: the tests verify them independently.
"""

from __future__ import annotations

import dataclasses
import itertools

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from engy_node.protocol.gemm import GemmChallenge, GemmOpenings, GemmPick
from engy_node.protocol.miner import (
    MAX_FRAME_BYTES,
    Admit,
    Cancel,
    Chunk,
    Deny,
    Heartbeat,
    Hello,
    MinerFrame,
    Ping,
    ProtocolError,
    Reconnect,
    Response,
    Serve,
    ServeRequest,
    encode,
    parse_miner_frame,
)


@dataclasses.dataclass
class LegConnection:
    worker: int
    hello: Hello
    websocket: WebSocket
    heartbeats: list[Heartbeat] = dataclasses.field(default_factory=list)
    closed: trio.Event = dataclasses.field(default_factory=trio.Event)
    close_code: int | None = None
    close_reason: str = ""
    """What the miner said when it closed the connection (empty when it did not close it)."""


@dataclasses.dataclass
class RequestRecord:
    chunks: list[str] = dataclasses.field(default_factory=list)
    response: Response | None = None
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


class GatewayHarness:
    def __init__(self, *, workers: int = 1, deny_reason: str | None = None) -> None:
        self.workers = workers
        self.deny_reason = deny_reason
        self.hellos: list[Hello] = []
        self.legs: dict[int, LegConnection] = {}
        self.requests: dict[str, RequestRecord] = {}
        self.protocol_errors: list[str] = []
        self.openings: dict[str, GemmOpenings] = {}
        """Each challenge's answer, by challenge_id."""
        self._changed = trio.Event()
        self._ids = itertools.count()
        self.url = ""

    def app(self) -> Starlette:
        routes = [
            Route("/gw/meta", self._meta),
            WebSocketRoute("/gw", self._leg),
            WebSocketRoute("/gw/{worker:int}", self._leg),
        ]
        return Starlette(routes=routes)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.websocket_max_message_size = MAX_FRAME_BYTES
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, self.app(), config)
            self.url = binds[0].replace("http://", "ws://") + "/gw"
            task_status.started(self.url)

    async def _meta(self, request) -> JSONResponse:
        return JSONResponse({"workers": self.workers})

    async def _leg(self, websocket: WebSocket) -> None:
        worker = websocket.path_params.get("worker", 0)
        await websocket.accept()
        hello: MinerFrame | ProtocolError
        try:
            hello = parse_miner_frame(await websocket.receive_text())
        except ProtocolError as error:
            hello = error
        if not isinstance(hello, Hello):
            self.protocol_errors.append(f"first frame was {type(hello).__name__}, not hello")
            await websocket.close(code=1002)
            return
        self.hellos.append(hello)
        if self.deny_reason is not None:
            await websocket.send_text(encode(Deny(self.deny_reason)))
            await websocket.close()
            self._notify()
            return
        await websocket.send_text(encode(Admit()))
        leg = LegConnection(worker, hello, websocket)
        self.legs[worker] = leg
        self._notify()
        try:
            while True:
                try:
                    frame = parse_miner_frame(await websocket.receive_text())
                except ProtocolError as error:
                    # As the real gateway does: a malformed frame closes that leg.
                    self.protocol_errors.append(str(error))
                    await websocket.close(code=1002)
                    return
                if isinstance(frame, Heartbeat):
                    leg.heartbeats.append(frame)
                elif isinstance(frame, Chunk):
                    self.requests.setdefault(frame.corr_id, RequestRecord()).chunks.append(frame.content)
                elif isinstance(frame, Response):
                    record = self.requests.setdefault(frame.corr_id, RequestRecord())
                    record.response = frame
                    record.done.set()
                elif isinstance(frame, GemmOpenings):
                    self.openings[frame.challenge_id] = frame
                else:
                    self.protocol_errors.append(f"unexpected {type(frame).__name__} after admission")
                self._notify()
        except WebSocketDisconnect as disconnect:
            leg.close_code, leg.close_reason = disconnect.code, disconnect.reason or ""
        finally:
            leg.closed.set()
            if self.legs.get(worker) is leg:
                del self.legs[worker]
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate, timeout: float = 30.0) -> None:
        with trio.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    async def serve(self, request: ServeRequest, *, worker: int = 0, stream: bool = False) -> str:
        corr_id = f"corr-{next(self._ids)}"
        self.requests[corr_id] = RequestRecord()
        await self.legs[worker].websocket.send_text(encode(Serve(corr_id, request, stream)))
        return corr_id

    async def result(self, corr_id: str, timeout: float = 120.0) -> RequestRecord:
        record = self.requests[corr_id]
        with trio.fail_after(timeout):
            await record.done.wait()
        return record

    async def challenge(
        self, rid: str, picks: tuple[GemmPick, ...], *, worker: int = 0, timeout: float = 60.0
    ) -> GemmOpenings:
        """Send a `gemm_challenge` for `rid` and wait for its answer."""
        challenge_id = f"challenge-{next(self._ids)}"
        await self.legs[worker].websocket.send_text(encode(GemmChallenge(challenge_id, rid, picks)))
        await self.wait_for(lambda: challenge_id in self.openings, timeout)
        return self.openings[challenge_id]

    async def cancel(self, corr_id: str, *, worker: int = 0) -> None:
        await self.legs[worker].websocket.send_text(encode(Cancel(corr_id)))

    async def ping(self, worker: int = 0) -> None:
        await self.legs[worker].websocket.send_text(encode(Ping()))

    async def reconnect(self, worker: int = 0) -> None:
        await self.legs[worker].websocket.send_text(encode(Reconnect()))

    async def drop(self, worker: int = 0) -> None:
        await self.legs[worker].websocket.close(code=1011)
