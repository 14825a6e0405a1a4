"""The miner pool: the websocket endpoint miners dial, and the legs it keeps (docs/protocol.md).

A leg is one admitted miner connection. Admission needs either a miner key the store knows, or a
hello signed by a hotkey the gateway allows (docs/protocol.md, "Signed hello") within the
signature window, not replayed. The hello must name a served model and, where the gateway knows
the canonical checkpoint, its `model_root`: a miner announcing another checkpoint is denied rather
than caught later by proofs. So is one past `max_legs_per_miner` legs of its miner identity.

Each leg tracks its advertised capacity (a heartbeat that carries `capacity` updates it) and the
requests in flight on it, counted here: a miner's own `inflight` report is not trusted (the public
miner always says 0). Frames are parsed liberally (`protocol.miner`); one that still cannot be read
closes that leg with the field and the reason, logged and sent as the close reason (the miner
re-dials), and fails its in-flight requests, never the others; so does a frame over the miner
endpoint's size limit, refused by the server before it is read (close code 1009, the reason
naming the limit). A leg without a heartbeat for `stale_after_s` stops receiving new
requests and is closed. A repeat hello with the same (identity, worker_name) supersedes the old
connection.

The leg's receive loop never waits on a buyer: chunks are queued per request (a completion is
bounded by max_tokens, so the queue is too) and the buyer's handler drains them at its own pace.

Routing (`route`). The pool keeps one `route_table.RouteTable` per served model and tells it of
every change as it happens: a leg admitted or gone, a heartbeat's new capacity, a request
dispatched or ended. A decision then reads a few entries of the table instead of a snapshot of
every leg, which at thousands of legs cost milliseconds a request (bench/router_decision.py).
Whether a leg may serve paid traffic (a fresh heartbeat and the traffic plane's word) changes
without an event here, so the pool asks again for every leg at most `ADMISSION_REFRESH_S` apart,
for a new leg or one heard from again at once, and for the leg a decision is about to return
every time.

GEMM challenges (`challenge`, issue 32). A miner that announced `FEATURE_GEMM` is asked for an
activation commitment on every request (`PoolSettings.gemm_audit`), not only on those the audit
will sample: asking on some would tell it which answers to compute honestly. A verifier's
challenge later goes back over the leg that served the answer, and the leg's receive loop hands
the miner's `gemm_openings` to the waiting challenge. Each waits at most its deadline, a leg
holds at most `MAX_CHALLENGES_PER_LEG` at once, and a leg that closes fails its challenges as it
fails its requests.

Why this size: admission, the receive loop, dispatch, expiry and the drain all read and change
the same legs and the routing table kept in step with them, each change at once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import trio
from starlette.websockets import WebSocket, WebSocketDisconnect

from engy_node import keys
from engy_node.gateway.routing.route_table import RouteTable
from engy_node.gateway.routing.router import Candidate, Choice, choose
from engy_node.protocol.audit import LEG_GONE, NO_OPENING, GemmOpeningFailed
from engy_node.protocol.gemm import FEATURE_GEMM, GemmChallenge, GemmOpenings, GemmPick
from engy_node.protocol.miner import (
    OPTIONAL_FEATURES,
    Admit,
    Cancel,
    Chunk,
    Deny,
    Heartbeat,
    Hello,
    KvLoad,
    ProtocolError,
    Reconnect,
    Response,
    Serve,
    ServeRequest,
    close_reason,
    encode,
    parse_miner_frame,
)

log = logging.getLogger("engy.gateway.pool")

FRAME_TOO_BIG = 1009
"""The close code of a frame over the listener's size limit: the server refuses it before it is
assembled (`hypercorn_edges`), closes with this code and a reason naming the limit, and tells
the endpoint with a disconnect carrying both."""

KV_FULL = 0.98
"""A serve whose KV cache is this full takes no new request until it frees some: it would only
queue it, while another miner may start it at once (the TEE miner's `kv` heartbeat says so)."""
MAX_CHALLENGES_PER_LEG = 16
"""GEMM challenges waiting on one leg at once: a verifier judges a few jobs at a time, each with
one challenge, so more means something is wrong; the next is refused rather than queued."""
ADMISSION_REFRESH_S = 1.0
"""The longest the routing table's word on a leg's admission may lag: as long as a gateway
worker process's own view of eligibility does (`control_plane.REFRESH_S`). Asking for every leg
costs about a microsecond a leg (7-12 ms a second at 10,000 legs, 40 ms when half of them
flip), where asking on every decision would cost that per request."""


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSettings:
    stale_after_s: float = 90.0
    """A leg without a heartbeat for this long is stale: three missed 30 s beats (docs/protocol.md)."""
    hello_timeout_s: float = 10.0
    netuid: int = 53
    max_legs_per_miner: int = 32
    """Legs one miner identity may hold here, so one key cannot fill the gateway (`workers.miner_legs_cap`)."""
    gemm_audit: bool = True
    """Ask miners that announced `FEATURE_GEMM` to commit their activations (`gateway.gemm_audit`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MinerIdentity:
    miner: str
    """Stable identity used for routing stats and settlement: the hotkey, or `key:<id>`."""
    hotkey: str | None


class LegLost(Exception):
    """The miner's connection went away while a request was in flight on it."""


@dataclasses.dataclass
class PendingChallenge:
    """One GEMM challenge waiting on a leg for the miner's `gemm_openings` (or the leg's end)."""

    answered: trio.Event = dataclasses.field(default_factory=trio.Event)
    openings: GemmOpenings | None = None
    lost: str | None = None


@dataclasses.dataclass
class PendingRequest:
    """One request in flight on a leg: what the miner has sent so far."""

    corr_id: str
    leg: Leg
    chunks: collections.deque[str | Chunk] = dataclasses.field(default_factory=collections.deque)
    """What the miner streamed, in order: text, or a chunk that carries reasoning or tool calls."""
    response: Response | None = None
    lost: str | None = None
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)
    gemm_asked: bool = False
    """The request sent asked the miner to commit its activations (`PoolSettings.gemm_audit`)."""

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def finished(self) -> bool:
        return self.response is not None or self.lost is not None


