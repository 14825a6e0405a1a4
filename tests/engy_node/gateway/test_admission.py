"""The waiting room's turns: fair across buyers, first come first served within one, bounded."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from engy_node.gateway.request.admission import WaitingRoom


def test_lines_take_turns_so_one_buyers_backlog_does_not_starve_another():
    room = WaitingRoom(max_waiting=100)
    heavy = [room.join("m", "heavy") for _ in range(5)]
    light = room.join("m", "light")
    served = []
    while (ticket := room.turn("m")) is not None:
        served.append(ticket)
        room.leave(ticket, served=True)
    assert served == [heavy[0], light, *heavy[1:]]


def test_a_full_queue_refuses_and_queues_are_per_model():
    room = WaitingRoom(max_waiting=2)
    assert room.join("a", 1) and room.join("a", 2)
    assert room.join("a", 3) is None
    assert room.join("b", 3) is not None
    assert (room.depth("a"), room.depth("b")) == (2, 1)


def test_giving_up_keeps_the_rotation_and_leaving_twice_is_harmless():
    room = WaitingRoom(max_waiting=10)
    first, second = room.join("m", "x"), room.join("m", "x")
    other = room.join("m", "y")
    room.leave(second, served=False)
    room.leave(second, served=False)
    assert room.depth("m") == 2
    assert room.turn("m") is first
    room.leave(first, served=False)
    assert room.turn("m") is other
    room.leave(other, served=True)
    assert room.turn("m") is None and room.depth("m") == 0


operations = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.sampled_from("abcd")),
        st.tuples(st.just("serve"), st.just("")),
        st.tuples(st.just("give_up"), st.integers(0, 50)),
    ),
    max_size=120,
)


@given(operations)
# A buyer whose last ticket gave up comes back as a fresh arrival (a random draw found it).
@example(
    [("join", "a")] * 5
    + [
        ("join", "b"),
        ("join", "c"),
        ("serve", ""),
        ("serve", ""),
        ("give_up", 0),
        ("give_up", 3),
        ("join", "c"),
        ("serve", ""),
    ]
)
# Four buyers served in turn: the last waits through three turns, one of each other buyer's, which
# is fair (a draw found the model that counted turns against the buyers left waiting wrong).
@example([("join", "a"), ("join", "b"), ("join", "c"), ("join", "d")] + [("serve", "")] * 3)
def test_any_sequence_keeps_the_counts_bounds_and_fairness(steps):
    room = WaitingRoom(max_waiting=8)
    waiting = []
    # Per waiting buyer, the buyers served since it arrived or was last served.
    served_while_waiting: dict[str, set[str]] = {}
    for action, argument in steps:
        if action == "join":
            ticket = room.join("m", argument)
            assert (ticket is None) == (len(waiting) >= 8)
            if ticket is not None:
                waiting.append(ticket)
        elif action == "serve":
            ticket = room.turn("m")
            assert (ticket is None) == (not waiting)
            if ticket is None:
                continue
            # Within a buyer, first come first served.
            assert ticket is next(t for t in waiting if t.buyer == ticket.buyer)
            # Across buyers, no buyer is served twice while another waited through both turns.
            for buyer in {t.buyer for t in waiting if t.buyer != ticket.buyer}:
                passed_by = served_while_waiting.setdefault(buyer, set())
                assert ticket.buyer not in passed_by, f"{ticket.buyer} served twice while {buyer} waited"
                passed_by.add(ticket.buyer)
            served_while_waiting[ticket.buyer] = set()
            room.leave(ticket, served=True)
            waiting.remove(ticket)
        elif waiting:
            ticket = waiting.pop(argument % len(waiting))
            room.leave(ticket, served=False)
            if all(t.buyer != ticket.buyer for t in waiting):
                # A buyer with nothing left waiting waited through no later turn: if it comes
                # back, it starts afresh (a new arrival, not one passed over).
                served_while_waiting.pop(ticket.buyer, None)
        assert room.depth("m") == len(waiting)
