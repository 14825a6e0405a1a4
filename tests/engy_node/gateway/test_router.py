"""gateway.router: stable prefix keys, affinity in the key's order under a load bound, fair
round-robin, priority classes, what a request needs, and the retry rule. `choose` over a list of
candidates is the routing table's decision (test_route_table.py tests the table as it changes)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import types
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engy_node.gateway.routing.route_table import POINTS_PER_WORKER, RouteTable
from engy_node.gateway.routing.router import (
    DEFAULT_LOAD_FACTOR,
    MIN_USEFUL_PREFIX_CHARS,
    PREFIX_PART_CHARS,
    Candidate,
    Choice,
    choose,
    prefix_key,
    retry_allowed,
)

# --- strategies and helpers -------------------------------------------------------------------

worker_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-/", min_size=1, max_size=10)
# Dyadic factors, so float products are exact and the test's exact arithmetic agrees with the
# router's float arithmetic at every boundary.
load_factors = st.sampled_from([1.0, 1.125, 1.25, 1.5, 2.0, 3.0])
counters = st.integers(min_value=0, max_value=10**9)
keys = st.binary(min_size=1, max_size=32)
texts = st.text(max_size=500)


@st.composite
def snapshots(draw, *, min_size: int = 0, max_size: int = 12, priorities=st.integers(0, 2)) -> list[Candidate]:
    ids = draw(st.lists(worker_ids, min_size=min_size, max_size=max_size, unique=True))
    snapshot = []
    for worker_id in ids:
        capacity = draw(st.integers(0, 16))
        snapshot.append(
            Candidate(
                worker_id=worker_id,
                capacity=capacity,
                inflight=draw(st.integers(0, capacity + 2)),
                priority=draw(priorities),
                lacks=draw(st.frozensets(st.sampled_from(FEATURES))),
            )
        )
    return snapshot


def eligible_top_class(snapshot, exclude=frozenset()) -> tuple[list[Candidate], list[Candidate]]:
    eligible = [w for w in snapshot if w.inflight < w.capacity and w.worker_id not in exclude]
    if not eligible:
        return [], []
    top = max(w.priority for w in eligible)
    return eligible, [w for w in eligible if w.priority == top]


def within_bound(worker: Candidate, workers: list[Candidate], load_factor: float) -> bool:
    """The bound in the words of docs/architecture.md ("Routing"): load after the assignment at
    most load_factor × the mean load after it, rounded up to a whole request."""
    mean_after = Fraction(sum(w.inflight for w in workers) + 1, sum(w.capacity for w in workers))
    return worker.inflight + 1 <= math.ceil(Fraction(load_factor) * mean_after * worker.capacity)


def key_order(workers: list[Candidate], prefix: bytes) -> list[str]:
    """The key's order, read through the public API: on an idle snapshot nobody is over the
    bound, so `choose` returns the best-ranked worker not yet excluded."""
    idle = [dataclasses.replace(w, inflight=0, priority=0) for w in workers]
    ranking: list[str] = []
    while len(ranking) < len(idle):
        choice = choose(candidates=idle, prefix=prefix, rr_counter=0, exclude=frozenset(ranking))
        assert choice is not None and choice.reason == "affinity"
        ranking.append(choice.worker_id)
    return ranking


def load(worker: Candidate) -> Fraction:
    return Fraction(worker.inflight, worker.capacity)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def tool(name: str, description: str = "") -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object"}},
    }


turns = st.lists(
    st.one_of(
        st.builds(user, texts),
        st.builds(assistant, texts),
        st.builds(lambda text, call_id: {"role": "tool", "content": text, "tool_call_id": call_id}, texts, worker_ids),
    ),
    max_size=5,
)
tool_lists = st.one_of(st.none(), st.lists(st.builds(tool, worker_ids, texts), max_size=3))
system_prompts = st.lists(st.builds(system, texts), max_size=2)

# --- prefix_key --------------------------------------------------------------------------------


@given(head=system_prompts, tools=tool_lists, first=texts, later=turns, appended=turns.filter(bool))
def test_appending_turns_never_changes_a_conversations_key(head, tools, first, later, appended):
    conversation = [*head, user(first), *later]
    key = prefix_key(messages=conversation, tools=tools)
    assume(key is not None)
    assert prefix_key(messages=conversation + appended, tools=tools) == key


@given(head=system_prompts, tools=tool_lists, first=texts, later=turns)
def test_a_request_with_a_useful_amount_of_text_always_has_a_key(head, tools, first, later):
    conversation = [*head, user(first), *later]
    content_chars = sum(len(m["content"]) for m in conversation) + sum(
        len(t["function"]["description"]) for t in tools or ()
    )
    if content_chars >= MIN_USEFUL_PREFIX_CHARS:
        assert prefix_key(messages=conversation, tools=tools) is not None


@given(
    prompt=texts,
    tools=st.lists(st.builds(tool, worker_ids, texts), min_size=1, max_size=3),
    first=texts,
    later=turns,
    changed=st.sampled_from(["system prompt", "tools", "first user turn"]),
)
def test_changing_the_system_prompt_the_tools_or_the_first_user_turn_changes_the_key(
    prompt, tools, first, later, changed
):
    # Every part here renders well under PREFIX_PART_CHARS, so each change falls inside the cap.
    def key(prompt, tools, first):
        return prefix_key(messages=[system(prompt), user(first), *later], tools=tools)

    before = key(prompt, tools, first)
    assume(before is not None)
    if changed == "system prompt":
        after = key(prompt + "!", tools, first)
    elif changed == "tools":
        after = key(prompt, [*tools, tool("extra")], first)
    else:
        after = key(prompt, tools, first + "!")
    assert after is not None and after != before


def test_conversations_sharing_a_long_system_prompt_are_told_apart_by_their_first_user_turn():
    prompt = system("You are a coding agent. " * 1000)  # far past the cap
    tools = [tool(f"tool_{i}", "does a thing " * 50) for i in range(20)]
    first = prefix_key(messages=[prompt, user("fix the bug in parser.py")], tools=tools)
    second = prefix_key(messages=[prompt, user("write tests for router.py")], tools=tools)
    assert first is not None and second is not None and first != second


def test_each_part_counts_only_its_first_part_chars_characters():
    long_head = "a" * PREFIX_PART_CHARS
    assert prefix_key(messages=[user(long_head + "b")]) == prefix_key(messages=[user(long_head + "c")])
    assert prefix_key(messages=[system(long_head + "b"), user("hi")]) == prefix_key(
        messages=[system(long_head + "c"), user("hi")]
    )


def test_a_short_request_has_no_key_and_so_goes_round_robin():
    assert prefix_key(messages=[user("hi")]) is None
    assert prefix_key(messages=[system("You are a helpful assistant."), user("hi")]) is None
    assert prefix_key(messages=[], tools=None) is None
    assert prefix_key(messages=[user("x" * MIN_USEFUL_PREFIX_CHARS)]) is not None
    assert prefix_key(messages=[user("hi")], tools=[tool("search", "Search the web for a query. " * 10)]) is not None


def test_a_conversation_that_starts_short_gets_its_key_once_it_grows_and_keeps_it():
    opening = [user("hi")]
    grown = [*opening, assistant("Hello! " + "How can I help you today? " * 12), user("Tell me about trio.")]
    assert prefix_key(messages=opening) is None
    key = prefix_key(messages=grown)
    assert key is not None
    assert prefix_key(messages=[*grown, assistant("Trio is a library."), user("And nurseries?")]) == key


def test_no_tools_and_an_empty_tool_list_give_the_same_key():
    conversation = [system("Answer briefly. " * 30), user("What is HRW hashing?")]
    assert prefix_key(messages=conversation, tools=None) == prefix_key(messages=conversation, tools=[])


def test_read_only_message_views_and_lone_surrogates_are_keyed_like_any_message():
    message = {"role": "user", "content": "q" * 300}
    assert prefix_key(messages=[types.MappingProxyType(message)]) == prefix_key(messages=[message])
    assert prefix_key(messages=[user("\ud800" * 300)]) is not None


def test_a_message_holding_something_with_no_json_form_is_refused_naming_the_type():
    with pytest.raises(TypeError, match="object"):
        prefix_key(messages=[{"role": "user", "content": object()}])


# --- choose: eligibility and priority ----------------------------------------------------------


@given(snapshot=snapshots(), prefix=st.one_of(st.none(), keys), counter=counters, data=st.data())
def test_only_a_worker_with_a_free_slot_not_yet_tried_is_chosen_and_none_means_there_was_none(
    snapshot, prefix, counter, data
):
    ids = [w.worker_id for w in snapshot]
    exclude = data.draw(st.frozensets(st.sampled_from(ids)) if ids else st.just(frozenset()))
    choice = choose(candidates=snapshot, prefix=prefix, rr_counter=counter, exclude=exclude)
    eligible, _ = eligible_top_class(snapshot, exclude)
    assert (choice is None) == (not eligible)
    if choice is not None:
        assert choice.worker_id in {w.worker_id for w in eligible}


@given(snapshot=snapshots(min_size=1), prefix=st.one_of(st.none(), keys), counter=counters)
def test_the_highest_priority_class_with_a_free_slot_always_wins(snapshot, prefix, counter):
    choice = choose(candidates=snapshot, prefix=prefix, rr_counter=counter)
    eligible, top_class = eligible_top_class(snapshot)
    assume(choice is not None)
    assert choice.worker_id in {w.worker_id for w in top_class}
    assert (choice.reason == "priority") == (len(top_class) == 1 and len(eligible) > 1)


def test_a_lower_class_serves_only_while_the_higher_class_is_full():
    first_party = Candidate(worker_id="own", capacity=2, inflight=0, priority=1, first_party=True)
    miners = [Candidate(worker_id=f"m{i}", capacity=4, inflight=0) for i in range(3)]
    assert choose(candidates=[first_party, *miners], prefix=b"k", rr_counter=0) == Choice("own", "priority")
    full = dataclasses.replace(first_party, inflight=2)
    assert choose(candidates=[full, *miners], prefix=b"k", rr_counter=0).worker_id.startswith("m")


# --- choose: affinity in the key's order and the load bound --------------------------------------------


@settings(deadline=None)  # builds a table (256 points a worker) per decision: slow on a busy machine
@given(snapshot=snapshots(min_size=1), prefix=keys, load_factor=load_factors)
def test_a_keyed_request_goes_to_the_highest_ranked_worker_within_the_load_bound(snapshot, prefix, load_factor):
    choice = choose(candidates=snapshot, prefix=prefix, rr_counter=0, load_factor=load_factor)
    _, top_class = eligible_top_class(snapshot)
    assume(choice is not None and choice.reason != "priority")
    by_id = {w.worker_id: w for w in top_class}
    ranking = key_order(top_class, prefix)
    best_within = next(w for w in ranking if within_bound(by_id[w], top_class, load_factor))
    assert choice.worker_id == best_within
    assert within_bound(by_id[choice.worker_id], top_class, load_factor)
    assert choice.reason == ("affinity" if best_within == ranking[0] else "affinity-spill")


@given(snapshot=snapshots(min_size=1), load_factor=load_factors)
def test_some_eligible_worker_is_always_within_the_load_bound(snapshot, load_factor):
    # The "unless every eligible worker is above the bound" case cannot happen for factors >= 1:
    # the rounded-up bounds sum to at least m slots and only m - 1 requests are in flight.
    _, top_class = eligible_top_class(snapshot)
    assume(top_class)
    assert any(within_bound(w, top_class, load_factor) for w in top_class)


@given(capacities=st.lists(st.integers(1, 16), min_size=1, max_size=10), prefix=keys)
def test_an_idle_cluster_always_keeps_affinity(capacities, prefix):
    snapshot = [Candidate(worker_id=f"w{i}", capacity=c, inflight=0) for i, c in enumerate(capacities)]
    assert choose(candidates=snapshot, prefix=prefix, rr_counter=0).reason == "affinity"


def test_a_hot_prefix_fills_its_home_to_a_quarter_past_its_fair_share_then_overflows_in_ranking_order():
    snapshot = [Candidate(worker_id=f"w{i}", capacity=8, inflight=0) for i in range(4)]
    ranking = key_order(snapshot, b"hot")
    for placed in range(1, 33):
        choice = choose(candidates=snapshot, prefix=b"hot", rr_counter=0)
        snapshot = [dataclasses.replace(w, inflight=w.inflight + (w.worker_id == choice.worker_id)) for w in snapshot]
        inflight = {w.worker_id: w.inflight for w in snapshot}
        fair_share = placed / len(snapshot)
        assert all(n <= math.ceil(DEFAULT_LOAD_FACTOR * fair_share) for n in inflight.values())
        used = [w for w in ranking if inflight[w]]
        assert used == ranking[: len(used)], "overflow skipped a better-ranked worker"
    assert choose(candidates=snapshot, prefix=b"hot", rr_counter=0) is None


def test_a_retry_goes_to_the_next_worker_in_the_keys_ranking():
    snapshot = [Candidate(worker_id=f"w{i}", capacity=4, inflight=0) for i in range(6)]
    ranking = key_order(snapshot, b"conversation")
    retry = choose(candidates=snapshot, prefix=b"conversation", rr_counter=0, exclude=frozenset(ranking[:1]))
    assert retry.worker_id == ranking[1]


def idle_homes(snapshot: list[Candidate], prefixes: list[bytes]) -> dict[bytes, str]:
    table = RouteTable()
    for candidate in snapshot:
        table.join(candidate, admitted=True)
    return {p: table.choose(prefix=p, rr_counter=0).worker_id for p in prefixes}


idle_snapshots = st.lists(
    st.tuples(worker_ids, st.integers(1, 8)), min_size=2, max_size=10, unique_by=lambda t: t[0]
).map(lambda rows: [Candidate(worker_id=i, capacity=c, inflight=0) for i, c in rows])
prefix_sets = st.lists(keys, min_size=1, max_size=40, unique=True)


@settings(deadline=None)  # builds a table (256 points a worker) per decision: slow on a busy machine
@given(snapshot=idle_snapshots, prefixes=prefix_sets, data=st.data())
def test_removing_a_worker_moves_only_the_keys_it_was_home_to(snapshot, prefixes, data):
    removed = data.draw(st.sampled_from([w.worker_id for w in snapshot]))
    before = idle_homes(snapshot, prefixes)
    after = idle_homes([w for w in snapshot if w.worker_id != removed], prefixes)
    assert all(after[p] == before[p] for p in prefixes if before[p] != removed)


@settings(deadline=None)  # builds a table (256 points a worker) per decision: slow on a busy machine
@given(snapshot=idle_snapshots, prefixes=prefix_sets, capacity=st.integers(1, 8))
def test_adding_a_worker_moves_keys_only_to_it(snapshot, prefixes, capacity):
    added = Candidate(worker_id="added!", capacity=capacity, inflight=0)
    before = idle_homes(snapshot, prefixes)
    after = idle_homes([*snapshot, added], prefixes)
    assert all(after[p] in (before[p], "added!") for p in prefixes)


@settings(deadline=None)  # builds a table (256 points a worker) per decision: slow on a busy machine
@given(snapshot=idle_snapshots, prefixes=prefix_sets, data=st.data())
def test_resizing_a_worker_moves_keys_only_to_or_from_it(snapshot, prefixes, data):
    index = data.draw(st.integers(0, len(snapshot) - 1))
    resized = dataclasses.replace(snapshot[index], capacity=data.draw(st.integers(1, 8)))
    before = idle_homes(snapshot, prefixes)
    after = idle_homes([*snapshot[:index], resized, *snapshot[index + 1 :]], prefixes)
    assert all(after[p] == before[p] for p in prefixes if resized.worker_id not in (before[p], after[p]))


# Spread. Each of K keys lands on worker i with probability p_i, its share of the ring, so its
# count is Binomial(K, p_i), standard deviation sqrt(K p_i (1 - p_i)). Unlike rendezvous hashing
# over every worker, p_i is not exactly the capacity share c_i: it is set by where the worker's
# points fall, a sum over its POINTS_PER_WORKER nearest arcs, off the capacity share by about
# c_i / sqrt(POINTS_PER_WORKER) (one standard deviation, 6 % at 256 points; route_table's
# docstring). So a worker's count has both spreads, and we allow 6 standard deviations of their
# sum: for draws that behave as random, the chance that any worker in these cases falls outside
# is below 31 workers × 2e-9 (two-sided normal tail at 6 σ), so a failure means bias, not bad
# luck. The keys and ids are fixed, so the tests are deterministic. Where the placement spread
# would make one worker's tolerance loose, the capacity test sums many workers of a capacity, so
# that their placements average out.
SPREAD_KEYS = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(20_000)]
SPREAD_SIGMAS = 6


def assert_spread(counts: dict[str, int], shares: dict[str, float], *, points: int) -> None:
    """`shares`: each name's capacity share; `points`: how many ring points its count rests on."""
    total = sum(counts.values())
    for name, share in shares.items():
        variance = total * share * (1 - share) + (total * share) ** 2 / points
        assert abs(counts.get(name, 0) - total * share) <= SPREAD_SIGMAS * math.sqrt(variance), (name, counts)


