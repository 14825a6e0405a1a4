"""The reference server's side of the GEMM audit: record what each projection consumed and
produced during a request's forward passes, commit it (`engy_node.gemm.activations`), and keep
the record for the challenge window.

Only a request that asks for it (``return_gemm_commitment``) is captured: the hooks cost time
on every forward pass and the record costs memory (about 0.55 MB per position on SmolLM2), so
they are registered for that request's forward calls only and removed after each, and the rest
of the traffic runs as before.

Exactness. The x a check uses must be the x the GEMM consumed, bit for bit, so every value is
taken from the projection's own forward hook (its argument and its result) as the serving dtype
holds it, copied before anything else could touch it. q, k and v read one tensor, as do gate and
up: the capture checks that they do (the very same tensor object, a free test) instead of
assuming it, and the same for a layer's output being the next layer's input (which is why
``residual_out`` is committed once). `exact_arithmetic` turns off TF32 and the reduced-precision
bf16/fp16 reductions on CUDA: the audit's tolerance assumes products summed in fp32, which those
modes break (on CPU they do not apply).

Threads: a capture is written by the engine thread only; `SharedOpenings` is the one object the
engine thread (filing a finished record) and the HTTP handlers (opening it) share, behind a lock.
"""

from __future__ import annotations

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
    """One request's capture: `recording` wraps each of its forward calls, `commit` ends it."""

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
        self._widths = {slot: layout.width(slot[1]) for slot in self._slots}
        self._modules: dict[Any, tuple[int, str]] = {}

    def start_at(self, position: int) -> None:
        """Commit from `position` on: the positions before it come from the prefix cache, and the
        answer that computed them committed them (`engy_node.gemm.activations`, "a cached
        prefix"). Only before the first forward call."""
        if self.builder.positions != self.builder.start:
            raise CaptureError("a capture's start moves only before its first forward call")
        self.builder = RecordBuilder(self.layout, start=position)

    def _module_table(self, model: Any) -> dict[Any, tuple[int, str]]:
        """Each decoder layer and projection of `model`, as (layer, "layer" or projection name)."""
        if not self._modules:
            layers = model.model.layers
            if len(layers) != self.layout.layers:
                raise CaptureError(f"the model has {len(layers)} decoder layers, the layout {self.layout.layers}")
            for index, layer in enumerate(layers):
                self._modules[layer] = (index, "layer")
                for name in GEMMS:
                    self._modules[getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)] = (index, name)
        return self._modules

    @contextlib.contextmanager
    def recording(self, model: Any) -> Iterator[None]:
        """Record one forward call of `model` (a transformers Llama-shaped causal LM); when it
        returns, its positions' leaves are hashed. Two process-wide module hooks, each looking
        the module up in this model's table, cost two registrations per call instead of one per
        projection; the engine thread runs one forward call at a time."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        table = self._module_table(model)
        last = self.layout.layers - 1
        seen: dict[tuple[int, str], Any] = {}
        consumed: dict[tuple[int, str], Any] = {}
        """The tensor object each shared input (and each layer's output) was: q/k/v and gate/up
        must read one, and a layer the previous one's output."""

        def before(module: Any, args: tuple[Any, ...]) -> None:
            entry = table.get(module)
            if entry is None or entry[1] != "layer":
                return
            layer = entry[0]
            if not args:
                raise CaptureError(f"decoder layer {layer} was called without a positional hidden state")
            if layer and consumed.get((layer - 1, RESIDUAL_OUT)) is not args[0]:
                raise CaptureError(f"layer {layer}'s input is not layer {layer - 1}'s output")
            seen[layer, "residual_in"] = args[0].clone()

        def after(module: Any, args: tuple[Any, ...], output: Any) -> None:
            entry = table.get(module)
            if entry is None:
                return
            layer, kind = entry
            if kind == "layer":
                consumed[layer, RESIDUAL_OUT] = output
                if layer == last:
                    seen[layer, RESIDUAL_OUT] = output.clone()
                return
            x_group, y_group = GEMMS[kind]
            x = args[0]
            first = consumed.setdefault((layer, x_group), x)
            if first is not x:
                raise CaptureError(f"layer {layer}: the projections sharing {x_group} were fed different tensors")
            if (layer, x_group) not in seen:
                seen[layer, x_group] = x.clone()
            seen[layer, y_group] = output.clone()

        exact_arithmetic()
        handles = [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self._hash(seen)

    def _hash(self, seen: dict[tuple[int, str], Any]) -> None:
        """One copy of the call's rows, [positions, all slots' widths], then the leaves."""
        import torch

        missing = [slot for slot in self._slots if slot not in seen]
        if missing:
            raise CaptureError(f"the forward call ran no {missing[0][1]} in layer {missing[0][0]}")
        parts = [seen[slot] for slot in self._slots]
        for slot, part in zip(self._slots, parts, strict=True):
            if part.shape[-1] != self._widths[slot]:
                raise CaptureError(
                    f"layer {slot[0]} {slot[1]} is {part.shape[-1]} wide, the layout says {self._widths[slot]}"
                )
        rows = parts[0].numel() // self._widths[self._slots[0]]
        table = torch.cat([part.reshape(rows, -1) for part in parts], dim=1).to("cpu")
        if table.dtype == torch.bfloat16:
            table = table.view(torch.int16)
        self.builder.add_rows(rows, table.numpy().data)

    def commit(self, rid: str) -> dict[str, Any]:
        """Close the record, file it under `rid`, and return the answer's `gemm_commitment`."""
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
