"""Tests for engy_node.metrics: percentiles, buckets, registration, snapshots, and the exposition
prometheus_client writes from the registry (read back with its parser)."""

import json
import math
import sys
import threading
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engy_node.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    HistogramSummary,
    Registry,
)
from engy_node.percentile import nearest_rank

METRIC_NAMES = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
PERCENTILES = st.one_of(
    st.integers(min_value=1, max_value=100),
    st.floats(min_value=0, max_value=100, exclude_min=True),
)


def exposition(registry: Registry) -> str:
    return generate_latest(registry).decode()


def read_back(registry: Registry) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in the registry's exposition, in order."""
    families = text_string_to_metric_families(exposition(registry))
    return [(sample.name, sample.labels, sample.value) for family in families for sample in family.samples]


def reference_percentile(values, q):
    """The smallest observation x with at least q% of all observations <= x."""
    ordered = sorted(values)
    for x in ordered:
        at_or_below = sum(1 for v in ordered if v <= x)
        if Fraction(at_or_below) * 100 >= Fraction(q) * len(ordered):
            return x
    raise AssertionError("unreachable for q <= 100")


@given(st.lists(st.integers(min_value=-1000, max_value=1000), min_size=1, max_size=60), PERCENTILES)
def test_nearest_rank_matches_a_reference_that_counts_sorted_values(values, q):
    assert nearest_rank(sorted(values), q) == reference_percentile(values, q)


def test_nearest_rank_picks_the_textbook_values():
    values = [15, 20, 35, 40, 50]
    assert [nearest_rank(values, q) for q in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]
    # In floats, 7/100 * 100 rounds up past 7, which would pick the 8th value instead.
    assert nearest_rank(list(range(1, 101)), 7) == 7
    assert nearest_rank([3, 9], 50) == 3
    assert nearest_rank([3, 9], 50.000001) == 9


@pytest.mark.parametrize("q", [0, -1, 100.5, math.nan])
def test_nearest_rank_rejects_a_percentile_outside_0_to_100(q):
    with pytest.raises(ValueError, match="percentile"):
        nearest_rank([1, 2, 3], q)


def test_nearest_rank_rejects_an_empty_sequence():
    with pytest.raises(ValueError, match="empty"):
        nearest_rank([], 50)


@settings(max_examples=60)
@given(
    st.lists(st.floats(min_value=-10, max_value=10), min_size=1, max_size=8, unique=True).map(sorted),
    st.lists(st.floats(min_value=-20, max_value=20), max_size=80),
)
def test_bucket_counts_are_cumulative_counts_of_observations_at_or_below_each_bound(bounds, observations):
    registry = Registry()
    histogram = registry.histogram("h", "help", buckets=bounds)
    for value in observations:
        histogram.observe(value)
    child = registry.snapshot()["h"]["children"][0]
    expected = [sum(1 for v in observations if v <= bound) for bound in bounds] + [len(observations)]
    assert list(child["buckets"].values()) == expected
    assert list(child["buckets"])[-1] == "+Inf"
    assert child["count"] == histogram.count == len(observations)
    assert child["sum"] == pytest.approx(math.fsum(observations), abs=1e-9)


def test_an_observation_equal_to_a_bound_counts_in_that_bound_bucket():
    registry = Registry()
    histogram = registry.histogram("h", "help", buckets=(0.1, 1.0))
    histogram.observe(0.1)
    histogram.observe(1)
    assert registry.snapshot()["h"]["children"][0]["buckets"] == {"0.1": 1, "1.0": 2, "+Inf": 2}


def test_the_window_keeps_only_the_most_recent_observations():
    histogram = Registry().histogram("h", "help", window=10)
    for value in range(100):
        histogram.observe(value)
    summary = histogram.summary()
    assert summary == HistogramSummary(count=10, sum=945.0, mean=94.5, p50=94.0, p95=99.0, p99=99.0, max=99.0)
    assert histogram.percentile(10) == 90.0
    # The buckets and totals still cover every observation.
    assert histogram.count == 100
    assert histogram.sum == sum(range(100))


def test_the_default_window_is_4096_observations():
    histogram = Registry().histogram("h", "help")
    for value in range(5000):
        histogram.observe(value)
    summary = histogram.summary()
    assert summary.count == 4096
    assert histogram.percentile(0.001) == 5000 - 4096


