"""gateway.route_table: the routing table as workers join, leave and change. Its key's order is
the one its docstring defines (checked against every worker's distance, computed the slow way),
a table kept current by updates decides exactly as one built afresh from the same workers in any
order, the walk along the rings and the scan of the eligible workers read the same order, the
load bound and `exclude` hold, admission is honoured, a join or a leave moves only
that worker's keys and about its share of them, and shares follow capacity on a large sample.
test_router.py tests the decision's rules over lists of candidates."""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.gateway.routing.route_table import (
    DEFAULT_LOAD_FACTOR,
    POINTS_PER_WORKER,
    Candidate,
    Choice,
    RouteTable,
    key_point,
    worker_points,
)

FEATURES = ("sampling", "tools", "seeded-rank-sampling")
worker_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-/", min_size=1, max_size=10)
keys = st.binary(min_size=1, max_size=32)
counters = st.integers(min_value=0, max_value=10**9)
load_factors = st.sampled_from([1.0, 1.125, 1.25, 1.5, 2.0, 3.0])


searches = st.sampled_from(["walk", "scan", "auto"])


def table_of(workers, *, admitted: bool = True, search: str = "auto") -> RouteTable:
    table = RouteTable(keyed_search=search)
    for worker in workers:
        table.join(worker, admitted=admitted)
    return table


def slow_order(workers, prefix: bytes) -> list[str]:
    """The key's order by its definition: distance to the nearest point over capacity, then id."""
    point = key_point(prefix)

    def score(worker: Candidate) -> tuple[Fraction, str]:
        return Fraction(
            min((p - point) % 2**64 for p in worker_points(worker.worker_id)), worker.capacity
        ), worker.worker_id

    return [w.worker_id for w in sorted(workers, key=score)]


def within_bound(worker: Candidate, workers, load_factor: float) -> bool:
    mean_after = Fraction(sum(w.inflight for w in workers) + 1, sum(w.capacity for w in workers))
    return worker.inflight + 1 <= math.ceil(Fraction(load_factor) * mean_after * worker.capacity)


@st.composite
def idle_workers(draw, *, min_size: int = 1, max_size: int = 12):
    rows = draw(
        st.lists(
            st.tuples(worker_ids, st.integers(1, 2**20)),
            min_size=min_size,
            max_size=max_size,
            unique_by=lambda row: row[0],
        )
    )
    return [Candidate(worker_id=i, capacity=c, inflight=0) for i, c in rows]


@st.composite
def busy_workers(draw, *, max_size: int = 12):
    ids = draw(st.lists(worker_ids, min_size=1, max_size=max_size, unique=True))
    workers = []
    for worker_id in ids:
        capacity = draw(st.integers(0, 16))
        workers.append(
            Candidate(
                worker_id=worker_id,
                capacity=capacity,
                inflight=draw(st.integers(0, capacity + 2)),
                lacks=draw(st.frozensets(st.sampled_from(FEATURES))),
            )
        )
    return workers


# --- the key's order ---------------------------------------------------------------------------


@settings(deadline=None)  # builds tables of 256 points a worker per example: slow on a busy machine
@given(workers=idle_workers(), prefix=keys, search=searches)
def test_the_keys_order_ranks_workers_by_their_nearest_points_distance_over_capacity(workers, prefix, search):
    # Capacities up to 2**20 put many capacity bit lengths, so many rings, in one walk.
    table = table_of(workers, search=search)
    read = []
    while len(read) < len(workers):
        choice = table.choose(prefix=prefix, rr_counter=0, exclude=frozenset(read))
        assert choice is not None and choice.reason == "affinity"
        read.append(choice.worker_id)
    assert read == slow_order(workers, prefix)


