"""Compiled loops for the GEMM audit's per-token checks (`gemm_check`): Freivalds' statistic
with its tolerance, the row check's recomputed rows with theirs, and the replay's element-wise
steps (silu(gate)·up, the two RMSNorms, the residual sum) with theirs.

Why compiled. An audit checks 8 tokens × about 16,000 values against their own layer's keys,
weight rows and norms. In numpy each operation is a pass over its arrays with a temporary of its
own — Freivalds' statistic, its norms and its tolerance were about fifteen passes, the row check
a gather of 448 weight rows into float64 and two batched products, the replay twenty more — and
those passes were most of the verifier's CPU per audited answer (docs/performance.md). Each loop
here reads every value it needs once, straight from the verifier's float32 weights and float64
keys, and keeps its sums in registers. What stays in numpy is what it does in SIMD and a loop
here would not: exp, for silu.

The sums are reassociated (`fastmath` with only ``reassoc`` and ``contract``: vector lanes and
fused multiply-adds, no assumptions about NaN or infinity), which the checks allow: Freivalds'
and the row check's tolerances include the verifier's own float64 rounding, bounded by γ over
the number of terms whatever the order, and a fused multiply-add rounds less, not more; the
replay's bounds have no such term, but each is a relative slack of at least the serving format's
unit roundoff (2⁻²⁴ for fp32, 2⁻⁸ for bf16), against float64's 2⁻⁵³ over a mean of a few
thousand squares. Values that are not finite fail: they make a ratio inf or NaN, and NaN
counts as inf.

Numba compiles each loop on its first call in a process (seconds) and caches the machine code
beside this file or in the user's cache directory; `warm` does that ahead, so a verifier pays it
while loading its model rather than in its first audit. Pure functions: arrays in, arrays out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numba
import numpy as np
import numpy.typing as npt
from numba.typed import List

log = logging.getLogger(__name__)

Array = npt.NDArray[np.float64]
Matrices: TypeAlias = List
"""A numba typed list of 2-D C-contiguous arrays of one dtype: the loops index it per token."""

_SUMS = {"reassoc", "contract"}
_UNCACHED: list[str] = []
"""The loops compiled without a disk cache (`_compiled`), so the log says why once, not per loop."""


def _compiled(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`numba.njit` (the GIL let go, NaN and inf kept) with the machine code cached on disk
    where numba finds a writable place for it — beside this file, or the user's cache
    directory; where it finds none (a read-only install run by a user without a home) numba
    refuses `cache=True` outright, so the loop is compiled in every process instead."""

    def compile(function: Callable[..., Any]) -> Any:
        try:
            return numba.njit(cache=True, nogil=True, **options)(function)
        except RuntimeError as error:
            if not _UNCACHED:
                log.warning(
                    "%s; each verifier start compiles the GEMM audit's loops again (seconds): "
                    "set NUMBA_CACHE_DIR to a writable directory to keep them",
                    error,
                )
            _UNCACHED.append(function.__name__)
            return numba.njit(nogil=True, **options)(function)

    return compile


Quantisation: TypeAlias = tuple[float, float, float, int]
"""How a GEMM consumes its input (W8A8: quantised per group of a token's values), as the replay's
loops take it: (unit roundoff, underflow, 2 / max value, group size) of the input format."""
NOT_QUANTISED: Quantisation = (0.0, 0.0, 0.0, 1 << 62)
"""A GEMM that consumes its input as is: no term added, one group."""


def spacing(precision: int, min_exponent: int) -> Array:
    """Half the ulp of a format (`gemm_check.FloatFormat.half_ulp`) by a float64's biased
    exponent, so a loop finds it with a shift and a load: 2^(max(e, min_exponent) − precision)
    for a value in [2^e, 2^(e+1)) — for zero and the float64 subnormals that is the format's
    underflow — and what e = −1 gives for the exponent of inf and NaN (judged apart)."""
    exponents = np.arange(2048) - 1023
    exponents[-1] = -1
    table: Array = np.ldexp(1.0, np.maximum(exponents, min_exponent) - precision)
    return table


