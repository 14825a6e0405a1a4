"""The node's local control API: what the TUI attaches to, what `engy-node status` reads, and
where operators (and Prometheus) get the node's state, events, metrics and actions (docs/architecture.md).

Failure posture: this API can run actions on the node (restart its model server, pause its
traffic), so it is reachable only by someone who can already read the node's data dir. It binds
loopback only, and a non-loopback host is refused rather than quietly narrowed, so an operator
who asked for 0.0.0.0 learns it is not on offer (an SSH tunnel is the way in from elsewhere).
Every request, `/metrics` and unknown paths included, needs `Authorization: Bearer <token>`,
where the token lives in `<data_dir>/control.token` (mode 0600). Prometheus reads the same file
(`authorization: {credentials_file: …}`), so there is one secret, not one per reader.

The token file is made once and reused, so a TUI or scraper keeps working across restarts. A
token file that group or others can read is replaced by a fresh one rather than tightened
(`chmod` would keep a token that may already have been read) or refused (the operator would
only have to do by hand what is safe to do here; every client reads the file afresh, so a new
token costs them nothing). A token file owned by someone else is refused.

Where the node listens (`port` 0 picks a free one) is written to `<data_dir>/control.json`
while it serves, so `engy-node status` and `engy-tui --attach` find it from `--home` alone.

Readers poll the hub, like the TUI does (see `hub.py`): `/v1/events` pages through the ring by
sequence number, and `/v1/events/stream` is that same poll at `STREAM_POLL_S` written out as
Server-Sent Events. A slow client therefore holds no queue: what it has not read stays in the
ring, and if the ring moves past it the stream says how many events it missed.

Routes (JSON unless said; errors `{"error": {"message", "type"}}` with the status that fits):

* `GET /v1/status`: `{"node": {...}, "states", "metrics", "last_seq"}` (`Hub.snapshot()`).
* `GET /v1/events?since=N&limit=M`: `{"events": [{seq, ts, level, component, message}],
  "next_seq", "missed"}`; `since` defaults to 0 (all the ring holds), `limit` to
  `DEFAULT_EVENTS_LIMIT` and is capped at `MAX_EVENTS_LIMIT`.
* `GET /v1/events/stream?since=N` (or a `Last-Event-ID` header): `text/event-stream`. Each
  event is `id: <seq>` and one `data: <event JSON>` line; events that fell out of the ring first
  arrive as `event: missed` with `data: {"missed": n}`; `: keep-alive` comments fill silences.
* `GET /metrics`: Prometheus text format 0.0.4.
* `GET /v1/actions`: `{"actions": [{"id", "description"}]}`; `POST /v1/actions/{id}` with an
  optional JSON object body (the action's parameters): `{"action": id, "result": {...}}`.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import re
import secrets
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engy_node.asgi import BodyError, Receive, Send, read_json_object, start_listener, watch_disconnect
from engy_node.errors import ConfigError, EngyError, single_failure
from engy_node.hub import Event, Hub

log = logging.getLogger("engy.control")

TOKEN_FILE = "control.token"
ENDPOINT_FILE = "control.json"
HOST_SETTING = "control.host"
PORT_SETTING = "control.port"
"""The settings an operator changes to fix a refused host or a busy port; errors name them."""

DEFAULT_EVENTS_LIMIT = 500
MAX_EVENTS_LIMIT = 5000
"""A page of the ring: 5,000 events of ~200 bytes is a 1 MB answer, which a client parses in
well under a frame; larger asks are capped, not refused, since `next_seq` pages on."""
STREAM_POLL_S = 0.25
"""Events reach a stream reader within this; the TUI renders at 2–5 Hz, so sooner buys nothing."""
STREAM_BATCH = 500
"""Events read from the ring per poll; a full batch is followed by the next one at once."""
STREAM_KEEPALIVE_S = 15.0
"""A silent stream gets a comment this often, so idle-timeouts between client and node (and the
client's own) see a live connection."""
ACTION_TIMEOUT_S = 30.0
"""Default bound on one action; a role registering a slower one (a model reload) passes its own."""
MAX_BODY_BYTES = 64 * 1024
"""Action parameters are a handful of fields; nothing legitimate comes near this."""
ACTION_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
DECIMAL = re.compile(r"[0-9]{1,18}")
TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
"""Visible ASCII: what an HTTP header carries unchanged (`token_urlsafe` is a subset)."""


class ControlError(EngyError):
    title = "control"


class NodeNotRunningError(ControlError):
    """Nothing answers at the control API's address."""


class ControlAuthError(ControlError):
    """The node answered but refused the token."""


@dataclasses.dataclass(frozen=True, slots=True)
class ControlEndpoint:
    url: str
    """`http://127.0.0.1:PORT`, without a trailing slash."""
    token_file: Path

    def __str__(self) -> str:
        return f"{self.url} (token in {self.token_file})"


# ---- the token and the endpoint file ---------------------------------------------------------
def token_path(data_dir: Path) -> Path:
    return Path(data_dir) / TOKEN_FILE


def endpoint_path(data_dir: Path) -> Path:
    return Path(data_dir) / ENDPOINT_FILE


def control_token(data_dir: Path) -> str:
    """The node's control token: read from `<data_dir>/control.token`, or made (0600) if the
    file is missing, empty, or readable by group or others (see the module docstring)."""
    path = token_path(data_dir)
    try:
        info = path.stat()
    except FileNotFoundError:
        return _write_new_token(path)
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise ConfigError(
            f"the control token {path} belongs to another user (uid {info.st_uid}); "
            "run the node as its owner, or delete the file so a new one is made"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        log.warning(
            "the control token %s was readable by others (mode %o); replaced it with a new one",
            path,
            stat.S_IMODE(info.st_mode),
        )
        return _write_new_token(path)
    token = _read_token_text(path)
    if not token:
        log.warning("the control token %s was empty; made a new one", path)
        return _write_new_token(path)
    return token


def read_token(token_file: Path) -> str:
    """A client's side: the token a node made, without ever making one (a token no node
    serves would only turn "not running" into "wrong token")."""
    try:
        token = _read_token_text(Path(token_file))
    except FileNotFoundError:
        raise NodeNotRunningError(
            f"no control token at {token_file}: no node has run with this data dir; "
            "start one (engy-node --role …, engy-node up) or pass the --home it runs with"
        ) from None
    except PermissionError:
        raise ControlAuthError(
            f"cannot read the control token {token_file}; run this as the user the node runs as"
        ) from None
    if not token:
        raise ControlAuthError(f"the control token {token_file} is empty; restart the node to make a new one")
    return token


def _read_token_text(path: Path) -> str:
    token = path.read_text(encoding="ascii", errors="replace").strip()
    if token and TOKEN_CHARS.fullmatch(token) is None:
        raise ConfigError(
            f"the control token {path} holds characters an HTTP header cannot carry; "
            "delete the file and a new one is made"
        )
    return token


def _write_new_token(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    _write_private(path, token + "\n")
    log.info("made a new control token in %s", path)
    return token


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` (mode 0600) through a temporary file and a rename, so a reader
    never sees a half-written file and the secret is never readable by others, not even
    briefly (the mode is set at creation, before anything is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover temporary file
        with os.fdopen(fd, "w", encoding="ascii") as file:
            fd = -1
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if fd != -1:
            os.close(fd)
        temporary.unlink(missing_ok=True)


def read_endpoint(data_dir: Path) -> ControlEndpoint:
    """Where the node using `data_dir` serves its control API, from the file it writes while
    serving. A file left behind by a killed node still reads; `fetch_status` then says that
    nothing answers there."""
    path = endpoint_path(data_dir)
    try:
        record = orjson.loads(path.read_bytes())
        return ControlEndpoint(url=str(record["url"]), token_file=Path(record["token_file"]))
    except FileNotFoundError:
        raise NodeNotRunningError(
            f"no engy node is serving with the data dir {data_dir} (no {path}); "
            "start one (engy-node --role …, engy-node up) or pass the --home it runs with"
        ) from None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise ControlError(f"{path} is not a control endpoint record; delete it and restart the node") from None


# ---- actions ---------------------------------------------------------------------------------
ActionHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    id: str
    description: str
    handler: ActionHandler
    timeout_s: float


class Actions:
    """What the control API can be asked to do. Roles register theirs at start-up
    ("restart-model-server", "pause-traffic", …); the API lists and runs them.

    A handler receives the request's JSON object (`{}` without a body) and returns a JSON-ready
    dict. It raises an `EngyError` for a request it refuses (answered 400 with its message). It
    runs under a timeout and is cancelled when that expires, so it must leave things consistent
    when cancelled. A client hanging up does not cancel it: an action half done on a whim of the
    network is worse than one finished for nobody."""

    def __init__(self) -> None:
        self._actions: dict[str, Action] = {}

    def register(
        self, id: str, description: str, handler: ActionHandler, *, timeout_s: float = ACTION_TIMEOUT_S
    ) -> None:
        """Raises ValueError for an id that is not lowercase letters, digits and dashes, or that
        is taken: two roles claiming one id is a bug to find at start-up, not at first use."""
        if ACTION_ID.fullmatch(id) is None:
            raise ValueError(f"action id {id!r} must be lowercase letters, digits and dashes (at most 64)")
        if id in self._actions:
            raise ValueError(f"action {id!r} is already registered")
        if not timeout_s > 0:
            raise ValueError(f"action {id!r}: timeout_s must be positive, got {timeout_s}")
        self._actions[id] = Action(id, description, handler, timeout_s)

    def get(self, id: str) -> Action | None:
        return self._actions.get(id)

    def ids(self) -> list[str]:
        return sorted(self._actions)

    def describe(self) -> list[dict[str, str]]:
        return [{"id": action.id, "description": action.description} for _, action in sorted(self._actions.items())]


def node_actions() -> Actions:
    """A registry with what every node can do: change its log level (`{"level": "debug"}`)."""
    from engy_node.hub import set_log_level

    actions = Actions()

    async def log_level(params: dict[str, Any]) -> dict[str, Any]:
        level = params.get("level")
        try:
            set_log_level(level if isinstance(level, str) else "")
        except ValueError as error:
            raise ControlError(f'{error}; send {{"level": "debug"}}') from None
        logging.getLogger("engy.control").info("log level set to %s", level)
        return {"level": level}

    actions.register(
        "set-log-level", "change the node's stderr and log-file level (debug, info, warning, error)", log_level
    )
    return actions


# ---- the app ---------------------------------------------------------------------------------
def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    # orjson, not JSONResponse: role states may hold values json.dumps rejects (a Path, a NaN
    # gauge); `default=str` and orjson's null-for-NaN keep a status answer from becoming a 500.
    return Response(
        orjson.dumps(body, default=str, option=orjson.OPT_NON_STR_KEYS),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _error(status: int, type_: str, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return _json({"error": {"message": message, "type": type_}}, status, headers)


class _BadParameter(ValueError):
    pass


def _int_param(request: Request, name: str, default: int, *, minimum: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    if DECIMAL.fullmatch(text) is None or int(text) < minimum:
        raise _BadParameter(f"{name} must be a whole number of at least {minimum}, not {text!r}")
    return int(text)


def _event_dict(event: Event) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "ts": event.ts,
        "level": event.level,
        "component": event.component,
        "message": event.message,
    }


class _TokenAuth:
    """Refuses, before routing, any HTTP request without the bearer token, so an unauthorised
    caller learns nothing, not even which paths exist."""

    def __init__(self, app, *, token: str, token_file: Path) -> None:
        self.app = app
        self.expected = b"bearer " + token.encode("ascii")
        self.token_file = token_file

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorised(scope):
            given = any(name == b"authorization" for name, _ in scope["headers"])
            message = (
                f"{'wrong' if given else 'missing'} control token; send Authorization: Bearer <token>, "
                f"with the token from {self.token_file}"
            )
            await _error(401, "unauthorized", message, {"www-authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                # The scheme is case-insensitive (RFC 9110); the token is compared in constant time.
                scheme, _, rest = value.partition(b" ")
                return hmac.compare_digest(scheme.lower() + b" " + rest.strip(), self.expected)
        return False


class _EventStream(Response):
    """The ring from `since` on, as Server-Sent Events, until the client hangs up (watched by
    `asgi.watch_disconnect`, which cancels the poll) or the server stops."""

    media_type = "text/event-stream"

    def __init__(self, hub: Hub, since: int) -> None:
        # Not Response.__init__: it renders an empty body and would announce Content-Length: 0.
        self.hub = hub
        self.seq = since
        """The next event to send."""
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        log.debug("event stream opened at seq %d", self.seq)
        async with watch_disconnect(receive):
            # A first comment at once, so a client's "connected" does not wait for the first event.
            await send({"type": "http.response.body", "body": b": connected\n\n", "more_body": True})
            await self._pump(send)
        # The pump never returns: only the client leaving (the watch cancels it) ends up here.
        log.debug("event stream ended at seq %d: the client left", self.seq)

    async def _pump(self, send: Send) -> None:
        last_sent = trio.current_time()
        while True:
            batch = self.hub.events_since(self.seq, limit=STREAM_BATCH)
            self.seq = batch.next_seq
            chunks = []
            if batch.missed:
                chunks.append(b"event: missed\ndata: " + orjson.dumps({"missed": batch.missed}) + b"\n\n")
            chunks.extend(
                b"id: %d\ndata: %s\n\n" % (event.seq, orjson.dumps(_event_dict(event))) for event in batch.events
            )
            now = trio.current_time()
            if not chunks and now - last_sent >= STREAM_KEEPALIVE_S:
                chunks.append(b": keep-alive\n\n")
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
                last_sent = now
            if len(batch.events) < STREAM_BATCH:
                await trio.sleep(STREAM_POLL_S)


class _ControlApi:
    def __init__(self, hub: Hub, *, node_info: Mapping[str, Any], actions: Actions) -> None:
        self.hub = hub
        self.node_info = dict(node_info)
        self.actions = actions

    async def status(self, request: Request) -> Response:
        return _json({"node": self.node_info, **self.hub.snapshot()})

    async def events(self, request: Request) -> Response:
        try:
            since = _int_param(request, "since", 0, minimum=0)
            limit = min(_int_param(request, "limit", DEFAULT_EVENTS_LIMIT, minimum=1), MAX_EVENTS_LIMIT)
        except _BadParameter as bad:
            return _error(400, "invalid_request", str(bad))
        batch = self.hub.events_since(since, limit=limit)
        return _json(
            {
                "events": [_event_dict(event) for event in batch.events],
                "next_seq": batch.next_seq,
                "missed": batch.missed,
            }
        )

    async def stream(self, request: Request) -> Response:
        # EventSource clients reconnect with the id of the last event they saw.
        last_id = request.headers.get("last-event-id", "")
        default = int(last_id) + 1 if DECIMAL.fullmatch(last_id) else 0
        try:
            since = _int_param(request, "since", default, minimum=0)
        except _BadParameter as bad:
            return _error(400, "invalid_request", str(bad))
        return _EventStream(self.hub, since)

    async def metrics(self, request: Request) -> Response:
        from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

        return Response(generate_latest(self.hub.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    async def list_actions(self, request: Request) -> Response:
        return _json({"actions": self.actions.describe()})

    async def run_action(self, request: Request) -> Response:
        action_id = request.path_params["action_id"]
        action = self.actions.get(action_id)
        if action is None:
            known = ", ".join(self.actions.ids()) or "none are registered"
            return _error(404, "not_found", f"no action {action_id!r}; known actions: {known}")
        try:
            params = await read_json_object(request.receive, max_bytes=MAX_BODY_BYTES, allow_empty=True)
        except BodyError as bad:
            return _error(bad.status, "request_too_large" if bad.status == 413 else "invalid_request", str(bad))
        log.info("action %s requested%s", action_id, f" with {sorted(params)}" if params else "")
        try:
            with trio.fail_after(action.timeout_s):
                result = await action.handler(params)
        except trio.TooSlowError:
            log.warning("action %s did not finish within %g s; cancelled it", action_id, action.timeout_s)
            return _error(
                504, "timeout", f"action {action_id} did not finish within {action.timeout_s:g} s and was cancelled"
            )
        except EngyError as refused:
            log.info("action %s refused: %s", action_id, refused)
            return _error(400, "action_failed", str(refused))
        except Exception:  # broad on purpose: a broken action must answer, and be logged, not kill the API
            log.exception("action %s failed", action_id)
            return _error(
                500, "internal_error", f"action {action_id} failed unexpectedly; the node's log has the details"
            )
        if not isinstance(result, dict):
            log.error("action %s returned %s, not a dict", action_id, type(result).__name__)
            return _error(
                500, "internal_error", f"action {action_id} returned no result object; the node's log has the details"
            )
        return _json({"action": action_id, "result": result})


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(
        404,
        "not_found",
        f"no route {request.url.path}; the control API serves /v1/status, /v1/events, "
        "/v1/events/stream, /v1/actions and /metrics",
    )


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error(500, "internal_error", "the control API failed on this request; the node's log has the details")


def build_control_app(
    hub: Hub, *, token: str, token_file: Path, node_info: Mapping[str, Any], actions: Actions
) -> Starlette:
    """The control API as an ASGI app. `node_info` (version, pid, roles, started_at, home, …)
    is copied once and answered under "node" in every status."""
    api = _ControlApi(hub, node_info=node_info, actions=actions)
    return Starlette(
        routes=[
            Route("/v1/status", api.status, methods=["GET"]),
            Route("/v1/events", api.events, methods=["GET"]),
            Route("/v1/events/stream", api.stream, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
            Route("/v1/actions", api.list_actions, methods=["GET"]),
            Route("/v1/actions/{action_id}", api.run_action, methods=["POST"]),
        ],
        middleware=[Middleware(_TokenAuth, token=token, token_file=token_file)],
        exception_handlers={404: _not_found, 405: _not_allowed, 500: _server_error},
    )


# ---- the service -----------------------------------------------------------------------------
def loopback_bind(host: str, port: int) -> str:
    """hypercorn's bind string for `host:port`, or a `ConfigError` if `host` is not loopback."""
    if host == "localhost":
        # Bind the address, not the name: a hosts file can point "localhost" anywhere.
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise ConfigError(
            f"the control API listens on loopback only (127.0.0.1 or ::1), not {host!r}: it can run "
            f"actions on this node. Set {HOST_SETTING} to 127.0.0.1, and reach it from another machine "
            "through an SSH tunnel (ssh -L)"
        )
    if not 0 <= port <= 65535:
        raise ConfigError(f"{PORT_SETTING} must be a port number (0 picks a free one), not {port}")
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


async def serve_control(
    hub: Hub,
    *,
    data_dir: Path,
    actions: Actions,
    node_info: Mapping[str, Any],
    host: str = "127.0.0.1",
    port: int = 0,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """A node service (see `node.py`): serve the control API on `host:port` until cancelled.
    Ready, it reports a `ControlEndpoint`, records it in the hub's "control" state and in
    `<data_dir>/control.json` (removed again on the way out)."""
    from hypercorn.config import Config as HypercornConfig

    bind = loopback_bind(host, port)
    data_dir = Path(data_dir)
    token = await trio.to_thread.run_sync(control_token, data_dir)
    token_file = token_path(data_dir)
    app = build_control_app(hub, token=token, token_file=token_file, node_info=node_info, actions=actions)
    hc = HypercornConfig()
    hc.bind = [bind]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("engy.control.http")
    # single_failure: a busy port comes out of `nursery.start` as the ConfigError itself.
    with single_failure():
        async with trio.open_nursery() as nursery:
            binds = await start_listener(nursery, app, hc, what="control API", flag=PORT_SETTING)
            endpoint = ControlEndpoint(url=binds[0].rstrip("/"), token_file=token_file)
            record = orjson.dumps({"url": endpoint.url, "token_file": str(token_file), "pid": os.getpid()})
            try:
                await trio.to_thread.run_sync(_write_private, endpoint_path(data_dir), record.decode())
                hub.set_state("control", url=endpoint.url, token_file=str(token_file))
                log.info("control API on %s; token in %s", endpoint.url, token_file)
                task_status.started(endpoint)
                await trio.sleep_forever()
            finally:
                _remove_endpoint_record(endpoint_path(data_dir), endpoint.url)


def _remove_endpoint_record(path: Path, url: str) -> None:
    # Only our own record: a second node started on this data dir since then owns the file now.
    # A few bytes of local IO, done inline because it runs while the service is being cancelled.
    try:
        if orjson.loads(path.read_bytes()).get("url") == url:
            path.unlink()
    except (OSError, orjson.JSONDecodeError, AttributeError) as error:
        log.debug("left %s in place (%s)", path, error)


# ---- the CLI's client ------------------------------------------------------------------------
def fetch_status(url: str, token: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """`GET /v1/status` from a running node, blocking (for CLI commands). Raises
    `NodeNotRunningError` when nothing answers, `ControlAuthError` for a refused token, and
    `ControlError` for anything else, each naming the fix."""
    import httpx

    url = url.rstrip("/")
    try:
        # trust_env=False: a proxy from the environment must never see (or relay) a loopback token.
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            response = client.get(f"{url}/v1/status", headers={"authorization": f"Bearer {token}"})
    except httpx.ConnectError as error:
        raise NodeNotRunningError(
            f"no engy node answers at {url} ({error}); start one (engy-node --role …, "
            "engy-node up), or check --home and the control port"
        ) from None
    except httpx.TimeoutException:
        raise ControlError(
            f"the node at {url} did not answer within {timeout:g} s; it may be overloaded or stuck "
            "(engy-node diagnose collects its logs)"
        ) from None
    except httpx.HTTPError as error:
        raise ControlError(f"cannot read the status from {url}: {error}") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ControlError(
            f"{url} answered HTTP {response.status_code} without a JSON object; is it an engy node's control API?"
        )
    reported = body.get("error")
    message = reported.get("message") if isinstance(reported, dict) else None
    if response.status_code == 401:
        raise ControlAuthError(f"the node at {url} refused the control token: {message or 'unauthorized'}")
    if response.status_code != 200:
        raise ControlError(f"the node at {url} answered HTTP {response.status_code}: {message or response.text[:200]}")
    return body
