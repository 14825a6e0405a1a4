"""The gateway's buyer API: authenticate, tokenise, hold, route, relay, settle.

One request's life, whichever API it came through (`openai_api` / `anthropic_api` parse and
encode; everything here is shared):

1. **Authenticate** the API key; **parse** the body into a `ChatRequest` (size-capped).
2. **Tokenise** it with the model's own chat template — the same `ServedModel.render_prompt` a
   miner uses — so the prompt count is the gateway's, and the commitment's `prompt_ids` can be
   checked against it.
3. **Hold** the worst case (prompt + max_tokens) atomically; no hold, no dispatch (402).
4. **Route** (`router.choose`) and dispatch to a miner leg. Until the first byte reaches the buyer,
   a failing miner is retried on another; a stream therefore waits (up to `first_byte_wait_s`)
   for the miner's first output before committing status 200, so errors keep their status codes.
5. **Relay** text through `OutputParser` (reasoning and tool calls) to the API's encoder, with
   keepalives while the miner is quiet. A buyer who hangs up gets the miner cancelled at once.
6. **Settle** on usage the gateway can account for (`billing.billable_usage`): never more
   completion tokens than were relayed, nor than the commitment holds. The rest of the hold is
   released; on failure before any output, all of it.
7. **Record** metadata only (no prompt or completion text, ever; queued to one writer task,
   `request_log`) and keep the proof material in the in-memory proof tee.

Failures attributed to the miner are logged as 502 (it died or errored) or 504 (it timed out);
a buyer hang-up is 499. Those statuses feed epoch settlement (SPEC §9).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router, WebSocketRoute

from engy_node import proof
from engy_node.asgi import BodyError, Receive, Send, read_json_object, watch_disconnect
from engy_node.gateway import anthropic_api, billing, openai_api
from engy_node.gateway.audit import ProofTee, TeeEntry
from engy_node.gateway.chat import ChatRequest, GatewayError, OutputEvent, ToolCall, Usage
from engy_node.gateway.output_parser import OutputParser
from engy_node.gateway.pool import LegLost, MinerPool, PendingRequest
from engy_node.gateway.request_log import RequestLogWriter
from engy_node.gateway.router import choose, prefix_key, retry_allowed
from engy_node.gateway.store import RequestLogEntry, Store, StoreError
from engy_node.miner.serving import ServedModel
from engy_node.protocol.miner import Message, ServeRequest

log = logging.getLogger("engy.gateway")

AUTH_CACHE_TTL_S = 30.0
"""A valid key is looked up once per this long, not once per request; revoking a key therefore
takes effect within this time. Unknown keys are never cached, so guessing cannot fill memory."""
AUTH_CACHE_MAX_ENTRIES = 100_000
INLINE_TOKENIZE_MAX_CHARS = 4096
"""Text up to this size (~1,000 tokens) is tokenised on the event loop: measured on this
project's 2-core machine, rendering and tokenising it takes well under a millisecond, less than
the thread hand-off it would otherwise cost (gateway CPU per streamed request 2.9 → 2.6 ms)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GatewaySettings:
    max_body_bytes: int = 8 * 1024 * 1024
    keepalive_s: float = 15.0
    first_byte_wait_s: float = 15.0
    max_attempts: int = 2
    no_capacity_retry_after_s: int = 5
    tokenize_threads: int = 2


@dataclasses.dataclass
class Flight:
    """One buyer request in progress."""

    request_id: str
    api: str
    account_id: int
    chat: ChatRequest
    serve: ServeRequest
    model: ServedModel
    prompt_ids: list[int]
    hold: Any
    started: float
    pending: PendingRequest | None = None
    miner: str = ""
    relayed_text: str = ""
    first_output_at: float | None = None
    tried: set[str] = dataclasses.field(default_factory=set)


