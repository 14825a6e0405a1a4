"""Seeded sampling against sglang's definition (`--enable-deterministic-inference`).

The reference here is written from the published algorithms, not from our module: MurmurHash3
x86_32 over bytes (Appleby's MurmurHash3.cpp, pinned to its well-known test vectors), the 16-byte
key sglang hashes, the float64 Gumbel noise and the Gumbel-max, in plain Python ints and floats.
Our torch functions must agree with it exactly on the hash and on every chosen token. The golden
values at the end were produced by sglang 0.5.23's own functions (`murmur_hash32_kernel` under
Triton's interpreter, `multinomial_with_seed`, `sampling_from_probs_torch`,
`top_k_top_p_min_p_sampling_from_probs_torch`) on the logits built here.

The statistical checks loop over fixed seeds: the noise is a hash, so they cannot flake.
"""

from __future__ import annotations

import math
import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.serve.sampling import (
    SamplingParams,
    choose_token,
    sample_with_seed,
    seeded_choice,
    seeded_gumbel,
    seeded_hash,
    seeded_token_scores,
)

M32 = 0xFFFFFFFF
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
POSITIONS = st.integers(min_value=0, max_value=2**31 - 1)


# --- the reference, from the published definitions ---------------------------------------------


def rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32, block by block as in Appleby's MurmurHash3.cpp."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed
    whole = len(data) - len(data) % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (rotl((k * c1) & M32, 15) * c2) & M32
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    if len(data) > whole:
        k = int.from_bytes(data[whole:], "little")
        h ^= (rotl((k * c1) & M32, 15) * c2) & M32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_hash(seed: int, position: int, column: int) -> int:
    """sglang's key: the seed as a little-endian uint64 (low word first), then the position and
    the column as little-endian uint32s; MurmurHash3 with hash seed 0."""
    return murmur3_x86_32(struct.pack("<QII", seed & (2**64 - 1), position & M32, column))


def reference_gumbel(hashed: int) -> float:
    """u = hash / (2**32 - 1); noise = -log(-log u), log u clamped to [-DBL_MAX, -2**-32]."""
    u = hashed / M32
    log_u = math.log(u) if u > 0 else -math.inf
    log_u = min(max(log_u, -sys.float_info.max), -(2.0**-32))
    return -math.log(-log_u)


def reference_gumbel_max(scores: list[float], seed: int, position: int) -> int:
    """The first column with the largest score + noise."""
    perturbed = [score + reference_gumbel(reference_hash(seed, position, c)) for c, score in enumerate(scores)]
    return max(range(len(perturbed)), key=perturbed.__getitem__)


def reference_choice(probs: list[float], *, top_k: int, top_p: float, min_p: float, seed: int, position: int) -> int:
    """sglang's two paths from softmax probabilities: token-id columns without top-k/top-p/min-p,
    otherwise rank columns over the descending order with the masks applied."""
    if top_k == -1 and top_p == 1.0 and min_p == 0.0:
        with np.errstate(divide="ignore"):
            logprobs = np.log(np.array(probs, dtype=np.float32))  # this path takes the log in float32
        return reference_gumbel_max(logprobs.astype(np.float64).tolist(), seed, position)
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, mass_before = [], 0.0
    for rank, token in enumerate(order):
        p = probs[token]
        kept.append(p if (top_k == -1 or rank < top_k) and mass_before <= top_p else 0.0)
        mass_before += p
    if min_p > 0:
        kept = [p if p >= kept[0] * min_p else 0.0 for p in kept]
    rank = reference_gumbel_max([math.log(p) if p > 0 else -math.inf for p in kept], seed, position)
    return order[rank]


def formula_logits(size: int) -> torch.Tensor:
    return torch.tensor([3.0 * math.sin(1.7 * i) + 0.01 * i for i in range(size)], dtype=torch.float32)


def softmax_list(logits: torch.Tensor, temperature: float) -> list[float]:
    return torch.softmax(logits / torch.tensor(temperature, dtype=torch.float32), dim=-1).tolist()


def seeded_params(seed: int, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "sampling_seed": seed, **overrides})


def choose(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    return choose_token(logits, params, [], None, position=position)[0]


# --- the reference is MurmurHash3 ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "seed", "expected"),
    [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\xff\xff\xff\xff", 0, 0x76293B50),
        (b"\x21\x43\x65\x87", 0, 0xF55B516B),
        (b"\x21\x43\x65\x87", 0x5082EDEE, 0x2362F9DE),
        (b"\x21\x43\x65", 0, 0x7E4A8634),
        (b"\x21\x43", 0, 0xA0F7B07A),
        (b"\x21", 0, 0x72661CF4),
        (b"Hello, world!", 1234, 0xFAF6CDB3),
    ],
)
def test_the_reference_hash_is_murmur3_x86_32(data, seed, expected):
    assert murmur3_x86_32(data, seed) == expected


