"""Counters, gauges and latency histograms, with the two views of them the node needs.

Every role of the node records its numbers here: the model server its time to first token
(TTFT) and inter-token latency (ITL), the gateway its request latencies, the miner its work.
Two readers consume them: Prometheus-style scrapers through `prometheus_client` (`Registry` is
one of its collectors, so `generate_latest(registry)` writes text format 0.0.4), and the TUI and
control API through `Registry.snapshot()` (plain JSON-ready dicts). Reading a scraped exposition
back (sglang's `/metrics`) is `prometheus_client.parser`'s job; see `serve/status.py`.

Why a histogram keeps two views of the same observations:

* Cumulative buckets, `_sum` and `_count` are what Prometheus can aggregate across processes
  and time ranges; they are lifetime totals and never forget.
* A bounded window of the most recent observations (a deque, 4096 by default) gives exact
  nearest-rank p50/p95/p99, which is what an operator reads on a dashboard: "how slow is it
  now", not a bucket-interpolated estimate over the whole uptime.

Why the metric classes are ours and only the format is prometheus_client's: its `Histogram` has
no window, and its `Counter` and `Histogram` add `_created` series our `/metrics` has never had;
registering a definition twice here returns the existing family (its registry raises); and a
snapshot needs each child's lifetime values, which its metric classes keep private. So the
families below hold the numbers, and `Registry.collect()` hands them to the library as
`*MetricFamily` objects at scrape time. Two consequences of that format: a counter's name must
end in `_total` (the library writes the suffix itself), and a histogram whose first bucket bound
is negative is written without `_sum` and `_count` (OpenMetrics' rule, which the library
applies); the snapshot keeps both either way.

Percentiles are `engy_node.percentile.nearest_rank`, the definition epoch settlement and the
breaker use too.

This module does no IO and reads no clock: callers measure durations and pass them in.

Thread safety: the model server's engine updates metrics from a worker thread while trio
tasks collect and snapshot them. Each metric family has one `threading.Lock` shared by all its
children; an update holds it for O(log buckets) work (a bisect and a deque append). Readers
copy state under the lock and sort or format outside it, so a dashboard refresh never makes
the engine thread wait on a sort. The registry's own lock guards only registration.
"""

from __future__ import annotations

import abc
import bisect
import collections
import dataclasses
import math
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from engy_node.percentile import checked, nearest_rank

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_WINDOW",
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "TTFT_BUCKETS",
    "Counter",
    "CounterChild",
    "Gauge",
    "GaugeChild",
    "Histogram",
    "HistogramChild",
    "HistogramSummary",
    "Registry",
]

# prometheus_client's default buckets, for histograms that are not one of the latencies below.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip

# The three latency bucket sets below are sglang's (its metrics collector), so our model
# server's histograms line up bucket for bucket with a scraped sglang's and can be summed or
# compared in one query.
# Time to first token, seconds.
TTFT_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
)  # fmt: skip
# Inter-token latency (time per output token), seconds: sglang's range 0.002 ... 8.0.
ITL_BUCKETS: tuple[float, ...] = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.300, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
# End-to-end request latency, seconds: sglang's range 0.1 ... 2400.
E2E_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200, 250, 300,
    350, 500, 1000, 2400,
)  # fmt: skip

# Enough recent samples for a stable p99 (about 40 values above it) while a full sort for a
# dashboard refresh stays well under a millisecond.
DEFAULT_WINDOW = 4096

# The classic character sets, checked at registration. prometheus_client itself accepts any
# UTF-8 name and would write one outside this set with its characters replaced by "_", so the
# series would be scraped under a name nobody registered.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Label names may not contain colons; names starting with "__" are reserved by Prometheus.
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclasses.dataclass(frozen=True)
class HistogramSummary:
    """Statistics over a histogram's recent window (not its lifetime totals).

    With an empty window, count is 0, sum is 0.0 and the other fields are None.
    """

    count: int
    sum: float
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None


class CounterChild:
    """One labelled series of a counter: a float that only goes up."""

    def __init__(self, name: str, lock: threading.Lock) -> None:
        self._name = name
        self._lock = lock
        self._value = 0.0

    def inc(self, amount: float = 1) -> None:
        # A counter that went down or became infinite would break rate() for every reader.
        if not (0 <= amount < math.inf):
            raise ValueError(f"counter {self._name} can only increase by a finite amount >= 0, got {amount!r}")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        with self._lock:
            return self._value

    def _read_locked(self) -> float:
        return self._value