class Gateway:
    def __init__(self, *, store: Store, pool: MinerPool, models: dict[str, ServedModel], tee: ProofTee,
                 settings: GatewaySettings = GatewaySettings(), clock: Callable[[], float] = time.time,
                 request_log: RequestLogWriter | None = None) -> None:
        self.store = store
        self.request_log = request_log
        """Where request-log rows queue, so a buyer never waits for them (None: written inline)."""
        self.pool = pool
        self.models = models
        self.tee = tee
        self.settings = settings
        self.clock = clock
        self.rr_counter = 0
        self.tokenize_limiter = trio.CapacityLimiter(settings.tokenize_threads)
        self.created = int(clock())
        self._accounts: dict[bytes, tuple[Any, float]] = {}

    # ---- shared steps -------------------------------------------------------------------------
    async def read_body(self, receive: Receive) -> dict[str, Any]:
        try:
            return await read_json_object(receive, max_bytes=self.settings.max_body_bytes)
        except BodyError as error:
            raise GatewayError("request_too_large" if error.status == 413 else "invalid_request", str(error)) from None

    async def authenticate(self, api_key: str | None):
        if not api_key:
            raise GatewayError("authentication", "missing API key: send Authorization: Bearer <key> (or x-api-key)")
        digest = hashlib.sha256(api_key.encode()).digest()
        cached = self._accounts.get(digest)
        now = time.monotonic()
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
        messages = tuple(Message(role=m["role"], content=m.get("content") or "",
                                 extra={k: v for k, v in m.items() if k not in ("role", "content")}) for m in chat.messages)
        return ServeRequest(messages=messages, max_tokens=chat.max_tokens, engy_request_id=request_id,
                            tools=chat.tools, sampling=chat.sampling)

    async def begin(self, api: str, account, chat: ChatRequest) -> Flight:
        model = self.models[chat.model]
        request_id = uuid.uuid4().hex
        serve = self.serve_request(chat, request_id)
        try:
            prompt_ids = await self.off_loop_if_large(_conversation_chars(chat), model.render_prompt, serve)
        except Exception as error:  # broad on purpose: a template rejecting input is the buyer's 400
            raise GatewayError("invalid_request", f"the conversation cannot be rendered for {chat.model}: {error}") from None
        spec = model.spec
        if len(prompt_ids) > spec.max_input_tokens:
            raise GatewayError("invalid_request", f"the prompt is {len(prompt_ids)} tokens; {chat.model} accepts at most "
                               f"{spec.max_input_tokens}", param="messages")
        amount = billing.worst_case_hold(price=spec.price, prompt_tokens=len(prompt_ids), max_tokens=chat.max_tokens)
        hold = await self.store.run(self.store.hold, account.account_id, amount=amount, request_id=request_id)
        if hold is None:
            raise GatewayError("billing", f"insufficient balance: this request may cost up to {amount} micro-USD "
                               f"({len(prompt_ids)} prompt + {chat.max_tokens} max tokens); add credit or lower max_tokens")
        return Flight(request_id, api, account.account_id, chat, serve, model, prompt_ids, hold, time.perf_counter())

    async def dispatch(self, flight: Flight) -> PendingRequest:
        chat = flight.chat
        candidates = self.pool.candidates(chat.model)
        self.rr_counter += 1
        choice = choose(candidates=candidates, prefix=prefix_key(messages=chat.messages, tools=chat.tools), rr_counter=self.rr_counter,
                        exclude=frozenset(flight.tried))
        if choice is None:
            raise GatewayError("overloaded", f"no miner has capacity for {chat.model} right now; retry shortly",
                               retry_after_s=self.settings.no_capacity_retry_after_s)
        flight.tried.add(choice.worker_id)
        pending = await self.pool.dispatch(choice.worker_id, flight.serve, stream=chat.stream)
        flight.pending = pending
        flight.miner = pending.leg.identity.miner
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
                        await pending.changed.wait()
                if pending.lost is not None:
                    last_error = f"the miner disconnected: {pending.lost}"
                    await self.log_outcome(flight, status=502, usage=None)
                elif pending.response is not None and pending.response.error is not None and not pending.chunks:
                    last_error = f"the miner failed: {pending.response.error}"
                    await self.log_outcome(flight, status=502, usage=None)
                else:
                    return pending
            if not retry_allowed(first_byte_sent=False, attempts=attempts, max_attempts=self.settings.max_attempts):
                break
        raise GatewayError("upstream", f"{last_error}; try again")

    async def settle(self, flight: Flight, *, status: int, completion_claim: dict | None, relayed_tokens: int) -> Usage:
        """Charge for what the buyer got, release the rest of the hold, record metadata."""
        prompt = len(flight.prompt_ids)
        claimed = Usage(prompt_tokens=prompt, completion_tokens=relayed_tokens, cached_tokens=0)
        committed_completion = relayed_tokens
        if completion_claim is not None:
            usage = completion_claim.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            claimed = Usage(prompt_tokens=prompt, completion_tokens=_int(usage.get("completion_tokens")),
                            cached_tokens=min(prompt, _int(details.get("cached_tokens"))))
            committed_completion = completion_claim.get("committed_completion", relayed_tokens)
        usage = billing.billable_usage(claimed=claimed, committed_prompt=prompt, committed_completion=committed_completion,
                                       relayed_completion=relayed_tokens)
        cost = billing.charge(price=flight.model.spec.price, usage=usage)
        await self.store.run(self.store.settle, flight.hold, cost=cost)
        await self.log_outcome(flight, status=status, usage=usage, cost=cost)
        return usage

    async def log_outcome(self, flight: Flight, *, status: int, usage: Usage | None, cost: int = 0) -> None:
        elapsed_ms = int((time.perf_counter() - flight.started) * 1000)
        ttft_ms = int((flight.first_output_at - flight.started) * 1000) if flight.first_output_at else None
        tpot_ms = None
        if usage is not None and ttft_ms is not None and usage.completion_tokens > 1:
            tpot_ms = max(0, (elapsed_ms - ttft_ms) // (usage.completion_tokens - 1))
        entry = RequestLogEntry(
            request_id=flight.request_id, account_id=flight.account_id, miner=flight.miner or None, model=flight.chat.model,
            api=flight.api, kind="paid", status=status,
            prompt_tokens=usage.prompt_tokens if usage else 0, completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0, cost_micro=cost, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
            created_at=self.clock(),
        )
        if self.request_log is not None and self.request_log.add(entry):
            return
        try:
            with trio.CancelScope(shield=True):
                await self.store.run(self.store.log_request, entry)
        except StoreError as error:
            # The request itself is served and billed; losing its log row must not fail it.
            log.error("request %s: could not write the request log (%s)", entry.request_id, error)

    async def off_loop_if_large(self, size_chars: int, work: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work inline when it is small, in a worker thread when it is not: a thread
        hand-off costs about as much CPU as rendering or counting a short conversation, and
        most requests are short, but a long one must never stall the event loop."""
        if size_chars <= INLINE_TOKENIZE_MAX_CHARS:
            return work(*args)
        return await trio.to_thread.run_sync(functools.partial(work, *args), limiter=self.tokenize_limiter)

    async def release(self, flight: Flight) -> None:
        await self.store.run(self.store.release, flight.hold)

    async def abandon(self, flight: Flight) -> None:
        """Nothing reached the buyer (they left, or we failed): stop the miner if it is still
        working, record the hang-up, and return the whole hold. Shielded: it must finish."""
        with trio.CancelScope(shield=True):
            if flight.pending is not None and not flight.pending.finished:
                await self.pool.cancel(flight.pending)
                await self.log_outcome(flight, status=499, usage=None)
            await self.release(flight)

    def count_tokens(self, model: ServedModel, text: str) -> int:
        return len(model.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def account_for(self, flight: Flight, pending: PendingRequest) -> tuple[dict | None, int]:
        """(claim, relayed token count) for settlement, checking the commitment (SPEC §8.9)."""
        response = pending.response
        commitment = None
        if response is not None and response.output is not None and response.commitment is not None:
            try:
                commitment = proof.Commitment.from_wire(response.commitment)
            except proof.ProofFormatError as error:
                log.warning("request %s: miner %s sent a malformed commitment (%s)", flight.request_id, flight.miner, error)
        if commitment is None:
            relayed = await trio.to_thread.run_sync(self.count_tokens, flight.model, flight.relayed_text, limiter=self.tokenize_limiter)
            return None, relayed
        if list(commitment.prompt_ids) != flight.prompt_ids:
            log.warning("request %s: miner %s proved a different prompt than the one sent", flight.request_id, flight.miner)
        finish_stop = (response.output.get("choices") or [{}])[0].get("finish_reason") == "stop"
        relayed_tokens, consistent = await self.off_loop_if_large(
            len(flight.relayed_text), relayed_token_count, flight.model, flight.relayed_text,
            list(commitment.output_token_ids), finish_stop)
        if not consistent:
            # Billing still takes the smallest count; the proof tee keeps the evidence.
            log.warning("request %s: miner %s relayed text its committed tokens do not decode to", flight.request_id, flight.miner)
        self.tee.add(TeeEntry(
            request_id=flight.request_id, model=flight.chat.model, miner=flight.miner, kind="paid",
            prompt_ids=tuple(flight.prompt_ids), commitment=response.commitment,
            greedy=flight.chat.sampling.greedy, relayed_output_ids=None, created_at=self.clock(),
        ), now=self.clock())
        return {**response.output, "committed_completion": len(commitment.output_token_ids)}, relayed_tokens


def relayed_token_count(model: ServedModel, relayed_text: str, output_ids: list[int], finish_stop: bool) -> tuple[int, bool]:
    """(completion tokens the buyer received, whether the relayed text is what the committed
    tokens decode to). When it is, every committed token reached the buyer (the final stop token
    as the end of the answer); otherwise the relayed text is recounted with the model's
    tokenizer, plus the stop token, which the buyer never sees as text."""
    committed_text = model.decode(output_ids)
    if committed_text == relayed_text:
        return len(output_ids), True
    count = len(model.tokenizer.encode(relayed_text, add_special_tokens=False)) if relayed_text else 0
    return count + (1 if finish_stop and output_ids else 0), committed_text.startswith(relayed_text)


def _conversation_chars(chat: ChatRequest) -> int:
    """A cheap upper bound on the rendered prompt's size, to decide where to tokenise it."""
    size = sum(len(str(message.get("content") or "")) + len(str(message.get("tool_calls") or "")) for message in chat.messages)
    return size + (len(str(chat.tools)) if chat.tools else 0)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _final_content(pending: PendingRequest) -> tuple[str, str]:
    """(content, finish_reason) from the miner's response."""
    output = pending.response.output if pending.response is not None else None
    choice = ((output or {}).get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content")
    finish = choice.get("finish_reason")
    return (content if isinstance(content, str) else ""), ("length" if finish == "length" else "stop")


def _finish_for(events: list[OutputEvent], finish: str) -> str:
    return "tool_calls" if any(isinstance(event, ToolCall) for event in events) else finish


class _Api(abc.ABC):
    """What differs between the two buyer APIs; the flow in `Handlers` is shared."""

    name: str

    def api_key(self, headers: Headers) -> str | None:
        header = headers.get("authorization", "")
        return header[7:].strip() if header.lower().startswith("bearer ") else None

    @abc.abstractmethod
    def parse(self, body: dict, gateway: Gateway) -> ChatRequest: ...

    @abc.abstractmethod
    def error_response(self, err: GatewayError, request_id: str) -> JSONResponse: ...

    @abc.abstractmethod
    def body(self, flight: Flight, events: list[OutputEvent], finish: str, usage: Usage, stop_sequence: str | None) -> dict: ...

    @abc.abstractmethod
    def encoder(self, flight: Flight) -> "_Encoder": ...


class _OpenAi(_Api):
    name = "openai"

    def parse(self, body: dict, gateway: Gateway) -> ChatRequest:
        return openai_api.parse_chat_request(body, known_models=set(gateway.models), max_output_tokens_for=gateway.max_output_tokens_for)

    def error_response(self, err: GatewayError, request_id: str) -> JSONResponse:
        headers = {**openai_api.error_headers(err), "x-request-id": request_id}
        return JSONResponse(openai_api.error_body(err, request_id), status_code=err.status, headers=headers)

    def body(self, flight: Flight, events: list[OutputEvent], finish: str, usage: Usage, stop_sequence: str | None) -> dict:
        return openai_api.completion_body(request_id=f"chatcmpl-{flight.request_id}", created=int(time.time()),
                                          model=flight.chat.model, events=events, finish=finish, usage=usage)

    def encoder(self, flight: Flight) -> "_Encoder":
        encoder = openai_api.ChunkEncoder(f"chatcmpl-{flight.request_id}", int(time.time()), flight.chat.model, flight.chat.include_usage)
        return _Encoder(start=encoder.start, events=encoder.events, keepalive=encoder.keepalive, error=encoder.error,
                        finish=lambda finish, usage, stop_sequence: encoder.finish(finish, usage))


class _Anthropic(_Api):
    name = "anthropic"

    def api_key(self, headers: Headers) -> str | None:
        return headers.get("x-api-key") or super().api_key(headers)

    def parse(self, body: dict, gateway: Gateway) -> ChatRequest:
        return anthropic_api.parse_messages_request(body, known_models=set(gateway.models), max_output_tokens_for=gateway.max_output_tokens_for)

    def error_response(self, err: GatewayError, request_id: str) -> JSONResponse:
        headers = {**anthropic_api.error_headers(err), "request-id": request_id, "x-request-id": request_id}
        return JSONResponse(anthropic_api.error_body(err, request_id), status_code=anthropic_api.status_for(err), headers=headers)

    def body(self, flight: Flight, events: list[OutputEvent], finish: str, usage: Usage, stop_sequence: str | None) -> dict:
        return anthropic_api.message_body(message_id=f"msg_{flight.request_id}", model=flight.chat.model, events=events,
                                          finish=finish, stop_sequence=stop_sequence, usage=usage)

    def encoder(self, flight: Flight) -> "_Encoder":
        encoder = anthropic_api.EventEncoder(f"msg_{flight.request_id}", flight.chat.model)
        prompt = len(flight.prompt_ids)
        return _Encoder(start=lambda: encoder.start(Usage(prompt_tokens=prompt, completion_tokens=1)), events=encoder.events,
                        keepalive=encoder.ping, error=encoder.error,
                        finish=lambda finish, usage, stop_sequence: encoder.finish(finish, stop_sequence=stop_sequence, usage=usage))


@dataclasses.dataclass(frozen=True)
class _Encoder:
    start: Callable[[], list[bytes]]
    events: Callable[[list[OutputEvent]], list[bytes]]
    keepalive: Callable[[], list[bytes]]
    error: Callable[[GatewayError], list[bytes]]
    finish: Callable[[str, Usage, str | None], list[bytes]]


OPENAI, ANTHROPIC = _OpenAi(), _Anthropic()


class ChatEndpoint:
    """One buyer API's chat route (`/v1/chat/completions` or `/v1/messages`) as a raw ASGI app.

    This is the gateway's hot path, so it speaks ASGI itself instead of going through Starlette's
    `Request` and `StreamingResponse`: one task watches for the buyer hanging up over the whole
    response (the wait for the miner's first output, then the relay) where Starlette would start
    one per phase, and the relay writes straight to the server without a task group around it.
    """

    def __init__(self, gateway: Gateway, api: _Api) -> None:
        self.gateway = gateway
        self.api = api

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        gateway, api = self.gateway, self.api
        request_id = uuid.uuid4().hex
        try:
            account = await gateway.authenticate(api.api_key(Headers(scope=scope)))
            chat = api.parse(await gateway.read_body(receive), gateway)
            flight = await gateway.begin(api.name, account, chat)
            request_id = flight.request_id
            async with watch_disconnect(receive):
                if chat.stream:
                    await self._stream(flight, send)
                else:
                    await self._complete(flight, send)
        except GatewayError as err:
            if err.kind not in ("authentication", "invalid_request", "not_found", "request_too_large"):
                log.info("request %s (%s) failed: %s (%s)", request_id, api.name, err.kind, err)
            await api.error_response(err, request_id)(scope, receive, send)

    async def _complete(self, flight: Flight, send: Send) -> None:
        """A non-streamed answer. Every way out before settling returns the whole hold."""
        gateway = self.gateway
        deadline_s = flight.model.spec.max_request_s
        settled = False
        try:
            pending = await gateway.first_output(flight, wait_s=deadline_s)
            with trio.move_on_after(deadline_s):
                while not pending.finished:
                    await pending.changed.wait()
            if not pending.finished:
                raise GatewayError("timeout", f"the miner did not finish within {deadline_s} s")
            if pending.lost is not None or pending.response is None or pending.response.error is not None:
                reason = pending.lost or (pending.response.error if pending.response else "no response")
                await gateway.log_outcome(flight, status=502, usage=None)
                raise GatewayError("upstream", f"the miner failed: {reason}")
            content, finish = _final_content(pending)
            flight.relayed_text = content
            flight.first_output_at = flight.first_output_at or time.perf_counter()
            parser = OutputParser(call_id_prefix=flight.request_id[:12])
            events = parser.feed(content) + parser.finish()
            claim, relayed_tokens = await gateway.account_for(flight, pending)
            usage = await gateway.settle(flight, status=200, completion_claim=claim, relayed_tokens=relayed_tokens)
            settled = True
        finally:
            if not settled:
                await gateway.abandon(flight)
        stop_sequence = await self._matched_stop(flight, pending, content, finish)
        body = self.api.body(flight, events, _finish_for(events, finish), usage, stop_sequence)
        await _send_json(send, body, request_id=flight.request_id)

    async def _matched_stop(self, flight: Flight, pending: PendingRequest, content: str, finish: str) -> str | None:
        stops = flight.chat.sampling.stop
        if finish != "stop" or not stops or pending.response is None or not pending.response.commitment:
            return None
        ids = pending.response.commitment.get("output_token_ids") or []
        full = await trio.to_thread.run_sync(lambda: flight.model.decode(ids))
        rest = full[len(content):] if full.startswith(content) else ""
        return next((stop for stop in stops if rest.startswith(stop)), None)

    async def _stream(self, flight: Flight, send: Send) -> None:
        """Status 200 is committed only once the miner has produced output, so that a miner
        failing before that is retried on another and other failures keep their status codes."""
        gateway = self.gateway
        committed = False
        try:
            pending = await gateway.first_output(flight, wait_s=gateway.settings.first_byte_wait_s)
            committed = True
        finally:
            if not committed:
                await gateway.abandon(flight)
        request_id = flight.request_id.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, (b"x-request-id", request_id), (b"request-id", request_id)]})
        await self._relay(flight, pending, send)

    async def _relay(self, flight: Flight, pending: PendingRequest, send: Send) -> None:
        """Everything after status 200: relay, then finish in-band. A buyer hanging up cancels
        this; whatever the way out short of the end, the miner is stopped and only what was
        relayed is charged."""
        gateway = self.gateway
        encoder = self.api.encoder(flight)
        parser = OutputParser(call_id_prefix=flight.request_id[:12])
        events_seen: list[OutputEvent] = []
        deadline = time.perf_counter() + flight.model.spec.max_request_s
        outcome = "buyer-gone"
        try:
            # Everything ready at a wake-up goes out as one write: under load several chunks
            # arrive per wake-up, and each separate send costs the server a trip through its stack.
            out = list(encoder.start())
            while True:
                while pending.chunks:
                    text = pending.chunks.popleft()
                    flight.first_output_at = flight.first_output_at or time.perf_counter()
                    events = parser.feed(text)
                    flight.relayed_text += text
                    events_seen += events
                    out += encoder.events(events)
                if out:
                    await _send_body(send, b"".join(out), more=True)
                    out = []
                if pending.finished:
                    break
                if time.perf_counter() > deadline:
                    outcome = "timeout"
                    break
                if not await _wait_changed(pending, gateway.settings.keepalive_s):
                    await _send_body(send, b"".join(encoder.keepalive()), more=True)
            if outcome == "timeout" or pending.lost is not None or pending.response is None or pending.response.error is not None:
                outcome = "timeout" if outcome == "timeout" else "miner-failed"
                reason = ("the miner did not finish in time" if outcome == "timeout"
                          else pending.lost or (pending.response.error if pending.response else "no response"))
                error = GatewayError("timeout" if outcome == "timeout" else "upstream", f"the miner failed mid-stream: {reason}")
                await _send_body(send, b"".join(encoder.error(error)), more=False)
                return
            content, finish = _final_content(pending)
            if content.startswith(flight.relayed_text) and len(content) > len(flight.relayed_text):
                rest = content[len(flight.relayed_text):]
                events = parser.feed(rest)
                flight.relayed_text += rest
                events_seen += events
                out += encoder.events(events)
            tail = parser.finish()
            events_seen += tail
            out += encoder.events(tail)
            with trio.CancelScope(shield=True):
                claim, relayed_tokens = await gateway.account_for(flight, pending)
                usage = await gateway.settle(flight, status=200, completion_claim=claim, relayed_tokens=relayed_tokens)
                stop_sequence = await self._matched_stop(flight, pending, flight.relayed_text, finish)
            outcome = "ok"
            await _send_body(send, b"".join(out + encoder.finish(_finish_for(events_seen, finish), usage, stop_sequence)), more=False)
        finally:
            if outcome != "ok":
                with trio.CancelScope(shield=True):
                    await self._settle_partial(flight, pending, outcome)

    async def _settle_partial(self, flight: Flight, pending: PendingRequest, outcome: str) -> None:
        """A stream that did not complete: stop the miner, charge only what was relayed."""
        gateway = self.gateway
        if not pending.finished:
            await gateway.pool.cancel(pending)
        status = {"buyer-gone": 499, "timeout": 504}.get(outcome, 502)
        if not flight.relayed_text:
            await gateway.release(flight)
            await gateway.log_outcome(flight, status=status, usage=None)
            return
        relayed = await trio.to_thread.run_sync(gateway.count_tokens, flight.model, flight.relayed_text)
        await gateway.settle(flight, status=status, completion_claim=None, relayed_tokens=relayed)


SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))


async def _send_body(send: Send, data: bytes, *, more: bool) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _send_json(send: Send, body: dict, *, request_id: str) -> None:
    payload = orjson.dumps(body)
    rid = request_id.encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"x-request-id", rid), (b"request-id", rid)]})
    await _send_body(send, payload, more=False)


class Handlers:
    """The buyer API's other routes over one `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def count_tokens(self, request: Request) -> Response:
        gateway = self.gateway
        request_id = uuid.uuid4().hex
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
            return OPENAI.error_response(GatewayError("not_found", f"The model `{name}` does not exist", param="model"), uuid.uuid4().hex)
        return JSONResponse(openai_api.model_body((name, self.gateway.created, "engy")))

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "miners": len(self.gateway.pool.legs)})


async def _wait_changed(pending: PendingRequest, timeout_s: float) -> bool:
    with trio.move_on_after(timeout_s):
        await pending.changed.wait()
        return True
    return False


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
