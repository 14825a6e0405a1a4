"""The requests panel: how fast this node's miner answers (TTFT and TPOT p50/p95/p99 with a
sparkline of the p50), how much it serves (in flight, requests/s, tokens/s) and how often it fails.

The widget is handed the hub's metrics snapshot (`engy_node.metrics.Registry.snapshot()`) and the
render time through `update_metrics` by the app's fixed-rate timer; it never polls or reads the
clock. Everything it shows is computed by the plain functions below, tested without a terminal:

* `latency_of` reads a histogram's recent window (exact nearest-rank percentiles over the last
  few thousand observations, not the lifetime buckets).
* `counters_of` reads the request and token counters; `advance` folds one frame into `Frames`
  (the samples of the last `RATE_WINDOW_S` and a bounded p50 history, one point per
  `HISTORY_STEP_S`), and `rates` turns two samples into per-second rates: counter deltas over the
  `now` difference. A counter that went down (the node restarted) starts the rates afresh.
* `load_of` reads in-flight requests and the cap from the miners' states (`NodeStates.miners`), and
  `limits_for` the model's p99 ceilings from the catalog: the gateway's breaker pulls a worker
  whose p99 stays over them.

The miner's metrics are `MinerMetrics` (`engy_node/miner/role.py`): `engy_miner_ttft_seconds`,
`engy_miner_tpot_seconds`, `engy_miner_requests_total{outcome}` ("ok" or an error class) and
`engy_miner_tokens_total{kind}` (prompt, completion). A local network's miners share one registry,
so their numbers are summed. The gateway registers no request metrics of its own.

Until a miner has reported, the panel says why there is nothing: the node's roles tell a node that
runs no miner from one whose miners are still starting (their states not in yet).

Honesty rules: a number the snapshot does not have is "—" or "n/a", dimmed, never 0; the metrics
are treated as untrusted JSON (a wrong type reads as missing, nothing raises); colour is never the
only signal (✔ ⚠ and words carry it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_node.models import CATALOG
from engy_node.snapshots import NodeStates, is_miner
from engy_tui.widgets.cells import (
    DASH,
    NA,
    Cell,
    cells_content,
    room,
)
from engy_tui.widgets.cells import (
    as_int as _int,
)
from engy_tui.widgets.cells import (
    as_list as _list,
)
from engy_tui.widgets.cells import (
    as_map as _map,
)
from engy_tui.widgets.cells import (
    as_number as _num,
)
from engy_tui.widgets.server_panel import format_ms

__all__ = [
    "HISTORY_POINTS",
    "HISTORY_STEP_S",
    "RATE_WINDOW_S",
    "REQUESTS_METRIC",
    "STYLES",
    "TOKENS_METRIC",
    "TPOT_METRIC",
    "TTFT_METRIC",
    "Cell",
    "Counters",
    "Frames",
    "Latency",
    "Load",
    "PanelView",
    "Rates",
    "RequestsPanel",
    "Sample",
    "advance",
    "counters_of",
    "latency_of",
    "limit_cell",
    "limits_for",
    "link_notes",
    "links_down",
    "load_of",
    "no_metrics",
    "panel_view",
    "push_point",
    "rate",
    "rates",
    "sparkline",
]

TTFT_METRIC = "engy_miner_ttft_seconds"
TPOT_METRIC = "engy_miner_tpot_seconds"
REQUESTS_METRIC = "engy_miner_requests_total"
TOKENS_METRIC = "engy_miner_tokens_total"

HISTORY_POINTS = 30
HISTORY_STEP_S = 2.0
"""The sparkline: one p50 point every 2 s, the last 30 of them (a minute), whatever the frame
rate."""
SERVED_SOURCE = "the miners' count, probes included"
"""Where the lifetime total comes from, beside it: the demo traffic's "sent" and the gateway's
billed requests count buyers only, so the three figures differ and each says whose it is."""
NARROW_SPARK_POINTS = 8
"""A sparkline shorter than this says too little: a narrow terminal leaves it out instead."""
SPARK_COLUMN = 7
"""The latency rows' sparkline column: label, p50, value, p95, value, p99, value, sparkline."""
RATE_WINDOW_S = 10.0
"""Rates are averaged over about this long: one frame's delta (0.5 s, while the node's snapshot
may refresh once a second) would swing between 0 and twice the truth."""

