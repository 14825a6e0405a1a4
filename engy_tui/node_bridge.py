"""The node manager's link to a node: the node's hub, read at a fixed rate, from either side of a
process boundary.

Two ways to have a node (docs/architecture.md, "The TUI"):

* **attached** (`engy-tui --attach URL`): a headless node (`engy-node --role …`, `engy-node up`)
  serves its control API; the trio side polls `/v1/status` and `/v1/events` with the node's
  token and keeps the newest snapshot and the events since the last frame.
* **local** (`engy-tui --local`): the node core runs inside this process, in the same trio guest
  run — `engy-node up`'s whole network, started by the `start` callable with the hub and action
  registry the TUI reads. Quitting cancels the guest run's root scope, which runs every node
  service's shutdown (model servers stopped, chain saved) before the host loop may end.

Either way the app sees the same things: `latest` (a `NodeSnapshot`: node info and states decoded
into `engy_node.snapshots` types, metrics, and whether the node answered), `drain_events()` (the log events that arrived
since the last call, bounded), and `run_action(id, params)` (the node's registered actions:
pause traffic, …). The app copies them into widgets at its own render rate, so 1,000 events a
second cost the UI one batch per frame, not one redraw per event.

The guest run lifecycle (start on the running asyncio loop; stop = cancel the root scope and
wait; an unexpected end reported once through `on_crash`) is `StatusBridge`'s, in
`engy_tui.bridge`; this module reuses it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import trio

from engy_node.control import Action, node_actions
from engy_node.errors import EngyError, collapse
from engy_node.hub import Hub
from engy_node.snapshots import STATE_SCHEMA, NodeInfo, NodeStates, decode, decode_states
from engy_tui.bridge import GuestRun

SNAPSHOT_INTERVAL_S = 0.5
EVENTS_INTERVAL_S = 0.25
REQUEST_TIMEOUT_S = 5.0
ACTION_TIMEOUT_S = 150.0
"""Long enough for the slowest action a node registers (a model server restart: 120 s)."""
EVENT_BATCH = 2_000
PENDING_EVENTS = 20_000
"""Events held for the next frame; a UI that falls further behind loses the oldest (counted)."""

log = logging.getLogger("engy.tui")

LocalStart = Callable[..., Awaitable[Any]]
"""`async def start(hub, actions, *, task_status)`: runs a node until cancelled."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node: NodeInfo
    states: NodeStates
    """Decoded once per snapshot (`snapshots.decode_states`, liberal), for every panel to read."""
    metrics: Mapping[str, Any]
    taken_at: float
    """Wall-clock seconds when this snapshot was read."""
    connected: bool
    error: str | None = None
    """Why the node did not answer (attached), or why it stopped (local)."""
    schema: int | None = None
    """The node's state schema (`snapshots.STATE_SCHEMA` of its version); None before it had one."""

    @property
    def newer_schema(self) -> bool:
        """The node speaks a state schema this TUI predates: some figures may be missing."""
        return self.schema is not None and self.schema > STATE_SCHEMA


