"""The miner ↔ gateway websocket protocol (docs/protocol.md), compatible with the public SN53 gateway.

Frames are JSON text messages with a `type` field. This module is the one place their shapes are
declared: each frame is a frozen dataclass with `to_wire()`, and `parse_miner_frame` /
`parse_gateway_frame` turn a peer's text into those dataclasses.

**Liberal in what we accept, exact in what we send.** Peers we do not control speak this
protocol: the public one-file miner (0.4.4) sends `capacity.max_request_s` as a float (it applies
`float()` to the setting), repeats `capacity` in every heartbeat, describes its hardware with
strings (`hw.gpus = "4x NVIDIA GeForce RTX 4090"`), sends `versions: {}` and `inflight: 0`; the TEE
miner sends `error` as an object and `{}` for an absent commitment; the public gateway may put
OpenAI sampling fields directly in a serve request. So parsing coerces what has one obvious
meaning (an integral float where a count is due, a string or an object for `hw`, a missing
optional field), keeps unknown extra fields out of the way, and refuses only what it cannot read:
then `ProtocolError` names the field (`hello.capacity.max_inflight`) and the reason, which the
caller logs and sends back as the close reason. `to_wire()` always writes exact types.

Trust: a frame from the network is attacker-controlled. Parsing never raises anything but
`ProtocolError` (property-tested on arbitrary input). Size is the transport's to limit, before a
frame is assembled, let alone parsed: the gateway's miner endpoint refuses a frame larger than
`MAX_FRAME_BYTES`, derived below from the largest frame a miner can honestly send.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from engy_node.chat_template import RESERVED_VARIABLES
from engy_node.models import ModelSpec
from engy_node.protocol.fields import (
    ProtocolError,
    as_count,
    as_object,
    as_seconds,
    count_field,
    describe,
    text_field,
)
from engy_node.protocol.gemm import GemmChallenge, GemmOpenings, parse_gemm_commitment

PROTOCOL_VERSION = 1

FEATURE_SAMPLING = "sampling"
"""A miner that announces this in hello's `features` honours `sampling` (temperature, top_p,
seed); one that does not is taken to answer greedily, as the public miner does."""
FEATURE_SEEDED = "seeded-rank-sampling"
"""A miner that announces this samples deterministically from `sampling.seed` as sglang does with
`--enable-deterministic-inference` (the reference server always does), and always on sglang's
rank path (`SEEDED_TOP_K`), so a verifier can replay the one draw it made on the canonical logits
and judge a sampled answer as strictly as a greedy one. (Miners before 2026-12 announced
`seeded-sampling` and drew a request without top_p on whichever path its batch took; they are
judged by the statistical test, as a miner that cannot be replayed.)"""
SEEDED_TOP_K = 2**30 - 1
"""The top_k a seeded-sampling miner sends with every seeded request that has none: one below
sglang's whole-vocabulary sentinel (`TOP_K_ALL`, 2**30), so it masks nothing in any vocabulary,
yet it puts the request on sglang's rank path whatever else shares its batch. sglang picks the
path per batch (any request with a top-k, and a greedy one counts, sends the whole batch by
rank), so without it the verifier could not know which of two draws to replay."""
FEATURE_STOP = "stop"
FEATURE_TOOLS = "tools"
"""A miner that announces this renders `tools` into the prompt with the chat template; the public
miner renders each message's role and content only."""
OUR_FEATURES = frozenset({FEATURE_SAMPLING, FEATURE_STOP, FEATURE_TOOLS})
"""What this project's miner honours from a serve request."""
OPTIONAL_FEATURES = frozenset({FEATURE_SAMPLING, FEATURE_SEEDED, FEATURE_TOOLS})
"""What a request may need or want that the public miner does not do, and the gateway cannot
make up for (it applies stop strings itself), so routing prefers miners that announce them:
sampling and tools are needed to answer as asked, seeded sampling to verify a sampled answer as
strictly as a greedy one."""