class GaugeChild:
    """One labelled series of a gauge: a float that can be set, raised or lowered."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def inc(self, amount: float = 1) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1) -> None:
        with self._lock:
            self._value -= amount

    @property
    def value(self) -> float:
        with self._lock:
            return self._value

    def _read_locked(self) -> float:
        return self._value


class HistogramChild:
    """One labelled series of a histogram: lifetime buckets plus a window of recent samples."""

    def __init__(self, name: str, lock: threading.Lock, bounds: tuple[float, ...], window: int) -> None:
        self._name = name
        self._lock = lock
        self._bounds = bounds
        # Per-bucket (not cumulative) counts, the last one for +Inf: an observation touches one
        # slot, and readers accumulate.
        self._bucket_counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._count = 0
        self._window: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, value: float) -> None:
        """Record one observation (e.g. a duration in seconds); it must be finite."""
        value = float(value)
        # NaN would make the window unsortable and an infinity would poison _sum for good.
        if not math.isfinite(value):
            raise ValueError(f"histogram {self._name} observations must be finite, got {value!r}")
        # Buckets are "less than or equal": bisect_left puts a value equal to a bound in it.
        slot = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._bucket_counts[slot] += 1
            self._sum += value
            self._count += 1
            self._window.append(value)

    @property
    def count(self) -> int:
        """Lifetime number of observations."""
        with self._lock:
            return self._count

    @property
    def sum(self) -> float:
        """Lifetime sum of observations."""
        with self._lock:
            return self._sum

    def _sorted_window(self) -> list[float]:
        with self._lock:
            values = list(self._window)
        values.sort()
        return values

    def percentile(self, q: float) -> float | None:
        """Exact nearest-rank q-th percentile of the recent window; None when it is empty."""
        checked(q)
        values = self._sorted_window()
        return nearest_rank(values, q) if values else None

    def summary(self) -> HistogramSummary:
        """Count, sum, mean, p50, p95, p99 and max of the recent window."""
        values = self._sorted_window()
        if not values:
            return HistogramSummary(count=0, sum=0.0, mean=None, p50=None, p95=None, p99=None, max=None)
        total = math.fsum(values)
        return HistogramSummary(
            count=len(values),
            sum=total,
            mean=total / len(values),
            p50=nearest_rank(values, 50),
            p95=nearest_rank(values, 95),
            p99=nearest_rank(values, 99),
            max=values[-1],
        )

    def _read_locked(self) -> tuple[list[int], float, int]:
        """Cumulative bucket counts (the last is +Inf), sum and count."""
        cumulative = []
        running = 0
        for n in self._bucket_counts:
            running += n
            cumulative.append(running)
        return cumulative, self._sum, self._count


C = TypeVar("C", CounterChild, GaugeChild, HistogramChild)


class _Family(Generic[C], abc.ABC):
    """What all metric types share: a name, help text, label names and children by label values."""

    kind: ClassVar[str]
    # prometheus_client's family type for a counter or a gauge; a histogram overrides _collect.
    _exposition_family: ClassVar[type[CounterMetricFamily] | type[GaugeMetricFamily]]

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.help = help
        self.labelnames = labelnames
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], C] = {}
        # Prometheus clients expose an unlabelled metric at zero before its first update, so a
        # scraper sees the series exist from the start; a labelled one has no series until used.
        if not labelnames:
            self._children[()] = self._new_child()

    @abc.abstractmethod
    def _new_child(self) -> C: ...

    def _identity(self) -> tuple[Any, ...]:
        """What must match for a second registration to return this family."""
        return (self.kind, self.labelnames)

    def _exposed_names(self) -> tuple[str, ...]:
        """Sample names this family writes, which no other family may also write."""
        return (self.name,)

    def labels(self, /, **values: object) -> C:
        """The child for these label values (each is passed through str()), created on first use."""
        if not self.labelnames:
            raise ValueError(f"metric {self.name} has no labels; update it directly")
        missing = [n for n in self.labelnames if n not in values]
        extra = sorted(set(values) - set(self.labelnames))
        if missing or extra:
            problems = []
            if missing:
                problems.append(f"missing label(s) {', '.join(missing)}")
            if extra:
                problems.append(f"unexpected label(s) {', '.join(extra)}")
            raise ValueError(f"metric {self.name}: {'; '.join(problems)} (labels are {', '.join(self.labelnames)})")
        key = tuple(str(values[n]) for n in self.labelnames)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
            return child

    def _only(self) -> C:
        if self.labelnames:
            raise ValueError(f"metric {self.name} has labels ({', '.join(self.labelnames)}); use .labels(...) first")
        return self._children[()]

    def _read(self) -> list[tuple[tuple[str, ...], C, Any]]:
        """(label values, child, state) for every child, states copied under the lock in one go,
        ordered by label values."""
        with self._lock:
            rows = [(key, child, child._read_locked()) for key, child in self._children.items()]
        rows.sort(key=lambda row: row[0])
        return rows

    def _collect(self) -> Metric:
        """Every child, as the prometheus_client family the text format is written from."""
        family = self._exposition_family(self.name, self.help, labels=self.labelnames)
        for key, _, value in self._read():
            family.add_metric(key, value)
        return family

    def _snapshot_child(self, child: C, state: Any) -> dict[str, Any]:
        return {"value": state}

    def _snapshot(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "help": self.help,
            "labelnames": list(self.labelnames),
            "children": [
                {"labels": dict(zip(self.labelnames, key))} | self._snapshot_child(child, state)
                for key, child, state in self._read()
            ],
        }


class Counter(_Family[CounterChild]):
    """A monotonically increasing count, registered and exposed under a name ending in `_total`."""

    kind = "counter"
    _exposition_family = CounterMetricFamily

    def _new_child(self) -> CounterChild:
        return CounterChild(self.name, self._lock)

    def inc(self, amount: float = 1) -> None:
        self._only().inc(amount)

    @property
    def value(self) -> float:
        return self._only().value


class Gauge(_Family[GaugeChild]):
    """A value that can go up and down (queue depth, running requests, free memory)."""

    kind = "gauge"
    _exposition_family = GaugeMetricFamily

    def _new_child(self) -> GaugeChild:
        return GaugeChild(self._lock)

    def set(self, value: float) -> None:
        self._only().set(value)

    def inc(self, amount: float = 1) -> None:
        self._only().inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._only().dec(amount)

    @property
    def value(self) -> float:
        return self._only().value


class Histogram(_Family[HistogramChild]):
    """Observations (usually latencies in seconds) in cumulative buckets plus a recent window."""

    kind = "histogram"

    def __init__(
        self, name: str, help: str, labelnames: tuple[str, ...], buckets: tuple[float, ...], window: int
    ) -> None:
        # Set before the base constructor, which creates the unlabelled child from them.
        self.buckets = buckets
        self.window = window
        super().__init__(name, help, labelnames)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.name, self._lock, self.buckets, self.window)

    def _identity(self) -> tuple[Any, ...]:
        return (*super()._identity(), self.buckets, self.window)

    def _exposed_names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")

    def observe(self, value: float) -> None:
        self._only().observe(value)

    @property
    def count(self) -> int:
        return self._only().count

    @property
    def sum(self) -> float:
        return self._only().sum

    def percentile(self, q: float) -> float | None:
        return self._only().percentile(q)

    def summary(self) -> HistogramSummary:
        return self._only().summary()

    def _le_labels(self) -> list[str]:
        """The `le` label of each bucket, +Inf last, written as prometheus_client writes floats."""
        return [*map(floatToGoString, self.buckets), "+Inf"]

    def _collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labelnames)
        bounds = self._le_labels()
        for key, _, (cumulative, total, _count) in self._read():
            # The family writes `_count` from the +Inf bucket, which equals the child's count.
            family.add_metric(key, list(zip(bounds, cumulative)), total)
        return family

    def _snapshot_child(self, child: HistogramChild, state: Any) -> dict[str, Any]:
        cumulative, total, count = state
        bounds = self._le_labels()
        return {
            "count": count,
            "sum": total,
            "buckets": dict(zip(bounds, cumulative)),
            # Read after the totals, so under concurrent updates the window may already hold a
            # few later observations; a dashboard cannot tell, and holding the lock across the
            # sort would stall the engine thread.
            "window": dataclasses.asdict(child.summary()),
        }


def _validate_buckets(name: str, buckets: Iterable[float]) -> tuple[float, ...]:
    bounds = tuple(float(b) for b in buckets)
    # +Inf is always implied; accept it written out, as prometheus_client does.
    if bounds and bounds[-1] == math.inf:
        bounds = bounds[:-1]
    if not bounds:
        raise ValueError(f"histogram {name} needs at least one finite bucket bound")
    if not all(math.isfinite(b) for b in bounds):
        raise ValueError(f"histogram {name} bucket bounds must be finite (+Inf is implied): {bounds}")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"histogram {name} bucket bounds must be strictly increasing: {bounds}")
    return bounds


class Registry:
    """Metric families by name; a prometheus_client collector (`generate_latest(registry)`).

    Registering a name again with the same type, label names (and for histograms, buckets and
    window) returns the existing family, so modules can declare their metrics at import or
    construction time without coordinating; the first registration's help text is kept. Any
    other mismatch, or a name that would collide with another family's exposed samples (a
    histogram `x` writes `x_bucket`, `x_sum`, `x_count`), raises ValueError naming the metric.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family[Any]] = {}
        # Exposed sample name -> owning family's name, to catch collisions across families.
        self._exposed: dict[str, str] = {}

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        """A counter exposed exactly as `name`, which must end in `_total`."""
        labels = _check_names(name, labelnames, reserved=())
        # prometheus_client writes every counter as `<base>_total`: a name without the suffix
        # would be exposed under another name than the one registered and snapshotted.
        if not name.endswith("_total") or name == "_total":
            raise ValueError(f"counter {name}: a counter's name must end in _total, e.g. {name}_total")
        return self._register(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._register(Gauge(name, help, _check_names(name, labelnames, reserved=())))

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Iterable[float] = DEFAULT_BUCKETS,
        window: int = DEFAULT_WINDOW,
    ) -> Histogram:
        """A histogram; `window` is how many recent observations the percentiles cover."""
        labels = _check_names(name, labelnames, reserved=("le",))
        if window < 1:
            raise ValueError(f"histogram {name} window must be at least 1, got {window}")
        return self._register(Histogram(name, help, labels, _validate_buckets(name, buckets), window))

    def _register(self, family: _Family[Any]) -> Any:
        with self._lock:
            existing = self._families.get(family.name)
            if existing is not None:
                if existing.kind != family.kind:
                    raise ValueError(
                        f"metric {family.name} is already registered as a {existing.kind}, not a {family.kind}"
                    )
                if existing._identity() != family._identity():
                    raise ValueError(
                        f"metric {family.name} is already registered with a different definition: "
                        f"{existing._identity()} vs {family._identity()}"
                    )
                return existing
            for exposed in family._exposed_names():
                owner = self._exposed.get(exposed)
                if owner is not None:
                    raise ValueError(f"metric {family.name} would expose {exposed}, which metric {owner} already does")
            self._families[family.name] = family
            for exposed in family._exposed_names():
                self._exposed[exposed] = family.name
            return family

    def _all(self) -> list[_Family[Any]]:
        with self._lock:
            return list(self._families.values())

    def collect(self) -> Iterator[Metric]:
        """Every family in registration order, as prometheus_client families: the collector
        interface, which `prometheus_client.exposition.generate_latest(registry)` reads."""
        for family in self._all():
            yield family._collect()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every family as plain dicts and lists, JSON-ready, keyed by metric name.

        Counters and gauges: {"type", "help", "labelnames", "children": [{"labels", "value"}]}.
        Histogram children instead carry lifetime "count", "sum" and cumulative "buckets"
        (keyed by the `le` string, ending in "+Inf"), and "window": the HistogramSummary fields.
        Everything is finite except a gauge someone set to NaN or an infinity, which strict JSON
        encoders reject.
        """
        return {family.name: family._snapshot() for family in self._all()}


def _check_names(name: str, labelnames: Sequence[str], reserved: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"invalid metric name {name!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")
    # A lone string would otherwise be read as a sequence of one-letter label names.
    if isinstance(labelnames, str):
        raise ValueError(f"metric {name}: labelnames must be a sequence of names, not the string {labelnames!r}")
    labels = tuple(labelnames)
    for label in labels:
        if not isinstance(label, str) or not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
            raise ValueError(
                f"metric {name}: invalid label name {label!r}: must match [a-zA-Z_][a-zA-Z0-9_]* without a leading __"
            )
        if label in reserved:
            raise ValueError(f"metric {name}: label name {label!r} is reserved for this metric type")
    if len(set(labels)) != len(labels):
        raise ValueError(f"metric {name}: duplicate label names in {labels}")
    return labels