# --- the hash and the noise ---------------------------------------------------------------------

SGLANG_HASHES = {
    # (seed, position): hashes of columns 0..3, from sglang 0.5.23's murmur_hash32_kernel.
    (0, 0): [2167721464, 10027521, 2423355346, 1368026766],
    (42, 17): [3382997381, 3497547135, 889188079, 4185919001],
    (-1, 3): [4240278766, 3295783382, 3667549211, 3363489726],
    (2**40 + 7, 100000): [3483734816, 3327997977, 3321569503, 3025165109],
}


@pytest.mark.parametrize(("key", "expected"), SGLANG_HASHES.items())
def test_the_hash_equals_sglangs_kernel_and_the_reference(key, expected):
    seed, position = key
    assert seeded_hash(seed, position, 4).tolist() == expected
    assert [reference_hash(seed, position, c) for c in range(4)] == expected


@given(INT64, st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=1, max_value=64))
@settings(max_examples=200)
def test_the_hash_equals_the_reference_for_any_int64_seed_and_uint32_position(seed, position, columns):
    assert seeded_hash(seed, position, columns).tolist() == [reference_hash(seed, position, c) for c in range(columns)]


def test_a_position_is_hashed_as_its_low_32_bits_like_sglangs_uint32_cast():
    assert torch.equal(seeded_hash(5, 2**32 + 9, 16), seeded_hash(5, 9, 16))


@given(INT64, POSITIONS)
@settings(max_examples=100)
def test_the_noise_is_the_float64_gumbel_of_the_hash(seed, position):
    noise = seeded_gumbel(seed, position, 32)
    assert noise.dtype == torch.float64
    expected = [reference_gumbel(reference_hash(seed, position, c)) for c in range(32)]
    assert noise.tolist() == pytest.approx(expected, rel=1e-14, abs=1e-14)


def _unmix(h: int, k: int) -> int:
    """The state before a murmur3 block given the state after it and the block's raw word."""
    h = rotl(((h - 0xE6546B64) * pow(5, -1, 2**32)) & M32, 32 - 13)
    return h ^ ((rotl((k * 0xCC9E2D51) & M32, 15) * 0x1B873593) & M32)


