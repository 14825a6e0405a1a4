"""Compiled loops for the GEMM audit's two per-token checks (`gemm_check`): Freivalds'
statistic with its tolerance, and the row check's recomputed rows with theirs.

Why compiled. An audit checks 8 tokens × about 16,000 values against their own layer's keys and
weight rows. In numpy each operation is a pass over its arrays with a temporary of its own —
Freivalds' statistic, its norms and its tolerance were about fifteen passes, the row check a
gather of 448 weight rows into float64 and two batched products — and those passes were most of
the verifier's CPU per audited answer (docs/performance.md). Each loop here reads every value it
needs once, straight from the verifier's float32 weights and float64 keys, and keeps its sums in
registers.

The sums are reassociated (`fastmath` with only ``reassoc`` and ``contract``: vector lanes and
fused multiply-adds, no assumptions about NaN or infinity), which the checks allow: the
verifier's own float64 rounding is bounded by γ over the number of terms whatever the order
(`gemm_check`'s tolerances include it), and a fused multiply-add rounds less, not more. Values
that are not finite fail: they make a ratio inf or NaN, and NaN counts as inf.

Numba compiles each loop on its first call in a process (about a second) and caches the machine
code beside this file or in the user's cache directory; `warm` does that ahead, so a verifier
pays it while loading its model rather than in its first audit. Pure functions: arrays in,
arrays out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

import numba
import numpy as np
import numpy.typing as npt
from numba.typed import List

Array = npt.NDArray[np.float64]
Matrices: TypeAlias = List
"""A numba typed list of 2-D C-contiguous arrays of one dtype: the loops index it per token."""

_SUMS = {"reassoc", "contract"}


def spacing(precision: int, min_exponent: int) -> Array:
    """Half the ulp of a format (`gemm_check.FloatFormat.half_ulp`) by a float64's biased
    exponent, so a loop finds it with a shift and a load: 2^(max(e, min_exponent) − precision)
    for a value in [2^e, 2^(e+1)) — for zero and the float64 subnormals that is the format's
    underflow — and what e = −1 gives for the exponent of inf and NaN (judged apart)."""
    exponents = np.arange(2048) - 1023
    exponents[-1] = -1
    table: Array = np.ldexp(1.0, np.maximum(exponents, min_exponent) - precision)
    return table


def matrices(arrays: Sequence[npt.NDArray[np.floating]]) -> Matrices:
    """`arrays` (each a matrix; float32 kept, any other float read as float64) as the typed list
    the row loop reads, holding the arrays themselves where they are already C-contiguous."""
    dtype = np.float32 if all(array.dtype == np.float32 for array in arrays) else np.float64
    return List([np.ascontiguousarray(array, dtype) for array in arrays])


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _row_sums(row: npt.NDArray[np.floating], x: Array) -> tuple[float, float]:
    """Σ W_j·x_j and Σ |W_j·x_j| over one weight row, in float64."""
    exact = 0.0
    total = 0.0
    for j in range(x.shape[0]):
        product = np.float64(row[j]) * x[j]
        exact += product
        total += abs(product)
    return exact, total


@numba.njit(cache=True, nogil=True, error_model="numpy")
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
    0/0 is 0 and NaN is inf, so a value that is not finite fails (its excess is inf or NaN)."""
    bits = y.view(np.uint64)
    tokens = rows.shape[0]
    worst = np.zeros(tokens)
    for t in range(tokens):
        weight = weights[entries[t]]
        for k in range(rows.shape[1]):
            row = rows[t, k]
            exact, total = _row_sums(weight[row], x[t])
            excess = y[t, row] - exact
            if excess == 0.0:
                continue
            ratio = abs(excess) / (spacings[(bits[t, row] >> 52) & 0x7FF] + slack * total)
            worst[t] = max(worst[t], math.inf if math.isnan(ratio) else ratio)
    return worst


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _dot(a: Array, b: Array) -> float:
    total = 0.0
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _output_sums(y: Array, bits: npt.NDArray[np.uint64], spacings: Array) -> tuple[float, float]:
    """Σ half_ulp(y)² and Σ |y|."""
    rounding = 0.0
    magnitude = 0.0
    for i in range(y.shape[0]):
        spacing = spacings[(bits[i] >> 52) & 0x7FF]
        rounding += spacing * spacing
        magnitude += abs(y[i])
    return rounding, magnitude


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _input_sums(x: Array, column_abs: Array) -> tuple[float, float]:
    """Σ |x|·1ᵀ|W| and Σ x²."""
    sum_abs = 0.0
    squares = 0.0
    for j in range(x.shape[0]):
        sum_abs += abs(x[j]) * column_abs[j]
        squares += x[j] * x[j]
    return sum_abs, squares


@numba.njit(cache=True, nogil=True, error_model="numpy")
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
