"""The reference server's side of the GEMM audit: record what each projection consumed and
produced during a request's forward passes, commit it (`engy_node.gemm.activations`), and keep
the record for the challenge window.

Only a request that asks for it (``return_gemm_commitment``) is captured: the wrappers cost
time on every forward pass and the record costs memory (about 0.55 MB per position on SmolLM2),
so they are set for that request's forward calls only and removed after each, and the rest of
the traffic runs as before.

Exactness. The x a check uses must be the x the GEMM consumed, bit for bit, so every value is
the projection's own argument and result, as the serving dtype holds it. q, k and v read one
tensor, as do gate and up: the capture checks that they do (the very same tensor object, a free
test) instead of assuming it, and the same for a layer's output being the next layer's input
(which is why ``residual_out`` is committed once). `exact_arithmetic` turns off TF32 and the
reduced-precision bf16/fp16 reductions on CUDA: the audit's tolerance assumes products summed in
fp32, which those modes break (on CPU they do not apply).

Cost (issue 32's target: ≤ 3 % of generation time). A decode step of SmolLM2 on a CPU core is
about 50 ms and commits 361 rows, so the capture has ~1.5 ms a step, and a torch call costs
microseconds, a Python hook call about one. So:

* each projection and decoder layer of the captured model gets a wrapper as its instance
  ``forward`` for the duration of one forward call (`recording`), not a global module hook,
  which would send every module call of the model (norms, activations, rotary) down
  ``Module._call_impl``'s slow path;
* the wrappers keep references, not copies: the forward call's tensors are copied once, by one
  ``torch.cat`` into a position-major table, when it returns. That is exact because nothing in
  the forward call writes a captured tensor in place after its projection made it (HF Llama's
  residual adds, activation, RoPE and cache updates all allocate); a model that did would commit
  other bytes than hooks cloning each tensor at once, which
  tests/engy_node/serve/test_capture_recording.py compares, and have its openings fail the
  weights check tests/engy_node/serve/test_gemm_capture.py runs on every group;
* the leaves and the tree's complete pairs are hashed on a thread of the capture's own
  (`engy_node.gemm.activations.RecordBuilder`), a forward call's table while the engine thread
  runs the next one, and `commit` waits for it: the engine thread's share is the wrappers and
  the copy.

Threads: a capture's tensors are taken by the engine thread only, and its `RecordBuilder` is
written by its hashing thread only until `commit` (engine thread) has waited for that thread;
`SharedOpenings` is the one object the engine thread (filing a finished record) and the HTTP
handlers (opening it) share, behind a lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from engy_node.gemm.activations import (
    GEMMS,
    RESIDUAL_OUT,
    ActivationLayout,
    ActivationRecord,
    Opening,
    OpeningStore,
    RecordBuilder,
    open_leaves,
)
from engy_node.protocol.gemm import RECORD_WINDOW_S

log = logging.getLogger("engy.serve.capture")

STORE_MAX_BYTES = 2 * 1024**3
"""The records kept at once: about 3,800 SmolLM2 positions (`engy_node.gemm.activations`)."""
STORE_WINDOW_S = RECORD_WINDOW_S
"""How long a finished answer's record stays open to challenges."""
MAX_PICKS = 4096
"""Openings per `/gemm/openings` call (each about 3 KB of JSON on SmolLM2)."""
HASH_WAIT_S = 120.0
"""How long `commit` waits for the hashing thread: it trails the engine by about one forward
call, so only a machine starved of CPU comes near."""


class CaptureError(RuntimeError):
    """The model did not run the way the capture's layout assumes."""