@dataclasses.dataclass
class Leg:
    leg_id: str
    identity: MinerIdentity
    hello: Hello
    websocket: WebSocket
    last_heartbeat: float
    inflight: dict[str, PendingRequest] = dataclasses.field(default_factory=dict)
    challenges: dict[str, PendingChallenge] = dataclasses.field(default_factory=dict)
    """GEMM challenges sent on this leg and not yet answered, by challenge id."""
    closed: bool = False

    capacity: int = 0
    """This leg's share of the miner's concurrency, from hello and then each heartbeat."""
    reconnecting: bool = False
    """Told to re-dial (`reconnect`): it finishes what it serves and is sent nothing new."""
    kv: KvLoad | None = None
    """The serve's KV cache and queue, from the latest heartbeat that carried them."""
    context_length: int | None = None
    """The serve's context window (hello, then any heartbeat's capacity that says it)."""
    lacks: frozenset[str] = frozenset()
    """Features a request may need that this miner did not announce (fixed by its hello; read
    for every leg on every dispatch, so computed once)."""

    def __post_init__(self) -> None:
        self.capacity = self.hello.capacity.max_inflight
        self.context_length = self.hello.capacity.context_length
        self.lacks = OPTIONAL_FEATURES - self.hello.features

    def takes(self, prompt_tokens: int) -> bool:
        """Whether one more request of `prompt_tokens` fits: the prompt in the serve's context,
        and its KV cache not full (`KV_FULL`): a serve that holds all it can would only queue it."""
        if self.context_length is not None and prompt_tokens >= self.context_length:
            return False
        fraction = None if self.kv is None else self.kv.fraction
        return fraction is None or fraction < KV_FULL

    async def send(self, frame: Serve | Cancel | Reconnect | Admit | Deny | GemmChallenge) -> None:
        # No lock of our own: the server encodes each message whole and writes them under its
        # connection's lock in the order they were sent, so frames from several tasks never mix.
        await self.websocket.send_text(encode(frame))


MinerKeyLookup = Callable[[str], Awaitable[str | None]]
"""miner key -> its id at the store (None: unknown)."""


