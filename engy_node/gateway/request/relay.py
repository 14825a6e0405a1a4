"""Between dispatch and the last byte: one buyer API's chat route, relaying a miner's answer.

This is the gateway's hot path, so it speaks ASGI itself instead of going through Starlette's
`Request` and `StreamingResponse`: one watch for the buyer hanging up spans the whole response
(the wait for the miner's first output, then the relay; under the gateway's own server it is a
callback, not a task: `asgi.watch_disconnect`), and the relay writes straight to the server, in
as few sends as the answer allows. A stream commits status 200 only once the miner produced
output (up to `first_byte_wait_s`), so a miner failing before that, or sending nothing by then,
is retried on another (`Gateway.first_output`) and errors keep their codes; the buyer sees
nothing of an attempt given up.

Text goes through `OutputParser` (reasoning and tool calls) to the API's encoder, with keepalives
while the miner is quiet. A buyer who hangs up gets the miner cancelled at once, and is charged
for what was relayed. What differs between the OpenAI and Anthropic APIs is behind `Api`.

Why this size: a whole answer and a stream share their steps (the wait for the miner, the
accounting, the settlement, the in-band finish) and the two APIs' differences, so splitting them
apart would split one request's path across modules that each call back into the other.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import orjson
import trio
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from engy_node.asgi import Receive, Send, watch_disconnect
from engy_node.gateway import limits
from engy_node.gateway.api import anthropic_api, cost_fields, openai_api
from engy_node.gateway.api.chat import ApiName, ChatRequest, FinishReason, GatewayError, Usage
from engy_node.gateway.api.cost_fields import COST_HEADER
from engy_node.gateway.billing.costs import cost_usd, usage_cost
from engy_node.gateway.request.corrections import (
    ReplacementHold,
    StopScanner,
    StructuredParts,
    corrected_finish,
    presentation_match,
)
from engy_node.gateway.request.flight import Accounting, Flight
from engy_node.gateway.request.lifecycle import Gateway
from engy_node.gateway.routing.fallbacks import pick_model
from engy_node.gateway.routing.pool import PendingRequest
from engy_node.model_output import OutputEvent, OutputParser, ReasoningDelta, TextDelta, ToolCall
from engy_node.protocol.miner import Chunk

log = logging.getLogger("engy.gateway")


def _final_content(flight: Flight, pending: PendingRequest) -> tuple[str, str]:
    """(content, finish_reason) from the miner's response; its reasoning and tool calls, when
    its message carries them apart from the text, go to `flight.miner_parts`."""
    output = pending.response.output if pending.response is not None else None
    choice = ((output or {}).get("choices") or [{}])[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    if message.get("reasoning_content") or message.get("tool_calls"):
        if flight.miner_parts is None:
            flight.miner_parts = StructuredParts()
        flight.miner_parts.settle(message)
    content = message.get("content")
    finish = choice.get("finish_reason")
    return (content if isinstance(content, str) else ""), ("length" if finish == "length" else "stop")


def _answer_events(flight: Flight, proven_text: str | None) -> list[OutputEvent]:
    """The events a buyer is given for a whole answer: the proven raw text read into parts; with
    no proof, the miner's own text read so, after its reasoning and before its tool calls when
    it sent those apart."""
    parser = OutputParser(call_id_prefix=flight.request_id[-12:], tools=flight.chat.tools)
    events = parser.feed(flight.miner_text if proven_text is None else proven_text) + parser.finish()
    parts = flight.miner_parts
    if parts is None or proven_text is not None:
        return events
    calls = [
        ToolCall(index=i, id=f"call_{flight.request_id[-12:]}_{i}", name=name, arguments=arguments or "{}")
        for i, (name, arguments) in enumerate(parts.tool_calls)
        if name
    ]
    return ([ReasoningDelta(parts.reasoning)] if parts.reasoning else []) + events + calls


def _finish_for(events: list[OutputEvent], finish: FinishReason) -> FinishReason:
    return "tool_calls" if any(isinstance(event, ToolCall) for event in events) else finish


class Api(abc.ABC):
    """What differs between the two buyer APIs; the flow in `ChatEndpoint` is shared."""

    name: ApiName

    def api_key(self, headers: Headers) -> str | None:
        header = headers.get("authorization", "")
        return header[7:].strip() if header.lower().startswith("bearer ") else None

    @abc.abstractmethod
    def parse(self, body: dict, gateway: Gateway) -> ChatRequest: ...

    @abc.abstractmethod
    def error_response(self, err: GatewayError, request_id: str) -> JSONResponse: ...

    @abc.abstractmethod
    def body(
        self, flight: Flight, events: list[OutputEvent], finish: FinishReason, usage: Usage, stop_sequence: str | None
    ) -> dict: ...

    @abc.abstractmethod
    def encoder(self, flight: Flight) -> _Encoder: ...


class _OpenAi(Api):
    name = "openai"

    def parse(self, body: dict, gateway: Gateway) -> ChatRequest:
        return openai_api.parse_chat_request(
            body, known_models=set(gateway.models), max_output_tokens_for=gateway.max_output_tokens_for
        )

    def error_response(self, err: GatewayError, request_id: str) -> JSONResponse:
        headers = {**openai_api.error_headers(err), "x-request-id": request_id}
        return JSONResponse(openai_api.error_body(err, request_id), status_code=err.status, headers=headers)

    def body(
        self, flight: Flight, events: list[OutputEvent], finish: FinishReason, usage: Usage, stop_sequence: str | None
    ) -> dict:
        body = openai_api.completion_body(
            request_id=f"chatcmpl-{flight.request_id}",
            created=flight.created,
            model=flight.chat.model,
            events=events,
            finish=finish,
            usage=usage,
        )
        if (cost := _asked_cost(flight, usage)) is not None:
            body["usage"].update(cost)
        return body

    def encoder(self, flight: Flight) -> _Encoder:
        encoder = openai_api.ChunkEncoder(
            f"chatcmpl-{flight.request_id}", flight.created, flight.chat.model, flight.chat.include_usage
        )
        return _Encoder(
            start=encoder.start,
            events=encoder.events,
            keepalive=encoder.keepalive,
            error=encoder.error,
            finish=lambda finish, usage, stop_sequence: encoder.finish(finish, usage, _asked_cost(flight, usage)),
        )


def _asked_cost(flight: Flight, usage: Usage) -> dict | None:
    """`usage.cost` and its breakdown, when the buyer asked for them (`cost_fields`)."""
    if not flight.chat.include_cost or flight.charged is None:
        return None
    return usage_cost(flight.model.spec.price, usage, charged=flight.charged)


class _Anthropic(Api):
    name = "anthropic"

    def api_key(self, headers: Headers) -> str | None:
        return headers.get("x-api-key") or super().api_key(headers)

    def parse(self, body: dict, gateway: Gateway) -> ChatRequest:
        return anthropic_api.parse_messages_request(
            body, known_models=set(gateway.models), max_output_tokens_for=gateway.max_output_tokens_for
        )

    def error_response(self, err: GatewayError, request_id: str) -> JSONResponse:
        headers = {**anthropic_api.error_headers(err), "request-id": request_id, "x-request-id": request_id}
        return JSONResponse(
            anthropic_api.error_body(err, request_id), status_code=anthropic_api.status_for(err), headers=headers
        )

    def body(
        self, flight: Flight, events: list[OutputEvent], finish: FinishReason, usage: Usage, stop_sequence: str | None
    ) -> dict:
        return anthropic_api.message_body(
            message_id=f"msg_{flight.request_id}",
            model=flight.chat.model,
            events=events,
            finish=finish,
            stop_sequence=stop_sequence,
            usage=usage,
        )

    def encoder(self, flight: Flight) -> _Encoder:
        encoder = anthropic_api.EventEncoder(f"msg_{flight.request_id}", flight.chat.model)
        prompt = len(flight.prompt_ids)
        return _Encoder(
            start=lambda: encoder.start(Usage(prompt_tokens=prompt, completion_tokens=1)),
            events=encoder.events,
            keepalive=encoder.ping,
            error=encoder.error,
            finish=lambda finish, usage, stop_sequence: encoder.finish(
                finish, stop_sequence=stop_sequence, usage=usage
            ),
        )


@dataclasses.dataclass(frozen=True)
class _Encoder:
    start: Callable[[], list[bytes]]
    events: Callable[[list[OutputEvent]], list[bytes]]
    keepalive: Callable[[], list[bytes]]
    error: Callable[[GatewayError], list[bytes]]
    finish: Callable[[FinishReason, Usage, str | None], list[bytes]]


OPENAI, ANTHROPIC = _OpenAi(), _Anthropic()


class ChatEndpoint:
    """One buyer API's chat route (`/v1/chat/completions` or `/v1/messages`) as a raw ASGI app.

    This is the gateway's hot path, so it speaks ASGI itself instead of going through Starlette's
    `Request` and `StreamingResponse`: one watch for the buyer hanging up spans the whole
    response (the wait for the miner's first output, then the relay) where Starlette would start
    a task per phase, and the relay writes straight to the server without a task group around it.
    """

    def __init__(self, gateway: Gateway, api: Api) -> None:
        self.gateway = gateway
        self.api = api

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        gateway, api = self.gateway, self.api
        request_id = None
        try:
            account = await gateway.authenticate(api.api_key(Headers(scope=scope)), api.name)
            chat = api.parse(await gateway.read_body(receive, account), gateway)
            if cost_fields.asked_in_headers(Headers(scope=scope)):
                chat = dataclasses.replace(chat, include_cost=True)
            chat = pick_model(chat, gateway.pool, gateway.eligible, account.models)
            with gateway.serving():
                async with watch_disconnect(receive, scope):
                    flight = await gateway.begin(api.name, account, chat)
                    request_id = flight.request_id
                    flight.key_id = account.key_id
                    if flight.hold.rate is not None:
                        send = _with_headers(send, limits.response_headers(flight.hold.rate, api.name))
                    if chat.stream:
                        await self._stream(flight, send)
                    else:
                        await self._complete(flight, send)
        except GatewayError as err:
            # Refused before it had a flight (and its id): the answer still names a request id.
            request_id = request_id or gateway.new_id()
            # What a buyer sent wrong is the buyer's to read in the answer: logging each one would
            # let a client flood the log with refusals as cheap as a 402.
            if err.kind in BUYER_CAUSED:
                log.debug("request %s (%s) refused: %s (%s)", request_id, api.name, err.kind, err)
            else:
                log.info("request %s (%s) failed: %s (%s)", request_id, api.name, err.kind, err)
            await api.error_response(err, request_id)(scope, receive, send)

    async def run_probe(self, flight: Flight) -> None:
        """Serve a probe (`Gateway.begin_probe`) exactly as a buyer's request from dispatch on;
        the answer goes nowhere. Its outcome is in the request log, like any request's."""

        async def discard(message: MutableMapping[str, Any]) -> None:
            return None

        try:
            with self.gateway.serving():
                if flight.chat.stream:
                    await self._stream(flight, discard)
                else:
                    await self._complete(flight, discard)
        except GatewayError as err:
            log.info("probe %s to %s: %s (%s)", flight.request_id, flight.target, err.kind, err)

    async def _complete(self, flight: Flight, send: Send) -> None:
        """A non-streamed answer. Every way out before settling returns the whole hold."""
        gateway = self.gateway
        deadline_s = flight.model.spec.max_request_s
        settled = False
        try:
            pending = await gateway.first_output(flight, wait_s=deadline_s)
            with trio.move_on_after(gateway.deadline(flight) - gateway.monotonic()):
                while not pending.finished:
                    if gateway.cut_off:
                        raise gateway.shutting_down()
                    await pending.changed.wait()
            if not pending.finished:
                await gateway.give_up(flight, status=504)
                raise GatewayError("timeout", f"the miner did not finish within {deadline_s} s; try again")
            if pending.lost is not None or pending.response is None or pending.response.error is not None:
                reason = pending.lost or (pending.response.error_text if pending.response else "no response")
                await gateway.accountant.log_outcome(flight, status=502, usage=None)
                raise GatewayError("upstream", f"the miner failed: {reason}")
            content, reported = _final_content(flight, pending)
            stops = StopScanner(flight.chat.sampling.stop)
            flight.miner_text = stops.feed(content) + stops.finish()
            flight.first_output_at = flight.first_output_at or gateway.monotonic()
            accounting = await gateway.accountant.account_for(flight, pending, cut_at=stops.matched)
            if accounting.refused is not None:
                await gateway.accountant.log_outcome(flight, status=502, usage=None)
                raise GatewayError("upstream", _REFUSED[accounting.refused])
            flight.relayed_text = flight.miner_text if accounting.proven_text is None else accounting.proven_text
            events = _answer_events(flight, accounting.proven_text)
            usage = gateway.accountant.billable(
                flight, completion_claim=accounting.claim, relayed_tokens=accounting.relayed_tokens
            )
            usage = dataclasses.replace(
                usage, reasoning_tokens=await gateway.accountant.reasoning_tokens(flight, accounting)
            )
            finish, stop_sequence = self._finish(flight, stops, accounting, usage, reported)
            finish = _finish_for(events, finish)
            await gateway.accountant.charge(flight, usage, status=200, finish=finish)
            settled = True
        finally:
            if not settled:
                await gateway.abandon(flight)
        body = self.api.body(flight, events, finish, usage, stop_sequence)
        await _send_json(send, body, request_id=flight.request_id, model=flight.chat.model, charged=flight.charged)

    def _finish(
        self, flight: Flight, stops: StopScanner, accounting: Accounting, usage: Usage, reported: str
    ) -> tuple[FinishReason, str | None]:
        """(finish reason, the stop string that ended the answer) as they really were, whatever
        the miner reported (`corrections`)."""
        finish = corrected_finish(
            reported=reported,
            completion_tokens=usage.completion_tokens,
            max_tokens=flight.chat.max_tokens,
            ended_by_end_token=flight.model.ends_answer(accounting.output_ids or ()),
            stop_matched=stops.matched is not None or accounting.stop is not None,
        )
        return finish, accounting.stop if finish == "stop" else None

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
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    *SSE_HEADERS,
                    (b"x-request-id", request_id),
                    (b"request-id", request_id),
                    (b"x-engy-model", flight.chat.model.encode()),
                ],
            }
        )
        await self._relay(flight, pending, send)

    async def _relay(self, flight: Flight, pending: PendingRequest, send: Send) -> None:
        """Everything after status 200: relay, then finish in-band. A buyer hanging up cancels
        this; whatever the way out short of the end, the miner is stopped and only what was
        relayed is charged. A stop string the miner ignored ends the answer here: the stream
        finishes as if the miner had stopped, and the miner goes on to its commitment, which the
        audit waits for (`Accountant.account_for_cut`). The buyer is never sent a U+FFFD the miner
        streamed for an incomplete character (`ReplacementHold`), and at the end is sent what the
        miner's text lacked of the proven text (a held-back tail)."""
        gateway = self.gateway
        encoder = self.api.encoder(flight)
        parser = OutputParser(call_id_prefix=flight.request_id[-12:], tools=flight.chat.tools)
        stops = StopScanner(flight.chat.sampling.stop)
        replacements = ReplacementHold()
        received = ""
        events_seen: list[OutputEvent] = []
        # The model's limit from the first output, never past the request's deadline (a retried
        # request has spent part of it on the miners that stayed silent).
        deadline = min(gateway.monotonic() + flight.model.spec.max_request_s, gateway.deadline(flight))
        outcome = "buyer-gone"

        def send_text(text: str) -> list[bytes]:
            flight.relayed_text += text
            events = parser.feed(text)
            events_seen.extend(events)
            return encoder.events(events)

        def relay(text: str) -> list[bytes]:
            flight.miner_text += text
            return send_text(replacements.feed(text))

        def relay_parts(chunk: Chunk) -> list[bytes]:
            """A chunk of an answer sent in parts: its reasoning goes out as reasoning while no
            text has (every API puts reasoning first), its tool calls are kept for the end, when
            the proven text has them whole; its text is returned to go the way of any text."""
            parts = flight.miner_parts = flight.miner_parts or StructuredParts()
            parts.add_calls(chunk.tool_calls)
            if not chunk.reasoning:
                return []
            parts.reasoning += chunk.reasoning
            if flight.relayed_text:
                return []
            events: list[OutputEvent] = [ReasoningDelta(chunk.reasoning)]
            events_seen.extend(events)
            return encoder.events(events)

        try:
            # Everything ready at a wake-up goes out as one write: under load several chunks
            # arrive per wake-up, and each separate send costs the server a trip through its
            # stack. For the same reason what arrives with the end of the answer goes out with
            # the stream's last events, after settlement; only the first write (the 200's head
            # and the first output, `hypercorn_edges`) never waits for it.
            out = list(encoder.start())
            sent = False
            while stops.matched is None:
                while pending.chunks and stops.matched is None:
                    text = pending.chunks.popleft()
                    if isinstance(text, Chunk):
                        out += relay_parts(text)
                        text = text.content
                    flight.first_output_at = flight.first_output_at or gateway.monotonic()
                    received += text
                    out += relay(stops.feed(text))
                ended = pending.finished or stops.matched is not None
                if out and not (ended and sent):
                    await _send_body(send, b"".join(out), more=True)
                    out, sent = [], True
                    continue  # what came in while it was sent, or the end, is seen before waiting
                if ended:
                    break
                if gateway.monotonic() > deadline:
                    outcome = "timeout"
                    break
                if gateway.cut_off:
                    outcome = "shutdown"
                    break
                if not await _wait_changed(pending, gateway.settings.keepalive_s):
                    await _send_body(send, b"".join(encoder.keepalive()), more=True)
            if stops.matched is not None:
                reported = "stop"
            elif outcome == "shutdown":
                await _send_body(send, b"".join(out + encoder.error(gateway.shutting_down())), more=False)
                return
            elif (
                outcome == "timeout"
                or pending.lost is not None
                or pending.response is None
                or pending.response.error is not None
            ):
                outcome = "timeout" if outcome == "timeout" else "miner-failed"
                reason = (
                    "the miner did not finish in time"
                    if outcome == "timeout"
                    else pending.lost or (pending.response.error_text if pending.response else "no response")
                )
                error = GatewayError(
                    "timeout" if outcome == "timeout" else "upstream", f"the miner failed mid-stream: {reason}"
                )
                await _send_body(send, b"".join(out + encoder.error(error)), more=False)
                return
            else:
                content, reported = _final_content(flight, pending)
                if content.startswith(received) and len(content) > len(received):
                    out += relay(stops.feed(content[len(received) :]))
                out += relay(stops.finish())
            with trio.CancelScope(shield=True):
                if stops.matched is not None and not pending.finished:
                    accounting = await gateway.accountant.account_for_cut(flight, pending, cut_at=stops.matched)
                else:
                    accounting = await gateway.accountant.account_for(flight, pending, cut_at=stops.matched)
                if accounting.refused is not None:
                    await gateway.release(flight)
                    await gateway.accountant.log_outcome(flight, status=502, usage=None)
                    outcome = "refused"
                    await _send_body(
                        send,
                        b"".join(out + encoder.error(GatewayError("upstream", _REFUSED[accounting.refused]))),
                        more=False,
                    )
                    return
                if flight.miner_parts is None:
                    out += send_text(_missing(flight.relayed_text, accounting.proven_text or flight.miner_text))
                    tail = parser.finish()
                else:
                    tail = parser.finish() + self._rest_of_parts(flight, accounting, events_seen)
                events_seen += tail
                out += encoder.events(tail)
                usage = gateway.accountant.billable(
                    flight, completion_claim=accounting.claim, relayed_tokens=accounting.relayed_tokens
                )
                usage = dataclasses.replace(
                    usage, reasoning_tokens=await gateway.accountant.reasoning_tokens(flight, accounting)
                )
                finish, stop_sequence = self._finish(flight, stops, accounting, usage, reported)
                finish = _finish_for(events_seen, finish)
                await gateway.accountant.charge(flight, usage, status=200, finish=finish)
            outcome = "ok"
            await _send_body(send, b"".join(out + encoder.finish(finish, usage, stop_sequence)), more=False)
        finally:
            if outcome not in ("ok", "refused"):
                with trio.CancelScope(shield=True):
                    await self._settle_partial(flight, pending, outcome)

    @staticmethod
    def _rest_of_parts(flight: Flight, accounting: Accounting, events_seen: list[OutputEvent]) -> list[OutputEvent]:
        """For an answer sent in parts, what the buyer still lacks of the answer it is given (the
        proven text read into parts, or the miner's own parts without a proof): the reasoning's
        tail while no text has gone out, the text's tail, and every tool call."""
        answer = _answer_events(flight, accounting.proven_text)
        reasoning = "".join(event.text for event in answer if isinstance(event, ReasoningDelta))
        text = "".join(event.text for event in answer if isinstance(event, TextDelta))
        sent_reasoning = "".join(event.text for event in events_seen if isinstance(event, ReasoningDelta))
        rest: list[OutputEvent] = []
        if not flight.relayed_text and (more := _missing(sent_reasoning, reasoning)):
            rest.append(ReasoningDelta(more))
        if more := _missing(flight.relayed_text, text):
            flight.relayed_text += more
            rest.append(TextDelta(more))
        return rest + [event for event in answer if isinstance(event, ToolCall)]

    async def _settle_partial(self, flight: Flight, pending: PendingRequest, outcome: str) -> None:
        """A stream that did not complete: stop the miner, charge only what was relayed."""
        gateway = self.gateway
        if not pending.finished:
            await gateway.pool.cancel(pending)
        # A stream the gateway ended while shutting down says nothing about the miner: logged as
        # 499, the status settlement leaves out of a miner's acceptance, like a buyer's hang-up.
        status = {"buyer-gone": 499, "shutdown": 499, "timeout": 504}.get(outcome, 502)
        if not flight.relayed_text:
            await gateway.release(flight)
            await gateway.accountant.log_outcome(flight, status=status, usage=None)
            return
        relayed = await trio.to_thread.run_sync(gateway.accountant.encode, flight.model, flight.relayed_text)
        await gateway.accountant.settle(flight, status=status, completion_claim=None, relayed_tokens=len(relayed))


