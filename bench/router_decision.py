"""How long one routing decision takes at fleet scale, and how well it keeps prefixes cached:
the routing table (ours) and the snapshot router it replaced (today), side by side in one run.

    .venv/bin/python bench/router_decision.py [--repeats 5] [--seeds 5] [--requests 90000] [--workers 200]

Today is the router as it was before `route_table`, kept here verbatim: per request, the pool
built a list of every leg, and `choose` hashed every eligible worker for a keyed request
(weighted rendezvous, SHA-256 per worker) or scanned and sorted the least-loaded tier for an
unkeyed one. Ours is `RouteTable.choose` on a table kept current by explicit updates.

Part 1, decision time. At 10, 100, 1,000 and 10,000 workers on a seeded mid-load snapshot
(capacities 4 to 32, each worker's in-flight count drawn uniformly below its capacity, so some
keyed requests spill), µs per keyed and per unkeyed decision, the median over `--repeats` rounds
of the mean; today and ours alternate within a round, so drift hits both alike. Also what ours
pays to stay current (an in-flight change, a join and a leave), what today's pool paid per
request to build the snapshot on top of its decision, ours with 90 % of the workers full (the
walk passes over full workers), and ours in its worst case: only about sqrt(3 × workers) free,
where walking past the full ones and scoring the free ones cost about the same (`_SCAN_WHILE`).
Before timing, ours is checked against a brute-force reading of its own policy (every worker's
distance to the key, the load bound in exact fractions).

Part 2, prefix affinity under churn. A seeded stream of keyed requests over `--prefixes` prefixes
with Zipf popularity (s = 1), arriving at a rate that keeps the fleet about 60 % busy, each
lasting a geometric number of ticks; meanwhile workers leave (their requests end) and join
(empty caches), and capacities change. Each worker keeps an LRU cache of 4 prefixes per slot. A
hit is a request that lands on a worker that already holds its prefix. Both routers see the
same requests and the same membership events. Each of `--seeds` seeds draws another stream and
other events; the hit rates differ between seeds by more than between the routers, so the run
prints each seed's difference and their mean with its standard error, besides the means of the
hit rate, how often the load bound spilled a request, the mean over ticks of (busiest worker's load ÷ the mean load) and the
busiest worker's peak load, among workers within their capacity (a capacity cut can leave a
worker over it, which no router causes).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import itertools
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engy_node.gateway.routing.route_table import (  # noqa: E402
    DEFAULT_LOAD_FACTOR,
    Candidate,
    Choice,
    RouteTable,
    key_point,
    worker_points,
)

SIZES = (10, 100, 1_000, 10_000)
PREFIXES = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(256)]
CAPACITIES = (4, 8, 16, 32)
# About 0.1 s of today's decisions per cell and round, whatever the size.
DECISIONS_PER_CELL = 200_000
CHECKED_PREFIXES = 8


# ---- today: the snapshot router before the routing table, verbatim --------------------------


def today_choose(
    *,
    candidates: Sequence,
    prefix: bytes | None,
    rr_counter: int,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    exclude=frozenset(),
) -> Choice | None:
    eligible = [c for c in candidates if c.inflight < c.capacity and c.worker_id not in exclude]
    if not eligible:
        return None
    top_priority = max(c.priority for c in eligible)
    top_class = [c for c in eligible if c.priority == top_priority]
    if len(top_class) == 1 and len(eligible) > 1:
        return Choice(top_class[0].worker_id, "priority")
    if prefix is None:
        return Choice(_today_round_robin(top_class, rr_counter).worker_id, "round-robin")
    return _today_rendezvous(top_class, prefix, load_factor)


def _today_round_robin(workers: list, rr_counter: int):
    least = workers[0]
    for worker in workers:
        if worker.inflight * least.capacity < least.inflight * worker.capacity:
            least = worker
    tier = sorted(
        (w for w in workers if w.inflight * least.capacity == least.inflight * w.capacity), key=lambda w: w.worker_id
    )
    return tier[rr_counter % len(tier)]


def _today_rendezvous(workers: list, prefix: bytes, load_factor: float) -> Choice:
    total_capacity = sum(w.capacity for w in workers)
    slots_demanded = load_factor * (sum(w.inflight for w in workers) + 1)
    salt = len(prefix).to_bytes(8, "big") + prefix
    digests = [hashlib.sha256(salt + w.worker_id.encode()).digest() for w in workers]
    home = _today_highest_score(zip(digests, workers))
    if home.inflight * total_capacity < slots_demanded * home.capacity:
        return Choice(home.worker_id, "affinity")
    spill = _today_highest_score(
        (digest, worker)
        for digest, worker in zip(digests, workers)
        if worker.inflight * total_capacity < slots_demanded * worker.capacity
    )
    return Choice(spill.worker_id, "affinity-spill")


def _today_highest_score(scored: Iterable[tuple[bytes, object]]):
    best_by_capacity: dict[int, tuple[bytes, object]] = {}
    for digest, worker in scored:
        best = best_by_capacity.get(worker.capacity)
        if best is None or digest > best[0]:
            best_by_capacity[worker.capacity] = (digest, worker)
    return max(best_by_capacity.values(), key=lambda entry: (_today_score(entry[1].capacity, entry[0]), entry[0]))[1]


def _today_score(capacity: int, digest: bytes) -> float:
    u = ((int.from_bytes(digest[:8], "big") >> 11) + 0.5) * 2.0**-53
    return capacity / -math.log(u)


# ---- part 1: decision time --------------------------------------------------------------------


def snapshot(size: int, rng: random.Random, *, full_share: float = 0.0, free: int | None = None) -> list[Candidate]:
    """`full_share`: each worker is full with this chance; `free`: exactly this many are not."""
    with_room = set(rng.sample(range(size), free)) if free is not None else None
    workers = []
    for i in range(size):
        capacity = rng.choice(CAPACITIES)
        full = rng.random() < full_share if with_room is None else i not in with_room
        inflight = capacity if full else rng.randrange(capacity)
        workers.append(Candidate(worker_id=f"miner-{i:05d}/leg-{i % 4}", capacity=capacity, inflight=inflight))
    return workers


def table_of(candidates: list[Candidate]) -> RouteTable:
    table = RouteTable()
    for candidate in candidates:
        table.join(candidate, admitted=True)
    return table


def reference_choice(candidates: list[Candidate], points: dict[str, tuple[int, ...]], prefix: bytes) -> str:
    """Our keyed policy computed the slow way: every worker's distance, then the bound exactly."""
    k = key_point(prefix)
    eligible = [c for c in candidates if c.inflight < c.capacity]
    mean_after = Fraction(sum(c.inflight for c in eligible) + 1, sum(c.capacity for c in eligible))

    def score(c: Candidate) -> tuple[Fraction, str]:
        return Fraction(min((p - k) % (1 << 64) for p in points[c.worker_id]), c.capacity), c.worker_id

    for c in sorted(eligible, key=score):
        if c.inflight + 1 <= math.ceil(Fraction(DEFAULT_LOAD_FACTOR) * mean_after * c.capacity):
            return c.worker_id
    raise AssertionError("the pigeonhole bound failed")


