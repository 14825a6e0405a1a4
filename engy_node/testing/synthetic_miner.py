"""A miner that answers instantly from a script, over the real link and protocol.

It runs the real `GatewayLink` (legs, hello, heartbeats, cancel) with a handler that skips the
model: it streams a fixed answer, or an answer chosen per request, as fast as the websocket takes
it (coalescing chunks as the real miner does), and returns a commitment-shaped object whose token ids are the answer's tokenisation. Used
where the gateway itself is under test: its overhead benchmark (so generation time does not hide
it) and tests of paths a small real model will not produce on demand (tool calls, reasoning,
failing mid-stream).

Its proofs are not real TOPLOC proofs — verification is not what it stands in for. So with GEMM
audits: a link made with `gemm_audits` announces the feature, hands `Script.gemm_commitment`
back under a rid of its own when a request asks, and answers a challenge on that rid with
placeholder openings (one per pick, no data, no path), so the gateway's relay can be tested
without a model.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
import uuid
from collections.abc import Callable

import trio

from engy_node.miner.link import GatewayLink, Identity, LinkSettings
from engy_node.miner.serving import STREAM_COALESCE_S, Send
from engy_node.model_output import ReasoningDelta, TextDelta, ToolCall, parse_output
from engy_node.protocol.gemm import FEATURE_GEMM, GemmChallenge, GemmOpenings
from engy_node.protocol.miner import OUR_FEATURES, Capacity, Chunk, Response, Serve
from engy_node.served_model import ServedModel


@dataclasses.dataclass
class Script:
    text: str = "Hello from the synthetic miner."
    chunk_chars: int = 8
    """Characters per streamed chunk."""
    delay_s: float = 0.0
    """Pause before each chunk (0: as fast as possible)."""
    coalesce_s: float = STREAM_COALESCE_S
    """Text produced within this long after a chunk frame waits for the next one, as the real
    miner's (chunks are coalesced, ≈50 ms: docs/protocol.md); 0 sends every chunk as its own frame."""
    fail_after_chunks: int | None = None
    """Raise mid-stream after this many chunks: the leg drops, as a crashed miner's would."""
    finish_reason: str = "stop"
    in_parts: bool = False
    """Send the answer in parts, as the newest public miner does: reasoning as
    `reasoning_content`, each tool call whole in `tool_calls`, the text alone as `content` (null
    in the final message when there is none), read out of `text` by the gateway's own parser."""
    refuse: tuple[str, int] | None = None
    """Answer with this error (message, HTTP status) instead, as a miner does when its model
    server refuses the request (a 4xx: the request was at fault)."""
    cached_tokens: int = 0
    """Prompt tokens its serve reports read from its prefix cache."""
    lie_in_parts: Callable[[dict], dict] | None = None
    """With `in_parts`: what to make of the final message before it goes (a miner whose parts
    say something its tokens do not)."""
    gemm_commitment: dict | None = None
    """The activation commitment to answer a request that asks for one with (its rid added)."""


class MinerCrashed(Exception):
    pass


