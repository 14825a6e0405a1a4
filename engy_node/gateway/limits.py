"""Per-key limits: what a buyer's API key may still do, decided over plain data.

A key may carry limits of its own, and its account defaults for the limits a key leaves unset:
requests per minute, tokens per minute (prompt + max_tokens counted when the request is held,
corrected to what it really used when it is settled), requests at once, and spend caps per UTC
day and month (in µUSD: the worst case counted when held, the unused part given back when
settled, so what is charged can never pass the cap). Windows are fixed: the UTC minute, day
and month a request's hold was taken in; a hold settled in a later window changes only the
window it was counted in (which no longer counts).

This module is the pure part: no clock reads, no IO. The store (`store/key_limits.py`) reads a
key's counters under the row's lock in the same transaction as the balance hold, asks `admit`,
and writes what it answers, which is what makes the limits hold across workers and hosts; the
API modules turn a `RateView` into each API's rate-limit headers (`response_headers`).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Literal

MINUTE_S = 60
DAY_S = 86_400

LimitName = Literal["rpm", "tpm", "concurrent", "daily_usd", "monthly_usd"]
LIMIT_NAMES: tuple[LimitName, ...] = ("rpm", "tpm", "concurrent", "daily_usd", "monthly_usd")


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; None is no limit (or, on a key, its account's default)."""

    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None
    daily_micro: int | None = None
    monthly_micro: int | None = None

    def over(self, defaults: Limits) -> Limits:
        """These limits, each one left unset taken from `defaults` (the account's)."""
        return Limits(*(mine if mine is not None else theirs for mine, theirs in zip(self.values(), defaults.values())))

    def values(self) -> tuple[int | None, ...]:
        return (self.rpm, self.tpm, self.concurrent, self.daily_micro, self.monthly_micro)

    @property
    def any(self) -> bool:
        return any(value is not None for value in self.values())


@dataclasses.dataclass(frozen=True, slots=True)
class Windows:
    """The fixed windows a moment falls in, and the seconds until each ends."""

    minute: int
    day: int
    month: int
    minute_reset_s: float
    day_reset_s: float
    month_reset_s: float