def exact_arithmetic() -> None:
    """Products summed in fp32 on CUDA: no TF32, no reduced-precision bf16/fp16 reductions."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")


class SharedOpenings:
    """The server's `OpeningStore` behind a lock, on the monotonic clock."""

    def __init__(
        self,
        *,
        max_bytes: int = STORE_MAX_BYTES,
        window_s: float = STORE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = OpeningStore(max_bytes=max_bytes, window_s=window_s)
        self._lock = threading.Lock()
        self._clock = clock

    @property
    def max_bytes(self) -> int:
        return self._store.max_bytes

    @property
    def window_s(self) -> float:
        return self._store.window_s

    def file(self, rid: str, record: ActivationRecord) -> bool:
        with self._lock:
            return self._store.put(rid, record, self._clock())

    def open(self, rid: str, picks: list[tuple[int, int, str]]) -> tuple[ActivationRecord, list[Opening]] | None:
        """The record and the openings of `picks`, or None when the record is gone (or never was)."""
        with self._lock:
            record = self._store.get(rid, self._clock())
        if record is None:
            return None
        return record, open_leaves(record, picks)


class ActivationCapture:
    """One request's capture: `recording` wraps each of its forward calls, `commit` ends it
    (`close` instead, when the request is dropped)."""

    def __init__(
        self, layout: ActivationLayout, openings: SharedOpenings, *, weights_root: str, arithmetic: str
    ) -> None:
        self.layout = layout
        self.openings = openings
        self.weights_root = weights_root
        """The served checkpoint's weight commitment ("" when unknown: left out of the answer)."""
        self.arithmetic = arithmetic
        """The serving arithmetic's name, as `engy_node.verifier.gemm_check.ARITHMETIC` keys it."""
        self.builder = RecordBuilder(layout)
        self.commit_from_at_most: int | None = None
        """The latest position the commitment may start at (``gemm_commit_from``): the buyer's
        prompt's last, so a prefix-cache hit never leaves the whole prompt uncommitted."""
        self._slots = layout.slots()
        self._widths = [layout.width(slot[1]) for slot in self._slots]
        self._row_values = sum(self._widths)
        self._modules: list[tuple[Any, Callable[..., Any]]] = []
        self._seen: dict[tuple[int, str], Any] = {}
        """The current forward call's tensors by slot; a shared input's first reader puts it
        here, so q/k/v and gate/up can be checked to read that very tensor."""
        self._outputs: list[Any] = []
        """Each decoder layer's output in the current call, in order: the next layer must read it."""
        self._hasher: concurrent.futures.ThreadPoolExecutor | None = None
        self._hashing: list[concurrent.futures.Future[None]] = []

    def start_at(self, position: int) -> None:
        """Commit from `position` on: the positions before it come from the prefix cache, and the
        answer that computed them committed them (`engy_node.gemm.activations`, "a cached
        prefix"). Only before the first forward call."""
        if self._hashing or self.builder.positions != self.builder.start:
            raise CaptureError("a capture's start moves only before its first forward call")
        self.builder = RecordBuilder(self.layout, start=position)

    def _wrappers(self, model: Any) -> list[tuple[Any, Callable[..., Any]]]:
        """Each decoder layer and projection of `model` with the wrapper `recording` sets as its
        ``forward``, made once per capture: they write the current call's `_seen`/`_outputs`.
        Its first call also sets the arithmetic the audit assumes."""
        if not self._modules:
            exact_arithmetic()
            layers = model.model.layers
            if len(layers) != self.layout.layers:
                raise CaptureError(f"the model has {len(layers)} decoder layers, the layout {self.layout.layers}")
            for index, layer in enumerate(layers):
                self._modules.append((layer, self._layer_forward(index, layer.forward)))
                for name in GEMMS:
                    module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
                    self._modules.append((module, self._projection_forward(index, name, module.forward)))
        return self._modules

    def _layer_forward(self, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        last = self.layout.layers - 1

        def run(*args: Any, **kwargs: Any) -> Any:
            outputs = self._outputs
            if not args:
                raise CaptureError(f"decoder layer {layer} was called without a positional hidden state")
            if layer and (len(outputs) != layer or outputs[-1] is not args[0]):
                raise CaptureError(f"layer {layer}'s input is not layer {layer - 1}'s output")
            self._seen[layer, "residual_in"] = args[0]
            output = forward(*args, **kwargs)
            outputs.append(output)
            if layer == last:
                self._seen[layer, RESIDUAL_OUT] = output
            return output

        return run

    def _projection_forward(self, layer: int, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        x_group, y_group = GEMMS[name]

        def run(x: Any, *args: Any, **kwargs: Any) -> Any:
            if self._seen.setdefault((layer, x_group), x) is not x:
                raise CaptureError(f"layer {layer}: the projections sharing {x_group} were fed different tensors")
            output = forward(x, *args, **kwargs)
            self._seen[layer, y_group] = output
            return output

        return run

    @contextlib.contextmanager
    def recording(self, model: Any) -> Iterator[None]:
        """Record one forward call of `model` (a transformers Llama-shaped causal LM); when it
        returns, its positions' rows are copied into one table and handed to the hashing thread.
        The engine thread runs one forward call at a time, so the wrappers, set on this model's
        modules for this call only, see this request's tensors alone."""
        wrappers = self._wrappers(model)
        self._seen = {}
        self._outputs = []
        replaced = []
        try:
            for module, wrapper in wrappers:
                namespace = module.__dict__
                replaced.append((namespace, namespace.get("forward")))
                namespace["forward"] = wrapper
            yield
        finally:
            for namespace, before in replaced:
                if before is None:
                    del namespace["forward"]
                else:
                    namespace["forward"] = before
            seen, self._seen, self._outputs = self._seen, {}, []
        self._hash(seen)

    def _hash(self, seen: dict[tuple[int, str], Any]) -> None:
        """One copy of the call's rows, [positions, all slots' widths], then the leaves, on the
        hashing thread."""
        import torch

        try:
            parts = [seen[slot] for slot in self._slots]
        except KeyError as error:
            layer, group = error.args[0]
            raise CaptureError(f"the forward call ran no {group} in layer {layer}") from None
        if not self._hashing:  # a module's widths are its weights' shapes: the first call tells
            for slot, part, width in zip(self._slots, parts, self._widths, strict=True):
                if part.shape[-1] != width:
                    raise CaptureError(f"layer {slot[0]} {slot[1]} is {part.shape[-1]} wide, the layout says {width}")
        table = torch.cat(parts, dim=-1).reshape(-1, self._row_values).to("cpu")
        if table.dtype == torch.bfloat16:
            table = table.view(torch.int16)
        if self._hasher is None:
            self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engy-gemm-hash")
        self._hashing.append(self._hasher.submit(self.builder.add_rows, table.shape[0], table.numpy().data))

    def close(self) -> None:
        """End the hashing thread, dropping what it has not started (a dropped request); it
        exits once the table in hand, one forward call's, is hashed."""
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)
            self._hasher = None

    def _hashed(self) -> None:
        """Wait for every forward call's leaves, raising what hashing them raised."""
        done, pending = concurrent.futures.wait(self._hashing, timeout=HASH_WAIT_S)
        self.close()
        if pending:
            raise CaptureError(f"hashing the activations took over {HASH_WAIT_S:.0f} s: the server is short of CPU")
        for future in done:
            future.result()

    def commit(self, rid: str) -> dict[str, Any]:
        """Close the record, file it under `rid`, and return the answer's `gemm_commitment`."""
        self._hashed()
        record = self.builder.finish()
        if not self.openings.file(rid, record):
            log.warning(
                "request %s's activation record (%d bytes) exceeds the store's %d bytes: it cannot be opened",
                rid,
                record.nbytes,
                self.openings.max_bytes,
            )
        wire = record.commitment.to_wire()
        if self.weights_root:
            wire["weights_root"] = self.weights_root
        wire["arithmetic"] = self.arithmetic
        return wire
