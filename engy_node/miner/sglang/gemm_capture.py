"""The GEMM audit's capture inside an sglang server (issue 32 item 2): the rows each decoder
layer's projections consumed and produced, for the requests that asked, committed with
`engy_node.gemm.activations` exactly as the reference server's `engy_node.serve.capture` does,
and opened over a loopback HTTP port of its own.

How it gets in. sglang runs the model in a scheduler process we do not write, so this module is
loaded there by ``sitecustomize`` (the ``site/`` folder next to this file, put on the server's
``PYTHONPATH`` by `command.sglang_launch`, the way the public SN53 miner arms its hidden-state
trim): `install` wraps sglang's ``ModelRunner.load_model`` so that, once a model is loaded in a
process, `SglangCapture` hooks its layers and `serve` starts the opening server on
``ENGY_GEMM_CAPTURE_PORT``. Nothing happens in a process where that variable is unset.

Which requests. A request asks by its rid: the miner sends rid ``RID_PREFIX + unique`` to
``/generate``. The rid is the one thing about a request that reaches the forward pass in every
sglang version (``ForwardBatch.rids``); a flag in ``custom_params`` reaches only the sampler,
and only under a custom logit processor. The server is on loopback behind the miner, so only
the miner chooses rids.

Rows. In a forward batch a request owns ``extend_seq_lens_cpu[i]`` consecutive rows (prefill
and chunked prefill; MIXED batches list their decode requests as 1-row extends) starting at
position ``extend_prefix_lens_cpu[i]``, or one row at position ``seq_lens[i] − 1`` (decode).
Every hook copies only the asking requests' rows, the moment its module returns: sglang's
fused RMSNorm overwrites its inputs in place (``x`` becomes the normed value, ``residual`` the
sum), so a row read later would be another value.

Exactness, sglang's shapes. q, k and v are column slices of one ``qkv_proj`` GEMM's output, and
gate/up of ``gate_up_proj``'s: the same bits the merged GEMM produced, split by the layout's
widths. ``residual_in`` of layer l > 0 is the residual the fused input norm returns (the previous
layer's residual plus its MLP output, added where transformers adds them), of layer 0 the
embedding; the last layer's ``residual_out`` is the residual the model's final norm returns.
As in the reference capture, the tensor each consumer read is checked to be the very object its
producer returned (q/k/v's input is the input norm's output, a layer's inputs are the previous
layer's outputs).

What it refuses, instead of committing rows it did not see. Positions must arrive in order from
0: a request whose prefix came from the radix cache, or whose decode steps replayed a CUDA graph
(hooks do not run inside a replay), has a gap and gets no commitment; the reason names the
launch flag (``--disable-radix-cache``, ``--disable-cuda-graph``; `command.sglang_launch` adds
both when the capture is on). A batch of another kind (speculative verify, split prefill), a
width the layout does not expect (tensor parallelism > 1 shards q/k/v and gate/up) or any
failure inside a hook marks the asking requests broken and never touches serving: a capture bug
must not take the server down.

When a record closes. The forward pass does not know when a request finished, so the miner says
so after the answer: ``GET /gemm/commitment/{rid}?positions=N`` (N = prompt + output − 1, as
the reference server commits) hashes the first N captured positions, files the record in a
`SharedOpenings` store (same window and cap as the reference server), and answers the
commitment wire (``weights_root`` from ``ENGY_GEMM_WEIGHTS_ROOT`` when set, ``arithmetic`` the
served dtype). Rows past N (sglang's overlap scheduler runs a finished request one step more)
are dropped. ``POST /gemm/openings`` takes and answers exactly what `engy_node.serve.gemm_routes`
does. ``GET /gemm/info`` says what it commits, in the shape of the reference server's
``gemm_commitments``, or answers 409 with why it commits nothing and the fix (`refusal_of`: a
model the hooks do not know, tensor or data parallelism, a launch flag missing; the server
then hooks nothing); the miner's `capture_client` reads it to decide whether to take GEMM
audits. The commitment is not put into sglang's ``meta_info``: that is built in another process.

Limits: tensor parallelism 1 and Llama-shaped models (``model.model.layers`` with ``self_attn.
qkv_proj``/``o_proj``, ``mlp.gate_up_proj``/``down_proj`` and the two norms); no torch.compile;
the hashing (61 leaves per SmolLM2 position in ``engy-activations-v2``) runs when the commitment
is asked for, on the opening server's thread. The server is stdlib `http.server` on a daemon
thread, not trio: it runs inside sglang's process, whose environment has neither trio nor our
ASGI stack.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import numpy.typing as npt

from engy_node.gemm.activations import (
    RESIDUAL_OUT,
    ActivationLayout,
    CommitmentError,
    RecordBuilder,
    llama_layout,
    parse_picks,
)
from engy_node.serve.capture import MAX_PICKS, SharedOpenings, exact_arithmetic

log = logging.getLogger("engy.miner.gemm_capture")

RID_PREFIX = "engy-gemm-"
"""A request whose rid starts with this is captured."""
PORT_ENV = "ENGY_GEMM_CAPTURE_PORT"
WEIGHTS_ROOT_ENV = "ENGY_GEMM_WEIGHTS_ROOT"
MAX_BODY_BYTES = 1024 * 1024
"""As `engy_node.serve.gemm_routes`: a challenge of MAX_PICKS picks is about 200 KB."""
SOCKET_TIMEOUT_S = 30.0
PENDING_IDLE_S = 60.0
"""A request's captured rows untouched this long are dropped: a running request adds rows every
forward pass and the miner asks for the commitment as soon as sglang answers, so such rows are
an aborted request's (one sglang retracted starts again from position 0, which needs none)."""
COMMITTED_KEPT = 4096
"""Commitments remembered for a repeated ``GET /gemm/commitment`` (the record itself is in the store)."""