def ready(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """`array` as the loops take arrays: C-contiguous and writable (a copy otherwise), the one
    kind `warm` compiles them for, so no call compiles another version. (`np.require` says the
    same, at ten times the cost of reading two flags, on every array of every check.)"""
    flags = array.flags
    return array if flags.c_contiguous and flags.writeable else array.copy(order="C")


def matrices(arrays: Sequence[npt.NDArray[np.floating]]) -> Matrices:
    """`arrays` (each a matrix) as the typed list the row loop reads: the arrays themselves when
    all are C-contiguous float32 (a model's weights), otherwise float64 copies of every one."""
    dtype = np.float32 if all(array.dtype == np.float32 for array in arrays) else np.float64
    return List([np.ascontiguousarray(array, dtype) for array in arrays])


@_compiled(fastmath=_SUMS)
def _row_sums(row: npt.NDArray[np.floating], x: Array) -> tuple[float, float]:
    """Σ W_j·x_j and Σ |W_j·x_j| over one weight row, in float64."""
    exact = 0.0
    total = 0.0
    for j in range(x.shape[0]):
        product = np.float64(row[j]) * x[j]
        exact += product
        total += abs(product)
    return exact, total


@_compiled(error_model="numpy")
def row_ratios(
    weights: Matrices,
    entries: npt.NDArray[np.intp],
    rows: npt.NDArray[np.intp],
    x: Array,
    y: Array,
    slack: float,
    spacings: Array,
) -> Array:
    """Per token t, the worst |y[t, i] − (W x[t])_i| / (half_ulp(y[t, i]) + slack · Σ_j |W_ij x_tj|)
    over the rows i = rows[t] of W = weights[entries[t]], half_ulp from `spacings` (`spacing`);
    0/0 is 0 and NaN is inf, so a value that is not finite fails (its excess is inf or NaN).
    Shapes are checked here, where each token's matrix is at hand: nothing is bounds-checked in
    a compiled loop."""
    bits = y.view(np.uint64)
    tokens = rows.shape[0]
    if x.shape[0] != tokens or y.shape[0] != tokens or entries.shape[0] != tokens:
        raise ValueError("row check: x, y, entries and rows need one row per token")
    worst = np.zeros(tokens)
    for t in range(tokens):
        weight = weights[entries[t]]
        if weight.shape[1] != x.shape[1]:
            raise ValueError("row check: a matrix's columns are not the inputs' width")
        for k in range(rows.shape[1]):
            row = rows[t, k]
            if not (0 <= row < weight.shape[0] and row < y.shape[1]):
                raise ValueError("row check: a drawn row outside the matrix or the outputs")
            exact, total = _row_sums(weight[row], x[t])
            excess = y[t, row] - exact
            if excess == 0.0:
                continue
            ratio = abs(excess) / (spacings[(bits[t, row] >> 52) & 0x7FF] + slack * total)
            worst[t] = max(worst[t], math.inf if math.isnan(ratio) else ratio)
    return worst


@_compiled(fastmath=_SUMS)
def _dot(a: Array, b: Array) -> float:
    total = 0.0
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total


@_compiled(fastmath=_SUMS)
def _output_sums(y: Array, bits: npt.NDArray[np.uint64], spacings: Array) -> tuple[float, float]:
    """Σ half_ulp(y)² and Σ |y|."""
    rounding = 0.0
    magnitude = 0.0
    for i in range(y.shape[0]):
        spacing = spacings[(bits[i] >> 52) & 0x7FF]
        rounding += spacing * spacing
        magnitude += abs(y[i])
    return rounding, magnitude


@_compiled(fastmath=_SUMS)
def _input_sums(x: Array, column_abs: Array) -> tuple[float, float]:
    """Σ |x|·1ᵀ|W| and Σ x²."""
    sum_abs = 0.0
    squares = 0.0
    for j in range(x.shape[0]):
        sum_abs += abs(x[j]) * column_abs[j]
        squares += x[j] * x[j]
    return sum_abs, squares


@_compiled(error_model="numpy")
def freivalds_ratios(
    signs: Array,
    projected: Array,
    column_abs: Array,
    frobenius: Array,
    entries: npt.NDArray[np.intp],
    m_bounds: npt.NDArray[np.intp],
    n_bounds: npt.NDArray[np.intp],
    growth: Array,
    own: Array,
    z: float,
    x: Array,
    y: Array,
    spacings: Array,
) -> Array:
    """T × S: per token t and segment s (outputs m_bounds[s] … m_bounds[s + 1] − 1, inputs
    likewise by n_bounds), the largest |σᵀy − (σᵀW)x| over the vectors of key entry
    entries[t], as a multiple of z·(‖half_ulp(y)‖₂ + growth[s]·min(‖W‖_F‖x‖₂, Σ|x|·1ᵀ|W|)) +
    own[s]·(2·Σ|x|·1ᵀ|W| + Σ|y|) (`gemm_check.freivalds_tolerance`); NaN is inf, so a value
    read that is not finite fails (it makes the statistic, or both it and the tolerance, inf
    or NaN)."""
    # Each loop runs over a slice from 0 (a range from a start is not vectorised: the index
    # could be negative, as far as the compiler knows, and wrap around).
    bits = y.view(np.uint64)
    tokens = x.shape[0]
    segments = m_bounds.shape[0] - 1
    ratios = np.zeros((tokens, segments))
    for t in range(tokens):
        e = entries[t]
        for s in range(segments):
            outputs, inputs = slice(m_bounds[s], m_bounds[s + 1]), slice(n_bounds[s], n_bounds[s + 1])
            rounding, magnitude = _output_sums(y[t, outputs], bits[t, outputs], spacings)
            sum_abs, squares = _input_sums(x[t, inputs], column_abs[e, inputs])
            products = min(frobenius[e, s] * math.sqrt(squares), sum_abs)
            tolerance = z * (math.sqrt(rounding) + growth[s] * products) + own[s] * (2 * sum_abs + magnitude)
            for k in range(signs.shape[1]):
                statistic = _dot(y[t, outputs], signs[e, k, outputs]) - _dot(x[t, inputs], projected[e, k, inputs])
                if statistic == 0.0:
                    continue
                ratio = abs(statistic) / tolerance
                ratios[t, s] = max(ratios[t, s], math.inf if math.isnan(ratio) else ratio)
    return ratios


@_compiled(error_model="numpy")
def _worse(worst: float, excess: float, bound: float) -> float:
    """The larger of `worst` and |excess| / bound (0 when the excess is 0, inf when NaN)."""
    if excess == 0.0:
        return worst
    ratio = abs(excess) / bound
    return max(worst, math.inf if math.isnan(ratio) else ratio)


@_compiled(error_model="numpy")
def _worst_into_gemm(committed: Array, exact: Array, relative: float, floor: float, quantised: Quantisation) -> float:
    """One token's worst |committed − exact| over relative · |exact| + floor, where `committed`
    is what a GEMM consumed: under W8A8 quantised per group of the input format's values, which
    adds that rounding, relative and near zero (the scale at most 2 · amax / max_value: amax /
    max_value, or the power of two above it); `NOT_QUANTISED` adds nothing."""
    unit_roundoff, underflow, factor, group = quantised
    worst = 0.0
    # Group by group, each a slice from 0, so the inner loop has no index division and can be
    # vectorised.
    for start in range(0, committed.shape[0], group):
        values, exacts = committed[start : start + group], exact[start : start + group]
        amax = 0.0
        if factor != 0.0:
            for i in range(values.shape[0]):
                amax = max(amax, abs(values[i]))
        near_zero = underflow * factor * amax
        for i in range(values.shape[0]):
            size = abs(exacts[i])
            bound = (relative * size + floor) * (1 + unit_roundoff) + unit_roundoff * size + near_zero
            worst = _worse(worst, values[i] - exacts[i], bound)
    return worst


@_compiled(error_model="numpy")
def silu_ratios(
    gate: Array,
    decay: Array,
    up: Array,
    committed: Array,
    relative: float,
    floor: float,
    quantised: Quantisation,
) -> Array:
    """Per token, the worst |committed − silu(gate)·up| over its bound, relative · |silu(gate)·up|
    + floor, through `_worst_into_gemm` (down_proj's input). `decay` is exp(−gate), which numpy
    evaluates in SIMD where a loop here would call libm once per value."""
    if decay.shape != gate.shape or up.shape != gate.shape or committed.shape != gate.shape:
        raise ValueError("replay: gate, exp(-gate), up and down's input need one shape")
    worst = np.zeros(gate.shape[0])
    exact = np.empty(gate.shape[1])
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            exact[i] = gate[t, i] / (1.0 + decay[t, i]) * up[t, i]
        worst[t] = _worst_into_gemm(committed[t], exact, relative, floor, quantised)
    return worst


@_compiled(error_model="numpy")
def rmsnorm_ratios(
    hidden: Array,
    added: Array,
    add: bool,
    gamma: Array,
    eps: float,
    committed: Array,
    relative: float,
    floor: float,
    quantised: Quantisation,
) -> Array:
    """Per token, the worst |committed − RMSNorm(h)·γ| over its bound, relative · |RMSNorm(h)·γ|
    + floor, through `_worst_into_gemm`, for h = hidden (+ added, with `add`) and the token's
    own γ (gamma[t])."""
    if added.shape != hidden.shape or gamma.shape != hidden.shape or committed.shape != hidden.shape:
        raise ValueError("replay: the residual, what is added to it, γ and the GEMM input need one shape")
    worst = np.zeros(hidden.shape[0])
    exact = np.empty(hidden.shape[1])
    for t in range(hidden.shape[0]):
        row = hidden[t] + added[t] if add else hidden[t]
        inverse = 1.0 / math.sqrt(_dot(row, row) / row.shape[0] + eps)
        for i in range(row.shape[0]):
            exact[i] = gamma[t, i] * row[i] * inverse
        worst[t] = _worst_into_gemm(committed[t], exact, relative, floor, quantised)
    return worst


@_compiled(error_model="numpy")
def residual_ratios(
    residual: Array, attention: Array, mlp: Array, committed: Array, unit_roundoff: float, floor: float
) -> Array:
    """Per token, the worst |committed − (residual + attention + mlp)| over its bound: each of
    the two sums rounded to the activation format (u(1 + u)·|residual + attention| +
    u·|the total|) + floor."""
    if attention.shape != residual.shape or mlp.shape != residual.shape or committed.shape != residual.shape:
        raise ValueError("replay: the residuals and the two outputs added to them need one shape")
    worst = np.zeros(residual.shape[0])
    u = unit_roundoff
    for t in range(residual.shape[0]):
        for i in range(residual.shape[1]):
            middle = residual[t, i] + attention[t, i]
            total = middle + mlp[t, i]
            bound = u * (1 + u) * abs(middle) + u * abs(total) + floor
            worst[t] = _worse(worst[t], committed[t, i] - total, bound)
    return worst


@_compiled()
def first_distinct(values: npt.NDArray[np.uint64], counts: npt.NDArray[np.uint64], k: int) -> npt.NDArray[np.intp]:
    """Per row of `values` (draws), the first k distinct values of each draw modulo the row's
    count, sorted; −1 throughout a row whose draws hold fewer (the caller draws on)."""
    if counts.shape[0] != values.shape[0]:
        raise ValueError("row draws: one count per row of draws")
    chosen = np.full((values.shape[0], k), -1, np.intp)
    for label in range(values.shape[0]):
        found = 0
        for draw in range(values.shape[1]):
            value = values[label, draw] % counts[label]
            seen = False
            for earlier in range(found):
                seen |= chosen[label, earlier] == value
            if not seen:
                chosen[label, found] = value
                found += 1
                if found == k:
                    break
        if found == k:
            chosen[label].sort()
        else:
            chosen[label] = -1
    return chosen


def warm() -> None:
    """Compile (or load from the cache) each loop for the types the verifier calls it with."""
    one = np.ones((1, 2))
    spacings = spacing(8, -126)
    index = np.zeros(1, np.intp)
    bounds = np.array([0, 2], np.intp)
    for dtype in (np.float32, np.float64):
        row_ratios(matrices([one.astype(dtype)]), index, index.reshape(1, 1), one, one, 0.0, spacings)
    keys = np.ones((1, 1, 2))
    freivalds_ratios(keys, keys, one, one, index, bounds, bounds, one[0], one[0], 1.0, one, one, spacings)
    for quantised in (NOT_QUANTISED, (2.0**-4, 2.0**-10, 2 / 448, 128)):
        silu_ratios(one, one, one, one, 0.0, 0.0, quantised)
        for add in (False, True):
            rmsnorm_ratios(one, one, add, one, 0.0, one, 0.0, 0.0, quantised)
    residual_ratios(one, one, one, one, 0.0, 0.0)
    first_distinct(np.ones((1, 2), np.uint64), np.ones(1, np.uint64), 1)
