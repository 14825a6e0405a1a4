"""What a model server is doing right now, read over sglang's native HTTP API: one snapshot per poll.

`fetch_status()` asks four endpoints (`/health`, `/model_info`, `/server_info`, `/metrics`) at
once and folds the answers into a frozen `ServerStatus`. It is the one reader the TUI, and later
the miner's supervisor, use to tell "down" from "starting" from "serving", for our reference
server and for real sglang alike.

Trust and failure posture:

* The server is a peer we do not control, so nothing it sends can make this module raise. A
  network error, a timeout, an HTTP error status, a body that is not JSON or an exposition that
  does not parse becomes a short line in `ServerStatus.error` naming the endpoint and what went
  wrong, and the fields that endpoint would have filled stay None. A half-answered poll is
  still worth showing: a server whose `/metrics` is off (sglang without `--enable-metrics`) is
  healthy, just less visible.
* `reachable` means at least one endpoint answered with an HTTP response, whatever its status;
  `healthy` means `/health` answered 200. sglang answers `/health` 503 while it warms up and
  while it shuts down, so "reachable but not healthy" is a normal state; `error` then says
  which status `/health` gave.
* Real sglang's `/model_info` has no `engy` object (model id, model_root, device, dtype are
  ours); those fields then come from `/server_info`'s server args where sglang has them, or stay
  None.
* The whole poll runs under one deadline (`timeout_s`): the four requests run concurrently and
  whichever has not answered when it passes is reported as "no answer within N s".

Latency percentiles come from the cumulative histogram buckets on `/metrics`, so they are
estimates over the server's lifetime, not exact values over a recent window; see
`bucket_quantile()` for how they are estimated and how far they can be off.

The exposition is read by `prometheus_client`'s parser, the library sglang writes it with. That
parser is lenient (a lax reader, by its own description), which suits a peer we do not control;
`exposition_samples()` only flattens its families and names the line when it does give up.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.parser import text_fd_to_metric_families
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    import httpx

__all__ = [
    "LatencySummary",
    "ServerStatus",
    "bucket_quantile",
    "exposition_samples",
    "fetch_status",
    "histogram_quantiles",
]

TTFT_METRIC = "sglang:time_to_first_token_seconds"
ITL_METRIC = "sglang:inter_token_latency_seconds"
# sglang <= 0.4 exported inter-token latency under this name; a server that still does is read
# through it rather than shown as having no ITL.
LEGACY_ITL_METRIC = "sglang:time_per_output_token_seconds"

# Scheduler gauges carry one series per parallel rank. Every tensor/pipeline/expert-parallel rank
# of one replica runs the same batch and reports the same numbers, so only rank 0 counts; data
# parallel replicas (dp_rank) hold different requests and add up.
_RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank")

_ENDPOINTS = ("/health", "/model_info", "/server_info", "/metrics")


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """A latency histogram's lifetime count, mean and estimated percentiles, in seconds.

    The mean is exact (`_sum / _count`); the percentiles are bucket estimates (`bucket_quantile`).
    """

    count: int
    mean_s: float
    p50_s: float
    p95_s: float
    p99_s: float


@dataclasses.dataclass(frozen=True)
class ServerStatus:
    """One poll of a model server. Fields are None when the server did not tell us."""

    url: str
    reachable: bool
    """At least one endpoint answered with an HTTP response."""
    healthy: bool
    """`/health` answered 200."""
    error: str | None = None
    """What went wrong during the poll, one clause per endpoint, or None when nothing did."""
    model_id: str | None = None
    """Our catalog id (the reference server's `engy.model_id`); real sglang has none."""
    served_model_name: str | None = None
    model_path: str | None = None
    model_root: str | None = None
    device: str | None = None
    dtype: str | None = None
    running: int | None = None
    queued: int | None = None
    max_running_requests: int | None = None
    gen_throughput: float | None = None
    """Generated tokens per second, as the server measures it."""
    requests_total: int | None = None
    aborted_total: int | None = None
    generation_tokens_total: int | None = None
    ttft: LatencySummary | None = None
    itl: LatencySummary | None = None


# ---- histogram estimation (pure) ---------------------------------------------------------------


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Estimate the q-quantile (0 < q <= 1) from cumulative buckets, as PromQL's histogram_quantile.

    `buckets` are (upper bound `le`, cumulative count) pairs in any order and must include the
    +Inf bucket. The estimate assumes observations are spread evenly inside each bucket:

    * rank = q * total; the answer lies in the first bucket whose cumulative count reaches rank;
    * inside it, interpolate linearly between the bucket's lower bound (the previous bound, or 0
      for the first bucket) and its upper bound, by how far rank is into the bucket's count;
    * if rank falls in the +Inf bucket, the answer is the highest finite bound: nothing better is
      known, and the estimate is then a lower bound on the true value;
    * a first bucket with an upper bound <= 0 answers that bound (no interpolation below 0).

    The error is at most the width of the bucket the true value lies in (sglang's latency
    buckets are roughly logarithmic, so that can be half the value or more); counts that
    decrease with the bound, which summing series scraped at slightly different moments can
    produce, are raised to the running maximum first, as Prometheus does. Returns None when
    there is no +Inf bucket, no finite bucket, or no observation.
    """
    if not (0 < q <= 1):  # written so that NaN is rejected too
        raise ValueError(f"quantile must be in (0, 1], got {q!r}")
    prepared = _prepare(buckets)
    return None if prepared is None else _quantile(q, *prepared)


def _prepare(buckets: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]] | None:
    """Sorted bounds and monotonic cumulative counts, or None when no quantile can be estimated."""
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    bounds = [bound for bound, _ in ordered]
    counts: list[float] = []
    for _, count in ordered:
        counts.append(max(count, counts[-1]) if counts else count)
    return (bounds, counts) if counts[-1] > 0 else None


def _quantile(q: float, bounds: list[float], counts: list[float]) -> float:
    """`bucket_quantile` over `_prepare`d buckets."""
    rank = q * counts[-1]
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if index == len(bounds) - 1:
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    lower = bounds[index - 1] if index > 0 else 0.0
    below = counts[index - 1] if index > 0 else 0.0
    interpolated = lower + (bounds[index] - lower) * (rank - below) / (counts[index] - below)
    return min(interpolated, bounds[index])  # rounding may overshoot the bound by one ulp


def histogram_quantiles(samples: Iterable[Sample], metric_name: str) -> LatencySummary | None:
    """Count, mean, p50, p95 and p99 of histogram `metric_name`, all its label sets summed.

    Summing children gives the server-wide distribution (sglang splits TTFT by `is_streaming`,
    for instance). The percentiles are `bucket_quantile` estimates. Returns None when the
    metric is absent or has no observations yet.
    """
    by_bound: dict[float, float] = {}
    total_sum = 0.0
    total_count = 0.0
    bucket_name, sum_name, count_name = f"{metric_name}_bucket", f"{metric_name}_sum", f"{metric_name}_count"
    for sample in samples:
        if sample.name == bucket_name:
            try:
                bound = float(sample.labels.get("le", ""))
            except ValueError:
                bound = math.nan
            if math.isnan(bound):
                continue  # a bucket without a usable bound cannot be placed; the others still can
            by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
        elif sample.name == sum_name:
            total_sum += sample.value
        elif sample.name == count_name:
            total_count += sample.value
    prepared = _prepare(list(by_bound.items()))
    if prepared is None:
        return None
    # _count equals the +Inf bucket by definition; the bucket stands in when _count is missing.
    count = total_count or prepared[1][-1]
    return LatencySummary(
        count=int(count),
        mean_s=total_sum / count,
        p50_s=_quantile(0.5, *prepared),
        p95_s=_quantile(0.95, *prepared),
        p99_s=_quantile(0.99, *prepared),
    )


# ---- reading the endpoints' bodies (pure) ------------------------------------------------------


class _NumberedLines(io.StringIO):
    """Text handed to the parser line by line, remembering which line it read last: the parser
    consumes one line at a time and fails on the line it is reading, and its own errors carry
    no line number (some carry no text at all)."""

    def __init__(self, text: str) -> None:
        # newline="\n": split only where the format does, not at U+2028 inside a label value.
        super().__init__(text, newline="\n")
        self.number = 0
        self.line = ""

    # typeshed's StringIO has two bases that disagree on __next__ (_IOBase's says bytes).
    def __next__(self) -> str:  # type: ignore[override]
        self.line = super().__next__()
        self.number += 1
        return self.line


def exposition_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order, as `prometheus_client` parses it.

    Values are ints or floats as written; `timestamp` is in seconds, or None. Sample lines are
    read leniently (loose spacing, extra fields, unknown escapes kept as written). `# HELP` and
    `# TYPE` lines group samples into families, so a malformed one is an error, and the samples
    of a counter whose `# TYPE` name lacks `_total` come back with it appended (every Prometheus
    client, sglang's included, writes the suffix itself). What the parser refuses raises
    ValueError naming the line it was reading: "line 4: 'metric{a=1} 2' (Invalid labels: a=1)".
    """
    lines = _NumberedLines(text)
    try:
        return [sample for family in text_fd_to_metric_families(lines) for sample in family.samples]
    except ValueError as err:
        line = lines.line.rstrip("\r\n")
        detail = f" ({err})" if str(err) else ""
        raise ValueError(f"line {lines.number}: {line!r}{detail}") from None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _number(value: Any) -> float | None:
    # bool is an int subclass; a JSON true is not a count.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _primary_rank(labels: dict[str, str]) -> bool:
    return all(labels.get(name, "0") == "0" for name in _RANK_LABELS)


