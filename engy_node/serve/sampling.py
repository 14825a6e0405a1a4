"""Request rules of the reference server: sampling parameters, token choice and stop matching.

These follow sglang 0.5.x (its `SamplingParams` and the native `/generate` route) so a client written for
real sglang sees the same defaults and the same 400s here: `max_new_tokens` defaults to 128,
`temperature` below 1e-6 means greedy, unknown keys are rejected, stop strings are trimmed from
the text and streamed text is held back while its tail could still become a stop string or
ends in a character whose UTF-8 bytes have not all been generated (`stream_holdback`).

Parsing and stop matching are pure. `choose_token` works on a logits tensor. An unseeded sampled
request draws from its own torch generator, so requests never share random state. A request
with a `sampling_seed` is sampled the way sglang samples it under
`--enable-deterministic-inference`, so a verifier can replay the choice from the seed, the
position and the canonical logits (docs/verification.md, seeded replay).

Seeded sampling, replicated from sglang 0.5.23 (`srt/layers/sampler.py`:
`multinomial_with_seed`, `sampling_from_probs_torch`, `top_k_top_p_min_p_sampling_from_probs_torch`;
`kernels/ops/sampling/murmur_hash.py`; checked line by line against the released wheel):

* Noise. For each column c of a row, `h = MurmurHash3_x86_32` (hash seed 0) of 16 bytes, four
  little-endian uint32 words: the request seed's low and high halves (the seed is an int64 read
  as uint64), the position, and c. `u = h / (2**32 - 1)` in float64, and the Gumbel noise is
  `-log(-clamp(log u, max=-2**-32))`: the clamp turns `h = 2**32 - 1` (u = 1) into the noise of
  its neighbour rather than +inf; `h = 0` gives `-log(-log 0)`, clamped to about -709.8.
* Position: the 0-based position of the last token the model has seen, i.e. the sequence
  length minus one (sglang passes `seq_lens - 1` after a prefill and `positions` in decode).
  The first output token is drawn at `len(prompt) - 1`, output token k at `len(prompt) + k - 1`.
* Before the noise: logit bias and penalties, then division by the temperature (a float32
  tensor, as sglang keeps it), then `torch.softmax` in float32. Then one of two paths:
  - no top-k, top-p or min-p (`top_k == -1`, `top_p == 1`, `min_p == 0`): the columns are token
    ids and the scores are `log(probs)` taken in float32, then widened to float64;
  - otherwise: the probabilities are sorted in descending order, the top-k mask (rank >= k) and
    the top-p mask (mass before this rank > top_p, from a float32 cumsum of the unmasked sorted
    probabilities) zero entries, the scores are `log` of the result taken in float64, the
    columns are *ranks in that order*, and the winning rank is mapped back to its token id.
  The token is `argmax(score + noise)` in float64 (first index on a tie).

What differs from sglang, and why:

* sglang chooses between the two paths per *batch* (`need_top_k_sampling` is true if any
  request in the batch has a top-k, and a greedy request has top_k = 1), so the same seeded
  request with no top-k/top-p can take the rank path when batched with others. This server runs
  each request alone, so it always takes the path the request itself implies.
* min-p with a seed is refused by sglang's sampler (an assertion: the pytorch backend, which
  deterministic inference selects, does not support it). Here the min-p mask
  (`p < p_max * min_p`, after the other two) is applied on the rank path, which is what sglang
  would compute without the assertion.
* sglang runs the noise under `torch.compile` on the GPU. The integer hash is exact everywhere;
  the float64 `log` of CUDA and of the CPU may differ in the last bit, which changes a token only
  when two perturbed scores agree to about 1e-16. softmax, sort and cumsum run on the local
  device, so the replay is exact given the same float32 probabilities.
* sglang 0.5.12 lacks the upper clamp (u = 1 gives +inf noise, which wins the row); the two
  versions differ only for a column whose hash is exactly 2**32 - 1.
* The tie order of the sort is index order here (`stable=True`); sglang's unstable CUDA sort
  is not documented to keep it, which matters only for exactly equal probabilities.
* Without a seed sglang uses seed 42 under deterministic inference; this server keeps drawing
  from the request's own generator instead, as sglang does without the flag.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

GREEDY_TEMPERATURE = 1e-6
MAX_STOP_STRINGS = 32
SEED_RANGE = (-(2**63), 2**63 - 1)
"""sglang keeps a request's `sampling_seed` in an int64 tensor and rejects anything outside."""
REPLACEMENT_CHARACTER = "\ufffd"
"""What the tokenizer decodes bytes that are not (yet) valid UTF-8 to."""

FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "stream_interval",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "logit_bias",
    "custom_params",
    "stop_regex",
)
"""Every key sglang's HTTP contract accepts; anything else is a 400 naming these."""

UNSUPPORTED = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "custom_params")
"""Accepted by sglang but not implemented by the reference server: a 400 says so, rather
than silently ignoring a constraint the caller relies on."""


class SamplingError(ValueError):
    """A request's sampling parameters are invalid; the message is sent back as a 400."""


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stream_interval: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _int(name: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"invalid type: {name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SamplingError(f"{name} must be at least {minimum}, got {value}")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"invalid type: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingError(f"invalid type: {name} must be a boolean, got {value!r}")
    return value


def parse_sampling_params(raw: Mapping[str, Any] | None) -> SamplingParams:
    """Validate a request's `sampling_params` object the way sglang's HTTP contract does."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, Mapping):
        raise SamplingError("invalid type: sampling_params must be an object")
    for key in raw:
        if key not in FIELDS:
            expected = ", ".join(f"`{name}`" for name in FIELDS)
            raise SamplingError(f"unknown field `{key}`, expected one of {expected}")
    for key in UNSUPPORTED:
        if raw.get(key) is not None:
            raise SamplingError(
                f"`{key}` is not supported by the engy reference server; use sglang for constrained decoding"
            )

    values: dict[str, Any] = {}
    if raw.get("n") is not None and _int("n", raw["n"], minimum=1) != 1:
        raise SamplingError("n > 1 is not supported by the engy reference server; send n separate requests")
    for name in ("max_new_tokens", "min_new_tokens"):
        if raw.get(name) is not None:
            values[name] = _int(name, raw[name], minimum=0)
    if raw.get("stream_interval") is not None:
        values["stream_interval"] = _int("stream_interval", raw["stream_interval"], minimum=1)
    if raw.get("top_k") is not None:
        top_k = _int("top_k", raw["top_k"])
        if top_k == 0 or top_k < -1:
            raise SamplingError(f"top_k must be -1 (all) or at least 1, got {top_k}")
        values["top_k"] = top_k
    if raw.get("sampling_seed") is not None:
        seed = _int("sampling_seed", raw["sampling_seed"])
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise SamplingError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}")
        values["sampling_seed"] = seed
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if raw.get(name) is not None:
            values[name] = _number(name, raw[name])
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if raw.get(name) is not None:
            values[name] = _bool(name, raw[name])

    stop = raw.get("stop")
    if stop is not None:
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            raise SamplingError("invalid type: stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise SamplingError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        values["stop"] = tuple(s for s in stops if s)
    stop_ids = raw.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, (list, tuple)):
            raise SamplingError("invalid type: stop_token_ids must be a list of integers")
        values["stop_token_ids"] = tuple(_int("stop_token_ids", t, minimum=0) for t in stop_ids)
    bias = raw.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise SamplingError("invalid type: logit_bias must be an object of token id -> bias")
        entries = []
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise SamplingError(f"logit_bias key {key!r} is not a token id") from None
            if token < 0:
                raise SamplingError(f"logit_bias key {key!r} is not a token id (ids are non-negative)")
            entries.append((token, _number("logit_bias", value)))
        values["logit_bias"] = tuple(sorted(entries))

    params = SamplingParams(**values)
    if params.temperature < 0:
        raise SamplingError(f"temperature must be non-negative, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise SamplingError(f"top_p must be in (0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise SamplingError(f"min_p must be in [0, 1], got {params.min_p}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(params, name) <= 2:
            raise SamplingError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
    if not 0 < params.repetition_penalty <= 2:
        raise SamplingError(f"repetition_penalty must be in (0, 2], got {params.repetition_penalty}")
    return params


@dataclasses.dataclass(frozen=True, slots=True)
class StopMatch:
    index: int
    """Where the stop string starts in the text."""
    matched: str


def find_stop(text: str, stops: Sequence[str], *, ends_after: int = 0) -> StopMatch | None:
    """The earliest stop string in `text` that ends past its first `ends_after` characters
    (earliest start wins, then the longest). A streaming caller passes the length of the text
    it has already searched, so that only a stop string the new characters complete is found,
    however it straddles the boundary. With 0 every match counts."""
    best: StopMatch | None = None
    for stop in stops:
        # A match ends past `ends_after` exactly when it starts at or after this.
        index = text.find(stop, max(0, ends_after - len(stop) + 1) if ends_after else 0)
        if index >= 0 and (
            best is None or index < best.index or (index == best.index and len(stop) > len(best.matched))
        ):
            best = StopMatch(index, stop)
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still be the start of a stop string, and
    so must not be streamed yet (sglang holds the whole event back; we hold only the tail)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def stream_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of an unfinished generation's text must not be streamed yet.

    A byte-level tokenizer splits a multi-byte character across tokens, and until its last byte
    is generated the decode ends in U+FFFD; the next token turns that into the character, so
    the run of U+FFFD at the end is held back (sglang's detokenizer holds back new text that
    ends in U+FFFD). An invalid byte the model really produced stays U+FFFD and comes out once
    the run is followed by other text or the generation finishes. Before that run, a tail that
    could still become a stop string is held back as well. This is never less than
    `stop_holdback(text, stops)`: a stop prefix that reaches into the run, cut where the run
    starts, is still a stop prefix that ends the text before it."""
    settled = len(text.rstrip(REPLACEMENT_CHARACTER))
    return len(text) - settled + stop_holdback(text[:settled], stops)


# --- seeded sampling (sglang's deterministic inference; see the module docstring) -----------

_MASK32 = 0xFFFFFFFF
_UINT32_MAX = float(_MASK32)
_LOG_U_CAP = -(2.0**-32)
"""sglang clamps log(u) to at most this, the hash spacing, so that u = 1 is not +inf noise."""


def _mul32(a, constant: int):
    """a * constant mod 2**32 for a < 2**32, with every intermediate below 2**49, so that it is
    exact for Python ints and for int64 tensors alike (torch has no wrapping uint32 multiply)."""
    low = a * (constant & 0xFFFF)
    high = ((a * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_block(h, k):
    """One 4-byte block of MurmurHash3_x86_32."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _murmur3_finish(h):
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_hash(seed: int, position: int, columns: int | range, device=None):
    """MurmurHash3_x86_32 (hash seed 0) of (seed low, seed high, position, column) as four
    little-endian uint32 words, for columns 0..columns-1 (or the columns of a range): an int64
    tensor of uint32 values."""
    return seeded_hashes(seed, (position,), columns, device)[0]


def seeded_hashes(seed: int, positions: Sequence[int], columns: int | range, device=None):
    """`seeded_hash` for several positions at once: an int64 tensor [len(positions), columns].
    The seed and position words are mixed per row in Python; only the column word is a tensor,
    broadcast against every row."""
    import torch

    span = columns if isinstance(columns, range) else range(columns)
    unsigned = seed & 0xFFFF_FFFF_FFFF_FFFF
    prefixes = []
    for position in positions:
        prefix = 0
        for word in (unsigned & _MASK32, unsigned >> 32, position & _MASK32):
            prefix = _murmur3_block(prefix, word)
        prefixes.append(prefix)
    h = torch.tensor(prefixes, dtype=torch.int64, device=device)[:, None]
    h = _murmur3_block(h, torch.arange(span.start, span.stop, span.step, dtype=torch.int64, device=device)[None, :])
    return _murmur3_finish(h ^ 16)


def seeded_gumbel(seed: int, position: int, columns: int | range, device=None):
    """sglang's float64 Gumbel noise for one row: -log(-log u), u = hash / (2**32 - 1). Each
    column's noise depends on that column alone, so a range of columns gets the same values as
    the corresponding slice of the whole row (a verifier draws only the ranks it compares)."""
    return seeded_gumbels(seed, (position,), columns, device)[0]


def seeded_gumbels(seed: int, positions: Sequence[int], columns: int | range, device=None):
    """`seeded_gumbel` for several positions at once: float64 [len(positions), columns]."""
    import torch

    u = seeded_hashes(seed, positions, columns, device).to(torch.float64) / _UINT32_MAX
    return torch.log(u).clamp(min=torch.finfo(torch.float64).min, max=_LOG_U_CAP).neg().log().neg()


def sample_with_seed(scores, seed: int, position: int) -> int:
    """The column of 1-D `scores` (log-probabilities or log-weights) that wins the seeded
    Gumbel-max at `position`: argmax(scores + noise) in float64, first column on a tie."""
    import torch

    noise = seeded_gumbel(seed, position, scores.shape[-1], scores.device)
    return int(torch.argmax(noise + scores.to(torch.float64)))


def seeded_choice(scores, params: SamplingParams, position: int) -> int:
    """The token sglang with `--enable-deterministic-inference` picks for a request alone in its
    batch, from float32 `scores` that already carry the logit bias and penalties."""
    assert params.sampling_seed is not None, "a seeded request only"
    weights, order = _seeded_weights(scores, params)
    column = sample_with_seed(weights, params.sampling_seed, position)
    return column if order is None else int(order[column])


def seeded_token_scores(scores, params: SamplingParams, position: int):
    """What the seeded Gumbel-max compares, per token id (float64; -inf for tokens outside the
    top-k/top-p/min-p set): the winner is the token `seeded_choice` picks."""
    import torch

    weights, order, noise = seeded_draw(scores, params, position)
    perturbed = weights.to(torch.float64) + noise
    return perturbed if order is None else torch.empty_like(perturbed).scatter(-1, order, perturbed)


def seeded_draw(scores, params: SamplingParams, position: int):
    """(log-weights, order, noise) of one seeded draw: the winner is argmax(log-weights + noise),
    a column that is a token id when `order` is None, else a rank in `order` (descending
    probability). A verifier replays it on canonical logits; on the rank path, tokens of nearly
    equal probability may stand in either order, so it needs the columns apart."""
    assert params.sampling_seed is not None, "a seeded request only"
    weights, order = _seeded_weights(scores, params)
    return weights, order, seeded_gumbel(params.sampling_seed, position, weights.shape[-1], weights.device)


def _seeded_weights(scores, params: SamplingParams):
    """(log-weights, order): over token ids (order None) when no top-k/top-p/min-p applies, else
    over ranks in descending-probability order, as sglang's two paths do."""
    import torch

    probs = torch.softmax(scores / torch.tensor(params.temperature, dtype=torch.float32), dim=-1)
    if params.top_k == -1 and params.top_p == 1.0 and params.min_p == 0.0:
        return torch.log(probs), None
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before > torch.tensor(params.top_p, dtype=torch.float32)
    if params.top_k > 0:
        drop |= torch.arange(sorted_probs.shape[-1], device=probs.device) >= params.top_k
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        threshold = sorted_probs[0] * torch.tensor(params.min_p, dtype=torch.float32)
        sorted_probs = sorted_probs.masked_fill(sorted_probs < threshold, 0.0)
    return torch.log(sorted_probs.to(torch.float64)), order


def choose_token(logits, params: SamplingParams, history: Sequence[int], generator, *, position: int):
    """Pick the next token id from 1-D `logits` (a float tensor). Returns (token_id, logprob):
    logprob is log-softmax of the raw logits (before temperature, penalties and bias), as
    sglang reports it by default.

    `position` is the 0-based position of the last token the model has seen (prompt length
    plus tokens generated so far, minus one); only a seeded request's draw depends on it.
    `generator` is used only by unseeded sampled requests."""
    import torch

    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
    scores = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long, device=scores.device)
        valid = (ids >= 0) & (ids < scores.shape[-1])
        scores[ids[valid]] += torch.tensor(
            [bias for _, bias in params.logit_bias], dtype=scores.dtype, device=scores.device
        )[valid]
    if history and (params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0):
        seen = torch.tensor(list(history), dtype=torch.long, device=scores.device)
        counts = torch.bincount(seen, minlength=scores.shape[-1]).to(scores.dtype)[: scores.shape[-1]]
        present = counts > 0
        if params.repetition_penalty != 1.0:
            penalised = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
            scores = torch.where(present, penalised, scores)
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * present.to(scores.dtype)

    if params.greedy:
        token = int(torch.argmax(scores))
        return token, float(raw_logprobs[token])
    if params.sampling_seed is not None:
        token = seeded_choice(scores, params, position)
        return token, float(raw_logprobs[token])

    scores = scores / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = cumulative - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, float(raw_logprobs[token])
