"""The requests panel: the readers of a metrics snapshot, rates from counter deltas, the p50
history and its sparkline, the view of whole frames, robustness against any JSON, the widget under
Pilot and one SVG snapshot per look.

The metrics come from the same code as in the node: a hub's registry with the miner's
`MinerMetrics`, fed `RequestOutcome`s the way `RequestHandler` reports them, read back with
`Registry.snapshot()`. The miners' states are written as the hub holds them and decoded strictly
into the `NodeStates` the panel reads (`snapshots.decode_states`). Pilot tests are plain functions driving the app with `asyncio.run`, as in
`test_app.py` (pytest-trio claims `async def` tests).
"""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from textual.app import App, ComposeResult
from textual.widgets import Static

from engy_node.hub import Hub
from engy_node.metrics import Registry
from engy_node.miner.role import MinerMetrics
from engy_node.miner.serving import RequestOutcome
from engy_node.models import CATALOG
from engy_node.snapshots import NodeStates, decode_states
from engy_tui.widgets.requests_panel import (
    HISTORY_POINTS,
    HISTORY_STEP_S,
    RATE_WINDOW_S,
    REQUESTS_METRIC,
    STYLES,
    TOKENS_METRIC,
    TPOT_METRIC,
    TTFT_METRIC,
    Cell,
    Counters,
    Frames,
    Latency,
    Load,
    RequestsPanel,
    Sample,
    advance,
    counters_of,
    latency_of,
    limit_cell,
    limits_for,
    load_of,
    no_metrics,
    panel_view,
    push_point,
    rate,
    rates,
    sparkline,
)

MODEL = "smollm2-135m"
T0 = 1_000_000.0
SIZE = (140, 8)
MINER_STATES = {
    "miner-1": {"model": MODEL, "max_inflight": 32, "inflight": 12, "cpu_mode": True, "legs_up": 1, "legs": 1},
    "model_server.miner-1": {"state": "ready", "kind": "reference"},
}


class Miner:
    """A miner's metrics in a hub's registry, fed deterministic requests."""

    def __init__(self) -> None:
        self.hub = Hub()
        self.metrics = MinerMetrics(self.hub)
        self.served = 0

    def serve(self, n: int, *, ttft_s: float = 0.18, tpot_s: float = 0.021, errors: tuple[str, ...] = ()) -> dict:
        for _ in range(n):
            k = self.served = self.served + 1
            # A little deterministic spread, so percentiles differ.
            self.metrics.record(
                RequestOutcome(
                    ok=True,
                    prompt_tokens=120,
                    completion_tokens=64,
                    ttft_s=ttft_s * (1 + 0.1 * (k % 7)),
                    tpot_s=tpot_s * (1 + 0.05 * (k % 5)),
                )
            )
        for error in errors:
            self.metrics.record(RequestOutcome(ok=False, error_class=error))
        return self.snapshot()

    def snapshot(self) -> dict:
        return self.hub.registry.snapshot()


def busy_frames() -> tuple[dict, Frames]:
    """A minute of frames, one every 2 s: 4 requests a frame, latency creeping up, then a spike,
    and one timeout along the way."""
    miner = Miner()
    frames = Frames()
    metrics = miner.snapshot()
    for frame in range(32):
        ttft = 0.15 + 0.004 * frame + (0.3 if frame == 27 else 0.0)
        metrics = miner.serve(4, ttft_s=ttft, tpot_s=0.02 + 0.0002 * frame, errors=("timeout",) if frame == 10 else ())
        frames = advance(frames, metrics, T0 + 2.0 * frame)
    return metrics, frames


def typed(states: dict | None) -> NodeStates | None:
    """The hub's states as the panel gets them: decoded (strictly: the fixture must fit the schema)."""
    return None if states is None else decode_states(states, strict=True)


def text(line) -> str:
    return "".join(cell.text for cell in line).rstrip()


# ---- reading the snapshot -----------------------------------------------------------------------