def _total(samples: Sequence[Sample], name: str, *, primary_ranks_only: bool = False) -> float | None:
    values = [s.value for s in samples if s.name == name and (not primary_ranks_only or _primary_rank(s.labels))]
    return math.fsum(values) if values else None


def _internal_state_total(server_info: dict[str, Any], key: str) -> float | None:
    """Sum of `key` over `/server_info`'s internal_states (one entry per data-parallel rank)."""
    states = server_info.get("internal_states")
    if not isinstance(states, list):
        return None
    values = [_number(state.get(key)) for state in states if isinstance(state, dict)]
    present = [v for v in values if v is not None]
    return math.fsum(present) if present else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _status_from(
    url: str,
    *,
    healthy: bool,
    model_info: dict[str, Any],
    server_info: dict[str, Any],
    samples: Sequence[Sample],
    error: str | None,
) -> ServerStatus:
    """The status of a server that answered at least one endpoint."""
    raw_engy = model_info.get("engy")
    engy = raw_engy if isinstance(raw_engy, dict) else {}
    return ServerStatus(
        url=url,
        reachable=True,
        healthy=healthy,
        error=error,
        model_id=_str(engy.get("model_id")),
        served_model_name=_first(_str(model_info.get("served_model_name")), _str(server_info.get("served_model_name"))),
        model_path=_first(_str(model_info.get("model_path")), _str(server_info.get("model_path"))),
        model_root=_first(_str(engy.get("model_root")), _str(server_info.get("model_root"))),
        device=_first(_str(engy.get("device")), _str(server_info.get("device"))),
        dtype=_first(_str(engy.get("dtype")), _str(server_info.get("dtype"))),
        # /server_info's internal_states is read live; sglang's gauges only move every few dozen
        # decode steps, so they are the fallback (real sglang's internal_states lacks these keys).
        running=_int(
            _first(
                _internal_state_total(server_info, "num_running_reqs"),
                _total(samples, "sglang:num_running_reqs", primary_ranks_only=True),
            )
        ),
        queued=_int(
            _first(
                _internal_state_total(server_info, "num_queue_reqs"),
                _total(samples, "sglang:num_queue_reqs", primary_ranks_only=True),
            )
        ),
        max_running_requests=_int(server_info.get("max_running_requests")),
        gen_throughput=_first(
            _internal_state_total(server_info, "last_gen_throughput"),
            _total(samples, "sglang:gen_throughput", primary_ranks_only=True),
        ),
        requests_total=_int(_total(samples, "sglang:num_requests_total")),
        aborted_total=_int(_total(samples, "sglang:num_aborted_requests_total")),
        generation_tokens_total=_int(_total(samples, "sglang:generation_tokens_total")),
        ttft=histogram_quantiles(samples, TTFT_METRIC),
        itl=histogram_quantiles(samples, ITL_METRIC) or histogram_quantiles(samples, LEGACY_ITL_METRIC),
    )