CLOSE_REASON_MAX_BYTES = 123
"""RFC 6455: a close frame's reason fits in 123 bytes of UTF-8."""


def close_reason(text: str) -> str:
    """`text` cut to what a websocket close frame can carry."""
    return text.encode(errors="replace")[:CLOSE_REASON_MAX_BYTES].decode(errors="ignore")


# The largest frame a miner sends honestly is a `response` at the catalog's limits: its commitment
# holds the prompt's token ids (up to max_input_tokens) and the output's (up to
# max_output_tokens), each a JSON integer and a separator; one base64 proof of 2 + 2·topk bytes
# per decode_batching_size output tokens; and the answer's text, which stays under
# ANSWER_BYTES_PER_TOKEN per output token even JSON-escaped (a token is about 4 characters; the
# longest are runs of tens of spaces or dashes, and an escaped non-ASCII character takes 6-12
# bytes). For Qwen3.6-35B-A3B that is 4.4 MiB (229,376 + 32,768 token ids at 8 bytes, 1,024
# proofs of 348 bytes, 2 MiB of text). The live protocol allows 64 MiB either way (the newest
# public TEE miner raised its own limit to that after 1 MiB cut off prompts of ~156k tokens,
# and answers with images or long tool results grow as models do), so that is the limit, read
# as the frame arrives: a larger one closes its leg before it is buffered whole.
TOKEN_ID_BYTES = 8
"""A token id in a JSON list: up to 6 digits (the catalog's vocabularies have fewer than 10**6
entries) and the ", " Python's json module puts between items."""
ANSWER_BYTES_PER_TOKEN = 64
FRAME_ENVELOPE_BYTES = 16 * 1024
"""Keys, ids, model_root, usage, finish_reason and an error string around the lists and text."""


def largest_response_bytes(spec: ModelSpec) -> int:
    """An upper bound on the size of an honest `response` frame for a request at `spec`'s limits."""
    proof_bytes = 4 * math.ceil((2 + 2 * spec.proof.topk) / 3) + 3  # base64, quotes and ","
    proofs = math.ceil(spec.max_output_tokens / spec.proof.decode_batching_size) * proof_bytes
    token_ids = (spec.max_input_tokens + spec.max_output_tokens) * TOKEN_ID_BYTES
    return token_ids + proofs + spec.max_output_tokens * ANSWER_BYTES_PER_TOKEN + FRAME_ENVELOPE_BYTES


MAX_FRAME_BYTES = 64 * 1024 * 1024
"""The largest frame either side reads from the other (the live protocol's); a larger one closes
that leg with 1009."""


