"""One buyer request's life in the gateway, whichever API it came through: authenticate, render
and tokenise, hold, dispatch (with retries before the first byte), settle, record.

1. **Authenticate** the API key (cached for `AUTH_CACHE_TTL_S`), then read the body (capped in
   size and time).
2. **Check what is cheap before what is not** (`intake`): a conversation that certainly exceeds
   the model's input limit is refused by its size alone, and an account that cannot pay for a
   large one is refused before it is tokenised.
3. **Tokenise** the request with the model's own chat template — the same
   `ServedModel.render_prompt` a miner uses — so the prompt count is the gateway's, and the
   commitment's `prompt_ids` can be checked against it. A large one is tokenised in a worker
   thread (at most `tokenize_threads` at once) that lets go of the GIL, so it stalls no one.
4. **Hold** the worst case (prompt + max_tokens) atomically; no hold, no dispatch (402).
5. **Route** (`pool.route`, over the model's `route_table`) and dispatch to a miner leg; when no
   eligible miner has room, wait a few seconds in the model's queue, fair across buyers
   (`admission`), before 503/529. Until
   the first byte reaches the buyer, a failing miner is retried on another. A request that asks
   to sample, or passes tools, goes to a miner that honours that while one has room, else to
   one that does not, and the flight records what was missing (a greedy answer to a sampled
   request is logged as such).
6. **Settle** on usage the gateway can account for (`billing.billable_usage`): never more
   completion tokens than were relayed, nor than the commitment holds. The rest of the hold is
   released; on failure before any output, all of it.
7. **Record** metadata only (no prompt or completion text, ever; queued to one writer task,
   `request_log`), and hand the proof material of a sampled response to the audit
   (`audit.py`: in memory only).

Probes (docs/trust.md) take the same steps from dispatch on (`begin_probe`): the traffic control
plane sends them to one chosen miner, without an account, a hold or a charge, and they are
logged as `probe`. Paid traffic goes only to miners the control plane made eligible.

What happens between dispatch and settlement — relaying to the buyer in each API's format —
is `relay.py`. The clocks and the request-id source are injected, so tests can pin them.

Failures attributed to the miner are logged as 502 (it died or errored) or 504 (it timed out);
a buyer hang-up is 499. Those statuses feed epoch settlement (docs/trust.md, "Settlement").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import random
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypedDict

import trio

from engy_node import proof
from engy_node.asgi import BodyError, Receive, read_json_object
from engy_node.config import GatewaySection
from engy_node.gateway.api.chat import ApiName, ChatRequest, GatewayError, Usage
from engy_node.gateway.billing import billing
from engy_node.gateway.billing.settlement import BUYER_FAULTS
from engy_node.gateway.request import intake
from engy_node.gateway.request.admission import WaitingRoom
from engy_node.gateway.request.corrections import StructuredParts, presentation_match, structured_account
from engy_node.gateway.request.request_log import RequestLogWriter
from engy_node.gateway.routing.pool import LegLost, MinerPool, PendingRequest
from engy_node.gateway.routing.router import prefix_key, retry_allowed
from engy_node.gateway.store import RequestLogEntry, Store, StoreError
from engy_node.gateway.trust.audit import audited
from engy_node.metrics import Registry
from engy_node.model_output import THINK_CLOSE, ReasoningDelta, parse_output
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import FEATURE_SAMPLING, FEATURE_SEEDED, FEATURE_TOOLS, Message, Response, ServeRequest
from engy_node.serve.sampling import REPLACEMENT_CHARACTER
from engy_node.served_model import ServedModel

log = logging.getLogger("engy.gateway")


AUTH_CACHE_TTL_S = 30.0
"""A valid key is looked up once per this long, not once per request; revoking a key therefore
takes effect within this time. Unknown keys are never cached, so guessing cannot fill memory."""
AUTH_CACHE_MAX_ENTRIES = 100_000
QUEUE_RECHECK_S = 0.5
"""A waiting request looks for room at least this often, events or not."""
INLINE_TOKENIZE_MAX_CHARS = 4096
"""Text up to this size (~1,000 tokens) is tokenised on the event loop: measured on this
project's 2-core machine, rendering and tokenising it takes well under a millisecond, less than
the thread hand-off it would otherwise cost (gateway CPU per streamed request 2.9 → 2.6 ms)."""


_SECTION = GatewaySection()


@dataclasses.dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the request path reads of the `[gateway]` config section. The defaults are the
    section's (`config.GatewaySection` documents each), so a `Gateway` built without a config
    behaves as a node with none."""

    max_body_bytes: int = _SECTION.max_body_bytes
    body_timeout_s: float = _SECTION.body_timeout_s
    keepalive_s: float = _SECTION.keepalive_s
    first_byte_wait_s: float = _SECTION.first_byte_wait_s
    max_attempts: int = _SECTION.max_attempts
    no_capacity_retry_after_s: int = _SECTION.no_capacity_retry_after_s
    tokenize_threads: int = 2
    audit_paid_pct: float = _SECTION.audit_paid_pct
    queue_wait_s: float = _SECTION.queue_wait_s
    queue_max: int = _SECTION.queue_max

    @classmethod
    def from_section(cls, section: GatewaySection) -> GatewaySettings:
        # Every field the section has; `tokenize_threads` is not a setting.
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)})