def homes(snapshot: list[Candidate]) -> list[str]:
    """Each spread key's home. One table answers them all: a decision over the list would build
    it again for every key."""
    table = RouteTable()
    for candidate in snapshot:
        table.join(candidate, admitted=True)
    return [table.choose(prefix=key, rr_counter=0).worker_id for key in SPREAD_KEYS]


@pytest.mark.parametrize("workers", [2, 3, 16])
def test_keys_spread_evenly_over_equal_workers(workers):
    snapshot = [Candidate(worker_id=f"miner-{i}/leg-0", capacity=8, inflight=0) for i in range(workers)]
    counts: dict[str, int] = {}
    for home in homes(snapshot):
        counts[home] = counts.get(home, 0) + 1
    assert choose(candidates=snapshot, prefix=SPREAD_KEYS[0], rr_counter=0).worker_id == homes(snapshot)[0]
    assert_spread(counts, {w.worker_id: 1 / workers for w in snapshot}, points=POINTS_PER_WORKER)


def test_keys_spread_in_proportion_to_capacity():
    capacities = {"small": 2, "medium": 4, "big": 6, "huge": 12}
    per_capacity = 24
    snapshot = [
        Candidate(worker_id=f"{name}-{i}", capacity=c, inflight=0)
        for name, c in capacities.items()
        for i in range(per_capacity)
    ]
    counts: dict[str, int] = {}
    for home in homes(snapshot):
        name = home.split("-")[0]
        counts[name] = counts.get(name, 0) + 1
    assert_spread(
        counts,
        {name: c / sum(capacities.values()) for name, c in capacities.items()},
        points=per_capacity * POINTS_PER_WORKER,
    )