def test_a_histograms_window_percentiles_are_read():
    miner = Miner()
    assert latency_of(miner.snapshot(), TTFT_METRIC) == Latency(0, None, None, None), "registered, nothing measured"
    metrics = miner.serve(100, ttft_s=0.1)
    latency = latency_of(metrics, TTFT_METRIC)
    window = miner.metrics.ttft.summary()
    assert latency == Latency(100, window.p50, window.p95, window.p99)
    assert latency_of(metrics, "engy_nope_seconds") is None
    assert latency_of(metrics, REQUESTS_METRIC) is None, "a counter is not a histogram"
    assert latency_of(None, TTFT_METRIC) is None


def test_several_labelled_series_give_an_upper_bound_never_an_exact_percentile():
    registry = Registry()
    family = registry.histogram("engy_miner_ttft_seconds", "x", labelnames=("model",))
    for value in (0.1, 0.2, 0.3):
        family.labels(model="a").observe(value)
    family.labels(model="b").observe(0.9)
    family.labels(model="c")  # a series with nothing in its window says nothing
    latency = latency_of(registry.snapshot(), TTFT_METRIC)
    assert latency == Latency(4, 0.9, 0.9, 0.9, upper_bound=True)


def test_a_window_that_is_not_numbers_reads_as_unknown():
    metrics = {
        TTFT_METRIC: {
            "type": "histogram",
            "children": [{"window": {"count": 5, "p50": "fast", "p95": 0.2, "p99": None}}],
        }
    }
    assert latency_of(metrics, TTFT_METRIC) == Latency(5, None, 0.2, None)
    assert latency_of({TTFT_METRIC: {"type": "histogram", "children": "x"}}, TTFT_METRIC) == Latency(
        0, None, None, None
    )
    assert (
        latency_of({TTFT_METRIC: {"type": "histogram", "children": [{"window": {"count": "5"}}]}}, TTFT_METRIC).count
        is None
    )


def test_counters_total_requests_errors_by_class_and_tokens_by_kind():
    miner = Miner()
    nothing = Counters(requests=0.0, errors=0.0, prompt_tokens=0.0, completion_tokens=0.0)
    assert counters_of(miner.snapshot()) == nothing, "registered and never used: truly none served"
    metrics = miner.serve(10, errors=("timeout", "timeout", "ServeError"))
    assert counters_of(metrics) == Counters(
        requests=13.0,
        errors=3.0,
        prompt_tokens=1200.0,
        completion_tokens=640.0,
        errors_by_class=(("timeout", 2.0), ("ServeError", 1.0)),
    )
    assert counters_of(None) == counters_of({}) == Counters()


def test_a_counter_that_is_not_a_finite_non_negative_number_is_unknown_not_zero():
    def requests(*values):
        return {
            REQUESTS_METRIC: {
                "type": "counter",
                "children": [{"labels": {"outcome": "ok"}, "value": v} for v in values],
            }
        }

    assert counters_of(requests(3, "4")).requests is None
    assert counters_of(requests(3, -1)).requests is None
    assert counters_of(requests(3, float("inf"))).requests is None
    assert counters_of(requests(1e308, 1e308)).requests is None, "a sum past float range is unknown"
    assert counters_of(requests(3, 4)) == Counters(requests=7.0, errors=0.0)
    tokens = {TOKENS_METRIC: {"type": "counter", "children": [{"labels": {"kind": "completion"}, "value": 9}]}}
    assert counters_of(tokens) == Counters(prompt_tokens=0.0, completion_tokens=9.0)


# ---- rates --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("previous", "current", "seconds", "expected"),
    [
        (10, 31, 10.0, 2.1),
        (10, 10, 5.0, 0.0),
        (None, 10, 5.0, None),
        (10, None, 5.0, None),
        (10, 5, 5.0, None),
        (10, 20, 0.0, None),
        (10, 20, -1.0, None),
        (10, 20, float("nan"), None),
    ],
)
def test_a_rate_is_a_counters_delta_over_the_time_between(previous, current, seconds, expected):
    assert rate(previous, current, seconds) == (None if expected is None else pytest.approx(expected))


