"""The miner ↔ gateway websocket protocol (SPEC §4), compatible with the public SN53 gateway.

Frames are JSON text messages with a `type` field. This module is the one place their shapes are
declared: each frame is a frozen dataclass with `to_wire()` and a `parse_*` function that checks
every field a peer relies on and raises `ProtocolError` naming the field. Unknown extra fields
are ignored (peers add fields over time — ours adds `hotkey`/`ts`/`signature` to hello and
`tools`/`sampling` to serve requests), unknown frame types are errors.

Trust: a frame from the network is attacker-controlled. Parsing never raises anything but
`ProtocolError`, and size limits are the transport's job (the caller sets the websocket's
maximum message size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orjson

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A frame is malformed; the message names the frame type and field."""


def _require(obj: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], frame: str, *, optional: bool = False) -> Any:
    value = obj.get(key)
    if value is None:
        if optional:
            return None
        raise ProtocolError(f"{frame}: missing {key}")
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError(f"{frame}: {key} has the wrong type")
    if not isinstance(value, kinds):
        raise ProtocolError(f"{frame}: {key} has the wrong type")
    return value


def _non_negative_int(obj: Mapping[str, Any], key: str, frame: str, *, optional: bool = False) -> int | None:
    value = _require(obj, key, int, frame, optional=optional)
    if value is not None and value < 0:
        raise ProtocolError(f"{frame}: {key} must be non-negative")
    return value


# ---- miner -> gateway ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    max_inflight: int
    """This leg's share of the miner's concurrency."""
    max_inflight_total: int
    max_input_tokens: int
    max_output_tokens: int
    max_request_s: int

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, raw: Any, frame: str) -> "Capacity":
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"{frame}: capacity must be an object")
        values = {field.name: _non_negative_int(raw, field.name, f"{frame}.capacity") for field in dataclasses.fields(cls)}
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    miner_key: str
    model: str
    model_root: str
    hw: dict[str, Any]
    versions: dict[str, Any]
    capacity: Capacity
    worker_name: str
    worker_id: str
    hotkey: str | None = None
    ts: int | None = None
    signature: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": "hello", "miner_key": self.miner_key, "model": self.model, "model_root": self.model_root,
            "hw": self.hw, "versions": self.versions, "capacity": self.capacity.to_wire(),
            "worker_name": self.worker_name, "instance_id": self.worker_name, "worker_id": self.worker_id,
        }
        if self.hotkey is not None:
            wire.update(hotkey=self.hotkey, ts=self.ts, signature=self.signature)
        return wire


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    inflight: int
    idle_seconds: float
    capacity: Capacity | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": "heartbeat", "inflight": self.inflight, "idle_seconds": round(self.idle_seconds, 3)}
        if self.capacity is not None:
            wire["capacity"] = self.capacity.to_wire()
        return wire


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    corr_id: str
    content: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "chunk", "corr_id": self.corr_id, "delta": {"content": self.content}}


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    corr_id: str
    request_id: str
    commitment: dict[str, Any] | None
    output: dict[str, Any] | None
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": "response", "corr_id": self.corr_id, "request_id": self.request_id,
                                "commitment": self.commitment, "output": self.output}
        if self.error is not None:
            wire["error"] = self.error
        return wire


MinerFrame = Hello | Heartbeat | Chunk | Response


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

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "messages": [m.for_template() for m in self.messages],
            "max_tokens": self.max_tokens,
            "engy_request_id": self.engy_request_id,
        }
        if self.tools is not None:
            wire["tools"] = list(self.tools)
        sampling = {k: v for k, v in (("temperature", self.sampling.temperature), ("top_p", self.sampling.top_p),
                                      ("seed", self.sampling.seed)) if v is not None}
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


GatewayFrame = Admit | Deny | Serve | Cancel | Ping | Reconnect


def encode(frame: MinerFrame | GatewayFrame) -> str:
    return orjson.dumps(frame.to_wire()).decode()