@dataclasses.dataclass
class LegLike:
    """What today's pool read from each leg to build a candidate."""

    leg_id: str
    capacity: int
    inflight: dict
    lacks: frozenset[str]


def time_per_call(call: Callable[[int], object], calls: int) -> float:
    start = time.perf_counter()
    for n in range(calls):
        call(n)
    return (time.perf_counter() - start) / calls * 1e6


def decision_time(repeats: int) -> None:
    print("### Decision time, µs (median of", repeats, "rounds)\n")
    print(
        "| workers | today keyed | ours keyed | today ÷ ours | today unkeyed | ours unkeyed | today ÷ ours "
        "| today's snapshot build | ours keyed, 90 % full | ours keyed, √(3n) free | ours: in-flight change | ours: join "
        "| ours: leave |"
    )
    print("|---:|" + "---:|" * 12)
    for size in SIZES:
        candidates = snapshot(size, random.Random(53 + size))
        table = table_of(candidates)
        busy = table_of(snapshot(size, random.Random(53 + size), full_share=0.9))
        scarce = table_of(snapshot(size, random.Random(53 + size), free=math.isqrt(3 * size)))
        points = {c.worker_id: worker_points(c.worker_id) for c in candidates}
        for prefix in PREFIXES[:CHECKED_PREFIXES]:
            choice = table.choose(prefix=prefix, rr_counter=0)
            assert choice.worker_id == reference_choice(candidates, points, prefix), (size, prefix.hex())
        legs = [LegLike(c.worker_id, c.capacity, dict.fromkeys(range(c.inflight)), c.lacks) for c in candidates]
        ids = [c.worker_id for c in candidates]
        inflight = {c.worker_id: c.inflight for c in candidates}
        decisions = max(20, DECISIONS_PER_CELL // size)
        ours_decisions = 20_000
        columns: dict[str, Callable[[], float]] = {
            "today keyed": lambda: time_per_call(
                lambda n: today_choose(candidates=candidates, prefix=PREFIXES[n % 256], rr_counter=n), decisions
            ),
            "ours keyed": lambda: time_per_call(
                lambda n: table.choose(prefix=PREFIXES[n % 256], rr_counter=n), ours_decisions
            ),
            "today unkeyed": lambda: time_per_call(
                lambda n: today_choose(candidates=candidates, prefix=None, rr_counter=n), decisions
            ),
            "ours unkeyed": lambda: time_per_call(lambda n: table.choose(prefix=None, rr_counter=n), ours_decisions),
            "snapshot build": lambda: time_per_call(
                lambda n: [
                    Candidate(worker_id=leg.leg_id, capacity=leg.capacity, inflight=len(leg.inflight), lacks=leg.lacks)
                    for leg in legs
                ],
                decisions,
            ),
            "busy keyed": lambda: time_per_call(
                lambda n: busy.choose(prefix=PREFIXES[n % 256], rr_counter=n), ours_decisions
            ),
            "scarce keyed": lambda: time_per_call(
                lambda n: scarce.choose(prefix=PREFIXES[n % 256], rr_counter=n), 2_000
            ),
            # A dispatch then its completion: two in-flight changes, on a spread of workers.
            "update": lambda: time_per_call(
                lambda n: table.update(ids[n * 7919 % size], inflight=inflight[ids[n * 7919 % size]] + (n & 1 ^ 1)),
                ours_decisions,
            ),
            "leave": lambda: time_per_call(lambda n: table.leave(ids[n]), min(size, 200)),
            "join": lambda: time_per_call(lambda n: table.join(candidates[n], admitted=True), min(size, 200)),
        }
        samples: dict[str, list[float]] = {name: [] for name in columns}
        for _ in range(repeats):
            for name, measure in columns.items():
                samples[name].append(measure())
        median = {name: statistics.median(values) for name, values in samples.items()}
        print(
            f"| {size:,} | {median['today keyed']:,.1f} | {median['ours keyed']:,.1f} "
            f"| {median['today keyed'] / median['ours keyed']:,.1f}× "
            f"| {median['today unkeyed']:,.1f} | {median['ours unkeyed']:,.1f} "
            f"| {median['today unkeyed'] / median['ours unkeyed']:,.1f}× "
            f"| {median['snapshot build']:,.1f} | {median['busy keyed']:,.1f} | {median['scarce keyed']:,.1f} "
            f"| {median['update']:,.1f} "
            f"| {median['join']:,.0f} | {median['leave']:,.0f} |"
        )
    print()


# ---- part 2: prefix affinity under churn ------------------------------------------------------


@dataclasses.dataclass
class SimWorker:
    worker_id: str
    capacity: int
    inflight: int = 0
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Everything both routers see: the requests and the membership events, tick by tick."""

    initial: list[tuple[str, int]]
    arrivals: list[list[tuple[int, int]]]
    """Per tick: (prefix index, duration in ticks) of each request."""
    events: list[list[tuple[str, str, int]]]
    """Per tick, before its arrivals: ("leave", id, 0), ("join", id, capacity), ("resize", id, capacity)."""
    prefixes: list[bytes]


def scenario(*, workers: int, requests: int, prefixes: int, seed: int = 53) -> Scenario:
    rng = random.Random(seed)
    serial = itertools.count()
    live = [(f"leg-{next(serial):05d}", rng.choice(CAPACITIES)) for _ in range(workers)]
    initial = list(live)
    mean_duration = 20
    total_capacity = sum(c for _, c in live)
    per_tick = max(1, round(0.6 * total_capacity / mean_duration))
    ticks = max(1, requests // per_tick)
    weights = list(itertools.accumulate(1 / rank for rank in range(1, prefixes + 1)))
    arrivals, events = [], []
    for _ in range(ticks):
        changes = []
        if rng.random() < 0.1:
            gone = live.pop(rng.randrange(len(live)))
            changes.append(("leave", gone[0], 0))
        if rng.random() < 0.1:
            joined = (f"leg-{next(serial):05d}", rng.choice(CAPACITIES))
            live.append(joined)
            changes.append(("join", *joined))
        if rng.random() < 0.1:
            index = rng.randrange(len(live))
            resized = (live[index][0], rng.choice(CAPACITIES))
            live[index] = resized
            changes.append(("resize", *resized))
        events.append(changes)
        picks = rng.choices(range(prefixes), cum_weights=weights, k=per_tick)
        arrivals.append([(p, 1 + int(rng.expovariate(1 / (mean_duration - 1)))) for p in picks])
    return Scenario(
        initial, arrivals, events, [hashlib.sha256(b"prefix" + i.to_bytes(4, "big")).digest() for i in range(prefixes)]
    )


class TodayRouter:
    def __init__(self) -> None:
        self.workers: dict[str, SimWorker] = {}

    def join(self, worker_id: str, capacity: int) -> None:
        self.workers[worker_id] = SimWorker(worker_id, capacity)

    def leave(self, worker_id: str) -> None:
        del self.workers[worker_id]

    def set(self, worker_id: str, *, capacity: int | None = None, inflight: int | None = None) -> None:
        worker = self.workers[worker_id]
        worker.capacity = worker.capacity if capacity is None else capacity
        worker.inflight = worker.inflight if inflight is None else inflight

    def choose(self, prefix: bytes) -> Choice | None:
        return today_choose(candidates=list(self.workers.values()), prefix=prefix, rr_counter=0)


class OurRouter:
    def __init__(self) -> None:
        self.table = RouteTable()

    def join(self, worker_id: str, capacity: int) -> None:
        self.table.join(Candidate(worker_id=worker_id, capacity=capacity, inflight=0), admitted=True)

    def leave(self, worker_id: str) -> None:
        self.table.leave(worker_id)

    def set(self, worker_id: str, *, capacity: int | None = None, inflight: int | None = None) -> None:
        self.table.update(worker_id, capacity=capacity, inflight=inflight)

    def choose(self, prefix: bytes) -> Choice | None:
        return self.table.choose(prefix=prefix, rr_counter=0)


def simulate(router, plan: Scenario) -> dict[str, float]:
    capacity: dict[str, int] = {}
    inflight: dict[str, int] = {}
    caches: dict[str, collections.OrderedDict] = {}
    ending: dict[int, list[str]] = collections.defaultdict(list)

    def join(worker_id: str, slots: int) -> None:
        router.join(worker_id, slots)
        capacity[worker_id], inflight[worker_id], caches[worker_id] = slots, 0, collections.OrderedDict()

    for worker_id, slots in plan.initial:
        join(worker_id, slots)
    hits = served = spilled = refused = 0
    ratios: list[float] = []
    peak = 0.0
    started = time.perf_counter()
    for tick, (events, arrivals) in enumerate(zip(plan.events, plan.arrivals)):
        for worker_id in ending.pop(tick, ()):
            if worker_id in inflight:
                inflight[worker_id] -= 1
                router.set(worker_id, inflight=inflight[worker_id])
        for kind, worker_id, slots in events:
            if kind == "leave":
                router.leave(worker_id)
                del capacity[worker_id], inflight[worker_id], caches[worker_id]
            elif kind == "join":
                join(worker_id, slots)
            else:
                capacity[worker_id] = slots
                router.set(worker_id, capacity=slots)
        for prefix_index, duration in arrivals:
            choice = router.choose(plan.prefixes[prefix_index])
            if choice is None:
                refused += 1
                continue
            worker_id = choice.worker_id
            served += 1
            spilled += choice.reason == "affinity-spill"
            cache = caches[worker_id]
            if prefix_index in cache:
                hits += 1
                cache.move_to_end(prefix_index)
            else:
                cache[prefix_index] = None
                if len(cache) > 4 * capacity[worker_id]:
                    cache.popitem(last=False)
            inflight[worker_id] += 1
            router.set(worker_id, inflight=inflight[worker_id])
            ending[tick + duration].append(worker_id)
        mean = sum(inflight.values()) / sum(capacity.values())
        # Within capacity only: a capacity cut can leave a worker over it, which no router causes.
        busiest = max((inflight[w] / capacity[w] for w in capacity if inflight[w] <= capacity[w]), default=0.0)
        peak = max(peak, busiest)
        if mean:
            ratios.append(busiest / mean)
    return {
        "hit rate": hits / served,
        "spilled": spilled / served,
        "refused": refused,
        "served": served,
        "max/mean": statistics.fmean(ratios),
        "peak": peak,
        "seconds": time.perf_counter() - started,
    }


def affinity(requests: int, workers: int, prefixes: int, seeds: int) -> None:
    routers = {"today (rendezvous over a snapshot)": TodayRouter, "ours (route table)": OurRouter}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in routers}
    plans = []
    for seed in range(53, 53 + seeds):
        plan = scenario(workers=workers, requests=requests, prefixes=prefixes, seed=seed)
        plans.append(plan)
        for name, router in routers.items():
            results[name].append(simulate(router(), plan))
    events = collections.Counter(kind for plan in plans for tick in plan.events for kind, _, _ in tick)
    print(
        f"### Prefix affinity under churn: {seeds} seeds × {sum(map(len, plans[0].arrivals)):,} keyed requests over "
        f"{prefixes:,} Zipf(1) prefixes, {workers} workers at the start, {len(plans[0].arrivals):,} ticks; per seed on "
        f"average {events['join'] / seeds:.0f} joins, {events['leave'] / seeds:.0f} leaves and {events['resize'] / seeds:.0f} "
        "capacity changes; LRU of 4 prefixes per slot; means over the seeds\n"
    )
    print(
        "| router | hit rate | spilled | refused (no room) | mean busiest ÷ mean load | peak busiest load | sim seconds |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():

        def mean(field: str) -> float:
            return statistics.fmean(run[field] for run in runs)

        print(
            f"| {name} | {mean('hit rate'):.2%} | {mean('spilled'):.2%} | {mean('refused'):,.0f} | {mean('max/mean'):.2f} "
            f"| {max(run['peak'] for run in runs):.2f} | {sum(run['seconds'] for run in runs):.1f} |"
        )
    today, ours = results.values()
    differences = [(o["hit rate"] - t["hit rate"]) * 100 for t, o in zip(today, ours)]
    spread = statistics.stdev(differences) / math.sqrt(seeds) if seeds > 1 else math.nan
    print(
        f"\nhit rate ours − today, points, per seed: {', '.join(f'{d:+.2f}' for d in differences)}; "
        f"mean {statistics.fmean(differences):+.2f} ± {spread:.2f} (standard error)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5, help="affinity simulations, each with its own seed")
    parser.add_argument("--requests", type=int, default=90_000, help="keyed requests in each affinity simulation")
    parser.add_argument("--workers", type=int, default=200, help="workers at the start of the affinity simulation")
    parser.add_argument("--prefixes", type=int, default=20_000, help="distinct prefixes in the affinity simulation")
    args = parser.parse_args()
    print(
        f"router at fleet scale; Python {platform.python_version()} on {platform.machine()} "
        f"({platform.processor() or 'unknown CPU'})\n"
    )
    decision_time(args.repeats)
    affinity(args.requests, args.workers, args.prefixes, args.seeds)


if __name__ == "__main__":
    main()