def test_rates_between_two_samples():
    before = Sample(T0, Counters(requests=100, errors=1, prompt_tokens=1000, completion_tokens=500))
    after = Sample(T0 + 10, Counters(requests=121, errors=3, prompt_tokens=3400, completion_tokens=4620))
    window = rates(before, after)
    assert window is not None and window.span_s == 10
    assert window.requests_per_s == pytest.approx(2.1)
    assert window.errors == 2
    assert window.prompt_tokens_per_s == pytest.approx(240)
    assert window.completion_tokens_per_s == pytest.approx(412)
    assert rates(None, after) is None
    assert rates(after, after) is None, "no time passed"
    assert rates(before, Sample(T0 + 10, Counters())).requests_per_s is None


# ---- frames -------------------------------------------------------------------------------------


def test_the_history_takes_one_point_per_step_and_keeps_the_newest():
    history: tuple = ()
    for i in range(4 * HISTORY_POINTS):
        history = push_point(history, T0 + i * HISTORY_STEP_S / 2, float(i))
    assert len(history) == HISTORY_POINTS
    assert [value for _, value in history] == [float(i) for i in range(2 * HISTORY_POINTS, 4 * HISTORY_POINTS, 2)]
    assert push_point(((T0, 1.0),), T0 + HISTORY_STEP_S - 0.01, 2.0) == ((T0, 1.0),)


def test_advance_averages_rates_over_the_window():
    miner = Miner()
    frames = Frames()
    for frame in range(40):  # 2 requests a frame, a frame every 0.5 s: 4 req/s
        frames = advance(frames, miner.serve(2), T0 + frame * 0.5)
    assert frames.samples[-1].at - frames.samples[0].at == RATE_WINDOW_S
    window = rates(frames.samples[0], frames.samples[-1])
    assert window.requests_per_s == pytest.approx(4.0)
    assert window.completion_tokens_per_s == pytest.approx(4.0 * 64)
    assert len(frames.ttft) == math.ceil(39 * 0.5 / HISTORY_STEP_S)


def test_a_frame_seeing_the_same_snapshot_again_lowers_no_rate_to_zero_for_long():
    miner = Miner()
    frames = Frames()
    metrics = miner.snapshot()
    for frame in range(30):
        if frame % 2 == 0:  # the node's snapshot refreshes once a second, frames come twice as often
            metrics = miner.serve(3)
        frames = advance(frames, metrics, T0 + frame * 0.5)
    window = rates(frames.samples[0], frames.samples[-1])
    assert window.requests_per_s == pytest.approx(3.0, rel=0.06)


def test_sparse_frames_keep_the_previous_sample():
    miner = Miner()
    frames = advance(Frames(), miner.serve(1), T0)
    frames = advance(frames, miner.serve(30), T0 + 3 * RATE_WINDOW_S)
    assert len(frames.samples) == 2
    assert rates(*frames.samples).requests_per_s == pytest.approx(30 / (3 * RATE_WINDOW_S))


def test_a_counter_that_went_down_restarts_the_rates():
    old, new = Miner(), Miner()
    frames = advance(Frames(), old.serve(50), T0)
    frames = advance(frames, new.serve(2), T0 + 1)
    assert len(frames.samples) == 1, "the node restarted: the old sample would give a negative rate"
    frames = advance(frames, new.serve(2), T0 + 2)
    assert rates(*frames.samples).requests_per_s == pytest.approx(2.0)


def test_a_clock_that_went_back_starts_over():
    miner = Miner()
    frames = advance(advance(Frames(), miner.serve(1), T0 + 100), miner.serve(1), T0 + 101)
    frames = advance(frames, miner.serve(1), T0)
    assert len(frames.samples) == 1 and len(frames.ttft) == 1
    assert advance(frames, miner.snapshot(), float("nan")) is frames


# ---- sparkline ----------------------------------------------------------------------------------


def test_a_steady_latency_is_a_flat_line_in_the_middle_and_a_spike_stands_out():
    assert sparkline([0.2] * 5, width=5) == "▄▄▄▄▄"
    line = sparkline([0.2, 0.2, 0.2, 0.8, 0.2], width=5)
    assert line[3] == "█" and line[0] == line[1] == line[4] == "▁"
    assert sparkline([0.2, 0.21, 0.2], width=3) in ("▄▅▄", "▅▅▅", "▄▆▄"), "a 5 % wobble stays a few levels"