# --- choose: round-robin -----------------------------------------------------------------------


@given(
    rows=st.lists(st.tuples(worker_ids, st.integers(1, 4)), min_size=1, max_size=12, unique_by=lambda t: t[0]),
    base=st.integers(2, 8),
    busy=st.integers(0, 1),
    start=counters,
)
def test_round_robin_visits_each_equally_loaded_worker_once_per_cycle_in_id_order(rows, base, busy, start):
    # Capacities differ, loads are equal: worker i has k_i * base slots and k_i * busy in flight.
    snapshot = [Candidate(worker_id=i, capacity=k * base, inflight=k * busy) for i, k in rows]
    ids = sorted(i for i, _ in rows)
    picks = [
        choose(candidates=snapshot, prefix=None, rr_counter=start + n, exclude=frozenset()).worker_id
        for n in range(len(ids))
    ]
    offset = start % len(ids)
    assert picks == ids[offset:] + ids[:offset]
    assert all(choose(candidates=snapshot, prefix=None, rr_counter=start).reason == "round-robin" for _ in range(2))


@given(snapshot=snapshots(min_size=1, priorities=st.just(0)), counter=counters)
def test_round_robin_picks_among_the_least_loaded_workers(snapshot, counter):
    choice = choose(candidates=snapshot, prefix=None, rr_counter=counter)
    _, top_class = eligible_top_class(snapshot)
    assume(choice is not None)
    chosen = next(w for w in top_class if w.worker_id == choice.worker_id)
    assert load(chosen) == min(load(w) for w in top_class)