RADIX_HINT = "a radix-cache hit: launch sglang with --disable-radix-cache"
GRAPH_HINT = "decode steps replayed from a CUDA graph run no hooks: launch sglang with --disable-cuda-graph"


class CaptureRefused(Exception):
    """No commitment for this request; the message says why and names the fix."""

    def __init__(self, message: str, *, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True, slots=True)
class RowSpan:
    """One asking request's rows in a forward batch: `count` rows from batch row `row`, the first
    at token position `position`."""

    rid: str
    row: int
    count: int
    position: int


def plan_rows(
    rids: Sequence[str] | None,
    mode: str,
    *,
    extend_lens: Sequence[int] | None,
    prefix_lens: Sequence[int] | None,
    seq_lens: Sequence[int] | None,
    total_rows: int,
    prefix: str = RID_PREFIX,
) -> tuple[list[RowSpan], dict[str, str]]:
    """Which rows of a forward batch (`mode` is sglang's ForwardMode name) belong to the requests
    that asked, and the asking requests this batch cannot be captured for, with why."""
    if not rids:
        return [], {}
    asking = [i for i, rid in enumerate(rids) if rid.startswith(prefix)]
    if not asking:
        return [], {}
    if mode == "DECODE" and seq_lens is not None:
        counts, starts = [1] * len(rids), [int(n) - 1 for n in seq_lens]
    elif mode in ("EXTEND", "MIXED") and extend_lens is not None and prefix_lens is not None:
        counts, starts = [int(n) for n in extend_lens], [int(n) for n in prefix_lens]
    else:
        return [], {
            rids[i]: f"a {mode} forward pass is not captured (speculative decoding must be off)" for i in asking
        }
    if len(counts) != len(rids) or sum(counts) != total_rows:
        why = f"the batch's {total_rows} rows do not match its {len(rids)} requests' lengths {counts}"
        return [], {rids[i]: why for i in asking}
    firsts = np.cumsum([0, *counts])
    return [RowSpan(rids[i], int(firsts[i]), counts[i], starts[i]) for i in asking], {}


@dataclasses.dataclass(slots=True)
class _Pending:
    chunks: list[tuple[int, npt.NDArray[np.uint8]]]
    """(first position, rows × row_bytes), in position order."""
    positions: int
    touched: float
    broken: str = ""
    nbytes: int = 0
    """The chunks' bytes, kept as they change: summing them on every step cost more than the
    step's own copy once dozens of requests were in flight."""


