"""node.run_services: ordered, readiness-gated start; failures before readiness stop start-up."""

from __future__ import annotations

import pytest
import trio

from engy_node.node import run_services


async def test_services_start_in_order_and_each_waits_for_the_previous_to_be_ready():
    order = []

    def service(name: str, delay: float):
        async def run(*, task_status=trio.TASK_STATUS_IGNORED):
            await trio.sleep(delay)
            order.append(f"{name} ready")
            task_status.started(name)
            await trio.sleep_forever()
        return run

    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_services([("a", service("a", 0.2)), ("b", service("b", 0.0))], handle_signals=False))
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught
    assert order == ["a ready", "b ready"]


async def test_a_service_failing_before_ready_stops_start_up_with_its_error():
    started_second = False

    async def broken(*, task_status=trio.TASK_STATUS_IGNORED):
        raise RuntimeError("port already in use")

    async def second(*, task_status=trio.TASK_STATUS_IGNORED):
        nonlocal started_second
        started_second = True
        task_status.started()

    with pytest.raises(RuntimeError, match="port already in use"):
        await run_services([("broken", broken), ("second", second)], handle_signals=False)
    assert not started_second


async def test_cancelling_the_node_runs_every_services_cleanup():
    cleaned = []

    def service(name: str):
        async def run(*, task_status=trio.TASK_STATUS_IGNORED):
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                cleaned.append(name)
        return run

    with trio.move_on_after(0.5):
        await run_services([("a", service("a")), ("b", service("b"))], handle_signals=False)
    assert sorted(cleaned) == ["a", "b"]
