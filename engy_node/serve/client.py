"""The client for sglang's native `/generate` that the miner and the verifier share.

It works against real sglang 0.5.x and against our reference server alike, and is shaped by
three facts about them:

* **Streams are cumulative.** Every SSE event carries the whole result so far (text, ids,
  logprobs and — with `return_hidden_states` — every hidden state again). Only the newest event
  matters, so `SseParser` scans each received byte once for event boundaries and hands back just
  the newest complete event: parsing stays linear in the bytes received even when one event is
  hundreds of MB, and older events are never decoded.
* **Long outputs are generated in chunks** (default 4,096 tokens per call): a single 32k-token
  call with hidden states can balloon the server's memory. Each later chunk re-sends the prompt
  plus all output but the last token, so its first generated token re-derives that last token
  and every later row is a decode vector; for greedy decoding the result equals one call.
* **Cancellation must reach the GPU.** Every call carries an explicit `rid`; if the caller is
  cancelled (the buyer hung up), the client posts `/abort_request` for it under a shielded,
  short deadline before letting the cancellation continue.

Hidden states come back ragged: element 0 is the prefill block (2-D; its last row produced output
token 0; possibly empty after a full prefix-cache hit), then one vector per decode step. The
client keeps exactly one row per output token, in order — what TOPLOC commits to.

A GEMM audit's activation commitment (``return_gemm_commitment``, docs/protocol.md "GEMM audits")
is asked for on every call of a chunked generation and the last call's is kept: that call
re-sends the prompt and all output but the last token, so its record covers every position of
the whole answer (a prefix the server takes from its cache ends inside the prompt:
``gemm_commit_from``), and it is filed under that call's rid (`GenerateResult.gemm_rid`), which
`open_gemm` later names. Only servers that say so in `/get_server_info` (`gemm_support`) can.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import orjson
import trio

log = logging.getLogger("engy.serve.client")

DEFAULT_CHUNK_TOKENS = 4096
ABORT_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 3.0
OPEN_GEMM_TIMEOUT_S = 20.0
"""How long `open_gemm` waits: the reference server opens a challenge of its most picks in well
under a second, so this leaves room for a busy CPU while a gateway's deadline still holds."""


class ServeError(Exception):
    """The model server failed a request; `status` is the HTTP status when there was one."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SseParser:
    """Incremental parser for `data:` server-sent events (sglang emits one data line per event).

    `feed` scans only bytes it has not scanned before, so total work is linear in the stream's
    length however it is chunked."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._scanned = 0

    def feed(self, data: bytes) -> list[bytes]:
        """Append `data`; return the payloads of events completed by it, oldest first."""
        self._buffer += data
        events: list[bytes] = []
        start = 0
        while True:
            boundary, width = self._find_boundary(max(self._scanned, start))
            if boundary < 0:
                break
            events.append(_event_data(bytes(self._buffer[start:boundary])))
            start = boundary + width
        if start:
            del self._buffer[:start]
        self._scanned = max(0, len(self._buffer) - 3)
        return [event for event in events if event]

    def _find_boundary(self, offset: int) -> tuple[int, int]:
        lf = self._buffer.find(b"\n\n", offset)
        crlf = self._buffer.find(b"\r\n\r\n", offset)
        if crlf >= 0 and (lf < 0 or crlf < lf):
            return crlf, 4
        return lf, (2 if lf >= 0 else 0)

    def pending(self) -> int:
        return len(self._buffer)


def _event_data(block: bytes) -> bytes:
    lines = [line.rstrip(b"\r") for line in block.split(b"\n")]
    data = [line[5:].lstrip(b" ") if line.startswith(b"data:") else None for line in lines]
    return b"\n".join(part for part in data if part is not None)


@dataclasses.dataclass
class GenerateResult:
    """One finished generation (possibly assembled from several chunked calls)."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int
    text: str
    """The server's text for single-call results; the caller re-decodes chunked ones."""
    hidden_rows: list[list[float]]
    """One final hidden state per output token (empty when hidden states were not asked for)."""
    calls: int = 1
    first_token_s: float | None = None
    """Seconds from the first call to the first output token seen (streamed calls only)."""
    gemm_commitment: dict[str, Any] | None = None
    """The last call's ``meta_info.gemm_commitment`` when one was asked for (module doc)."""
    gemm_rid: str | None = None
    """The rid the server filed that commitment's record under, for `open_gemm`."""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class GemmSupport:
    """A server's activation commitments (`ServeClient.gemm_support`)."""

    format: str
    """``engy-activations-v2`` (`engy_node.gemm.activations.FORMAT`) on this release's servers;
    a miner relays any format of `FORMATS`, which verifiers read."""
    most_positions: int
    """The prompt plus ``max_new_tokens`` a committed request may reach: the server refuses to
    capture one whose record could not fit its store (a 400), so a longer request is served
    without a commitment rather than failed."""