_REFUSED = {
    "prompt-mismatch": "the miner's answer failed verification (its proof covers another prompt); nothing is "
    "charged for it, retry the request",
    "output-mismatch": "the miner's answer failed verification (its text is not what it proved); nothing is "
    "charged for it, retry the request",
}


def _missing(relayed: str, answer: str) -> str:
    """What the buyer has not been sent of `answer` (the proven text, or the miner's own): the
    part past what the relayed text covers; nothing when the two differ in content."""
    if answer.startswith(relayed):  # nearly always, and at C speed: the match below is Python
        return answer[len(relayed) :]
    covered = presentation_match(relayed, answer)
    return "" if covered is None else answer[covered:]


BUYER_CAUSED = frozenset(
    {
        "authentication",
        "invalid_request",
        "not_found",
        "request_too_large",
        "billing",
        "request_timeout",
        "method_not_allowed",
        "unsupported_media_type",
    }
)

SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))


async def _send_body(send: Send, data: bytes, *, more: bool) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _send_json(send: Send, body: dict, *, request_id: str, model: str, charged: int | None = None) -> None:
    """A whole answer; `x-engy-model` names the model that served it (`models` fallbacks),
    `x-engy-cost-usd` what it cost (`charged` µUSD; None: nobody paid, a probe)."""
    payload = orjson.dumps(body)
    rid = request_id.encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"x-request-id", rid),
        (b"request-id", rid),
        (b"x-engy-model", model.encode()),
    ]
    if charged is not None:
        headers.append((COST_HEADER, cost_usd(charged).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await _send_body(send, payload, more=False)


def _with_headers(send: Send, headers: list[tuple[str, str]]) -> Send:
    """`send` with `headers` added to the response's start (a limited key's rate-limit headers):
    a wrapper only for such keys, so the others' answers pay nothing for it."""
    encoded = [(name.encode(), value.encode()) for name, value in headers]

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *encoded]}
        await send(message)

    return sending


async def _wait_changed(pending: PendingRequest, timeout_s: float) -> bool:
    with trio.move_on_after(timeout_s):
        await pending.changed.wait()
        return True
    return False
