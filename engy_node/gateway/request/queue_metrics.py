"""The waiting room's metrics: its depth, how long requests waited and how each wait ended, per
model, in the node's metrics registry. Apart from `admission`, which is the pure queue, and from
`lifecycle.Gateway`, which waits in it and reports here."""

from __future__ import annotations

from engy_node.metrics import Registry


class QueueMetrics:
    """The waiting room's depth, waits and outcomes per model, in the node's metrics registry."""

    def __init__(self, registry: Registry) -> None:
        self._depth = registry.gauge(
            "engy_gateway_queue_depth", "Requests waiting for a miner with room.", labelnames=("model",)
        )
        self._wait = registry.histogram(
            "engy_gateway_queue_wait_seconds",
            "Time requests waited for a miner with room.",
            labelnames=("model",),
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self._outcomes = registry.counter(
            "engy_gateway_queue_outcomes_total",
            "Requests that waited, by how the wait ended (served, timed_out, gone: the buyer hung up; full: "
            "refused at a full queue).",
            labelnames=("model", "outcome"),
        )

    def depth(self, model: str, depth: int) -> None:
        self._depth.labels(model=model).set(depth)

    def outcome(self, model: str, outcome: str) -> None:
        self._outcomes.labels(model=model, outcome=outcome).inc()

    def left(self, model: str, *, waited_s: float, outcome: str, depth: int) -> None:
        self._wait.labels(model=model).observe(waited_s)
        self.outcome(model, outcome)
        self.depth(model, depth)


QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