def rows_per_token(hidden_states: Sequence[Any]) -> tuple[list[list[float]], int]:
    """(rows, missing): one row per output token from sglang's ragged list. A 2-D element
    contributes its last row, a 1-D element itself; `missing` counts leading tokens with no
    row (an empty prefill block after a full prefix-cache hit)."""
    rows: list[list[float]] = []
    missing = 0
    for element in hidden_states:
        if not element:
            if not rows:
                missing += 1
            continue
        rows.append(element[-1] if isinstance(element[0], list) else element)
    return rows, missing


ProgressCallback = Callable[[list[int], str], Awaitable[None] | None]
"""Called with (output ids so far, server text so far) as a streamed call advances."""


class ServeClient:
    """One model server's native API. Cheap to create; shares the caller's httpx client."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, *, request_timeout_s: float = 1800.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.request_timeout_s = request_timeout_s
        self.gemm_url = self.base_url
        """Where `open_gemm` asks: the server itself, or the capture's own port beside sglang
        (`engy_node.miner.sglang.capture_client`)."""
        self._kv_limit: int | None = None

    async def abort(self, rid: str) -> bool:
        """Ask the server to stop `rid`; True when it answered below 400. Never raises."""
        if self.http.is_closed:
            # Shutdown: the owner's client closed before this request's cleanup ran, so the
            # server (stopping too) cannot be told; httpx would raise RuntimeError here.
            log.warning(
                "could not abort %s on %s: the HTTP client is already closed (shutting down)", rid, self.base_url
            )
            return False
        try:
            with trio.fail_after(ABORT_TIMEOUT_S):
                response = await self.http.post(f"{self.base_url}/abort_request", json={"rid": rid})
            return response.status_code < 400
        except (httpx.HTTPError, trio.TooSlowError) as error:
            log.warning("could not abort %s on %s: %s", rid, self.base_url, type(error).__name__)
            return False

    async def load(self) -> tuple[list, int | None]:
        """(sglang's `/get_load` list, `max_total_num_tokens` from `/get_server_info`): what the
        server holds and can hold. The size is read once; raises `httpx.HTTPError`, `ServeError`
        or `ValueError` (a body that is not JSON) when the server does not say."""
        if self._kv_limit is None:
            response = await self.http.get(f"{self.base_url}/get_server_info", timeout=LOAD_TIMEOUT_S)
            raise_for_status(response)
            info = orjson.loads(response.content)
            limit = info.get("max_total_num_tokens") if isinstance(info, dict) else None
            self._kv_limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
        response = await self.http.get(f"{self.base_url}/get_load", timeout=LOAD_TIMEOUT_S)
        raise_for_status(response)
        return orjson.loads(response.content), self._kv_limit or None

    async def gemm_support(self) -> GemmSupport | None:
        """What activation commitments the server can make (`/get_server_info`'s
        ``gemm_commitments``, which the reference server sets and sglang does not: its capture
        says so on a port of its own, `capture_client`); None when it names none. Raises
        `ServeError` naming the server when it does not answer."""
        try:
            response = await self.http.get(f"{self.base_url}/get_server_info", timeout=LOAD_TIMEOUT_S)
            raise_for_status(response)
            info = orjson.loads(response.content)
        except (httpx.HTTPError, ServeError, orjson.JSONDecodeError) as error:
            raise ServeError(
                f"the model server {self.base_url} did not say whether it commits its activations "
                f"({type(error).__name__}: {error})",
                status=error.status if isinstance(error, ServeError) else None,
            ) from None
        return gemm_support_of(info.get("gemm_commitments") if isinstance(info, dict) else None)

    async def open_gemm(
        self, rid: str, picks: Sequence[dict[str, Any]], *, timeout_s: float = OPEN_GEMM_TIMEOUT_S
    ) -> dict[str, Any]:
        """`POST /gemm/openings`: the rows `picks` names of the record filed under `rid`, with
        their Merkle paths (``{"rid", "activations_root", "positions", "openings"}``). Raises
        `ServeError`: with the server's message and status for a record it no longer holds (404)
        or picks it refuses (400); or when it does not answer within `timeout_s`."""
        try:
            with trio.fail_after(timeout_s):
                response = await self.http.post(
                    f"{self.gemm_url}/gemm/openings", json={"rid": rid, "picks": list(picks)}, timeout=None
                )
        except trio.TooSlowError:
            raise ServeError(f"the model server did not open {rid} within {timeout_s:.0f} s") from None
        except httpx.HTTPError as error:
            raise ServeError(f"model server unreachable at {self.gemm_url}: {type(error).__name__}: {error}") from None
        raise_for_status(response)
        try:
            payload = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict) or not isinstance(payload.get("openings"), list):
            raise ServeError(f"the model server's openings for {rid} are not an object with an openings list")
        return payload

    def rid_prefix(self, rid_prefix: str | None, *, committing: bool) -> str:
        """What a generation's rids start with (one rid per call): the caller's prefix, or a
        fresh one. `committing`: the generation asks for an activation commitment."""
        return rid_prefix or f"engy-{uuid.uuid4().hex}"

    async def generate_once(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        rid: str,
        return_hidden_states: bool = True,
        return_gemm_commitment: bool = False,
        gemm_commit_from: int | None = None,
        stream: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """One `/generate` call; returns the final result object. Cancellation aborts `rid`.
        `gemm_commit_from`: the latest position its commitment may start at (module doc)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "rid": rid,
            "return_hidden_states": return_hidden_states,
            "return_logprob": True,
        }
        if return_gemm_commitment:
            body["return_gemm_commitment"] = True
            if gemm_commit_from is not None:
                body["gemm_commit_from"] = gemm_commit_from
        finished = False
        try:
            with trio.fail_after(self.request_timeout_s):
                if stream:
                    body["stream"] = True
                    result = await self._stream(body, on_progress)
                else:
                    response = await self.http.post(f"{self.base_url}/generate", json=body, timeout=None)
                    raise_for_status(response)
                    result = orjson.loads(response.content)
                    if isinstance(result, list):
                        result = result[0]
            finished = True
            return result
        except trio.TooSlowError:
            raise ServeError(f"the model server did not finish {rid} within {self.request_timeout_s:.0f} s") from None
        except httpx.HTTPError as error:
            raise ServeError(f"model server unreachable at {self.base_url}: {type(error).__name__}: {error}") from None
        finally:
            if not finished:
                with trio.CancelScope(shield=True):
                    await self.abort(rid)

    async def _stream(self, body: dict[str, Any], on_progress: ProgressCallback | None) -> dict[str, Any]:
        parser = SseParser()
        latest: dict[str, Any] | None = None
        async with self.http.stream("POST", f"{self.base_url}/generate", json=body, timeout=None) as response:
            if response.status_code >= 400:
                await response.aread()
                raise_for_status(response)
            async for data in response.aiter_bytes():
                events = parser.feed(data)
                if not events:
                    continue
                newest = events[-1]
                if newest == b"[DONE]":
                    if len(events) > 1:
                        latest = _decode_event(events[-2])
                    break
                latest = _decode_event(newest)
                if on_progress is not None and latest.get("output_ids") is not None:
                    outcome = on_progress(list(latest["output_ids"]), latest.get("text", ""))
                    if outcome is not None:
                        await outcome
        if latest is None:
            raise ServeError("the model server's stream ended without a result")
        return latest

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        max_new_tokens: int,
        rid_prefix: str | None = None,
        return_hidden_states: bool = True,
        return_gemm_commitment: bool = False,
        stream: bool = False,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        on_progress: ProgressCallback | None = None,
    ) -> GenerateResult:
        """Generate up to `max_new_tokens`, in chunks of at most `chunk_tokens` (see module doc)."""
        if chunk_tokens < 2:
            raise ValueError("chunk_tokens must be at least 2 (one token overlaps)")
        rid_prefix = self.rid_prefix(rid_prefix, committing=return_gemm_commitment)
        prompt = list(input_ids)
        output: list[int] = []
        rows: list[list[float]] = []
        started = time.perf_counter()
        first_token_s: float | None = None
        cached_tokens = 0
        text = ""
        finish: dict[str, Any] = {"type": "length", "length": max_new_tokens}
        call = 0
        gemm_commitment: dict[str, Any] | None = None
        gemm_rid: str | None = None

        while True:
            overlap = 1 if output else 0
            remaining = max_new_tokens - len(output)
            budget = min(chunk_tokens, remaining + overlap)
            sent = prompt + output[:-1] if overlap else prompt
            base = list(output[:-1]) if overlap else []

            async def progress(ids: list[int], server_text: str, base=base) -> None:
                nonlocal first_token_s
                if ids and first_token_s is None:
                    first_token_s = time.perf_counter() - started
                if on_progress is not None:
                    outcome = on_progress(base + ids, server_text)
                    if outcome is not None:
                        await outcome

            rid = f"{rid_prefix}-{call}"
            result = await self.generate_once(
                sent,
                {**sampling_params, "max_new_tokens": budget},
                rid=rid,
                return_hidden_states=return_hidden_states,
                return_gemm_commitment=return_gemm_commitment,
                gemm_commit_from=len(prompt) - 1 if overlap else None,
                stream=stream,
                on_progress=progress,
            )
            meta = result.get("meta_info") or {}
            if return_gemm_commitment:
                committed = meta.get("gemm_commitment")
                gemm_commitment, gemm_rid = (
                    (committed, rid) if isinstance(committed, dict) and committed else (None, None)
                )
            ids = list(result.get("output_ids") or [])
            finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
            if call == 0:
                cached_tokens = int(meta.get("cached_tokens") or 0)
                text = result.get("text", "")
            new_rows: list[list[float]] = []
            if return_hidden_states:
                new_rows, missing = rows_per_token(meta.get("hidden_states") or [])
                if missing and not overlap:
                    raise ServeError(
                        "the model server returned no hidden state for the first output token "
                        "(empty prefill block); cannot build a proof"
                    )
                if len(new_rows) + missing != len(ids):
                    raise ServeError(
                        f"the model server returned {len(new_rows) + missing} hidden states for {len(ids)} tokens"
                    )
            if overlap and ids:
                if ids[0] != output[-1]:
                    # A sampled re-derivation chose differently: keep the new token and its row.
                    if return_hidden_states and missing:
                        raise ServeError(
                            "the re-derived overlap token differs and has no hidden state; cannot build a proof"
                        )
                    output[-1] = ids[0]
                    if return_hidden_states:
                        rows[-1] = new_rows[0]
                ids, new_rows = ids[1:], (new_rows[1:] if return_hidden_states and not missing else new_rows)
            output.extend(ids)
            rows.extend(new_rows)
            call += 1
            if finish.get("type") != "length" or len(output) >= max_new_tokens:
                break
        if finish.get("type") == "length":
            finish = {"type": "length", "length": max_new_tokens}
        return GenerateResult(
            output_ids=output,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached_tokens,
            text=text,
            hidden_rows=rows,
            calls=call,
            first_token_s=first_token_s,
            gemm_commitment=gemm_commitment,
            gemm_rid=gemm_rid,
        )


