"""sglang's native HTTP API over the engine: the routes, their shapes and their errors.

A client written against real sglang 0.5.x's native API (`/generate`, `/get_model_info`, …) must work here
unchanged, so shapes follow it exactly: `meta_info` keys in sglang's order, ragged
`hidden_states` ([prefill block, v_1, …, v_{n-1}]), `[logprob, token_id, null]` entries,
finish_reason objects, cumulative SSE events ending in `data: [DONE]`, 400 bodies in both of
sglang's shapes (`{"error": "..."}` for contract violations, `{"error": {"message": ...}}` for
validation failures).

Cancellation reaches the model: a streaming client that disconnects, or a non-streaming one
that hangs up while waiting, aborts its generation at the engine's next step, the same as
`/abort_request`. Nothing is generated for nobody.

Hidden states dominate the bytes on the wire (one float per hidden unit per token). Each row is
serialised once, when it is first sent, and reused by later cumulative events, so a stream
costs serialisation proportional to its tokens, not their square.

`/engy/prefill` is ours: the verifier's recompute (final hidden states and logits over a given
token sequence), served by the same engine thread so it never races a generation for the CPU.

So is ``return_gemm_commitment`` (per item, like ``return_hidden_states``): the request's GEMMs
are captured (`engy_node.serve.capture`) and its final result's ``meta_info`` gains
``gemm_commitment``, opened later through `/gemm/openings` (`engy_node.serve.gemm_routes`). A
request without it gets sglang's shapes unchanged.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import trio
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engy_node import __version__
from engy_node.asgi import BodyError, read_json_object, watching_disconnect
from engy_node.gemm.activations import llama_layout
from engy_node.serve.capture import ActivationCapture, SharedOpenings
from engy_node.serve.engine import Engine, Generation, ModelRunner, RequestError, run_on_engine
from engy_node.serve.gemm_routes import GemmRoutes
from engy_node.serve.openai_routes import OpenAiRoutes
from engy_node.serve.sampling import SamplingError, parse_sampling_params

log = logging.getLogger("engy.serve")

HEALTH_CHECK_TIMEOUT_S = 20.0
"""sglang's SGLANG_HEALTH_CHECK_TIMEOUT: /health_generate gives up after this long."""
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted (a 200k-token input_ids list is ~1.5 MB; this is generous)."""
PREFILL_FULL_LOGITS_MAX = 64 * 1024 * 1024
"""`/engy/prefill` returns full logits only up to this many floats (256 MB); ask for a summary
beyond that."""

HIDDEN_STATES_DISABLED = (
    "The server is not configured to return hidden states. Please set "
    "`--enable-return-hidden-states` to enable this feature."
)
ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


@dataclasses.dataclass(frozen=True, slots=True)
class ServerInfo:
    model_id: str
    served_model_name: str
    model_path: str
    model_root: str
    weights_root: str
    """The checkpoint's weight commitment, checked against the catalog's pin (engy_node.gemm.loaded)."""
    dtype: str
    device: str
    host: str
    port: int
    max_running_requests: int
    enable_return_hidden_states: bool
    stream_hidden_states: str
    architectures: tuple[str, ...]
    model_type: str
    simulated_cheat: str | None = None
    """The cheat applied to the weights in memory after the weights check (`serve.simulate_cheat`),
    shown so nobody mistakes this server for an honest one."""


class ApiError(Exception):
    """An error answered with `status` and sglang's body for it."""

    def __init__(self, status: int, message: str, *, contract: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.contract = contract

    def response(self) -> JSONResponse:
        body: Any = {"error": self.message} if self.contract else {"error": {"message": self.message}}
        return JSONResponse(body, status_code=self.status)


class Waker:
    """Wakes trio waiters when the engine thread updates a generation.

    Waiters read the generation's state, never queued messages, so wake-ups may coalesce: one
    `run_sync_soon` in flight at a time, however fast tokens come."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._event = trio.Event()
        self._scheduled = False

    def __call__(self, _generation: Generation) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self._token.run_sync_soon(self._wake)
        except trio.RunFinishedError:
            pass

    def _wake(self) -> None:
        self._scheduled = False
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


class HiddenStatesJson:
    """Serialised hidden states of one generation, built once per row (see module docstring)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.block: bytes | None = None
        self.rows: list[bytes] = []

    def render(self, count: int) -> bytes:
        """JSON for the first `count` entries of the ragged list."""
        import torch

        generation = self.generation
        if count == 0 or generation.hidden_block is None:
            return b"[]"
        if self.block is None:
            self.block = orjson.dumps(
                generation.hidden_block.to("cpu", dtype=torch.float64).numpy(), option=ORJSON_OPTIONS
            )
        rows = generation.hidden_rows
        while len(self.rows) < count - 1:
            self.rows.append(
                orjson.dumps(rows[len(self.rows)].to("cpu", dtype=torch.float64).numpy(), option=ORJSON_OPTIONS)
            )
        return b"[" + b",".join([self.block, *self.rows[: count - 1]]) + b"]"


@dataclasses.dataclass
class _Item:
    generation: Generation
    hidden: HiddenStatesJson
    seen_version: int = 0
    sent_first: bool = False
    sent_final: bool = False


class ReferenceApp:
    """Route handlers bound to one engine."""

    def __init__(self, engine: Engine, info: ServerInfo, registry) -> None:
        self.engine = engine
        self.info = info
        self.registry = registry
        self.ready = False
        self.started_at = time.time()
        self.openings = SharedOpenings()
        self.activation_layout = llama_layout(engine.runner.model.config.to_dict(), engine.runner.dtype)

    # ---- /generate -----------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            waker = Waker(trio.lowlevel.current_trio_token())
            items = self._parse_generate(body, waker)
            for item in items:
                self.engine.submit(item.generation)
        except ApiError as err:
            return err.response()
        except RequestError as err:
            for item in locals().get("items", []):
                self.engine.abort(item.generation.rid, prefix=False)
            return ApiError(400, str(err)).response()
        batch = _is_batch(body)
        if body.get("stream"):
            return StreamingResponse(self._stream(items, waker, batch=batch), media_type="text/event-stream")
        return await self._complete(request, items, waker, batch=batch)

    def _parse_generate(self, body: dict[str, Any], waker: Waker) -> list[_Item]:
        prompts = self._prompts(body)
        batch = _is_batch(body)
        count = len(prompts)
        rids = body.get("rid")
        if rids is None:
            base = uuid.uuid4().hex
            rid_list = [f"{base}_{i}" for i in range(count)] if batch else [base]
        elif isinstance(rids, str):
            rid_list = [f"{rids}_{i}" for i in range(count)] if batch else [rids]
        elif isinstance(rids, list) and all(isinstance(r, str) for r in rids):
            if len(rids) != count:
                raise ApiError(400, f"The rid list has {len(rids)} entries for a batch of {count}")
            rid_list = list(rids)
        else:
            raise ApiError(400, "invalid type: rid must be a string or a list of strings", contract=True)
        if len(set(rid_list)) != len(rid_list):
            raise ApiError(400, "Duplicate request ids in one batch")

        sampling = _per_item(body.get("sampling_params"), count, "sampling_params")
        hidden = _per_item(body.get("return_hidden_states", False), count, "return_hidden_states")
        logprob = _per_item(body.get("return_logprob", False), count, "return_logprob")
        gemm = _per_item(body.get("return_gemm_commitment", False), count, "return_gemm_commitment")
        items = []
        for i, prompt in enumerate(prompts):
            try:
                params = parse_sampling_params(sampling[i])
            except SamplingError as err:
                raise ApiError(400, str(err), contract=True) from None
            want_hidden = _bool_field(hidden[i], "return_hidden_states")
            if want_hidden and not self.info.enable_return_hidden_states:
                raise ApiError(400, HIDDEN_STATES_DISABLED)
            generation = Generation(
                rid=rid_list[i],
                input_ids=prompt,
                params=params,
                return_hidden_states=want_hidden,
                return_logprob=_bool_field(logprob[i], "return_logprob"),
                on_update=waker,
            )
            if _bool_field(gemm[i], "return_gemm_commitment"):
                generation.capture = self._capture(len(prompt) + params.max_new_tokens)
                generation.capture.commit_from_at_most = _commit_from(body.get("gemm_commit_from"))
            items.append(_Item(generation, HiddenStatesJson(generation)))
        return items

    def _capture(self, most_positions: int) -> ActivationCapture:
        layout = self.activation_layout
        need = most_positions * layout.bytes_per_position()
        if need > self.openings.max_bytes:
            most = self.openings.max_bytes // layout.bytes_per_position()
            raise ApiError(
                400,
                f"return_gemm_commitment keeps {layout.bytes_per_position()} bytes per position for the challenge "
                f"window, at most {most} positions (prompt plus max_new_tokens); this request may reach "
                f"{most_positions}: lower max_new_tokens or shorten the prompt",
            )
        return ActivationCapture(
            layout, self.openings, weights_root=self.info.weights_root, arithmetic=self.engine.runner.dtype
        )

    def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        given = [key for key in ("text", "input_ids", "input_embeds") if body.get(key) is not None]
        if len(given) != 1:
            raise ApiError(400, "Either text, input_ids or input_embeds should be provided, and only one of them.")
        if given[0] == "input_embeds":
            raise ApiError(400, "input_embeds is not supported by the engy reference server; send input_ids or text")
        if given[0] == "text":
            text = body["text"]
            texts = text if isinstance(text, list) else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, "invalid type: text must be a string or a list of strings", contract=True)
            tokenizer = self.engine.runner.tokenizer
            return [list(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(row, list) for row in ids):
            prompts = ids
        elif isinstance(ids, list):
            prompts = [ids]
        else:
            raise ApiError(400, "invalid type: input_ids must be a list of integers or a list of lists", contract=True)
        for prompt in prompts:
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "input_ids must be non-empty lists of integers", contract=True)
        return [list(p) for p in prompts]

    async def _complete(self, request: Request, items: list[_Item], waker: Waker, *, batch: bool) -> Response:
        """Wait for every item; a client hang-up aborts them all."""

        async def wait_all() -> None:
            while not all(item.generation.finished for item in items):
                await waker.wait()

        done = False
        try:
            done, _ = await watching_disconnect(request.receive, wait_all)
        finally:
            if not done:
                self._abort_items(items, "client disconnected")
        if not done:
            return Response(status_code=499)
        failures = [r for r in (i.generation.finish_reason for i in items) if r and r.get("status_code")]
        if failures:
            reason = failures[0]
            return ApiError(int(reason["status_code"]), str(reason.get("message"))).response()
        now = time.time()
        parts = [self._result_json(item, final=True, sent_ts=now, index=None) for item in items]
        body = b"[" + b",".join(parts) + b"]" if batch else parts[0]
        return Response(body, media_type="application/json")

    async def _stream(self, items: list[_Item], waker: Waker, *, batch: bool) -> AsyncIterator[bytes]:
        """SSE events as generations advance; events of a batch interleave, tagged by index.

        No nursery here: an async generator must not yield inside one, so one shared waker
        stands in for per-item tasks."""
        finished_cleanly = False
        try:
            while not all(item.sent_final for item in items):
                progressed = False
                for index, item in enumerate(items):
                    generation = item.generation
                    version = generation.version
                    if item.sent_final or version == item.seen_version:
                        continue
                    item.seen_version = version
                    final = generation.finished
                    if final or generation.output_ids:
                        sent_ts = None if item.sent_first else time.time()
                        item.sent_first = True
                        item.sent_final = final
                        progressed = True
                        yield (
                            b"data: "
                            + self._result_json(item, final=final, sent_ts=sent_ts, index=index if batch else None)
                            + b"\n\n"
                        )
                if not progressed:
                    await waker.wait()
            finished_cleanly = True
            yield b"data: [DONE]\n\n"
        finally:
            if not finished_cleanly:
                self._abort_items(items, "client disconnected")

    def _abort_items(self, items: list[_Item], message: str) -> None:
        for item in items:
            if not item.generation.finished:
                self.engine.abort(item.generation.rid, prefix=False, message=message)

    def _result_json(self, item: _Item, *, final: bool, sent_ts: float | None, index: int | None) -> bytes:
        """One result object in sglang's shape, for the generation's current state."""
        generation = item.generation
        finish = generation.finish_reason if final else None
        count = (
            len(generation.output_ids) if final else min(len(generation.output_ids), len(generation.output_logprobs))
        )
        output_ids = generation.output_ids[:count]
        text = generation.text if final else generation.visible_text
        meta: dict[str, Any] = {
            "id": generation.rid,
            "finish_reason": _public_finish(finish),
            "prompt_tokens": len(generation.input_ids),
            "weight_version": "default",
            "num_retractions": 0,
        }
        if generation.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(generation.output_logprobs[:count], output_ids)
            ]
            meta["output_token_logprobs_length"] = count
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = count
        meta["cached_tokens"] = generation.cached_tokens
        if final:
            meta["weight_versions"] = [{"version": "default", "start": 0, "end": count}]
        meta["cached_tokens_details"] = None
        hidden_marker = None
        if generation.return_hidden_states:
            if final or self.info.stream_hidden_states == "cumulative":
                hidden_marker = f"@@engy-hidden-states-{uuid.uuid4().hex}@@"
                meta["hidden_states"] = hidden_marker
            else:
                meta["hidden_states"] = []
        meta["dp_rank"] = None
        if final:
            end = generation.finished_perf or time.perf_counter()
            meta["e2e_latency"] = round(end - generation.created_perf, 6)
        if sent_ts is not None:
            meta["response_sent_to_client_ts"] = sent_ts
        if final and generation.gemm_commitment is not None:
            meta["gemm_commitment"] = generation.gemm_commitment
        result: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
        if index is not None:
            result["index"] = index
        encoded = orjson.dumps(result)
        if hidden_marker is not None:
            count_hidden = min(generation.hidden_states_count, max(count, 1))
            encoded = encoded.replace(orjson.dumps(hidden_marker), item.hidden.render(count_hidden), 1)
        return encoded

    # ---- /abort_request ------------------------------------------------------------------
    async def abort_request(self, request: Request) -> Response:
        try:
            body = await _json_body(request, allow_empty=True)
        except ApiError as err:
            return err.response()
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            return ApiError(400, "invalid type: rid must be a string", contract=True).response()
        count = self.engine.abort(rid, abort_all=bool(body.get("abort_all")))
        if count:
            log.info("aborted %d request(s) matching rid %r", count, rid)
        return Response(status_code=200)

    # ---- health and info -----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.ready and self.engine.alive else 503)

    async def health_generate(self, request: Request) -> Response:
        if not (self.ready and self.engine.alive):
            return Response(status_code=503)
        running, waiting = self.engine.load()
        if running and time.time() - self.engine.last_step_at < HEALTH_CHECK_TIMEOUT_S:
            return Response(status_code=200)
        generation = Generation(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            params=parse_sampling_params({"max_new_tokens": 1, "temperature": 0}),
        )
        waker = Waker(trio.lowlevel.current_trio_token())
        generation.on_update = waker
        try:
            self.engine.submit(generation)
        except RequestError:
            return Response(status_code=503)
        with trio.move_on_after(HEALTH_CHECK_TIMEOUT_S):
            while not generation.finished:
                await waker.wait()
        reason = generation.finish_reason  # set once it finished
        if reason is None:
            self.engine.abort(generation.rid, prefix=False)
            return Response(status_code=503)
        ok = reason.get("status_code") is None
        return Response(status_code=200 if ok else 503)

    def model_info_body(self) -> dict[str, Any]:
        info = self.info
        return {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "tokenizer_path": info.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": info.model_type,
            "architectures": list(info.architectures),
            "engy": {
                "model_id": info.model_id,
                "model_root": info.model_root,
                "dtype": info.dtype,
                "device": info.device,
            },
        }

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(self.model_info_body())

    async def server_info(self, request: Request) -> Response:
        info = self.info
        runner = self.engine.runner
        running, waiting = self.engine.load()
        body = {
            "model_path": info.model_path,
            "tokenizer_path": info.model_path,
            "served_model_name": info.served_model_name,
            "host": info.host,
            "port": info.port,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": runner.context_length,
            "max_running_requests": info.max_running_requests,
            "dtype": info.dtype,
            "device": info.device,
            "enable_return_hidden_states": info.enable_return_hidden_states,
            "enable_metrics": True,
            "status": "ready" if self.ready else "starting",
            "max_total_num_tokens": runner.context_length * info.max_running_requests,
            "max_req_input_len": runner.context_length - 1,
            "startup_time": self.started_at,
            "internal_states": [
                {
                    "last_gen_throughput": self.engine.gen_throughput(),
                    "num_running_reqs": running,
                    "num_queue_reqs": waiting,
                }
            ],
            "version": __version__,
            "frontend": "engy-reference",
            "model_root": info.model_root,
            "weights_root": info.weights_root,
            "simulated_cheat": info.simulated_cheat,
            "gemm_commitments": self.openings.advertised(self.activation_layout),
        }
        return JSONResponse(body)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.info.served_model_name:
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model `{name}` does not exist.",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                },
                status_code=404,
            )
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        name = self.info.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(self.started_at),
            "owned_by": "engy",
            "root": name,
            "parent": None,
            "max_model_len": self.engine.runner.context_length,
        }

    async def flush_cache(self, request: Request) -> Response:
        self.engine.flush_cache()
        return Response("Cache flushed.\n", media_type="text/plain")

    async def get_load(self, request: Request) -> Response:
        """sglang's per-rank load list (one rank here): what a miner reports as its `kv`."""
        return JSONResponse([{"dp_rank": 0, **self.engine.kv_load()}])

    async def metrics(self, request: Request) -> Response:
        running, waiting = self.engine.load()
        if self.engine.metrics is not None:
            self.engine.metrics.set_load(running, waiting)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    # ---- /engy/prefill -------------------------------------------------------------------
    async def prefill(self, request: Request) -> Response:
        """Body: {"input_ids": [...], "start": 0, "hidden_dtype": "bfloat16"|"float32",
        "logits": "none"|"summary"|"full", "target_ids": [...] (for "summary": the token each
        returned position is checked against)}. Arrays come back base64-encoded little-endian
        with dtype and shape."""
        try:
            body = await _json_body(request)
            ids = body.get("input_ids")
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise ApiError(400, "input_ids must be a non-empty list of integers")
            start = body.get("start", 0)
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(ids):
                raise ApiError(400, f"start must be an integer in [0, {len(ids) - 1}]")
            hidden_dtype = body.get("hidden_dtype", "bfloat16")
            if hidden_dtype not in ("bfloat16", "float32"):
                raise ApiError(400, "hidden_dtype must be bfloat16 or float32")
            logits_mode = body.get("logits", "none")
            if logits_mode not in ("none", "summary", "full"):
                raise ApiError(400, "logits must be none, summary or full")
            targets = body.get("target_ids")
            rows = len(ids) - start
            if logits_mode == "summary":
                if (
                    not isinstance(targets, list)
                    or len(targets) != rows
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in targets)
                ):
                    raise ApiError(400, f"logits=summary needs target_ids: {rows} token ids, one per returned position")
            if logits_mode == "full" and rows * self.engine.runner.vocab_size > PREFILL_FULL_LOGITS_MAX:
                raise ApiError(400, "too many positions for full logits; use logits=summary")
            if len(ids) > self.engine.runner.context_length:
                raise ApiError(
                    400, f"input_ids has {len(ids)} tokens; the context length is {self.engine.runner.context_length}"
                )
        except ApiError as err:
            return err.response()

        def work(runner: ModelRunner) -> dict[str, Any]:
            return _prefill_payload(
                runner, ids, start=start, hidden_dtype=hidden_dtype, logits_mode=logits_mode, targets=targets
            )

        try:
            payload = await run_on_engine(self.engine, work)
        except RequestError as err:
            return ApiError(400, str(err)).response()
        return Response(orjson.dumps(payload), media_type="application/json")


