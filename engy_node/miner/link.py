"""The miner's connection to a gateway: legs, hello, heartbeats, serve/cancel, reconnects.

Miners dial out; they need no inbound port (docs/protocol.md). A gateway with N worker processes says N
at `GET …/gw/meta`; the miner opens one websocket leg per worker and splits its concurrency
across them (with fewer slots than workers, one slot each on randomly chosen workers), so every
gateway worker can route to it.

Each leg is an independent loop: dial, `hello`, wait for `admit`, then serve until the
connection drops or the gateway says `reconnect`, then re-dial with jittered exponential backoff.
One leg failing never touches the others. A `deny` is logged with the gateway's reason and
retried slowly — a revoked key is fixed by an operator, not by hammering the gateway.

Requests run as tasks in their leg's nursery, each in its own cancel scope: `cancel` from the
gateway cancels that scope at once (the serve client then aborts the generation on the model
server), and a dropped connection cancels every request of that leg — nobody is left to receive
their results. Concurrency is what the miner advertised; the link never refuses or clamps a
routed request on its own. A GEMM audit's `gemm_challenge` runs as such a task too (it waits on
the model server, never on the receive loop), and is always answered with a `gemm_openings`.

A gateway frame this side cannot read (after `protocol.miner`'s liberal parsing) ends the leg:
it is logged with the field and the reason, the connection is closed with them as the close
reason, and the leg re-dials; its requests are cancelled, as on any lost connection.

Stopping is `drain`, not cancellation: the miner role calls it while the model server is still
up, and only then stops the server. It announces capacity 0 on every leg, refuses what is
routed meanwhile, lets requests in flight finish until the deadline, aborts the rest with a
terminal error response each, and closes the legs, which then do not re-dial. The steps and
their bounds are `engy_node.miner.drain`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx
import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from engy_node import keys
from engy_node.errors import single_failure
from engy_node.miner.drain import ABORTED_ERROR, REFUSED_ERROR, DrainPhase, StopBudget, request_action
from engy_node.miner.serving import Send
from engy_node.protocol.gemm import GemmChallenge, GemmOpenings
from engy_node.protocol.miner import (
    MAX_FRAME_BYTES,
    OUR_FEATURES,
    Admit,
    Cancel,
    Capacity,
    Deny,
    Heartbeat,
    Hello,
    KvLoad,
    MinerFrame,
    Ping,
    ProtocolError,
    Reconnect,
    Response,
    Serve,
    close_reason,
    encode,
    parse_gateway_frame,
)
from engy_node.retry import backoff_delay

log = logging.getLogger("engy.miner.link")

RECONNECT = "gateway is draining (reconnect)"
"""How a leg ends that the gateway asked to reconnect: re-dialled at once, the old connection
finishing its requests in flight meanwhile."""
RETIRED = "retired: the gateway's workers changed and the legs were planned anew"
GOING_AWAY = 1001
"""The websocket close code for an endpoint that is shutting down (RFC 6455 §7.4.1)."""
CLOSE_TIMEOUT_S = 2.0
"""How long closing a leg waits for the gateway's half of the close handshake."""


@dataclasses.dataclass(frozen=True, slots=True)
class LinkSettings:
    heartbeat_s: float = 30.0
    """The gateway marks a leg stale after 90 s without one (docs/protocol.md); 30 s leaves two misses."""
    connect_timeout_s: float = 15.0
    hello_timeout_s: float = 15.0
    """How long to wait for `admit`/`deny` after sending hello."""
    meta_timeout_s: float = 10.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    deny_backoff_s: float = 60.0
    """A denied leg waits at least this long: denial is an operator's problem, not a glitch."""
    reconnect_delay_s: float = 0.5
    """After a leg ends without an error (closed by the gateway), re-dial after up to this (jittered)."""
    load_heartbeat_gap_s: float = 0.2
    """Between the short heartbeats a leg sends when requests start or end (as the newest public
    TEE miner does, so a gateway sees the load at once), at least this long: a burst is one."""
    serve_check_s: float = 1.0
    """How often the link looks whether its model server can take requests."""
    kv_check_s: float = 5.0
    """How often it reads the model server's KV cache and queue for its heartbeats' `kv`."""
    meta_check_s: float = 30.0
    """How often `/gw/meta` is read again: when the gateway's worker count changes, the legs are
    planned anew (the old ones finish what they serve, then close) without a restart."""
    reconnect_drain_s: float = 1800.0
    """After the gateway's `reconnect` (that host is draining), the leg is re-dialled at once and
    the old connection keeps serving the requests it has in flight for up to this long (the live
    protocol's 1,800 s, the longest a request may run); what is still running then is aborted."""
    max_message_bytes: int = MAX_FRAME_BYTES
    gemm_open_timeout_s: float = 20.0
    """How long a GEMM challenge's openings may take from the model server: the reference
    server opens its most picks well within a second; a gateway's deadline is longer."""


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """How the miner proves who it is: a miner key, or a registered hotkey's signature (docs/protocol.md)."""

    miner_key: str = ""
    keypair: Any = None
    netuid: int = 53

    def hello_fields(self, *, worker_id: str, now: int) -> dict[str, Any]:
        if self.keypair is None:
            return {}
        hotkey = self.keypair.ss58_address
        signature = keys.sign(self.keypair, keys.hello_message(self.netuid, hotkey, now, worker_id))
        return {"hotkey": hotkey, "ts": now, "signature": signature}