# ---- miner -> gateway ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    max_inflight: int
    """This leg's share of the miner's concurrency: the one number routing uses."""
    max_inflight_total: int
    max_input_tokens: int
    max_output_tokens: int
    max_request_s: int
    context_length: int | None = None
    """The serve's context window in tokens (TEE miners announce it): a longer prompt is never
    routed to it."""
    input_modalities: tuple[str, ...] = ()
    """What the serve takes besides text (`["text", "image"]`); empty: text only."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "max_inflight": self.max_inflight,
            "max_inflight_total": self.max_inflight_total,
            "max_input_tokens": self.max_input_tokens,
            "max_output_tokens": self.max_output_tokens,
            "max_request_s": self.max_request_s,
        }
        if self.context_length is not None:
            wire["context_length"] = self.context_length
        if self.input_modalities:
            wire["input_modalities"] = list(self.input_modalities)
        return wire

    @classmethod
    def parse(cls, raw: Any, where: str) -> Capacity:
        """Only `max_inflight` is required; the total defaults to it and an unstated limit to 0
        (not announced). A fractional `max_request_s` rounds up: it is a deadline. A zero
        `context_length` is none announced; modalities that are not strings are dropped."""
        where = f"{where}.capacity"
        raw = as_object(raw, where)
        max_inflight = count_field(raw, "max_inflight", where)
        seconds = raw.get("max_request_s")
        modalities = raw.get("input_modalities")
        return cls(
            max_inflight=max_inflight,
            max_inflight_total=count_field(raw, "max_inflight_total", where, default=max_inflight),
            max_input_tokens=count_field(raw, "max_input_tokens", where, default=0),
            max_output_tokens=count_field(raw, "max_output_tokens", where, default=0),
            max_request_s=0 if seconds is None else _deadline_s(seconds, f"{where}.max_request_s"),
            context_length=count_field(raw, "context_length", where, default=None) or None,
            input_modalities=tuple(m for m in modalities if isinstance(m, str)) if isinstance(modalities, list) else (),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class KvLoad:
    """A serve's KV cache and queue, as sglang's `/get_load` reports them summed over its ranks
    (the `kv` block of the TEE miner's heartbeats): tokens held and the most it can hold,
    requests running and waiting."""

    used: int = 0
    limit: int | None = None
    running: int = 0
    waiting: int = 0

    @property
    def fraction(self) -> float | None:
        """How full the cache is (0..1), when its size is known."""
        return None if not self.limit else min(1.0, self.used / self.limit)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"used": self.used, "reqs": self.running, "waiting": self.waiting}
        if self.limit:
            wire.update(limit=self.limit, frac=round(self.used / self.limit, 4))
        return wire

    @classmethod
    def of_ranks(cls, ranks: Any, limit: int | None) -> KvLoad | None:
        """Summed over sglang's `/get_load` list (one entry per scheduler rank); `limit` is the
        servers' `max_total_num_tokens` summed (None: unknown). None when the list holds no rank
        it can read: then no `kv` block is sent, and the gateway counts requests alone."""
        if not isinstance(ranks, list):
            return None
        read = [rank for rank in ranks if isinstance(rank, Mapping)]
        if not read:
            return None

        def total(key: str) -> int:
            return sum(
                value
                for rank in read
                if isinstance(value := rank.get(key), int) and not isinstance(value, bool) and value >= 0
            )

        return cls(
            used=total("num_tokens"), limit=limit or None, running=total("num_reqs"), waiting=total("num_waiting_reqs")
        )

    @classmethod
    def parse(cls, raw: Any) -> KvLoad | None:
        """Liberal: a block that is not an object, or counts that are not whole numbers, read as
        no report (it only refines routing; the gateway counts requests itself)."""
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls(
                used=count_field(raw, "used", "heartbeat.kv", default=0),
                limit=count_field(raw, "limit", "heartbeat.kv", default=None),
                running=count_field(raw, "reqs", "heartbeat.kv", default=0),
                waiting=count_field(raw, "waiting", "heartbeat.kv", default=0),
            )
        except ProtocolError:
            return None


def _deadline_s(value: Any, field: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return as_count(value, field)
    return as_count(float(math.ceil(as_seconds(value, field))), field)


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    miner_key: str
    model: str
    model_root: str
    hw: dict[str, Any]
    """Informational; values may be strings (`gpus: "4x RTX 4090"`) or numbers."""
    versions: dict[str, Any]
    capacity: Capacity
    worker_name: str
    worker_id: str
    """The miner process's id ("" when a peer did not send one: every hello then counts as a
    new process, superseding the previous connection of its worker name)."""
    hotkey: str | None = None
    ts: int | None = None
    signature: str | None = None
    features: frozenset[str] = frozenset()
    """What the miner honours beyond the public protocol (`FEATURE_*`); empty for the public miner."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": "hello",
            "miner_key": self.miner_key,
            "model": self.model,
            "model_root": self.model_root,
            "hw": self.hw,
            "versions": self.versions,
            "capacity": self.capacity.to_wire(),
            "worker_name": self.worker_name,
            "instance_id": self.worker_name,
            "worker_id": self.worker_id,
        }
        if self.features:
            wire["features"] = sorted(self.features)
        if self.hotkey is not None:
            wire.update(hotkey=self.hotkey, ts=self.ts, signature=self.signature)
        return wire

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Hello:
        hw = obj.get("hw")
        versions = obj.get("versions")
        features = obj.get("features")
        worker_name = text_field(obj, "worker_name", "hello", default=None)
        if worker_name is None:
            worker_name = text_field(obj, "instance_id", "hello", default="")
        return cls(
            miner_key=text_field(obj, "miner_key", "hello", default=""),
            model=text_field(obj, "model", "hello"),
            model_root=text_field(obj, "model_root", "hello"),
            hw=dict(hw) if isinstance(hw, Mapping) else ({"summary": hw} if isinstance(hw, str) else {}),
            versions=dict(versions) if isinstance(versions, Mapping) else {},
            capacity=Capacity.parse(obj.get("capacity"), "hello"),
            worker_name=worker_name,
            worker_id=text_field(obj, "worker_id", "hello", default=""),
            hotkey=text_field(obj, "hotkey", "hello", default=None),
            ts=count_field(obj, "ts", "hello", default=None),
            signature=text_field(obj, "signature", "hello", default=None),
            features=frozenset(f for f in features if isinstance(f, str))
            if isinstance(features, list)
            else frozenset(),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    inflight: int
    """As the miner reports it; the public miner always says 0, so the gateway counts its own."""
    idle_seconds: float
    capacity: Capacity | None = None
    kv: KvLoad | None = None
    """The serve's KV cache and queue, when the miner reads them (TEE, ours on sglang)."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": "heartbeat",
            "inflight": self.inflight,
            "idle_seconds": round(self.idle_seconds, 3),
        }
        if self.capacity is not None:
            wire["capacity"] = self.capacity.to_wire()
        if self.kv is not None:
            wire["kv"] = self.kv.to_wire()
        return wire

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Heartbeat:
        idle = obj.get("idle_seconds")
        capacity = obj.get("capacity")
        return cls(
            inflight=count_field(obj, "inflight", "heartbeat", default=0),
            idle_seconds=0.0 if idle is None else as_seconds(idle, "heartbeat.idle_seconds"),
            capacity=None if capacity is None or capacity == {} else Capacity.parse(capacity, "heartbeat"),
            kv=KvLoad.parse(obj.get("kv")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    corr_id: str
    content: str
    reasoning: str = ""
    """`delta.reasoning_content`: a miner whose serve splits reasoning out (sglang's reasoning
    parser, or its own) streams it apart from the answer's text (the newest public miners do)."""
    tool_calls: tuple[dict[str, Any], ...] = ()
    """`delta.tool_calls`: OpenAI-style call fragments (`index`, then `id`, `function.name` and
    pieces of `function.arguments`), or whole calls, as the miner streams them."""

    @property
    def plain(self) -> bool:
        """Text alone, as the public protocol's first miners stream it."""
        return not self.reasoning and not self.tool_calls

    def to_wire(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content or self.plain:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = list(self.tool_calls)
        return {"type": "chunk", "corr_id": self.corr_id, "delta": delta}

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Chunk:
        """`delta` is OpenAI-shaped: `content`, `reasoning_content` and `tool_calls`, any of them
        absent or null (a delta without any, such as `{}`, relays nothing). A bare string is
        taken as the text. Tool-call fragments that are not objects are dropped, not refused:
        whether the calls hold together is judged against the proven tokens at the end."""
        delta = obj.get("delta")
        corr_id = text_field(obj, "corr_id", "chunk")
        if isinstance(delta, str):
            return cls(corr_id=corr_id, content=delta)
        if delta is None:
            return cls(corr_id=corr_id, content="")
        delta = as_object(delta, "chunk.delta")
        calls = delta.get("tool_calls")
        return cls(
            corr_id=corr_id,
            content=text_field(delta, "content", "chunk.delta", default=""),
            reasoning=text_field(delta, "reasoning_content", "chunk.delta", default=""),
            tool_calls=tuple(call for call in calls if isinstance(call, dict)) if isinstance(calls, list) else (),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    corr_id: str
    request_id: str
    commitment: dict[str, Any] | None
    output: dict[str, Any] | None
    error: str | None = None
    """The failure's message: `error` when a string, its `message` when an object."""
    error_type: str | None = None
    error_status: int | None = None
    """The HTTP status of a failure, when the miner gives one (`error: {message, type, status}`,
    the newest public protocol): a 4xx says the request itself was at fault."""
    gemm_commitment: dict[str, Any] | None = None
    """The answer's activation commitment with its serve ``rid``, when asked for
    (`engy_node.protocol.gemm`)."""

    @property
    def error_text(self) -> str | None:
        """The failure as one line: its type, then its message."""
        return f"{self.error_type}: {self.error}" if self.error_type and self.error is not None else self.error

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": "response",
            "corr_id": self.corr_id,
            "request_id": self.request_id,
            "commitment": self.commitment,
            "output": self.output,
        }
        if self.gemm_commitment is not None:
            wire["gemm_commitment"] = self.gemm_commitment
        if self.error is not None:
            if self.error_type is None and self.error_status is None:
                wire["error"] = self.error
            else:
                wire["error"] = {
                    "message": self.error,
                    **({"type": self.error_type} if self.error_type else {}),
                    **({"status": self.error_status} if self.error_status is not None else {}),
                }
        return wire

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Response:
        """An empty `commitment` or `output` object means none; `error` may be a string or an
        object (`{"message", "type", "status"}`; one without a message is kept whole as JSON text)."""
        commitment = obj.get("commitment")
        output = obj.get("output")
        error, error_type, error_status = _error_parts(obj.get("error"))
        return cls(
            corr_id=text_field(obj, "corr_id", "response"),
            request_id=text_field(obj, "request_id", "response", default=""),
            commitment=dict(as_object(commitment, "response.commitment")) or None if commitment is not None else None,
            output=dict(as_object(output, "response.output")) or None if output is not None else None,
            error=error,
            error_type=error_type,
            error_status=error_status,
            gemm_commitment=parse_gemm_commitment(obj.get("gemm_commitment")),
        )


def _error_parts(error: Any) -> tuple[str | None, str | None, int | None]:
    if error is None or error == "" or error == {}:
        return None, None, None
    if isinstance(error, str):
        return error, None, None
    if isinstance(error, Mapping):
        message, kind, status = error.get("message"), error.get("type"), error.get("status")
        if not isinstance(message, str) or not message:
            try:
                message = orjson.dumps(error).decode()
            except orjson.JSONEncodeError:  # nested past what orjson writes (it reads deeper)
                message = "an error object too deeply nested to show"
        return (
            message,
            kind if isinstance(kind, str) and kind else None,
            status if type(status) is int and 100 <= status <= 599 else None,
        )
    raise ProtocolError("response.error", f"must be a string or an object, got {describe(error)}")


MinerFrame = Hello | Heartbeat | Chunk | Response | GemmOpenings


# ---- gateway -> miner ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: Any
    """A string, or the list of content parts some APIs use; passed to the chat template."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other fields of the message (tool_calls, tool_call_id, name), kept for the template."""

    def for_template(self) -> dict[str, Any]:
        return {**self.extra, "role": self.role, "content": self.content}


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature is None or self.temperature < 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class ServeRequest:
    messages: tuple[Message, ...]
    max_tokens: int | None
    engy_request_id: str
    tools: tuple[dict[str, Any], ...] | None = None
    sampling: Sampling = Sampling()
    tool_choice: Any = None
    """OpenAI's `tool_choice` ("auto", "required", or a function by name), for a serve that
    enforces it (sglang's OpenAI route constrains decoding by it). Not a template variable:
    neither transformers nor the public miners render it, and the prompt must be theirs."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template (`enable_thinking`), as sglang's and vLLM's OpenAI
    servers take them; the newest public miner passes them to `apply_chat_template`."""
    gemm_commitment: bool = False
    """Commit the answer's activations for a GEMM audit (``return_gemm_commitment``); sent only
    to a miner that announced `FEATURE_GEMM`."""

    def template_variables(self) -> dict[str, Any]:
        """What the chat template is rendered with beyond the conversation and the tools."""
        return dict(self.chat_template_kwargs or {})

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "messages": [m.for_template() for m in self.messages],
            "max_tokens": self.max_tokens,
            "engy_request_id": self.engy_request_id,
        }
        if self.tools is not None:
            wire["tools"] = list(self.tools)
        if self.tool_choice is not None:
            wire["tool_choice"] = self.tool_choice
        if self.chat_template_kwargs:
            wire["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.gemm_commitment:
            wire["return_gemm_commitment"] = True
        sampling: dict[str, Any] = {
            k: v
            for k, v in (
                ("temperature", self.sampling.temperature),
                ("top_p", self.sampling.top_p),
                ("seed", self.sampling.seed),
            )
            if v is not None
        }
        if self.sampling.stop:
            sampling["stop"] = list(self.sampling.stop)
        if sampling:
            wire["sampling"] = sampling
        return wire


@dataclasses.dataclass(frozen=True, slots=True)
class Admit:
    def to_wire(self) -> dict[str, Any]:
        return {"type": "admit"}


@dataclasses.dataclass(frozen=True, slots=True)
class Deny:
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "deny", "reason": self.reason}


@dataclasses.dataclass(frozen=True, slots=True)
class Serve:
    corr_id: str
    request: ServeRequest
    stream: bool

    def to_wire(self) -> dict[str, Any]:
        return {"type": "serve", "corr_id": self.corr_id, "request": self.request.to_wire(), "stream": self.stream}


@dataclasses.dataclass(frozen=True, slots=True)
class Cancel:
    corr_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "cancel", "corr_id": self.corr_id}