def _load(text: str | bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise ProtocolError("frame is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame must be a JSON object")
    if not isinstance(obj.get("type"), str):
        raise ProtocolError("frame has no type")
    return obj


def _parse_sampling(raw: Any) -> Sampling:
    if raw is None:
        return Sampling()
    if not isinstance(raw, Mapping):
        raise ProtocolError("serve.request.sampling must be an object")
    temperature = _require(raw, "temperature", (int, float), "serve.request.sampling", optional=True)
    top_p = _require(raw, "top_p", (int, float), "serve.request.sampling", optional=True)
    seed = _require(raw, "seed", int, "serve.request.sampling", optional=True)
    stop = raw.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ProtocolError("serve.request.sampling.stop must be a string or a list of strings")
    return Sampling(
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        seed=seed,
        stop=stops,
    )


def _parse_request(raw: Any) -> ServeRequest:
    if not isinstance(raw, Mapping):
        raise ProtocolError("serve.request must be an object")
    messages_raw = raw.get("messages")
    if not isinstance(messages_raw, list) or not messages_raw:
        raise ProtocolError("serve.request.messages must be a non-empty list")
    messages = []
    for item in messages_raw:
        if not isinstance(item, Mapping) or not isinstance(item.get("role"), str):
            raise ProtocolError("serve.request.messages[] must be objects with a role")
        content = item.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ProtocolError("serve.request.messages[].content must be a string or a list of parts")
        extra = {k: v for k, v in item.items() if k not in ("role", "content")}
        messages.append(Message(role=item["role"], content=content if content is not None else "", extra=extra))
    max_tokens = _non_negative_int(raw, "max_tokens", "serve.request", optional=True)
    request_id = _require(raw, "engy_request_id", str, "serve.request")
    tools = raw.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise ProtocolError("serve.request.tools must be a list of objects")
    return ServeRequest(
        messages=tuple(messages), max_tokens=max_tokens, engy_request_id=request_id,
        tools=tuple(dict(t) for t in tools) if tools is not None else None,
        sampling=_parse_sampling(raw.get("sampling")),
    )


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
        stream = obj.get("stream", False)
        if not isinstance(stream, bool):
            raise ProtocolError("serve: stream must be a boolean")
        return Serve(corr_id=_require(obj, "corr_id", str, "serve"), request=_parse_request(obj.get("request")), stream=stream)
    if kind == "cancel":
        return Cancel(corr_id=_require(obj, "corr_id", str, "cancel"))
    if kind == "ping":
        return Ping()
    if kind == "reconnect":
        return Reconnect()
    raise ProtocolError(f"unknown frame type {kind!r} from the gateway")


def parse_miner_frame(text: str | bytes) -> MinerFrame:
    """A frame a miner sent to the gateway."""
    obj = _load(text)
    kind = obj["type"]
    if kind == "hello":
        hw = obj.get("hw") if isinstance(obj.get("hw"), Mapping) else {}
        versions = obj.get("versions") if isinstance(obj.get("versions"), Mapping) else {}
        return Hello(
            miner_key=obj.get("miner_key") if isinstance(obj.get("miner_key"), str) else "",
            model=_require(obj, "model", str, "hello"),
            model_root=_require(obj, "model_root", str, "hello"),
            hw=dict(hw), versions=dict(versions),
            capacity=Capacity.parse(obj.get("capacity"), "hello"),
            worker_name=_require(obj, "worker_name", str, "hello"),
            worker_id=_require(obj, "worker_id", str, "hello"),
            hotkey=_require(obj, "hotkey", str, "hello", optional=True),
            ts=_non_negative_int(obj, "ts", "hello", optional=True),
            signature=_require(obj, "signature", str, "hello", optional=True),
        )
    if kind == "heartbeat":
        inflight = _non_negative_int(obj, "inflight", "heartbeat")
        idle = _require(obj, "idle_seconds", (int, float), "heartbeat")
        capacity = Capacity.parse(obj["capacity"], "heartbeat") if obj.get("capacity") is not None else None
        return Heartbeat(inflight=inflight, idle_seconds=float(idle), capacity=capacity)
    if kind == "chunk":
        delta = obj.get("delta")
        if not isinstance(delta, Mapping) or not isinstance(delta.get("content"), str):
            raise ProtocolError("chunk: delta.content must be a string")
        return Chunk(corr_id=_require(obj, "corr_id", str, "chunk"), content=delta["content"])
    if kind == "response":
        commitment = obj.get("commitment")
        output = obj.get("output")
        error = obj.get("error")
        if commitment is not None and not isinstance(commitment, Mapping):
            raise ProtocolError("response: commitment must be an object")
        if output is not None and not isinstance(output, Mapping):
            raise ProtocolError("response: output must be an object")
        if error is not None and not isinstance(error, str):
            raise ProtocolError("response: error must be a string")
        return Response(
            corr_id=_require(obj, "corr_id", str, "response"),
            request_id=obj.get("request_id") if isinstance(obj.get("request_id"), str) else "",
            commitment=dict(commitment) if commitment is not None else None,
            output=dict(output) if output is not None else None,
            error=error,
        )
    raise ProtocolError(f"unknown frame type {kind!r} from a miner")
