"""One model's routing state, kept current as workers join, leave and change, so that a routing
decision costs a few dozen steps however many workers there are (docs/architecture.md, "Routing").

Why a table. A decision over a snapshot must look at every worker: the rendezvous hashing the
router used hashed each one per keyed request (466 µs at 1,000 workers, 4.7 ms at 10,000), and
the pool built the snapshot per request as well. A fleet of 10,000 legs at 1,000 requests a
second would spend cores on it. The table is plain data that the pool updates by explicit calls
(`join`, `leave`, `update`) whenever a worker comes, goes, or changes its capacity, its in-flight
count or its admission; `choose` only reads it. Pure: no IO, no clock, no randomness. Every
gateway process and host holding the same workers makes the same choice without sharing state.

The key's order. Each worker owns `POINTS_PER_WORKER` points on a ring of 2**64 positions,
hashed from its id alone (`worker_points`); a request's key has one point (`key_point`). A
worker's distance to the key is the clockwise distance from the key's point to the nearest of the
worker's points, and its score is that distance divided by its capacity. The key's order ranks
workers by score, lowest first (an exact tie by worker id). The first in the order is the key's
home. This is the exponential race behind weighted rendezvous hashing: the nearest of a worker's
many points lies at a distance that is close to an exponential draw with the same rate for every
worker, so distance ÷ capacity is exponential with a rate proportional to capacity, and a worker
is home to a share of keys proportional to its capacity (within about 1 / sqrt(points) for the
placement of its points, 6 % at 256; the load bound absorbs what is left). A worker's score
depends only on the key, its own id and its own capacity, so adding, removing or resizing one
worker moves keys only to or from that worker, and every retry (`exclude`) goes to the next
worker in the same order.

Reading the order without scoring everyone. Walking the ring clockwise from the key's point
meets points in increasing distance, and a worker's first point met is its nearest. A worker not
met yet scores at least (the next point's distance) ÷ (the largest capacity on the ring), so the
worker with the best score seen so far is final as soon as that bound passes it. Workers are
kept in separate rings by the bit length of their capacity, so capacities on one ring differ by
less than 2×: the home is final after about two points per ring, and each next worker in the
order after a point or two more. The rings of the request's class are walked together through
one heap. Positions sit in sorted runs of at most `2 * _RUN` (a sorted list of lists), so a join
inserts its points in O(points × log) steps, not by shifting one list of every point.

What is counted. Per group of workers with equal priority and equal `lacks`: how many admitted
workers have a free slot, with their in-flight and capacity sums (the load bound's m and C), and
those workers by load `inflight / capacity` (exactly, as scaled integers), each load's workers
sorted by id (round-robin). Admission is the pool's word on whether the traffic plane lets the
worker serve and its leg is fresh; the pool refreshes it at least once a second, and `choose`
can check it once more per candidate (`admit`), so a worker pulled since the last refresh is
never chosen, it only lingers in the counts until then.

What stays on the rings. Every worker with a capacity, admitted or not, free or full: moving a
worker's points costs about a millisecond, so a pull of thousands of workers at once, or a
gateway's legs all re-admitted after a restart, would stall the event loop for seconds if
admission moved points. An admission or a load change touches only the counts; the walk passes
over the workers that are not eligible. When few of a class's workers are eligible (most of the
fleet still probing, or nearly all of it full), walking past the others costs more than scoring
the eligible ones one by one, and `choose` does that instead (`_SCAN_WHILE`): each worker keeps
its points sorted, so its nearest point clockwise of the key is one bisection, and the order is
the same by its definition. A decision then costs at most ~0.2 ms at 10,000 workers, where the
snapshot router always paid ~5 ms.

Failure posture as in `router`: `choose` returns None when no worker is eligible and never raises
on a well-formed table; a caller's nonsense (a load factor below 1, a negative count, an unknown
or duplicate worker id) raises ValueError naming the argument.

Why this size: the rings, the per-class groups and `RouteTable` keep one set of invariants
between them (every worker's points on its class's ring, its counts in step with the pool's), and
each incremental update touches all three, so they are read and changed together.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import math
import struct
from array import array
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Literal

__all__ = [
    "DEFAULT_LOAD_FACTOR",
    "POINTS_PER_WORKER",
    "Candidate",
    "Choice",
    "Reason",
    "RouteTable",
    "key_point",
    "worker_points",
]

# A worker takes a keyed request while its load after the assignment stays within 1.25× the
# mean, rounded up to a whole request. 1.25 is smg prefix_hash's default (reference §0 item 2,
# §1a). It is also the ε = 0.25 of consistent hashing with bounded loads (Mirrokni, Thorup and
# Zadimoghaddam 2018), where a hot key's home holds at most 25 % past its fair share before the
# overflow moves to the key's next choices. Those next choices are deterministic, so the hot
# prefix ends up cached on a few workers rather than recomputed on a random one each time.
DEFAULT_LOAD_FACTOR = 1.25

# 256 points put a worker's share of keys within about 6 % (one standard deviation) of its
# capacity share. At 128 (9 %) the affinity simulation in bench/router_decision.py lost 0.16
# points of cache hits to the snapshot router's exact rendezvous, every seed below it; at 256 the
# two are level within the seeds' spread. Each point costs 20 bytes: its position and its
# owner's number on the ring, and the worker's own sorted copy. That is 5 KiB a worker, ~50 MiB
# for a table of 10,000 workers. Four points come out of each SHA-256, so a join hashes 64 times.
POINTS_PER_WORKER = 256

# A keyed decision scans the eligible workers instead of walking the rings while eligible² ≤
# this × the workers on the class's rings. Measured at 10,000 workers: scoring one eligible worker
# (a bisection of its sorted points) costs ~1 µs, and the walk meets an eligible worker about
# every (workers ÷ eligible) workers, about 35,000 ÷ eligible µs in all; the two cost the same
# near 170 eligible, where 170² ≈ 3 × 10,000.
_SCAN_WHILE = 3

# Sorted runs of positions are split past twice this length. A run this size costs ~1 µs to
# insert into (a memmove of 8 KiB), and 10,000 workers make ~1,300 runs, two bisections deep.
_RUN = 512

_RING = 1 << 64
_MASK = _RING - 1
# Scores are compared as (distance << 128) // capacity: capacities are below 2**64 (the
# protocol's limit), so two different ratios distance / capacity never floor to the same
# integer, and an integer compares exactly and cheaply on every host.
_SCORE_SHIFT = 128
_POINT_SCHEME = b"engy-ring/1"
_KEY_SCHEME = b"engy-ring-key/1"

Reason = Literal["affinity", "affinity-spill", "round-robin", "priority"]
"""Why `choose` picked its worker, for logs and metrics:

