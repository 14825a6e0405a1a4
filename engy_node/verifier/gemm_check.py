"""The GEMM audit's check (docs/verification.md, issue 32 item 4): did the served projection
compute y = W·x with the committed weights, for the committed x and y, and do consecutive
committed activations follow from each other through the layer's cheap non-linear steps?

The scheme. For a weight matrix W (m×n) the verifier draws K secret sign vectors σ ∈ {±1}^m
(`draw_signs`: SHAKE-256 of a 256-bit secret, so it is a CSPRNG; tests pass a fixed seed) and
precomputes σᵀW once per model (`verifier_key`). A challenged token's GEMV is then checked with
two dot products per vector (`freivalds`): D = σᵀy − (σᵀW)·x, which is σᵀe for the error
e = y − Wx of the served output. Rows the challenge opens are recomputed outright
(`row_check`: one dot product per row, each held to its own row's bound). A verifier judging
many tokens of many matrices at once (an audit's layers and projections) uses the same checks as
per-token ratios (`freivalds_ratios` with a `KeyStack`, `drawn_row_ratios`, `replay_ratios`), each
token against its own matrix, so that the audit costs one call per check rather than one per
matrix; the first two are compiled loops (`gemm_kernels`) that read each value once.

Tolerance, from the arithmetic. Served in a format with unit roundoff u_acc (fp32 accumulate) and
rounded to an output format D, row i of an honest output satisfies, for any accumulation order
(every product meets at most n − 1 additions on its way, whatever tree or blocking the kernel
uses, and the standard bound Π(1 + δ_k) − 1 ≤ γ_n = n·u/(1 − n·u) does not depend on which):

    |ỹ_i − (Wx)_i| ≤ δ_i = half_ulp_D(ỹ_i) + θ_n · s_i,   s_i = Σ_j |W_ij||x_j|,
    θ_n = (1 + u_acc)^(n − 1 + [products rounded]) − 1            (≤ γ_n)

and block-FP8 (exact fp8 products summed in chunks of 128 at the tensor core's reduced
precision u_chunk, each chunk scaled and added in fp32) has θ_n = (1 + u_chunk)^127 ·
(1 + u_acc)^(⌈n/128⌉ + 1) − 1. The x in the bound is what the GEMM consumed: for W8A8 that is the
fp8 activation times its group scale, so the capture must record it (recording the bf16 value
before quantisation would add a 2⁻⁴ relative input error that swamps the check).

The honest error d = ỹ − Wx is fixed before the verifier's secret σ is used, so σᵀd is a
Rademacher sum: Hoeffding gives P(|σᵀd| > z‖δ‖₂) ≤ 2·exp(−z²/2). With z = √(2 ln(2K/p)) an honest
product fails any of the K vectors with probability ≤ p (2⁻⁴⁰ per check by default). ‖δ‖₂ needs
no per-row work: ‖δ‖₂ ≤ ‖half_ulp(ỹ)‖₂ + θ_n · min(‖W‖_F‖x‖₂, (1ᵀ|W|)·|x|), both norms precomputed
(for σ ∈ {±1}, |σ|ᵀ|W| = 1ᵀ|W| for every vector). The verifier's own float64 rounding is added.
A worst-case bound summed over rows (Σ|σ_i|δ_i) is never wrong but grows with m where this grows
with √m: 4× looser on SmolLM2's MLP, 20× on a 70B one.

False accept, per challenged token and matrix, with K vectors. (a) If any row is off by more
than the tolerance T (|e_k| > T), then for each vector the two values of σ_k give statistics
2|e_k| apart, so at most one lies in [−T, T]: a vector passes with probability ≤ 1/2, all K with
≤ 2⁻ᴷ, whatever the other rows hold. (b) A single wrong weight element W_kl + ε, the product
otherwise computed as served, moves only row k, by ε·x_l; beyond 2T it can pass only if the
honest rounding σᵀd of the other rows exceeds T = z‖δ‖₂, so with probability ≤ 2·exp(−z²/2) per
vector: ≤ 2⁻⁴⁰ with one vector, the issue's 1 − 2⁻³⁰ with room. One vector per matrix is
therefore the default cost (`bench/gemm_check.py`: keys of n + m floats per matrix); K ≥ 30
buys (a)'s bound for adversarial outputs at K times the keys and the time. Errors spread thinly
over every row (dense weight noise, 8-bit weights) move each row by about as much as bf16's own
output rounding; those the row check catches, against each row's own δ_i, which is never
exceeded honestly (on SmolLM2 with 1e-2 relative noise, ≥ 99.8 % of opened rows).

Replay. Between GEMMs a Llama layer (SmolLM2 is one) has cheap element-wise steps the verifier
replays in float64 against the committed activations, each with a relative bound from the same
unit roundoffs (`replay_layer`): q/k/v share one input and gate/up another (bit-equal); down's
input is silu(gate)·up; q's input is RMSNorm(residual)·γ; gate's input is the RMSNorm of
residual + o; the next residual is residual + o + down. So a chain cannot be forged one matrix at
a time. Attention (RoPE, softmax(QKᵀ)V) between q/k/v and o needs every earlier position's keys
and values: it stays in the trust region (it has no weights to substitute; the o projection is
still checked on whatever it was fed, and TOPLOC judges the attention end to end).

Pure functions of numpy arrays; no IO, clock or randomness beyond the seed the caller passes.
The per-token arithmetic of Freivalds, the row check and the replay runs in compiled loops
(`gemm_kernels`); this module holds the rules, the bounds and their derivation.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from engy_node.verifier import gemm_kernels

Array = npt.NDArray[np.float64]

FLOAT64_UNIT_ROUNDOFF = 2.0**-53
FUNCTION_ERROR = 2.0**-20
"""Relative error allowed for a transcendental evaluated in fp32 (exp, rsqrt inside silu and
RMSNorm): 16 ulp, above any CUDA or CPU library's documented bound."""