def test_the_sparkline_is_right_aligned_with_gaps_for_missing_points():
    assert sparkline([], width=4) == "    "
    assert sparkline([None, None], width=4) == "    "
    assert sparkline([0.1, None, 0.1], width=4) == " ▄ ▄"
    assert sparkline([1.0, 2.0, 3.0], width=2) == sparkline([2.0, 3.0], width=2)
    assert sparkline([0.0, 0.0], width=2) == "▄▄"
    assert sparkline([-1.0, 1.0, float("inf"), float("nan")], width=4) == "▁█  "
    assert sparkline([1.0], width=0) == ""


def test_a_ramp_uses_every_level():
    assert sparkline([float(i) for i in range(8)], width=8) == "▁▂▃▄▅▆▇█"


# ---- load and limits ----------------------------------------------------------------------------


def test_in_flight_is_summed_over_the_nodes_miners():
    assert load_of(typed(MINER_STATES)) == Load(miners=1, inflight=12, capacity=32, models=(MODEL,))
    two = {**MINER_STATES, "miner-2": {"model": MODEL, "max_inflight": 8, "inflight": 1}}
    assert load_of(typed(two)) == Load(miners=2, inflight=13, capacity=40, models=(MODEL,))
    starting = {"miner-1": {"model": MODEL, "max_inflight": 32}}
    assert load_of(typed(starting)) == Load(miners=1, inflight=None, capacity=32, models=(MODEL,)), (
        "link not up yet: unknown"
    )
    assert load_of(typed({"gateway": {"state": "ready"}})) == load_of(None) == Load(0, None, None, ())


def test_limits_are_the_catalogs_p99_ceilings_for_the_one_model_served():
    spec = CATALOG["qwen3.6-35b-a3b"]
    assert limits_for(["qwen3.6-35b-a3b"]) == (spec.qual_ttft_p99_ms, spec.qual_tpot_p99_ms) == (10_000, 200)
    assert limits_for([]) == limits_for(["nope"]) == limits_for([MODEL, "qwen3.6-35b-a3b"]) == (None, None)


def test_the_limit_cell_says_whether_p99_is_within_it_in_words():
    assert limit_cell(0.69, 2_000) == Cell("p99 limit 2,000 ms ✔", "ok")
    assert limit_cell(2.5, 2_000) == Cell("⚠ p99 over limit 2,000 ms", "warning")
    assert limit_cell(None, 2_000) == Cell("p99 limit 2,000 ms", "na")
    assert limit_cell(0.69, None) == Cell("")


# ---- the view -----------------------------------------------------------------------------------


def test_a_busy_miner_shows_percentiles_sparklines_limits_and_rates():
    metrics, frames = busy_frames()
    view = panel_view(metrics, frames, states=typed(MINER_STATES))

    assert view.title == f"Requests · {MODEL}" and view.status == () and view.notes == ()
    ttft, tpot = (text(row) for row in view.table)
    assert ttft.startswith("TTFT p50 ") and tpot.startswith("TPOT p50 ")
    assert ttft.index("p95") == tpot.index("p95") and ttft.index("p99 limit") == tpot.index("p99 limit"), (
        "columns line up"
    )
    spark = view.table[0][7].text.strip()
    assert len(spark) == HISTORY_POINTS and set(spark) <= set("▁▂▃▄▅▆▇█")
    assert "p99 limit 30,000 ms ✔" in ttft and "p99 limit 2,000 ms ✔" in tpot
    assert ttft.endswith("last 128 requests")
    inflight, errors, served = (text(line) for line in view.traffic)
    assert inflight == "in flight 12/32 · 2.0 req/s · 128 tok/s out · 240 tok/s in  (last 10 s)"
    assert errors == "errors    none in the last 10 s ✔"
    assert served == (
        "served    129 requests since the node started, 1 failed (timeout 1)  (the miners' count, probes included)"
    )