# --- choose: determinism -----------------------------------------------------------------------


@given(
    snapshot=snapshots(), prefix=st.one_of(st.none(), keys), counter=counters, load_factor=load_factors, data=st.data()
)
def test_a_decision_depends_only_on_its_inputs_not_on_candidate_order(snapshot, prefix, counter, load_factor, data):
    shuffled = data.draw(st.permutations(snapshot))

    def decide(candidates):
        return choose(candidates=candidates, prefix=prefix, rr_counter=counter, load_factor=load_factor)

    assert decide(snapshot) == decide(list(shuffled)) == decide(tuple(snapshot))


# --- retry_allowed -----------------------------------------------------------------------------


@given(
    first_byte_sent=st.booleans(),
    attempts=st.integers(1, 10),
    max_attempts=st.integers(1, 10),
    time_left_s=st.floats(allow_nan=False),
)
def test_a_retry_happens_only_before_the_first_byte_within_the_attempt_budget_and_the_deadline(
    first_byte_sent, attempts, max_attempts, time_left_s
):
    allowed = retry_allowed(
        first_byte_sent=first_byte_sent, attempts=attempts, max_attempts=max_attempts, time_left_s=time_left_s
    )
    assert allowed == (not first_byte_sent and attempts < max_attempts and time_left_s > 0)