@settings(deadline=None)  # builds tables of 256 points a worker per example: slow on a busy machine
@given(workers=busy_workers(), prefix=keys, load_factor=load_factors, search=searches, data=st.data())
def test_a_keyed_choice_is_the_first_eligible_worker_in_the_keys_order_within_the_load_bound(
    workers, prefix, load_factor, search, data
):
    exclude = frozenset(data.draw(st.lists(st.sampled_from([w.worker_id for w in workers]))))
    choice = table_of(workers, search=search).choose(
        prefix=prefix, rr_counter=0, load_factor=load_factor, exclude=exclude
    )
    eligible = [w for w in workers if w.inflight < w.capacity and w.worker_id not in exclude]
    assert (choice is None) == (not eligible)
    if choice is None:
        return
    by_id = {w.worker_id: w for w in eligible}
    order = slow_order(eligible, prefix)
    expected = next(w for w in order if within_bound(by_id[w], eligible, load_factor))
    assert choice == Choice(expected, "affinity" if expected == order[0] else "affinity-spill")


@settings(deadline=None)  # builds tables of 256 points a worker per example: slow on a busy machine
@given(workers=idle_workers(min_size=2), prefix=keys, search=searches, data=st.data())
def test_each_retry_goes_to_the_next_worker_in_the_keys_order(workers, prefix, search, data):
    order = slow_order(workers, prefix)
    failed = data.draw(st.integers(1, len(workers) - 1))
    retry = table_of(workers, search=search).choose(prefix=prefix, rr_counter=0, exclude=frozenset(order[:failed]))
    assert retry == Choice(order[failed], "affinity")


# --- a table kept current decides as one built afresh ------------------------------------------

operations = st.lists(
    st.tuples(
        st.sampled_from(["join", "leave", "capacity", "inflight", "admitted"]),
        st.integers(0, 7),
        st.integers(0, 18),
        st.booleans(),
        st.integers(0, 2),
        st.frozensets(st.sampled_from(FEATURES)),
    ),
    max_size=60,
)


@settings(deadline=None)  # builds tables of 256 points a worker per example: slow on a busy machine
@given(
    history=operations,
    ids=st.lists(worker_ids, min_size=8, max_size=8, unique=True),
    prefixes=st.lists(st.one_of(st.none(), keys), min_size=1, max_size=4),
    counter=counters,
    load_factor=load_factors,
    needs=st.frozensets(st.sampled_from(FEATURES)),
    prefer=st.frozensets(st.sampled_from(FEATURES)),
    data=st.data(),
)
def test_a_table_kept_current_decides_as_one_built_afresh_in_any_order(
    history, ids, prefixes, counter, load_factor, needs, prefer, data
):
    # The kept table walks the rings and the fresh one scans the eligible workers, so this also
    # checks that the two read one order on tables with full, unadmitted and unequal workers.
    table = RouteTable(keyed_search="walk")
    state: dict[str, tuple[Candidate, bool]] = {}
    for kind, index, number, flag, priority, lacks in history:
        worker_id = ids[index]
        if kind == "join" and worker_id not in state:
            worker = Candidate(
                worker_id=worker_id, capacity=number, inflight=number // 2, priority=priority, lacks=lacks
            )
            table.join(worker, admitted=flag)
            state[worker_id] = (worker, flag)
        elif worker_id not in state:
            continue
        elif kind == "leave":
            table.leave(worker_id)
            del state[worker_id]
        elif kind == "capacity":
            table.update(worker_id, capacity=number)
            worker, admitted = state[worker_id]
            state[worker_id] = (
                Candidate(
                    worker_id=worker_id,
                    capacity=number,
                    inflight=worker.inflight,
                    priority=worker.priority,
                    lacks=worker.lacks,
                ),
                admitted,
            )
        elif kind == "inflight":
            table.update(worker_id, inflight=number)
            worker, admitted = state[worker_id]
            state[worker_id] = (
                Candidate(
                    worker_id=worker_id,
                    capacity=worker.capacity,
                    inflight=number,
                    priority=worker.priority,
                    lacks=worker.lacks,
                ),
                admitted,
            )
        else:
            table.update(worker_id, admitted=flag)
            state[worker_id] = (state[worker_id][0], flag)
    fresh = RouteTable(keyed_search="scan")
    for worker_id in data.draw(st.permutations(list(state))):
        worker, admitted = state[worker_id]
        fresh.join(worker, admitted=admitted)
    assert sorted(table) == sorted(fresh) and all(table[w] == fresh[w] for w in table)
    exclude = frozenset(data.draw(st.lists(st.sampled_from(ids))))
    for prefix in prefixes:
        arguments = dict(
            prefix=prefix, rr_counter=counter, load_factor=load_factor, exclude=exclude, needs=needs, prefer=prefer
        )
        assert table.choose(**arguments) == fresh.choose(**arguments)


