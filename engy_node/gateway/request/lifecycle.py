"""One buyer request's life in the gateway, whichever API it came through: authenticate, render
and tokenise, hold, dispatch (with retries before the first byte), settle, record.

1. **Authenticate** the API key (`auth`: cached, and checked again by the hold in step 4), then
   read the body (capped in size and time).
2. **Check what is cheap before what is not** (`intake`): a conversation that certainly exceeds
   the model's input limit is refused by its size alone, and an account that cannot pay for a
   large one is refused before it is tokenised.
3. **Tokenise** the request with the model's own chat template — the same
   `ServedModel.render_prompt` a miner uses — so the prompt count is the gateway's, and the
   commitment's `prompt_ids` can be checked against it. A large one is tokenised in a worker
   thread (at most `tokenize_threads` at once) that lets go of the GIL, so it stalls no one.
4. **Hold** the worst case (prompt + max_tokens) atomically, counted against the key's limits in
   the same transaction (`auth.KeyCache.hold`); no hold, no dispatch (402, or 429 over a limit).
5. **Route** (`pool.route`, over the model's `route_table`) and dispatch to a miner leg; when no
   eligible miner has room, wait a few seconds in the model's queue, fair across buyers
   (`admission`), before 503/529. Until
   the first byte reaches the buyer, a failing miner is retried on another, and so is one that
   sent nothing within the first-byte wait (it is told to cancel, and logged as timed out), all
   within the request's one deadline (`longest_request_s`). A request that asks
   to sample, or passes tools, goes to a miner that honours that while one has room, else to
   one that does not, and the flight records what was missing (a greedy answer to a sampled
   request is logged as such).
6. **Settle** on usage the gateway can account for (`billing.billable_usage`): never more
   completion tokens than were relayed, nor than the commitment holds. The rest of the hold is
   released; on failure before any output, all of it.
7. **Record** metadata only (no prompt or completion text, ever; queued to one writer task,
   `request_log`), and hand the proof material of a sampled response to the audit
   (`audit.py`: in memory only).

This module holds steps 1 to 5 (`Gateway`); 6 and 7, with the check of an answer against its
proof, are `accountant.Accountant`'s (`Gateway.accountant`), over the measures in
`accounting.py`; the request's data is `flight.py`'s.

Probes (docs/trust.md) take the same steps from dispatch on (`begin_probe`): the traffic control
plane sends them to one chosen miner, without an account, a hold or a charge, and they are
logged as `probe`. Paid traffic goes only to miners the control plane made eligible.

What happens between dispatch and settlement — relaying to the buyer in each API's format —
is `relay.py`. The clocks and the request-id source are injected, so tests can pin them.

Failures attributed to the miner are logged as 502 (it died or errored) or 504 (it timed out,
or stayed silent past the first-byte wait);
a buyer hang-up is 499. Those statuses feed epoch settlement (docs/trust.md, "Settlement").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import trio

from engy_node.asgi import Receive
from engy_node.config import GatewaySection
from engy_node.gateway.api.chat import ApiName, ChatRequest, GatewayError
from engy_node.gateway.billing import billing
from engy_node.gateway.billing.settlement import BUYER_FAULTS
from engy_node.gateway.request import bodies, intake
from engy_node.gateway.request.accountant import Accountant, PromptCacheTally
from engy_node.gateway.request.admission import WaitingRoom
from engy_node.gateway.request.auth import KeyCache
from engy_node.gateway.request.flight import AuditSink, Flight, new_request_id
from engy_node.gateway.request.queue_metrics import QueueMetrics
from engy_node.gateway.request.request_log import RequestLogWriter
from engy_node.gateway.routing.pool import LegLost, MinerPool, PendingRequest
from engy_node.gateway.routing.router import prefix_key, retry_allowed
from engy_node.gateway.store import Account, Store
from engy_node.metrics import Registry
from engy_node.protocol.miner import FEATURE_SAMPLING, FEATURE_SEEDED, FEATURE_TOOLS, Message, ServeRequest
from engy_node.served_model import ServedModel

log = logging.getLogger("engy.gateway")


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
    body_bytes_in_flight: int = _SECTION.body_bytes_in_flight
    body_bytes_in_flight_per_account: int = _SECTION.body_bytes_in_flight_per_account
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


def _always_eligible(miner: str, model: str) -> bool:
    return True


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
        self.pool = pool
        self.models = models
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
        self.accountant = Accountant(
            store=store,
            pool=pool,
            request_log=request_log,
            audit=audit,
            audit_draw=audit_draw,
            audit_paid_pct=settings.audit_paid_pct,
            clock=clock,
            monotonic=monotonic,
            tokenize_limiter=self.tokenize_limiter,
            off_loop=self.off_loop_if_large,
            prompt_cache=self.prompt_cache,
        )
        """What a finished answer goes through: its proof checked, audited, charged, logged."""
        self.waiting_room = WaitingRoom(max_waiting=settings.queue_max)
        registry = registry if registry is not None else Registry()
        self.queue_metrics = QueueMetrics(registry)
        self.created = int(clock())
        self.keys = KeyCache(store, monotonic)
        self.body_budget = bodies.BodyBudget(
            total_cap=settings.body_bytes_in_flight,
            account_cap=settings.body_bytes_in_flight_per_account,
            registry=registry,
        )
        self.in_flight = 0
        """Buyer requests and probes being served (`serving`), for the drain."""
        self._none_in_flight = trio.Event()
        self.cut_off = False
        """Set when a drain ran out of time: requests still running end now, in-band."""

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
    async def read_body(self, receive: Receive, account: Account) -> dict[str, Any]:
        """The body as a JSON object, read no further than the size cap, no longer than
        `body_timeout_s` (a client trickling its body holds a connection for that long at most),
        and within what the process and the account may be receiving at once (`bodies`)."""
        settings = self.settings
        return await bodies.read_body(
            receive,
            account.account_id,
            self.body_budget,
            max_bytes=settings.max_body_bytes,
            timeout_s=settings.body_timeout_s,
        )

    async def authenticate(self, api_key: str | None, api: ApiName, *, cached: bool = True) -> Account:
        return await self.keys.authenticate(api_key, api, cached=cached)

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
        tokens = len(prompt_ids) + chat.max_tokens
        hold = await self.keys.hold(account, api, model=chat.model, amount=amount, request_id=request_id, tokens=tokens)
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

    def deadline(self, flight: Flight) -> float:
        """When `flight` must be over, on `monotonic`'s clock (`longest_request_s` from its start)."""
        return flight.started + longest_request_s(self.settings, flight.model)

    async def first_output(self, flight: Flight, *, wait_s: float) -> PendingRequest:
        """Dispatch, retrying on another miner on failure, until one produced output. Each attempt
        waits up to `wait_s` for it, never past the request's deadline (`deadline`, which the
        attempts share); a miner that sent nothing by then is told to stop and logged as timed out
        (504, the miner's failure for the breaker and settlement), like one that failed. Raises
        GatewayError when every attempt failed before any output: 504 when the last one was
        silent, 502 when it failed."""
        deadline = self.deadline(flight)
        attempts = 0
        while True:
            attempts += 1
            try:
                pending = await self.dispatch(flight)
            except LegLost as error:
                failure = GatewayError("upstream", f"{error}; try again")
            except GatewayError as error:
                if error.kind == "overloaded" and attempts > 1:
                    break  # every miner that could take it already failed it: report that failure
                raise
            else:
                waited_s = max(0.0, min(wait_s, deadline - self.monotonic()))
                with trio.move_on_after(waited_s):
                    while not (pending.chunks or pending.finished):
                        if self.cut_off:
                            raise self.shutting_down()
                        await pending.changed.wait()
                if pending.lost is not None:
                    failure = GatewayError("upstream", f"the miner disconnected: {pending.lost}; try again")
                    await self.accountant.log_outcome(flight, status=502, usage=None)
                elif pending.response is not None and pending.response.error is not None and not pending.chunks:
                    status = pending.response.error_status
                    if status in BUYER_FAULTS and flight.kind == "paid":
                        # The request itself was at fault (a prompt past the model's context, a
                        # tool schema its template rejects): any miner would refuse it, so it is
                        # not retried, and it is the buyer's to read, with the miner's status.
                        await self.accountant.log_outcome(flight, status=status, usage=None)
                        raise GatewayError(
                            "request_too_large" if status == 413 else "invalid_request",
                            f"the model cannot serve this request: {pending.response.error}",
                            status_from_miner=status,
                        )
                    failure = GatewayError("upstream", f"the miner failed: {pending.response.error_text}; try again")
                    await self.accountant.log_outcome(flight, status=502, usage=None)
                elif not (pending.chunks or pending.finished):
                    failure = GatewayError(
                        "timeout", f"the miner sent nothing within {round(waited_s, 1):g} s; try again"
                    )
                    await self.give_up(flight, status=504)
                else:
                    return pending
            if not retry_allowed(
                first_byte_sent=False,
                attempts=attempts,
                max_attempts=self.settings.max_attempts,
                time_left_s=deadline - self.monotonic(),
            ):
                break
        raise failure

    async def give_up(self, flight: Flight, *, status: int) -> None:
        """Stop the attempt in flight on its miner (it is sent `cancel`, and what it sends after is
        dropped) and log it with `status` against that miner; the request itself goes on, on
        another miner or to its error. Shielded: a miner left working unseen would hold its slot."""
        pending, flight.pending = flight.pending, None
        with trio.CancelScope(shield=True):
            if pending is not None and not pending.finished:
                await self.pool.cancel(pending)
            await self.accountant.log_outcome(flight, status=status, usage=None)

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
                await self.accountant.log_outcome(flight, status=499, usage=None)
            await self.release(flight)


def longest_request_s(settings: GatewaySettings | GatewaySection, model: ServedModel) -> float:
    """The longest one request for `model` may take from its start, and so hold money: the wait
    for a first byte, then the model's limit. Its attempts share it: a miner tried after another
    stayed silent gets what is left."""
    return settings.first_byte_wait_s + model.spec.max_request_s


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