def _decode_event(payload: bytes) -> dict[str, Any]:
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise ServeError(f"the model server sent an event that is not JSON ({len(payload)} bytes)") from None
    if not isinstance(event, dict):
        raise ServeError("the model server sent an event that is not an object")
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise ServeError(f"the model server failed the request: {message}")
    return event


def gemm_support_of(gemm: Any) -> GemmSupport | None:
    """The `GemmSupport` a server's ``gemm_commitments`` object describes; None when it is not one."""
    if not isinstance(gemm, dict):
        return None
    name, most, each = gemm.get("format"), _count(gemm.get("max_bytes")), _count(gemm.get("bytes_per_position"))
    if not (isinstance(name, str) and name and most and each):
        return None
    return GemmSupport(name, most // each)


def _count(value: Any) -> int:
    """`value` when a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def error_message(response: httpx.Response) -> str:
    """The message of a server's error answer: its JSON ``error.message`` (or ``detail``), else
    the start of its body."""
    try:
        body = orjson.loads(response.content)
        error = body.get("error", body.get("detail", body))
        return str(error.get("message") if isinstance(error, dict) else error)
    except (orjson.JSONDecodeError, AttributeError):
        return response.text[:300]


def raise_for_status(response: httpx.Response) -> None:
    """Raise `ServeError` with the server's own message and status for an answer of 400 or more."""
    if response.status_code < 400:
        return
    raise ServeError(
        f"the model server answered {response.status_code}: {error_message(response)}", status=response.status_code
    )