class NodeBridge(GuestRun):
    """Feeds the node manager from a node: `NodeBridge.attach(url, token)` or `NodeBridge.local(start)`."""

    def __init__(
        self,
        *,
        url: str | None = None,
        token: str | None = None,
        start: LocalStart | None = None,
        node_info: Mapping[str, Any] | None = None,
        hub: Hub | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        if (url is None) == (start is None):
            raise ValueError("a NodeBridge either attaches to a URL or runs a node locally")
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.start_node = start
        self.hub = hub if hub is not None else (Hub() if start is not None else None)
        self.actions = node_actions()
        self.node_info = dict(node_info or {})
        self.clock = clock
        self.latest: NodeSnapshot | None = None
        self.missed_events = 0
        """Events the node or this bridge dropped before the UI drained them."""
        self.ready = False
        """Local: the node said it is serving. Attached: the first status answered."""
        self._pending: collections.deque[dict[str, Any]] = collections.deque(maxlen=PENDING_EVENTS)
        self._next_seq = 0
        self._error: str | None = None
        """Local: why the node stopped; snapshots carry it."""
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        """Local: where `run_action` starts a handler inside the guest run, and how it gets there."""

    @classmethod
    def attach(cls, url: str, token: str, **kwargs: Any) -> NodeBridge:
        return cls(url=url, token=token, **kwargs)

    @classmethod
    def local(
        cls, start: LocalStart, *, node_info: Mapping[str, Any] | None = None, hub: Hub | None = None, **kwargs: Any
    ) -> NodeBridge:
        return cls(start=start, node_info=node_info, hub=hub, **kwargs)

    @property
    def mode(self) -> str:
        return "attached" if self.url else "local"

    def drain_events(self) -> list[dict[str, Any]]:
        """The events that arrived since the last call, oldest first."""
        events = list(self._pending)
        self._pending.clear()
        return events

    async def list_actions(self) -> list[dict[str, Any]]:
        """The node's actions, `[{id, description}]`; raises `EngyError` when the node does not answer."""
        if self.url is None:
            return self.actions.describe()
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
                response = await client.get(f"{self.url}/v1/actions", headers=self._headers())
        except httpx.HTTPError as err:
            raise EngyError(f"the node at {self.url} does not answer ({type(err).__name__})") from None
        actions = _json(response).get("actions")
        return actions if isinstance(actions, list) else []

    async def run_action(self, action_id: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run one of the node's actions; raises `EngyError` with the node's message if it refuses.
        Call it from the host (asyncio) side: it hops into the guest run when local."""
        if self.url is None:
            action = self.actions.get(action_id)
            if action is None:
                raise EngyError(f"no action {action_id!r}; this node offers: {', '.join(self.actions.ids()) or 'none'}")
            return await self._in_guest(action, dict(params or {}))
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=ACTION_TIMEOUT_S) as client:
                response = await client.post(
                    f"{self.url}/v1/actions/{action_id}", json=dict(params or {}), headers=self._headers()
                )
        except httpx.HTTPError as err:
            raise EngyError(f"the node at {self.url} did not answer ({type(err).__name__})") from None
        body = _json(response)
        if response.status_code != 200:
            raise EngyError(str((body.get("error") or {}).get("message") or f"HTTP {response.status_code}"))
        return body.get("result") or {}

    async def _in_guest(self, action: Action, params: dict[str, Any]) -> dict[str, Any]:
        """Run a local action's handler inside the guest run and await its result from the host.

        Handlers are trio code (a model server restart sleeps and waits on trio events); awaited
        from the asyncio side they fail with trio's "must be called from async context", after
        whatever they did before their first wait. So the handler runs as a task in the node's
        nursery, under its own timeout as the control API runs it, and the host awaits an asyncio
        future that task settles."""
        if self._nursery is None or self._token is None or not self.running:
            raise EngyError(f"the node is not running, so {action.id} cannot run; start it again (engy-tui --local)")
        nursery, future = self._nursery, asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                with trio.fail_after(action.timeout_s):
                    result = await action.handler(params)
            except trio.TooSlowError:
                settle(EngyError(f"{action.id} did not finish within {action.timeout_s:g} s and was cancelled"))
            except EngyError as refused:
                settle(refused)
            except trio.Cancelled:
                settle(EngyError(f"the node stopped before {action.id} finished"))
                raise
            except Exception as failed:  # broad on purpose: a broken action must answer, not kill the node
                log.exception("action %s failed", action.id)
                settle(
                    EngyError(f"{action.id} failed unexpectedly ({collapse(failed)}); the node's log has the details")
                )
            else:
                settle(result if isinstance(result, dict) else {"result": result})

        def settle(outcome: dict[str, Any] | EngyError) -> None:
            if future.done():  # the host stopped waiting
                return
            if isinstance(outcome, EngyError):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        def spawn() -> None:  # runs inside the guest run, where a closed nursery raises
            try:
                nursery.start_soon(run)
            except RuntimeError:
                settle(EngyError(f"the node stopped before {action.id} could run"))

        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise EngyError(f"the node stopped before {action.id} could run") from None
        return await future

    # ---- the guest run ---------------------------------------------------------------------

    async def _main(self) -> None:
        if self.url is not None:
            await self._attached()
        else:
            await self._local()

    async def _attached(self) -> None:
        async with (
            httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(self._poll_events, client)
            while True:
                self.latest = await self._fetch_status(client)
                self.ready = self.ready or self.latest.connected
                await trio.sleep(SNAPSHOT_INTERVAL_S)

    async def _fetch_status(self, client: httpx.AsyncClient) -> NodeSnapshot:
        now = self.clock()
        previous = self.latest
        try:
            response = await client.get(f"{self.url}/v1/status", headers=self._headers())
        except httpx.HTTPError as err:
            return _stale(
                previous, now, f"the node at {self.url} does not answer ({type(err).__name__}); is it running?"
            )
        body = _json(response)
        if response.status_code != 200:
            message = (body.get("error") or {}).get("message") or f"HTTP {response.status_code}"
            return _stale(previous, now, f"the node refused: {message}")
        return snapshot_of(body.get("node"), body, taken_at=now, connected=True)

    async def _poll_events(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                response = await client.get(
                    f"{self.url}/v1/events",
                    params={"since": self._next_seq, "limit": EVENT_BATCH},
                    headers=self._headers(),
                )
            except httpx.HTTPError:
                await trio.sleep(SNAPSHOT_INTERVAL_S)  # the status poll says what is wrong
                continue
            body = _json(response)
            if response.status_code == 200:
                self._take(body.get("events") or [], body.get("next_seq", self._next_seq), body.get("missed", 0))
                if len(body.get("events") or []) >= EVENT_BATCH:
                    continue  # more are waiting: read them before the next frame
            await trio.sleep(EVENTS_INTERVAL_S)

    async def _local(self) -> None:
        assert self.start_node is not None and self.hub is not None
        async with trio.open_nursery() as nursery:
            self._nursery, self._token = nursery, trio.lowlevel.current_trio_token()
            nursery.start_soon(self._read_hub)
            try:
                await nursery.start(self.start_node, self.hub, self.actions)
            except Exception as raised:
                # The node could not start (a port in use, a missing model): show why and keep
                # the logs readable rather than closing the window on the user.
                error = collapse(raised)
                self._error = f"the node did not start: {error}"
                self.latest = _stale(self.latest, self.clock(), self._error)
                return
            self.ready = True

    async def _read_hub(self) -> None:
        assert self.hub is not None
        while True:
            batch = self.hub.events_since(self._next_seq, limit=EVENT_BATCH)
            self._take([dataclasses.asdict(event) for event in batch.events], batch.next_seq, batch.missed)
            snapshot = self.hub.snapshot()
            self.latest = snapshot_of(
                self.node_info, snapshot, taken_at=self.clock(), connected=self._error is None, error=self._error
            )
            await trio.sleep(EVENTS_INTERVAL_S)

    def _take(self, events: list[dict[str, Any]], next_seq: Any, missed: Any) -> None:
        overflow = max(0, len(self._pending) + len(events) - PENDING_EVENTS)
        self.missed_events += overflow + (missed if isinstance(missed, int) else 0)
        self._pending.extend(events)
        if isinstance(next_seq, int):
            self._next_seq = next_seq

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def read_attach_token(token_file: str | Path) -> str:
    """The control API token from the node's token file, or an `EngyError` naming the file."""
    from engy_node.control import read_token

    return read_token(Path(token_file))


def snapshot_of(
    node_info: Any, status: Mapping[str, Any], *, taken_at: float, connected: bool, error: str | None = None
) -> NodeSnapshot:
    """A `/v1/status` document (or `Hub.snapshot()`) and the node's info as a `NodeSnapshot`."""
    wire = status.get("states")
    wire = wire if isinstance(wire, Mapping) else {}
    published = wire.get("node")
    # A node that describes itself (the local network publishes its hotkeys) wins.
    node = {**_mapping(node_info), **_mapping(published)}
    metrics = status.get("metrics")
    schema = status.get("schema")
    return NodeSnapshot(
        node=decode(NodeInfo, node),
        states=decode_states(wire),
        metrics=metrics if isinstance(metrics, Mapping) else {},
        taken_at=taken_at,
        connected=connected,
        error=error,
        schema=schema if isinstance(schema, int) else None,
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _stale(previous: NodeSnapshot | None, now: float, error: str) -> NodeSnapshot:
    """What the node last said, marked as no longer current and why."""
    if previous is None:
        return snapshot_of({}, {}, taken_at=now, connected=False, error=error)
    return dataclasses.replace(previous, connected=False, error=error)


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