def _unfinish(h: int) -> int:
    """Invert murmur3's final avalanche."""

    def unshift(x: int, s: int) -> int:
        y = x
        for _ in range(32 // s + 1):
            y = x ^ (y >> s)
        return y & M32

    h = unshift(h, 16)
    h = (h * pow(0xC2B2AE35, -1, 2**32)) & M32
    h = unshift(h, 13)
    h = (h * pow(0x85EBCA6B, -1, 2**32)) & M32
    return unshift(h, 16)


def seed_hashing_to(target: int) -> int:
    """A seed (low word 0) whose hash at position 0, column 0 is `target`: murmur3 is a bijection
    step by step, so the high word can be solved for."""
    h = _unmix(_unmix(_unfinish(target) ^ 16, 0), 0)  # undo the column block, then the position block
    after_low = (rotl(0, 13) * 5 + 0xE6546B64) & M32  # the state after the low word 0
    k = rotl(((h - 0xE6546B64) * pow(5, -1, 2**32)) & M32, 32 - 13) ^ after_low
    high = (rotl((k * pow(0x1B873593, -1, 2**32)) & M32, 32 - 15) * pow(0xCC9E2D51, -1, 2**32)) & M32
    seed = high << 32
    assert reference_hash(seed, 0, 0) == target
    return seed - 2**64 if seed >= 2**63 else seed


def test_the_largest_hash_gets_the_capped_noise_not_infinity():
    seed = seed_hashing_to(M32)
    assert seeded_hash(seed, 0, 1).tolist() == [M32]
    assert seeded_gumbel(seed, 0, 1).item() == pytest.approx(32 * math.log(2), rel=1e-12)
    # So a column with zero probability still loses, however lucky its hash.
    scores = torch.tensor([-math.inf, 0.0, 0.0], dtype=torch.float64)
    assert sample_with_seed(scores, seed, 0) != 0


def test_a_zero_hash_gets_the_smallest_finite_noise():
    seed = seed_hashing_to(0)
    assert seeded_hash(seed, 0, 1).tolist() == [0]
    assert seeded_gumbel(seed, 0, 1).item() == pytest.approx(-math.log(sys.float_info.max), rel=1e-12)


# --- the Gumbel-max ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 42, -1, 2**63 - 1, -(2**63), 123456789])
@pytest.mark.parametrize("position", [0, 1, 7, 4095, 2**31 - 1])
@pytest.mark.parametrize("vocab", [1, 2, 17, 300])
def test_the_gumbel_max_equals_the_reference(seed, position, vocab):
    scores = torch.log_softmax(formula_logits(vocab), dim=-1).to(torch.float64)
    assert sample_with_seed(scores, seed, position) == reference_gumbel_max(scores.tolist(), seed, position)


# --- choose_token with a seed ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7, -3, 2**62 + 11])
@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [
        (-1, 1.0, 0.0),
        (-1, 0.9, 0.0),
        (10, 1.0, 0.0),
        (5, 0.8, 0.0),
        (64, 1.0, 0.0),
        (1000, 1.0, 0.0),
        (-1, 1.0, 0.05),
        (20, 0.95, 0.1),
    ],
)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.4])
def test_a_seeded_choice_equals_the_reference_on_both_paths(seed, top_k, top_p, min_p, temperature):
    logits = formula_logits(64)
    params = seeded_params(seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = softmax_list(logits, temperature)
    for position in range(0, 40, 3):
        expected = reference_choice(probs, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, position=position)
        assert choose(logits, params, position) == expected


@pytest.mark.parametrize("seed", [0, 7, -3, 2**62 + 11])
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(-1, 1.0, 0.0), (-1, 0.9, 0.0), (5, 0.8, 0.0), (20, 0.95, 0.1)])
def test_the_replayed_scores_crown_the_token_the_seeded_choice_picks(seed, top_k, top_p, min_p):
    logits = formula_logits(64)
    params = seeded_params(seed, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    for position in range(0, 40, 3):
        scores = seeded_token_scores(logits, params, position)
        assert int(torch.argmax(scores)) == seeded_choice(logits, params, position)
        assert torch.isinf(scores).sum() == (64 - (scores > -math.inf).sum()), "masked tokens cannot win"


def test_without_top_k_or_top_p_the_columns_are_token_ids_and_with_them_ranks():
    # A top-k as large as the vocabulary masks nothing, yet takes the rank path, as in sglang.
    logits = formula_logits(64)
    plain, ranked = seeded_params(5), seeded_params(5, top_k=64)
    probs = softmax_list(logits, 1.0)
    chosen = [(choose(logits, plain, p), choose(logits, ranked, p)) for p in range(50)]
    assert chosen == [
        (
            reference_choice(probs, top_k=-1, top_p=1.0, min_p=0.0, seed=5, position=p),
            reference_choice(probs, top_k=64, top_p=1.0, min_p=0.0, seed=5, position=p),
        )
        for p in range(50)
    ]
    assert any(a != b for a, b in chosen)


SGLANG_TOKENS = [
    # (temperature, top_k, top_p, seed, vocab, first position, tokens at 8 consecutive positions),
    # from sglang 0.5.23's sampler functions on formula_logits(vocab).
    (0.8, -1, 1.0, 1234, 64, 5, [12, 16, 39, 34, 60, 53, 35, 45]),
    (1.0, -1, 0.9, -7, 64, 0, [23, 34, 1, 16, 34, 60, 38, 60]),
    (1.3, 10, 1.0, 2**63 - 1, 64, 100, [12, 23, 38, 49, 60, 23, 49, 34]),
    (0.7, 5, 0.8, 42, 64, 1000, [38, 49, 23, 60, 60, 23, 49, 23]),
    (1.0, -1, 1.0, 99, 5000, 10, [4506, 4957, 4935, 4909, 4991, 4847, 4957, 4976]),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "seed", "vocab", "start", "tokens"), SGLANG_TOKENS)
def test_seeded_tokens_equal_those_sglang_picks(temperature, top_k, top_p, seed, vocab, start, tokens):
    params = seeded_params(seed, temperature=temperature, top_k=top_k, top_p=top_p)
    logits = formula_logits(vocab)
    assert [choose(logits, params, start + i) for i in range(8)] == tokens


