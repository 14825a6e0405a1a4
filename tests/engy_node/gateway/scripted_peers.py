"""The public SN53 miners on the wire, frame for frame, answering from a script.

Each `Dialect` below is one public miner as its source shows it on the wire (the shapes are
written here from reading `hanlinai/engy`; none of its code is), driven over a raw websocket,
not through our protocol module, so a test holds the gateway to the frames real peers send:

* `ENGY_MINER_0_4_4`: `miner/engy_miner.py` at release 0.4.4 (`db8e7de`). hello with
  `capacity {max_inflight (floor share), max_inflight_total, max_input_tokens, max_output_tokens,
  max_request_s: 1800.0}`, `instance_id` = `worker_name`, `versions: {}`; a heartbeat every
  interval and on `ping`, `{inflight: 0, idle_seconds: 0.0, capacity}` (it never reports load);
  renders each message's role and content only (tools dropped); streams only when `serve.stream`,
  each chunk `{"content": raw text}` with the model's `<think>` and tool-call markup in it; the
  response's `finish_reason` is always `"stop"`, `prompt_tokens_details` only when cached tokens
  > 0, a TOPLOC commitment; an error is `error: "<repr>"` with `commitment: null`; after
  `cancel` nothing; on `reconnect` it closes the socket at once (what it serves is lost) and
  re-dials.
* `ENGY_MINER_NEWEST`: `miner/engy_miner.py` at `df70f57`. The same hello, heartbeats, errors
  and reconnect; renders messages verbatim with `tools` and `chat_template_kwargs` (tool-call
  arguments given as JSON strings turned into objects first); streams one key per chunk
  (`reasoning_content`, `content`, or `tool_calls` with each call whole, `index`, id
  `call_<24 hex>`, at the end); the final message has `content: null` when there is no text,
  `tool_calls` and `reasoning_content` only when there are some; `finish_reason` is `length`
  when the budget ran out, else `tool_calls` when there are calls, else `stop`.
* `TEE_MINER_NEWEST`: `miner/tee_miner.py` at `1f03c32`. hello with `hw.region`,
  `hw.tee {gpu_cc}`, `capacity {max_inflight (ceil share), max_inflight_total, context_length,
  input_modalities}`, no `instance_id`; periodic heartbeats with a `kv` block `{used, reqs,
  waiting, pending, ranks, limit, frac}` and, on every request's start and end, an event
  heartbeat `{inflight, idle_seconds}` with neither capacity nor kv; always streams, each chunk
  the union of the serve's delta keys, tool calls as the serve's raw fragments (the first naming
  the call, the rest adding to its arguments), `logprobs` beside the delta when there are some;
  the final output is a whole `chat.completion` (`id`, `object`, `model`, `content: ""` when
  empty, calls merged by index) with flat `usage.reasoning_tokens`; `commitment: {}`; an error is
  `{message, type, status}`; on `reconnect` it keeps the old socket open, heartbeats and all,
  until what it serves is done, and re-dials at once; frames up to 64 MiB.

What a peer answers comes from `Answer`: reasoning, text, tool calls (written into the raw text
in the Qwen3-Coder XML format the gateway reads), a length cut-off, cached tokens, an error, or a
pause a test ends. Its proof-bearing ids are the raw text's tokenisation, so a commitment names
what the peer actually sent.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import uuid
from collections.abc import Callable

import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from engy_node.served_model import ServedModel


@dataclasses.dataclass(frozen=True)
class Dialect:
    name: str
    renders_tools: bool
    streams_always: bool
    parts: str
    """How an answer goes out: "raw" (text with markup), "whole-calls" (one key a chunk, calls
    whole at the end) or "fragments" (the serve's union deltas)."""
    honest_finish: bool
    commitment: bool
    error_object: bool
    kv_and_events: bool
    drains_on_reconnect: bool
    max_frame_bytes: int


ENGY_MINER_0_4_4 = Dialect(
    "engy_miner 0.4.4",
    renders_tools=False,
    streams_always=False,
    parts="raw",
    honest_finish=False,
    commitment=True,
    error_object=False,
    kv_and_events=False,
    drains_on_reconnect=False,
    max_frame_bytes=1 << 20,
)
ENGY_MINER_NEWEST = Dialect(
    "engy_miner df70f57",
    renders_tools=True,
    streams_always=False,
    parts="whole-calls",
    honest_finish=True,
    commitment=True,
    error_object=False,
    kv_and_events=False,
    drains_on_reconnect=False,
    max_frame_bytes=1 << 20,
)
TEE_MINER_NEWEST = Dialect(
    "tee_miner 1f03c32",
    renders_tools=True,
    streams_always=True,
    parts="fragments",
    honest_finish=True,
    commitment=False,
    error_object=True,
    kv_and_events=True,
    drains_on_reconnect=True,
    max_frame_bytes=64 << 20,
)
DIALECTS = (ENGY_MINER_0_4_4, ENGY_MINER_NEWEST, TEE_MINER_NEWEST)


@dataclasses.dataclass
class Answer:
    reasoning: str = ""
    text: str = "Paris is the capital of France."
    calls: tuple[tuple[str, dict], ...] = ()
    cut_at_max_tokens: bool = False
    """Run out of budget: the raw answer's first `max_tokens` tokens, no end-of-sequence."""
    cached_tokens: int = 0
    error: tuple[str, int | None] | None = None
    """Fail instead: (message, HTTP status the serve answered, where the dialect reports one)."""
    pause: trio.Event | None = None
    """Send the first chunk, then wait for this before the rest."""

    def raw(self) -> str:
        """The answer as the model writes it, in the Qwen3 template's conventions."""
        raw = f"<think>\n{self.reasoning}\n</think>\n\n" if self.reasoning else ""
        raw += self.text
        for name, arguments in self.calls:
            parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
            raw += f"\n<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"
        return raw


@dataclasses.dataclass
class Sent:
    """One answer as the peer composed it."""

    prompt_ids: list[int]
    output_ids: list[int]
    reasoning: str
    text: str
    calls: list[dict]
    finish: str


class ScriptedPeer:
    def __init__(
        self,
        dialect: Dialect,
        *,
        url: str,
        miner_key: str,
        model: ServedModel,
        answer: Callable[[dict], Answer],
        heartbeat_s: float = 0.5,
        max_inflight: int = 8,
        context_length: int | None = 4096,
        kv_frac: float = 0.25,
    ) -> None:
        self.dialect = dialect
        self.url = url
        self.miner_key = miner_key
        self.model = model
        self.answer = answer
        self.heartbeat_s = heartbeat_s
        self.max_inflight = max_inflight
        self.context_length = context_length
        self.kv_frac = kv_frac
        """What its serve's KV cache holds, as the next periodic heartbeat says (TEE miner)."""
        self.worker_id = uuid.uuid4().hex
        self.worker_name = ("tee-" if dialect.drains_on_reconnect else "ins-") + secrets.token_hex(6)
        self.received: list[dict] = []
        """Every frame the gateway sent it, in order."""
        self.sent: list[Sent] = []
        self.admitted = 0
        self.legs_opened = 0
        self.inflight = 0
        self.heartbeats_sent = 0
        self._receiving = trio.CancelScope()
        self.padding_bytes = 0
        """Pad the next periodic heartbeat with this many bytes (an extra field peers may send)."""
        self.changed = trio.Event()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, condition: Callable[[], bool], *, timeout_s: float = 30, what: str) -> None:
        with trio.move_on_after(timeout_s):
            while not condition():
                await self.changed.wait()
            return
        raise AssertionError(f"{self.dialect.name}: not {what} within {timeout_s} s")

    def frames(self, kind: str) -> list[dict]:
        return [frame for frame in self.received if frame.get("type") == kind]

    # ---- frames ------------------------------------------------------------------------------
    def capacity(self) -> dict:
        if self.dialect.drains_on_reconnect:
            capacity = {
                "max_inflight": self.max_inflight,
                "max_inflight_total": self.max_inflight,
                "input_modalities": ["text", "image"],
            }
            if self.context_length is not None:
                capacity["context_length"] = self.context_length
            return capacity
        return {
            "max_inflight": self.max_inflight,
            "max_inflight_total": self.max_inflight,
            "max_input_tokens": 229376,
            "max_output_tokens": 32768,
            "max_request_s": 1800.0,
        }

    def hello(self) -> dict:
        spec = self.model.spec
        if self.dialect.drains_on_reconnect:
            hw = {
                "host": "tee-host",
                "cpus": 0,
                "ram_gb": 0.0,
                "gpu": "NVIDIA H200",
                "gpu_count": 8,
                "gpu_mem_gb": 0.0,
                "gpus": "8x NVIDIA H200",
                "region": "eu-north",
                "tee": {"gpu_cc": "on", "gpu_cc_multigpu": " ppcie"},
            }
            return {
                "type": "hello",
                "miner_key": self.miner_key,
                "model": spec.id,
                "model_root": self.model.model_root,
                "hw": hw,
                "versions": {},
                "capacity": self.capacity(),
                "worker_name": self.worker_name,
                "worker_id": self.worker_id,
            }
        hw = {
            "parallelism": "tp",
            "host": "rig-1",
            "cpus": 32,
            "ram_gb": 125.7,
            "gpu": "NVIDIA GeForce RTX 4090",
            "gpu_count": 4,
            "gpu_mem_gb": 24.0,
            "torch": "2.9.1+cu128",
            "cuda": "12.8",
            "gpus": "4x NVIDIA GeForce RTX 4090",
        }
        return {
            "type": "hello",
            "miner_key": self.miner_key,
            "model": spec.id,
            "model_root": self.model.model_root,
            "hw": hw,
            "versions": {},
            "capacity": self.capacity(),
            "worker_name": self.worker_name,
            "instance_id": self.worker_name,
            "worker_id": self.worker_id,
        }

    def heartbeat(self, *, event: bool = False) -> dict:
        if not self.dialect.kv_and_events:
            return {"type": "heartbeat", "inflight": 0, "idle_seconds": 0.0, "capacity": self.capacity()}
        frame = {"type": "heartbeat", "inflight": self.inflight, "idle_seconds": 0.0 if self.inflight else 3.5}
        if not event:
            limit = 200_000
            frame["capacity"] = self.capacity()
            frame["kv"] = {
                "used": int(limit * self.kv_frac),
                "reqs": self.inflight,
                "waiting": 0,
                "pending": 0,
                "ranks": 1,
                "limit": limit,
                "frac": round(self.kv_frac, 4),
            }
            if self.padding_bytes:
                frame["padding"] = "x" * self.padding_bytes
                self.padding_bytes = 0
        return frame

    # ---- the connection ----------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Dial, and re-dial as the dialect does when the gateway says `reconnect` or closes."""
        started = False
        async with trio.open_nursery() as legs:
            while True:
                redial = trio.Event()
                try:
                    await legs.start(self._leg, redial)
                except (OSError, HandshakeError, ConnectionClosed):
                    await trio.sleep(0.5)  # the gateway is away: dial again, as the public miners do
                    continue
                if not started:
                    task_status.started()
                    started = True
                await redial.wait()
                await trio.sleep(0 if self.dialect.drains_on_reconnect else 0.5)

    async def _leg(self, redial: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_websocket_url(self.url, max_message_size=self.dialect.max_frame_bytes) as ws:
            self.legs_opened += 1
            await ws.send_message(json.dumps(self.hello()))
            first = json.loads(await ws.get_message())
            self.received.append(first)
            if first.get("type") != "admit":
                raise AssertionError(f"{self.dialect.name} was not admitted: {first}")
            self.admitted += 1
            self._notify()
            task_status.started()
            serving: set[str] = set()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._heartbeats, ws)
                    with trio.CancelScope() as self._receiving:
                        await self._receive(ws, nursery, serving)
                    if self.dialect.drains_on_reconnect:
                        # The replacement leg dials now; what this one serves finishes on this
                        # socket, heartbeats and all.
                        redial.set()
                        await self._drained(serving)
                    else:
                        await ws.aclose()  # what it serves is lost with the socket
                    nursery.cancel_scope.cancel()
            except* ConnectionClosed:
                pass
            finally:
                redial.set()
                self._notify()

    def redial(self) -> None:
        """Dial a new leg as if told `reconnect` (the live gateway says so when it changes colour)."""
        self._receiving.cancel()

    @staticmethod
    async def _drained(serving: set[str]) -> None:
        while serving:
            await trio.sleep(0.05)

    async def _heartbeats(self, ws) -> None:
        while True:
            await trio.sleep(self.heartbeat_s)
            await ws.send_message(json.dumps(self.heartbeat()))
            self.heartbeats_sent += 1
            self._notify()

    async def _receive(self, ws, nursery: trio.Nursery, serving: set[str]) -> None:
        active: dict[str, trio.CancelScope] = {}
        while True:
            frame = json.loads(await ws.get_message())
            self.received.append(frame)
            self._notify()
            kind = frame.get("type")
            if kind == "serve":
                scope = active[frame["corr_id"]] = trio.CancelScope()
                serving.add(frame["corr_id"])
                nursery.start_soon(self._serve, ws, frame, scope, serving)
            elif kind == "cancel" and frame.get("corr_id") in active:
                active.pop(frame["corr_id"]).cancel()
            elif kind == "ping":
                await ws.send_message(json.dumps(self.heartbeat()))
            elif kind == "reconnect":
                return

    # ---- answering ---------------------------------------------------------------------------
    def _prompt_ids(self, request: dict) -> list[int]:
        tokenizer = self.model.tokenizer
        if not self.dialect.renders_tools:
            messages = [{"role": m["role"], "content": m.get("content")} for m in request["messages"]]
            text = tokenizer.render(messages, add_generation_prompt=True)
        else:
            messages = [_arguments_as_objects(m) for m in request["messages"]]
            text = tokenizer.render(
                messages,
                tools=request.get("tools") or None,
                add_generation_prompt=True,
                template_kwargs=request.get("chat_template_kwargs") or {},
            )
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _compose(self, request: dict, answer: Answer, prompt_ids: list[int]) -> Sent:
        tokenizer = self.model.tokenizer
        raw = answer.raw()
        output_ids = list(tokenizer.encode(raw, add_special_tokens=False))
        if answer.cut_at_max_tokens:
            output_ids = output_ids[: request["max_tokens"]]
            raw = tokenizer.decode(output_ids, skip_special_tokens=True)
            finish = "length"
        else:
            output_ids.append(int(tokenizer.eos_token_id))
            finish = "tool_calls" if answer.calls else "stop"
        reasoning, text = ("", raw) if self.dialect.parts == "raw" else _split_reasoning(raw, answer)
        calls = [
            {
                "id": "call_" + secrets.token_hex(12),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for name, arguments in answer.calls
        ]
        if self.dialect.parts == "raw" or answer.cut_at_max_tokens:
            calls = []
        return Sent(prompt_ids, output_ids, reasoning, text, calls, finish)

    async def _serve(self, ws, frame: dict, scope: trio.CancelScope, serving: set[str]) -> None:
        corr_id = frame["corr_id"]
        request = frame["request"]
        try:
            with scope:
                self.inflight += 1
                if self.dialect.kv_and_events:
                    await ws.send_message(json.dumps(self.heartbeat(event=True)))
                answer = self.answer(request)
                if answer.error is not None:
                    await ws.send_message(json.dumps(self._error(corr_id, request, answer)))
                    return
                sent = self._compose(request, answer, self._prompt_ids(request))
                self.sent.append(sent)
                streams = self.dialect.streams_always or bool(frame.get("stream"))
                chunks = self._chunks(sent) if streams else []
                for position, delta in enumerate(chunks):
                    await ws.send_message(json.dumps({"type": "chunk", "corr_id": corr_id, **delta}))
                    if position == 0 and answer.pause is not None:
                        await answer.pause.wait()
                if not chunks and answer.pause is not None:
                    await answer.pause.wait()
                await ws.send_message(json.dumps(self._response(corr_id, request, sent, answer)))
        except ConnectionClosed:
            pass  # as the public miners: the leg is gone, the gateway times the request out
        finally:
            self.inflight -= 1
            serving.discard(corr_id)
            self._notify()
            if self.dialect.kv_and_events:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await ws.send_message(json.dumps(self.heartbeat(event=True)))
                    except ConnectionClosed:
                        pass

    def _chunks(self, sent: Sent) -> list[dict]:
        if self.dialect.parts == "raw":
            return [{"delta": {"content": piece}} for piece in _pieces(sent.text)]
        if self.dialect.parts == "whole-calls":
            return (
                [{"delta": {"reasoning_content": piece}} for piece in _pieces(sent.reasoning)]
                + [{"delta": {"content": piece}} for piece in _pieces(sent.text) if sent.text.strip()]
                + [{"delta": {"tool_calls": [{"index": i, **call}]}} for i, call in enumerate(sent.calls)]
            )
        chunks = [{"delta": {"reasoning_content": piece}} for piece in _pieces(sent.reasoning)]
        chunks += [
            {
                "delta": {"content": piece},
                "logprobs": {"content": [{"token": piece[:1], "logprob": -0.25, "bytes": None, "top_logprobs": []}]},
            }
            for piece in _pieces(sent.text)
        ]
        for index, call in enumerate(sent.calls):
            arguments = call["function"]["arguments"]
            chunks.append(
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call["id"],
                                "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""},
                            }
                        ]
                    }
                }
            )
            chunks += [
                {"delta": {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}}
                for piece in _pieces(arguments, 5)
            ]
        return chunks

    def _response(self, corr_id: str, request: dict, sent: Sent, answer: Answer) -> dict:
        dialect = self.dialect
        prompt, completion = len(sent.prompt_ids), len(sent.output_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if answer.cached_tokens or dialect.kv_and_events:
            usage["prompt_tokens_details"] = {"cached_tokens": min(answer.cached_tokens, prompt)}
        if dialect.parts == "raw":
            message = {"role": "assistant", "content": sent.text}
            finish = "stop"
        elif dialect.parts == "whole-calls":
            message = {"role": "assistant", "content": sent.text if sent.text.strip() else None}
            if sent.calls:
                message["tool_calls"] = sent.calls
            if sent.reasoning:
                message["reasoning_content"] = sent.reasoning
            finish = sent.finish
        else:
            message = {
                "role": "assistant",
                "content": sent.text,
                "tool_calls": [{"index": i, **call} for i, call in enumerate(sent.calls)] or None,
                "reasoning_content": sent.reasoning or None,
            }
            finish = sent.finish
            if sent.reasoning:
                usage["reasoning_tokens"] = len(self.model.tokenizer.encode(sent.reasoning, add_special_tokens=False))
        output = {"choices": [{"index": 0, "finish_reason": finish, "message": message}], "usage": usage}
        if dialect.kv_and_events:
            output = {
                "id": "chatcmpl-" + secrets.token_hex(6),
                "object": "chat.completion",
                "model": request.get("model"),
                **output,
            }
            output["choices"][0]["logprobs"] = None
        commitment: dict = {}
        if dialect.commitment:
            commitment = {
                "model_root": self.model.model_root,
                "output_token_ids": sent.output_ids,
                "toploc": {
                    "proofs": [],
                    "topk": 128,
                    "decode_batching_size": 32,
                    "skip_prefill": True,
                    "n_tokens": len(sent.output_ids),
                    "prompt_ids": sent.prompt_ids,
                },
            }
        return {
            "type": "response",
            "corr_id": corr_id,
            "request_id": request.get("engy_request_id") or uuid.uuid4().hex,
            "commitment": commitment,
            "output": output,
        }

    def _error(self, corr_id: str, request: dict, answer: Answer) -> dict:
        message, status = answer.error
        request_id = request.get("engy_request_id") or uuid.uuid4().hex
        if self.dialect.error_object:
            return {
                "type": "response",
                "corr_id": corr_id,
                "request_id": request_id,
                "commitment": {},
                "output": {},
                "error": {"message": message, "type": "ServeError", "status": status},
            }
        return {
            "type": "response",
            "corr_id": corr_id,
            "request_id": request_id,
            "commitment": None,
            "output": {},
            "error": f"RuntimeError({message!r})",
        }


def _pieces(text: str, size: int = 12) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _arguments_as_objects(message: dict) -> dict:
    """A history message as the newest public miners hand it to the template: tool-call
    arguments sent as a JSON string become an object (a malformed one, `{}`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                function["arguments"] = {}
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def _split_reasoning(raw: str, answer: Answer) -> tuple[str, str]:
    """(reasoning, visible text) of a raw answer, as a miner with a reasoning parser splits it."""
    if "</think>" in raw:
        head, _, tail = raw.partition("</think>")
        text = tail.lstrip("\n").split("\n<tool_call>")[0] if answer.calls else tail.lstrip("\n")
        return head.removeprefix("<think>\n").removesuffix("\n"), text
    if raw.startswith("<think>"):
        return raw.removeprefix("<think>\n"), ""
    return "", raw.split("\n<tool_call>")[0] if answer.calls else raw