def _prefill_payload(
    runner: ModelRunner, ids: list[int], *, start: int, hidden_dtype: str, logits_mode: str, targets: list[int] | None
) -> dict[str, Any]:
    import torch

    from engy_node.logit_stats import token_stats

    hidden, logits = runner.prefill(ids, start=start)
    payload: dict[str, Any] = {"hidden_states": encode_array(hidden.to(getattr(torch, hidden_dtype)))}
    if logits_mode == "full":
        payload["logits"] = encode_array(logits.float())
    elif logits_mode == "summary":
        stats = token_stats(logits, targets or [])
        payload["token_stats"] = {
            "argmax": stats.argmax,
            "gap": stats.gap,
            "rank": stats.rank,
            "logprob": stats.logprob,
        }
    return payload


def encode_array(tensor) -> dict[str, Any]:
    """A tensor as {"dtype", "shape", "data": base64 of its little-endian bytes}."""
    import torch

    tensor = tensor.detach().to("cpu").contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    raw = tensor.view(torch.int16).numpy().tobytes() if tensor.dtype == torch.bfloat16 else tensor.numpy().tobytes()
    return {"dtype": dtype, "shape": list(tensor.shape), "data": base64.b64encode(raw).decode()}


def decode_array(encoded: dict[str, Any]):
    """Inverse of `encode_array`."""
    import numpy as np
    import torch

    raw = base64.b64decode(encoded["data"])
    shape = tuple(encoded["shape"])
    if encoded["dtype"] == "bfloat16":
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(encoded["dtype"])).copy()).reshape(shape)