def test_seeded_choice_applies_bias_and_penalties_before_the_draw():
    logits = formula_logits(32)
    weakest = int(torch.argmin(logits))
    forced = seeded_params(3, logit_bias=((weakest, 100.0),))
    assert {choose(logits, forced, p) for p in range(30)} == {weakest}
    # With the bias folded into the logits the draw is the same one seeded_choice makes.
    biased = logits.clone()
    biased[weakest] += 100.0
    assert choose(logits, forced, 4) == seeded_choice(biased, seeded_params(3), 4)


@given(INT64, POSITIONS, st.integers(min_value=0, max_value=10_000))
@settings(max_examples=100)
def test_the_same_seed_position_and_logits_give_the_same_token(seed, position, logits_seed):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(logits_seed)) * 3
    params = seeded_params(seed, top_p=0.9)
    first = choose_token(logits, params, [], None, position=position)
    assert choose_token(logits.clone(), params, [], torch.Generator().manual_seed(1), position=position) == first


@given(
    INT64,
    POSITIONS,
    st.integers(min_value=0, max_value=10_000),
    st.one_of(st.just(-1), st.integers(min_value=1, max_value=40)),
    st.floats(min_value=0.01, max_value=1.0),
    st.sampled_from([0.0, 0.05, 0.5]),
    st.floats(min_value=0.1, max_value=3.0),
)
@settings(max_examples=200)
def test_a_seeded_token_always_lies_in_the_top_k_top_p_min_p_nucleus(
    seed, position, logits_seed, top_k, top_p, min_p, temperature
):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(logits_seed)) * 4
    params = seeded_params(seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    token = choose(logits, params, position)
    probs = torch.softmax(logits / torch.tensor(temperature, dtype=torch.float32), dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    rank = order.tolist().index(token)
    assert top_k == -1 or rank < top_k
    assert float(torch.cumsum(sorted_probs, dim=-1)[rank] - sorted_probs[rank]) <= top_p
    assert float(sorted_probs[rank]) >= float(sorted_probs[0]) * min_p * (1 - 1e-6)


@given(INT64, POSITIONS, st.integers(min_value=0, max_value=10_000))
@settings(max_examples=50)
def test_a_seed_never_changes_greedy_or_top_k_one(seed, position, logits_seed):
    logits = torch.randn(30, generator=torch.Generator().manual_seed(logits_seed)) * 3
    argmax = int(torch.argmax(logits))
    assert choose(logits, seeded_params(seed, temperature=0.0), position) == argmax
    assert choose(logits, seeded_params(seed, temperature=1.5, top_k=1), position) == argmax


def test_choose_token_with_a_seed_does_not_modify_the_callers_logits():
    logits = formula_logits(16)
    before = logits.clone()
    choose_token(logits, seeded_params(9, top_k=5, top_p=0.9, repetition_penalty=1.5), [1, 2, 2], None, position=3)
    assert torch.equal(logits, before)


# --- the draws follow the distribution --------------------------------------------------------------

PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
DRAWS = 6000


def assert_frequencies(tokens: list[int], probs: list[float]) -> None:
    """Every token's count within five standard deviations of its expectation (fixed seeds, so
    this is a fixed outcome, not a chance)."""
    total = len(tokens)
    for token, p in enumerate(probs):
        expected = total * p
        bound = 5 * math.sqrt(total * p * (1 - p)) + 1
        assert abs(tokens.count(token) - expected) <= bound, (token, tokens.count(token), expected)


def test_over_many_seeds_the_draws_follow_the_softmax():
    logits = torch.log(torch.tensor(PROBS))
    assert_frequencies([choose(logits, seeded_params(seed), 11) for seed in range(DRAWS)], PROBS)


def test_over_the_positions_of_one_seed_the_draws_follow_the_softmax():
    logits = torch.log(torch.tensor(PROBS))
    assert_frequencies([choose(logits, seeded_params(77), position) for position in range(DRAWS)], PROBS)


def test_with_top_p_the_draws_follow_the_renormalised_nucleus():
    logits = torch.log(torch.tensor(PROBS))
    # Mass before the 4th token is 0.8 > 0.75: the nucleus is the first three.
    tokens = [choose(logits, seeded_params(seed, top_p=0.75), 0) for seed in range(DRAWS)]
    assert set(tokens) == {0, 1, 2}
    assert_frequencies(tokens, [p / 0.8 for p in PROBS[:3]])


def test_temperature_sharpens_the_seeded_distribution_as_it_should():
    logits = torch.log(torch.tensor(PROBS))
    sharpened = torch.softmax(logits / 0.5, dim=-1).tolist()
    assert_frequencies([choose(logits, seeded_params(seed, temperature=0.5), 3) for seed in range(DRAWS)], sharpened)