@settings(deadline=None)  # builds tables of 256 points a worker per example: slow on a busy machine
@given(workers=busy_workers(), prefix=st.one_of(st.none(), keys), counter=counters, search=searches, data=st.data())
def test_only_admitted_workers_that_admit_accepts_are_chosen(workers, prefix, counter, search, data):
    ids = [w.worker_id for w in workers]
    unadmitted = frozenset(data.draw(st.lists(st.sampled_from(ids))))
    refused = frozenset(data.draw(st.lists(st.sampled_from(ids))))
    table = RouteTable(keyed_search=search)
    for worker in workers:
        table.join(worker, admitted=worker.worker_id not in unadmitted)
    choice = table.choose(prefix=prefix, rr_counter=counter, admit=lambda worker_id: worker_id not in refused)
    possible = {w.worker_id for w in workers if w.inflight < w.capacity} - unadmitted - refused
    assert (choice is None) == (not possible)
    assert choice is None or choice.worker_id in possible


def test_a_hot_key_kept_in_the_table_fills_its_order_under_the_bound():
    workers = [Candidate(worker_id=f"w{i}", capacity=8, inflight=0) for i in range(6)]
    table = table_of(workers)
    order = slow_order(workers, b"hot")
    inflight = dict.fromkeys(order, 0)
    for placed in range(1, 6 * 8 + 1):
        choice = table.choose(prefix=b"hot", rr_counter=0)
        inflight[choice.worker_id] += 1
        table.update(choice.worker_id, inflight=inflight[choice.worker_id])
        assert max(inflight.values()) <= math.ceil(DEFAULT_LOAD_FACTOR * placed / len(workers))
        used = [w for w in order if inflight[w]]
        assert used == order[: len(used)], "overflow skipped a worker earlier in the key's order"
    assert table.choose(prefix=b"hot", rr_counter=0) is None
    table.update(order[3], inflight=7)
    assert table.choose(prefix=b"hot", rr_counter=0) == Choice(order[3], "affinity")


def test_round_robin_cycles_through_groups_that_lack_different_things():
    greedy = [Candidate(worker_id=f"g{i}", capacity=2, inflight=0, lacks=frozenset({"sampling"})) for i in range(3)]
    full = [Candidate(worker_id=f"f{i}", capacity=2, inflight=0) for i in range(2)]
    table = table_of(greedy + full)
    picks = [table.choose(prefix=None, rr_counter=n).worker_id for n in range(10)]
    assert picks[:5] == ["f0", "f1", "g0", "g1", "g2"] and picks[5:] == picks[:5]
    table.update("g1", inflight=1)
    assert "g1" not in {table.choose(prefix=None, rr_counter=n).worker_id for n in range(8)}, "only the least loaded"


# --- movement and shares on a large seeded sample ----------------------------------------------

MANY_KEYS = [hashlib.sha256(b"key" + i.to_bytes(4, "big")).digest() for i in range(20_000)]
SIGMAS = 6


def fleet(count: int) -> list[Candidate]:
    return [
        Candidate(worker_id=f"miner-{i:04d}/leg-{i % 3}", capacity=(4, 8, 16, 32)[i % 4], inflight=0)
        for i in range(count)
    ]


def homes(table: RouteTable) -> list[str]:
    return [table.choose(prefix=key, rr_counter=0).worker_id for key in MANY_KEYS]


