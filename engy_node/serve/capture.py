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
  ``forward`` (`recording`), not a global module hook, which would send every module call of
  the model (norms, activations, rotary) down ``Module._call_impl``'s slow path; the wrappers
  record only inside the capture's forward calls and stay set between them, until the capture
  ends or the engine runs a call without it (`release`);
* the wrappers keep references, not copies: the forward call's tensors are copied once, by one
  ``torch.cat`` into a position-major table, after it returns. That is exact because nothing
  writes a captured tensor in place after its projection made it, in the forward call or after
  (HF Llama's residual adds, activation, RoPE and cache updates all allocate, and the references
  keep the memory from being reused); a model that did would commit other bytes than hooks
  cloning each tensor at once, which tests/engy_node/serve/test_capture_recording.py compares,
  and have its openings fail the weights check tests/engy_node/serve/test_gemm_capture.py runs
  on every group;
* the copy, the leaves and the tree's complete pairs are made on a thread of the capture's own
  (`engy_node.gemm.activations.RecordBuilder`), a forward call's while the engine thread runs
  the next one, and `commit` waits for it: the engine thread's share is the wrappers and the
  handoff, about 0.1 ms a call on SmolLM2.

Threads: a capture's tensors are taken by the engine thread and handed over whole, one list a
forward call, to its hashing thread, which alone writes its `RecordBuilder` until `commit`
(engine thread) has waited for that thread;
`SharedOpenings` is the one object the engine thread (filing a finished record) and the HTTP
handlers (opening it) share, behind a lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from engy_node.gemm.activations import (
    FORMAT,
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

    def advertised(self, layout: ActivationLayout) -> dict[str, Any]:
        """The ``gemm_commitments`` object a server whose records of `layout` go to this store
        advertises (the reference server's ``/get_server_info``, the sglang capture's
        ``/gemm/info``), which `engy_node.serve.client.gemm_support_of` reads."""
        return {
            "format": FORMAT,
            "window_s": self.window_s,
            "max_bytes": self.max_bytes,
            "bytes_per_position": layout.bytes_per_position(),
            "max_picks": MAX_PICKS,
        }

    def open(self, rid: str, picks: list[tuple[int, int, str]]) -> tuple[ActivationRecord, list[Opening]] | None:
        """The record and the openings of `picks`, or None when the record is gone (or never was)."""
        with self._lock:
            record = self._store.get(rid, self._clock())
        if record is None:
            return None
        return record, open_leaves(record, picks)


_INSTALLED: weakref.WeakKeyDictionary[Any, ActivationCapture] = weakref.WeakKeyDictionary()
"""The capture whose wrappers are set on each model's modules (engine thread only)."""


def release(model: Any) -> None:
    """Take any capture's wrappers off `model`'s modules: before a forward call without a
    capture, which should not pay for them."""
    capture = _INSTALLED.get(model)
    if capture is not None:
        capture._uninstall()


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
        self._columns = layout.columns()
        self._index = {slot: index for index, slot in enumerate(self._columns)}
        self._widths = [layout.width(slot[1]) for slot in self._columns]
        self._row_values = sum(self._widths)
        self._modules: list[tuple[dict[str, Any], Callable[..., Any]]] = []
        self._model: Any = None
        """The model whose modules have this capture's wrappers set (`_install`), or None."""
        self._replaced: list[Any] = []
        self._seen: list[Any] | None = None
        """The current forward call's tensors in column order (None in a slot: not run yet), which
        is what the copy takes as is; a shared input's first reader puts it here, so q/k/v and
        gate/up can be checked to read that very tensor. None between forward calls: the
        wrappers then only call through."""
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

    def _wrappers(self, model: Any) -> list[tuple[dict[str, Any], Callable[..., Any]]]:
        """Each decoder layer's and projection's instance namespace with the wrapper `recording`
        sets as its ``forward``, made once per capture: they write the current call's
        `_seen`/`_outputs`. Its first call also sets the arithmetic the audit assumes."""
        if not self._modules:
            exact_arithmetic()
            layers = model.model.layers
            if len(layers) != self.layout.layers:
                raise CaptureError(f"the model has {len(layers)} decoder layers, the layout {self.layout.layers}")
            for index, layer in enumerate(layers):
                self._modules.append((layer.__dict__, self._layer_forward(index, layer.forward)))
                for name in GEMMS:
                    module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
                    self._modules.append((module.__dict__, self._projection_forward(index, name, module.forward)))
        return self._modules

    def _layer_forward(self, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        residual_in = self._index[layer, "residual_in"]
        residual_out = self._index.get((layer, RESIDUAL_OUT))

        def run(*args: Any, **kwargs: Any) -> Any:
            seen, outputs = self._seen, self._outputs
            if seen is None:
                return forward(*args, **kwargs)
            if not args:
                raise CaptureError(f"decoder layer {layer} was called without a positional hidden state")
            if layer and (len(outputs) != layer or outputs[-1] is not args[0]):
                raise CaptureError(f"layer {layer}'s input is not layer {layer - 1}'s output")
            seen[residual_in] = args[0]
            output = forward(*args, **kwargs)
            outputs.append(output)
            if residual_out is not None:
                seen[residual_out] = output
            return output

        return run

    def _projection_forward(self, layer: int, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        x_group, y_group = GEMMS[name]
        x_slot, y_slot = self._index[layer, x_group], self._index[layer, y_group]

        def run(x: Any, *args: Any, **kwargs: Any) -> Any:
            seen = self._seen
            if seen is None:
                return forward(x, *args, **kwargs)
            held = seen[x_slot]
            if held is None:
                seen[x_slot] = x
            elif held is not x:
                raise CaptureError(f"layer {layer}: the projections sharing {x_group} were fed different tensors")
            output = forward(x, *args, **kwargs)
            seen[y_slot] = output
            return output

        return run

    @contextlib.contextmanager
    def recording(self, model: Any) -> Iterator[None]:
        """Record one forward call of `model` (a transformers Llama-shaped causal LM); when it
        returns, its tensors go to the hashing thread, which copies its positions' rows into one
        table and hashes them.
        The engine thread runs one forward call at a time, so the wrappers, recording during this
        call only, see this request's tensors alone."""
        self._install(model)
        seen: list[Any] = [None] * len(self._columns)
        self._seen, self._outputs = seen, []
        try:
            yield
        except BaseException:
            self._uninstall()
            raise
        finally:
            self._seen, self._outputs = None, []
        self._hash(seen)

    def _install(self, model: Any) -> None:
        """Set this capture's wrappers on `model`'s modules, unless they are set already. They
        stay between its forward calls (only calling through), as setting and restoring 240
        instance attributes per call costs the engine thread more than the wrappers' own work
        (0.4 ms a call on SmolLM2, its caches cold after the forward pass), and go with `commit`
        or `close`, another capture's call on the model, or `release` (`ModelRunner.forward`
        without a capture)."""
        if self._model is model:
            return
        self._uninstall()
        release(model)
        wrappers = self._wrappers(model)
        self._replaced = [namespace.get("forward") for namespace, _ in wrappers]
        for namespace, wrapper in wrappers:
            namespace["forward"] = wrapper
        self._model = model
        _INSTALLED[model] = self

    def _uninstall(self) -> None:
        """Put back what the wrappers replaced (another instance ``forward``, or none)."""
        if self._model is None:
            return
        for (namespace, _), before in zip(self._modules, self._replaced, strict=True):
            if before is None:
                namespace.pop("forward", None)
            else:
                namespace["forward"] = before
        if _INSTALLED.get(self._model) is self:
            del _INSTALLED[self._model]
        self._model, self._replaced = None, []

    def _hash(self, parts: list[Any]) -> None:
        """Hand the call's tensors (`parts`, in column order) to the hashing thread, which copies
        them into one table and hashes it (`_hash_call`)."""
        if not self._hashing:  # a module's widths are its weights' shapes: the first call tells
            for slot, part, width in zip(self._columns, parts, self._widths, strict=True):
                if part is not None and part.shape[-1] != width:
                    raise CaptureError(f"layer {slot[0]} {slot[1]} is {part.shape[-1]} wide, the layout says {width}")
        if self._hasher is None:
            self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engy-gemm-hash")
        self._hashing.append(self._hasher.submit(self._hash_call, parts))

    def _hash_call(self, parts: list[Any]) -> None:
        """The hashing thread's part: one copy of a forward call's rows, [positions, all slots'
        widths], then their leaves and tree pairs. The copy is made here, not on the engine
        thread, as writing half a megabyte of fresh memory per position, read from tensors the
        forward pass left out of cache, costs as much as the leaves' Python (0.2–0.5 ms a
        position on SmolLM2); torch lets go of the GIL while it copies."""
        import torch

        try:
            with torch.inference_mode():
                table = torch.cat(parts, dim=-1)
        except TypeError:  # a None, found here rather than by a scan of every call's slots
            for (layer, group), part in zip(self._columns, parts, strict=True):
                if part is None:
                    raise CaptureError(f"the forward call ran no {group} in layer {layer}") from None
            raise
        parts.clear()  # the call's tensors go as soon as they are copied, not when the job ends
        table = table.reshape(-1, self._row_values).to("cpu")
        if table.dtype == torch.bfloat16:
            table = table.view(torch.int16)
        self.builder.add_rows(table.shape[0], table.numpy().data)

    def close(self) -> None:
        """Take the wrappers off the model and end the hashing thread, dropping what it has not
        started (a dropped request); it exits once the table in hand, one forward call's, is
        hashed."""
        self._uninstall()
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
