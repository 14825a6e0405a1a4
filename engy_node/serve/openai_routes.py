"""The reference server's OpenAI-compatible routes, as sglang's OpenAI server answers them.

`POST /v1/chat/completions` and `POST /v1/completions`, streamed and not, over the same engine as
`/generate`: a miner that expects an OpenAI server (the public TEE miner streams from
`/v1/chat/completions`) runs on the reference server, and a buyer can compare the gateway with a
bare serve. What sglang does, and so what this does:

* chat: the checkpoint's chat template renders `messages` with `tools` and `chat_template_kwargs`
  (`enable_thinking`); the answer comes back in parts, as sglang with `--reasoning-parser` and
  `--tool-call-parser` gives it (`model_output`: reasoning as `reasoning_content`, tool calls as
  `tool_calls`, `finish_reason` `tool_calls`); `usage` counts prompt and completion tokens, and
  the prompt tokens that came from the prefix cache (`prompt_tokens_details.cached_tokens`);
* completions: `prompt` as text or token ids; `echo` puts the prompt before the answer, and
  with `logprobs` the prompt's own tokens get theirs (the first none: nothing predicts it), from
  one prefill over the prompt on the engine thread;
* `logprobs`: the chosen tokens' log probabilities (chat: `logprobs: true`; completions: an
  integer). Alternatives per position (`top_logprobs` > 0) are not computed here: a 400 says so;
* sampling: `temperature`, `top_p`, `top_k`, `seed` (sglang's `sampling_seed`), `stop`,
  `max_tokens` / `max_completion_tokens`; `n` above 1 is refused as `/generate` refuses it;
* streaming: `data:` chunks (`chat.completion.chunk` with the role first, then deltas;
  `text_completion` pieces), the finish reason in the last one, usage in a chunk of its own when
  `stream_options.include_usage` asks, then `data: [DONE]`. A client that hangs up aborts its
  generation.

Errors are OpenAI's shape: `{"object": "error", "message", "type", "param", "code"}` with the
status, as sglang's OpenAI server writes them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import orjson
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engy_node.asgi import BodyError, read_json_object, watching_disconnect
from engy_node.model_output import OutputParser, ReasoningDelta, TextDelta, ToolCall, parse_output
from engy_node.serve.engine import Engine, Generation, RequestError, run_on_engine
from engy_node.serve.sampling import SamplingError, parse_sampling_params

MAX_BODY_BYTES = 64 * 1024 * 1024


class OpenAiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def response(self) -> JSONResponse:
        kind = "BadRequestError" if self.status == 400 else "InternalServerError"
        return JSONResponse(
            {"object": "error", "message": str(self), "type": kind, "param": self.param, "code": self.status},
            status_code=self.status,
        )


def _sampling(body: Mapping[str, Any], *, default_max_tokens: int) -> dict[str, Any]:
    """sglang sampling parameters from an OpenAI body (validated by `parse_sampling_params`)."""
    if body.get("n") not in (None, 1):
        raise OpenAiError(
            400, "n > 1 is not supported by the engy reference server; send n separate requests", param="n"
        )
    top = body.get("top_logprobs")
    if top not in (None, 0) or (
        isinstance(body.get("logprobs"), int) and not isinstance(body.get("logprobs"), bool) and body["logprobs"] > 0
    ):
        raise OpenAiError(
            400,
            "alternatives per position are not computed by the engy reference server; ask for the "
            "chosen tokens' log probabilities only (top_logprobs 0)",
            param="top_logprobs",
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params: dict[str, Any] = {"max_new_tokens": default_max_tokens if max_tokens is None else max_tokens}
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "ignore_eos",
        "skip_special_tokens",
    ):
        if body.get(key) is not None:
            params[key] = body[key]
    if body.get("seed") is not None:
        params["sampling_seed"] = body["seed"]
    params.setdefault("temperature", 1.0)
    return params


class OpenAiRoutes:
    """`/v1/chat/completions` and `/v1/completions` over one engine."""

    def __init__(self, engine: Engine, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await _body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise OpenAiError(400, "messages must be a non-empty list", param="messages")
            tools = body.get("tools") or None
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, Mapping):
                raise OpenAiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
            try:
                prompt = self._render(messages, tools, kwargs)
            except Exception as error:  # broad on purpose: a template rejecting the input is the client's 400
                raise OpenAiError(400, f"the messages cannot be rendered with the chat template: {error}") from None
            generation = self._generation(body, prompt, logprobs=bool(body.get("logprobs")))
        except OpenAiError as error:
            return error.response()
        answer = _Answer(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, tools=tools)
        if body.get("stream"):
            return StreamingResponse(
                self._chat_stream(generation, answer, _include_usage(body)), media_type="text/event-stream"
            )
        finished = await self._wait(request, generation)
        if finished is not None:
            return finished
        return JSONResponse(answer.chat_body(generation, self.engine.runner))

    async def completions(self, request: Request) -> Response:
        try:
            body = await _body(request)
            prompt = self._prompt(body.get("prompt"))
            echo = bool(body.get("echo"))
            logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
            generation = self._generation(body, prompt, logprobs=logprobs)
        except OpenAiError as error:
            return error.response()
        answer = _Answer(f"cmpl-{uuid.uuid4().hex}", self.model_name, tools=None)
        prompt_logprobs = None
        if echo and logprobs:
            prompt_logprobs = await self._prompt_logprobs(prompt)
        if body.get("stream"):
            return StreamingResponse(
                self._completion_stream(generation, answer, _include_usage(body), echo=echo),
                media_type="text/event-stream",
            )
        finished = await self._wait(request, generation)
        if finished is not None:
            return finished
        return JSONResponse(
            answer.completion_body(
                generation, self.engine.runner, echo=echo, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )
        )

    # ---- the work ----------------------------------------------------------------------------
    def _render(self, messages: list, tools: Any, kwargs: Mapping[str, Any]) -> list[int]:
        ids = self.engine.runner.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **dict(kwargs)
        )
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def _prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.runner.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return self._prompt(prompt[0])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise OpenAiError(
            400, "prompt must be a string or a non-empty list of token ids (one prompt per request)", param="prompt"
        )

    def _generation(self, body: Mapping[str, Any], prompt: list[int], *, logprobs: bool) -> Generation:
        runner = self.engine.runner
        try:
            params = parse_sampling_params(
                _sampling(body, default_max_tokens=max(1, runner.context_length - len(prompt)))
            )
        except SamplingError as error:
            raise OpenAiError(400, str(error)) from None
        generation = Generation(
            rid=f"openai-{uuid.uuid4().hex}", input_ids=prompt, params=params, return_logprob=logprobs
        )
        generation.on_update = _Wake(trio.lowlevel.current_trio_token())
        try:
            self.engine.submit(generation)
        except RequestError as error:
            raise OpenAiError(400, str(error)) from None
        return generation

    async def _prompt_logprobs(self, prompt: list[int]) -> list[float | None]:

        def work(runner) -> list[float | None]:
            import torch

            _, logits = runner.prefill(prompt)
            chosen = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            return [None, *chosen.tolist()]

        return await run_on_engine(self.engine, work)

    async def _wait(self, request: Request, generation: Generation) -> Response | None:
        """Wait for the generation; an error response when it failed, None when it finished."""
        wake = generation.on_update
        assert isinstance(wake, _Wake)  # set by _generation

        async def done() -> None:
            while not generation.finished:
                await wake.wait()

        finished, _ = await watching_disconnect(request.receive, done)
        if not finished:
            self.engine.abort(generation.rid, prefix=False, message="client disconnected")
            return Response(status_code=499)
        failure = generation.finish_reason or {}
        if failure.get("status_code"):
            return OpenAiError(int(failure["status_code"]), str(failure.get("message"))).response()
        return None

    def _chat_stream(self, generation: Generation, answer: _Answer, include_usage: bool) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            parser = OutputParser(call_id_prefix=answer.id[-12:], tools=answer.tools)
            sent, called = "", False
            yield answer.chunk({"role": "assistant", "content": ""})
            async for text, final in _texts(generation):
                events = parser.feed(text[len(sent) :]) + (parser.finish() if final else [])
                sent = text
                called = called or any(isinstance(e, ToolCall) for e in events)
                delta = _delta(events)
                if delta:
                    yield answer.chunk(delta)
                if final:
                    yield answer.chunk({}, finish=answer.finish(generation, called=called))

        return self._stream(generation, answer, include_usage, chunks())

    def _completion_stream(
        self, generation: Generation, answer: _Answer, include_usage: bool, *, echo: bool
    ) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            sent = ""
            if echo:
                yield answer.text_chunk(self.engine.runner.decode_text(generation.input_ids))
            async for text, final in _texts(generation):
                piece, sent = text[len(sent) :], text
                if piece or final:
                    yield answer.text_chunk(piece, finish=answer.finish(generation, called=False) if final else None)

        return self._stream(generation, answer, include_usage, chunks())

    async def _stream(
        self, generation: Generation, answer: _Answer, include_usage: bool, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """An SSE stream of `chunks`, then the usage chunk if asked for and `[DONE]`; a client
        that leaves before the end aborts the generation."""
        finished_cleanly = False
        try:
            async for chunk in chunks:
                yield chunk
            if include_usage:
                yield answer.usage_chunk(generation)
            finished_cleanly = True
            yield b"data: [DONE]\n\n"
        finally:
            if not finished_cleanly:
                self.engine.abort(generation.rid, prefix=False, message="client disconnected")


class _Wake:
    """Wakes the trio task waiting on one generation when the engine thread updates it."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.event = trio.Event()

    def __call__(self, _generation: Generation) -> None:
        try:
            self.token.run_sync_soon(self.event.set)
        except trio.RunFinishedError:
            pass

    async def wait(self) -> None:
        await self.event.wait()
        self.event = trio.Event()


