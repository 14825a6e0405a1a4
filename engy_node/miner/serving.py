"""Serve one routed request: chat template → /generate → TOPLOC commitment → response frame.

This is the miner's unit of work, independent of how the request arrived. It tokenises locally
with the checkpoint's own tokenizer and chat template (the gateway checks `prompt_ids` against its
own rendering, so the miner must not trust the server to tokenise), generates through the shared
serve client (chunked, abortable), streams deltas coalesced to ~50 ms when the gateway asked for
streaming, and builds the proof off the event loop. The answer goes out in the parts the newest
public miner sends (`model_output`): reasoning as `reasoning_content`, tool calls whole, the text
alone as `content`; a model that writes no such markup (SmolLM2) sends its text as it was.

Failure posture: a request that fails ends with a `response` carrying `error` and no commitment;
it never takes the leg down. A cancelled request (the buyer hung up) sends nothing more: the
cancellation propagates, and the serve client aborts the generation on the server.

What is relayed while streaming is always the start of the final answer's parts: the tail that
could still turn into a stop string or a tag, or that ends in an incomplete UTF-8 sequence, is held
back until it resolves. That keeps the gateway's check — the commitment's tokens, read into parts,
say exactly what was relayed — true for honest miners.

A serve request may ask for a GEMM audit's activation commitment (`engy_node.miner.gemm_audit`):
when this miner's serves can commit, the answer is generated under a rid of its own (the
`corr_id` plus a random suffix: corr_ids repeat across gateways and restarts, a record must not)
and its response carries the commitment with that rid; the handler remembers which serve holds
it, for the challenge (`open_gemm`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from engy_node import proof
from engy_node.miner.gemm_audit import GemmRecords, commit_decision, open_challenge
from engy_node.model_output import OutputEvent, OutputParser, ReasoningDelta, TextDelta, ToolCall, parse_output
from engy_node.protocol.gemm import GemmChallenge, GemmOpenings
from engy_node.protocol.miner import SEEDED_TOP_K, Chunk, MinerFrame, Response, Serve, ServeRequest
from engy_node.serve.client import GemmSupport, GenerateResult, ServeClient, ServeError
from engy_node.serve.sampling import find_stop, stop_holdback
from engy_node.served_model import ServedModel

log = logging.getLogger("engy.miner.serving")

STREAM_COALESCE_S = 0.05
"""Streamed deltas are sent at most this often (≈50 ms, docs/protocol.md), so a fast model does not send
one websocket frame per token."""
REPLACEMENT_CHARACTER = "\ufffd"


def sampling_params(request: ServeRequest) -> dict[str, Any]:
    """sglang sampling_params for a routed request; greedy unless the buyer asked otherwise."""
    sampling = request.sampling
    # Every knob is explicit: sglang fills omitted ones from the model's generation_config (a
    # top_k of 20, say), and a verifier replaying a seeded draw must know what was applied.
    params: dict[str, Any] = {
        "temperature": 0.0 if sampling.temperature is None else sampling.temperature,
        "top_p": 1.0 if sampling.top_p is None else sampling.top_p,
        "top_k": -1,
        "min_p": 0.0,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
        if not sampling.greedy:
            params["top_k"] = SEEDED_TOP_K
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    return params


def final_text(model: ServedModel, result: GenerateResult, stops: Sequence[str]) -> str:
    """The completion text: output ids decoded without the matched EOS/stop token, cut at a
    matched stop string."""
    ids = list(result.output_ids)
    matched = result.finish_reason.get("matched")
    if result.finish_reason.get("type") == "stop" and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = model.decode(ids)
    match = find_stop(text, stops) if stops else None
    return text[: match.index] if match is not None else text


def streamable_prefix(text: str, stops: Sequence[str]) -> str:
    """The part of `text` that can be relayed now without ever being taken back."""
    if stops:
        match = find_stop(text, stops)
        if match is not None:
            return text[: match.index]
        text = text[: len(text) - stop_holdback(text, stops)]
    return text.rstrip(REPLACEMENT_CHARACTER)


def finish_reason_for_buyer(finish: dict[str, Any]) -> str:
    return "length" if finish.get("type") == "length" else "stop"


def _call(event: ToolCall) -> dict[str, Any]:
    return {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": event.arguments}}


def chunk_of(corr_id: str, events: Sequence[OutputEvent]) -> Chunk:
    """A streamed chunk carrying events in the newest public protocol's parts: reasoning as
    `reasoning_content`, text as `content`, each tool call whole."""
    return Chunk(
        corr_id=corr_id,
        content="".join(e.text for e in events if isinstance(e, TextDelta)),
        reasoning="".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        tool_calls=tuple({"index": e.index, **_call(e)} for e in events if isinstance(e, ToolCall)),
    )


def message_of(events: Sequence[OutputEvent]) -> dict[str, Any]:
    """The final message in parts, as the newest public miner sends it: the text as `content`
    (null when an answer has only reasoning or tool calls), `reasoning_content`, `tool_calls`."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [_call(e) for e in events if isinstance(e, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if reasoning or calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