def _json_object(path: str, response: httpx.Response, problems: list[str]) -> dict[str, Any]:
    if response.status_code != 200:
        problems.append(f"GET {path}: HTTP {response.status_code}")
        return {}
    try:
        body = response.json()
    except ValueError:
        problems.append(f"GET {path}: answer is not JSON")
        return {}
    if not isinstance(body, dict):
        problems.append(f"GET {path}: answer is not a JSON object")
        return {}
    return body


def _metric_samples(response: httpx.Response, problems: list[str]) -> list[Sample]:
    if response.status_code == 404:
        problems.append("GET /metrics: HTTP 404 (sglang serves it only with --enable-metrics)")
        return []
    if response.status_code != 200:
        problems.append(f"GET /metrics: HTTP {response.status_code}")
        return []
    try:
        return exposition_samples(response.text)
    except ValueError as err:
        problems.append(f"GET /metrics: unreadable exposition: {err}")
        return []


def _describe(err: Exception) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ---- IO --------------------------------------------------------------------------------------


async def fetch_status(client: httpx.AsyncClient, base_url: str, *, timeout_s: float = 5.0) -> ServerStatus:
    """Poll the model server at `base_url` once and return what it said.

    Resources: four concurrent GETs on `client`; nothing outlives the call.
    Errors: none for anything the server or the network does; they land in `.error`
    (see the module docstring). Only a bug here, or cancellation, raises.
    Cancellation: nothing is kept; cancelling simply abandons the poll.
    Timing: returns within about `timeout_s` seconds, answered or not.
    """
    # Imported here: with rich installed (textual brings it), `import httpx` loads rich through
    # httpx's CLI module, and the headless core must not load rich at import time.
    import httpx

    url = base_url.rstrip("/")
    answers: dict[str, httpx.Response | str] = {}

    async def get(path: str) -> None:
        try:
            answers[path] = await client.get(url + path, timeout=timeout_s)
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            answers[path] = _describe(err)

    # httpx's own timeout bounds each phase (connect, read, ...) separately; this scope bounds
    # the poll as a whole, so a server trickling bytes cannot stretch it.
    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for path in _ENDPOINTS:
                nursery.start_soon(get, path)

    problems: list[str] = []
    for path in _ENDPOINTS:
        answer = answers.get(path, f"no answer within {timeout_s:g} s")
        if isinstance(answer, str):
            problems.append(f"GET {path}: {answer}")
    reachable = any(isinstance(answer, httpx.Response) for answer in answers.values())
    if not reachable:
        # Every endpoint failed the same way; the first says it without repeating it four times.
        return ServerStatus(url=url, reachable=False, healthy=False, error=f"cannot reach {url}: {problems[0]}")

    health = answers.get("/health")
    healthy = isinstance(health, httpx.Response) and health.status_code == 200
    if isinstance(health, httpx.Response) and not healthy:
        problems.append(f"GET /health: HTTP {health.status_code} (starting, shutting down or unhealthy)")

    def response(path: str) -> httpx.Response | None:
        answer = answers.get(path)
        return answer if isinstance(answer, httpx.Response) else None

    model_info = response("/model_info")
    server_info = response("/server_info")
    metrics = response("/metrics")
    return _status_from(
        url,
        healthy=healthy,
        model_info=_json_object("/model_info", model_info, problems) if model_info is not None else {},
        server_info=_json_object("/server_info", server_info, problems) if server_info is not None else {},
        samples=_metric_samples(metrics, problems) if metrics is not None else [],
        error="; ".join(problems) or None,
    )