def test_latency_over_the_models_ceiling_is_flagged_with_what_it_means():
    miner = Miner()
    frames = Frames()
    for frame in range(3):
        metrics = miner.serve(5, ttft_s=40.0, tpot_s=0.02, errors=("timeout",) * frame)
        frames = advance(frames, metrics, T0 + frame)
    view = panel_view(metrics, frames, states=typed(MINER_STATES))
    assert "⚠ p99 over limit 30,000 ms" in text(view.table[0])
    p99 = latency_of(metrics, TTFT_METRIC).p99
    assert p99 == 64.0
    assert view.notes[0].text.startswith(f"⚠ TTFT p99 64,000 ms is over {MODEL}'s 30,000 ms ceiling: the gateway pulls")
    assert text(view.traffic[1]).startswith("errors    ⚠ 3 in the last 2 s")


def test_before_any_request_the_rows_say_so_without_zeros():
    miner = Miner()
    frames = advance(Frames(), miner.snapshot(), T0)
    view = panel_view(miner.snapshot(), frames, states=typed({"miner-1": {"model": MODEL, "max_inflight": 4}}))
    ttft = text(view.table[0])
    assert ttft.split()[:7] == ["TTFT", "p50", "—", "p95", "—", "p99", "—"]
    assert ttft.endswith("p99 limit 30,000 ms  no requests yet")
    assert [text(line) for line in view.traffic] == [
        "in flight n/a/4 · — req/s · — tok/s out · — tok/s in  (measuring)",
        "errors    — recently",
        "served    0 requests since the node started, 0 failed  (the miners' count, probes included)",
    ]


def test_what_the_snapshot_lacks_reads_n_a_not_zero():
    counters_only = {REQUESTS_METRIC: {"type": "counter", "children": [{"labels": {"outcome": "ok"}, "value": 7}]}}
    view = panel_view(counters_only, advance(Frames(), counters_only, T0), states=typed(MINER_STATES))
    ttft = text(view.table[0])
    assert ttft.split()[:7] == ["TTFT", "p50", "n/a", "p95", "n/a", "p99", "n/a"] and ttft.endswith("not reported")
    assert text(view.traffic[2]).startswith("served    7 requests since the node started, 0 failed")
    histograms_only = Miner().serve(3)
    histograms_only = {name: family for name, family in histograms_only.items() if family["type"] == "histogram"}
    view = panel_view(histograms_only, advance(Frames(), histograms_only, T0), states=typed(MINER_STATES))
    assert [text(line) for line in view.traffic[1:]] == ["errors    — recently", "served    totals n/a"]
    assert text(view.table[0]).endswith("last 3 requests")


def test_without_metrics_or_a_miner_the_panel_says_why():
    assert panel_view(None, Frames()).status == (Cell("waiting for the node's first metrics", "na"),)
    gateway_only = Registry()
    gateway_only.counter("engy_gateway_other_total", "x")
    view = panel_view(gateway_only.snapshot(), Frames(), states=typed({"gateway": {"state": "ready"}}))
    assert view.status == (Cell("no miner on this node: no request metrics", "na"),) and view.table == ()
    roles = ["gateway", "validator"]
    assert panel_view({}, Frames(), states=typed({"gateway": {}}), roles=roles).status == view.status


def test_a_node_whose_roles_name_miners_not_reported_yet_says_they_are_starting():
    """The first seconds of a node: its roles say it runs miners, their states are not in yet."""
    gateway = typed({"gateway": {"state": "ready"}})
    local = ["chain", "gateway", "miner-1", "miner-2", "validator", "verifier"]
    view = panel_view({}, Frames(), states=gateway, roles=local)
    assert view.status == (Cell("miners starting…: no request metrics yet", "na"),) and view.table == ()
    assert panel_view({}, Frames(), states=None, roles=["miner"]).status == (
        Cell("miner starting…: no request metrics yet", "na"),
    )
    assert panel_view({}, Frames(), roles=["miners", "miner-", "model_server"]).status == (
        Cell("no miner on this node: no request metrics", "na"),
    ), "only `miner` and `miner-N` are miners"
    reported = panel_view({}, Frames(), states=typed(MINER_STATES), roles=local)
    assert reported.status == (Cell("no request metrics from the miner yet", "na"),)
    assert no_metrics(load_of(typed({**MINER_STATES, "miner-2": {}})), ["miner-1"]) == (
        "no request metrics from the miners yet"
    )
    assert panel_view(None, Frames(), roles=local).status == (Cell("waiting for the node's first metrics", "na"),)