@dataclasses.dataclass
class RequestOutcome:
    """What happened to one request, for metrics and the hub."""

    ok: bool
    error_class: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    proof_s: float = 0.0


Send = Callable[[MinerFrame], Awaitable[None]]


class RequestHandler:
    """Turns `serve` frames into `chunk`s and a `response`."""

    def __init__(
        self,
        *,
        model: ServedModel,
        serve: Callable[[], ServeClient],
        chunk_tokens: int = 4096,
        proof_limiter: trio.CapacityLimiter | None = None,
        on_outcome: Callable[[RequestOutcome], None] | None = None,
        gemm: GemmSupport | None = None,
    ) -> None:
        self.model = model
        self.serve = serve
        self.chunk_tokens = chunk_tokens
        self.proof_limiter = proof_limiter or trio.CapacityLimiter(2)
        self.on_outcome = on_outcome
        self.gemm = gemm
        """What activation commitments every serve can make; None when not all can, and then
        a request's `gemm_commitment` is ignored."""
        self.gemm_records = GemmRecords()

    async def handle(self, frame: Serve, send: Send) -> None:
        """Serve `frame` and send its frames. Cancellation: nothing more is sent; the generation
        is aborted on the model server by the serve client."""
        request = frame.request
        outcome = RequestOutcome(ok=False)
        started = time.perf_counter()
        try:
            response = await self._serve(frame, send, outcome, started)
        except ServeError as error:
            outcome.error_class = "serve"
            # The model server's 4xx (a prompt past its context) is the request's fault, and the
            # gateway passes it to the buyer with its status; anything else is the miner's.
            fault = error.status if error.status is not None and 400 <= error.status < 500 else None
            response = Response(
                corr_id=frame.corr_id,
                request_id=request.engy_request_id,
                commitment=None,
                output=None,
                error=f"model server error: {error}",
                error_type="ServeError",
                error_status=fault or 500,
            )
        except (ValueError, TypeError, KeyError) as error:
            # Broad on purpose within these types: a template or tokenizer rejecting the input is
            # the request's problem, reported to the gateway, not a miner crash.
            outcome.error_class = "request"
            response = Response(
                corr_id=frame.corr_id,
                request_id=request.engy_request_id,
                commitment=None,
                output=None,
                error=f"bad request: {type(error).__name__}: {error}",
                error_type=type(error).__name__,
                error_status=400,
            )
        finally:
            if self.on_outcome is not None:
                self.on_outcome(outcome)
        await send(response)

    async def _serve(self, frame: Serve, send: Send, outcome: RequestOutcome, started: float) -> Response:
        request = frame.request
        model = self.model
        prompt_ids = await trio.to_thread.run_sync(model.render_prompt, request)
        max_tokens = request.max_tokens if request.max_tokens is not None else model.spec.max_output_tokens
        stops = request.sampling.stop
        relayed = ""
        last_sent = 0.0
        parts = OutputParser(call_id_prefix=frame.corr_id[-12:], tools=request.tools)

        async def relay(text: str, *, final: bool = False) -> None:
            nonlocal relayed, last_sent
            ready = streamable_prefix(text, stops)
            events = []
            if len(ready) > len(relayed) and ready.startswith(relayed):
                events = parts.feed(ready[len(relayed) :])
                relayed = ready
            if final:
                events += parts.finish()
            if events:
                await send(chunk_of(frame.corr_id, events))
                last_sent = time.perf_counter()

        async def on_progress(ids: list[int], _server_text: str) -> None:
            if time.perf_counter() - last_sent >= STREAM_COALESCE_S:
                await relay(await trio.to_thread.run_sync(model.decode, ids))

        gemm = commit_decision(
            asked=request.gemm_commitment, support=self.gemm, prompt_tokens=len(prompt_ids), max_new_tokens=max_tokens
        )
        if request.gemm_commitment and not gemm.commit:
            log.info("request %s: answered without a GEMM commitment: %s", request.engy_request_id, gemm.reason)
        serve = self.serve()
        result = await serve.generate(
            prompt_ids,
            sampling_params(request),
            max_new_tokens=max_tokens,
            rid_prefix=f"engy-{frame.corr_id}-{secrets.token_hex(6)}" if gemm.commit else f"engy-{frame.corr_id}",
            return_gemm_commitment=gemm.commit,
            stream=frame.stream,
            chunk_tokens=self.chunk_tokens,
            on_progress=on_progress if frame.stream else None,
        )
        if result.finish_reason.get("type") == "abort":
            raise ServeError(f"generation aborted by the model server: {result.finish_reason.get('message')}")
        text = await trio.to_thread.run_sync(final_text, model, result, stops)
        if frame.stream:
            await relay(text, final=True)
            if relayed != text:
                log.warning(
                    "request %s: relayed text diverged from the final decode; the gateway will see a mismatch",
                    request.engy_request_id,
                )

        proof_started = time.perf_counter()
        commitment = await trio.to_thread.run_sync(self._commit, prompt_ids, result, limiter=self.proof_limiter)
        outcome.proof_s = time.perf_counter() - proof_started

        elapsed = time.perf_counter() - started
        outcome.ok = True
        outcome.prompt_tokens = len(prompt_ids)
        outcome.completion_tokens = result.completion_tokens
        outcome.ttft_s = result.first_token_s
        if result.first_token_s is not None and result.completion_tokens > 1:
            outcome.tpot_s = (elapsed - outcome.proof_s - result.first_token_s) / (result.completion_tokens - 1)
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": result.completion_tokens,
            "total_tokens": len(prompt_ids) + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }
        message = message_of(parse_output(text, call_id_prefix=frame.corr_id[-12:], tools=request.tools))
        finish = finish_reason_for_buyer(result.finish_reason)
        output = {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls" if message.get("tool_calls") and finish == "stop" else finish,
                    "message": message,
                }
            ],
            "usage": usage,
        }
        gemm_commitment = None
        if result.gemm_commitment is not None and result.gemm_rid is not None:
            self.gemm_records.remember(result.gemm_rid, serve)
            gemm_commitment = {**result.gemm_commitment, "rid": result.gemm_rid}
        elif gemm.commit:
            log.warning(
                "request %s: the model server returned no gemm_commitment though asked; answered without one",
                request.engy_request_id,
            )
        return Response(
            corr_id=frame.corr_id,
            request_id=request.engy_request_id,
            commitment=commitment.to_wire(),
            output=output,
            gemm_commitment=gemm_commitment,
        )

    async def open_gemm(self, challenge: GemmChallenge, *, timeout_s: float) -> GemmOpenings:
        """The answer to a GEMM challenge, from the serve that committed its rid (an rid this
        handler no longer remembers is asked of the next serve, which says whether it holds it).
        Bounded by `timeout_s`; never raises for the serve."""
        if self.gemm is None:
            return GemmOpenings(
                challenge.challenge_id,
                error="this miner's model server cannot commit its activations (it did not announce gemm-audit)",
            )
        serve = self.gemm_records.serve_of(challenge.rid) or self.serve()
        return await open_challenge(serve, challenge, timeout_s=timeout_s)

    def _commit(self, prompt_ids: list[int], result: GenerateResult) -> proof.Commitment:
        import numpy as np
        import torch

        rows = torch.from_numpy(np.asarray(result.hidden_rows, dtype=np.float32))
        return proof.build_commitment(
            model_root=self.model.model_root,
            prompt_ids=prompt_ids,
            output_ids=result.output_ids,
            rows=rows,
            params=self.model.spec.proof,
        )