@dataclasses.dataclass(frozen=True, slots=True)
class FloatFormat:
    name: str
    precision: int
    """Significand bits, the implicit one included: unit roundoff is 2^-precision."""
    min_exponent: int
    """Exponent of the smallest normal number."""
    max_value: float

    @property
    def unit_roundoff(self) -> float:
        return 2.0**-self.precision

    @property
    def underflow(self) -> float:
        """Half the subnormal spacing: the absolute error of rounding near zero."""
        return 2.0 ** (self.min_exponent - self.precision)

    def half_ulp(self, values: Array) -> Array:
        """The most a value rounded to nearest in this format, `values`, can be from what was
        rounded (the ulp above, so a power of two is covered from below too):
        2^(max(e, min_exponent) − precision) for |value| in [2^e, 2^(e+1)), built from the
        float64 exponent bits, which is half of frexp and ldexp's time on an audit's outputs.
        A non-finite value gets what frexp's exponent 0 would give; callers judge it apart."""
        array = np.asarray(values, np.float64)
        exponent = np.atleast_1d(array.view(np.uint64) >> np.uint64(52))
        exponent &= np.uint64(0x7FF)
        exponent[exponent == 0x7FF] = 1022
        np.maximum(exponent, np.uint64(self.min_exponent + 1023), out=exponent)
        exponent -= np.uint64(self.precision)
        exponent <<= np.uint64(52)
        spacing: Array = exponent.view(np.float64)
        spacing[np.atleast_1d(array == 0)] = self.underflow
        return spacing.reshape(array.shape)