def windows(now: float) -> Windows:
    """The UTC minute, day and month `now` (Unix seconds) is in, numbered so that a later window
    has a larger number."""
    minute = math.floor(now / MINUTE_S)
    day = math.floor(now / DAY_S)
    date = datetime.datetime.fromtimestamp(day * DAY_S, datetime.UTC)
    month = date.year * 12 + date.month - 1
    next_year, next_month = divmod(month + 1, 12)
    month_end = datetime.datetime(next_year, next_month + 1, 1, tzinfo=datetime.UTC).timestamp()
    return Windows(
        minute=minute,
        day=day,
        month=month,
        minute_reset_s=(minute + 1) * MINUTE_S - now,
        day_reset_s=(day + 1) * DAY_S - now,
        month_reset_s=month_end - now,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
    """What a key has used: requests in flight, and per window what was counted in it."""

    in_flight: int = 0
    minute: int = 0
    minute_requests: int = 0
    minute_tokens: int = 0
    day: int = 0
    day_micro: int = 0
    month: int = 0
    month_micro: int = 0

    def at(self, w: Windows) -> Counters:
        """The counters as of windows `w`: a window that has ended counts nothing."""
        same_minute, same_day, same_month = self.minute == w.minute, self.day == w.day, self.month == w.month
        return Counters(
            in_flight=self.in_flight,
            minute=w.minute,
            minute_requests=self.minute_requests if same_minute else 0,
            minute_tokens=self.minute_tokens if same_minute else 0,
            day=w.day,
            day_micro=self.day_micro if same_day else 0,
            month=w.month,
            month_micro=self.month_micro if same_month else 0,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class RateView:
    """What the rate-limit headers say: the request and token limits, what remains, and the
    seconds until they reset, as of `at` (Unix seconds). Requests are the per-minute limit, or,
    for a key limited only in concurrency, that."""

    at: float
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is over a limit, in the buyer's words, and when retrying can help."""

    limit: LimitName
    message: str
    retry_after_s: int
    view: RateView


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    counters: Counters
    view: RateView


def view(limits: Limits, counters: Counters, w: Windows, now: float) -> RateView:
    """The headers' view at `now` of `counters` (already `at(w)`) under `limits`."""
    if limits.rpm is not None:
        limit_requests, remaining = limits.rpm, max(0, limits.rpm - counters.minute_requests)
        reset_requests = w.minute_reset_s
    elif limits.concurrent is not None:
        limit_requests, remaining = limits.concurrent, max(0, limits.concurrent - counters.in_flight)
        reset_requests = 0.0
    else:
        limit_requests, remaining, reset_requests = None, None, 0.0
    remaining_tokens = None if limits.tpm is None else max(0, limits.tpm - counters.minute_tokens)
    return RateView(now, limit_requests, remaining, reset_requests, limits.tpm, remaining_tokens, w.minute_reset_s)


def _usd(micro: int) -> str:
    return f"${micro / 1_000_000:.6f}".rstrip("0").rstrip(".")


def _wait(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def admit(limits: Limits, counters: Counters, now: float, *, tokens: int, micro: int) -> Admission | Refusal:
    """Whether a request that may use up to `tokens` tokens and `micro` µUSD fits `limits` at
    `now`, given what the key has used (`counters`): the counters with it added, or why not.

    The first limit it is over is the one named, checked in this order: at once, per minute
    (requests, then tokens), per day, per month."""
    w = windows(now)
    used = counters.at(w)
    seen = view(limits, used, w, now)
    fix = "; raise it with `engy-node gateway key set-limits`, or ask the gateway's operator"
    if limits.concurrent is not None and used.in_flight + 1 > limits.concurrent:
        return Refusal(
            "concurrent",
            f"rate limit: this key may have {limits.concurrent} requests in flight at once; "
            f"wait for one to finish{fix}",
            1,
            seen,
        )
    if limits.rpm is not None and used.minute_requests + 1 > limits.rpm:
        return Refusal(
            "rpm",
            f"rate limit: this key may make {limits.rpm} requests per minute; retry in {_wait(w.minute_reset_s)} s{fix}",
            _wait(w.minute_reset_s),
            seen,
        )
    if limits.tpm is not None and used.minute_tokens + tokens > limits.tpm:
        hint = "lower max_tokens (prompt + max_tokens are counted)" if tokens > limits.tpm else "retry shortly"
        return Refusal(
            "tpm",
            f"rate limit: this key may use {limits.tpm} tokens per minute and this request counts {tokens} "
            f"(prompt + max_tokens), {used.minute_tokens} already counted this minute; {hint}{fix}",
            _wait(w.minute_reset_s),
            seen,
        )
    if limits.daily_micro is not None and used.day_micro + micro > limits.daily_micro:
        return Refusal(
            "daily_usd",
            f"spend cap: this key may spend {_usd(limits.daily_micro)} per UTC day; {_usd(used.day_micro)} is spent "
            f"or held today and this request may cost up to {_usd(micro)}; lower max_tokens, or wait for the "
            f"day to end{fix}",
            _wait(w.day_reset_s),
            seen,
        )
    if limits.monthly_micro is not None and used.month_micro + micro > limits.monthly_micro:
        return Refusal(
            "monthly_usd",
            f"spend cap: this key may spend {_usd(limits.monthly_micro)} per UTC month; {_usd(used.month_micro)} is "
            f"spent or held this month and this request may cost up to {_usd(micro)}; lower max_tokens, or wait "
            f"for the month to end{fix}",
            _wait(w.month_reset_s),
            seen,
        )
    after = dataclasses.replace(
        used,
        in_flight=used.in_flight + 1,
        minute_requests=used.minute_requests + 1,
        minute_tokens=used.minute_tokens + tokens,
        day_micro=used.day_micro + micro,
        month_micro=used.month_micro + micro,
    )
    return Admission(after, view(limits, after, w, now))


def settle(counters: Counters, held_at: Windows, *, unused_tokens: int, unused_micro: int) -> Counters:
    """The counters once a hold taken in windows `held_at` is closed: one fewer in flight, and
    what it did not use given back to the windows it was counted in, if they are still the
    counters' own."""
    minute = counters.minute == held_at.minute
    return dataclasses.replace(
        counters,
        in_flight=max(0, counters.in_flight - 1),
        minute_tokens=max(0, counters.minute_tokens - unused_tokens) if minute else counters.minute_tokens,
        day_micro=max(0, counters.day_micro - unused_micro) if counters.day == held_at.day else counters.day_micro,
        month_micro=(
            max(0, counters.month_micro - unused_micro) if counters.month == held_at.month else counters.month_micro
        ),
    )


def response_headers(rate: RateView, api: Literal["openai", "anthropic"]) -> list[tuple[str, str]]:
    """The rate-limit headers of a response to a key with limits, in `api`'s names: OpenAI's
    `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset as a duration, "12s"), and on
    `/v1/messages` Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`
    (reset as an RFC 3339 time)."""
    out: list[tuple[str, str]] = []
    for kind, limit, remaining, reset_s in (
        ("requests", rate.limit_requests, rate.remaining_requests, rate.reset_requests_s),
        ("tokens", rate.limit_tokens, rate.remaining_tokens, rate.reset_tokens_s),
    ):
        if limit is None or remaining is None:
            continue
        if api == "openai":
            out += [
                (f"x-ratelimit-limit-{kind}", str(limit)),
                (f"x-ratelimit-remaining-{kind}", str(remaining)),
                (f"x-ratelimit-reset-{kind}", f"{math.ceil(reset_s)}s"),
            ]
        else:
            at = datetime.datetime.fromtimestamp(math.ceil(rate.at + reset_s), datetime.UTC)
            out += [
                (f"anthropic-ratelimit-{kind}-limit", str(limit)),
                (f"anthropic-ratelimit-{kind}-remaining", str(remaining)),
                (f"anthropic-ratelimit-{kind}-reset", at.strftime("%Y-%m-%dT%H:%M:%SZ")),
            ]
    return out