@dataclasses.dataclass(frozen=True, slots=True)
class Ping:
    def to_wire(self) -> dict[str, Any]:
        return {"type": "ping"}


@dataclasses.dataclass(frozen=True, slots=True)
class Reconnect:
    def to_wire(self) -> dict[str, Any]:
        return {"type": "reconnect"}


GatewayFrame = Admit | Deny | Serve | Cancel | Ping | Reconnect | GemmChallenge


def encode(frame: MinerFrame | GatewayFrame) -> str:
    return orjson.dumps(frame.to_wire()).decode()


def _load(text: str | bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise ProtocolError("frame", "not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame", f"must be a JSON object, got {describe(obj)}")
    if not isinstance(obj.get("type"), str):
        raise ProtocolError(
            "frame.type", "missing" if obj.get("type") is None else f"must be a string, got {describe(obj['type'])}"
        )
    return obj


def _parse_number(raw: Mapping[str, Any], key: str, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{where}.{key}", f"must be a finite number, got {describe(value)}")
    return float(value)


def _parse_seed(raw: Mapping[str, Any], where: str) -> int | None:
    seed = raw.get("seed")
    if seed is None:
        return None
    if isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ProtocolError(f"{where}.seed", f"must be an integer, got {describe(seed)}")
    if not -(2**63) <= seed < 2**63:
        raise ProtocolError(f"{where}.seed", "must fit in 64 bits (what sglang's sampling_seed takes)")
    return seed


def _parse_sampling(raw: Mapping[str, Any], where: str) -> Sampling:
    stop = raw.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ProtocolError(f"{where}.stop", "must be a string or a list of strings")
    return Sampling(
        temperature=_parse_number(raw, "temperature", where),
        top_p=_parse_number(raw, "top_p", where),
        seed=_parse_seed(raw, where),
        stop=stops,
    )


def _parse_request(raw: Any, corr_id: str) -> ServeRequest:
    """`sampling` is ours; without it, OpenAI sampling fields at the top of the request (as a
    gateway passing the buyer's body through would send them) are read instead. A request
    without `engy_request_id` is known by its corr_id."""
    raw = as_object(raw, "serve.request")
    messages_raw = raw.get("messages")
    if not isinstance(messages_raw, list) or not messages_raw:
        raise ProtocolError("serve.request.messages", "must be a non-empty list")
    messages = []
    for index, item in enumerate(messages_raw):
        where = f"serve.request.messages[{index}]"
        item = as_object(item, where)
        role = text_field(item, "role", where)
        content = item.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ProtocolError(f"{where}.content", "must be a string or a list of parts")
        extra = {k: v for k, v in item.items() if k not in ("role", "content")}
        messages.append(Message(role=role, content=content if content is not None else "", extra=extra))
    tools = raw.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise ProtocolError("serve.request.tools", "must be a list of objects")
    sampling = raw.get("sampling")
    choice = raw.get("tool_choice")
    kwargs = raw.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ProtocolError("serve.request.chat_template_kwargs", f"must be an object, got {describe(kwargs)}")
    return ServeRequest(
        tool_choice=choice if isinstance(choice, (str, Mapping)) else None,
        chat_template_kwargs={str(k): v for k, v in kwargs.items() if k not in RESERVED_VARIABLES} or None
        if kwargs
        else None,
        messages=tuple(messages),
        max_tokens=count_field(raw, "max_tokens", "serve.request", default=None),
        engy_request_id=text_field(raw, "engy_request_id", "serve.request", default=corr_id),
        tools=tuple(dict(t) for t in tools) if tools is not None else None,
        gemm_commitment=raw.get("return_gemm_commitment") is True,
        sampling=(
            _parse_sampling(as_object(sampling, "serve.request.sampling"), "serve.request.sampling")
            if sampling is not None
            else _parse_sampling(raw, "serve.request")
        ),
    )


def _parse_stream(obj: Mapping[str, Any]) -> bool:
    stream = obj.get("stream")
    if stream is None:
        return False
    if isinstance(stream, bool):
        return stream
    if isinstance(stream, (int, float)) and stream in (0, 1):
        return bool(stream)
    raise ProtocolError("serve.stream", f"must be a boolean, got {describe(stream)}")


def parse_gateway_frame(text: str | bytes) -> GatewayFrame:
    """A frame the gateway sent to a miner."""
    obj = _load(text)
    kind = obj["type"]
    if kind == "admit":
        return Admit()
    if kind == "deny":
        reason = obj.get("reason")
        return Deny(reason=reason if isinstance(reason, str) else "denied")
    if kind == "serve":
        corr_id = text_field(obj, "corr_id", "serve")
        return Serve(corr_id=corr_id, request=_parse_request(obj.get("request"), corr_id), stream=_parse_stream(obj))
    if kind == "cancel":
        return Cancel(corr_id=text_field(obj, "corr_id", "cancel"))
    if kind == "ping":
        return Ping()
    if kind == "reconnect":
        return Reconnect()
    if kind == "gemm_challenge":
        return GemmChallenge.parse(obj)
    raise ProtocolError("frame.type", f"unknown frame type {kind[:40]!r} from the gateway")


_MINER_FRAMES: dict[str, Callable[[Mapping[str, Any]], MinerFrame]] = {
    "hello": Hello.parse,
    "heartbeat": Heartbeat.parse,
    "chunk": Chunk.parse,
    "response": Response.parse,
    "gemm_openings": GemmOpenings.parse,
}


def parse_miner_frame(text: str | bytes) -> MinerFrame:
    """A frame a miner sent to the gateway."""
    obj = _load(text)
    parse = _MINER_FRAMES.get(obj["type"])
    if parse is None:
        raise ProtocolError("frame.type", f"unknown frame type {obj['type'][:40]!r} from a miner")
    return parse(obj)