FP32 = FloatFormat("float32", 24, -126, 3.4028234663852886e38)
BF16 = FloatFormat("bfloat16", 8, -126, 3.3895313892515355e38)
FP16 = FloatFormat("float16", 11, -14, 65504.0)
FP8_E4M3 = FloatFormat("float8_e4m3fn", 4, -6, 448.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Arithmetic:
    """How the serving side computes a projection and the element-wise steps between them."""

    name: str
    activations: FloatFormat
    """The format of activations between GEMMs and of each GEMM's output."""
    products_exact: bool
    """Whether a weight × input product is exact in the accumulator (bf16, fp16 and fp8 in fp32)."""
    accumulate: FloatFormat = FP32
    chunk: int = 0
    """Inputs summed per chunk at `chunk_accumulate` before the chunk joins the fp32 sum (block
    FP8 on tensor cores); 0: one accumulator over the whole row."""
    chunk_accumulate: FloatFormat = FP32
    input_format: FloatFormat | None = None
    """The format each GEMM consumes its input in when it is not `activations` (W8A8's fp8, one
    scale per `input_group` elements of a token); None: it consumes the activation as is."""
    input_group: int = 128

    def growth(self, n: int) -> float:
        """θ_n: the relative accumulation error of a length-n row, any order, as a multiple of
        Σ|W||x| (the product of every rounding factor a term can meet, less one)."""
        extra = 0 if self.products_exact else 1
        if not self.chunk:
            return math.expm1((n - 1 + extra) * math.log1p(self.accumulate.unit_roundoff))
        inside = (min(self.chunk, n) - 1 + extra) * math.log1p(self.chunk_accumulate.unit_roundoff)
        across = (-(-n // self.chunk) + 1) * math.log1p(self.accumulate.unit_roundoff)
        return math.expm1(inside + across)


BF16_SERVE = Arithmetic("bf16 serve, fp32 accumulate", BF16, products_exact=True)
FP16_SERVE = Arithmetic("fp16 serve, fp32 accumulate", FP16, products_exact=True)
FP32_SERVE = Arithmetic("fp32 serve", FP32, products_exact=False)
FP8_BLOCK_SERVE = Arithmetic(
    "block-FP8 W8A8 (128×128 weight blocks, 1×128 activation groups), bf16 activations",
    BF16,
    products_exact=True,
    chunk=128,
    chunk_accumulate=FloatFormat("tensor-core fp8 accumulator", 13, -126, FP32.max_value),
    input_format=FP8_E4M3,
)
"""The chunk accumulator is taken at 13 bits: DeepSeek-V3 measured about 14 on H800."""
ARITHMETIC = {
    "bfloat16": BF16_SERVE,
    "float16": FP16_SERVE,
    "float32": FP32_SERVE,
    "fp8-block": FP8_BLOCK_SERVE,
}
"""By the serving side's dtype name."""


def dequantise_blocks(quantised: Array, scales: Array, block: tuple[int, int] = (128, 128)) -> Array:
    """A block-quantised matrix in float64 (exact: an fp8 value times an fp32 scale fits in 53
    bits): element (i, j) times `scales[i // block[0], j // block[1]]` (a checkpoint's
    `weight_scale_inv`, which despite its name multiplies)."""
    rows, cols = quantised.shape
    expanded = np.repeat(np.repeat(np.asarray(scales, np.float64), block[0], axis=0), block[1], axis=1)
    return np.asarray(quantised, np.float64) * expanded[:rows, :cols]


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    step: str
    worst: float
    """The largest |discrepancy| / tolerance over what was checked: ≤ 1 passes."""
    where: int = -1
    """The token (row of the committed activations) with the worst ratio; -1 when none."""

    @property
    def passed(self) -> bool:
        return self.worst <= 1.0


def check_of(step: str, per_token: Array) -> Check:
    """The Check over per-token ratios: the worst token's."""
    if per_token.size == 0:
        return Check(step, 0.0)
    token = int(np.argmax(per_token))
    return Check(step, float(per_token[token]), token)


def _rows(values: npt.ArrayLike) -> Array:
    """Activations as float64 rows, one per token."""
    array = np.asarray(values, np.float64)
    return array.reshape(1, -1) if array.ndim == 1 else array


def _loop_rows(values: npt.ArrayLike) -> Array:
    return gemm_kernels.ready(_rows(values))


def _loop_indices(values: npt.ArrayLike) -> npt.NDArray[np.intp]:
    return gemm_kernels.ready(np.asarray(values, np.intp))


def draw_signs(seed: bytes, label: str, vectors: int, rows: int) -> Array:
    """`vectors` × `rows` signs (±1.0) from SHAKE-256 of the verifier's secret `seed` and the
    matrix's `label` (its tensor name), so each matrix gets independent vectors from one secret."""
    stream = hashlib.shake_256(seed + b"\0" + label.encode()).digest(-(-vectors * rows // 8))
    bits = np.unpackbits(np.frombuffer(stream, np.uint8))[: vectors * rows]
    return (1.0 - 2.0 * bits.astype(np.float64)).reshape(vectors, rows)


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierKey:
    """The verifier's secret for one weight matrix W (m×n), made once per model."""

    signs: Array
    """K × m: the secret vectors σ."""
    projected: Array
    """K × n: σᵀW for each vector."""
    column_abs: Array
    """n: 1ᵀ|W| (= |σ|ᵀ|W| for every σ), for the Σ|W||x| term of the tolerance."""
    frobenius: float

    @property
    def shape(self) -> tuple[int, int]:
        return self.signs.shape[1], self.projected.shape[1]

    @property
    def false_accept(self) -> float:
        """The most a product with any row beyond tolerance passes with: 2^-K (bound (a))."""
        return 2.0 ** -int(self.signs.shape[0])


def verifier_key(weight: npt.ArrayLike, signs: Array) -> VerifierKey:
    """The key for `weight` (m×n, any float dtype; read exactly into float64) and `signs`
    (K×m, from `draw_signs`)."""
    matrix = np.asarray(weight, np.float64)
    if signs.shape[1] != matrix.shape[0]:
        raise ValueError(f"{signs.shape[1]} signs per vector for a matrix of {matrix.shape[0]} rows")
    return VerifierKey(
        signs=signs,
        projected=signs @ matrix,
        column_abs=np.abs(matrix).sum(axis=0),
        frobenius=float(np.linalg.norm(matrix)),
    )


def _gamma(terms: int, unit_roundoff: float) -> float:
    return terms * unit_roundoff / (1 - terms * unit_roundoff)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyStack:
    """Keys stacked two ways, so that many checks run as one pass: along a leading axis, one
    entry per matrix of one kind (a projection's, one per layer: a check's `entries` give each
    token its own layer's), and side by side along the vectors, matrices of different kinds (a
    layer's seven projections, `joined`), each a segment of the inputs and outputs it is
    checked on."""

    signs: Array
    """L × K × Σm: each segment's secret vectors σ."""
    projected: Array
    """L × K × Σn: σᵀW of each segment."""
    column_abs: Array
    """L × Σn."""
    frobenius: Array
    """L × S."""
    m_starts: tuple[int, ...] = (0,)
    """Where each segment's rows (outputs) start."""
    n_starts: tuple[int, ...] = (0,)
    """Where each segment's columns (inputs) start."""

    @classmethod
    def of(cls, keys: Sequence[VerifierKey]) -> KeyStack:
        """One matrix kind: `keys` one per entry, all of one shape."""
        return cls(
            np.stack([key.signs for key in keys]),
            np.stack([key.projected for key in keys]),
            np.stack([key.column_abs for key in keys]),
            np.array([[key.frobenius] for key in keys]),
        )

    @classmethod
    def joined(cls, stacks: Sequence[KeyStack]) -> KeyStack:
        """Single-segment stacks with as many entries each, side by side."""
        m_starts = np.cumsum([0] + [stack.signs.shape[2] for stack in stacks[:-1]])
        n_starts = np.cumsum([0] + [stack.projected.shape[2] for stack in stacks[:-1]])
        return cls(
            np.concatenate([stack.signs for stack in stacks], axis=2),
            np.concatenate([stack.projected for stack in stacks], axis=2),
            np.concatenate([stack.column_abs for stack in stacks], axis=1),
            np.concatenate([stack.frobenius for stack in stacks], axis=1),
            tuple(m_starts.tolist()),
            tuple(n_starts.tolist()),
        )

    def widths(self) -> tuple[Array, Array]:
        """Each segment's m and n."""
        m = np.diff([*self.m_starts, self.signs.shape[2]])
        n = np.diff([*self.n_starts, self.projected.shape[2]])
        return m, n

    def bounds(self) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """Where each segment's rows and columns start, and the ends: S + 1 each."""
        return (
            np.array([*self.m_starts, self.signs.shape[2]], np.intp),
            np.array([*self.n_starts, self.projected.shape[2]], np.intp),
        )


def _tolerance(keys: KeyStack, inputs: Array, outputs: Array, arithmetic: Arithmetic, false_reject: float) -> Array:
    """T × S: `freivalds_tolerance` of every token and segment."""
    m, n = keys.widths()
    sum_abs = np.add.reduceat(np.abs(inputs) * keys.column_abs, keys.n_starts, axis=1)
    norms = np.sqrt(np.add.reduceat(inputs * inputs, keys.n_starts, axis=1))
    products = np.minimum(keys.frobenius * norms, sum_abs)
    half_ulps = arithmetic.activations.half_ulp(outputs)
    rounding = np.sqrt(np.add.reduceat(half_ulps * half_ulps, keys.m_starts, axis=1))
    z = math.sqrt(2 * math.log(2 * keys.signs.shape[1] / false_reject))
    growth, own = _segment_terms(keys, arithmetic)
    own_terms = 2 * sum_abs + np.add.reduceat(np.abs(outputs), keys.m_starts, axis=1)
    tolerance: Array = z * (rounding + growth * products) + own * own_terms
    return tolerance


def freivalds_tolerance(
    key: VerifierKey, x: npt.ArrayLike, y: npt.ArrayLike, arithmetic: Arithmetic, *, false_reject: float = 2.0**-40
) -> Array:
    """T per token: z·‖δ‖₂ with z = √(2 ln(2K / false_reject)), plus the verifier's own float64
    rounding of the statistic; the same for every vector (|σ| = 1)."""
    return _tolerance(KeyStack.of([key]), _rows(x), _rows(y), arithmetic, false_reject)[:, 0]


@functools.cache
def _spacings(fmt: FloatFormat) -> Array:
    return gemm_kernels.spacing(fmt.precision, fmt.min_exponent)


def _segment_terms(keys: KeyStack, arithmetic: Arithmetic) -> tuple[Array, Array]:
    """Per segment, θ_n (`Arithmetic.growth`) and the verifier's own γ over its m + n + 2 terms."""
    m, n = keys.widths()
    growth = np.array([arithmetic.growth(int(width)) for width in n])
    own = np.array([_gamma(int(terms), FLOAT64_UNIT_ROUNDOFF) for terms in m + n + 2])
    return growth, own


def freivalds_ratios(
    keys: KeyStack,
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    arithmetic: Arithmetic,
    *,
    false_reject: float = 2.0**-40,
    entries: npt.ArrayLike | None = None,
) -> Array:
    """T × S: per token and segment, the largest |σᵀy − (σᵀW)x| over the K vectors as a
    multiple of its tolerance (`freivalds_tolerance`; inf where a value it reads is not
    finite), token t checked against `keys` entry `entries[t]` (default: entry t, or the one
    entry every token shares); x (T × Σn) and y (T × Σm) hold each segment's inputs and outputs
    side by side. One compiled pass over each token's values (`gemm_kernels`)."""
    inputs, outputs = _loop_rows(x), _loop_rows(y)
    tokens = inputs.shape[0]
    if entries is None:
        entries = np.zeros(tokens, np.intp) if keys.signs.shape[0] == 1 else np.arange(tokens)
    chosen = _loop_indices(entries)
    if (
        inputs.shape[1] != keys.projected.shape[2]
        or outputs.shape[1] != keys.signs.shape[2]
        or outputs.shape[0] != tokens
        or chosen.shape != (tokens,)
        or not (0 <= chosen).all()
        or not (chosen < keys.signs.shape[0]).all()
    ):
        raise ValueError(
            f"x {inputs.shape} and y {outputs.shape}, entries {chosen.tolist()} for keys of "
            f"{keys.signs.shape[0]} × {keys.widths()}"
        )
    growth, own = _segment_terms(keys, arithmetic)
    m_bounds, n_bounds = keys.bounds()
    z = math.sqrt(2 * math.log(2 * keys.signs.shape[1] / false_reject))
    ratios: Array = gemm_kernels.freivalds_ratios(
        keys.signs,
        keys.projected,
        keys.column_abs,
        keys.frobenius,
        chosen,
        m_bounds,
        n_bounds,
        growth,
        own,
        z,
        inputs,
        outputs,
        _spacings(arithmetic.activations),
    )
    return ratios


def freivalds(
    key: VerifierKey, x: npt.ArrayLike, y: npt.ArrayLike, arithmetic: Arithmetic, *, false_reject: float = 2.0**-40
) -> Check:
    """Freivalds' check of committed y (tokens × m) against W·x for committed x (tokens × n):
    fails when some vector's |σᵀy − (σᵀW)x| exceeds `freivalds_tolerance`, which an honest
    product does with probability ≤ `false_reject` per token."""
    inputs, outputs = _rows(x), _rows(y)
    per_token = freivalds_ratios(KeyStack.of([key]), inputs, outputs, arithmetic, false_reject=false_reject)
    return check_of("freivalds", per_token[:, 0])


def drawn_row_ratios(
    weights: gemm_kernels.Matrices,
    entries: npt.ArrayLike,
    rows: npt.ArrayLike,
    x: npt.ArrayLike,
    y: npt.ArrayLike,
    arithmetic: Arithmetic,
) -> Array:
    """Per token t, the worst of rows `rows[t]` of matrix `weights[entries[t]]` (a typed list
    from `gemm_kernels.matrices`, read in place) recomputed for committed x[t] against the same
    rows of committed y[t] (every row's output), each as a multiple of that row's own δ_i:
    half_ulp(y_i) + (θ_n + γ_{n+1}) · Σ_j |W_ij||x_j|. One compiled pass over each drawn row."""
    inputs, outputs = _loop_rows(x), _loop_rows(y)
    chosen, drawn = _loop_indices(entries), _loop_indices(rows)
    n = inputs.shape[1]
    slack = arithmetic.growth(n) + _gamma(n + 1, FLOAT64_UNIT_ROUNDOFF)
    ratios: Array = gemm_kernels.row_ratios(
        weights, chosen, drawn, inputs, outputs, slack, _spacings(arithmetic.activations)
    )
    return ratios


def row_ratios(weight_rows: npt.ArrayLike, x: npt.ArrayLike, y_rows: npt.ArrayLike, arithmetic: Arithmetic) -> Array:
    """Per token, the worst of its recomputed rows as a multiple of that row's own δ_i: opened
    rows of W (r × n, the same for every token, or T × r × n, token t's own) against the same
    rows of committed y (T × r) for committed x (T × n)."""
    stacked, inputs, outputs = np.asarray(weight_rows), _rows(x), _rows(y_rows)
    tokens = inputs.shape[0]
    if stacked.ndim == 2:
        weights, entries = gemm_kernels.matrices([stacked]), np.zeros(tokens, np.intp)
    else:
        weights, entries = gemm_kernels.matrices(list(stacked)), np.arange(tokens)
    rows = np.tile(np.arange(outputs.shape[1]), (outputs.shape[0], 1))
    return drawn_row_ratios(weights, entries, rows, inputs, outputs, arithmetic)


def row_check(weight_rows: npt.ArrayLike, x: npt.ArrayLike, y_rows: npt.ArrayLike, arithmetic: Arithmetic) -> Check:
    """Opened rows of W (r×n) recomputed against the same rows of committed y (tokens × r) for
    committed x (tokens × n), each held to its own δ_i: never fails an honest product."""
    return check_of("rows", row_ratios(weight_rows, x, y_rows, arithmetic))


def _relative(*factors: tuple[float, int]) -> float:
    """Π(1 + u)^k − 1 over (u, k) pairs."""
    return math.expm1(sum(k * math.log1p(u) for u, k in factors))


def _quantisation(arithmetic: Arithmetic) -> gemm_kernels.Quantisation:
    """How the arithmetic's GEMMs consume their inputs, as the replay's loops take it: W8A8
    quantises each group of a token's values to the input format."""
    fmt = arithmetic.input_format
    if fmt is None:
        return gemm_kernels.NOT_QUANTISED
    return (fmt.unit_roundoff, fmt.underflow, 2 / fmt.max_value, arithmetic.input_group)


def _per_token(values: Array, tokens: int) -> Array:
    """One row per token: `values` as given, or its one row repeated."""
    rows = _loop_rows(values)
    return rows if rows.shape[0] == tokens else np.repeat(rows, tokens, axis=0)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerTrace:
    """What a Llama decoder layer's capture committed for some tokens (rows): each projection's
    (input, output) by module name (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
    `up_proj`, `down_proj`), those the challenge opened; the residual stream into the layer and
    out of it where opened."""

    projections: Mapping[str, tuple[Array, Array]]
    residual_in: Array | None = None
    residual_out: Array | None = None


def replay_layer(
    trace: LayerTrace, input_norm: Array, post_norm: Array, eps: float, arithmetic: Arithmetic
) -> tuple[Check, ...]:
    """The layer's element-wise steps replayed against the committed activations, each a Check;
    a step whose activations were not opened is not checked. `input_norm` and `post_norm` are
    the two RMSNorm weights, `eps` their epsilon."""
    return tuple(
        check_of(step, per_token) for step, per_token in replay_ratios(trace, input_norm, post_norm, eps, arithmetic)
    )


def replay_ratios(
    trace: LayerTrace, input_norm: Array, post_norm: Array, eps: float, arithmetic: Arithmetic
) -> tuple[tuple[str, Array], ...]:
    """`replay_layer`'s steps as (step, per-token ratios): the tokens may come from different
    layers, each with its own norm weights (`input_norm` and `post_norm` T × hidden, or one
    vector every token shares)."""
    opened = {name: (_loop_rows(x), _loop_rows(y)) for name, (x, y) in trace.projections.items()}
    u = arithmetic.activations.unit_roundoff
    checks: list[tuple[str, Array]] = []
    for step, names in (("q/k/v input", ("q_proj", "k_proj", "v_proj")), ("gate/up input", ("gate_proj", "up_proj"))):
        inputs = [opened[name][0] for name in names if name in opened]
        if len(inputs) > 1:
            same = np.logical_and.reduce([(inputs[0] == other).all(axis=1) for other in inputs[1:]])
            checks.append((step, np.where(same, 0.0, np.inf)))
    quantised = _quantisation(arithmetic)
    floor = 2 * arithmetic.activations.underflow
    if {"gate_proj", "up_proj", "down_proj"} <= opened.keys():
        # silu in fp32 (exp, add, divide) rounded to D, times up rounded to D (or fused: one
        # rounding, covered).
        relative = _relative((FUNCTION_ERROR, 1), (FP32.unit_roundoff, 2), (u, 2))
        gate, up, down_in = opened["gate_proj"][1], opened["up_proj"][1], opened["down_proj"][0]
        with np.errstate(over="ignore"):
            decay = np.exp(-gate)
        ratios = gemm_kernels.silu_ratios(gate, decay, up, down_in, relative, floor, quantised)
        checks.append(("silu(gate)·up", ratios))
    residual = None if trace.residual_in is None else _loop_rows(trace.residual_in)
    if residual is None:
        return tuple(checks)
    tokens, hidden = residual.shape
    # Mean of squares and eps in fp32 (γ_{d+3} on the variance, so on its inverse root), rsqrt,
    # the product in fp32; rounded to D, then × γ rounded to D.
    variance = _gamma(hidden + 3, FP32.unit_roundoff)
    norm = _relative((FUNCTION_ERROR, 1), (FP32.unit_roundoff, 1), (u, 2), (variance, 1))
    first = next((opened[name][0] for name in ("q_proj", "k_proj", "v_proj") if name in opened), None)
    if first is not None:
        ratios = gemm_kernels.rmsnorm_ratios(
            residual, residual, False, _per_token(input_norm, tokens), eps, first, norm, floor, quantised
        )
        checks.append(("input norm", ratios))
    if "o_proj" not in opened:
        return tuple(checks)
    attention = opened["o_proj"][1]
    mlp_input = next((opened[name][0] for name in ("gate_proj", "up_proj") if name in opened), None)
    if mlp_input is not None:
        # The sum is rounded to D before the norm reads it (or not, when fused): each element
        # within (1 ± u), the root mean square too.
        rounded_sum = (1 + norm) * (1 + u) / (1 - u) - 1
        ratios = gemm_kernels.rmsnorm_ratios(
            residual, attention, True, _per_token(post_norm, tokens), eps, mlp_input, rounded_sum, floor, quantised
        )
        checks.append(("post-attention norm", ratios))
    if "down_proj" in opened and trace.residual_out is not None:
        committed = _loop_rows(trace.residual_out)
        ratios = gemm_kernels.residual_ratios(residual, attention, opened["down_proj"][1], committed, u, floor)
        checks.append(("residual", ratios))
    return tuple(checks)
