"""Reading a model server's state: bucket quantile estimates, sglang's exposition as
prometheus_client parses it, sglang's own answers, and real polls.

The quantile estimate is checked two ways: against an independent brute-force inversion of the
piecewise-linear distribution the estimate assumes, and against the exact nearest-rank value
of the raw observations, which it must bracket within one bucket. Fake sglang answers go
through httpx's in-memory transport; the reference server is the real `engy-node serve`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import socket

import httpx
import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from engy_node.percentile import nearest_rank
from engy_node.serve.status import (
    LatencySummary,
    bucket_quantile,
    exposition_samples,
    fetch_status,
    histogram_quantiles,
)
from tests.waiting import wait_until_async

INF = math.inf
QUANTILES = (0.5, 0.95, 0.99)


# ---- bucket_quantile: worked examples -----------------------------------------------------------


def test_quantile_interpolates_linearly_inside_the_bucket_that_holds_the_rank():
    buckets = [(0.1, 2), (0.2, 6), (0.4, 10), (INF, 10)]
    # rank 5 of 10 is the 3rd of the 4 observations in (0.1, 0.2]: 0.1 + 0.1 * 3/4.
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.175)
    # rank 9.9 is 3.9 of 4 into (0.2, 0.4].
    assert bucket_quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * 3.9 / 4)


def test_first_bucket_interpolates_up_from_zero():
    assert bucket_quantile(0.5, [(2.0, 4), (INF, 4)]) == pytest.approx(1.0)


def test_rank_in_the_inf_bucket_answers_the_highest_finite_bound():
    assert bucket_quantile(0.5, [(1.0, 1), (4.0, 2), (INF, 10)]) == 4.0


def test_bucket_order_does_not_matter():
    buckets = [(0.1, 2), (0.2, 6), (0.4, 10), (INF, 10)]
    assert bucket_quantile(0.95, list(reversed(buckets))) == bucket_quantile(0.95, buckets)


def test_decreasing_cumulative_counts_are_raised_to_the_running_maximum():
    assert bucket_quantile(0.5, [(1.0, 4), (2.0, 3), (INF, 4)]) == bucket_quantile(0.5, [(1.0, 4), (2.0, 4), (INF, 4)])


@pytest.mark.parametrize(
    "buckets",
    [[], [(INF, 5)], [(1.0, 3), (2.0, 5)], [(1.0, 0), (INF, 0)]],
    ids=["no buckets", "only +Inf", "no +Inf bucket", "no observations"],
)
def test_no_estimate_without_finite_and_inf_buckets_and_observations(buckets):
    assert bucket_quantile(0.5, buckets) is None


@pytest.mark.parametrize("q", [0, -0.1, 1.5, math.nan])
def test_quantile_outside_zero_to_one_is_rejected(q):
    with pytest.raises(ValueError, match="quantile must be in"):
        bucket_quantile(q, [(1.0, 1), (INF, 1)])


# ---- bucket_quantile: properties ----------------------------------------------------------------


def brute_force_quantile(q: float, bounds: list[float], per_bucket: list[int]) -> float:
    """Invert the piecewise-linear CDF through (0, 0) and (bound_i, cumulative_i) by bisection.

    `per_bucket` has one count per finite bound plus a last one for +Inf. This is the
    distribution the estimate assumes, inverted numerically rather than bucket by bucket.
    """
    xs = [0.0, *bounds]
    ys = [0, *itertools.accumulate(per_bucket[:-1])]
    rank = q * sum(per_bucket)
    if rank > ys[-1]:
        return bounds[-1]

    def cdf(x: float) -> float:
        i = max(1, bisect.bisect_left(xs, x))
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    low, high = 0.0, bounds[-1]
    for _ in range(200):
        middle = (low + high) / 2
        if cdf(middle) >= rank:
            high = middle
        else:
            low = middle
    return high


sorted_bounds = st.lists(st.floats(min_value=1e-4, max_value=1e4), min_size=1, max_size=12, unique=True).map(sorted)


@given(
    bounds=sorted_bounds,
    counts=st.lists(st.integers(min_value=0, max_value=50), min_size=13, max_size=13),
    q=st.floats(min_value=1e-6, max_value=1.0),
)
def test_estimate_matches_a_brute_force_inversion_of_the_assumed_distribution(bounds, counts, q):
    per_bucket = counts[: len(bounds) + 1]
    if sum(per_bucket) == 0:
        per_bucket[0] = 1
    cumulative = list(itertools.accumulate(per_bucket))
    buckets = [*zip(bounds, cumulative[:-1]), (INF, cumulative[-1])]
    expected = brute_force_quantile(q, bounds, per_bucket)
    assert bucket_quantile(q, buckets) == pytest.approx(expected, rel=1e-9, abs=1e-9 * bounds[-1])


@given(
    bounds=sorted_bounds,
    observations=st.lists(st.floats(min_value=0, max_value=2e4), min_size=1, max_size=200),
    q=st.sampled_from(QUANTILES),
)
@example(bounds=[1.1683227250755408, 4097.424541440011], observations=[2.0, 4098.0], q=0.5)
def test_estimate_lies_in_the_bucket_of_the_exact_nearest_rank_value(bounds, observations, q):
    per_bucket = [0] * (len(bounds) + 1)
    for value in observations:
        per_bucket[bisect.bisect_left(bounds, value)] += 1  # buckets are "less than or equal"
    cumulative = list(itertools.accumulate(per_bucket))
    estimate = bucket_quantile(q, [*zip(bounds, cumulative[:-1]), (INF, cumulative[-1])])

    exact = nearest_rank(sorted(observations), q * 100)
    slot = bisect.bisect_left(bounds, exact)
    if slot == len(bounds):
        assert estimate == bounds[-1]  # beyond the last finite bound nothing better is known
    else:
        lower = bounds[slot - 1] if slot else 0.0
        assert lower <= estimate <= bounds[slot]


# ---- exposition_samples: what prometheus_client's parser makes of real expositions --------------

# A slice of sglang's /metrics with the other series a prometheus_client process exports: a NaN
# gauge, a gauge without HELP, the library's own gc counter, an untyped line.
SGLANG_EXPOSITION = """\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.1",model_name="Qwen3.6"} 4.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="+Inf",model_name="Qwen3.6"} 5.0
sglang:time_to_first_token_seconds_sum{engine_type="unified",is_streaming="true",model_name="Qwen3.6"} 0.61
sglang:time_to_first_token_seconds_count{engine_type="unified",is_streaming="true",model_name="Qwen3.6"} 5.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen3.6"} NaN
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 5346.0
process_start_time_seconds 1.71e+09
"""


def fields(samples):
    return [(sample.name, sample.labels, sample.value, sample.timestamp) for sample in samples]


def test_samples_of_a_realistic_sglang_exposition_come_back_in_order():
    samples = exposition_samples(SGLANG_EXPOSITION)
    assert [s.name for s in samples] == [
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:time_to_first_token_seconds_sum",
        "sglang:time_to_first_token_seconds_count",
        "sglang:num_running_reqs",
        "sglang:cache_hit_rate",
        "python_gc_objects_collected_total",
        "process_start_time_seconds",
    ]
    assert fields(samples[:1]) == [
        (
            "sglang:time_to_first_token_seconds_bucket",
            {"engine_type": "unified", "is_streaming": "true", "le": "0.1", "model_name": "Qwen3.6"},
            4.0,
            None,
        )
    ]
    assert samples[1].labels["le"] == "+Inf" and samples[1].value == 5.0
    assert samples[2].value == 0.61
    assert samples[4].labels == {
        "engine_type": "unified",
        "model_name": "Qwen3.6",
        "moe_ep_rank": "0",
        "pp_rank": "0",
        "tp_rank": "0",
    }
    assert samples[4].value == 2.0
    assert math.isnan(samples[5].value)
    assert fields(samples[7:]) == [("process_start_time_seconds", {}, 1.71e9, None)]


def test_samples_keep_special_values_timestamps_escapes_and_loose_spacing():
    text = (
        "# a plain comment\n"
        "\n"
        "up 1 1700000000000\n"
        "down -Inf\n"
        "big +Inf -5\n"
        'esc{a="x\\\\y\\"z\\nw",b="\u2028é"} 1.5e-3\r\n'
        'spaced { a = "1" , b="2", } \t 7\t \n'
        "bare{} 3"
    )
    # Timestamps are written in milliseconds and read back in seconds.
    assert fields(exposition_samples(text)) == [
        ("up", {}, 1.0, 1700000000.0),
        ("down", {}, -math.inf, None),
        ("big", {}, math.inf, -0.005),
        ("esc", {"a": 'x\\y"z\nw', "b": "\u2028é"}, 0.0015, None),
        ("spaced", {"a": "1", "b": "2"}, 7.0, None),
        ("bare", {}, 3.0, None),
    ]


@pytest.mark.parametrize(
    ("line", "sample"),
    [
        ("metric 1 2 3", ("metric", {}, 1.0, 0.003)),  # extra fields: the last is the timestamp
        ('metric{a="\\t"} 2', ("metric", {"a": "\\t"}, 2.0, None)),  # an unknown escape is kept as written
        ('metric{a:b="1"} 2', ("metric", {"a:b": "1"}, 2.0, None)),
        ('metric{a="1"}2', ("metric", {"a": "1"}, 2.0, None)),
    ],
)
def test_odd_but_readable_sample_lines_are_accepted(line, sample):
    assert fields(exposition_samples(line + "\n")) == [sample]


def test_a_counter_typed_without_total_is_read_under_the_suffixed_name():
    # Every Prometheus client writes the suffix itself; the parser supplies it when a writer did not.
    assert [s.name for s in exposition_samples("# TYPE jobs counter\njobs 3\n")] == ["jobs_total"]


@pytest.mark.parametrize(
    "bad_line",
    [
        "metric",
        'metric{a="1"}',
        "metric abc",
        "metric 1_000",
        "metric 1.5x",
        "metric+1",
        "9metric 1",
        'metric{a="1" 2',
        'metric{a="1} 2',
        "metric{a=1} 2",
        'metric{a="1",a="2"} 2',
        "# TYPE 9metric gauge",
    ],
)
def test_a_malformed_line_is_reported_with_its_number_and_text(bad_line):
    text = "# TYPE ok gauge\nok 1\n\n" + bad_line + "\r\nok 2\n"
    with pytest.raises(ValueError, match="^line 4: " + re.escape(repr(bad_line))):
        exposition_samples(text)


# ---- histogram_quantiles over a realistic sglang exposition -------------------------------------

# The shape of sglang 0.5.23's /metrics: colon names, tokenizer-side histograms and counters split
# by is_streaming, scheduler gauges per rank (two tensor-parallel ranks reporting the same batch,
# on two data-parallel replicas).
SGLANG_METRICS = """\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.1",model_name="Qwen3.6"} 4.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.2",model_name="Qwen3.6"} 8.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.4",model_name="Qwen3.6"} 10.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="+Inf",model_name="Qwen3.6"} 10.0
sglang:time_to_first_token_seconds_sum{engine_type="unified",is_streaming="true",model_name="Qwen3.6"} 1.5
sglang:time_to_first_token_seconds_count{engine_type="unified",is_streaming="true",model_name="Qwen3.6"} 10.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="false",le="0.1",model_name="Qwen3.6"} 0.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="false",le="0.2",model_name="Qwen3.6"} 0.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="false",le="0.4",model_name="Qwen3.6"} 8.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="false",le="+Inf",model_name="Qwen3.6"} 10.0
sglang:time_to_first_token_seconds_sum{engine_type="unified",is_streaming="false",model_name="Qwen3.6"} 4.5
sglang:time_to_first_token_seconds_count{engine_type="unified",is_streaming="false",model_name="Qwen3.6"} 10.0
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.002",model_name="Qwen3.6"} 0.0
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.004",model_name="Qwen3.6"} 0.0
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.006",model_name="Qwen3.6"} 0.0
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.008",model_name="Qwen3.6"} 0.0
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.01",model_name="Qwen3.6"} 50.0
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="0.015",model_name="Qwen3.6"} 100.0
sglang:inter_token_latency_seconds_bucket{engine_type="unified",le="+Inf",model_name="Qwen3.6"} 100.0
sglang:inter_token_latency_seconds_sum{engine_type="unified",model_name="Qwen3.6"} 1.0
sglang:inter_token_latency_seconds_count{engine_type="unified",model_name="Qwen3.6"} 100.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 2.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 1.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="Qwen3.6",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 0.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{engine_type="unified",is_streaming="true",model_name="Qwen3.6"} 900.0
sglang:generation_tokens_total{engine_type="unified",is_streaming="false",model_name="Qwen3.6"} 100.0
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{engine_type="unified",is_streaming="true",model_name="Qwen3.6"} 10.0
sglang:num_requests_total{engine_type="unified",is_streaming="false",model_name="Qwen3.6"} 10.0
# HELP sglang:num_aborted_requests_total Number of requests aborted.
# TYPE sglang:num_aborted_requests_total counter
sglang:num_aborted_requests_total{engine_type="unified",model_name="Qwen3.6"} 1.0
"""


def test_histogram_quantiles_sum_every_label_set_of_a_sglang_histogram():
    ttft = histogram_quantiles(exposition_samples(SGLANG_METRICS), "sglang:time_to_first_token_seconds")
    # Summed: 4 at <= 0.1, 8 at <= 0.2, 18 at <= 0.4, 20 in all.
    assert ttft is not None
    assert ttft.count == 20
    assert ttft.mean_s == pytest.approx(6.0 / 20)
    assert ttft.p50_s == pytest.approx(0.2 + 0.2 * (10 - 8) / 10)
    assert ttft.p95_s == 0.4  # rank 19 of 20 lies beyond the last finite bound
    assert ttft.p99_s == 0.4


def test_histogram_quantiles_of_an_itl_histogram():
    itl = histogram_quantiles(exposition_samples(SGLANG_METRICS), "sglang:inter_token_latency_seconds")
    assert itl == LatencySummary(
        count=100,
        mean_s=pytest.approx(0.01),
        p50_s=pytest.approx(0.01),
        p95_s=pytest.approx(0.01 + 0.005 * 45 / 50),
        p99_s=pytest.approx(0.01 + 0.005 * 49 / 50),
    )


def test_histogram_quantiles_is_none_for_an_absent_metric():
    assert histogram_quantiles(exposition_samples(SGLANG_METRICS), "sglang:e2e_request_latency_seconds") is None


# ---- fetch_status against fake sglang answers (in-memory transport) ----------------------------

SGLANG_MODEL_INFO = {
    "model_path": "/data/models/Qwen/Qwen3.6-35B-A3B-FP8",
    "served_model_name": "Qwen3.6",
    "tokenizer_path": "/data/models/Qwen/Qwen3.6-35B-A3B-FP8",
    "is_generation": True,
    "model_type": "qwen3_5_moe",
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
}
SGLANG_SERVER_INFO = {
    "model_path": "/data/models/Qwen/Qwen3.6-35B-A3B-FP8",
    "served_model_name": "Qwen3.6",
    "tp_size": 2,
    "dp_size": 2,
    "device": "cuda",
    "dtype": "auto",
    "max_running_requests": 48,
    "context_length": 262144,
    "status": "ready",
    "internal_states": [
        {"last_gen_throughput": 410.5, "memory_usage": {}},
        {"last_gen_throughput": 389.5, "memory_usage": {}},
    ],
    "version": "0.5.23",
}


def fake_sglang(*, health: int = 200, metrics: str | None = SGLANG_METRICS) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        match request.url.path:
            case "/health":
                return httpx.Response(health)
            case "/model_info":
                return httpx.Response(200, json=SGLANG_MODEL_INFO)
            case "/server_info":
                return httpx.Response(200, json=SGLANG_SERVER_INFO)
            case "/metrics" if metrics is not None:
                return httpx.Response(200, text=metrics)
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


async def test_real_sglang_answers_fill_the_status_without_the_engy_object():
    async with httpx.AsyncClient(transport=fake_sglang()) as client:
        status = await fetch_status(client, "http://gpu-box:30000/")
    assert status.url == "http://gpu-box:30000"
    assert (status.reachable, status.healthy, status.error) == (True, True, None)
    assert status.model_id is None and status.model_root is None
    assert status.served_model_name == "Qwen3.6"
    assert status.model_path == "/data/models/Qwen/Qwen3.6-35B-A3B-FP8"
    assert (status.device, status.dtype, status.max_running_requests) == ("cuda", "auto", 48)
    # Tensor-parallel ranks report the same batch (counted once); data-parallel replicas add up.
    assert (status.running, status.queued) == (5, 1)
    assert status.gen_throughput == pytest.approx(800.0)
    assert (status.requests_total, status.aborted_total, status.generation_tokens_total) == (20, 1, 1000)
    assert status.ttft is not None and status.ttft.count == 20
    assert status.itl is not None and status.itl.count == 100


async def test_legacy_time_per_output_token_histogram_stands_in_for_itl():
    legacy = SGLANG_METRICS.replace("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")
    async with httpx.AsyncClient(transport=fake_sglang(metrics=legacy)) as client:
        status = await fetch_status(client, "http://gpu-box:30000")
    assert status.itl is not None and status.itl.count == 100


async def test_sglang_without_metrics_is_healthy_and_the_error_names_the_flag():
    async with httpx.AsyncClient(transport=fake_sglang(metrics=None)) as client:
        status = await fetch_status(client, "http://gpu-box:30000")
    assert status.reachable and status.healthy
    assert "--enable-metrics" in status.error
    assert status.served_model_name == "Qwen3.6" and status.ttft is None and status.requests_total is None


async def test_a_starting_server_is_reachable_but_not_healthy():
    async with httpx.AsyncClient(transport=fake_sglang(health=503)) as client:
        status = await fetch_status(client, "http://gpu-box:30000")
    assert status.reachable and not status.healthy
    assert "GET /health: HTTP 503" in status.error


async def test_an_unreadable_exposition_is_reported_and_the_rest_still_shown():
    async with httpx.AsyncClient(transport=fake_sglang(metrics="sglang:num_running_reqs two\n")) as client:
        status = await fetch_status(client, "http://gpu-box:30000")
    assert status.healthy and status.served_model_name == "Qwen3.6"
    assert "GET /metrics: unreadable exposition: line 1" in status.error


async def test_a_server_that_never_answers_is_unreachable_after_the_timeout(autojump_clock):
    async def hang(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()

    started = trio.current_time()
    async with httpx.AsyncClient(transport=httpx.MockTransport(hang)) as client:
        status = await fetch_status(client, "http://gpu-box:30000", timeout_s=5.0)
    assert trio.current_time() - started == pytest.approx(5.0)
    assert not status.reachable and not status.healthy
    assert status.error == "cannot reach http://gpu-box:30000: GET /health: no answer within 5 s"


# ---- fetch_status against real servers ---------------------------------------------------------


async def test_reference_server_status_after_one_generation(reference_server):
    async with httpx.AsyncClient(base_url=reference_server.url, timeout=120) as client:
        response = await client.post(
            "/generate",
            json={"input_ids": [1, 504, 3575], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
        )
        response.raise_for_status()
        # The engine counts a request as finished in the step after its answer is handed over,
        # so the request counter may lag the response briefly; the server is another process and
        # its counters are the only view of that, so the wait is a bounded poll.
        statuses = []

        async def counted() -> bool:
            statuses.append(await fetch_status(client, reference_server.url))
            return statuses[-1].requests_total != 0

        await wait_until_async(counted, timeout_s=10, what="the request counted in the server's status")
        status = statuses[-1]

    assert (status.reachable, status.healthy, status.error) == (True, True, None)
    assert status.model_id == "smollm2-135m"
    assert (status.device, status.dtype) == ("cpu", "bfloat16")
    assert status.model_root is not None and len(status.model_root) == 64
    assert status.max_running_requests == 4
    assert status.running is not None and status.queued is not None
    assert status.gen_throughput is not None and status.gen_throughput > 0
    # The session's server is shared with other tests, so totals are at least this request's.
    assert status.requests_total >= 1 and status.generation_tokens_total >= 4
    assert status.aborted_total is not None
    assert status.ttft is not None and status.ttft.count >= 1
    assert status.itl is not None and status.itl.count >= 3
    for summary in (status.ttft, status.itl):
        assert 0 < summary.p50_s <= summary.p95_s <= summary.p99_s


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_a_closed_port_is_unreachable_with_a_clear_error():
    url = f"http://127.0.0.1:{closed_port()}"
    async with httpx.AsyncClient() as client:
        status = await fetch_status(client, url, timeout_s=2.0)
    assert not status.reachable and not status.healthy
    assert status.error.startswith(f"cannot reach {url}: GET /health: ConnectError")
    assert status.model_id is None and status.ttft is None