class QueueMetrics:
    """The waiting room's depth, waits and outcomes per model, in the node's metrics registry."""

    def __init__(self, registry: Registry) -> None:
        self._depth = registry.gauge(
            "engy_gateway_queue_depth", "Requests waiting for a miner with room.", labelnames=("model",)
        )
        self._wait = registry.histogram(
            "engy_gateway_queue_wait_seconds",
            "Time requests waited for a miner with room.",
            labelnames=("model",),
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self._outcomes = registry.counter(
            "engy_gateway_queue_outcomes_total",
            "Requests that waited, by how the wait ended (served, timed_out, gone: the buyer hung up; full: "
            "refused at a full queue).",
            labelnames=("model", "outcome"),
        )

    def depth(self, model: str, depth: int) -> None:
        self._depth.labels(model=model).set(depth)

    def outcome(self, model: str, outcome: str) -> None:
        self._outcomes.labels(model=model, outcome=outcome).inc()

    def left(self, model: str, *, waited_s: float, outcome: str, depth: int) -> None:
        self._wait.labels(model=model).observe(waited_s)
        self.outcome(model, outcome)
        self.depth(model, depth)


QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class AuditSink(Protocol):
    """Where sampled responses' proof material goes: the audit desk, or the link to it."""

    def offer(self, job: AuditJob) -> None: ...


def _always_eligible(miner: str, model: str) -> bool:
    return True


@dataclasses.dataclass
class Flight:
    """One buyer request in progress."""

    request_id: str
    api: ApiName
    account_id: int | None
    """None for a probe."""
    chat: ChatRequest
    serve: ServeRequest
    model: ServedModel
    prompt_ids: list[int]
    hold: Any
    """The billing hold; None for a probe, which nobody pays for."""
    started: float
    pending: PendingRequest | None = None
    miner: str = ""
    relayed_text: str = ""
    """What the buyer has been sent of the answer."""
    miner_text: str = ""
    """What the miner sent of the answer's text (up to the stop string that ended it), before
    the gateway repaired it to the proven text: the delivery its verdict judges."""
    miner_parts: StructuredParts | None = None
    """The reasoning and tool calls of a miner that sent its answer in parts (None: one that
    sent raw text, its reasoning and calls inside it)."""
    created: int = 0
    """Wall-clock seconds when the request began (the APIs' `created`)."""
    first_output_at: float | None = None
    tried: set[str] = dataclasses.field(default_factory=set)
    seeded: bool = False
    """The miner serving it samples deterministically from the request's seed."""
    unmet: frozenset[str] = frozenset()
    """What the request needed that the miner serving it does not honour (no capable miner had room)."""
    kind: Literal["paid", "probe"] = "paid"
    target: str | None = None
    """A probe's miner (identity): it goes there or nowhere."""

    @property
    def delivered_text(self) -> str:
        """The miner's answer as the model's raw text, as far as it can be told without a proof:
        the text itself, after its reasoning in the `<think>` block the chat templates write.
        Tool calls sent in parts are left out: their raw form (JSON or XML) is the model's own,
        and the answer's tokens up to them are judged as a prefix."""
        if self.miner_parts is None or not self.miner_parts.reasoning:
            return self.miner_text
        return f"<think>\n{self.miner_parts.reasoning}\n</think>\n\n{self.miner_text}"

    @property
    def served_greedily(self) -> bool:
        """The buyer asked to sample, and a miner that answers greedily served it."""
        return FEATURE_SAMPLING in self.unmet


@dataclasses.dataclass(frozen=True, slots=True)
class Accounting:
    """What settlement needs from a finished answer (`Gateway.account_for`)."""

    claim: dict | None
    """The miner's output with `committed_completion` added, when its commitment could be read."""
    relayed_tokens: int
    """Completion tokens the buyer received."""
    output_ids: tuple[int, ...] | None
    """The committed output token ids (None: no readable commitment)."""
    stop: str | None
    """The stop string the answer ended at, when one did."""
    refused: str | None = None
    """Why the answer is proven wrong before its delivery ended (`prompt-mismatch`: the proof
    covers another prompt; `output-mismatch`: the miner's text is not what its tokens decode
    to): it is not delivered whole nor charged, and the miner is recorded as a cheat."""
    proven_text: str | None = None
    """What the buyer is to be given: the decode of the proven tokens, up to the stop string
    that ended the answer (None: nothing proven to repair the miner's text to)."""


def _cache_claim(response: Response | None, relayed_tokens: int) -> dict | None:
    """An unproven answer's claim: the miner's cached-token count (a TEE miner reports its
    serve's cache reads with `commitment: {}`), which can only lower the bill, and the relayed
    completion as its completion, since a count that is no proof's must not lower it."""
    output = response.output if response is not None else None
    usage = output.get("usage") if isinstance(output, dict) else None
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens_details"), dict):
        return None
    return {
        "usage": {"completion_tokens": relayed_tokens, "prompt_tokens_details": usage["prompt_tokens_details"]},
        "committed_completion": relayed_tokens,
    }


def new_request_id() -> str:
    """A request id: 32 lowercase hex digits, the shape of `uuid4().hex`, at under half its cost
    (no `UUID` object is built): the milliseconds since the Unix epoch in the first 12, then 80
    random bits from the OS.

    Time first, so ids made later sort later, the way UUIDv7 orders them: the store's index of
    holds by request id then grows at its end, where its pages are already in memory. With
    random ids, each hold went to a random page of that index: on a store that had served
    200,000 requests, 2.7 reads and 30 KB written per request rather than 0.4 and 20 KB, and
    1.12× the store's CPU (`bench/store_backends.py --prefill`, `docs/performance.md`).

    Random after that, so ids from any number of processes and hosts do not collide (10^6 ids
    in one millisecond collide with a chance of ~10^-12), and nobody learns the gateway's
    request rate from the ids a miner or a buyer sees; the time in them is the request's, which
    both know. The id is a store `identifier`, and its last 12 digits name the request's tool
    calls (`relay`)."""
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"


def _new_seed() -> int:
    return secrets.randbits(63)


class _Serving:
    """`Gateway.serving`: a class rather than a generator-based context manager, which would
    cost as much again on every request."""

    __slots__ = ("_gateway",)

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def __enter__(self) -> None:
        self._gateway.in_flight += 1

    def __exit__(self, *exc_info: object) -> None:
        self._gateway._served()


@dataclasses.dataclass
class PromptCacheTally:
    """How much of the prompts the miners served came from their prefix caches: what prefix
    affinity routing (`router.prefix_key`) earns, and what buyers are billed at the cached rate."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens

    @property
    def hit_rate(self) -> float | None:
        return None if not self.prompt_tokens else self.cached_tokens / self.prompt_tokens

    def to_state(self) -> dict[str, Any]:
        rate = self.hit_rate
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": None if rate is None else round(rate, 4),
        }


class Gateway:
    """The steps of a request's life, shared by both buyer APIs (`relay.ChatEndpoint` drives them).

    `clock` is the wall clock (log rows, `created`), `monotonic` measures durations (TTFT,
    deadlines, the auth cache), `new_id` names requests, `new_seed` seeds sampled ones.
    """

    def __init__(
        self,
        *,
        store: Store,
        pool: MinerPool,
        models: dict[str, ServedModel],
        audit: AuditSink | None = None,
        settings: GatewaySettings = GatewaySettings(),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.perf_counter,
        new_id: Callable[[], str] = new_request_id,
        new_seed: Callable[[], int] = _new_seed,
        audit_draw: Callable[[], float] = random.random,
        eligible: Callable[[str, str], bool] = _always_eligible,
        request_log: RequestLogWriter | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.store = store
        self.request_log = request_log
        """Where request-log rows queue, so a buyer never waits for them (None: written inline)."""
        self.pool = pool
        self.models = models
        self.audit = audit
        """None: nothing is audited (no desk in this gateway)."""
        self.audit_draw = audit_draw
        self.eligible = eligible
        """(miner identity, model) -> may it serve paid traffic (the traffic control plane's view)."""
        self.settings = settings
        self.clock = clock
        self.monotonic = monotonic
        self.new_id = new_id
        self.new_seed = new_seed
        self.rr_counter = 0
        self.prompt_cache = PromptCacheTally()
        """Prompt tokens settled in this process, and how many came from the miners' caches."""
        self.tokenize_limiter = trio.CapacityLimiter(settings.tokenize_threads)
        self.waiting_room = WaitingRoom(max_waiting=settings.queue_max)
        self.queue_metrics = QueueMetrics(registry if registry is not None else Registry())
        self.created = int(clock())
        self._accounts: dict[bytes, tuple[Any, float]] = {}
        self.in_flight = 0
        """Buyer requests and probes being served (`serving`), for the drain."""
        self._none_in_flight = trio.Event()
        self.cut_off = False
        """Set when a drain ran out of time: requests still running end now, in-band."""
        self._proof_waits: trio.Nursery | None = None
        """Where answers cut at a stop string wait for their miner's commitment (`keep_proofs`)."""

    # ---- drain --------------------------------------------------------------------------------
    def serving(self) -> _Serving:
        """Count one request in flight for as long as the block runs."""
        return _Serving(self)

    def _served(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._none_in_flight.set()
            self._none_in_flight = trio.Event()

    async def drain(self, *, grace_s: float, cutoff_wait_s: float) -> int:
        """Let the requests in flight run to their end for up to `grace_s` (the buyer listener
        has stopped taking new ones), then end the rest now: a stream with an error event in its
        API's format, anything that has sent nothing with a 503 and Retry-After, each charged for
        what it relayed. Returns how many were cut off."""
        with trio.move_on_after(grace_s):
            await self._until_none_in_flight()
        left = self.in_flight
        if left:
            log.warning("%d request(s) still running after the %g s drain; ending them now", left, grace_s)
            self.cut_off = True
            for leg in list(self.pool.legs.values()):
                for pending in list(leg.inflight.values()):
                    pending.notify()
            self.pool.notify_room()
            with trio.move_on_after(cutoff_wait_s):
                await self._until_none_in_flight()
        return left

    async def _until_none_in_flight(self) -> None:
        while self.in_flight:
            await self._none_in_flight.wait()

    def shutting_down(self) -> GatewayError:
        return GatewayError("overloaded", "the gateway is shutting down; retry shortly", retry_after_s=1)

    # ---- shared steps -------------------------------------------------------------------------
    async def read_body(self, receive: Receive) -> dict[str, Any]:
        """The body as a JSON object, read no further than the size cap and no longer than
        `body_timeout_s`: a client trickling its body (slow-loris) holds a connection for that
        long at most."""
        timeout_s = self.settings.body_timeout_s
        try:
            return await read_json_object(receive, max_bytes=self.settings.max_body_bytes, timeout_s=timeout_s)
        except BodyError as error:
            if error.status == 408:
                raise GatewayError(
                    "request_timeout",
                    f"the request body did not arrive within {timeout_s:g} s; "
                    "send it in one go, or check the client's network",
                ) from None
            raise GatewayError("request_too_large" if error.status == 413 else "invalid_request", str(error)) from None

    async def authenticate(self, api_key: str | None):
        if not api_key:
            raise GatewayError("authentication", "missing API key: send Authorization: Bearer <key> (or x-api-key)")
        digest = hashlib.sha256(api_key.encode()).digest()
        cached = self._accounts.get(digest)
        now = self.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        account = await self.store.run(self.store.authenticate, api_key)
        if account is None:
            raise GatewayError("authentication", "invalid API key")
        if len(self._accounts) >= AUTH_CACHE_MAX_ENTRIES:
            self._accounts.clear()
        self._accounts[digest] = (account, now + AUTH_CACHE_TTL_S)
        return account

    def max_output_tokens_for(self, model: str) -> int:
        return self.models[model].spec.max_output_tokens

    def serve_request(self, chat: ChatRequest, request_id: str) -> ServeRequest:
        messages = tuple(
            Message(
                role=m["role"],
                content=m.get("content") or "",
                extra={k: v for k, v in m.items() if k not in ("role", "content")},
            )
            for m in chat.messages
        )
        sampling = chat.sampling
        if not sampling.greedy and sampling.seed is None:
            # Every sampled request carries a seed: a miner that samples deterministically from
            # it can then be verified by replaying its draws (`proof.SamplingTerms.seed`).
            sampling = dataclasses.replace(sampling, seed=self.new_seed())
        return ServeRequest(
            messages=messages,
            max_tokens=chat.max_tokens,
            engy_request_id=request_id,
            tools=chat.tools,
            sampling=sampling,
            tool_choice=chat.tool_choice,
            chat_template_kwargs=chat.chat_template_kwargs,
        )

    async def begin(self, api: ApiName, account, chat: ChatRequest) -> Flight:
        model = self.models[chat.model]
        spec = model.spec
        request_id = self.new_id()
        serve = self.serve_request(chat, request_id)
        size, floor = self.size_up(chat, model)
        if size.chars > INLINE_TOKENIZE_MAX_CHARS:
            # Tokenising this one costs more than a balance read: an account that cannot pay
            # even for the prompt's floor is refused before the tokenizer runs.
            least = billing.worst_case_hold(price=spec.price, prompt_tokens=floor, max_tokens=chat.max_tokens)
            balance = await self.store.run(self.store.balance, account.account_id)
            if balance.available < least:
                raise GatewayError(
                    "billing", _insufficient(least, f"at least {floor} prompt + {chat.max_tokens} max tokens")
                )
        prompt_ids = await self.render(chat, model, serve, size)
        if len(prompt_ids) > spec.max_input_tokens:
            raise GatewayError(
                "invalid_request",
                f"the prompt is {len(prompt_ids)} tokens; {chat.model} accepts at most {spec.max_input_tokens}",
                param="messages",
            )
        amount = billing.worst_case_hold(price=spec.price, prompt_tokens=len(prompt_ids), max_tokens=chat.max_tokens)
        hold = await self.store.run(self.store.hold, account.account_id, amount=amount, request_id=request_id)
        if hold is None:
            raise GatewayError(
                "billing", _insufficient(amount, f"{len(prompt_ids)} prompt + {chat.max_tokens} max tokens")
            )
        return Flight(
            request_id,
            api,
            account.account_id,
            chat,
            serve,
            model,
            prompt_ids,
            hold,
            self.monotonic(),
            created=int(self.clock()),
        )

    async def begin_probe(self, chat: ChatRequest, *, target: str) -> Flight:
        """A probe for miner `target`, shaped by the caller like a buyer's request (the same
        rendering, seed and frames); no account, no hold."""
        model = self.models[chat.model]
        request_id = self.new_id()
        serve = self.serve_request(chat, request_id)
        prompt_ids = await self.render(chat, model, serve, intake.prompt_size(chat))
        return Flight(
            request_id,
            "openai",
            None,
            chat,
            serve,
            model,
            prompt_ids,
            None,
            self.monotonic(),
            created=int(self.clock()),
            kind="probe",
            target=target,
        )

    def _route(self, flight: Flight) -> tuple[str, frozenset[str]] | None:
        """(the leg to send `flight` to, what the request needs that its miner lacks), or None
        when no eligible leg has room."""
        chat = flight.chat
        tried = frozenset(flight.tried)
        needs = _needs(chat)
        # A sampled answer from a miner that samples from the gateway's seed is verified by
        # replay, as strictly as a greedy one; from any other, only statistically.
        prefer = frozenset({FEATURE_SEEDED}) if FEATURE_SAMPLING in needs else frozenset()
        self.rr_counter += 1
        choice = self.pool.route(
            chat.model,
            prefix=prefix_key(messages=chat.messages, tools=chat.tools),
            rr_counter=self.rr_counter,
            prompt_tokens=len(flight.prompt_ids),
            needs=needs,
            prefer=prefer,
            exclude=tried,
            target=flight.target,
            eligible=lambda miner: self.eligible(miner, chat.model),
        )
        if choice is None:
            return None
        return choice.worker_id, needs & self.pool.legs[choice.worker_id].lacks

    async def _wait_for_room(self, flight: Flight) -> tuple[str, frozenset[str]]:
        """Wait in the model's queue (`admission`) for this request's turn and a leg with room,
        up to `queue_wait_s`; then 503/529. A probe (it goes to one miner or nowhere) and a retry
        (the miners that had room already failed it) do not queue. A buyer hanging up cancels
        the wait, and the ticket leaves with it."""
        model = flight.chat.model
        retry_after_s = self.settings.no_capacity_retry_after_s
        no_room = GatewayError(
            "overloaded", f"no miner has capacity for {model} right now; retry shortly", retry_after_s=retry_after_s
        )
        if flight.target is not None or flight.tried or self.settings.queue_wait_s <= 0:
            raise no_room
        ticket = self.waiting_room.join(model, flight.account_id)
        if ticket is None:
            self.queue_metrics.outcome(model, "full")
            raise GatewayError(
                "overloaded",
                f"no miner has capacity for {model} and {self.settings.queue_max} requests are "
                "already waiting for it; retry shortly",
                retry_after_s=retry_after_s,
            )
        self.queue_metrics.depth(model, self.waiting_room.depth(model))
        joined = self.monotonic()
        route = None
        outcome = "gone"
        try:
            with trio.move_on_after(self.settings.queue_wait_s):
                while route is None:
                    if self.cut_off:
                        raise self.shutting_down()
                    changed = self.pool.room_changed
                    if self.waiting_room.turn(model) is ticket and (route := self._route(flight)) is not None:
                        break
                    # Eligibility changes (a miner passing its probes) come without a pool
                    # event: look again now and then all the same.
                    with trio.move_on_after(QUEUE_RECHECK_S):
                        await changed.wait()
            outcome = "timed_out" if route is None else "served"
        finally:
            self.waiting_room.leave(ticket, served=route is not None)
            self.pool.notify_room()
            self.queue_metrics.left(
                model, waited_s=self.monotonic() - joined, outcome=outcome, depth=self.waiting_room.depth(model)
            )
        if route is None:
            raise GatewayError(
                "overloaded",
                f"no miner had capacity for {model} within {self.settings.queue_wait_s:g} s; retry shortly",
                retry_after_s=retry_after_s,
            )
        return route

    async def dispatch(self, flight: Flight) -> PendingRequest:
        chat = flight.chat
        route = self._route(flight)
        if route is None:
            route = await self._wait_for_room(flight)
        worker_id, flight.unmet = route
        flight.tried.add(worker_id)
        if flight.unmet:
            log.debug(
                "request %s: no miner that honours %s had room; one that does not serves it",
                flight.request_id,
                ", ".join(sorted(flight.unmet)),
            )
        pending = await self.pool.dispatch(worker_id, flight.serve, stream=chat.stream)
        flight.pending = pending
        flight.miner = pending.leg.identity.miner
        flight.seeded = FEATURE_SEEDED in pending.leg.hello.features
        return pending

    async def first_output(self, flight: Flight, *, wait_s: float) -> PendingRequest:
        """Dispatch, retrying on failure, until the miner produced output or `wait_s` passed.
        Raises GatewayError when every attempt failed before any output."""
        attempts = 0
        while True:
            attempts += 1
            try:
                pending = await self.dispatch(flight)
            except LegLost as error:
                last_error = str(error)
            except GatewayError as error:
                if error.kind == "overloaded" and attempts > 1:
                    break  # every miner that could take it already failed it: report that failure
                raise
            else:
                with trio.move_on_after(wait_s):
                    while not (pending.chunks or pending.finished):
                        if self.cut_off:
                            raise self.shutting_down()
                        await pending.changed.wait()
                if pending.lost is not None:
                    last_error = f"the miner disconnected: {pending.lost}"
                    await self.log_outcome(flight, status=502, usage=None)
                elif pending.response is not None and pending.response.error is not None and not pending.chunks:
                    status = pending.response.error_status
                    if status in BUYER_FAULTS and flight.kind == "paid":
                        # The request itself was at fault (a prompt past the model's context, a
                        # tool schema its template rejects): any miner would refuse it, so it is
                        # not retried, and it is the buyer's to read, with the miner's status.
                        await self.log_outcome(flight, status=status, usage=None)
                        raise GatewayError(
                            "request_too_large" if status == 413 else "invalid_request",
                            f"the model cannot serve this request: {pending.response.error}",
                            status_from_miner=status,
                        )
                    last_error = f"the miner failed: {pending.response.error_text}"
                    await self.log_outcome(flight, status=502, usage=None)
                else:
                    return pending
            if not retry_allowed(first_byte_sent=False, attempts=attempts, max_attempts=self.settings.max_attempts):
                break
        raise GatewayError("upstream", f"{last_error}; try again")

    async def reasoning_tokens(self, flight: Flight, accounting: Accounting) -> int:
        """How many of the answer's completion tokens are its reasoning (`reasoning_tokens`)."""
        answer = accounting.proven_text if accounting.proven_text is not None else flight.delivered_text
        if THINK_CLOSE not in answer and not answer.startswith("<think>"):
            return 0
        return await trio.to_thread.run_sync(
            reasoning_tokens, flight.model, accounting.output_ids, answer, limiter=self.tokenize_limiter
        )

    async def settle(self, flight: Flight, *, status: int, completion_claim: dict | None, relayed_tokens: int) -> Usage:
        """Charge for what the buyer got, release the rest of the hold, record metadata."""
        prompt = len(flight.prompt_ids)
        claimed = Usage(prompt_tokens=prompt, completion_tokens=relayed_tokens, cached_tokens=0)
        committed_completion = relayed_tokens
        if completion_claim is not None:
            usage = completion_claim.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            claimed = Usage(
                prompt_tokens=prompt,
                completion_tokens=_int(usage.get("completion_tokens")),
                cached_tokens=min(prompt, _int(details.get("cached_tokens"))),
            )
            committed_completion = completion_claim.get("committed_completion", relayed_tokens)
        usage = billing.billable_usage(
            claimed=claimed,
            committed_prompt=prompt,
            committed_completion=committed_completion,
            relayed_completion=relayed_tokens,
        )
        self.prompt_cache.add(usage)
        if flight.hold is None:
            await self.log_outcome(flight, status=status, usage=usage)
            return usage
        # One write: the charge and the request's log row (which epochs are settled from, so it
        # records what the ledger charged) land together or not at all.
        settlement = await self.store.run(
            self.store.settle_and_log,
            flight.hold,
            cost=billing.charge(price=flight.model.spec.price, usage=usage),
            entry=self._log_entry(flight, status=status, usage=usage, cost=0),
        )
        if not settlement.applied:
            log.error(
                "request %s: its hold was closed before it settled (charged %d µUSD, released %d); the answer is "
                "not charged again",
                flight.request_id,
                settlement.charged,
                settlement.released,
            )
        return usage

    async def log_outcome(self, flight: Flight, *, status: int, usage: Usage | None, cost: int = 0) -> None:
        entry = self._log_entry(flight, status=status, usage=usage, cost=cost)
        if self.request_log is not None and self.request_log.add(entry):
            return
        try:
            with trio.CancelScope(shield=True):
                await self.store.run(self.store.log_request, entry)
        except StoreError as error:
            # The request itself is served and billed; losing its log row must not fail it.
            log.error("request %s: could not write the request log (%s)", entry.request_id, error)

    def _log_entry(self, flight: Flight, *, status: int, usage: Usage | None, cost: int) -> RequestLogEntry:
        elapsed_ms = int((self.monotonic() - flight.started) * 1000)
        ttft_ms = int((flight.first_output_at - flight.started) * 1000) if flight.first_output_at else None
        tpot_ms = None
        if usage is not None and ttft_ms is not None and usage.completion_tokens > 1:
            tpot_ms = max(0, (elapsed_ms - ttft_ms) // (usage.completion_tokens - 1))
        return RequestLogEntry(
            request_id=flight.request_id,
            account_id=flight.account_id,
            miner=flight.miner or None,
            model=flight.chat.model,
            api=flight.api,
            kind=flight.kind,
            status=status,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            cost_micro=cost,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            created_at=self.clock(),
            served_greedily=flight.served_greedily,
        )

    def size_up(self, chat: ChatRequest, model: ServedModel) -> tuple[intake.PromptSize, int]:
        """The conversation's size and its token floor (`intake`); a 400 when the floor alone
        exceeds the model's input limit, so such a prompt is never tokenised."""
        size = intake.prompt_size(chat)
        floor = intake.token_floor(size, max_token_bytes=model.max_token_bytes)
        refusal = intake.too_long(size, floor=floor, max_input_tokens=model.spec.max_input_tokens, model=chat.model)
        if refusal is not None:
            raise GatewayError("invalid_request", refusal, param="messages")
        return size, floor

    async def count_prompt(self, chat: ChatRequest, request_id: str) -> int:
        """The prompt's token count as `begin` would make it (Anthropic's count_tokens)."""
        model = self.models[chat.model]
        size, _ = self.size_up(chat, model)
        return len(await self.render(chat, model, self.serve_request(chat, request_id), size))

    async def render(
        self, chat: ChatRequest, model: ServedModel, serve: ServeRequest, size: intake.PromptSize
    ) -> list[int]:
        """The request's prompt ids under the model's chat template; a template that rejects the
        conversation is the buyer's 400."""
        try:
            return await self.off_loop_if_large(size.chars, model.render_prompt, serve)
        except Exception as error:  # broad on purpose: a template rejecting input is the buyer's 400
            raise GatewayError(
                "invalid_request", f"the conversation cannot be rendered for {chat.model}: {error}"
            ) from None

    async def off_loop_if_large(self, size_chars: int, work: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work inline when it is small, in a worker thread when it is not: a thread
        hand-off costs about as much CPU as rendering or counting a short conversation, and
        most requests are short, but a long one must never stall the event loop."""
        if size_chars <= INLINE_TOKENIZE_MAX_CHARS:
            return work(*args)
        return await trio.to_thread.run_sync(functools.partial(work, *args), limiter=self.tokenize_limiter)

    async def release(self, flight: Flight) -> None:
        if flight.hold is not None:
            await self.store.run(self.store.release, flight.hold)

    async def abandon(self, flight: Flight) -> None:
        """Nothing reached the buyer (they left, or we failed): stop the miner if it is still
        working, record the hang-up, and return the whole hold. Shielded: it must finish."""
        with trio.CancelScope(shield=True):
            if flight.pending is not None and not flight.pending.finished:
                await self.pool.cancel(flight.pending)
                await self.log_outcome(flight, status=499, usage=None)
            await self.release(flight)

    def encode(self, model: ServedModel, text: str) -> list[int]:
        return model.tokenizer.encode(text, add_special_tokens=False) if text else []

    async def account_for(self, flight: Flight, pending: PendingRequest, *, cut_at: str | None = None) -> Accounting:
        """What settlement needs, checking the commitment against what was relayed (docs/billing.md),
        and the delivery the audit judges the proof against. `cut_at`: the stop string at which
        the gateway ended an answer the miner went on with; the relayed text is then billed as
        it stands, with no stop token after it."""
        response = pending.response
        commitment = None
        if response is not None and response.output is not None and response.commitment is not None:
            try:
                commitment = proof.Commitment.from_wire(response.commitment)
            except proof.ProofFormatError as error:
                log.warning(
                    "request %s: miner %s sent a malformed commitment (%s)", flight.request_id, flight.miner, error
                )
        if commitment is None:
            relayed = await trio.to_thread.run_sync(
                self.encode, flight.model, flight.delivered_text, limiter=self.tokenize_limiter
            )
            # Audited all the same: with no commitment at all the verifier judges the delivered
            # tokens on the canonical model (`proof.judge_delivered`); with an unreadable one the
            # answer is `unproven`, and a rising share of those pulls a miner hiding behind them.
            self._offer_audit(
                flight,
                (response.commitment if response is not None else None) or {},
                proof.Delivery(
                    relayed_output_ids=tuple(relayed),
                    ended_at_stop=cut_at is not None,
                    max_tokens=flight.chat.max_tokens,
                ),
            )
            return Accounting(
                claim=_cache_claim(response, len(relayed)), relayed_tokens=len(relayed), output_ids=None, stop=cut_at
            )
        # A commitment was read, so the response has one, and its output.
        assert response is not None and response.output is not None and response.commitment is not None
        if list(commitment.prompt_ids) != flight.prompt_ids and await self._rendered_as_public_miner(
            flight, pending, commitment
        ):
            # An honest public miner: it proved the prompt as it renders the request, without
            # what it does not honour. That is what it computed, and what is billed and audited.
            log.info(
                "request %s: miner %s proved the prompt as the public miner renders it (%d tokens, not %d)",
                flight.request_id,
                flight.miner,
                len(commitment.prompt_ids),
                len(flight.prompt_ids),
            )
            flight.prompt_ids = list(commitment.prompt_ids)
        if list(commitment.prompt_ids) != flight.prompt_ids:
            # Established before the answer is delivered: whatever the text says, it was not
            # computed for this buyer's prompt. Recorded as a cheat at once (it pulls the miner,
            # qualification or not) and refused: the buyer is not charged for it.
            log.warning(
                "request %s: miner %s proved a different prompt than the one sent; the answer is refused and "
                "not charged",
                flight.request_id,
                flight.miner,
            )
            self._offer_audit(
                flight,
                response.commitment,
                proof.Delivery((), cut_at is not None, flight.chat.max_tokens),
                found=("cheat", "prompt-mismatch"),
            )
            return Accounting(claim=None, relayed_tokens=0, output_ids=None, stop=cut_at, refused="prompt-mismatch")
        padding = usage_padding(
            response.output, prompt_tokens=len(flight.prompt_ids), committed_tokens=len(commitment.output_token_ids)
        )
        finish_stop = cut_at is None and (response.output.get("choices") or [{}])[0].get("finish_reason") == "stop"
        terms = _StopTerms(stops=flight.chat.sampling.stop, cut_at=cut_at, finish_stop=finish_stop)
        if flight.miner_parts is None:
            relay = await self.off_loop_if_large(
                len(flight.miner_text),
                functools.partial(relayed_tokens, **terms),
                flight.model,
                flight.miner_text,
                list(commitment.output_token_ids),
            )
        else:
            relay = await trio.to_thread.run_sync(
                functools.partial(
                    structured_relayed_tokens, parts=flight.miner_parts, tools=flight.chat.tools, **terms
                ),
                flight.model,
                flight.miner_text,
                list(commitment.output_token_ids),
                limiter=self.tokenize_limiter,
            )
        if not relay.proved:
            # Established before the answer's end, like a proof of another prompt: the text is
            # not what the proven tokens say, so it is neither completed nor charged.
            log.warning(
                "request %s: miner %s sent text its proven tokens do not decode to; the answer is refused and not "
                "charged",
                flight.request_id,
                flight.miner,
            )
            self._offer_audit(
                flight,
                response.commitment,
                proof.Delivery(relay.output_ids, relay.stop is not None, flight.chat.max_tokens),
                found=("cheat", "output-mismatch"),
            )
            return Accounting(claim=None, relayed_tokens=0, output_ids=None, stop=cut_at, refused="output-mismatch")
        if relay.defect is not None:
            log.info(
                "request %s: miner %s sent text that differs from its proven tokens in presentation only (%s); the "
                "buyer is given the proven text",
                flight.request_id,
                flight.miner,
                relay.defect,
            )
        if padding is not None:
            log.warning(
                "request %s: miner %s claims more usage than it served (%s)", flight.request_id, flight.miner, padding
            )
        self._offer_audit(
            flight,
            response.commitment,
            proof.Delivery(
                relayed_output_ids=relay.output_ids,
                ended_at_stop=relay.stop is not None,
                max_tokens=flight.chat.max_tokens,
                defect=relay.defect,
            ),
            found=None if padding is None else ("cheat", "usage-padding"),
        )
        return Accounting(
            claim={**response.output, "committed_completion": len(commitment.output_token_ids)},
            relayed_tokens=relay.tokens,
            output_ids=tuple(commitment.output_token_ids),
            stop=relay.stop,
            proven_text=relay.proven_text,
        )

    async def _rendered_as_public_miner(
        self, flight: Flight, pending: PendingRequest, commitment: proof.Commitment
    ) -> bool:
        """Whether a miner that does not announce our features (a public one) proved the prompt
        one of the public miners renders for this request (`ServedModel.public_miner_prompts`)."""
        if FEATURE_TOOLS not in pending.leg.lacks:
            return False
        proven = list(commitment.prompt_ids)
        renders = await trio.to_thread.run_sync(
            flight.model.public_miner_prompts, flight.serve, limiter=self.tokenize_limiter
        )
        return proven in renders

    async def keep_proofs(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The service that lets an answer cut at a stop string stay provable (`account_for_cut`):
        its miner finishes and commits after the buyer's stream has ended, and the audit waits
        for that here rather than in the buyer's request."""
        async with trio.open_nursery() as nursery:
            self._proof_waits = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._proof_waits = None

    async def account_for_cut(self, flight: Flight, pending: PendingRequest, *, cut_at: str) -> Accounting:
        """An answer the gateway ended at a stop string while its miner was still generating (a
        miner that ignores stop strings, as the public one does). The buyer's stream ends now,
        billed for the relayed text as it stands; the miner is not cancelled, because its
        commitment comes only with its last frame, and a cancelled miner would leave the answer
        unproven for the gateway's own cut. The audit waits for that frame in `keep_proofs`, up
        to the request's time limit; a miner that never sends it is stopped then, and the answer
        is judged on its delivered tokens alone (`proof.judge_delivered`)."""
        relayed = await trio.to_thread.run_sync(
            self.encode, flight.model, flight.delivered_text, limiter=self.tokenize_limiter
        )
        waits = self._proof_waits
        if waits is None:
            await self.pool.cancel(pending)
            self._offer_audit(flight, {}, proof.Delivery(tuple(relayed), True, flight.chat.max_tokens))
        else:
            waits.start_soon(self._audit_when_proven, flight, pending, cut_at, tuple(relayed))
        return Accounting(claim=None, relayed_tokens=len(relayed), output_ids=None, stop=cut_at)

    async def _audit_when_proven(
        self, flight: Flight, pending: PendingRequest, cut_at: str, relayed: tuple[int, ...]
    ) -> None:
        with trio.move_on_after(max(0.0, flight.started + flight.model.spec.max_request_s - self.monotonic())):
            while not pending.finished:
                await pending.changed.wait()
        response = pending.response
        if response is not None and response.output is not None and response.commitment:
            await self.account_for(flight, pending, cut_at=cut_at)
            return
        if not pending.finished:
            log.info(
                "request %s: miner %s sent no commitment within the request's time after the gateway cut its answer at a "
                "stop string; stopped, and its delivered tokens are audited",
                flight.request_id,
                flight.miner,
            )
            await self.pool.cancel(pending)
        self._offer_audit(flight, {}, proof.Delivery(relayed, True, flight.chat.max_tokens))

    def _offer_audit(
        self,
        flight: Flight,
        commitment: dict,
        delivery: proof.Delivery,
        *,
        found: tuple[proof.VerdictKind, str] | None = None,
    ) -> None:
        if self.audit is None:
            return
        if found is None and not audited(
            flight.kind, draw=self.audit_draw(), paid_sample_pct=self.settings.audit_paid_pct
        ):
            return
        self.audit.offer(
            AuditJob(
                request_id=flight.request_id,
                model=flight.chat.model,
                miner=flight.miner,
                kind=flight.kind,
                prompt_ids=tuple(flight.prompt_ids),
                commitment=commitment,
                greedy=flight.chat.sampling.greedy or flight.served_greedily,
                sampling=flight.serve.sampling,
                seeded=flight.seeded,
                delivery=delivery,
                created_at=self.clock(),
                found=found,
            )
        )


class _StopTerms(TypedDict):
    """How an answer ended, as `relayed_tokens` and `structured_relayed_tokens` take it."""

    stops: Sequence[str]
    cut_at: str | None
    finish_stop: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Relayed:
    """What the miner sent, measured against the committed output."""

    tokens: int
    """Completion tokens to bill: all committed ones when the buyer is given the whole proven
    answer (the end token as the end of the answer); otherwise the text up to the stop recounted."""
    output_ids: tuple[int, ...]
    """The delivery as token ids (`proof.Delivery.relayed_output_ids`): the committed ids, or the
    shortest prefix of them that covers an answer ended at a stop string; for text that is not
    what they decode to, that text's own tokenisation (which then disagrees)."""
    proved: bool
    """The miner's text is what the committed ids decode to, or a prefix of it, or differs from
    that only in presentation (`corrections.presentation_match`)."""
    stop: str | None
    """The stop string the answer ended at: where the gateway cut it, or where the committed
    output goes on past the miner's text with one of the request's stop strings."""
    proven_text: str | None = None
    """The decode of the proven tokens, as far as the answer goes: what the buyer is given."""
    defect: str | None = None
    """How the miner's text differs from `proven_text` when it is proved but not equal:
    `held-back` (a tail it never sent), `whitespace`, `replacement-character` (U+FFFD for a
    character it did not wait for)."""


def relayed_tokens(
    model: ServedModel,
    miner_text: str,
    output_ids: list[int],
    *,
    stops: Sequence[str],
    cut_at: str | None,
    finish_stop: bool,
) -> Relayed:
    """Blocking (decodes and tokenises): measure a miner's text against its committed output ids."""
    committed_text = model.decode(output_ids)
    if committed_text == miner_text and cut_at is None:
        return Relayed(
            tokens=len(output_ids), output_ids=tuple(output_ids), proved=True, stop=None, proven_text=committed_text
        )
    covered = (
        len(miner_text) if committed_text.startswith(miner_text) else presentation_match(miner_text, committed_text)
    )
    if covered is None:
        return _unproved(model, miner_text, output_ids, cut_at=cut_at, finish_stop=finish_stop)
    rest = committed_text[covered:]
    stop = cut_at if cut_at is not None else next((s for s in stops if s and rest.lstrip().startswith(s)), None)
    if stop is None:
        # The whole proven answer goes to the buyer, whatever part of it the miner's text lacked.
        return Relayed(
            tokens=len(output_ids),
            output_ids=tuple(output_ids),
            proved=True,
            stop=None,
            proven_text=committed_text,
            defect=_defect(miner_text, committed_text, covered),
        )
    proven = committed_text[:covered]
    tokens = len(model.tokenizer.encode(proven, add_special_tokens=False) if proven else []) + (
        1 if finish_stop and output_ids else 0
    )
    return Relayed(
        tokens=tokens,
        output_ids=_covering_prefix(model, output_ids, proven),
        proved=True,
        stop=stop,
        proven_text=proven,
        defect=_defect(miner_text, proven, covered),
    )


def structured_relayed_tokens(
    model: ServedModel,
    miner_text: str,
    output_ids: list[int],
    *,
    parts: StructuredParts,
    tools: Sequence[dict] | None,
    stops: Sequence[str],
    cut_at: str | None,
    finish_stop: bool,
) -> Relayed:
    """Blocking: `relayed_tokens` for a miner that sent its answer in parts (`miner_text` is its
    text alone): the parts are measured against the proven text read into parts
    (`corrections.structured_account`), and the relayed tokens are those of the proven text
    they account for."""
    account = structured_account(miner_text, parts, model.decode(output_ids), tools=tools)
    if account is None:
        return _unproved(model, miner_text, output_ids, cut_at=cut_at, finish_stop=finish_stop)
    relay = relayed_tokens(model, account.text, output_ids, stops=stops, cut_at=cut_at, finish_stop=finish_stop)
    # Text that ends at a stop string was not held back: it ended there.
    defect = None if account.defect == "held-back" and relay.stop is not None else account.defect
    return dataclasses.replace(relay, defect=defect or relay.defect) if relay.proved else relay


def _unproved(
    model: ServedModel, miner_text: str, output_ids: list[int], *, cut_at: str | None, finish_stop: bool
) -> Relayed:
    relayed_ids = model.tokenizer.encode(miner_text, add_special_tokens=False) if miner_text else []
    return Relayed(
        tokens=len(relayed_ids) + (1 if finish_stop and output_ids else 0),
        output_ids=tuple(relayed_ids),
        proved=False,
        stop=cut_at,
    )


def _defect(miner_text: str, proven: str, covered: int) -> str | None:
    if miner_text == proven:
        return None
    if REPLACEMENT_CHARACTER in miner_text and miner_text.count(REPLACEMENT_CHARACTER) != proven[:covered].count(
        REPLACEMENT_CHARACTER
    ):
        return "replacement-character"
    if miner_text != proven[:covered]:
        return "whitespace"
    return "held-back"


def reasoning_tokens(model: ServedModel, output_ids: Sequence[int] | None, answer: str) -> int:
    """Blocking: how many of an answer's tokens are its reasoning. With proven tokens, those up
    to the one that closes the `<think>` block (all of them when the answer never closed it);
    without, the reasoning's own tokenisation. 0 for an answer that does not reason."""
    reasoning = "".join(
        event.text for event in parse_output(answer, call_id_prefix="r") if isinstance(event, ReasoningDelta)
    )
    if not reasoning:
        return 0
    if not output_ids:
        return len(model.tokenizer.encode(reasoning, add_special_tokens=False))
    end = answer.find(THINK_CLOSE)
    if end < 0:
        return len(output_ids)
    return len(_covering_prefix(model, list(output_ids), answer[: end + len(THINK_CLOSE)]))


def _covering_prefix(model: ServedModel, output_ids: list[int], text: str) -> tuple[int, ...]:
    """The shortest prefix of `output_ids` whose decoding starts with `text` (which the whole
    decodes to a prefix of): the tokens a buyer received part or all of. Binary search: a
    longer prefix decodes to a longer text."""
    low, high = 0, len(output_ids)
    while low < high:
        middle = (low + high) // 2
        if model.decode(output_ids[:middle]).startswith(text):
            high = middle
        else:
            low = middle + 1
    return tuple(output_ids[:low])


def usage_padding(output: dict, *, prompt_tokens: int, committed_tokens: int) -> str | None:
    """How a miner's usage claim exceeds what its own commitment shows, or None. Billing never
    pays for the excess (`billing.billable_usage`); claiming it is still established
    misbehaviour, since the miner's engine counted those very tokens."""
    usage = output.get("usage") if isinstance(output, dict) else None
    if not isinstance(usage, dict):
        return None
    claimed_prompt, claimed_completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    excess = []
    if _int(claimed_completion) > committed_tokens:
        excess.append(f"{claimed_completion} completion tokens claimed, {committed_tokens} committed")
    if _int(claimed_prompt) > prompt_tokens:
        excess.append(f"{claimed_prompt} prompt tokens claimed, {prompt_tokens} sent")
    return "; ".join(excess) or None


def _needs(chat: ChatRequest) -> frozenset[str]:
    """What a miner must honour to answer this request as asked."""
    needs = set()
    if not chat.sampling.greedy:
        needs.add(FEATURE_SAMPLING)
    if chat.tools:
        needs.add(FEATURE_TOOLS)
    return frozenset(needs)


def _insufficient(amount: int, worst_case: str) -> str:
    return f"insufficient balance: this request may cost up to {amount} micro-USD ({worst_case}); add credit or lower max_tokens"


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