class MinerPool:
    def __init__(
        self,
        *,
        served_models: Mapping[str, str | None],
        authenticate_key: MinerKeyLookup,
        allowed_hotkeys: Callable[[], set[str]],
        settings: PoolSettings = PoolSettings(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.served_models = dict(served_models)
        """model id -> canonical model_root (None: not pinned)."""
        self.authenticate_key = authenticate_key
        self.allowed_hotkeys = allowed_hotkeys
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock
        self.legs: dict[str, Leg] = {}
        self.replay = keys.ReplayGuard()
        self._corr_ids = itertools.count()
        self._corr_salt = os.urandom(4).hex()
        """Drawn once per pool: with the counter, a correlation id this process never used
        before, nor a restarted one (a miner may still hold frames of the last)."""
        self.draining = False
        self.room_changed = trio.Event()
        """Set (and replaced) whenever a leg may have room it did not have: a request on it
        ended, it was admitted, its capacity changed. The waiting room waits on it."""
        self.tables: dict[str, RouteTable] = {model: RouteTable() for model in self.served_models}
        """model -> the routing table of its legs (module docstring)."""
        self._unasked: dict[str, set[str]] = {model: set() for model in self.served_models}
        """model -> its legs whose admission the table has not had since they joined or were
        heard from again."""
        self._asked_at: dict[str, float] = {}
        """model -> when the pool last asked about every one of its legs."""
        self._by_miner: dict[str, dict[str, Leg]] = {}
        """miner identity -> its live legs, so a probe's legs are found without a scan."""

    # ---- the websocket endpoint ------------------------------------------------------------
    async def endpoint(self, websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            with trio.fail_after(self.settings.hello_timeout_s):
                hello = parse_miner_frame(await websocket.receive_text())
        except ProtocolError as error:
            log.warning("refused a miner's hello: %s is invalid (%s)", error.field, error.reason)
            await _close(websocket, 1002, f"invalid hello: {error}")
            return
        except trio.TooSlowError:
            log.info("miner connection dropped: no hello within %.0f s", self.settings.hello_timeout_s)
            await _close(websocket, 1008, "no hello in time")
            return
        except WebSocketDisconnect as gone:
            if gone.code == FRAME_TOO_BIG:
                log.warning("refused a miner's hello: %s", gone.reason)
            else:
                log.info("miner connection closed before its hello")
            return
        if not isinstance(hello, Hello):
            await self._deny(websocket, "the first frame must be hello")
            return
        identity, reason = await self._admit(hello)
        held = [] if identity is None else list(self._by_miner.get(identity.miner, {}).values())
        superseded = [
            other
            for other in held
            if other.hello.worker_name == hello.worker_name
            and (other.hello.worker_id != hello.worker_id or not hello.worker_id)
        ]
        if identity is not None and (kept := len(held) - len(superseded)) >= self.settings.max_legs_per_miner:
            reason = (
                f"miner {identity.miner} already holds {kept} legs on this gateway worker, the most one miner "
                "may (gateway.max_rigs_per_miner); stop the rigs you no longer run, or ask the gateway's operator"
            )
            identity = None
        if identity is None:
            log.warning("denied miner %s (%s): %s", hello.worker_name, hello.model, reason)
            await self._deny(websocket, reason)
            return
        if self.draining:
            await self._deny(websocket, "gateway is draining; retry shortly")
            return
        leg = Leg(self._leg_id(identity.miner, hello), identity, hello, websocket, self.clock())
        # No wait from the count above to taking the leg in: two hellos cannot both take the last place.
        for other in superseded:
            log.info(
                "miner %s/%s re-dialled from a new process; closing its old leg", identity.miner, hello.worker_name
            )
            self._drop(other, "superseded by a new hello")
        # Routable before the miner hears `admit`: a miner (or a local network) that reports
        # ready on admission may be sent a request at once.
        self.legs[leg.leg_id] = leg
        self._by_miner.setdefault(identity.miner, {})[leg.leg_id] = leg
        self.tables[hello.model].join(
            Candidate(worker_id=leg.leg_id, capacity=leg.capacity, inflight=0, lacks=leg.lacks)
        )
        self._unasked[hello.model].add(leg.leg_id)
        self.notify_room()
        for other in superseded:
            await _close(other.websocket, 1000)
        try:
            await leg.send(Admit())
        except Exception as error:  # broad on purpose: any send failure means this leg never came up
            self._drop(leg, f"admit not delivered ({type(error).__name__})")
            return
        log.info(
            "admitted %s (%s, %s) with capacity %d%s",
            identity.miner,
            hello.worker_name,
            hello.model,
            leg.capacity,
            f"; it does not honour {', '.join(sorted(leg.lacks))}" if leg.lacks else "",
        )
        try:
            await self._receive(leg)
        finally:
            self._drop(leg, "connection closed")

    async def _deny(self, websocket: WebSocket, reason: str) -> None:
        try:
            await websocket.send_text(encode(Deny(reason)))
        finally:
            await _close(websocket, 1008)

    async def _admit(self, hello: Hello) -> tuple[MinerIdentity | None, str]:
        if hello.model not in self.served_models:
            return None, f"model {hello.model!r} is not served here (served: {', '.join(sorted(self.served_models))})"
        canonical = self.served_models[hello.model]
        if canonical is not None and hello.model_root != canonical:
            return None, f"model_root {hello.model_root[:16]}… is not the canonical {hello.model} checkpoint"
        if hello.hotkey is not None and hello.signature is not None and hello.ts is not None:
            check = keys.check_hello(
                hotkey=hello.hotkey,
                ts=hello.ts,
                worker_id=hello.worker_id,
                sig_hex=hello.signature,
                netuid=self.settings.netuid,
                now=int(self.wall_clock()),
                replay=self.replay,
            )
            if not check.ok:
                return None, f"hotkey signature rejected ({check.reason})"
            if hello.hotkey not in self.allowed_hotkeys():
                return None, "hotkey is not registered on this subnet"
            return MinerIdentity(miner=hello.hotkey, hotkey=hello.hotkey), "ok"
        if hello.miner_key:
            miner_id = await self.authenticate_key(hello.miner_key)
            if miner_id is not None:
                return MinerIdentity(miner=f"key:{miner_id}", hotkey=None), "ok"
        return None, "unknown miner key"

    async def _receive(self, leg: Leg) -> None:
        websocket = leg.websocket
        while True:
            try:
                text = await websocket.receive_text()
            except WebSocketDisconnect as gone:
                if gone.code == FRAME_TOO_BIG:
                    log.warning(
                        "closing leg %s of %s: refused a frame, %s", leg.leg_id[:8], leg.identity.miner, gone.reason
                    )
                return
            try:
                frame = parse_miner_frame(text)
            except ProtocolError as error:
                log.warning(
                    "closing leg %s of %s: refused a frame, %s is invalid (%s)",
                    leg.leg_id[:8],
                    leg.identity.miner,
                    error.field,
                    error.reason,
                )
                await _close(websocket, 1002, f"invalid frame: {error}")
                return
            if isinstance(frame, Heartbeat):
                leg.last_heartbeat = self.clock()
                if frame.kv is not None:
                    leg.kv = frame.kv
                # A closed leg (superseded) may still be heard from before its socket goes; it is
                # in no routing table any more.
                table = None if leg.closed else self.tables[leg.hello.model]
                if table is not None and not table.admitted(leg.leg_id):
                    # It may have been refused as stale, and just stopped being so.
                    self._unasked[leg.hello.model].add(leg.leg_id)
                if frame.capacity is not None and frame.capacity.context_length is not None:
                    leg.context_length = frame.capacity.context_length
                if frame.capacity is not None and frame.capacity.max_inflight != leg.capacity:
                    log.info(
                        "leg %s of %s: capacity %d -> %d",
                        leg.leg_id[:8],
                        leg.identity.miner,
                        leg.capacity,
                        frame.capacity.max_inflight,
                    )
                    leg.capacity = frame.capacity.max_inflight
                    if table is not None:
                        table.update(leg.leg_id, capacity=leg.capacity)
                    self.notify_room()
            elif isinstance(frame, Chunk):
                pending = leg.inflight.get(frame.corr_id)
                if pending is not None:
                    pending.chunks.append(frame.content if frame.plain else frame)
                    pending.notify()
            elif isinstance(frame, Response):
                pending = leg.inflight.pop(frame.corr_id, None)
                if pending is not None:
                    self._count_inflight(leg)
                    pending.response = frame
                    pending.notify()
                    self.notify_room()
            elif isinstance(frame, GemmOpenings):
                # An answer to a challenge that gave up waiting is dropped: its verifier has moved on.
                challenge = leg.challenges.pop(frame.challenge_id, None)
                if challenge is not None:
                    challenge.openings = frame
                    challenge.answered.set()
            else:
                kind = type(frame).__name__.lower()
                log.warning(
                    "closing leg %s of %s: unexpected %s after admission", leg.leg_id[:8], leg.identity.miner, kind
                )
                await _close(websocket, 1002, f"unexpected {kind} after admission")
                return

    def _leg_id(self, miner: str, hello: Hello) -> str:
        """A leg's id, and so its place in the route table: derived from the miner, its rig and
        its process, not drawn at random, so that every gateway worker and every host of a fleet
        holding a leg of the same miner process ranks it the same for a conversation (the same
        membership gives the same choice, docs/architecture.md, "Routing"), and a re-dialled leg takes back the keys it
        had. A second leg of one process in one pool (a fleet host serving a dead host's leg too)
        takes the next ordinal. A miner names its own worker id, so it could search for one whose
        ring points fall where it likes: that changes which conversations it is home to, not how
        many (its share follows its capacity), and the load bound caps what any one key brings it."""
        base = f"{miner}\0{hello.worker_name}\0{hello.worker_id}"
        ids = (
            hashlib.sha256(f"{base}\0{ordinal}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
            for ordinal in itertools.count()
        )
        return next(leg_id for leg_id in ids if leg_id not in self.legs)

    def _drop(self, leg: Leg, reason: str) -> None:
        leg.closed = True
        if self.legs.get(leg.leg_id) is leg:
            del self.legs[leg.leg_id]
            siblings = self._by_miner[leg.identity.miner]
            del siblings[leg.leg_id]
            if not siblings:
                del self._by_miner[leg.identity.miner]
            self.tables[leg.hello.model].leave(leg.leg_id)
            self._unasked[leg.hello.model].discard(leg.leg_id)
        for pending in leg.inflight.values():
            pending.lost = reason
            pending.notify()
        leg.inflight.clear()
        for challenge in leg.challenges.values():
            challenge.lost = reason
            challenge.answered.set()
        leg.challenges.clear()

    def notify_room(self) -> None:
        """Wake whoever waits on `room_changed` (the waiting room also calls it when a turn ends)."""
        self.room_changed.set()
        self.room_changed = trio.Event()

    async def _close_leg(self, leg: Leg, reason: str) -> None:
        self._drop(leg, reason)
        await _close(leg.websocket, 1000)

    # ---- routing support -------------------------------------------------------------------
    def route(
        self,
        model: str,
        *,
        prefix: bytes | None,
        rr_counter: int,
        needs: frozenset[str] = frozenset(),
        prefer: frozenset[str] = frozenset(),
        exclude: frozenset[str] = frozenset(),
        eligible: Callable[[str], bool] | None = None,
        target: str | None = None,
        prompt_tokens: int = 0,
    ) -> Choice | None:
        """The leg to send one dispatch of a request for `model` to, or None when none may take it
        (the router's decision: `RouteTable.choose` for the arguments).

        A leg may take paid traffic while its heartbeat is fresh and `eligible(miner identity)`
        says so (None: every miner), and a request while it `takes` the prompt's size. With
        `target`, only that miner's legs are considered, eligible or not: a probe goes to the
        miner it tests.
        """
        now = self.clock()

        def usable(leg_id: str) -> bool:
            leg = self.legs.get(leg_id)
            return leg is not None and self._usable(leg, now, eligible) and leg.takes(prompt_tokens)

        if target is not None:
            legs = [
                leg
                for leg in self._by_miner.get(target, {}).values()
                if leg.hello.model == model and self._usable(leg, now, None) and leg.takes(prompt_tokens)
            ]
            return choose(
                candidates=[
                    Candidate(worker_id=leg.leg_id, capacity=leg.capacity, inflight=len(leg.inflight), lacks=leg.lacks)
                    for leg in legs
                ],
                prefix=prefix,
                rr_counter=rr_counter,
                exclude=exclude,
                needs=needs,
                prefer=prefer,
            )
        table = self.tables.get(model)
        if table is None:
            return None
        # A clock that went back counts as due as well, or the asking would stop until it caught up.
        if not 0 <= now - self._asked_at.get(model, -math.inf) < ADMISSION_REFRESH_S:
            self._asked_at[model] = now
            self._unasked[model].clear()
            asked: Iterable[str] = list(table)
        else:
            asked, self._unasked[model] = self._unasked[model], set()
        for leg_id in asked:
            admitted = self._usable(self.legs[leg_id], now, eligible)
            if admitted != table.admitted(leg_id):
                table.update(leg_id, admitted=admitted)
        return table.choose(
            prefix=prefix, rr_counter=rr_counter, exclude=exclude, needs=needs, prefer=prefer, admit=usable
        )

    def _usable(self, leg: Leg, now: float, eligible: Callable[[str], bool] | None) -> bool:
        return (
            not leg.closed
            and not leg.reconnecting
            and now - leg.last_heartbeat < self.settings.stale_after_s
            and (eligible is None or eligible(leg.identity.miner))
        )

    def _count_inflight(self, leg: Leg) -> None:
        """Tell the routing table that the leg's in-flight count changed. A closed leg has left it."""
        if not leg.closed:
            self.tables[leg.hello.model].update(leg.leg_id, inflight=len(leg.inflight))

    def connected(self) -> set[tuple[str, str]]:
        """(miner identity, model) of every live leg."""
        return {(leg.identity.miner, leg.hello.model) for leg in self.legs.values() if not leg.closed}

    async def dispatch(self, leg_id: str, request: ServeRequest, *, stream: bool) -> PendingRequest:
        """Send `serve` on a leg; raises LegLost if the leg is gone. A miner that announced
        `FEATURE_GEMM` is asked to commit its activations (`PoolSettings.gemm_audit`)."""
        leg = self.legs.get(leg_id)
        if leg is None or leg.closed:
            raise LegLost("the chosen miner disconnected")
        corr_id = f"c{next(self._corr_ids)}-{self._corr_salt}"
        pending = PendingRequest(corr_id, leg)
        if self.settings.gemm_audit and FEATURE_GEMM in leg.hello.features:
            request = dataclasses.replace(request, gemm_commitment=True)
            pending.gemm_asked = True
        leg.inflight[corr_id] = pending
        self._count_inflight(leg)
        try:
            await leg.send(Serve(corr_id=corr_id, request=request, stream=stream))
        except Exception as error:  # broad on purpose: any send failure means this leg is unusable
            if leg.inflight.pop(corr_id, None) is not None:
                self._count_inflight(leg)
            raise LegLost(f"could not send to the miner ({type(error).__name__})") from None
        return pending

    async def cancel(self, pending: PendingRequest) -> None:
        """Tell the miner to stop (buyer gone). Best effort; never raises."""
        leg = pending.leg
        if leg.inflight.pop(pending.corr_id, None) is not None:
            self._count_inflight(leg)
            self.notify_room()
        if leg.closed:
            return
        try:
            with trio.move_on_after(2):
                await leg.send(Cancel(pending.corr_id))
        except Exception as error:  # broad on purpose: the leg's own loop deals with a dead socket
            log.info("cancel for %s not delivered (%s)", pending.corr_id, type(error).__name__)

    async def challenge(
        self, leg_id: str, rid: str, picks: tuple[GemmPick, ...], *, timeout_s: float
    ) -> tuple[dict[str, Any], ...]:
        """Ask the miner on leg `leg_id` to open `picks` of the activations it filed under `rid`,
        and wait up to `timeout_s` for them: its openings, unread (only the verifier, holding the
        commitment, can judge them). Raises `GemmOpeningFailed` otherwise: `LEG_GONE` when the
        leg is gone or closes while the challenge waits, `NO_OPENING` when the miner answers an
        error, nothing in time, or cannot be challenged."""
        leg = self.legs.get(leg_id)
        if leg is None or leg.closed:
            raise GemmOpeningFailed(LEG_GONE, "the miner's connection that served this answer is gone")
        if FEATURE_GEMM not in leg.hello.features:
            raise GemmOpeningFailed(NO_OPENING, f"the miner's leg does not announce {FEATURE_GEMM}")
        if len(leg.challenges) >= MAX_CHALLENGES_PER_LEG:
            raise GemmOpeningFailed(
                NO_OPENING, f"{MAX_CHALLENGES_PER_LEG} challenges already wait on this miner's leg; try again later"
            )
        challenge_id = f"g{next(self._corr_ids)}-{self._corr_salt}"
        waiting = leg.challenges[challenge_id] = PendingChallenge()
        try:
            with trio.move_on_after(timeout_s):
                await leg.send(GemmChallenge(challenge_id=challenge_id, rid=rid, picks=picks))
                await waiting.answered.wait()
        except Exception as error:  # broad on purpose: any send failure means this leg is unusable
            raise GemmOpeningFailed(
                LEG_GONE, f"could not send the challenge to the miner ({type(error).__name__})"
            ) from None
        finally:
            leg.challenges.pop(challenge_id, None)
        if waiting.lost is not None:
            raise GemmOpeningFailed(LEG_GONE, f"the miner's connection closed while it was challenged: {waiting.lost}")
        if waiting.openings is None:
            raise GemmOpeningFailed(NO_OPENING, f"the miner sent no openings within {timeout_s:g} s")
        if waiting.openings.error is not None:
            raise GemmOpeningFailed(NO_OPENING, f"the miner could not open its activations: {waiting.openings.error}")
        return waiting.openings.openings

    async def expire_stale(self) -> None:
        """Close legs whose heartbeats stopped; run it periodically."""
        now = self.clock()
        for leg in list(self.legs.values()):
            if now - leg.last_heartbeat >= self.settings.stale_after_s:
                log.warning(
                    "leg %s of %s is stale (no heartbeat for %.0f s); closing it",
                    leg.leg_id[:8],
                    leg.identity.miner,
                    now - leg.last_heartbeat,
                )
                await self._close_leg(leg, "stale")

    async def drain(self) -> None:
        """Tell every miner to re-dial (the gateway is going away) and stop admitting."""
        self.draining = True
        for leg in list(self.legs.values()):
            leg.reconnecting = True
            try:
                with trio.move_on_after(2):
                    await leg.send(Reconnect())
            except Exception as error:  # broad on purpose: a dead leg needs no goodbye
                log.info("reconnect not delivered to %s (%s)", leg.identity.miner, type(error).__name__)

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            {
                "leg": leg.leg_id[:8],
                "miner": leg.identity.miner,
                "worker": leg.hello.worker_name,
                "model": leg.hello.model,
                "capacity": leg.capacity,
                "inflight": len(leg.inflight),
                "heartbeat_age_s": round(now - leg.last_heartbeat, 1),
                **_announced(leg),
            }
            for leg in self.legs.values()
        ]


def _announced(leg: Leg) -> dict[str, Any]:
    """What a leg's miner told about its serve beyond its capacity, for `status` and the TUI:
    its region and TEE mode (`hw`, informational), context window and KV cache, and whether its
    answers commit their activations for GEMM audits."""
    hw = leg.hello.hw
    tee = hw.get("tee")
    shown: dict[str, Any] = {"gemm_audit": FEATURE_GEMM in leg.hello.features}
    if isinstance(hw.get("region"), str):
        shown["region"] = hw["region"]
    if isinstance(tee, Mapping) and isinstance(tee.get("gpu_cc"), str):
        shown["tee"] = tee["gpu_cc"]
    if leg.context_length is not None:
        shown["context_length"] = leg.context_length
    if leg.kv is not None and leg.kv.fraction is not None:
        shown["kv_used"] = round(leg.kv.fraction, 3)
    return shown


async def _close(websocket: WebSocket, code: int, reason: str = "") -> None:
    try:
        await websocket.close(code=code, reason=close_reason(reason) or None)
    except Exception:  # broad on purpose: closing an already-closed socket is not an error worth raising
        pass