def test_several_miners_are_summed_and_counted_in_the_title():
    states = {
        **MINER_STATES,
        "miner-2": {"model": MODEL, "max_inflight": 8, "inflight": 8},
        "miner-3": {"model": "qwen3.6-35b-a3b", "max_inflight": 8, "inflight": 0},
    }
    metrics, frames = busy_frames()
    view = panel_view(metrics, frames, states=typed(states))
    assert view.title == "Requests · 3 miners"
    assert "p99 limit" not in text(view.table[0]), "two models: no one limit applies"
    assert text(view.traffic[0]).startswith("in flight 20/48 ·")
    full = panel_view(metrics, frames, states=typed({"miner-1": {"model": MODEL, "max_inflight": 4, "inflight": 4}}))
    assert full.traffic[0][1] == Cell("4/4 full", "warning")


# ---- any JSON -----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
CHILD = (
    st.fixed_dictionaries(
        {},
        optional={
            "labels": st.fixed_dictionaries(
                {},
                optional={
                    "outcome": st.sampled_from(["ok", "timeout"]) | JSON,
                    "kind": st.sampled_from(["prompt", "completion"]) | JSON,
                },
            )
            | JSON,
            "value": st.floats() | st.integers() | JSON,
            "window": st.fixed_dictionaries(
                {}, optional={k: st.floats() | st.integers() | JSON for k in ("count", "p50", "p95", "p99")}
            )
            | JSON,
        },
    )
    | JSON
)
FAMILY = (
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["counter", "histogram", "gauge"]) | JSON,
            "children": st.lists(CHILD, max_size=3) | JSON,
        },
    )
    | JSON
)
METRICS = (
    st.dictionaries(
        st.sampled_from([TTFT_METRIC, TPOT_METRIC, REQUESTS_METRIC, TOKENS_METRIC]) | st.text(max_size=5),
        FAMILY,
        max_size=5,
    )
    | JSON
)
STATES = (
    st.dictionaries(
        st.sampled_from(["miner", "miner-1", "miner-2", "model_server", "gateway"]) | st.text(max_size=5),
        st.fixed_dictionaries(
            {},
            optional={
                "model": st.sampled_from([MODEL, "qwen3.6-35b-a3b"]) | JSON,
                "max_inflight": JSON,
                "inflight": JSON,
            },
        )
        | JSON,
        max_size=3,
    )
    | JSON
)


@settings(max_examples=300, deadline=None)
@given(
    frames=st.lists(st.tuples(METRICS, st.floats()), min_size=1, max_size=4),
    states=STATES,
    roles=st.lists(st.sampled_from(["miner", "miner-1", "gateway"]) | st.text(max_size=6), max_size=4),
)
def test_no_json_and_no_clock_makes_the_panel_raise(frames, states, roles):
    decoded = decode_states(states) if isinstance(states, dict) else None  # liberal, as the bridge decodes
    remembered = Frames()
    for metrics, now in frames:
        remembered = advance(remembered, metrics, now)
        view = panel_view(metrics, remembered, states=decoded, roles=roles)
        cells = [
            *view.status,
            *(c for row in view.table for c in row),
            *(c for row in view.traffic for c in row),
            *view.notes,
        ]
        assert all(isinstance(cell.text, str) and cell.style in STYLES for cell in cells)
    assert len(remembered.ttft) <= HISTORY_POINTS and len(remembered.tpot) <= HISTORY_POINTS


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.none() | st.floats(), max_size=40), width=st.integers(-2, 40))
def test_a_sparkline_is_always_exactly_its_width(values, width):
    line = sparkline(values, width=width)
    assert len(line) == max(width, 0) and set(line) <= set(" ▁▂▃▄▅▆▇█")


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.tuples(st.integers(0, 10**6), st.floats(0.01, 100)), min_size=2, max_size=10))
def test_rates_are_never_negative(counts):
    frames = Frames()
    at = T0
    for total, gap in counts:
        at += gap
        metrics = {REQUESTS_METRIC: {"type": "counter", "children": [{"labels": {"outcome": "ok"}, "value": total}]}}
        frames = advance(frames, metrics, at)
        if len(frames.samples) > 1:
            window = rates(frames.samples[0], frames.samples[-1])
            assert window.requests_per_s is None or window.requests_per_s >= 0


