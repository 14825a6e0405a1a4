"""When the traffic control plane probes a worker, and what a probe looks like (docs/trust.md).

`next_probe_at` draws the gap to a worker's next probe, by its state: frequent while it qualifies,
occasional once it serves paid traffic, none otherwise. `probe_plan` shapes a probe like a
buyer's request (`BuyerMix`: sampling settings, max_tokens, streaming, each in proportion to how
buyers send it), so that an active worker cannot tell probes from paid traffic by their settings
or their timing (`traffic.py`, "What probes can and cannot hide").

Pure, like `traffic.py`: every random draw comes in as an argument, so the same draws give the
same probe and the tests replay it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypeVar

from engy_node.gateway.trust.traffic_state import Eligibility, TrafficPolicy, TrafficState, checked_count

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_TOKENS_MIX",
    "DEFAULT_SAMPLING_MIX",
    "PROBE_PLAN_DRAWS",
    "BuyerMix",
    "ProbePlan",
    "SamplingShape",
    "next_probe_at",
    "probe_plan",
]


def next_probe_at(
    state: TrafficState, *, now: float, policy: TrafficPolicy = TrafficPolicy(), rng_value: float
) -> float | None:
    """When the shell should send this worker its next probe, or None for no probe now.

    `probing` workers are probed until the round has `max_probes` finished probes; connected
    `active` workers (first-party too) keep getting the occasional probe; `new` and `pulled`
    workers get none. The shell calls this after each probe is sent and after each transition.

    The gap is the phase's `*_gap_min_s` plus an exponential draw of scale `*_gap_scale_s`,
    truncated at `*_gap_max_s` by inverting its distribution function at `rng_value` (uniform in
    [0, 1), drawn by the shell). Exponential gaps are memoryless, as independent buyers' arrivals
    are, so the times of past probes say nothing about the next one; the minimum keeps probes from
    bunching and the truncation bounds how long a round can take. The result is always after `now`
    and within [now + min, now + max].
    """
    if isinstance(rng_value, bool) or not isinstance(rng_value, (int, float)) or not 0.0 <= rng_value < 1.0:
        raise ValueError(f"rng_value must be a float in [0, 1), got {rng_value!r}")
    if state.state is Eligibility.PROBING and len(state.probes) < policy.max_probes:
        low, scale, high = policy.qualifying_gap_min_s, policy.qualifying_gap_scale_s, policy.qualifying_gap_max_s
    elif state.state is Eligibility.ACTIVE and state.connected:
        low, scale, high = policy.active_gap_min_s, policy.active_gap_scale_s, policy.active_gap_max_s
    else:
        return None
    # F(x) = (1 - e^(-x/scale)) / (1 - e^(-span/scale)) on [0, span]; x = F^-1(u).
    span = high - low
    gap = low - scale * math.log1p(-rng_value * -math.expm1(-span / scale))
    gap = min(max(gap, low), high)
    return max(now + gap, math.nextafter(now, math.inf))


# --- probe shapes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingShape:
    """One sampling setting buyers send, with its share of requests."""

    weight: int
    temperature: float | None
    """None: the buyer sent none (the model's default applies)."""
    top_p: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class ProbePlan:
    """The shape of one probe request, as plain data; the shell builds the request from it."""

    prompt_index: int
    """Which corpus entry to send."""
    max_tokens: int
    temperature: float | None
    top_p: float | None
    stream: bool


# Not measured yet: common client behaviour, to be replaced by the mix the request log shows
# (the shell can build a `BuyerMix` from recent paid requests). Most SDK calls send no sampling
# at all; agents and evaluations pin greedy; chat front-ends favour 0.7 and 0.6/0.95.
DEFAULT_SAMPLING_MIX: tuple[SamplingShape, ...] = (
    SamplingShape(weight=35, temperature=None, top_p=None),
    SamplingShape(weight=10, temperature=0.0, top_p=None),
    SamplingShape(weight=25, temperature=0.7, top_p=None),
    SamplingShape(weight=10, temperature=0.7, top_p=0.95),
    SamplingShape(weight=10, temperature=0.6, top_p=0.95),
    SamplingShape(weight=10, temperature=1.0, top_p=None),
)

# (weight, max_tokens); None is a buyer that sends none, which the buyer APIs resolve to the
# model's maximum (`openai_api._max_tokens`). Values past the model's maximum are clamped to it,
# since a buyer sending more is refused and a probe must look like an accepted request.
DEFAULT_MAX_TOKENS_MIX: tuple[tuple[int, int | None], ...] = (
    (30, None),
    (10, 256),
    (15, 512),
    (20, 1024),
    (10, 2048),
    (10, 4096),
    (5, 8192),
)

PROBE_PLAN_DRAWS = 4
"""Random values `probe_plan` takes: prompt, max_tokens, sampling, stream, in that order."""


@dataclasses.dataclass(frozen=True, slots=True)
class BuyerMix:
    """How buyers shape their requests, for probes to copy."""

    sampling: tuple[SamplingShape, ...] = DEFAULT_SAMPLING_MIX
    max_tokens: tuple[tuple[int, int | None], ...] = DEFAULT_MAX_TOKENS_MIX
    stream_pct: int = 80
    """Whole percent of requests that stream; not measured yet (chat front-ends and agents stream)."""

    def __post_init__(self) -> None:
        if not self.sampling or not self.max_tokens:
            raise ValueError("a buyer mix needs at least one sampling shape and one max_tokens value")
        for shape in self.sampling:
            checked_count("sampling weight", shape.weight)
        for weight, value in self.max_tokens:
            checked_count("max_tokens weight", weight)
            if value is not None:
                checked_count("max_tokens", value, minimum=1)
        if sum(shape.weight for shape in self.sampling) == 0 or sum(weight for weight, _ in self.max_tokens) == 0:
            raise ValueError("a buyer mix's weights must not all be zero")
        if checked_count("stream_pct", self.stream_pct) > 100:
            raise ValueError(f"stream_pct is a whole percentage, 0 to 100, got {self.stream_pct!r}")


def probe_plan(
    *, corpus: Sequence[object], draws: Sequence[float], max_output_tokens: int, mix: BuyerMix = BuyerMix()
) -> ProbePlan:
    """A buyer-like probe: a corpus prompt and settings drawn from `mix`.

    Args:
        corpus: the probe prompts; only its length is read here (the index comes back).
        draws: `PROBE_PLAN_DRAWS` values, each uniform in [0, 1), drawn by the shell:
            prompt, max_tokens, sampling, stream.
        max_output_tokens: the model's limit; `max_tokens` never exceeds it.
        mix: the buyer mix to copy.

    Each draw picks one thing, by inverting a weighted choice, so equal draws give equal plans
    and each setting appears in proportion to its weight.

    Raises:
        ValueError: an empty corpus, the wrong number of draws, a draw outside [0, 1), or a
            `max_output_tokens` below 1.
    """
    if not corpus:
        raise ValueError("the probe corpus is empty; ship at least one prompt")
    if len(draws) != PROBE_PLAN_DRAWS:
        raise ValueError(
            f"draws must hold {PROBE_PLAN_DRAWS} values (prompt, max_tokens, sampling, stream), got {len(draws)}"
        )
    for index, value in enumerate(draws):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"draws[{index}] must be a float in [0, 1), got {value!r}")
    checked_count("max_output_tokens", max_output_tokens, minimum=1)
    prompt_draw, tokens_draw, sampling_draw, stream_draw = draws
    prompt_index = min(int(prompt_draw * len(corpus)), len(corpus) - 1)
    requested = _weighted([value for _, value in mix.max_tokens], [weight for weight, _ in mix.max_tokens], tokens_draw)
    shape = _weighted(list(mix.sampling), [shape.weight for shape in mix.sampling], sampling_draw)
    return ProbePlan(
        prompt_index=prompt_index,
        max_tokens=max_output_tokens if requested is None else min(requested, max_output_tokens),
        temperature=shape.temperature,
        top_p=shape.top_p,
        stream=stream_draw * 100 < mix.stream_pct,
    )


def _weighted(values: list[T], weights: list[int], draw: float) -> T:
    target = min(int(draw * sum(weights)), sum(weights) - 1)
    for value, weight in zip(values, weights):
        if target < weight:
            return value
        target -= weight
    raise AssertionError("unreachable: target < sum(weights)")