def test_an_empty_histogram_has_no_percentiles():
    histogram = Registry().histogram("h", "help")
    assert histogram.percentile(99) is None
    assert histogram.summary() == HistogramSummary(count=0, sum=0.0, mean=None, p50=None, p95=None, p99=None, max=None)
    with pytest.raises(ValueError, match="percentile"):
        histogram.percentile(0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_histogram_rejects_non_finite_observations(value):
    histogram = Registry().histogram("ttft_seconds", "help")
    with pytest.raises(ValueError, match="ttft_seconds"):
        histogram.observe(value)
    assert histogram.count == 0


@pytest.mark.parametrize(
    ("buckets", "problem"),
    [((), "at least one"), ((1.0, 0.5), "increasing"), ((1.0, 1.0), "increasing"), ((math.nan,), "finite")],
)
def test_invalid_bucket_bounds_are_rejected(buckets, problem):
    with pytest.raises(ValueError, match=problem):
        Registry().histogram("h", "help", buckets=buckets)


def test_a_trailing_infinite_bucket_is_accepted_as_the_implied_one():
    histogram = Registry().histogram("h", "help", buckets=(1.0, math.inf))
    assert histogram.buckets == (1.0,)


def test_the_latency_bucket_sets_are_sglangs():
    assert TTFT_BUCKETS[0] == 0.1 and TTFT_BUCKETS[-1] == 400
    assert ITL_BUCKETS[0] == 0.002 and ITL_BUCKETS[-1] == 8.0
    assert E2E_BUCKETS[0] == 0.1 and E2E_BUCKETS[-1] == 2400
    for buckets in (TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


def test_labels_names_the_missing_and_the_unexpected_label_names():
    family = Registry().counter("requests_total", "help", ["role", "model"])
    with pytest.raises(ValueError, match="requests_total: missing label\\(s\\) model; unexpected label\\(s\\) colour"):
        family.labels(role="miner", colour="red")
    with pytest.raises(ValueError, match="missing label\\(s\\) role, model"):
        family.labels()


def test_labels_returns_the_same_child_for_the_same_values():
    family = Registry().gauge("slots", "help", ["role", "rank"])
    family.labels(role="miner", rank=0).inc()
    family.labels(rank="0", role="miner").inc(2)
    assert family.labels(role="miner", rank="0").value == 3.0


def test_an_unlabelled_family_is_used_directly_and_a_labelled_one_only_through_labels():
    registry = Registry()
    plain = registry.counter("plain_total", "help")
    plain.inc()
    assert plain.value == 1.0
    with pytest.raises(ValueError, match="plain_total has no labels"):
        plain.labels(role="x")
    labelled = registry.histogram("latency_seconds", "help", ["route"])
    with pytest.raises(ValueError, match="latency_seconds has labels \\(route\\)"):
        labelled.observe(1.0)


@pytest.mark.parametrize("name", ["1abc", "a-b", "", "a b", "é"])
def test_invalid_metric_names_are_rejected(name):
    with pytest.raises(ValueError, match="invalid metric name"):
        Registry().gauge(name, "help")


@pytest.mark.parametrize("name", ["sglang:time_to_first_token_seconds", ":x", "_a9", "A:b_c"])
def test_metric_names_may_contain_colons(name):
    assert Registry().gauge(name, "help").name == name


@pytest.mark.parametrize("labelnames", [["a:b"], ["__reserved"], ["9x"], ["a", "a"], "model"])
def test_invalid_label_names_are_rejected(labelnames):
    with pytest.raises(ValueError, match="metric g"):
        Registry().gauge("g", "help", labelnames)


def test_a_histogram_may_not_use_le_as_a_label():
    with pytest.raises(ValueError, match="'le' is reserved"):
        Registry().histogram("h", "help", ["le"])


def test_registering_the_same_metric_twice_returns_the_existing_family():
    registry = Registry()
    first = registry.histogram("itl_seconds", "help", ["model"], buckets=ITL_BUCKETS)
    first.labels(model="m").observe(0.01)
    second = registry.histogram("itl_seconds", "other help", ("model",), buckets=ITL_BUCKETS)
    assert second is first
    assert second.labels(model="m").count == 1
    assert exposition(registry).count("# TYPE itl_seconds") == 1


def test_registering_a_name_again_as_another_type_raises_naming_the_metric():
    registry = Registry()
    registry.counter("jobs_total", "help")
    with pytest.raises(ValueError, match="metric jobs_total is already registered as a counter, not a gauge"):
        registry.gauge("jobs_total", "help")


@pytest.mark.parametrize(
    "again",
    [
        lambda r: r.histogram("h", "help", ["other"]),
        lambda r: r.histogram("h", "help", ["model"], buckets=(1.0, 2.0)),
        lambda r: r.histogram("h", "help", ["model"], window=10),
    ],
)
def test_registering_a_name_again_with_another_definition_raises_naming_the_metric(again):
    registry = Registry()
    registry.histogram("h", "help", ["model"])
    with pytest.raises(ValueError, match="metric h is already registered with a different definition"):
        again(registry)


def test_a_name_colliding_with_another_familys_samples_is_rejected():
    registry = Registry()
    registry.histogram("latency", "help")
    with pytest.raises(ValueError, match="latency_count, which metric latency already does"):
        registry.gauge("latency_count", "help")
    registry.gauge("queue_sum", "help")
    with pytest.raises(ValueError, match="queue_sum"):
        registry.histogram("queue", "help")


@pytest.mark.parametrize("amount", [-1, -0.001, math.nan, math.inf])
def test_a_counter_rejects_negative_or_non_finite_increments(amount):
    counter = Registry().counter("errors_total", "help")
    with pytest.raises(ValueError, match="errors_total"):
        counter.inc(amount)
    assert counter.value == 0.0


def test_a_gauge_can_be_set_raised_and_lowered():
    gauge = Registry().gauge("running_requests", "help")
    gauge.set(5)
    gauge.inc()
    gauge.dec(2.5)
    assert gauge.value == 3.5


def test_prometheus_client_writes_the_registry_in_the_text_exposition_format():
    registry = Registry()
    help_text = "Time to first token.\nIn seconds \\ s."
    ttft = registry.histogram("engy:ttft_seconds", help_text, ["model"], buckets=(0.1, 1))
    ttft.labels(model='q"3\\x\ny').observe(0.05)
    ttft.labels(model='q"3\\x\ny').observe(0.5)
    registry.counter("requests_total", "Requests served.", ["role", "code"]).labels(code=200, role="gw").inc(2)
    registry.gauge("free_bytes", "Free memory.").set(1e20)
    registry.gauge("empty", "No children yet.", ["x"])
    # Labels are written in name order, and a histogram's _count before its _sum: the library's layout.
    assert exposition(registry) == (
        "# HELP engy:ttft_seconds Time to first token.\\nIn seconds \\\\ s.\n"
        "# TYPE engy:ttft_seconds histogram\n"
        'engy:ttft_seconds_bucket{le="0.1",model="q\\"3\\\\x\\ny"} 1.0\n'
        'engy:ttft_seconds_bucket{le="1.0",model="q\\"3\\\\x\\ny"} 2.0\n'
        'engy:ttft_seconds_bucket{le="+Inf",model="q\\"3\\\\x\\ny"} 2.0\n'
        'engy:ttft_seconds_count{model="q\\"3\\\\x\\ny"} 2.0\n'
        'engy:ttft_seconds_sum{model="q\\"3\\\\x\\ny"} 0.55\n'
        "# HELP requests_total Requests served.\n"
        "# TYPE requests_total counter\n"
        'requests_total{code="200",role="gw"} 2.0\n'
        "# HELP free_bytes Free memory.\n"
        "# TYPE free_bytes gauge\n"
        "free_bytes 1e+20\n"
        "# HELP empty No children yet.\n"
        "# TYPE empty gauge\n"
    )


def test_counters_and_histograms_get_no_created_series():
    registry = Registry()
    registry.counter("tokens_total", "help").inc(3)
    registry.histogram("latency_seconds", "help", buckets=(1.0,)).observe(0.5)
    assert "_created" not in exposition(registry)
    assert ("tokens_total", {}, 3.0) in read_back(registry)


@pytest.mark.parametrize("name", ["tokens", "tokens_count", "_total"])
def test_a_counter_name_must_end_in_total_because_that_is_how_it_is_exposed(name):
    with pytest.raises(ValueError, match=f"counter {name}: a counter's name must end in _total"):
        Registry().counter(name, "help")


def test_an_unlabelled_metric_is_exposed_at_zero_before_its_first_update():
    registry = Registry()
    registry.histogram("h", "help", buckets=(1.0,))
    assert read_back(registry) == [
        ("h_bucket", {"le": "1.0"}, 0.0),
        ("h_bucket", {"le": "+Inf"}, 0.0),
        ("h_count", {}, 0.0),
        ("h_sum", {}, 0.0),
    ]


def test_a_histogram_whose_first_bound_is_negative_is_exposed_without_sum_and_count():
    registry = Registry()
    histogram = registry.histogram("delta", "help", buckets=(-1.0, 1.0))
    histogram.observe(-2)
    histogram.observe(0.5)
    assert read_back(registry) == [
        ("delta_bucket", {"le": "-1.0"}, 1.0),
        ("delta_bucket", {"le": "1.0"}, 2.0),
        ("delta_bucket", {"le": "+Inf"}, 2.0),
    ]
    child = registry.snapshot()["delta"]["children"][0]
    assert (child["count"], child["sum"]) == (2, -1.5)


def test_an_empty_registry_is_exposed_as_nothing():
    assert generate_latest(Registry()) == b""


@settings(max_examples=80)
@given(
    name=METRIC_NAMES,
    label_values=st.lists(st.text(), min_size=1, max_size=3),
    value=st.floats(allow_nan=True, allow_infinity=True),
    observations=st.lists(st.floats(min_value=0, max_value=1000), max_size=5),
)
@example(name="sglang:x", label_values=['a"b\\c\nd', "\u2028é\r", ""], value=-0.0, observations=[0.5, 3.0])
def test_prometheus_client_reads_back_every_sample_it_wrote_from_the_registry(name, label_values, value, observations):
    registry = Registry()
    labelnames = [f"l{i}" for i in range(len(label_values))]
    labels = dict(zip(labelnames, label_values))
    registry.gauge(name, "a gauge", labelnames).labels(**labels).set(value)
    histogram = registry.histogram(name + "_h", 'help with "quotes"', labelnames, buckets=(0.5, 10))
    child = histogram.labels(**labels)
    for observation in observations:
        child.observe(observation)

    gauge_sample, *histogram_samples = read_back(registry)

    assert gauge_sample[:2] == (name, labels)
    assert gauge_sample[2] == value or (math.isnan(value) and math.isnan(gauge_sample[2]))
    assert histogram_samples == [
        (f"{name}_h_bucket", labels | {"le": "0.5"}, float(sum(1 for o in observations if o <= 0.5))),
        (f"{name}_h_bucket", labels | {"le": "10.0"}, float(sum(1 for o in observations if o <= 10))),
        (f"{name}_h_bucket", labels | {"le": "+Inf"}, float(len(observations))),
        (f"{name}_h_count", labels, float(len(observations))),
        (f"{name}_h_sum", labels, child.sum),
    ]


def test_snapshot_is_plain_json_with_every_family_and_child():
    registry = Registry()
    registry.counter("requests_total", "Requests.", ["role"]).labels(role="miner").inc(3)
    registry.gauge("running", "Running.").set(2)
    itl = registry.histogram("itl_seconds", "ITL.", ["model"], buckets=(0.01, 0.1))
    for value in (0.005, 0.02, 0.2):
        itl.labels(model="m").observe(value)

    snapshot = json.loads(json.dumps(registry.snapshot(), allow_nan=False))

    assert snapshot == {
        "requests_total": {
            "type": "counter",
            "help": "Requests.",
            "labelnames": ["role"],
            "children": [{"labels": {"role": "miner"}, "value": 3.0}],
        },
        "running": {"type": "gauge", "help": "Running.", "labelnames": [], "children": [{"labels": {}, "value": 2.0}]},
        "itl_seconds": {
            "type": "histogram",
            "help": "ITL.",
            "labelnames": ["model"],
            "children": [
                {
                    "labels": {"model": "m"},
                    "count": 3,
                    "sum": pytest.approx(0.225),
                    "buckets": {"0.01": 1, "0.1": 2, "+Inf": 3},
                    "window": {
                        "count": 3,
                        "sum": pytest.approx(0.225),
                        "mean": pytest.approx(0.075),
                        "p50": 0.02,
                        "p95": 0.2,
                        "p99": 0.2,
                        "max": 0.2,
                    },
                }
            ],
        },
    }


def test_four_threads_updating_one_histogram_lose_no_observations():
    # Switch threads far more often than the default 5 ms, to interleave the updates.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    registry = Registry()
    histogram = registry.histogram("latency_seconds", "help", ["worker"], buckets=(1.0, 2.0), window=100_000)
    shared = histogram.labels(worker="shared")
    per_thread = 12_000  # a multiple of 6, so each value is observed equally often
    start = threading.Barrier(4)

    def work(index):
        mine = histogram.labels(worker=str(index))
        start.wait()
        for i in range(per_thread):
            # Halves sum exactly in floating point, so the totals can be compared with ==.
            value = (i % 6) * 0.5
            shared.observe(value)
            mine.observe(value)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)

    one_thread_sum = sum((i % 6) * 0.5 for i in range(per_thread))
    assert shared.count == 4 * per_thread
    assert shared.sum == 4 * one_thread_sum
    assert shared.summary().count == 4 * per_thread
    children = registry.snapshot()["latency_seconds"]["children"]
    (shared_snapshot,) = [child for child in children if child["labels"] == {"worker": "shared"}]
    buckets = shared_snapshot["buckets"]
    # Values 0, 0.5, 1.0 are <= 1.0; 1.5, 2.0 are <= 2.0; 2.5 only in +Inf.
    assert buckets == {"1.0": 4 * per_thread // 2, "2.0": 4 * per_thread * 5 // 6, "+Inf": 4 * per_thread}
    for index in range(4):
        assert histogram.labels(worker=str(index)).count == per_thread