def test_once_a_byte_reached_the_buyer_or_the_deadline_passed_nothing_is_retried():
    assert retry_allowed(first_byte_sent=False, attempts=1, max_attempts=3, time_left_s=10.0)
    assert not retry_allowed(first_byte_sent=True, attempts=1, max_attempts=3, time_left_s=10.0)
    assert not retry_allowed(first_byte_sent=False, attempts=3, max_attempts=3, time_left_s=10.0)
    assert not retry_allowed(first_byte_sent=False, attempts=1, max_attempts=3, time_left_s=0.0)


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"load_factor": 0.99}, "load_factor"),
        ({"load_factor": math.nan}, "load_factor"),
        ({"load_factor": math.inf}, "load_factor"),
        ({"rr_counter": -1}, "rr_counter"),
        ({"rr_counter": True}, "rr_counter"),
    ],
)
def test_nonsense_choose_arguments_are_refused_naming_the_argument(kwargs, names):
    arguments = {"candidates": [], "prefix": None, "rr_counter": 0, **kwargs}
    with pytest.raises(ValueError, match=names):
        choose(**arguments)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"worker_id": ""}, "worker_id"),
        ({"capacity": -1}, "capacity"),
        ({"inflight": -1}, "inflight"),
        ({"capacity": True}, "capacity"),
        ({"priority": 1.5}, "priority"),
    ],
)
def test_a_candidate_with_impossible_numbers_is_refused(fields, names):
    with pytest.raises(ValueError, match=names):
        Candidate(**{"worker_id": "w", "capacity": 4, "inflight": 0, **fields})


