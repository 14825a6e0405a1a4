"""The GEMM audit's check (engy_node/verifier/gemm_check.py): honest products pass for every
arithmetic the serving side may use, in any accumulation order; a wrong weight, input or output
beyond tolerance is caught at the stated rate; the element-wise steps between GEMMs replay; and
the real SmolLM2 layers, served in bf16, pass while noise-perturbed ones do not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.verifier import gemm_check as gc

FORMATS = {gc.BF16_SERVE: torch.bfloat16, gc.FP16_SERVE: torch.float16, gc.FP32_SERVE: torch.float32}


def round_to(values: np.ndarray, fmt: gc.FloatFormat) -> np.ndarray:
    """Round to nearest even in `fmt` (subnormals included, no overflow)."""
    _, exponent = np.frexp(values)
    quantum = np.ldexp(1.0, np.maximum(exponent - 1, fmt.min_exponent) - fmt.precision + 1)
    return np.round(values / quantum) * quantum


@given(
    fmt=st.sampled_from([gc.BF16, gc.FP16, gc.FP32, gc.FP8_E4M3]),
    values=st.lists(st.floats(allow_subnormal=True), min_size=1, max_size=40),
)
def test_half_ulp_is_half_the_spacing_of_the_binade_above(fmt, values):
    """The bit-built half ulp is frexp's definition: for |v| in [2^e, 2^(e+1)),
    2^(max(e, min_exponent) − precision); zero gets the format's underflow. Rounding to the
    format moves a value by at most it."""
    array = np.array(values)
    _, exponent = np.frexp(array)
    expected = np.where(
        array == 0, fmt.underflow, np.ldexp(1.0, np.maximum(exponent - 1, fmt.min_exponent) - fmt.precision)
    )
    np.testing.assert_array_equal(fmt.half_ulp(array), expected)
    np.testing.assert_array_equal(fmt.half_ulp(array.reshape(1, -1)[:, ::-1]), expected[::-1].reshape(1, -1))
    np.testing.assert_array_equal(fmt.half_ulp(np.float64(values[0])), expected[0])
    representable = np.isfinite(array) & (np.abs(array) < fmt.max_value / 2)
    moved = np.abs(round_to(array[representable], fmt) - array[representable])
    assert (moved <= fmt.half_ulp(round_to(array[representable], fmt))).all()


def activations(rng: np.random.Generator, tokens: int, width: int, spread: float) -> np.ndarray:
    """LLM-like activations: log-normal magnitudes, a few outlier channels."""
    x = rng.standard_normal((tokens, width)) * np.exp(spread * rng.standard_normal(width))
    x[:, rng.integers(0, width, size=max(1, width // 64))] *= 30
    return x


def accumulate(terms: np.ndarray, fmt: gc.FloatFormat, order: str, rng: np.random.Generator) -> np.ndarray:
    """Σ over the last axis, rounding every addition to `fmt`: left to right in a random
    permutation, or as a pairwise tree."""
    if order == "tree":
        while terms.shape[-1] > 1:
            if terms.shape[-1] % 2:
                terms = np.concatenate([terms, np.zeros(terms.shape[:-1] + (1,))], axis=-1)
            terms = round_to(terms[..., 0::2] + terms[..., 1::2], fmt)
        return terms[..., 0]
    terms = terms[..., rng.permutation(terms.shape[-1])]
    total = np.zeros(terms.shape[:-1])
    for j in range(terms.shape[-1]):
        total = round_to(total + terms[..., j], fmt)
    return total


def served(weight: np.ndarray, x: np.ndarray, arithmetic: gc.Arithmetic, order: str, seed: int) -> np.ndarray:
    """y = Wx as a kernel with `arithmetic` computes it (weight and x already in its formats)."""
    rng = np.random.default_rng(seed)
    products = weight[None, :, :] * x[:, None, :]
    if not arithmetic.products_exact:
        products = round_to(products, arithmetic.accumulate)
    return round_to(accumulate(products, arithmetic.accumulate, order, rng), arithmetic.activations)


def fp8_block(values: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 values, fp32 scales): per block, scale = amax / 448."""
    rows, cols = values.shape
    scales = np.zeros((-(-rows // block[0]), -(-cols // block[1])))
    quantised = np.zeros_like(values)
    for a in range(scales.shape[0]):
        for b in range(scales.shape[1]):
            part = values[a * block[0] : (a + 1) * block[0], b * block[1] : (b + 1) * block[1]]
            scale = float(np.float32(max(np.abs(part).max(), 1e-30) / 448))
            scales[a, b] = scale
            q = torch.tensor(part / scale).to(torch.float8_e4m3fn).double().numpy()
            quantised[a * block[0] : (a + 1) * block[0], b * block[1] : (b + 1) * block[1]] = q
    return quantised, scales


def served_fp8(weight: np.ndarray, x: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block-FP8 W8A8 as DeepSeek-style kernels do it: fp8 products summed per 128 at 13 bits,
    each chunk scaled and added in fp32, the output rounded to bf16. Returns (the verifier's W,
    the consumed x, y)."""
    arithmetic, rng = gc.FP8_BLOCK_SERVE, np.random.default_rng(seed)
    q_weight, w_scales = fp8_block(weight, (128, 128))
    consumed, y = np.zeros_like(x), np.zeros((x.shape[0], weight.shape[0]))
    for t in range(x.shape[0]):
        q_x, x_scales = fp8_block(x[t : t + 1], (1, 128))
        consumed[t] = gc.dequantise_blocks(q_x, x_scales, (1, 128))[0]
        total = np.zeros(weight.shape[0])
        for b in range(x_scales.shape[1]):
            part = slice(b * 128, (b + 1) * 128)
            chunk = accumulate(q_weight[:, part] * q_x[0, part], arithmetic.chunk_accumulate, "left", rng)
            scale = round_to(w_scales[np.arange(weight.shape[0]) // 128, b] * x_scales[0, b], gc.FP32)
            total = round_to(total + round_to(chunk * scale, gc.FP32), gc.FP32)
        y[t] = round_to(total, gc.BF16)
    return gc.dequantise_blocks(q_weight, w_scales), consumed, y


def key_for(weight: np.ndarray, seed: int = 0, vectors: int = 32) -> gc.VerifierKey:
    return gc.verifier_key(weight, gc.draw_signs(seed.to_bytes(8, "big"), "w", vectors, weight.shape[0]))


def problem(seed: int, m: int, n: int, tokens: int, arithmetic: gc.Arithmetic) -> tuple[np.ndarray, np.ndarray]:
    """Weights (LLM-sized entries) and inputs already in the arithmetic's format."""
    rng = np.random.default_rng(seed)
    weight = round_to(rng.standard_normal((m, n)) * 0.05, arithmetic.activations)
    x = round_to(activations(rng, tokens, n, spread=1.0), arithmetic.activations)
    return weight, x


shapes = st.tuples(st.integers(1, 200), st.integers(1, 300), st.integers(1, 3))


@settings(max_examples=40, deadline=None)
@given(
    arithmetic=st.sampled_from([gc.BF16_SERVE, gc.FP16_SERVE, gc.FP32_SERVE]),
    shape=shapes,
    order=st.sampled_from(["left", "tree"]),
    seed=st.integers(0, 2**32),
)
def test_honest_products_pass_in_any_accumulation_order(arithmetic, shape, order, seed):
    m, n, tokens = shape
    weight, x = problem(seed, m, n, tokens, arithmetic)
    y = served(weight, x, arithmetic, order, seed)
    assert gc.freivalds(key_for(weight, seed), x, y, arithmetic).passed
    assert gc.row_check(weight, x, y, arithmetic).passed


@settings(max_examples=30, deadline=None)
@given(arithmetic=st.sampled_from(list(FORMATS)), shape=shapes, seed=st.integers(0, 2**32))
def test_honest_products_pass_from_torch_kernels(arithmetic, shape, seed):
    m, n, tokens = shape
    weight, x = problem(seed, m, n, tokens, arithmetic)
    dtype = FORMATS[arithmetic]
    y = torch.nn.functional.linear(torch.tensor(x).to(dtype), torch.tensor(weight).to(dtype)).double().numpy()
    assert gc.freivalds(key_for(weight, seed), x, y, arithmetic).passed
    assert gc.row_check(weight, x, y, arithmetic).passed


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 200), n=st.integers(1, 400), seed=st.integers(0, 2**32))
def test_honest_block_fp8_products_pass(m, n, seed):
    rng = np.random.default_rng(seed)
    weight, x = rng.standard_normal((m, n)) * 0.05, activations(rng, 2, n, spread=1.0)
    dequantised, consumed, y = served_fp8(weight, x, seed)
    assert gc.freivalds(key_for(dequantised, seed), consumed, y, gc.FP8_BLOCK_SERVE).passed
    assert gc.row_check(dequantised, consumed, y, gc.FP8_BLOCK_SERVE).passed


def test_dequantising_blocks_multiplies_each_block_by_its_scale():
    quantised = np.ones((3, 5))
    scales = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert gc.dequantise_blocks(quantised, scales, (2, 2)).tolist() == [
        [1, 1, 2, 2, 3],
        [1, 1, 2, 2, 3],
        [4, 4, 5, 5, 6],
    ]


def perturbed_output(weight, x, row, column, times_tolerance, key, arithmetic):
    """The output of W with element (row, column) moved so it shifts its row by
    `times_tolerance` × the honest product's tolerance (rounded as the serving side would)."""
    y = served(weight, x, arithmetic, "left", 0)
    tolerance = gc.freivalds_tolerance(key, x, y, arithmetic)[0]
    cheat = weight.copy()
    cheat[row, column] += times_tolerance * tolerance / x[0, column]
    return round_to(x @ cheat.T, arithmetic.activations)


@settings(max_examples=40, deadline=None)
@given(
    arithmetic=st.sampled_from([gc.BF16_SERVE, gc.FP16_SERVE, gc.FP32_SERVE]),
    m=st.integers(1, 150),
    n=st.integers(1, 150),
    seed=st.integers(0, 2**32),
    vectors=st.sampled_from([1, 32]),
    data=st.data(),
)
def test_a_single_wrong_weight_element_beyond_tolerance_is_caught(arithmetic, m, n, seed, vectors, data):
    weight, x = problem(seed, m, n, 1, arithmetic)
    column = data.draw(st.sampled_from(np.flatnonzero(x[0]).tolist() or [0]))
    if x[0, column] == 0:
        return
    row, sign = data.draw(st.integers(0, m - 1)), data.draw(st.sampled_from([-1, 1]))
    key = key_for(weight, seed, vectors)
    # 3× rather than the bound's 2×: rounding the cheat's output to the serving dtype may take up to
    # half an ulp back, and with 2× exactly that leaves the committed shift just under 2T.
    y = perturbed_output(weight, x, row, column, sign * 3.0, key, arithmetic)
    check = gc.freivalds(key, x, y, arithmetic)
    assert not check.passed and check.worst > 1
    assert not gc.row_check(weight[row : row + 1], x, y[:, row : row + 1], arithmetic).passed


def escape_rate(times_tolerance: float, draws: int) -> float:
    """How often one vector misses a single wrong element (one matrix, fresh σ per draw)."""
    weight, x = problem(7, 64, 96, 1, gc.BF16_SERVE)
    escapes = 0
    for draw in range(draws):
        key = key_for(weight, draw, vectors=1)
        y = perturbed_output(weight, x, draw % 64, draw % 96, times_tolerance, key, gc.BF16_SERVE)
        escapes += gc.freivalds(key, x, y, gc.BF16_SERVE).passed
    return escapes / draws


def test_one_vector_misses_a_wrong_element_beyond_tolerance_at_most_half_the_time():
    """Bound (a) is ≤ 1/2 per vector just past T (a vector misses when the honest rounding
    leans the other way); bound (b) is ≤ 2^-40 past 2T. Measured: 0.49 at T, 0.24 at 1.05T,
    0.001 at 1.2T, 0 from 1.5T."""
    draws = 1000
    assert escape_rate(1.05, draws) <= 0.5 + 3 * (0.25 / draws) ** 0.5
    assert escape_rate(2.0, draws) == 0


@settings(max_examples=30, deadline=None)
@given(arithmetic=st.sampled_from([gc.BF16_SERVE, gc.FP32_SERVE]), shape=shapes, seed=st.integers(0, 2**32))
def test_a_wrong_input_or_output_is_caught(arithmetic, shape, seed):
    m, n, tokens = shape
    weight, x = problem(seed, m, n, tokens + 1, arithmetic)
    y = served(weight, x, arithmetic, "left", seed)
    key = key_for(weight, seed)
    tolerance = gc.freivalds_tolerance(key, x, y, arithmetic)
    column = int(np.argmax(np.abs(weight).max(axis=0)))
    # The input moved where it meets W's largest element, by enough to move that row past 2T.
    moved = x.copy()
    moved[:, column] += 2 * tolerance / np.abs(weight[:, column]).max()
    assert not gc.freivalds(key, moved, y, arithmetic).passed
    # One output row moved past 2T, T taken where it lands: an output moved across a power of two
    # has twice the rounding room there; every output of another token (when it differs).
    shifted = y.copy()
    step = 2 * tolerance[0]
    for _ in range(8):
        shifted[0, seed % m] = y[0, seed % m] + step
        landed = gc.freivalds_tolerance(key, x, shifted, arithmetic)[0]
        if step >= 2 * landed:
            break
        step = 2 * landed
    assert not gc.freivalds(key, x, shifted, arithmetic).passed
    if not np.array_equal(y[0], y[1]) and np.abs(y[0] - y[1]).max() > 2 * tolerance.max():
        assert not gc.freivalds(key, x[:1], y[1:2], arithmetic).passed
    assert not gc.freivalds(key, x, np.where(y == y, np.nan, y), arithmetic).passed


def test_the_check_is_deterministic_given_its_inputs():
    weight, x = problem(3, 40, 50, 2, gc.BF16_SERVE)
    y = served(weight, x, gc.BF16_SERVE, "tree", 3)
    assert np.array_equal(gc.draw_signs(b"k", "a", 4, 40), gc.draw_signs(b"k", "a", 4, 40))
    assert not np.array_equal(gc.draw_signs(b"k", "a", 4, 40), gc.draw_signs(b"k", "b", 4, 40))
    assert set(np.unique(gc.draw_signs(b"k", "a", 4, 40))) == {-1.0, 1.0}
    first, second = key_for(weight, 3), key_for(weight, 3)
    assert gc.freivalds(first, x, y, gc.BF16_SERVE) == gc.freivalds(second, x, y, gc.BF16_SERVE)
    assert first.false_accept == 2.0**-32


SPECIAL_VALUES = [0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, 1e-300, 1e300]


def with_specials(values: np.ndarray, specials: list[tuple[int, int]]) -> np.ndarray:
    """`values` with some elements (flat index, which special value) replaced."""
    out = values.copy()
    for index, which in specials:
        out.flat[index % out.size] = SPECIAL_VALUES[which]
    return out


def reference_ratio(excess: np.ndarray, tolerance: np.ndarray, read: list[np.ndarray]) -> float:
    """The checks' rule, written plainly: |excess| / tolerance, 0 where the excess is 0, inf where
    that is NaN or where any value read is not finite."""
    if not all(np.isfinite(values).all() for values in read):
        return np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(excess == 0, 0.0, np.abs(excess) / tolerance)
    return float(np.where(np.isnan(ratio), np.inf, ratio).max(initial=0.0))


specials = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, len(SPECIAL_VALUES) - 1)), max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    arithmetic=st.sampled_from([gc.BF16_SERVE, gc.FP16_SERVE, gc.FP32_SERVE]),
    shape=shapes,
    vectors=st.integers(1, 3),
    float32=st.booleans(),
    seed=st.integers(0, 2**32),
    x_specials=specials,
    y_specials=specials,
    wrong=st.sampled_from([0.0, 1e-3, 1.0]),
)
def test_the_compiled_checks_compute_what_their_formulas_say(
    arithmetic, shape, vectors, float32, seed, x_specials, y_specials, wrong
):
    """`freivalds_ratios` and `drawn_row_ratios` run as compiled loops (gemm_kernels) that
    reassociate their sums: each token's ratio is the one the plain numpy formulas give — the
    statistic over `freivalds_tolerance`, each drawn row's excess over its own δ_i — up to float64
    rounding, with zeros, subnormals, huge values, infinities and NaNs judged by the same rules."""
    m, n, tokens = shape
    weight, x = problem(seed, m, n, tokens, arithmetic)
    if float32:
        weight = weight.astype(np.float32).astype(np.float64)
    y = served(weight, x, arithmetic, "left", seed)
    y[:, seed % m] += wrong
    x, y = with_specials(x, x_specials), with_specials(y, y_specials)
    key = key_for(weight, seed, vectors)
    compiled = gc.freivalds_ratios(gc.KeyStack.of([key]), x, y, arithmetic)[:, 0]
    with np.errstate(all="ignore"):
        tolerance = gc.freivalds_tolerance(key, x, y, arithmetic)
    for t in range(tokens):
        with np.errstate(all="ignore"):
            statistic = key.signs @ y[t] - key.projected @ x[t]
        expected = reference_ratio(statistic, tolerance[t], [x[t], y[t]])
        np.testing.assert_allclose(compiled[t], expected, rtol=1e-9, atol=1e-9)
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.choice(m, min(m, 4), replace=False) for _ in range(tokens)])
    matrices = gc.gemm_kernels.matrices([weight.astype(np.float32) if float32 else weight])
    compiled = gc.drawn_row_ratios(matrices, np.zeros(tokens, np.intp), rows, x, y, arithmetic)
    slack = arithmetic.growth(n) + gc._gamma(n + 1, gc.FLOAT64_UNIT_ROUNDOFF)
    for t in range(tokens):
        chosen = weight[rows[t]]
        with np.errstate(all="ignore"):
            excess = y[t, rows[t]] - chosen @ x[t]
            bound = arithmetic.activations.half_ulp(y[t, rows[t]]) + slack * (np.abs(chosen) @ np.abs(x[t]))
        expected = reference_ratio(excess, bound, [y[t, rows[t]]])
        np.testing.assert_allclose(compiled[t], expected, rtol=1e-9, atol=1e-9)


