"""node.run_services: ordered, readiness-gated start; failures before readiness stop start-up."""

from __future__ import annotations

import pytest
import trio

from engy_node.node import run_services
from tests.waiting import logged


async def test_services_start_in_order_and_each_waits_for_the_previous_to_be_ready(autojump_clock):
    order = []
    ready = {"a": trio.Event(), "b": trio.Event()}

    def service(name: str, delay: float):
        async def run(*, task_status=trio.TASK_STATUS_IGNORED):
            await trio.sleep(delay)  # scripted: "a" is the slower to start, so started at once "b" would be ready first
            order.append(f"{name} ready")
            task_status.started(name)
            ready[name].set()
            await trio.sleep_forever()

        return run

    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_services([("a", service("a", 0.2)), ("b", service("b", 0.0))], handle_signals=False)
            )
            for event in ready.values():
                await event.wait()
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


async def test_cancelling_the_node_runs_every_services_cleanup(autojump_clock):
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


async def test_what_start_up_created_is_frozen_out_of_garbage_collection_once_the_node_runs():
    import gc

    kept: list[object] = []
    frozen_at_ready: list[int] = []

    async def service(*, task_status=trio.TASK_STATUS_IGNORED):
        kept.append({"loaded": "at start-up"})
        frozen_at_ready.append(gc.get_freeze_count())
        task_status.started()
        await trio.sleep_forever()

    gc.unfreeze()
    try:
        async with trio.open_nursery() as nursery:
            with logged("engy.node", "node running") as running:
                nursery.start_soon(lambda: run_services([("loader", service)], handle_signals=False))
                await running.wait(timeout_s=5, what="the node running")
            nursery.cancel_scope.cancel()
        assert gc.get_freeze_count() > 0, "start-up's objects are frozen once the node runs"
        assert frozen_at_ready == [0], "nothing is frozen before every service is ready"
        assert not any(obj is kept[0] for obj in gc.get_objects()), (
            "start-up's objects are out of the collector's sight"
        )
    finally:
        gc.unfreeze()


def test_a_second_signal_during_a_slow_shutdown_exits_at_once(tmp_path):
    """The watcher outlives the services' cancellation: the second SIGTERM is its, not the default's."""
    import signal
    import subprocess
    import sys

    program = tmp_path / "slow_node.py"
    program.write_text(
        "import sys, trio\n"
        "from engy_node import node\n"
        "async def service(*, task_status=trio.TASK_STATUS_IGNORED):\n"
        "    task_status.started()\n"
        "    print('running', flush=True)\n"
        "    try:\n"
        "        await trio.sleep_forever()\n"
        "    finally:\n"
        "        with trio.CancelScope(shield=True):\n"
        "            print('draining', flush=True)\n"
        "            await trio.sleep(30)\n"
        "sys.exit(node.run([('slow', service)]))\n"
    )
    process = subprocess.Popen(
        [sys.executable, str(program)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert process.stdout.readline().strip() == "running"
        process.send_signal(signal.SIGTERM)
        assert process.stdout.readline().strip() == "draining"
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=20)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert "second SIGTERM during shutdown; exiting now" in output
