"""bodies: the room for request bodies being received, all together and per account (issue 33,
item 8). The decision against its definition; the budget's books over any sequence of takes and
returns. Real slow uploads against a running gateway: test_edges.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.api.chat import GatewayError
from engy_node.gateway.request.bodies import BodyBudget, body_room
from engy_node.metrics import Registry

sizes = st.integers(0, 1_000)


@given(total=sizes, account=sizes, more=sizes, total_cap=sizes, account_cap=sizes)
def test_a_body_is_refused_exactly_when_it_would_pass_a_cap_and_the_accounts_is_named_first(
    total, account, more, total_cap, account_cap
):
    room = body_room(total=total, account=account, more=more, total_cap=total_cap, account_cap=account_cap)
    if account + more > account_cap:
        assert room == "account"
    elif total + more > total_cap:
        assert room == "total"
    else:
        assert room is None


@given(steps=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 60), st.booleans()), max_size=40))
def test_the_budget_never_counts_past_its_caps_and_returns_to_nothing(steps):
    budget = BodyBudget(total_cap=100, account_cap=50, registry=Registry())
    taken: list[tuple[int, int]] = []
    for account_id, more, give_back_one in steps:
        if give_back_one and taken:
            budget.give_back(*taken.pop(0))
        try:
            budget.take(account_id, more)
        except GatewayError as refused:
            assert refused.kind in ("rate_limit", "overloaded") and refused.retry_after_s == 1
        else:
            taken.append((account_id, more))
        assert budget.total == sum(size for _, size in taken) <= 100
        assert all(budget.by_account[a] == sum(s for b, s in taken if b == a) <= 50 for a, _ in taken)
    for account_id, more in taken:
        budget.give_back(account_id, more)
    assert budget.total == 0 and budget.by_account == {}


def test_the_refusals_name_the_limit_and_what_to_do():
    budget = BodyBudget(total_cap=100, account_cap=60, registry=Registry())
    budget.take(1, 50)
    with pytest.raises(GatewayError) as own:
        budget.take(1, 20)
    assert own.value.status == 429 and "60 at once is its limit; send fewer large requests" in own.value.message
    budget.take(2, 40)
    with pytest.raises(GatewayError) as everyone:
        budget.take(3, 20)
    assert everyone.value.status == 503 and "retry shortly" in everyone.value.message
