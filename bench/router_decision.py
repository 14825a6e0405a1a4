"""How long one routing decision takes, ours and naive baselines side by side in one run.

    .venv/bin/python bench/router_decision.py [--repeats 5]

At 10, 100, 1,000 and 10,000 candidate workers this times `router.choose` with a prefix key
(rendezvous affinity under the load bound) and without one (round-robin over the least loaded),
against two baselines that do the obvious thing on every call:

* naive least-load: sort every eligible worker by load and take the first (the classic
  least-loaded router);
* naive rendezvous: the same policy as ours, but it sorts every eligible worker by its
  rendezvous score and walks the sorted list, where we take a maximum.

The snapshot is seeded and mid-load (capacities 4 to 32, each worker's in-flight count drawn
uniformly below its capacity), so some keyed requests spill. Candidates arrive sorted by worker
id, as the router's docstring asks. Each cell is the median over `--repeats` rounds of the mean
µs per decision. Ours and the baselines alternate within a round, so drift hits all of them
alike. Before timing, the naive rendezvous baseline is checked to pick the same workers as
`choose`. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engy_node.gateway.router import DEFAULT_LOAD_FACTOR, Candidate, choose  # noqa: E402

SIZES = (10, 100, 1_000, 10_000)
PREFIXES = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(256)]
# About 0.1 s of decisions per cell and round, whatever the size.
DECISIONS_PER_CELL = 200_000


def snapshot(size: int, rng: random.Random) -> list[Candidate]:
    workers = []
    for i in range(size):
        capacity = rng.choice((4, 8, 16, 32))
        workers.append(Candidate(worker_id=f"miner-{i:05d}/leg-{i % 4}", capacity=capacity, inflight=rng.randrange(capacity)))
    return workers


def naive_least_load(candidates: list[Candidate], prefix: bytes | None, counter: int) -> str | None:
    eligible = [c for c in candidates if c.inflight < c.capacity]
    if not eligible:
        return None
    return sorted(eligible, key=lambda c: (c.inflight / c.capacity, c.worker_id))[0].worker_id


def naive_rendezvous(candidates: list[Candidate], prefix: bytes, counter: int) -> str | None:
    eligible = [c for c in candidates if c.inflight < c.capacity]
    if not eligible:
        return None
    mean_after = (sum(c.inflight for c in eligible) + 1) / sum(c.capacity for c in eligible)

    def score(c: Candidate) -> float:
        digest = hashlib.sha256(len(prefix).to_bytes(8, "big") + prefix + c.worker_id.encode()).digest()
        u = ((int.from_bytes(digest[:8], "big") >> 11) + 0.5) * 2.0**-53
        return c.capacity / -math.log(u)

    for c in sorted(eligible, key=score, reverse=True):
        if c.inflight + 1 <= math.ceil(DEFAULT_LOAD_FACTOR * mean_after * c.capacity):
            return c.worker_id
    return None


def ours_keyed(candidates: list[Candidate], prefix: bytes, counter: int) -> str | None:
    choice = choose(candidates=candidates, prefix=prefix, rr_counter=counter)
    return choice and choice.worker_id


def ours_unkeyed(candidates: list[Candidate], prefix: bytes, counter: int) -> str | None:
    choice = choose(candidates=candidates, prefix=None, rr_counter=counter)
    return choice and choice.worker_id


def time_per_decision(decide: Callable[[list[Candidate], bytes, int], str | None], candidates: list[Candidate], decisions: int) -> float:
    start = time.perf_counter()
    for n in range(decisions):
        decide(candidates, PREFIXES[n % len(PREFIXES)], n)
    return (time.perf_counter() - start) / decisions * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    columns = {
        "choose, keyed": ours_keyed,
        "choose, unkeyed": ours_unkeyed,
        "naive least-load sort": naive_least_load,
        "naive rendezvous sort": naive_rendezvous,
    }
    print(f"router decision time, µs per decision (median of {args.repeats} rounds); "
          f"Python {platform.python_version()} on {platform.machine()} ({platform.processor() or 'unknown CPU'})\n")
    print("| workers | " + " | ".join(columns) + " | keyed ÷ least-load | keyed ÷ naive rendezvous | unkeyed ÷ least-load |")
    print("|---:|" + "---:|" * (len(columns) + 3))
    for size in SIZES:
        candidates = snapshot(size, random.Random(53 + size))
        decisions = max(20, DECISIONS_PER_CELL // size)
        # Same policy, same answers: otherwise the comparison would time different work.
        for n, prefix in enumerate(PREFIXES[:32]):
            assert naive_rendezvous(candidates, prefix, n) == ours_keyed(candidates, prefix, n), (size, n)
        samples: dict[str, list[float]] = {name: [] for name in columns}
        for _ in range(args.repeats):
            for name, decide in columns.items():
                samples[name].append(time_per_decision(decide, candidates, decisions))
        median = {name: statistics.median(values) for name, values in samples.items()}
        cells = " | ".join(f"{median[name]:,.1f}" for name in columns)
        print(f"| {size:,} | {cells} | {median['choose, keyed'] / median['naive least-load sort']:.2f} "
              f"| {median['choose, keyed'] / median['naive rendezvous sort']:.2f} "
              f"| {median['choose, unkeyed'] / median['naive least-load sort']:.2f} |")


if __name__ == "__main__":
    main()