@pytest.mark.parametrize(
    ("attempts", "max_attempts", "time_left_s"), [(0, 3, 1.0), (1, 0, 1.0), (True, 3, 1.0), (1, 3, math.nan)]
)
def test_nonsense_retry_arguments_are_refused(attempts, max_attempts, time_left_s):
    with pytest.raises(ValueError):
        retry_allowed(first_byte_sent=False, attempts=attempts, max_attempts=max_attempts, time_left_s=time_left_s)


@pytest.mark.parametrize(
    ("workers", "home_takes"),
    [
        (1, 4),  # alone: only capacity stops it
        (2, 2),  # the 3rd request: 1.25 × 3 in flight / 2 workers = 1.875, rounds up to 2 slots, so it spills
        (4, 1),  # the 2nd request: 1.25 × 2 / 4 = 0.625, rounds up to 1 slot, so it spills
        (16, 1),
    ],
)
def test_the_default_load_factor_lets_a_hot_key_hold_its_home_a_quarter_past_its_fair_share(workers, home_takes):
    # The margin the module derives, asserted as numbers: concurrent requests for one key on an
    # idle cluster of equal 4-slot workers stay on the key's home until its load after the next
    # one would pass ceil(1.25 × the mean).
    assert DEFAULT_LOAD_FACTOR == 1.25
    snapshot = [Candidate(worker_id=f"w{i}", capacity=4, inflight=0) for i in range(workers)]
    home = choose(candidates=snapshot, prefix=b"hot", rr_counter=0).worker_id
    taken = 0
    while (choice := choose(candidates=snapshot, prefix=b"hot", rr_counter=0)) is not None and choice.worker_id == home:
        taken += 1
        snapshot = [dataclasses.replace(w, inflight=w.inflight + (w.worker_id == home)) for w in snapshot]
    assert taken == home_takes
    assert choice is None or choice.reason == "affinity-spill"


# --- requests that need what some workers do not honour ----------------------------------------

FEATURES = ("sampling", "tools", "seeded-rank-sampling")


def free(worker: Candidate, exclude=frozenset()) -> bool:
    return worker.inflight < worker.capacity and worker.worker_id not in exclude