async def _texts(generation: Generation) -> AsyncIterator[tuple[str, bool]]:
    """The generation's streamable text as it grows (`visible_text`), and whether it is final."""
    wake = generation.on_update
    assert isinstance(wake, _Wake)  # set by OpenAiRoutes._generation
    seen = -1
    while True:
        version = generation.version
        if version != seen:
            seen = version
            final = generation.finished
            if (generation.finish_reason or {}).get("status_code"):
                return
            yield generation.visible_text, final
            if final:
                return
        await wake.wait()


def _delta(events: Sequence[Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [
        {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": e.arguments}}
        for e in events
        if isinstance(e, ToolCall)
    ]
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


class _Answer:
    """One response's identity and its bodies and chunks."""

    def __init__(self, response_id: str, model: str, *, tools: Any) -> None:
        self.id = response_id
        self.model = model
        self.tools = tools
        self.created = int(time.time())

    def finish(self, generation: Generation, *, called: bool) -> str:
        kind = (generation.finish_reason or {}).get("type")
        if kind == "length":
            return "length"
        return "tool_calls" if called else "stop"

    def usage(self, generation: Generation) -> dict[str, Any]:
        prompt, completion = len(generation.input_ids), len(generation.output_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens},
        }

    def chat_body(self, generation: Generation, runner) -> dict[str, Any]:
        events = parse_output(generation.text, call_id_prefix=self.id[-12:], tools=self.tools)
        delta = _delta(events)
        message: dict[str, Any] = {"role": "assistant", "content": delta.get("content")}
        if "reasoning_content" in delta:
            message["reasoning_content"] = delta["reasoning_content"]
        if "tool_calls" in delta:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": self.finish(generation, called="tool_calls" in delta),
        }
        if generation.return_logprob:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": runner.decode_text([token], skip_special_tokens=False),
                        "logprob": logprob,
                        "top_logprobs": [],
                    }
                    for token, logprob in zip(generation.output_ids, generation.output_logprobs)
                ]
            }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(generation),
        }

    def completion_body(
        self, generation: Generation, runner, *, echo: bool, logprobs: bool, prompt_logprobs: list[float | None] | None
    ) -> dict[str, Any]:
        text = generation.text
        choice: dict[str, Any] = {
            "index": 0,
            "text": (runner.decode_text(generation.input_ids) if echo else "") + text,
            "logprobs": None,
            "finish_reason": self.finish(generation, called=False),
        }
        if logprobs:
            ids = (list(generation.input_ids) if echo else []) + list(generation.output_ids)
            values = (prompt_logprobs or [None] * len(generation.input_ids) if echo else []) + list(
                generation.output_logprobs
            )
            tokens = [runner.decode_text([token], skip_special_tokens=False) for token in ids]
            offsets, at = [], 0
            for token in tokens:
                offsets.append(at)
                at += len(token)
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": values,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(generation),
        }

    def chunk(self, delta: dict[str, Any], *, finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
        )

    def text_chunk(self, text: str, *, finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }
        )

    def usage_chunk(self, generation: Generation) -> bytes:
        return _sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage(generation),
            }
        )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


async def _body(request: Request) -> dict[str, Any]:
    try:
        return await read_json_object(request.receive, max_bytes=MAX_BODY_BYTES)
    except BodyError as error:
        raise OpenAiError(error.status, str(error)) from None