def tolerance(expected: float, *, points: int) -> float:
    """6 standard deviations of a count of `expected` keys: binomial, plus the placement of the
    `points` ring points the share rests on (about share / sqrt(points); test_router.py)."""
    share = expected / len(MANY_KEYS)
    return SIGMAS * math.sqrt(expected * (1 - share) + expected**2 / points)


@pytest.mark.parametrize("capacity", [4, 32])
def test_a_join_moves_keys_only_to_the_new_worker_and_about_its_share_of_them(capacity):
    workers = fleet(300)
    table = table_of(workers)
    before = homes(table)
    table.join(Candidate(worker_id="newcomer", capacity=capacity, inflight=0), admitted=True)
    after = homes(table)
    moved = [b for b, a in zip(before, after) if a != b]
    assert {a for b, a in zip(before, after) if a != b} <= {"newcomer"}
    expected = len(MANY_KEYS) * capacity / (sum(w.capacity for w in workers) + capacity)
    assert abs(len(moved) - expected) <= tolerance(expected, points=POINTS_PER_WORKER)
    table.leave("newcomer")
    assert homes(table) == before, "leaving undoes the join exactly"


def test_a_leave_moves_only_the_keys_the_worker_was_home_to_and_spreads_them():
    workers = fleet(300)
    table = table_of(workers)
    before = homes(table)
    gone = "miner-0003/leg-0"  # capacity 32: home to about 200 of the keys
    table.leave(gone)
    after = homes(table)
    assert all(a == b for b, a in zip(before, after) if b != gone)
    inherited = [a for b, a in zip(before, after) if b == gone]
    assert len(inherited) > 100 and max(inherited.count(w) for w in set(inherited)) < len(inherited) / 4, (
        "its keys go to many workers, not to one neighbour"
    )


def test_shares_follow_capacity_on_a_large_sample():
    workers = fleet(400)
    counts = dict.fromkeys((4, 8, 16, 32), 0)
    capacity_of = {w.worker_id: w.capacity for w in workers}
    for home in homes(table_of(workers)):
        counts[capacity_of[home]] += 1
    total_capacity = sum(capacity_of.values())
    for capacity, count in counts.items():
        expected = len(MANY_KEYS) * capacity * 100 / total_capacity
        assert abs(count - expected) <= tolerance(expected, points=100 * POINTS_PER_WORKER), counts


# --- refusals ----------------------------------------------------------------------------------


def test_a_worker_id_twice_or_an_unknown_one_is_the_callers_bug():
    table = table_of([Candidate(worker_id="w", capacity=2, inflight=0)])
    with pytest.raises(ValueError, match="already in the table"):
        table.join(Candidate(worker_id="w", capacity=4, inflight=0))
    for change in (lambda: table.leave("x"), lambda: table.update("x", inflight=1), lambda: table.admitted("x")):
        with pytest.raises(ValueError, match="not in the table"):
            change()


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"capacity": -1}, "capacity"),
        ({"inflight": -2}, "inflight"),
        ({"inflight": True}, "inflight"),
        ({"capacity": 1.5}, "capacity"),
    ],
)
def test_an_update_with_impossible_numbers_is_refused_and_changes_nothing(fields, names):
    table = table_of([Candidate(worker_id="w", capacity=2, inflight=1)])
    with pytest.raises(ValueError, match=names):
        table.update("w", **fields)
    assert table["w"] == Candidate(worker_id="w", capacity=2, inflight=1)
    assert table.choose(prefix=None, rr_counter=0) == Choice("w", "round-robin")


def test_an_unknown_keyed_search_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'auto', 'walk' or 'scan'"):
        RouteTable(keyed_search="fast")


@pytest.mark.parametrize(
    ("arguments", "names"), [({"load_factor": 0.5}, "load_factor"), ({"rr_counter": -1}, "rr_counter")]
)
def test_nonsense_choose_arguments_are_refused_naming_the_argument(arguments, names):
    with pytest.raises(ValueError, match=names):
        RouteTable().choose(**{"prefix": None, "rr_counter": 0, **arguments})
