"""`engy-node --role miner` killed the hard way: its model server must not outlive it, and a server
an earlier run left behind must not run beside the next one.

Each test runs the miner as an operator does, a process of its own in a temp home, against a
protocol-level gateway, with the reference server on SmolLM2 as its model server. The model
server is another process that announces nothing as it goes, so its end is waited for with a
bounded poll of the process table.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import trio

from engy_node.testing.gateway import GatewayHarness
from tests.engy_node.miner.sglang.test_supervisor import free_port, is_running
from tests.engy_node.miner.test_lifeline import group_running
from tests.waiting import wait_until_async

START_TIMEOUT_S = 180
GONE_TIMEOUT_S = 60
"""The watcher's grace (the supervisor's 15 s stop_grace_s) and the SIGKILL after it, with room."""


async def start_miner_node(home: Path, gateway_url: str, log_path: Path, **env: str) -> trio.Process:
    with log_path.open("a") as log:
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "engy_node", "--home", str(home), "--role", "miner", "--gateway", gateway_url],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MINER_KEY": "mk-lifecycle", "PYTHONUNBUFFERED": "1", **env},
        )


def the_model_server(miner: trio.Process) -> psutil.Process:
    """The miner's one child: the model server itself (the lifeline guard execs it in place)."""
    children = psutil.Process(miner.pid).children()
    assert len(children) == 1, children
    return children[0]


async def stop(miner: trio.Process) -> None:
    if miner.returncode is None:
        miner.send_signal(signal.SIGTERM)
        with trio.move_on_after(90):
            await miner.wait()
        if miner.returncode is None:
            miner.kill()
            await miner.wait()


def is_a_server_on(port: str, cmdline: list[str]) -> bool:
    """A reference server's command line for `port` (a watcher's shows it too, after its guard's)."""
    return "serve" in cmdline and port in cmdline and "engy_node.miner.lifeline" not in cmdline


def kill_group(pgid: int) -> None:
    """Cleanup after a failed assertion, so a failing test leaves nothing running."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def test_a_miner_killed_with_sigkill_takes_its_model_server_with_it(nursery, tmp_path, checkpoint):
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    log_path = tmp_path / "miner.log"
    miner = await start_miner_node(tmp_path / "home", harness.url, log_path)
    server_pid = None
    try:
        await harness.wait_for(lambda: 0 in harness.legs, timeout=START_TIMEOUT_S)
        server = the_model_server(miner)
        server_pid = server.pid
        assert len(group_running(server_pid)) == 2, "the model server leads its group, with its watcher"
        assert "serve" in server.cmdline(), server.cmdline()

        miner.kill()
        await miner.wait()
        await wait_until_async(
            lambda: not group_running(server_pid),
            timeout_s=GONE_TIMEOUT_S,
            what="the model server's process group gone after its node was killed",
        )
    finally:
        await stop(miner)
        if server_pid is not None:
            kill_group(server_pid)


async def test_a_restarted_miner_stops_the_server_an_earlier_run_left_and_runs_only_its_own(
    nursery, tmp_path, checkpoint
):
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    home, log_path = tmp_path / "home", tmp_path / "miner.log"
    # One port for both runs, as an operator's fixed port: the leftover holds it until stopped.
    port = str(free_port())
    first = await start_miner_node(home, harness.url, log_path, ENGY_MINER__SERVE_PORT=port)
    second: trio.Process | None = None
    pgids: list[int] = []
    try:
        await harness.wait_for(lambda: 0 in harness.legs, timeout=START_TIMEOUT_S)
        leftover = the_model_server(first)
        pgids.append(leftover.pid)
        # What escapes the lifeline: its watcher killed first, then the node.
        watcher = next(psutil.Process(pid) for pid in group_running(leftover.pid) if pid != leftover.pid)
        assert "engy_node.miner.lifeline" in watcher.cmdline()
        watcher.kill()
        first.kill()
        await first.wait()
        assert is_running(leftover.pid), "the earlier run left its model server running"

        second = await start_miner_node(home, harness.url, log_path, ENGY_MINER__SERVE_PORT=port)
        await harness.wait_for(lambda: len(harness.hellos) == 2 and 0 in harness.legs, timeout=START_TIMEOUT_S)
        server = the_model_server(second)
        pgids.append(server.pid)
        assert not is_running(leftover.pid)
        assert [p.pid for p in psutil.process_iter(["cmdline"]) if is_a_server_on(port, p.info["cmdline"] or [])] == [
            server.pid
        ], "only the new run's model server runs on the port"
        log = log_path.read_text()
        assert f"a model server left by an earlier run in this home is still running: pid {leftover.pid}" in log
        assert "stopped the leftover model server" in log
    finally:
        for miner in (first, second):
            if miner is not None:
                await stop(miner)
        for pgid in pgids:
            kill_group(pgid)