def rmsnorm(hidden: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    variance = hidden.float().pow(2).mean(-1, keepdim=True)
    return gamma * (hidden.float() * torch.rsqrt(variance + eps)).to(hidden.dtype)


def layer_trace(dtype: torch.dtype, seed: int, width: int = 64, inner: int = 160, tokens: int = 2):
    """A Llama layer's committed activations, computed as transformers computes them, with the
    norm weights; attention's output (o_proj's input) is arbitrary (the trust region)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    gammas = rand(width, scale=0.3).abs() + 0.5, rand(width, scale=0.3).abs() + 0.5
    residual = rand(tokens, width, scale=3.0)
    weights = {
        name: rand(*shape, scale=0.1)
        for name, shape in (
            ("q_proj", (width, width)),
            ("k_proj", (width // 2, width)),
            ("o_proj", (width, width)),
            ("gate_proj", (inner, width)),
            ("up_proj", (inner, width)),
            ("down_proj", (width, inner)),
        )
    }
    linear = torch.nn.functional.linear
    attention_in = rmsnorm(residual, gammas[0], 1e-5)
    o_in = rand(tokens, width)
    middle = residual + linear(o_in, weights["o_proj"])
    mlp_in = rmsnorm(middle, gammas[1], 1e-5)
    gate, up = linear(mlp_in, weights["gate_proj"]), linear(mlp_in, weights["up_proj"])
    down_in = torch.nn.functional.silu(gate) * up
    out = middle + linear(down_in, weights["down_proj"])
    inputs = {
        "q_proj": attention_in,
        "k_proj": attention_in,
        "o_proj": o_in,
        "gate_proj": mlp_in,
        "up_proj": mlp_in,
        "down_proj": down_in,
    }
    projections = {
        name: (inputs[name].double().numpy(), linear(inputs[name], weights[name]).double().numpy()) for name in inputs
    }
    trace = gc.LayerTrace(projections, residual.double().numpy(), out.double().numpy())
    return trace, gammas[0].double().numpy(), gammas[1].double().numpy()


@settings(max_examples=30, deadline=None)
@given(arithmetic=st.sampled_from(list(FORMATS)), seed=st.integers(0, 2**32))
def test_an_honest_layer_replays(arithmetic, seed):
    trace, input_norm, post_norm = layer_trace(FORMATS[arithmetic], seed)
    checks = gc.replay_layer(trace, input_norm, post_norm, 1e-5, arithmetic)
    assert [check.step for check in checks] == [
        "q/k/v input",
        "gate/up input",
        "silu(gate)·up",
        "input norm",
        "post-attention norm",
        "residual",
    ]
    assert all(check.passed for check in checks), checks


def replaced(trace: gc.LayerTrace, name: str, x=None, y=None) -> gc.LayerTrace:
    old_x, old_y = trace.projections[name]
    projections = {**trace.projections, name: (old_x if x is None else x, old_y if y is None else y)}
    return gc.LayerTrace(projections, trace.residual_in, trace.residual_out)


@settings(max_examples=20, deadline=None)
@given(arithmetic=st.sampled_from(list(FORMATS)), seed=st.integers(0, 2**32), element=st.integers(0, 63))
def test_a_forged_step_between_gemms_is_caught(arithmetic, seed, element):
    trace, input_norm, post_norm = layer_trace(FORMATS[arithmetic], seed)

    def failed(forged, norms=(input_norm, post_norm)):
        return {check.step for check in gc.replay_layer(forged, *norms, 1e-5, arithmetic) if not check.passed}

    down_in = trace.projections["down_proj"][0].copy()
    down_in[:, element] = down_in[:, element] * 1.1 + 1e-3
    assert failed(replaced(trace, "down_proj", x=down_in)) == {"silu(gate)·up"}
    assert "input norm" in failed(trace, (post_norm, input_norm)) or np.allclose(input_norm, post_norm)
    k_in = trace.projections["k_proj"][0].copy()
    k_in[0, element] += 1.0
    assert failed(replaced(trace, "k_proj", x=k_in)) == {"q/k/v input"}
    # Another layer's o output: the post-attention norm and the residual no longer follow.
    o_out = trace.projections["o_proj"][1][::-1].copy() + 1.0
    assert {"post-attention norm", "residual"} <= failed(replaced(trace, "o_proj", y=o_out))
    assert failed(gc.LayerTrace(trace.projections, trace.residual_in, trace.residual_out * 1.05)) == {"residual"}


@settings(max_examples=30, deadline=None)
@given(arithmetic=st.sampled_from([gc.BF16_SERVE, gc.FP32_SERVE]), seed=st.integers(0, 2**32), data=st.data())
def test_tokens_checked_in_one_pass_against_their_own_matrices_are_judged_as_alone(arithmetic, seed, data):
    """`judge_openings` checks every audited (position, layer) at once, each token against its
    own layer's key, rows and norms: each token's ratio is the one it gets checked alone, a
    wrong one among honest ones included."""
    m, n, tokens = data.draw(st.integers(2, 60)), data.draw(st.integers(2, 80)), data.draw(st.integers(1, 6))
    matrices = [problem(seed + layer, m, n, tokens, arithmetic)[0] for layer in range(3)]
    owner = np.array(data.draw(st.lists(st.integers(0, 2), min_size=tokens, max_size=tokens)))
    _, x = problem(seed, m, n, tokens, arithmetic)
    y = np.concatenate([served(matrices[owner[t]], x[t : t + 1], arithmetic, "left", seed) for t in range(tokens)])
    wrong = data.draw(st.integers(0, tokens - 1))
    y[wrong, seed % m] += data.draw(st.sampled_from([0.0, 1.0]))
    keys = [key_for(weight, seed + layer, vectors=2) for layer, weight in enumerate(matrices)]
    # A second kind of matrix (another shape, as k_proj beside q_proj), checked side by side.
    others = [problem(seed + 7 + layer, n + 3, m, tokens, arithmetic)[0] for layer in range(3)]
    other_keys = [key_for(weight, seed + 7 + layer, vectors=2) for layer, weight in enumerate(others)]
    other_x = problem(seed + 9, n + 3, m, tokens, arithmetic)[1]
    other_y = np.concatenate(
        [served(others[owner[t]], other_x[t : t + 1], arithmetic, "tree", seed) for t in range(tokens)]
    )
    joined = gc.KeyStack.joined([gc.KeyStack.of(keys), gc.KeyStack.of(other_keys)])
    batched = gc.freivalds_ratios(
        joined, np.concatenate([x, other_x], axis=1), np.concatenate([y, other_y], axis=1), arithmetic, entries=owner
    )
    alone = [
        [
            gc.freivalds(keys[owner[t]], x[t : t + 1], y[t : t + 1], arithmetic).worst,
            gc.freivalds(other_keys[owner[t]], other_x[t : t + 1], other_y[t : t + 1], arithmetic).worst,
        ]
        for t in range(tokens)
    ]
    np.testing.assert_allclose(batched, alone, rtol=1e-9)
    assert (batched[wrong, 0] > 1) == (not gc.freivalds(keys[owner[wrong]], x[wrong], y[wrong], arithmetic).passed)
    rows = np.array(sorted(data.draw(st.sets(st.integers(0, m - 1), min_size=1))))
    batched = gc.row_ratios(np.stack([matrices[o][rows] for o in owner]), x, y[:, rows], arithmetic)
    alone = [gc.row_check(matrices[owner[t]][rows], x[t], y[t, rows], arithmetic).worst for t in range(tokens)]
    np.testing.assert_allclose(batched, alone, rtol=1e-9)
    layers = [layer_trace(FORMATS[arithmetic], seed + layer, tokens=1) for layer in owner.tolist()]
    trace = gc.LayerTrace(
        {
            name: tuple(np.concatenate([t.projections[name][i] for t, _, _ in layers]) for i in (0, 1))
            for name in layers[0][0].projections
        },
        np.concatenate([t.residual_in for t, _, _ in layers]),
        np.concatenate([t.residual_out for t, _, _ in layers]),
    )
    trace.residual_out[wrong] *= data.draw(st.sampled_from([1.0, 1.05]))
    norms = [np.stack([layer[i] for layer in layers]) for i in (1, 2)]
    batched_steps = gc.replay_ratios(trace, *norms, 1e-5, arithmetic)
    for t, (single, input_norm, post_norm) in enumerate(layers):
        if t == wrong:
            single = gc.LayerTrace(single.projections, single.residual_in, trace.residual_out[t : t + 1])
        steps = gc.replay_layer(single, input_norm, post_norm, 1e-5, arithmetic)
        assert [step for step, _ in batched_steps] == [check.step for check in steps]
        np.testing.assert_allclose([ratios[t] for _, ratios in batched_steps], [c.worst for c in steps], rtol=1e-9)


def reference_replay(trace, input_norm, post_norm, eps, arithmetic):
    """The replay's element-wise steps as plain numpy over whole arrays, step by step as the
    module docstring states them: (step, per-token ratio) for the steps after the two equality
    checks."""
    u, fmt = arithmetic.activations.unit_roundoff, arithmetic.activations
    x = {name: xy[0] for name, xy in trace.projections.items()}
    y = {name: xy[1] for name, xy in trace.projections.items()}

    def into_gemm(exact, bound, committed):
        quantised = arithmetic.input_format
        if quantised is None:
            return bound
        group, width = arithmetic.input_group, committed.shape[1]
        padded = np.pad(np.abs(committed), ((0, 0), (0, -width % group)))
        amax = padded.reshape(committed.shape[0], -1, group).max(axis=2)
        scale = np.repeat(2 * amax / quantised.max_value, group, axis=1)[:, :width]
        q = quantised.unit_roundoff
        return bound * (1 + q) + q * np.abs(exact) + quantised.underflow * scale

    def worst(committed, exact, bound):
        return [reference_ratio(committed[t] - exact[t], bound[t], []) for t in range(committed.shape[0])]

    def step(committed, exact, relative):
        return worst(committed, exact, into_gemm(exact, relative * np.abs(exact) + 2 * fmt.underflow, committed))

    def rmsnorm_of(hidden, gamma):
        return gamma * hidden / np.sqrt(np.mean(hidden * hidden, axis=1, keepdims=True) + eps)

    silu = gc._relative((gc.FUNCTION_ERROR, 1), (gc.FP32.unit_roundoff, 2), (u, 2))
    variance = gc._gamma(trace.residual_in.shape[1] + 3, gc.FP32.unit_roundoff)
    norm = gc._relative((gc.FUNCTION_ERROR, 1), (gc.FP32.unit_roundoff, 1), (u, 2), (variance, 1))
    middle = trace.residual_in + y["o_proj"]
    out = middle + y["down_proj"]
    with np.errstate(all="ignore"):
        return [
            (
                "silu(gate)·up",
                step(x["down_proj"], y["gate_proj"] / (1 + np.exp(-y["gate_proj"])) * y["up_proj"], silu),
            ),
            ("input norm", step(x["q_proj"], rmsnorm_of(trace.residual_in, input_norm), norm)),
            (
                "post-attention norm",
                step(x["gate_proj"], rmsnorm_of(middle, post_norm), (1 + norm) * (1 + u) / (1 - u) - 1),
            ),
            (
                "residual",
                worst(trace.residual_out, out, u * (1 + u) * np.abs(middle) + u * np.abs(out) + 2 * fmt.underflow),
            ),
        ]


@settings(max_examples=40, deadline=None)
@given(
    arithmetic=st.sampled_from([*FORMATS, gc.FP8_BLOCK_SERVE]),
    seed=st.integers(0, 2**32),
    tokens=st.integers(1, 4),
    specials=specials,
    where=st.sampled_from(["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    moved=st.sampled_from([0.0, 1e-3, 0.5]),
)
def test_the_compiled_replay_computes_what_its_formulas_say(arithmetic, seed, tokens, specials, where, moved):
    """The replay's steps run as compiled loops (gemm_kernels); each token's ratio is the one the
    plain numpy formulas give, for honest and moved values, W8A8's quantised inputs, and values
    that are not finite."""
    trace, input_norm, post_norm = layer_trace(torch.bfloat16, seed, width=200, inner=300, tokens=tokens)
    x, y = trace.projections[where]
    trace = replaced(trace, where, x=x * (1 + moved), y=y + moved)
    # Special values anywhere the replay reads: any projection's input or output, either residual.
    arrays = [*(value for pair in trace.projections.values() for value in pair), trace.residual_in, trace.residual_out]
    for index, which in specials:
        array = arrays[index % len(arrays)]
        array.flat[(index // len(arrays)) % array.size] = SPECIAL_VALUES[which]
    compiled = dict(gc.replay_ratios(trace, input_norm, post_norm, 1e-5, arithmetic))
    for step, expected in reference_replay(trace, input_norm, post_norm, 1e-5, arithmetic):
        np.testing.assert_allclose(compiled[step], expected, rtol=1e-9, atol=1e-9, err_msg=step)


def spoiled(values: np.ndarray, value: float) -> np.ndarray:
    """A copy with one value of the first token replaced."""
    out = values.copy()
    out[0, 3] = value
    return out


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_value_that_is_not_finite_fails_every_replayed_step_that_reads_it(value):
    """Wherever the replay reads a NaN or an infinity — the q/k/v, gate/up and down inputs, the
    o, gate, up and down outputs, either residual (not attention's inputs and output, the trust
    region) — the token fails (inf), and the other token does not."""
    trace, input_norm, post_norm = layer_trace(torch.bfloat16, 5, tokens=2)
    read = {"q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (1,), "down_proj": (0, 1)}
    places = [(name, side) for name in trace.projections for side in read.get(name, (0, 1))]
    for place in [*places, "residual_in", "residual_out"]:
        projections = dict(trace.projections)
        residuals = {"residual_in": trace.residual_in, "residual_out": trace.residual_out}
        if place in residuals:
            residuals[place] = spoiled(residuals[place], value)
        else:
            name, side = place
            pair = list(projections[name])
            pair[side] = spoiled(pair[side], value)
            projections[name] = tuple(pair)
        changed = gc.LayerTrace(projections, residuals["residual_in"], residuals["residual_out"])
        with np.errstate(all="ignore"):
            steps = dict(gc.replay_ratios(changed, input_norm, post_norm, 1e-5, gc.BF16_SERVE))
        assert max(ratios[0] for ratios in steps.values()) == np.inf, place
        assert max(ratios[1] for ratios in steps.values()) <= 1, place


def test_the_compiled_loops_refuse_arrays_of_the_wrong_shape():
    """Nothing is bounds-checked inside a compiled loop, so each checks the shapes it is given:
    a wrong width or a row outside the matrix is an error, never a read past an array."""
    weight, x = problem(1, 3, 4, 1, gc.BF16_SERVE)
    y = served(weight, x, gc.BF16_SERVE, "left", 1)
    matrices = gc.gemm_kernels.matrices([weight])
    assert gc.drawn_row_ratios(matrices, [0], [[2]], x, y, gc.BF16_SERVE)[0] <= 1
    with pytest.raises(ValueError, match="outside the matrix"):
        gc.drawn_row_ratios(matrices, [0], [[3]], x, y, gc.BF16_SERVE)
    with pytest.raises(ValueError, match="outside the matrix"):
        gc.drawn_row_ratios(matrices, [0], [[2]], x, y[:, :2], gc.BF16_SERVE)
    with pytest.raises(ValueError, match="inputs' width"):
        gc.drawn_row_ratios(matrices, [0], [[0]], np.hstack([x, x]), y, gc.BF16_SERVE)
    with pytest.raises(ValueError, match="one row per token"):
        gc.drawn_row_ratios(matrices, [0, 0], [[0], [1]], x, y, gc.BF16_SERVE)
    trace, input_norm, post_norm = layer_trace(torch.bfloat16, 1)
    gate, up = trace.projections["gate_proj"][1], trace.projections["up_proj"][1]
    for narrowed in (
        replaced(trace, "up_proj", y=up[:, :-1]),
        replaced(trace, "o_proj", y=trace.projections["o_proj"][1][:, :-1]),
        gc.LayerTrace(trace.projections, trace.residual_in, trace.residual_out[:, :-1]),
    ):
        with pytest.raises(ValueError, match="need one shape"):
            gc.replay_ratios(narrowed, input_norm, post_norm, 1e-5, gc.BF16_SERVE)
    assert gate.shape == up.shape


def test_the_loops_compile_without_a_disk_cache_where_numba_has_nowhere_to_write_one(monkeypatch, caplog):
    """numba refuses `cache=True` outright where neither the package's folder nor the user's
    cache directory is writable (a read-only install run by a user without a home): the loops
    are then compiled per process, and the log names the fix."""
    compile_for_real = gc.gemm_kernels.numba.njit

    def no_cache(*args, **options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function 'doubled': no locator available for file 'x.py'")
        return compile_for_real(*args, **options)

    monkeypatch.setattr(gc.gemm_kernels.numba, "njit", no_cache)
    monkeypatch.setattr(gc.gemm_kernels, "_UNCACHED", [])

    def doubled(value):
        return 2 * value

    def tripled(value):
        return 3 * value

    with caplog.at_level("WARNING", logger=gc.gemm_kernels.__name__):
        compiled = [gc.gemm_kernels._compiled()(function) for function in (doubled, tripled)]
    assert [loop(7) for loop in compiled] == [14, 21]
    assert "NUMBA_CACHE_DIR" in caplog.text and "no locator available" in caplog.text
    assert len(caplog.records) == 1, "said once, not once per loop"


def test_only_opened_steps_are_replayed():
    trace, input_norm, post_norm = layer_trace(torch.bfloat16, 1)
    mlp_only = gc.LayerTrace({name: trace.projections[name] for name in ("gate_proj", "up_proj", "down_proj")})
    steps = [check.step for check in gc.replay_layer(mlp_only, input_norm, post_norm, 1e-5, gc.BF16_SERVE)]
    assert steps == ["gate/up input", "silu(gate)·up"]


def test_a_w8a8_down_input_replays_through_its_quantisation():
    trace, input_norm, post_norm = layer_trace(torch.bfloat16, 2)
    down_in = trace.projections["down_proj"][0]
    q, scales = fp8_block(down_in, (1, 128))
    consumed = gc.dequantise_blocks(q, scales, (1, 128))
    forged = consumed.copy()
    forged[0, 3] = forged[0, 3] * 1.5 + 0.1
    for committed, passes in ((consumed, True), (forged, False)):
        layer = replaced(trace, "down_proj", x=committed)
        (check,) = [
            c for c in gc.replay_layer(layer, input_norm, post_norm, 1e-5, gc.FP8_BLOCK_SERVE) if "silu" in c.step
        ]
        assert check.passed is passes


@pytest.fixture(scope="module")
def smollm2_traces(checkpoint):
    """SmolLM2's layers 0, 14 and 29 served in bf16 on one prompt, then with 1e-2 relative
    noise on every projection: (canonical weights, honest traces, noisy traces)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval().requires_grad_(False)
    layers = {index: model.model.layers[index] for index in (0, 14, 29)}
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    modules = {
        (index, name): getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
        for index, layer in layers.items()
        for name in names
    }
    weights = {key: module.weight.double().numpy() for key, module in modules.items()}
    norms = {
        index: (layer.input_layernorm.weight.double().numpy(), layer.post_attention_layernorm.weight.double().numpy())
        for index, layer in layers.items()
    }

    def capture():
        seen: dict = {}
        hooks = [
            module.register_forward_hook(
                lambda m, a, out, key=key: seen.__setitem__(key, (a[0][0].double().numpy(), out[0].double().numpy()))
            )
            for key, module in modules.items()
        ]
        hooks += [
            layer.register_forward_pre_hook(
                lambda m, a, kw, i=index: seen.__setitem__(
                    ("in", i), (a[0] if a else kw["hidden_states"])[0].double().numpy()
                ),
                with_kwargs=True,
            )
            for index, layer in layers.items()
        ]
        hooks += [
            layer.register_forward_hook(
                lambda m, a, out, i=index: seen.__setitem__(
                    ("out", i), (out[0] if isinstance(out, tuple) else out)[0].double().numpy()
                )
            )
            for index, layer in layers.items()
        ]
        with torch.inference_mode():
            model(torch.tensor([[1, 504, 3158, 282, 4649, 314, 1690, 30]]))
        for hook in hooks:
            hook.remove()
        return {
            index: gc.LayerTrace({name: seen[index, name] for name in names}, seen["in", index], seen["out", index])
            for index in layers
        }

    honest = capture()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for module in modules.values():
            noise = torch.randn(module.weight.shape, generator=generator) * 1e-2
            module.weight.copy_((module.weight.float() * (1 + noise)).to(torch.bfloat16))
    return weights, norms, honest, capture(), model.config.rms_norm_eps


def test_smollm2_layers_served_in_bf16_pass_and_noisy_weights_do_not(smollm2_traces):
    weights, norms, honest, noisy, eps = smollm2_traces
    for index, trace in honest.items():
        assert all(check.passed for check in gc.replay_layer(trace, *norms[index], eps, gc.BF16_SERVE))
        for name, (x, y) in trace.projections.items():
            weight = weights[index, name]
            key = gc.verifier_key(weight, gc.draw_signs(b"secret", f"{index}.{name}", 32, weight.shape[0]))
            assert gc.freivalds(key, x, y, gc.BF16_SERVE).passed, (index, name)
            assert gc.row_check(weight, x, y, gc.BF16_SERVE).passed, (index, name)
            # 16 opened rows of the noisy layer: at least one is caught.
            noisy_x, noisy_y = noisy[index].projections[name]
            rows = np.arange(0, weight.shape[0], weight.shape[0] // 16)[:16]
            assert not gc.row_check(weight[rows], noisy_x, noisy_y[:, rows], gc.BF16_SERVE).passed, (index, name)