* `affinity`: the request has a key, and this worker comes first in the key's order among the
  eligible workers of the winning priority class. It is the key's home, or, on a retry, the best
  one left.
* `affinity-spill`: the key's home was over the load bound, so the first worker in the key's
  order within the bound took the request.
* `round-robin`: the request has no key, so the counter picked among the least-loaded workers.
* `priority`: the highest priority class had a single eligible worker and lower classes had
  others, so priority alone decided.
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One worker (a miner's leg) as the router sees it. Worker ids are unique in a table."""

    worker_id: str
    capacity: int
    """Requests the worker accepts at once, as it advertised. Zero means it takes none."""
    inflight: int
    """Requests the gateway has on it now. This can exceed `capacity` right after the capacity
    drops, and such a worker just is not eligible."""
    priority: int = 0
    """Higher classes are served first. A lower class gets traffic only while no worker in a
    higher class has a free slot."""
    lacks: frozenset[str] = frozenset()
    """What the worker does not honour of what a request may need (`protocol.miner.FEATURE_*`:
    the public miner answers greedily and without tools); `choose` keeps requests that need
    those off such workers while others have room."""
    first_party: bool = False
    """The operator's own worker. The router does not read it. Eligibility of first-party
    workers is settled before the router sees them (docs/trust.md), and any routing preference for them
    is expressed as `priority`, so one lever decides, not two that could disagree."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        for name in ("capacity", "inflight"):
            _check_count(name, getattr(self, name), self.worker_id)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r} for worker {self.worker_id!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    worker_id: str
    reason: Reason


def key_point(prefix: bytes) -> int:
    """The ring position of a routing key (`router.prefix_key`, or any bytes)."""
    return int.from_bytes(hashlib.sha256(_KEY_SCHEME + prefix).digest()[:8], "big")


# Remembered for the last few ids: a decision over a list of candidates (`router.choose`, a
# probe's legs) builds a table each time, and would otherwise hash the same legs again.
@functools.lru_cache(maxsize=256)
def worker_points(worker_id: str) -> tuple[int, ...]:
    """The `POINTS_PER_WORKER` ring positions of a worker, from its id alone."""
    encoded = worker_id.encode("utf-8", "surrogatepass")
    # Length-prefixed, so (id, counter) pairs never run together into the same bytes.
    seed = _POINT_SCHEME + len(encoded).to_bytes(8, "big") + encoded
    digests = b"".join(hashlib.sha256(seed + n.to_bytes(4, "big")).digest() for n in range(POINTS_PER_WORKER // 4))
    return struct.unpack(f">{POINTS_PER_WORKER}Q", digests)


@dataclasses.dataclass(eq=False, slots=True)
class _Worker:
    worker_id: str
    capacity: int
    inflight: int
    priority: int
    lacks: frozenset[str]
    admitted: bool
    group: _Group
    serial: int
    """Its number in the table, which the rings store for each point in 4 bytes rather than an
    8-byte reference; a number is reused once its worker has left."""
    points: array
    """Its positions, sorted: its nearest point clockwise of a key is one bisection away."""
    ring: _Ring | None = None
    """The ring holding its points: None while its capacity is 0."""
    level: int | None = None
    """Its load (`_load_level`) while it is admitted and has a free slot (it is then listed under
    it), else None: a worker is eligible, but for `exclude` and `admit`, exactly when this is set."""


class _Ring:
    """The points of one group's workers whose capacities have one bit length, sorted."""

    __slots__ = ("positions", "owners", "maxes", "size", "workers", "capacities", "max_capacity")

    def __init__(self) -> None:
        self.positions: list[array] = []
        self.owners: list[array] = []
        """The serial of each position's worker, run by run."""
        self.maxes: list[int] = []
        """The last position of each run: bisecting it finds the run a position belongs in."""
        self.size = 0
        self.workers = 0
        self.capacities: dict[int, int] = {}
        """capacity -> how many of the ring's workers have it, for `max_capacity`."""
        self.max_capacity = 0

    def add(self, worker: _Worker) -> None:
        for position in worker.points:
            self._insert(position, worker.serial)
        self.size += POINTS_PER_WORKER
        self.workers += 1
        self.count_capacity(worker.capacity, +1)

    def remove(self, worker: _Worker, capacity: int) -> None:
        for position in worker.points:
            self._delete(position, worker.serial)
        self.size -= POINTS_PER_WORKER
        self.workers -= 1
        self.count_capacity(capacity, -1)

    def count_capacity(self, capacity: int, change: int) -> None:
        left = self.capacities.get(capacity, 0) + change
        if left:
            self.capacities[capacity] = left
            self.max_capacity = max(self.max_capacity, capacity)
        else:
            del self.capacities[capacity]
            if capacity == self.max_capacity:
                self.max_capacity = max(self.capacities, default=0)

    def _insert(self, position: int, serial: int) -> None:
        if not self.maxes:
            self.positions.append(array("Q", (position,)))
            self.owners.append(array("I", (serial,)))
            self.maxes.append(position)
            return
        run = min(bisect_left(self.maxes, position), len(self.maxes) - 1)
        positions, owners = self.positions[run], self.owners[run]
        at = bisect_left(positions, position)
        positions.insert(at, position)
        owners.insert(at, serial)
        if position > self.maxes[run]:
            self.maxes[run] = position
        if len(positions) > 2 * _RUN:
            self.positions.insert(run + 1, positions[_RUN:])
            self.owners.insert(run + 1, owners[_RUN:])
            del positions[_RUN:], owners[_RUN:]
            self.maxes[run] = positions[-1]
            self.maxes.insert(run + 1, self.positions[run + 1][-1])

    def _delete(self, position: int, serial: int) -> None:
        # Two workers can share a position (a 64-bit collision), and equal positions can span
        # runs: look along them for this worker's.
        run = bisect_left(self.maxes, position)
        while True:
            positions, owners = self.positions[run], self.owners[run]
            at = bisect_left(positions, position)
            while at < len(positions) and positions[at] == position:
                if owners[at] == serial:
                    del positions[at], owners[at]
                    if positions:
                        self.maxes[run] = positions[-1]
                    else:
                        del self.positions[run], self.owners[run], self.maxes[run]
                    return
                at += 1
            run += 1

    def start(self, point: int) -> tuple[int, int]:
        """(run, index) of the first position at or after `point`, clockwise."""
        run = bisect_left(self.maxes, point)
        if run == len(self.maxes):
            return 0, 0
        return run, bisect_left(self.positions[run], point)


class _Group:
    """The workers of one priority and one `lacks`: their rings, counts and loads."""

    __slots__ = (
        "priority",
        "lacks",
        "order",
        "workers",
        "rings",
        "free",
        "free_inflight",
        "free_capacity",
        "levels",
        "members",
    )

    def __init__(self, priority: int, lacks: frozenset[str]) -> None:
        self.priority = priority
        self.lacks = lacks
        self.order = tuple(sorted(lacks))
        """Where its workers come in a round-robin cycle shared with other groups."""
        self.workers = 0
        self.rings: dict[int, _Ring] = {}
        """capacity bit length -> ring."""
        self.free = 0
        """Admitted workers with a free slot, and below, their in-flight and capacity sums."""
        self.free_inflight = 0
        self.free_capacity = 0
        self.levels: list[int] = []
        """The distinct loads of those workers (`_load_level`), ascending."""
        self.members: dict[int, list[str]] = {}
        """load -> the ids of those workers at that load, sorted."""


class RouteTable:
    """The workers serving one model, and the routing decision over them (module docstring).

    The pool calls `join` when a leg is admitted, `leave` when it goes, and `update` whenever
    its capacity, in-flight count or admission changes. A worker joins unadmitted unless told
    otherwise: it is counted nowhere and never chosen until admitted.

    `keyed_search` picks how a keyed decision reads the key's order: "auto" by the cost rule in
    the module docstring, or always "walk" or always "scan" (tests pin each, to check that both
    read the order its definition gives). A "scan" table keeps no rings at all, so a join costs
    only the worker's points: the table for a handful of workers that `router.choose` builds.
    """

    def __init__(self, *, keyed_search: Literal["auto", "walk", "scan"] = "auto") -> None:
        if keyed_search not in ("auto", "walk", "scan"):
            raise ValueError(f"keyed_search must be 'auto', 'walk' or 'scan', got {keyed_search!r}")
        self.keyed_search = keyed_search
        self._workers: dict[str, _Worker] = {}
        self._groups: dict[tuple[int, frozenset[str]], _Group] = {}
        self._by_serial: list[_Worker | None] = []
        self._free_serials: list[int] = []

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __getitem__(self, worker_id: str) -> Candidate:
        worker = self._worker(worker_id)
        return Candidate(
            worker_id=worker.worker_id,
            capacity=worker.capacity,
            inflight=worker.inflight,
            priority=worker.priority,
            lacks=worker.lacks,
        )

    def admitted(self, worker_id: str) -> bool:
        return self._worker(worker_id).admitted

    # ---- changes ----------------------------------------------------------------------------
    def join(self, candidate: Candidate, *, admitted: bool = False) -> None:
        if candidate.worker_id in self._workers:
            raise ValueError(f"worker {candidate.worker_id!r} is already in the table; leave it first, or update it")
        key = (candidate.priority, candidate.lacks)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(candidate.priority, candidate.lacks)
        group.workers += 1
        serial = self._free_serials.pop() if self._free_serials else len(self._by_serial)
        worker = _Worker(
            candidate.worker_id,
            candidate.capacity,
            candidate.inflight,
            candidate.priority,
            candidate.lacks,
            bool(admitted),
            group,
            serial,
            array("Q", sorted(worker_points(candidate.worker_id))),
        )
        if serial == len(self._by_serial):
            self._by_serial.append(worker)
        else:
            self._by_serial[serial] = worker
        self._workers[candidate.worker_id] = worker
        self._place(worker, worker.capacity)
        self._list(worker)

    def leave(self, worker_id: str) -> None:
        worker = self._worker(worker_id)
        self._unlist(worker)
        if worker.ring is not None:
            self._take_off_ring(worker, worker.capacity)
        del self._workers[worker_id]
        self._by_serial[worker.serial] = None
        self._free_serials.append(worker.serial)
        group = worker.group
        group.workers -= 1
        if not group.workers:
            del self._groups[(group.priority, group.lacks)]

    def update(
        self, worker_id: str, *, capacity: int | None = None, inflight: int | None = None, admitted: bool | None = None
    ) -> None:
        worker = self._worker(worker_id)
        if capacity is not None:
            _check_count("capacity", capacity, worker_id)
        if inflight is not None:
            _check_count("inflight", inflight, worker_id)
        self._unlist(worker)
        old_capacity = worker.capacity
        if capacity is not None:
            worker.capacity = capacity
        if inflight is not None:
            worker.inflight = inflight
        if admitted is not None:
            worker.admitted = bool(admitted)
        self._place(worker, old_capacity)
        self._list(worker)

    def _worker(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise ValueError(f"worker {worker_id!r} is not in the table; join it first")
        return worker

    def _place(self, worker: _Worker, old_capacity: int) -> None:
        """Put the worker on the ring its capacity calls for (none for a capacity of 0)."""
        if self.keyed_search == "scan":
            return
        group = worker.group
        bucket = worker.capacity.bit_length() if worker.capacity else None
        ring = None if bucket is None else group.rings.get(bucket)
        if ring is not None and ring is worker.ring:
            if worker.capacity != old_capacity:
                ring.count_capacity(old_capacity, -1)
                ring.count_capacity(worker.capacity, +1)
            return
        if worker.ring is not None:
            self._take_off_ring(worker, old_capacity)
        if bucket is not None:
            if ring is None:
                ring = group.rings[bucket] = _Ring()
            ring.add(worker)
            worker.ring = ring

    def _take_off_ring(self, worker: _Worker, capacity: int) -> None:
        ring = worker.ring
        assert ring is not None, "callers take a worker off its ring only while it has one"
        ring.remove(worker, capacity)
        if not ring.size:
            del worker.group.rings[capacity.bit_length()]
        worker.ring = None

    def _list(self, worker: _Worker) -> None:
        if not (worker.admitted and worker.inflight < worker.capacity):
            return
        group = worker.group
        group.free += 1
        group.free_inflight += worker.inflight
        group.free_capacity += worker.capacity
        level = _load_level(worker.inflight, worker.capacity)
        members = group.members.get(level)
        if members is None:
            members = group.members[level] = []
            insort(group.levels, level)
        insort(members, worker.worker_id)
        worker.level = level

    def _unlist(self, worker: _Worker) -> None:
        level = worker.level
        if level is None:
            return
        group = worker.group
        group.free -= 1
        group.free_inflight -= worker.inflight
        group.free_capacity -= worker.capacity
        members = group.members[level]
        del members[bisect_left(members, worker.worker_id)]
        if not members:
            del group.members[level]
            del group.levels[bisect_left(group.levels, level)]
        worker.level = None

    # ---- the decision -----------------------------------------------------------------------
    def choose(
        self,
        *,
        prefix: bytes | None,
        rr_counter: int,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        exclude: Collection[str] = frozenset(),
        needs: frozenset[str] = frozenset(),
        prefer: frozenset[str] = frozenset(),
        admit: Callable[[str], bool] | None = None,
    ) -> Choice | None:
        """The worker for one dispatch of a request, or None when no worker is eligible.

        1. Eligible: admitted, `inflight < capacity`, not in `exclude`, and, when `admit` is
           given, `admit(worker_id)`. A retry passes the workers that already failed this
           request, so with a key the retry goes to the next worker in the key's order.
        2. What the request needs. With `needs` or `prefer`, only the workers that lack none of
           `needs | prefer` are considered while any of them is eligible, else those that lack
           none of `needs`, else all: an answer without (say) sampling serves the buyer better
           than a 503. The caller reads what the chosen worker lacks and records it.
        3. Only the highest `priority` class among the eligible workers is considered further.
        4. With a `prefix` (from `router.prefix_key`), the first eligible worker in the key's
           order within the load bound (module docstring for the order).

           The load bound. Let m = the class's in-flight requests + 1 (this request) and C =
           the class's total capacity, over its eligible workers. The mean load after the
           assignment is m / C. A worker is within the bound when its own load after the
           assignment stays within `load_factor` × that mean, rounded up to a whole request:
           `inflight + 1 <= ceil(load_factor * m * capacity / C)`, that is `inflight * C <
           load_factor * m * capacity` (exact for a dyadic factor such as 1.25). Without the
           rounding, the first request on an idle cluster of two or more workers would already
           exceed 1.25× the mean, and affinity would be lost exactly when keeping it costs
           nothing. With `load_factor >= 1` some eligible worker is always within the bound:
           the bounds sum to at least `load_factor * m >= m` slots, more than the m - 1 requests
           in flight (pigeonhole). So the walk ends early. While a class of n equal workers has
           m <= n / load_factor requests, every worker's bound is one request. A second
           concurrent request for a key whose home is busy then goes to the key's next choice,
           which comes to cache the prefix as well. (Only when `admit` refuses workers the
           counts still hold can every eligible worker be over the bound; the key's first
           eligible worker then takes the request.)
        5. Without a prefix, round-robin over the least-loaded workers: those whose load
           `inflight / capacity` equals the class minimum (compared exactly), in a cycle of group
           after group (by what they lack), each group's in worker-id order; the pick is the one
           at `rr_counter % len(cycle)`, or the next eligible one after it. While the loads are
           equal, as in a lightly used cluster, the counter visits every worker once per cycle.
           Otherwise the least-loaded workers take turns.

        The caller increments `rr_counter` once per unkeyed request.
        """
        if not (math.isfinite(load_factor) and load_factor >= 1):
            raise ValueError(f"load_factor must be finite and >= 1, got {load_factor!r}")
        if isinstance(rr_counter, bool) or not isinstance(rr_counter, int) or rr_counter < 0:
            raise ValueError(f"rr_counter must be an integer >= 0, got {rr_counter!r}")
        exclude = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
        # Each group's eligible workers, their in-flight and their capacity, with what the
        # excluded workers add to the counts taken back out.
        net = {g: [g.free, g.free_inflight, g.free_capacity] for g in self._groups.values() if g.free}
        for worker_id in exclude:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.level is not None:
                counts = net[worker.group]
                counts[0] -= 1
                counts[1] -= worker.inflight
                counts[2] -= worker.capacity
        point = None if prefix is None else key_point(prefix)
        tiers: list[frozenset[str]] = [frozenset()]
        if needs:
            tiers.insert(0, needs)
        if prefer - needs:
            tiers.insert(0, needs | prefer)
        for wanted in tiers:
            groups = [
                (g, eligible, inflight, capacity)
                for g, (eligible, inflight, capacity) in net.items()
                if eligible and not wanted & g.lacks
            ]
            if groups:
                choice = self._choose_among(groups, point, rr_counter, load_factor, exclude, admit)
                if choice is not None:
                    return choice
        return None

    def _choose_among(
        self,
        groups: list[tuple[_Group, int, int, int]],
        point: int | None,
        rr_counter: int,
        load_factor: float,
        exclude: Collection[str],
        admit: Callable[[str], bool] | None,
    ) -> Choice | None:
        """Among (group, eligible, in-flight, capacity) rows, each with an eligible worker."""
        eligible = sum(row[1] for row in groups)
        priorities = {row[0].priority for row in groups}
        for priority in sorted(priorities, reverse=True) if len(priorities) > 1 else priorities:
            rows = sorted((row for row in groups if row[0].priority == priority), key=lambda row: row[0].order)
            top_class = [row[0] for row in rows]
            count = sum(row[1] for row in rows)
            if count == 1 and eligible > 1:
                worker_id = next(
                    w for g in top_class for level in g.levels for w in g.members[level] if w not in exclude
                )
                if admit is None or admit(worker_id):
                    return Choice(worker_id, "priority")
                continue
            if point is None:
                choice = _round_robin(top_class, rr_counter, exclude, admit)
            else:
                inflight = sum(row[2] for row in rows)
                capacity = sum(row[3] for row in rows)
                rings = [ring for g in top_class for ring in g.rings.values()]
                if self.keyed_search == "scan" or (
                    self.keyed_search == "auto" and count * count <= _SCAN_WHILE * sum(r.workers for r in rings)
                ):
                    order: Iterable[_Worker] = self._scored(top_class, point)
                else:
                    order = _key_order(rings, point, self._by_serial)
                choice = _keyed(order, load_factor * (inflight + 1), capacity, exclude, admit)
            if choice is not None:
                return choice
        return None

    def _scored(self, top_class: Sequence[_Group], point: int) -> list[_Worker]:
        """The class's admitted workers with a free slot in the key's order, each scored over its
        own points (the walk's order by its definition; module docstring)."""
        scored = []
        for group in top_class:
            for members in group.members.values():
                for worker_id in members:
                    worker = self._workers[worker_id]
                    points = worker.points
                    nearest = bisect_left(points, point)
                    distance = (points[nearest] if nearest < len(points) else points[0] + _RING) - point
                    scored.append(((distance << _SCORE_SHIFT) // worker.capacity, worker_id, worker))
        scored.sort()
        return [entry[2] for entry in scored]


def _keyed(
    order: Iterable[_Worker],
    slots_demanded: float,
    total_capacity: int,
    exclude: Collection[str],
    admit: Callable[[str], bool] | None,
) -> Choice | None:
    home = None
    for worker in order:
        if worker.level is None or worker.worker_id in exclude or (admit is not None and not admit(worker.worker_id)):
            continue
        if worker.inflight * total_capacity < slots_demanded * worker.capacity:
            return Choice(worker.worker_id, "affinity" if home is None else "affinity-spill")
        if home is None:
            home = worker
    return None if home is None else Choice(home.worker_id, "affinity")


def _key_order(rings: list[_Ring], point: int, by_serial: list[_Worker | None]) -> Iterator[_Worker]:
    """The rings' workers in the key's order, read lazily (module docstring).

    The heap holds two kinds of entries. A worker met on a ring: (its score, 1, its id, it).
    A ring's frontier: (a floor on the score of any worker not met on it yet, 0, the ring's
    index). At an equal score the frontier comes first, so a worker is yielded only once no
    worker still unmet could score as well. A ring whose workers have all been met has no
    frontier left: reading on would only meet their farther points.
    """
    heap: list[tuple] = []
    cursors: list[list] = []
    for index, ring in enumerate(rings):
        run, at = ring.start(point)
        cursors.append([run, at, ring.workers])
        position = ring.positions[run][at]
        heap.append(((((position - point) & _MASK) << _SCORE_SHIFT) // ring.max_capacity, 0, index))
    heapq.heapify(heap)
    met: set[str] = set()
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        entry = pop(heap)
        if entry[1]:
            yield entry[3]
            continue
        index = entry[2]
        ring = rings[index]
        cursor = cursors[index]
        run, at, unmet = cursor
        worker = by_serial[ring.owners[run][at]]
        if worker.worker_id not in met:
            met.add(worker.worker_id)
            distance = (ring.positions[run][at] - point) & _MASK
            push(heap, ((distance << _SCORE_SHIFT) // worker.capacity, 1, worker.worker_id, worker))
            unmet -= 1
            if not unmet:
                continue
        at += 1
        if at == len(ring.positions[run]):
            run = (run + 1) % len(ring.positions)
            at = 0
        cursor[0], cursor[1], cursor[2] = run, at, unmet
        distance = (ring.positions[run][at] - point) & _MASK
        push(heap, ((distance << _SCORE_SHIFT) // ring.max_capacity, 0, index))


def _load_level(inflight: int, capacity: int) -> int:
    """The load `inflight / capacity` as an integer that is equal for equal loads and ordered as
    they are: the ratio scaled by 2**128 and floored, exact for the same reason scores are
    (`_SCORE_SHIFT`). Hashing and comparing it costs a tenth of an exact `Fraction`'s, and the
    pool relists a worker on every change of its in-flight count."""
    return (inflight << _SCORE_SHIFT) // capacity


def _round_robin(
    top_class: Sequence[_Group], rr_counter: int, exclude: Collection[str], admit: Callable[[str], bool] | None
) -> Choice | None:
    last = None
    for level in top_class[0].levels if len(top_class) == 1 else heapq.merge(*(g.levels for g in top_class)):
        if level == last:
            continue
        last = level
        cycle = [members for g in top_class if (members := g.members.get(level)) is not None]
        for worker_id in _rotated(cycle, rr_counter % sum(map(len, cycle))):
            if worker_id not in exclude and (admit is None or admit(worker_id)):
                return Choice(worker_id, "round-robin")
    return None


def _rotated(cycle: list[list[str]], start: int) -> Iterator[str]:
    """The ids of the concatenated lists from position `start` on, wrapping round once."""
    first = 0
    while start >= len(cycle[first]):
        start -= len(cycle[first])
        first += 1
    head = cycle[first]
    for at in range(start, len(head)):
        yield head[at]
    for ids in cycle[first + 1 :] + cycle[:first]:
        yield from ids
    for at in range(start):
        yield head[at]


def _check_count(name: str, value: object, worker_id: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r} for worker {worker_id!r}")