@dataclasses.dataclass(frozen=True, slots=True)
class Leg:
    worker: int
    capacity: int


def plan_legs(*, workers: int, max_inflight: int, rng: random.Random) -> list[Leg]:
    """Which gateway workers to dial and each leg's share of the concurrency (pure)."""
    if workers < 1 or max_inflight < 1:
        raise ValueError("need at least one gateway worker and one slot")
    if max_inflight < workers:
        return [Leg(worker, 1) for worker in sorted(rng.sample(range(workers), max_inflight))]
    share, extra = divmod(max_inflight, workers)
    return [Leg(worker, share + (1 if worker < extra else 0)) for worker in range(workers)]


def meta_url(gateway_url: str) -> str:
    """`wss://host/gw` → `https://host/gw/meta` (the http(s) form of the websocket URL)."""
    parts = urlsplit(gateway_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/meta", "", ""))


def leg_url(gateway_url: str, *, worker: int, workers: int) -> str:
    base = gateway_url.rstrip("/")
    return base if workers == 1 else f"{base}/{worker}"


async def fetch_worker_count(http: httpx.AsyncClient, gateway_url: str, *, timeout_s: float) -> int:
    """N from `/gw/meta`; a gateway without the endpoint (404) has one worker."""
    with trio.fail_after(timeout_s):
        response = await http.get(meta_url(gateway_url))
    if response.status_code == 404:
        return 1
    response.raise_for_status()
    workers = response.json().get("workers")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"{meta_url(gateway_url)} answered an invalid worker count: {workers!r}")
    return workers


class LegDenied(Exception):
    pass


class FrameHandler(Protocol):
    """What serves each `serve` frame a leg receives: `serving.RequestHandler`, or a stand-in
    (`testing.synthetic_miner.SyntheticHandler`)."""

    async def handle(self, frame: Serve, send: Send) -> None: ...


class OpenGemm(Protocol):
    """`RequestHandler.open_gemm`: the answer to a challenge, bounded, never raising for the serve."""

    async def __call__(self, challenge: GemmChallenge, *, timeout_s: float) -> GemmOpenings: ...


