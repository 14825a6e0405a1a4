"""`errors.collapse`: the one real error out of trio's exception groups."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engy_node.errors import collapse, single_failure


async def test_one_error_in_nested_groups_is_returned_as_itself():
    error = ValueError("x")
    assert collapse(BaseExceptionGroup("outer", [ExceptionGroup("inner", [error])])) is error


async def test_several_real_errors_stay_a_group():
    group = ExceptionGroup("two", [ValueError("a"), KeyError("b")])
    assert collapse(group) is group


async def test_an_outer_cancellation_beside_one_real_error_yields_the_real_error():
    """What a nursery raises when its body fails while an enclosing scope is being cancelled."""

    async def fail_when_cancelled() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise ValueError("cleanup failed")

    with trio.CancelScope() as outer:
        with pytest.raises(BaseExceptionGroup) as raised:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail_when_cancelled)
                await trio.testing.wait_all_tasks_blocked()  # fail_when_cancelled is in sleep_forever
                outer.cancel()
                await trio.sleep_forever()
        assert isinstance(collapse(raised.value), ValueError)


async def test_single_failure_raises_a_nurserys_one_error_as_itself():
    async def fail() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        with single_failure():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail)


def test_single_failure_leaves_several_errors_a_group():
    with pytest.raises(ExceptionGroup):
        with single_failure():
            raise ExceptionGroup("two", [ValueError("a"), KeyError("b")])