# ---- the widget ---------------------------------------------------------------------------------


class PanelApp(App[None]):
    """Just the panel, fed a sequence of (metrics, now) frames on mount."""

    def __init__(
        self, frames: list[tuple[dict | None, float]], states: dict | None = None, roles: tuple[str, ...] = ()
    ) -> None:
        super().__init__()
        self.frames, self.states, self.roles = frames, typed(states), roles

    def compose(self) -> ComposeResult:
        yield RequestsPanel()

    def on_mount(self) -> None:
        for metrics, now in self.frames:
            self.query_one(RequestsPanel).update_metrics(metrics, now=now, states=self.states, roles=self.roles)


def busy_sequence() -> list[tuple[dict, float]]:
    miner = Miner()
    sequence = []
    for frame in range(32):
        ttft = 0.15 + 0.004 * frame + (0.3 if frame == 27 else 0.0)
        sequence.append(
            (
                miner.serve(4, ttft_s=ttft, tpot_s=0.02 + 0.0002 * frame, errors=("timeout",) if frame == 10 else ()),
                T0 + 2.0 * frame,
            )
        )
    return sequence


def shown(app: App, widget_id: str) -> str:
    return str(app.query_one(f"#{widget_id}", Static).content)


def test_the_widget_follows_frames_and_remembers_between_them():
    async def scenario() -> None:
        app = PanelApp([])
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(RequestsPanel)
            assert shown(app, "status") == "waiting for the node's first metrics" and panel.has_class("-idle")
            assert not app.query_one("#table").display

            for metrics, now in busy_sequence():
                panel.update_metrics(metrics, now=now, states=typed(MINER_STATES))
            await pilot.pause()
            assert panel.border_title == f"Requests · {MODEL}" and not panel.has_class("-idle")
            ttft, tpot = shown(app, "table").splitlines()
            assert ttft.startswith("TTFT p50") and tpot.startswith("TPOT p50")
            assert shown(app, "traffic").splitlines()[0].startswith("in flight 12/32 · 2.0 req/s")
            assert len(panel.frames.ttft) == HISTORY_POINTS

            panel.update_metrics(None, now=T0 + 100, states=typed(MINER_STATES))
            await pilot.pause()
            assert shown(app, "status") == "waiting for the node's first metrics"
            assert len(panel.frames.ttft) == HISTORY_POINTS, "a frame without metrics forgets nothing"

            panel.update_metrics({}, now=T0 + 200, states=typed({}), roles=("gateway", "miner"))
            await pilot.pause()
            assert shown(app, "status") == "miner starting…: no request metrics yet" and panel.has_class("-idle")

    asyncio.run(scenario())


def test_requests_snapshot(snap_compare):
    assert snap_compare(PanelApp(busy_sequence(), MINER_STATES), terminal_size=SIZE)


def test_over_the_limit_snapshot(snap_compare):
    miner = Miner()
    sequence = [
        (miner.serve(5, ttft_s=20.0 + 5 * i, tpot_s=0.02, errors=("timeout",) * (i % 2)), T0 + 2.0 * i)
        for i in range(12)
    ]
    assert snap_compare(PanelApp(sequence, MINER_STATES), terminal_size=(140, 10))


def test_no_miner_snapshot(snap_compare):
    assert snap_compare(PanelApp([({}, T0)], {"gateway": {"state": "ready"}}), terminal_size=(80, 5))