OK = "✔"
WARN = "⚠"
ERROR = "✘"
BLOCKS = "▁▂▃▄▅▆▇█"
GAP = "  "

STYLES: dict[str, str] = {
    "": "",
    "header": "bold $foreground-muted",
    "na": "$foreground-muted",
    "ok": "$text-success",
    "spark": "$text-primary",
    "warning": "$text-warning",
    "error": "$text-error",
}
"""Cell style names -> Textual styles (theme variables, so every theme works)."""


NA_CELL = Cell(NA, "na")
DASH_CELL = Cell(DASH, "na")


# ---- reading untrusted JSON ---------------------------------------------------------------------


def _family(metrics: Any, name: str, kind: str) -> Mapping[str, Any] | None:
    family = _map(metrics).get(name)
    return family if isinstance(family, Mapping) and family.get("type") == kind else None


def _children(family: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [child for child in _list(family.get("children")) if isinstance(child, Mapping)]


# ---- latency ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Latency:
    """A histogram's recent window, in seconds; percentiles None when it is empty or unreadable."""

    count: int | None
    p50: float | None
    p95: float | None
    p99: float | None
    upper_bound: bool = False
    """Merged from several labelled series: each percentile is the largest of theirs, which is
    at least the merged one (never shown as exact)."""


def latency_of(metrics: Any, name: str) -> Latency | None:
    """The window percentiles of histogram `name`; None when the snapshot has no such histogram."""
    family = _family(metrics, name, "histogram")
    if family is None:
        return None
    windows = [_map(child.get("window")) for child in _children(family)]
    if not windows:
        return Latency(0, None, None, None)
    counts = [_int(window.get("count")) for window in windows]
    count = None if None in counts else sum(c for c in counts if c is not None)

    def worst(key: str) -> float | None:
        values = [_num(window.get(key)) for window in windows if _int(window.get("count"))]
        return None if not values or None in values else max(v for v in values if v is not None)

    return Latency(count, worst("p50"), worst("p95"), worst("p99"), upper_bound=len(windows) > 1)


# ---- counters and rates -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
    """Lifetime totals from the counters; None where the snapshot does not have them."""

    requests: float | None = None
    errors: float | None = None
    """Requests whose outcome was not "ok"."""
    prompt_tokens: float | None = None
    completion_tokens: float | None = None
    errors_by_class: tuple[tuple[str, float], ...] = ()
    """(error class, count), most first."""


def _sum(children: Iterable[Mapping[str, Any]]) -> float | None:
    values = [_num(child.get("value")) for child in children]
    if None in values or any(v is not None and v < 0 for v in values):
        return None
    total = sum(v for v in values if v is not None)
    return total if math.isfinite(total) else None


def counters_of(metrics: Any) -> Counters:
    requests = _family(metrics, REQUESTS_METRIC, "counter")
    tokens = _family(metrics, TOKENS_METRIC, "counter")
    result = Counters()
    if requests is not None:
        children = _children(requests)
        failed = [child for child in children if _map(child.get("labels")).get("outcome") != "ok"]
        by_class: dict[str, float] = {}
        for child in failed:
            value = _num(child.get("value"))
            outcome = _map(child.get("labels")).get("outcome")
            if value and value > 0:
                label = outcome if isinstance(outcome, str) and outcome else "unlabelled"
                by_class[label] = by_class.get(label, 0.0) + value
        result = dataclasses.replace(
            result,
            requests=_sum(children),
            errors=_sum(failed),
            errors_by_class=tuple(sorted(by_class.items(), key=lambda item: (-item[1], item[0]))),
        )
    if tokens is not None:
        children = _children(tokens)

        def kind(name: str) -> float | None:
            return _sum(child for child in children if _map(child.get("labels")).get("kind") == name)

        result = dataclasses.replace(result, prompt_tokens=kind("prompt"), completion_tokens=kind("completion"))
    return result


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    at: float
    """The frame's `now`."""
    counters: Counters


@dataclasses.dataclass(frozen=True, slots=True)
class Rates:
    span_s: float
    """Seconds between the two samples."""
    requests_per_s: float | None
    errors: float | None
    """Failed requests in the span (a count: a few errors are easier to read than 0.1/s)."""
    prompt_tokens_per_s: float | None
    completion_tokens_per_s: float | None


def rate(previous: float | None, current: float | None, seconds: float) -> float | None:
    """(current - previous) / seconds; None when either is unknown, the span is not positive or
    the counter went down (it was reset)."""
    if previous is None or current is None or not seconds > 0 or current < previous:
        return None
    value = (current - previous) / seconds
    return value if math.isfinite(value) else None


def rates(previous: Sample | None, current: Sample) -> Rates | None:
    """Per-second rates between two samples; None without an earlier sample."""
    if previous is None:
        return None
    span = current.at - previous.at
    if not (span > 0 and math.isfinite(span)):
        return None
    before, now = previous.counters, current.counters
    errors = None
    if before.errors is not None and now.errors is not None and now.errors >= before.errors:
        errors = now.errors - before.errors
    return Rates(
        span_s=span,
        requests_per_s=rate(before.requests, now.requests, span),
        errors=errors,
        prompt_tokens_per_s=rate(before.prompt_tokens, now.prompt_tokens, span),
        completion_tokens_per_s=rate(before.completion_tokens, now.completion_tokens, span),
    )


def _went_down(before: Counters, now: Counters) -> bool:
    pairs = (
        (before.requests, now.requests),
        (before.errors, now.errors),
        (before.prompt_tokens, now.prompt_tokens),
        (before.completion_tokens, now.completion_tokens),
    )
    return any(a is not None and b is not None and b < a for a, b in pairs)


# ---- history ------------------------------------------------------------------------------------

Point = tuple[float, float | None]
"""(the frame's now, the p50 in seconds or None when nothing was measured)."""


def push_point(
    history: tuple[Point, ...],
    at: float,
    value: float | None,
    *,
    step_s: float = HISTORY_STEP_S,
    points: int = HISTORY_POINTS,
) -> tuple[Point, ...]:
    """`history` with (at, value) appended when `step_s` has passed since its last point, keeping
    the newest `points`; unchanged otherwise."""
    if history and at - history[-1][0] < step_s:
        return history
    return (*history, (at, value))[-points:]


@dataclasses.dataclass(frozen=True, slots=True)
class Frames:
    """What the panel remembers between frames: bounded, immutable, advanced by `advance`."""

    samples: tuple[Sample, ...] = ()
    """Counter samples of the last `RATE_WINDOW_S` (at least the previous one), oldest first."""
    ttft: tuple[Point, ...] = ()
    tpot: tuple[Point, ...] = ()


def advance(frames: Frames, metrics: Any, now: float) -> Frames:
    """`frames` after one more frame showing `metrics` at `now`. A clock that went back starts
    over; a counter that went down drops the older samples (their rates would be wrong)."""
    at = _num(now)
    if at is None:
        return frames
    if frames.samples and at < frames.samples[-1].at:
        frames = Frames()
    sample = Sample(at, counters_of(metrics))
    samples = frames.samples
    if samples and _went_down(samples[-1].counters, sample.counters):
        samples = ()
    recent = tuple(s for s in samples if at - s.at <= RATE_WINDOW_S) or samples[-1:]
    ttft, tpot = latency_of(metrics, TTFT_METRIC), latency_of(metrics, TPOT_METRIC)
    return Frames(
        samples=(*recent, sample),
        ttft=push_point(frames.ttft, at, ttft.p50 if ttft else None),
        tpot=push_point(frames.tpot, at, tpot.p50 if tpot else None),
    )


SPARK_MIN_SPAN = 0.25
"""The sparkline's vertical range is at least this share of its largest value, so jitter of a few
percent stays a few levels, not the full height."""


def sparkline(values: Sequence[float | None], *, width: int = HISTORY_POINTS) -> str:
    """The newest `width` values as block characters, right-aligned. The range spans the values
    shown (at least `SPARK_MIN_SPAN` of the largest, centred on them, never below 0), so a steady
    latency is a flat line in the middle and a spike stands out; a missing point is a space."""
    shown = list(values)[-width:] if width > 0 else []
    known = [v for v in shown if v is not None and math.isfinite(v)]
    chars = []
    span = bottom = high = low = 0.0
    if known:
        high, low = max(known), min(known)
        span = max(high - low, SPARK_MIN_SPAN * abs(high))
        bottom = max(0.0, (high + low - span) / 2) if low >= 0 else low
    for value in shown:
        if value is None or not math.isfinite(value):
            chars.append(" ")
        elif high == low or not math.isfinite(span):
            chars.append(BLOCKS[len(BLOCKS) // 2 - 1])
        else:
            level = round((value - bottom) / span * (len(BLOCKS) - 1))
            chars.append(BLOCKS[min(max(level, 0), len(BLOCKS) - 1)])
    return " " * (max(width, 0) - len(chars)) + "".join(chars)


# ---- load and limits ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    miners: int
    inflight: int | None
    capacity: int | None
    models: tuple[str, ...]


def load_of(states: NodeStates | None) -> Load:
    """In-flight requests and the cap, summed over the node's miners (`run_miner` publishes
    `max_inflight`; its link adds `inflight` once it runs)."""
    miners = list(states.miners.values()) if states is not None else []
    inflight = [state.inflight for state in miners]
    capacity = [state.max_inflight for state in miners]
    models = sorted({state.model for state in miners if state.model})
    return Load(
        miners=len(miners),
        inflight=None if not miners or None in inflight else sum(i for i in inflight if i is not None),
        capacity=None if not miners or None in capacity else sum(c for c in capacity if c is not None),
        models=tuple(models),
    )


def limits_for(models: Sequence[str]) -> tuple[int | None, int | None]:
    """The catalog's p99 ceilings (TTFT, TPOT) in ms for the one model served; (None, None) with
    none, several or an unknown one."""
    if len(models) != 1 or models[0] not in CATALOG:
        return None, None
    spec = CATALOG[models[0]]
    return spec.qual_ttft_p99_ms, spec.qual_tpot_p99_ms


def limit_cell(p99_s: float | None, limit_ms: int | None) -> Cell:
    """ "p99 limit 10,000 ms ✔", "⚠ p99 over limit 200 ms", or nothing without a limit."""
    if limit_ms is None:
        return Cell("")
    if p99_s is None:
        return Cell(f"p99 limit {limit_ms:,} ms", "na")
    if p99_s * 1000 > limit_ms:
        return Cell(f"{WARN} p99 over limit {limit_ms:,} ms", "warning")
    return Cell(f"p99 limit {limit_ms:,} ms {OK}", "ok")


# ---- the whole panel ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PanelView:
    title: str
    status: tuple[Cell, ...]
    """Why there is nothing to show, when there is not."""
    table: tuple[tuple[Cell, ...], ...]
    """The TTFT and TPOT rows, padded to line up."""
    traffic: tuple[tuple[Cell, ...], ...]
    """In flight and rates; errors."""
    notes: tuple[Cell, ...]


def _ms(value: float | None, bound: bool) -> str:
    return DASH if value is None else ("≤" if bound else "") + format_ms(value)


def _latency_row(
    label: str, latency: Latency | None, history: Sequence[Point], limit_ms: int | None, spark_width: int
) -> tuple[Cell, ...]:
    spark = Cell(sparkline([value for _, value in history], width=spark_width), "spark")
    if latency is None:
        return (
            Cell(label, "header"),
            Cell("p50", "header"),
            NA_CELL,
            Cell("p95", "header"),
            NA_CELL,
            Cell("p99", "header"),
            NA_CELL,
            spark,
            limit_cell(None, limit_ms),
            Cell("not reported", "na"),
        )
    values = [
        Cell(_ms(v, latency.upper_bound), "na" if v is None else "") for v in (latency.p50, latency.p95, latency.p99)
    ]
    if latency.count is None:
        n = NA_CELL
    elif latency.count == 0:
        n = Cell("no requests yet", "na")
    else:
        n = Cell(f"last {latency.count:,} requests", "na")
    return (
        Cell(label, "header"),
        Cell("p50", "header"),
        values[0],
        Cell("p95", "header"),
        values[1],
        Cell("p99", "header"),
        values[2],
        spark,
        limit_cell(latency.p99, limit_ms),
        n,
    )


def _per_s(value: float | None, unit: str) -> str:
    if value is None:
        return f"{DASH} {unit}/s"
    return f"{value:,.1f} {unit}/s" if value < 100 else f"{value:,.0f} {unit}/s"


def links_down(states: NodeStates | None) -> tuple[tuple[str, str], ...]:
    """(miner, why) for each miner with no leg up at the gateway and a known reason
    (`MinerState.link_down`, which the miner_link alert and the Miner tab read too)."""
    if states is None:
        return ()
    return tuple((name, why) for name, miner in sorted(states.miners.items()) if (why := miner.link_down))


def link_notes(down: Sequence[tuple[str, str]]) -> tuple[Cell, ...]:
    return tuple(Cell(f"{ERROR} {name} has no leg up at the gateway: {why}", "error") for name, why in down)


def _traffic(
    load: Load, counters: Counters, window: Rates | None, down: Sequence[tuple[str, str]] = ()
) -> tuple[tuple[Cell, ...], ...]:
    if load.miners:
        inflight = f"{NA if load.inflight is None else f'{load.inflight:,}'}/{NA if load.capacity is None else f'{load.capacity:,}'}"
        full = (
            load.inflight is not None
            and load.capacity is not None
            and load.capacity > 0
            and load.inflight >= load.capacity
        )
        first = [
            Cell("in flight ", "header"),
            Cell(f"{inflight} full" if full else inflight, "warning" if full else ""),
        ]
    else:
        first = [Cell("in flight ", "header"), NA_CELL]
    if window is None:
        first += [Cell(f" · {DASH} req/s · {DASH} tok/s out · {DASH} tok/s in", "na"), Cell("  (measuring)", "na")]
    else:
        first += [
            Cell(
                f" · {_per_s(window.requests_per_s, 'req')} · {_per_s(window.completion_tokens_per_s, 'tok')} out"
                f" · {_per_s(window.prompt_tokens_per_s, 'tok')} in"
            ),
            Cell(f"  (last {window.span_s:,.0f} s)", "na"),
        ]
    second: list[Cell] = [Cell("errors    ", "header")]
    if down:
        # No request fails while a miner cannot reach the gateway: nothing reaches it at all.
        second.append(Cell(f"{ERROR} {len(down)} miner link{'s' if len(down) != 1 else ''} down (below)", "error"))
        if window is not None and window.errors:
            second.append(Cell(f" · {WARN} {window.errors:,.0f} failed in the last {window.span_s:,.0f} s", "warning"))
    elif window is None or window.errors is None:
        second.append(Cell(f"{DASH} recently", "na"))
    elif window.errors:
        second.append(Cell(f"{WARN} {window.errors:,.0f} in the last {window.span_s:,.0f} s", "warning"))
    else:
        second.append(Cell(f"none in the last {window.span_s:,.0f} s {OK}", "ok"))
    third: list[Cell] = [Cell("served    ", "header")]
    if counters.requests is None:
        third.append(Cell(f"totals {NA}", "na"))
    else:
        # The miners' own count: what the demo buyer sent, or the gateway billed, is a part of it.
        errors = NA if counters.errors is None else f"{counters.errors:,.0f}"
        total = f"{counters.requests:,.0f} requests since the node started, {errors} failed"
        if counters.errors_by_class:
            total += " (" + ", ".join(f"{name} {count:,.0f}" for name, count in counters.errors_by_class[:4])
            total += ", …)" if len(counters.errors_by_class) > 4 else ")"
        third += [Cell(total), Cell(f"  ({SERVED_SOURCE})", "na")]
    return tuple(first), tuple(second), tuple(third)


def no_metrics(load: Load, roles: Sequence[str]) -> str:
    """Why a metrics snapshot has no request metrics: the miners have not reported yet (their
    states, or their first metrics), or the node runs no miner (none of its `roles`)."""
    if load.miners:
        return f"no request metrics from the miner{'s' if load.miners != 1 else ''} yet"
    starting = sum(1 for role in roles if is_miner(role))
    if starting:
        return f"miner{'s' if starting != 1 else ''} starting…: no request metrics yet"
    return "no miner on this node: no request metrics"


def panel_view(
    metrics: Any,
    frames: Frames,
    *,
    states: NodeStates | None = None,
    roles: Sequence[str] = (),
    width: int | None = None,
) -> PanelView:
    """What the panel shows for a metrics snapshot (None before the first), the frames so far
    (`advance` already applied for this one), the node's states (for in-flight and the model),
    its roles (does it run a miner at all) and the cells a line has (`width`, None: no limit)."""
    load = load_of(states)
    title = "Requests"
    if len(load.models) == 1:
        title += f" · {load.models[0]}"
    if load.miners > 1:
        title += f" · {load.miners} miners"
    down = links_down(states)
    if not isinstance(metrics, Mapping):
        return PanelView(title, (Cell("waiting for the node's first metrics", "na"), *link_notes(down)), (), (), ())
    ttft, tpot = latency_of(metrics, TTFT_METRIC), latency_of(metrics, TPOT_METRIC)
    counters = counters_of(metrics)
    if ttft is None and tpot is None and counters == Counters():
        return PanelView(title, (Cell(no_metrics(load, roles), "na"), *link_notes(down)), (), (), ())
    ttft_limit, tpot_limit = limits_for(load.models)

    def latency_table(spark_width: int, counts: bool) -> tuple[tuple[Cell, ...], ...]:
        rows = [
            _latency_row("TTFT", ttft, frames.ttft, ttft_limit, spark_width),
            _latency_row("TPOT", tpot, frames.tpot, tpot_limit, spark_width),
        ]
        rows = [row[:SPARK_COLUMN] + row[SPARK_COLUMN + 1 :] if not spark_width else row for row in rows]
        return _pad([row if counts else row[:-1] for row in rows], right={2, 4, 6}, tight={0, 1, 3, 5})

    # Narrow: the request counts go first, then the sparkline shortens (its newest points stay)
    # or goes; the percentiles and the limit stay whole.
    table = latency_table(HISTORY_POINTS, True)
    over = 0 if width is None else _width(table) - width
    if over > 0:
        table = latency_table(HISTORY_POINTS, False)
        over = _width(table) - (width or 0)
    if over > 0:
        spark_width = HISTORY_POINTS - over if HISTORY_POINTS - over >= NARROW_SPARK_POINTS else 0
        table = latency_table(spark_width, False)
    window = rates(frames.samples[0], frames.samples[-1]) if len(frames.samples) > 1 else None
    notes = list(link_notes(down))
    for label, latency, limit in (("TTFT", ttft, ttft_limit), ("TPOT", tpot, tpot_limit)):
        if latency is not None and latency.p99 is not None and limit is not None and latency.p99 * 1000 > limit:
            notes.append(
                Cell(
                    f"{WARN} {label} p99 {format_ms(latency.p99)} is over {load.models[0]}'s {limit:,} ms ceiling: "
                    "the gateway pulls a worker whose p99 stays over it (check GPU load, batch size, "
                    "or serve fewer requests at once)",
                    "warning",
                )
            )
    return PanelView(title, (), table, _traffic(load, counters, window, down), tuple(notes))


def _width(rows: Sequence[Sequence[Cell]]) -> int:
    return max(sum(cell_len(cell.text) for cell in row) for row in rows)


def _pad(rows: Sequence[tuple[Cell, ...]], *, right: set[int], tight: set[int]) -> tuple[tuple[Cell, ...], ...]:
    """Pad every cell to its column's widest text, then a gap (one space in `tight` columns, none
    after the last); `right` columns are right-aligned."""
    columns = len(rows[0])
    widths = [max(cell_len(row[c].text) for row in rows) for c in range(columns)]

    def fit(cell: Cell, column: int) -> Cell:
        room = " " * (widths[column] - cell_len(cell.text))
        text = room + cell.text if column in right else cell.text + room
        if column < columns - 1:
            text += " " if column in tight else GAP
        return cell._replace(text=text)

    return tuple(tuple(fit(cell, column) for column, cell in enumerate(row)) for row in rows)


def _content(lines: Iterable[Sequence[Cell]]) -> Content:
    return cells_content(lines, STYLES)


class RequestsPanel(Widget):
    """Latency, throughput and errors of this node's miner; call `update_metrics(metrics, now=...,
    states=..., roles=...)` with each new hub snapshot."""

    DEFAULT_CSS = """
    RequestsPanel {
        height: auto;
        padding: 0 1;
        border: round $primary;
        border-title-color: $text-primary;
        border-title-style: bold;
    }
    RequestsPanel.-idle {
        border: round $foreground-muted;
    }
    RequestsPanel > #table, RequestsPanel > #traffic {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.frames = Frames()
        """What the panel remembers between frames (rates and sparklines)."""
        self._shown: tuple[Mapping[str, Any] | None, NodeStates | None, Sequence[str]] = (None, None, ())
        """The metrics, states and roles shown, to lay out again for a new width."""

    def compose(self) -> ComposeResult:
        for widget_id in ("status", "table", "traffic", "notes"):
            yield Static(id=widget_id)

    def on_mount(self) -> None:
        self._show(panel_view(None, self.frames))

    def update_metrics(
        self,
        metrics: Mapping[str, Any] | None,
        *,
        now: float,
        states: NodeStates | None = None,
        roles: Sequence[str] = (),
    ) -> None:
        """Show the hub's metrics snapshot (None: none yet) as of wall-clock `now`; `states` (the
        node's states) gives in-flight requests and the served model, `roles` (the node info's)
        whether a miner that has not reported yet is starting."""
        if metrics is not None:
            self.frames = advance(self.frames, metrics, now)
        self._shown = (metrics, states, roles)
        self._show(panel_view(metrics, self.frames, states=states, roles=roles, width=room(self)))

    def on_resize(self) -> None:
        metrics, states, roles = self._shown
        self._show(panel_view(metrics, self.frames, states=states, roles=roles, width=room(self)))

    def _show(self, view: PanelView) -> None:
        self.border_title = view.title
        self.set_class(bool(view.status), "-idle")
        for widget_id, lines in (
            ("status", [(c,) for c in view.status]),
            ("table", view.table),
            ("traffic", view.traffic),
            ("notes", [(c,) for c in view.notes]),
        ):
            static = self.query_one(f"#{widget_id}", Static)
            static.update(_content(lines))
            static.display = bool(lines)