class SyntheticHandler:
    def __init__(self, model: ServedModel, script: Callable[[Serve], Script]) -> None:
        self.model = model
        self.script = script
        self.served: list[Serve] = []
        self._answer_ids: dict[str, list[int]] = {}
        self.challenges: list[GemmChallenge] = []
        self._committed: set[str] = set()
        """The rids of the answers it committed, which a challenge may name."""

    async def open_gemm(self, challenge: GemmChallenge, *, timeout_s: float) -> GemmOpenings:
        """A placeholder opening per pick of an answer it committed (`GatewayLink.open_gemm`)."""
        self.challenges.append(challenge)
        if challenge.rid not in self._committed:
            return GemmOpenings(challenge.challenge_id, error=f"no record under rid {challenge.rid}")
        openings = tuple({**pick.to_wire(), "data": "", "path": []} for pick in challenge.picks)
        return GemmOpenings(challenge.challenge_id, openings)

    async def handle(self, frame: Serve, send: Send) -> None:
        self.served.append(frame)
        script = self.script(frame)
        prompt_ids = self.model.render_prompt(frame.request)
        text = script.text
        if script.refuse is not None:
            message, status = script.refuse
            await send(
                Response(
                    corr_id=frame.corr_id,
                    request_id=frame.request.engy_request_id,
                    commitment={},
                    output={},
                    error=message,
                    error_type="ServeError",
                    error_status=status,
                )
            )
            return
        if script.in_parts:
            await self._send_in_parts(frame, script, prompt_ids, send)
            return
        if frame.stream:
            unsent, last_sent = "", -math.inf
            for index in range(0, len(text), script.chunk_chars):
                if script.fail_after_chunks is not None and index // script.chunk_chars >= script.fail_after_chunks:
                    raise MinerCrashed("scripted crash")
                if script.delay_s:
                    await trio.sleep(script.delay_s)
                unsent += text[index : index + script.chunk_chars]
                if time.perf_counter() - last_sent >= script.coalesce_s:
                    await send(Chunk(corr_id=frame.corr_id, content=unsent))
                    unsent, last_sent = "", time.perf_counter()
            if unsent:
                await send(Chunk(corr_id=frame.corr_id, content=unsent))
        await send(
            self._response(frame, script, prompt_ids, {"role": "assistant", "content": text}, script.finish_reason)
        )

    async def _send_in_parts(self, frame: Serve, script: Script, prompt_ids: list[int], send: Send) -> None:
        events = parse_output(script.text, call_id_prefix=frame.corr_id[-8:], tools=frame.request.tools)
        reasoning = "".join(event.text for event in events if isinstance(event, ReasoningDelta))
        content = "".join(event.text for event in events if isinstance(event, TextDelta))
        calls = [
            {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": event.arguments},
            }
            for event in events
            if isinstance(event, ToolCall)
        ]
        if frame.stream:
            for event in events:
                if isinstance(event, ReasoningDelta):
                    await send(Chunk(corr_id=frame.corr_id, content="", reasoning=event.text))
                elif isinstance(event, TextDelta):
                    await send(Chunk(corr_id=frame.corr_id, content=event.text))
                else:
                    await send(Chunk(corr_id=frame.corr_id, content="", tool_calls=(calls[event.index],)))
        message = {
            "role": "assistant",
            "content": content or None,
            **({"reasoning_content": reasoning} if reasoning else {}),
            **({"tool_calls": [{k: v for k, v in call.items() if k != "index"} for call in calls]} if calls else {}),
        }
        if script.lie_in_parts is not None:
            message = script.lie_in_parts(message)
        await send(self._response(frame, script, prompt_ids, message, "tool_calls" if calls else script.finish_reason))

    def _response(
        self, frame: Serve, script: Script, prompt_ids: list[int], message: dict, finish_reason: str
    ) -> Response:
        text = script.text
        if text not in self._answer_ids:
            if len(self._answer_ids) >= 64:
                self._answer_ids.clear()
            # A real miner gets the ids from its engine; tokenising the script once keeps this
            # miner's cost per request out of the way of what it helps measure.
            self._answer_ids[text] = list(self.model.tokenizer.encode(text, add_special_tokens=False))
        output_ids = list(self._answer_ids[text])
        if script.finish_reason == "stop":
            eos = self.model.tokenizer.eos_token_id
            assert eos is not None, "a stopped answer ends with the tokenizer's EOS"
            output_ids.append(int(eos))
        commitment = {
            "model_root": self.model.model_root,
            "output_token_ids": output_ids,
            "toploc": {
                "proofs": [],
                "topk": 128,
                "decode_batching_size": 32,
                "skip_prefill": True,
                "n_tokens": len(output_ids),
                "prompt_ids": prompt_ids,
            },
        }
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output_ids),
            "total_tokens": len(prompt_ids) + len(output_ids),
            "prompt_tokens_details": {"cached_tokens": min(script.cached_tokens, len(prompt_ids))},
        }
        output = {"choices": [{"index": 0, "finish_reason": finish_reason, "message": message}], "usage": usage}
        gemm = None
        if frame.request.gemm_commitment and script.gemm_commitment is not None:
            rid = f"{frame.corr_id}-{uuid.uuid4().hex[:8]}"
            self._committed.add(rid)
            gemm = {**script.gemm_commitment, "rid": rid}
        return Response(
            corr_id=frame.corr_id,
            request_id=frame.request.engy_request_id,
            commitment=commitment,
            output=output,
            gemm_commitment=gemm,
        )


def synthetic_link(
    *,
    gateway_url: str,
    model: ServedModel,
    identity: Identity,
    handler: SyntheticHandler,
    http,
    max_inflight: int = 256,
    settings: LinkSettings = LinkSettings(),
    worker_name: str = "synthetic",
    gemm_audits: bool = False,
) -> GatewayLink:
    """`gemm_audits`: announce `FEATURE_GEMM` and answer challenges (`SyntheticHandler.open_gemm`)."""
    spec = model.spec
    return GatewayLink(
        gateway_url=gateway_url,
        identity=identity,
        http=http,
        handler=handler,
        settings=settings,
        features=OUR_FEATURES | {FEATURE_GEMM} if gemm_audits else OUR_FEATURES,
        open_gemm=handler.open_gemm if gemm_audits else None,
        rng=random.Random(0),
        limits=Capacity(
            max_inflight=0,
            max_inflight_total=max_inflight,
            max_input_tokens=spec.max_input_tokens,
            max_output_tokens=spec.max_output_tokens,
            max_request_s=spec.max_request_s,
        ),
        hello={
            "model": spec.id,
            "model_root": model.model_root,
            "hw": {"host": worker_name, "gpu_count": 0},
            "versions": {"engy_node": "synthetic"},
            "worker_name": worker_name,
            "worker_id": uuid.uuid4().hex,
        },
    )