def _public_finish(finish: dict[str, Any] | None) -> dict[str, Any] | None:
    if finish is None or finish.get("type") != "abort":
        return finish
    return {
        "type": "abort",
        "message": finish.get("message"),
        "status_code": finish.get("status_code"),
        "err_type": finish.get("err_type"),
    }


def _is_batch(body: dict[str, Any]) -> bool:
    text = body.get("text")
    if isinstance(text, list):
        return True
    ids = body.get("input_ids")
    return isinstance(ids, list) and bool(ids) and all(isinstance(row, list) for row in ids)


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(400, f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


def _commit_from(value: Any) -> int | None:
    """``gemm_commit_from``: the latest position a commitment may start at (the miner sends its
    buyer's prompt length − 1), so the prefix cache never takes the whole prompt out of it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, "gemm_commit_from must be a position (an integer ≥ 0)", contract=True)
    return value


def _bool_field(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"invalid type: {name} must be a boolean, got {json.dumps(value)[:40]}", contract=True)
    return value


async def _json_body(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    try:
        return await read_json_object(request.receive, max_bytes=MAX_BODY_BYTES, allow_empty=allow_empty)
    except BodyError as error:
        raise ApiError(error.status, str(error), contract=error.status == 400) from None


def build_app(reference: ReferenceApp) -> Starlette:
    openai = OpenAiRoutes(reference.engine, model_name=reference.info.served_model_name)
    gemm = GemmRoutes(reference.openings)
    routes = [
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/generate", reference.generate, methods=["POST", "PUT"]),
        Route("/abort_request", reference.abort_request, methods=["POST"]),
        Route("/health", reference.health, methods=["GET"]),
        Route("/health_generate", reference.health_generate, methods=["GET"]),
        Route("/ready", reference.health, methods=["GET"]),
        Route("/get_model_info", reference.model_info, methods=["GET"]),
        Route("/model_info", reference.model_info, methods=["GET"]),
        Route("/get_server_info", reference.server_info, methods=["GET"]),
        Route("/server_info", reference.server_info, methods=["GET"]),
        Route("/v1/models", reference.models, methods=["GET"]),
        Route("/v1/models/{name:path}", reference.model, methods=["GET"]),
        Route("/flush_cache", reference.flush_cache, methods=["GET", "POST"]),
        Route("/get_load", reference.get_load, methods=["GET"]),
        Route("/metrics", reference.metrics, methods=["GET"]),
        Route("/engy/prefill", reference.prefill, methods=["POST"]),
        Route("/gemm/openings", gemm.openings_route, methods=["POST"]),
    ]
    return Starlette(routes=routes)