class PendingRows:
    """Captured rows of requests not yet committed, by rid: positions must come in order from 0
    (an earlier position again is a recomputation, e.g. after sglang retracted the request, and
    replaces what followed it). An entry leaves when committed, or after `window_s` untouched
    (a request aborted or never committed). All entries together hold at most `max_bytes`: rows
    that would pass it break the request they belong to, never one already running, so a
    burst of long answers costs the newest their commitments rather than every answer its own.
    Thread-safe: the scheduler thread adds, the opening server's threads take."""

    def __init__(self, *, max_bytes: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        self._total = 0

    def add(self, rid: str, position: int, rows: npt.NDArray[np.uint8]) -> None:
        now = self._clock()
        with self._lock:
            self._expire(now)
            entry = self._entries.pop(rid, None)
            if entry is None:
                entry = _Pending([], 0, now)
                if position:
                    entry.broken = f"positions 0..{position - 1} were not computed with the capture on ({RADIX_HINT})"
            entry.touched = now
            if not entry.broken:
                if position > entry.positions:
                    entry.broken = f"positions {entry.positions}..{position - 1} were not captured ({GRAPH_HINT})"
                else:
                    if position < entry.positions:
                        self._resize(entry, _cut(entry.chunks, position))
                    if self._total + rows.nbytes > self.max_bytes:
                        entry.broken = (
                            f"the capture's rows awaiting commitment would pass its {self.max_bytes} bytes "
                            "(too many long committed answers at once): serve fewer at a time "
                            "(sglang's --max-running-requests)"
                        )
                    else:
                        entry.chunks.append((position, rows))
                        entry.nbytes += rows.nbytes
                        self._total += rows.nbytes
                        entry.positions = position + len(rows)
            if entry.broken:
                self._resize(entry, [])
            self._entries[rid] = entry

    def mark(self, rid: str, reason: str) -> None:
        now = self._clock()
        with self._lock:
            entry = self._entries.pop(rid, None) or _Pending([], 0, now)
            entry.touched = now
            entry.broken = entry.broken or reason
            self._resize(entry, [])
            self._entries[rid] = entry

    def take(self, rid: str) -> _Pending | None:
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.pop(rid, None)
            if entry is not None:
                self._total -= entry.nbytes
            return entry

    def _resize(self, entry: _Pending, chunks: list[tuple[int, npt.NDArray[np.uint8]]]) -> None:
        nbytes = sum(rows.nbytes for _, rows in chunks)
        self._total += nbytes - entry.nbytes
        entry.chunks, entry.nbytes = chunks, nbytes

    def _expire(self, now: float) -> None:
        """Drop the entries untouched for `window_s`, oldest first (the order they were touched)."""
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if now - entry.touched <= self.window_s:
                break
            self._total -= entry.nbytes
            del self._entries[rid]


def _capturing_graph() -> bool:
    """Whether this forward call is being recorded into a CUDA graph (its hooks run once, at
    capture, and never at replay: rows are not read here, and a replayed step leaves a gap)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _cut(chunks: list[tuple[int, npt.NDArray[np.uint8]]], position: int) -> list[tuple[int, npt.NDArray[np.uint8]]]:
    """The chunks' rows before `position`."""
    kept = []
    for start, rows in chunks:
        if start < position:
            kept.append((start, rows[: position - start]))
    return kept


class SglangCapture:
    """Hooks on one sglang Llama model that record the asking requests' rows (`attach`), and
    the commitments made from them (`commit`)."""

    def __init__(
        self,
        layout: ActivationLayout,
        openings: SharedOpenings,
        *,
        weights_root: str = "",
        arithmetic: str | None = None,
        prefix: str = RID_PREFIX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout = layout
        self.openings = openings
        self.weights_root = weights_root
        self.arithmetic = arithmetic or layout.dtype
        self.prefix = prefix
        self.pending = PendingRows(
            max_bytes=openings.max_bytes, window_s=min(PENDING_IDLE_S, openings.window_s), clock=clock
        )
        self._committed: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._committed_lock = threading.Lock()
        self._widths = {name: width for name, width in layout.groups}
        self._columns = layout.columns()
        self._spans: list[RowSpan] = []
        self._index: Any = None
        self._seen: dict[tuple[int, str], Any] = {}
        self._consumed: dict[tuple[int, str], Any] = {}

    # --- recording (the scheduler thread) -------------------------------------------------

    def attach(self, model: Any) -> list[Any]:
        """Hook `model` (sglang's LlamaForCausalLM shape); returns the hook handles."""
        inner = model.model
        layers = inner.layers
        if len(layers) != self.layout.layers:
            raise CommitmentError(f"the model has {len(layers)} decoder layers, the layout {self.layout.layers}")
        handles = [
            inner.register_forward_pre_hook(self._before_model, with_kwargs=True),
            inner.register_forward_hook(self._after_model),
            inner.norm.register_forward_hook(self._guarded(self._final_norm, self.layout.layers - 1)),
        ]
        for index, layer in enumerate(layers):
            for module, hook in (
                (layer.input_layernorm, self._input_norm),
                (layer.self_attn.qkv_proj, self._qkv),
                (layer.self_attn.o_proj, self._o),
                (layer.post_attention_layernorm, self._post_norm),
                (layer.mlp.gate_up_proj, self._gate_up),
                (layer.mlp.down_proj, self._down),
            ):
                handles.append(module.register_forward_hook(self._guarded(hook, index)))
        return handles

    def _before_model(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._spans, self._index = [], None
        self._seen, self._consumed = {}, {}
        batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        asking = [rid for rid in getattr(batch, "rids", None) or () if rid.startswith(self.prefix)]
        if not asking or _capturing_graph():
            return
        try:
            spans, broken = self._plan(batch, args, kwargs)
        except Exception as error:  # broad on purpose: a capture bug must not stop serving
            log.exception("GEMM capture: cannot read the forward batch")
            spans, broken = [], {rid: f"the capture could not read the batch: {error!r}" for rid in asking}
        for rid, why in broken.items():
            self.pending.mark(rid, why)
        self._spans = spans

    def _plan(self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[RowSpan], dict[str, str]]:
        embeds = kwargs.get("input_embeds", args[3] if len(args) > 3 else None)
        rows = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
        if rows is None:
            raise CommitmentError("the model was called without input_ids or input_embeds")
        seq_lens = batch.seq_lens_cpu if getattr(batch, "seq_lens_cpu", None) is not None else batch.seq_lens
        return plan_rows(
            list(batch.rids),
            getattr(batch.forward_mode, "name", str(batch.forward_mode)),
            extend_lens=batch.extend_seq_lens_cpu,
            prefix_lens=batch.extend_prefix_lens_cpu,
            seq_lens=None if seq_lens is None else [int(n) for n in seq_lens.tolist()],
            total_rows=int(rows.shape[0]),
            prefix=self.prefix,
        )

    def _guarded(self, hook: Callable[[int, tuple[Any, ...], Any], None], layer: int) -> Callable[..., None]:
        def run(module: Any, args: tuple[Any, ...], output: Any) -> None:
            if not self._spans:
                return
            try:
                hook(layer, args, output)
            except Exception as error:  # broad on purpose: a capture bug must not stop serving
                self._fail(f"layer {layer}: {error}")

        return run

    def _fail(self, why: str) -> None:
        log.warning("GEMM capture: %s", why)
        for span in self._spans:
            self.pending.mark(span.rid, why)
        self._spans = []

    def _take(self, tensor: Any) -> Any:
        """A copy of the asking requests' rows of `tensor`, in span order."""
        import torch

        if self._index is None or self._index.device != tensor.device:
            rows = [span.row + i for span in self._spans for i in range(span.count)]
            self._index = torch.tensor(rows, dtype=torch.long, device=tensor.device)
        return tensor.index_select(0, self._index)

    def _same(self, got: Any, key: tuple[int, str], what: str) -> None:
        if self._consumed.get(key) is not got:
            raise CommitmentError(f"{what} is not the tensor {key[1]} was (the model does not run as sglang's Llama)")

    def _split(self, layer: int, y: Any, names: tuple[str, ...]) -> None:
        rows, start = self._take(y), 0
        for name in names:
            width = self._widths[name]
            self._seen[layer, name] = rows[:, start : start + width]
            start += width
        if start != y.shape[-1]:
            raise CommitmentError(f"{'/'.join(names)} are {y.shape[-1]} wide, the layout says {start}")

    def _input_norm(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(output, tuple):
            normed, residual = output
            if layer:
                self._same(args[0], (layer - 1, "down_out"), f"layer {layer}'s input")
                self._same(args[1], (layer - 1, "residual_mid"), f"layer {layer}'s residual")
        else:
            normed, residual = output, args[0]
        self._seen[layer, "residual_in"] = self._take(residual)
        self._consumed[layer, "attn_in"] = normed

    def _qkv(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        self._same(args[0], (layer, "attn_in"), "qkv_proj's input")
        self._seen[layer, "attn_in"] = self._take(args[0])
        self._split(layer, output[0] if isinstance(output, tuple) else output, ("q", "k", "v"))

    def _o(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        y = output[0] if isinstance(output, tuple) else output
        self._seen[layer, "o_in"] = self._take(args[0])
        self._seen[layer, "o_out"] = self._take(y)
        self._consumed[layer, "o_out"] = y

    def _post_norm(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        self._same(args[0], (layer, "o_out"), "the post-attention norm's input")
        self._consumed[layer, "mlp_in"], self._consumed[layer, "residual_mid"] = output

    def _gate_up(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        self._same(args[0], (layer, "mlp_in"), "gate_up_proj's input")
        self._seen[layer, "mlp_in"] = self._take(args[0])
        self._split(layer, output[0] if isinstance(output, tuple) else output, ("gate", "up"))

    def _down(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        y = output[0] if isinstance(output, tuple) else output
        self._seen[layer, "down_in"] = self._take(args[0])
        self._seen[layer, "down_out"] = self._take(y)
        self._consumed[layer, "down_out"] = y

    def _final_norm(self, layer: int, args: tuple[Any, ...], output: Any) -> None:
        if not isinstance(output, tuple):
            raise CommitmentError("the final norm was called without the residual")
        self._same(args[0], (layer, "down_out"), "the final norm's input")
        self._same(args[1], (layer, "residual_mid"), "the final norm's residual")
        self._seen[layer, RESIDUAL_OUT] = self._take(output[1])

    def _after_model(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if not self._spans:
            return
        try:
            rows = self._table()
        except Exception as error:  # broad on purpose: a capture bug must not stop serving
            self._fail(str(error))
            return
        first = 0
        for span in self._spans:
            own = rows[first : first + span.count]
            first += span.count
            with self._committed_lock:
                committed = span.rid in self._committed
            if committed:
                continue  # the overlap scheduler's extra step after the answer: nothing to keep
            # A view would keep its batch-mates' rows alive past their commitment, unaccounted.
            self.pending.add(span.rid, span.position, own if len(self._spans) == 1 else own.copy())
        self._spans, self._seen, self._consumed = [], {}, {}

    def _table(self) -> npt.NDArray[np.uint8]:
        """The asking rows, each position's columns in order, as raw bytes [rows, row_bytes]."""
        import torch

        missing = [slot for slot in self._columns if slot not in self._seen]
        if missing:
            raise CommitmentError(f"the forward pass ran no {missing[0][1]} in layer {missing[0][0]}")
        parts = [self._seen[slot] for slot in self._columns]
        if parts[0].element_size() != self.layout.item_size:
            raise CommitmentError(f"activations are {parts[0].dtype}, the layout says {self.layout.dtype}")
        table = torch.cat(parts, dim=1).to("cpu")
        if table.dtype == torch.bfloat16:
            table = table.view(torch.int16)
        return table.numpy().view(np.uint8).reshape(table.shape[0], self.layout.row_bytes)

    # --- commitments (the opening server's threads) ---------------------------------------

    def commit(self, rid: str, positions: int) -> dict[str, Any]:
        """Close `rid`'s record at its first `positions` positions, file it for openings, and
        return the answer's commitment wire; the same again for a repeated call."""
        with self._committed_lock:
            done = self._committed.get(rid)
        if done is not None:
            if done["positions"] != positions:
                raise CaptureRefused(f"request {rid} was committed at {done['positions']} positions, not {positions}")
            return done
        entry = self.pending.take(rid)
        if entry is None:
            raise CaptureRefused(
                f"no captured rows for request {rid}: ask with a rid starting {self.prefix!r}, and commit within "
                f"{self.pending.window_s:.0f} s while the rows fit in {self.pending.max_bytes} bytes",
                status=404,
            )
        if entry.broken:
            raise CaptureRefused(f"request {rid} cannot be committed: {entry.broken}")
        if entry.positions < positions:
            raise CaptureRefused(
                f"request {rid}: {entry.positions} of its {positions} positions were captured ({GRAPH_HINT})"
            )
        builder = RecordBuilder(self.layout)
        for start, rows in entry.chunks:
            rows = rows[: max(0, positions - start)]
            if len(rows):
                builder.add_rows(len(rows), rows.data)
        record = builder.finish()
        if not self.openings.file(rid, record):
            log.warning("request %s's activation record (%d bytes) exceeds the store", rid, record.nbytes)
        wire = record.commitment.to_wire()
        if self.weights_root:
            wire["weights_root"] = self.weights_root
        wire["arithmetic"] = self.arithmetic
        with self._committed_lock:
            self._committed[rid] = wire
            while len(self._committed) > COMMITTED_KEPT:
                self._committed.popitem(last=False)
        return wire

    def info(self) -> tuple[int, dict[str, Any]]:
        """``GET /gemm/info``: what commitments this server makes, in the shape of the reference
        server's ``/get_server_info`` ``gemm_commitments``."""
        return 200, {**self.openings.advertised(self.layout), "arithmetic": self.arithmetic}


class RefusingCapture:
    """What the opening server answers where this process must not capture (`refusal_of`):
    ``GET /gemm/info`` 409 with why and the fix, so the miner leaves GEMM audits off saying so,
    and every commitment refused the same way. No hooks, no records."""

    def __init__(self, refusal: str) -> None:
        self.refusal = refusal
        self.openings = SharedOpenings(max_bytes=0)

    def info(self) -> tuple[int, dict[str, Any]]:
        return 409, _error(self.refusal)

    def commit(self, rid: str, positions: int) -> dict[str, Any]:
        raise CaptureRefused(self.refusal)


# --- the opening server ---------------------------------------------------------------------


def openings_answer(openings: SharedOpenings, body: Any) -> tuple[int, dict[str, Any]]:
    """`POST /gemm/openings` as `engy_node.serve.gemm_routes` answers it: (status, JSON body)."""
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str) or not rid:
        return 400, _error("rid must be the request id of an answer that asked for a GEMM commitment")
    try:
        opened = openings.open(rid, parse_picks(body.get("picks"), MAX_PICKS))
    except CommitmentError as error:
        return 400, _error(str(error))
    if opened is None:
        return 404, _error(
            f"no activation record for request {rid}: records are kept for {openings.window_s:.0f} s after the "
            f"commitment (and while they fit in {openings.max_bytes} bytes); challenge sooner"
        )
    record, found = opened
    layout = record.layout
    return 200, {
        "rid": rid,
        "activations_root": record.tree.root.hex(),
        "positions": record.positions,
        "openings": [o.to_wire(layout.dtype, layout.width(o.group)) for o in found],
    }


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


def serve(capture: SglangCapture | RefusingCapture, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Start the opening server on a daemon thread; returns it (``server_address`` has the port)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/gemm/info":
                return self._send(*capture.info())
            rid = urllib.parse.unquote(url.path.removeprefix("/gemm/commitment/"))
            if not url.path.startswith("/gemm/commitment/") or not rid:
                return self._send(
                    404, _error("GET /gemm/info, GET /gemm/commitment/{rid}?positions=N or POST /gemm/openings")
                )
            try:
                positions = int(urllib.parse.parse_qs(url.query)["positions"][0])
                if positions < 1:
                    raise ValueError(positions)
            except (KeyError, ValueError):
                return self._send(400, _error("positions=N is required: the answer's prompt + output − 1 tokens"))
            try:
                self._send(200, capture.commit(rid, positions))
            except CaptureRefused as refused:
                self._send(refused.status, _error(str(refused)))

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/gemm/openings":
                return self._send(
                    404, _error("POST /gemm/openings, GET /gemm/info or GET /gemm/commitment/{rid}?positions=N")
                )
            size = int(self.headers.get("Content-Length") or 0)
            if not 0 < size <= MAX_BODY_BYTES:
                return self._send(413 if size else 400, _error(f"send a JSON body of at most {MAX_BODY_BYTES} bytes"))
            try:
                body = json.loads(self.rfile.read(size))
            except ValueError:
                return self._send(400, _error("the body is not JSON"))
            self._send(*openings_answer(capture.openings, body))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            log.debug(format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="engy-gemm-openings", daemon=True).start()
    return server


# --- arming inside sglang -----------------------------------------------------------------------

_armed: list[Any] = []
"""The capture and server of this process, once armed (one model per scheduler process)."""


ARCHITECTURES = ("LlamaForCausalLM",)
"""The sglang model classes `SglangCapture.attach` knows: dense Llama-shaped decoders (SmolLM2)."""


def refusal_of(*, tp_size: int, server_args: Any, architectures: Sequence[str]) -> str:
    """Why an sglang server launched so, serving a model of `architectures`, cannot commit,
    naming the fix; empty when it can."""
    if not set(architectures) & set(ARCHITECTURES):
        return (
            f"the model is {', '.join(architectures) or 'of no named architecture'}, and the capture hooks only "
            f"sglang's {', '.join(ARCHITECTURES)} (dense, Llama-shaped): this model is judged by TOPLOC alone; "
            "unset miner.gemm_capture for it"
        )
    if tp_size != 1:
        return (
            f"sglang runs with --tp-size {tp_size}, which shards q/k/v and gate/up over GPUs, and the capture reads "
            "each projection whole: relaunch sglang with --tp-size 1"
        )
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    if dp_size != 1 or getattr(server_args, "enable_dp_attention", False):
        return (
            f"sglang runs {dp_size} data-parallel replicas, each a process of its own, and one capture port serves "
            "one replica's records: relaunch sglang with --dp-size 1, or run one sglang per GPU, each with its own "
            f"{PORT_ENV}"
        )
    missing = [
        f"--{flag.replace('_', '-')}"
        for flag in ("disable_radix_cache", "disable_cuda_graph")
        if server_args is not None and not getattr(server_args, flag, False)
    ]
    if missing:
        return (
            f"sglang runs without {' '.join(missing)}, so the capture would miss rows: relaunch sglang with "
            f"{' '.join(missing)} (engy-node's miner.gemm_capture adds both)"
        )
    return ""


def arm(runner: Any, port: int) -> SglangCapture | None:
    """Hook the model an sglang ``ModelRunner`` just loaded and start the opening server; where
    this process must not capture (`refusal_of`), start the server refusing, saying why, and
    hook nothing. The server starts first, so a port another process holds leaves no hooks."""
    if _armed or getattr(runner, "is_draft_worker", False):
        return None
    model = runner.model
    refusal = refusal_of(
        tp_size=int(getattr(runner, "tp_size", 1)),
        server_args=getattr(runner, "server_args", None),
        architectures=tuple(getattr(model.config, "architectures", None) or ()),
    )
    if refusal:
        _armed.append(serve(RefusingCapture(refusal), port))
        print(f"[engy] GEMM capture not armed: {refusal}", file=sys.stderr, flush=True)
        return None
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    layout = llama_layout(model.config.to_dict(), dtype)
    exact_arithmetic()
    capture = SglangCapture(layout, SharedOpenings(), weights_root=os.environ.get(WEIGHTS_ROOT_ENV, ""))
    server = serve(capture, port)
    capture.attach(model)
    _armed.extend([capture, server])
    print(f"[engy] GEMM capture armed: {layout.layers} layers, {dtype}, openings on 127.0.0.1:{port}", flush=True)
    return capture


def install(environ: dict[str, str] | None = None) -> bool:
    """Called by the ``site/sitecustomize.py`` shim at interpreter start: when ``ENGY_GEMM_CAPTURE_PORT``
    is set, wrap sglang's ``ModelRunner.load_model`` so the model is armed once loaded. Whether it
    wrapped."""
    port = (os.environ if environ is None else environ).get(PORT_ENV)
    if not port:
        return False
    from sglang.srt.model_executor import model_runner

    original = model_runner.ModelRunner.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            arm(self, int(port))
        except Exception as error:  # broad on purpose: serving goes on, without commitments
            print(f"[engy] GEMM capture not armed: {error!r}", file=sys.stderr)
        return result

    model_runner.ModelRunner.load_model = load_model
    return True