@given(snapshot=snapshots(), prefix=keys, counter=counters, data=st.data())
def test_a_request_that_needs_nothing_may_go_to_any_worker(snapshot, prefix, counter, data):
    # What a worker lacks does not move it in a key's order or out of the load bound's counts.
    exclude = frozenset(data.draw(st.lists(st.sampled_from([c.worker_id for c in snapshot]))) if snapshot else [])
    lacking_nothing = [dataclasses.replace(c, lacks=frozenset()) for c in snapshot]
    assert choose(candidates=snapshot, prefix=prefix, rr_counter=counter, exclude=exclude) == choose(
        candidates=lacking_nothing, prefix=prefix, rr_counter=counter, exclude=exclude
    )


@given(
    snapshot=snapshots(),
    needs=st.frozensets(st.sampled_from(FEATURES), min_size=1),
    prefix=st.one_of(st.none(), keys),
    counter=counters,
    data=st.data(),
)
def test_a_request_goes_to_a_worker_that_honours_what_it_needs_whenever_one_has_room(
    snapshot, needs, prefix, counter, data
):
    exclude = frozenset(data.draw(st.lists(st.sampled_from([c.worker_id for c in snapshot]))) if snapshot else [])
    choice = choose(candidates=snapshot, prefix=prefix, rr_counter=counter, exclude=exclude, needs=needs)
    by_id = {c.worker_id: c for c in snapshot}
    room = any(not needs & c.lacks and free(c, exclude) for c in snapshot)
    if room:
        assert choice is not None and not needs & by_id[choice.worker_id].lacks
    elif choice is not None:
        assert needs & by_id[choice.worker_id].lacks, "when one is chosen, it lacks something the request needs"
    # Falling back never loses a request that any worker could take.
    assert (choice is None) == (not any(free(c, exclude) for c in snapshot))


def test_a_sampled_request_waits_for_no_one_when_only_greedy_workers_have_room():
    sampler = Candidate(worker_id="sampler", capacity=1, inflight=1)
    greedy = Candidate(worker_id="greedy", capacity=4, inflight=0, lacks=frozenset({"sampling", "tools"}))
    assert choose(candidates=[sampler, greedy], prefix=None, rr_counter=0, needs=frozenset({"sampling"})) == Choice(
        "greedy", "round-robin"
    )


@given(
    snapshot=snapshots(),
    needs=st.frozensets(st.sampled_from(FEATURES)),
    prefer=st.frozensets(st.sampled_from(FEATURES), min_size=1),
    prefix=st.one_of(st.none(), keys),
    counter=counters,
    data=st.data(),
)
def test_a_preference_is_met_whenever_a_worker_with_it_has_room_and_never_at_the_cost_of_a_need(
    snapshot, needs, prefer, prefix, counter, data
):
    exclude = frozenset(data.draw(st.lists(st.sampled_from([c.worker_id for c in snapshot]))) if snapshot else [])
    choice = choose(candidates=snapshot, prefix=prefix, rr_counter=counter, exclude=exclude, needs=needs, prefer=prefer)
    by_id = {c.worker_id: c for c in snapshot}
    if any(not (needs | prefer) & c.lacks and free(c, exclude) for c in snapshot):
        assert choice is not None and not (needs | prefer) & by_id[choice.worker_id].lacks
    elif any(not needs & c.lacks and free(c, exclude) for c in snapshot):
        assert choice is not None and not needs & by_id[choice.worker_id].lacks
    assert (choice is None) == (not any(free(c, exclude) for c in snapshot))


def test_a_sampled_request_goes_to_a_seeded_sampler_first_then_any_sampler_then_anyone():
    seeded = Candidate(worker_id="seeded", capacity=1, inflight=0)
    sampler = Candidate(worker_id="sampler", capacity=1, inflight=0, lacks=frozenset({"seeded-rank-sampling"}))
    greedy = Candidate(
        worker_id="greedy", capacity=1, inflight=0, lacks=frozenset({"sampling", "seeded-rank-sampling", "tools"})
    )
    sampled = dict(needs=frozenset({"sampling"}), prefer=frozenset({"seeded-rank-sampling"}))
    picks = []
    for exclude in (frozenset(), {"seeded"}, {"seeded", "sampler"}):
        picks.append(
            choose(
                candidates=[greedy, sampler, seeded], prefix=None, rr_counter=0, exclude=exclude, **sampled
            ).worker_id
        )
    assert picks == ["seeded", "sampler", "greedy"]