class GatewayLink:
    """All legs to one gateway. `run` is a service: started once the first leg is admitted."""

    def __init__(
        self,
        *,
        gateway_url: str,
        identity: Identity,
        hello: dict[str, Any],
        limits: Capacity,
        handler: FrameHandler,
        http: httpx.AsyncClient,
        settings: LinkSettings = LinkSettings(),
        rng: random.Random | None = None,
        on_state=None,
        features: frozenset[str] = OUR_FEATURES,
        serve_ready: Callable[[], bool] = lambda: True,
        serve_load: Callable[[], Awaitable[KvLoad | None]] | None = None,
        open_gemm: OpenGemm | None = None,
    ) -> None:
        self.gateway_url = gateway_url
        self.open_gemm = open_gemm
        """Opens a GEMM challenge's rows on the serve; None for a miner that cannot (it answers
        every challenge with an error)."""
        self.serve_ready = serve_ready
        """Whether the model server can take requests (`ModelServerSupervisor.ready`): while it
        cannot, every leg announces capacity 0 and is sent nothing, without re-dialling."""
        self.serving_ready = True
        self.serve_load = serve_load
        """The model servers' KV cache and queue (`ServeRotation.kv_load`), read every
        `kv_check_s` and sent in each periodic heartbeat as `kv`, as the TEE miner does."""
        self.kv: KvLoad | None = None
        self.features = features
        """What the miner announces it honours (`protocol.miner.FEATURE_*`)."""
        self.identity = identity
        self.hello_base = hello
        self.limits = limits
        self.handler = handler
        self.http = http
        self.settings = settings
        self.rng = rng or random.Random()
        self.on_state = on_state or (lambda **values: None)
        self.legs_up: dict[int, bool] = {}
        self.inflight = 0
        self.phase: DrainPhase = "serving"
        self._admitted = trio.Event()
        self._sessions: set[_LegSession] = set()
        self._changed = trio.Event()
        self.changes = 0
        """How many changes of legs, load or readiness `publish` has announced."""
        self.workers = 0
        """The gateway's worker count the legs are planned for."""
        self.plan = 0
        """Which plan of legs is current (`_plan`); a leg of an older one is not re-dialled."""
        self.link_error: str | None = None
        """Why the last dial (of `/gw/meta` or a leg) failed; None once a leg is admitted."""
        self.denied: str | None = None
        """The gateway's reason for the last deny; None once a leg is admitted."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        workers = await self._worker_count()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_serve)
            self._plan(nursery, workers)
            nursery.start_soon(self._follow_meta, nursery)
            await self._admitted.wait()
            task_status.started(self.gateway_url)

    def _plan(self, nursery: trio.Nursery, workers: int) -> None:
        """Open the legs for a gateway of `workers` workers (a new plan retires the old legs)."""
        self.workers = workers
        self.plan += 1
        legs = plan_legs(workers=workers, max_inflight=self.limits.max_inflight_total, rng=self.rng)
        log.info(
            "gateway %s has %d worker(s); opening %d leg(s): %s",
            self.gateway_url,
            workers,
            len(legs),
            ", ".join(f"worker {leg.worker} × {leg.capacity}" for leg in legs),
        )
        for leg in legs:
            nursery.start_soon(self._leg_loop, leg, workers, self.plan)

    async def _follow_meta(self, nursery: trio.Nursery) -> None:
        """Read `/gw/meta` again now and then, and plan the legs anew when the count changed."""
        while True:
            await trio.sleep(self.settings.meta_check_s)
            try:
                workers = await fetch_worker_count(self.http, self.gateway_url, timeout_s=self.settings.meta_timeout_s)
            except (httpx.HTTPError, trio.TooSlowError, ValueError) as error:
                log.info(
                    "could not re-read %s (%s: %s); keeping %d worker(s)",
                    meta_url(self.gateway_url),
                    type(error).__name__,
                    error,
                    self.workers,
                )
                continue
            if workers != self.workers and self.phase == "serving":
                log.info(
                    "gateway %s now has %d worker(s), not %d: retiring %d leg(s) once their requests end",
                    self.gateway_url,
                    workers,
                    self.workers,
                    len(self._sessions),
                )
                for session in list(self._sessions):
                    session.retire()
                self._plan(nursery, workers)

    async def _watch_serve(self) -> None:
        """Follow the model server's readiness (a change goes out at once as a heartbeat) and,
        less often, its KV cache and queue (they go out with the next periodic heartbeat)."""
        kv_due = 0.0
        while True:
            ready = self.serve_ready()
            if ready != self.serving_ready:
                self.serving_ready = ready
                log.warning(
                    "the model server %s; legs announce capacity %s",
                    "is ready again" if ready else "cannot take requests",
                    "restored" if ready else "0 until it can",
                )
                self.publish()
            if self.serve_load is not None and trio.current_time() >= kv_due:
                kv_due = trio.current_time() + self.settings.kv_check_s
                with trio.move_on_after(self.settings.kv_check_s):
                    self.kv = await self.serve_load()
            await trio.sleep(self.settings.serve_check_s)

    async def _worker_count(self) -> int:
        attempt = 0
        while True:
            try:
                return await fetch_worker_count(self.http, self.gateway_url, timeout_s=self.settings.meta_timeout_s)
            except (httpx.HTTPError, trio.TooSlowError, ValueError) as error:
                attempt += 1
                delay = backoff_delay(
                    consecutive_failures=attempt,
                    base_s=self.settings.backoff_base_s,
                    cap_s=self.settings.backoff_cap_s,
                    jitter=self.rng.random(),
                )
                log.warning(
                    "cannot read %s (%s: %s); retrying in %.1f s",
                    meta_url(self.gateway_url),
                    type(error).__name__,
                    error,
                    delay,
                )
                self._set_trouble(link_error=f"cannot read {meta_url(self.gateway_url)}: {_describe(error)}")
                await trio.sleep(delay)

    def _hello(self, leg: Leg) -> Hello:
        base = self.hello_base
        extra = self.identity.hello_fields(worker_id=base["worker_id"], now=int(time.time()))
        capacity = dataclasses.replace(self.limits, max_inflight=leg.capacity)
        return Hello(
            miner_key=self.identity.miner_key,
            model=base["model"],
            model_root=base["model_root"],
            hw=base["hw"],
            versions=base["versions"],
            capacity=capacity,
            worker_name=base["worker_name"],
            worker_id=base["worker_id"],
            hotkey=extra.get("hotkey"),
            ts=extra.get("ts"),
            signature=extra.get("signature"),
            features=self.features,
        )

    async def _leg_loop(self, leg: Leg, workers: int, plan: int) -> None:
        url = leg_url(self.gateway_url, worker=leg.worker, workers=workers)
        failures = 0
        # A session the gateway asked to reconnect goes on finishing its requests in `retiring`
        # (bounded by `reconnect_drain_s`) while this loop dials its successor at once.
        async with trio.open_nursery() as retiring:
            # Bounded by the miner's life: once its drain has begun, or the legs were planned
            # anew, a leg that ends is not re-dialled.
            while self.phase == "serving" and plan == self.plan:
                delay: float
                try:
                    outcome = await retiring.start(self._leg_session, url, leg)
                except LegDenied as denied:
                    failures += 1
                    delay = max(
                        self.settings.deny_backoff_s,
                        backoff_delay(
                            consecutive_failures=failures,
                            base_s=self.settings.backoff_base_s,
                            cap_s=self.settings.backoff_cap_s,
                            jitter=self.rng.random(),
                        ),
                    )
                    log.warning("gateway denied leg %s: %s; retrying in %.0f s", url, denied, delay)
                    self._set_trouble(denied=str(denied))
                except (ConnectionClosed, HandshakeError, OSError, trio.TooSlowError, ProtocolError) as error:
                    failures += 1
                    delay = backoff_delay(
                        consecutive_failures=failures,
                        base_s=self.settings.backoff_base_s,
                        cap_s=self.settings.backoff_cap_s,
                        jitter=self.rng.random(),
                    )
                    if self.phase == "serving":
                        log.warning(
                            "leg %s lost (%s: %s); re-dialling in %.1f s", url, type(error).__name__, error, delay
                        )
                        self._set_trouble(link_error=f"leg {url}: {_describe(error)}")
                    else:
                        log.info("leg %s closed: the miner is stopping", url)
                else:
                    failures = 0
                    delay = 0.0 if outcome == RECONNECT else self.settings.reconnect_delay_s * self.rng.random()
                    log.info("leg %s: %s%s", url, outcome, "; re-dialling" if self.phase == "serving" else "")
                self._set_leg(leg.worker, False)
                if self.phase == "serving" and plan == self.plan:
                    await trio.sleep(delay)

    def _set_trouble(self, **trouble: str | None) -> None:
        """Publish why the link is not up (`link_error`, `denied`), for the dashboards."""
        for name, value in trouble.items():
            setattr(self, name, value)
        self.on_state(link_error=self.link_error, denied=self.denied)

    def _set_leg(self, worker: int, up: bool) -> None:
        self.legs_up[worker] = up
        self.publish()

    @property
    def changed(self) -> trio.Event:
        """Set at the next change of legs, load or the serve's readiness."""
        return self._changed

    def publish(self) -> None:
        self.on_state(legs_up=sum(self.legs_up.values()), legs=len(self.legs_up), inflight=self.inflight)
        self.changes += 1
        self._changed.set()
        self._changed = trio.Event()

    async def drain(self, budget: StopBudget) -> None:
        """Stop as `engy_node.miner.drain` describes: capacity 0 on every leg, requests in flight
        finish until `budget.finish_s`, the rest are aborted with a terminal error response, the
        legs are closed. Call it once, while the model server is still up.

        Bounded by `budget.link_s`. It never raises for a leg that is gone: a lost leg's
        requests were already cancelled (their aborts still reach the model server), and
        nobody is left to tell. The legs do not re-dial afterwards; `run` may be cancelled.
        """
        inflight = self.inflight
        self.phase = "finishing"
        log.info(
            "stopping: no new requests; %d in flight on %d leg(s) may finish for %g s",
            inflight,
            len(self._sessions),
            budget.finish_s,
        )
        with trio.move_on_after(budget.announce_s):
            async with trio.open_nursery() as nursery:
                for session in list(self._sessions):
                    nursery.start_soon(session.announce_no_capacity)
        with trio.move_on_after(budget.finish_s):
            await self._wait_idle()

        self.phase = "aborting"
        aborted = sum(session.abort_inflight() for session in list(self._sessions))
        if aborted:
            log.warning("drain deadline (%g s): aborting %d request(s) still running", budget.finish_s, aborted)
        with trio.move_on_after(budget.abort_s):
            await self._wait_idle()
        if self.inflight:
            log.warning(
                "%d request(s) still running %g s after they were aborted; closing their legs anyway",
                self.inflight,
                budget.abort_s,
            )

        self.phase = "closing"
        sessions = list(self._sessions)
        with trio.move_on_after(budget.close_s):
            async with trio.open_nursery() as nursery:
                for session in sessions:
                    nursery.start_soon(session.close, "the miner is shutting down")
        log.info(
            "stopped serving: %d request(s) ended within the drain, %d aborted; %d leg(s) closed",
            max(inflight - aborted, 0),
            aborted,
            len(sessions),
        )

    async def _wait_idle(self) -> None:
        """Return once no request is in flight (the caller bounds the wait)."""
        while self.inflight:
            await self._changed.wait()

    async def _leg_session(self, url: str, leg: Leg, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """One connection of a leg. Reports how it ended through `task_status` (an error before
        that is raised to the leg loop): at its end, or as soon as the gateway asks it to
        reconnect (`RECONNECT`), after which it goes on serving its requests in flight."""
        async with open_websocket_url(
            url,
            max_message_size=self.settings.max_message_bytes,
            connect_timeout=self.settings.connect_timeout_s,
            disconnect_timeout=CLOSE_TIMEOUT_S,
        ) as connection:
            await connection.send_message(encode(self._hello(leg)))
            with trio.fail_after(self.settings.hello_timeout_s):
                first = parse_gateway_frame(await connection.get_message())
            if isinstance(first, Deny):
                raise LegDenied(first.reason)
            if not isinstance(first, Admit):
                raise ProtocolError(
                    "frame.type", f"expected admit or deny after hello, got {type(first).__name__.lower()}"
                )
            log.info("leg %s admitted (capacity %d)", url, leg.capacity)
            self._set_trouble(link_error=None, denied=None)
            self._set_leg(leg.worker, True)
            self._admitted.set()
            session = _LegSession(self, connection, leg)
            self._sessions.add(session)
            retired = False

            def retire(outcome: str) -> None:
                nonlocal retired
                retired = True
                task_status.started(outcome)

            try:
                outcome = await session.run(retire=retire)
            except (ConnectionClosed, OSError) as error:
                if not retired:
                    raise
                # Its successor is up; what the old connection still had in flight is lost.
                log.warning(
                    "leg %s: the connection finishing %d request(s) after a reconnect ended (%s: %s)",
                    url,
                    len(session.active),
                    type(error).__name__,
                    error,
                )
                return
            finally:
                self._sessions.discard(session)
            if not retired:
                task_status.started(outcome)


class _LegSession:
    """One admitted connection: heartbeats, the receive loop, and the requests it started."""

    def __init__(self, link: GatewayLink, connection, leg: Leg) -> None:
        self.link = link
        self.connection = connection
        self.leg = leg
        self.active: dict[str, trio.CancelScope] = {}
        self.drain_aborted: set[str] = set()
        """Requests the drain aborted: each still gets its terminal response, with an error."""
        self.send_lock = trio.Lock()
        self.idle_since = time.monotonic()
        self.retiring = False
        """This connection serves only what it has in flight: the gateway asked for a new one
        (`reconnected`), or the legs were planned anew (`retire`)."""
        self.reconnected = False
        self.withheld = False
        """The last heartbeat announced capacity 0 (the serve cannot take requests, or the link
        is stopping)."""
        self.waiting = trio.CancelScope()
        """The receive loop's wait for a frame, cancelled to let a retired leg end once idle."""

    async def send(self, frame: MinerFrame) -> None:
        async with self.send_lock:
            await self.connection.send_message(encode(frame))

    def heartbeat(self) -> Heartbeat:
        idle = 0.0 if self.active else time.monotonic() - self.idle_since
        # Once stopping, every heartbeat says capacity 0, so a later one cannot undo the first;
        # while the model server cannot take requests, so does every one, and the first after it
        # recovers says the leg's capacity again.
        if self.link.phase != "serving" or not self.link.serving_ready:
            capacity = dataclasses.replace(self.link.limits, max_inflight=0)
        elif self.withheld:
            capacity = dataclasses.replace(self.link.limits, max_inflight=self.leg.capacity)
        else:
            capacity = None
        self.withheld = capacity is not None and capacity.max_inflight == 0
        return Heartbeat(inflight=len(self.active), idle_seconds=idle, capacity=capacity, kv=self.link.kv)

    def load_heartbeat(self) -> Heartbeat:
        """The short heartbeat that tells a request started or ended: counts only, unless the
        serve's readiness changed with it (then the capacity that says so)."""
        withheld_now = self.link.phase != "serving" or not self.link.serving_ready
        if withheld_now != self.withheld:
            return self.heartbeat()
        idle = 0.0 if self.active else time.monotonic() - self.idle_since
        return Heartbeat(inflight=len(self.active), idle_seconds=idle)

    async def announce_no_capacity(self) -> None:
        """Send a heartbeat that says capacity 0 (the link is stopping); quiet if the leg is gone."""
        with contextlib.suppress(ConnectionClosed):
            await self.send(self.heartbeat())

    def retire(self) -> None:
        """Serve only what is in flight here, then close (the legs were planned anew)."""
        self.retiring = True
        if not self.active:
            self.waiting.cancel(reason="the leg was retired with nothing in flight")

    def abort_inflight(self) -> int:
        """Cancel every request in flight that the drain's phase says to abort; how many."""
        aborted = 0
        for corr_id, scope in list(self.active.items()):
            if request_action(self.link.phase, new=False) == "abort":
                self.drain_aborted.add(corr_id)
                scope.cancel(reason="the miner's drain deadline passed")
                aborted += 1
        return aborted

    async def close(self, reason: str) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.connection.aclose(code=GOING_AWAY, reason=reason)

    async def run(self, *, retire: Callable[[str], None]) -> str:
        """Serve until the connection ends; `RECONNECT` when the gateway asked for a new one,
        after `retire(RECONNECT)` was called and the requests in flight here have ended."""
        try:
            with single_failure():
                return await self._run(retire)
        except BaseExceptionGroup as group:
            # The receive loop and a heartbeat can meet the closed connection in the same tick
            # (a miner whose loop stalled while its gateway died): one lost connection, seen
            # twice, which the leg loop must re-dial like any other.
            lost, rest = group.split(ConnectionClosed)
            if lost is None or (rest is not None and rest.split(trio.Cancelled)[1] is not None):
                raise
            raise _first_leaf(lost) from None

    async def _run(self, retire: Callable[[str], None]) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats)
            while True:
                if self.retiring and not self.active:
                    nursery.cancel_scope.cancel(reason="the retired leg's requests have all ended")
                    return RECONNECT if self.reconnected else RETIRED
                with trio.CancelScope() as self.waiting:
                    message = await self.connection.get_message()
                if self.waiting.cancelled_caught:
                    continue
                try:
                    frame = parse_gateway_frame(message)
                except ProtocolError as error:
                    log.warning(
                        "leg to worker %d: closing it, the gateway sent a frame whose %s is invalid (%s)",
                        self.leg.worker,
                        error.field,
                        error.reason,
                    )
                    await self.connection.aclose(code=1002, reason=close_reason(f"invalid frame: {error}"))
                    raise
                if isinstance(frame, Serve):
                    self._start(nursery, frame)
                elif isinstance(frame, Cancel):
                    scope = self.active.pop(frame.corr_id, None)
                    self.drain_aborted.discard(frame.corr_id)  # the gateway wants nothing more for it
                    if scope is not None:
                        scope.cancel(reason="gateway cancelled the request")
                        log.info("request %s cancelled by the gateway", frame.corr_id)
                elif isinstance(frame, Ping):
                    await self.send(self.heartbeat())
                elif isinstance(frame, GemmChallenge):
                    nursery.start_soon(self._answer_challenge, frame)
                elif isinstance(frame, Reconnect) and not self.retiring:
                    self.retiring = self.reconnected = True
                    retire(RECONNECT)
                    if self.active:
                        log.info(
                            "leg to worker %d: the gateway asked to reconnect; re-dialled, and %d request(s) in "
                            "flight here go on for up to %g s",
                            self.leg.worker,
                            len(self.active),
                            self.link.settings.reconnect_drain_s,
                        )
                    nursery.start_soon(self._abort_after_drain)
                elif isinstance(frame, Deny):
                    raise LegDenied(frame.reason)
        return "closed"

    def _start(self, nursery: trio.Nursery, frame: Serve) -> None:
        if frame.corr_id in self.active:
            log.warning("duplicate serve for %s ignored", frame.corr_id)
            return
        if request_action(self.link.phase, new=True) == "refuse" or self.retiring:
            log.info("request %s refused: the miner is stopping", frame.corr_id)
            nursery.start_soon(self._send_error, frame, REFUSED_ERROR)
            return
        if len(self.active) >= self.leg.capacity:
            log.warning(
                "gateway routed %s beyond this leg's capacity %d; serving it anyway", frame.corr_id, self.leg.capacity
            )
        scope = trio.CancelScope()
        self.active[frame.corr_id] = scope
        self.link.inflight += 1
        self.link.publish()
        nursery.start_soon(self._serve, frame, scope)

    async def _serve(self, frame: Serve, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await self.link.handler.handle(frame, self.send)
            if scope.cancelled_caught and frame.corr_id in self.drain_aborted:
                # The serve client has aborted it on the model server by now; the gateway hears
                # why from us instead of from a dropped connection.
                await self._send_error(frame, ABORTED_ERROR)
        finally:
            self.drain_aborted.discard(frame.corr_id)
            self.active.pop(frame.corr_id, None)
            self.link.inflight -= 1
            self.link.publish()
            if not self.active:
                self.idle_since = time.monotonic()
                if self.retiring:
                    self.waiting.cancel(reason="the retired leg has nothing left in flight")

    async def _abort_after_drain(self) -> None:
        """A retired leg's limit: what still runs after `reconnect_drain_s` is aborted."""
        await trio.sleep(self.link.settings.reconnect_drain_s)
        for corr_id, scope in list(self.active.items()):
            self.drain_aborted.add(corr_id)
            scope.cancel(reason="the retired leg's drain limit passed")
        if self.active:
            log.warning(
                "leg to worker %d: %d request(s) still running %g s after the gateway asked to reconnect; aborted",
                self.leg.worker,
                len(self.active),
                self.link.settings.reconnect_drain_s,
            )

    async def _answer_challenge(self, challenge: GemmChallenge) -> None:
        """Open the challenged rows on the serve and answer; quiet if the leg is gone."""
        if self.link.open_gemm is None:
            answer = GemmOpenings(challenge.challenge_id, error="this miner does not take GEMM audits")
        else:
            answer = await self.link.open_gemm(challenge, timeout_s=self.link.settings.gemm_open_timeout_s)
        if answer.error is not None:
            log.warning("GEMM challenge %s for %s refused: %s", challenge.challenge_id, challenge.rid, answer.error)
        else:
            log.info(
                "GEMM challenge %s for %s: %d opening(s)", challenge.challenge_id, challenge.rid, len(answer.openings)
            )
        with contextlib.suppress(ConnectionClosed):
            await self.send(answer)

    async def _send_error(self, frame: Serve, error: str) -> None:
        """The request's terminal response, carrying `error`; quiet if the leg is gone."""
        response = Response(
            corr_id=frame.corr_id, request_id=frame.request.engy_request_id, commitment=None, output=None, error=error
        )
        with contextlib.suppress(ConnectionClosed):
            await self.send(response)

    async def _heartbeats(self) -> None:
        """A full heartbeat every `heartbeat_s`, and a short one whenever the link's load or the
        serve's readiness changes (at most one per `load_heartbeat_gap_s`)."""
        settings = self.link.settings
        due = trio.current_time() + settings.heartbeat_s
        seen = self.link.changes
        while True:
            with trio.move_on_at(due):
                while self.link.changes == seen:
                    await self.link.changed.wait()
                seen = self.link.changes
                await self.send(self.load_heartbeat())
                await trio.sleep(settings.load_heartbeat_gap_s)  # a change meanwhile is sent next
                continue
            await self.send(self.heartbeat())
            due = trio.current_time() + settings.heartbeat_s


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf
