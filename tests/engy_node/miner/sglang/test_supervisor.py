"""The supervisor's settings, and the supervisor itself running real children: our reference
server, and small scripted servers that crash, stall, never start or ignore SIGTERM on cue.

Every child a test starts is stopped by the supervisor's own cancellation, and the tests check
that its pid is gone afterwards. Scripted children also exit by themselves after a minute, so
a failing test cannot leak one for longer.

Nothing here sleeps to poll: a test waits for what the supervisor itself does, a hub state
change (`WatchedHub`) or a line of the child's output reaching its logger (`ChildLine`), each
under a deadline, or for `run` to return.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from engy_node.hub import Hub, HubHandler
from engy_node.miner.sglang.command import LaunchSpec, reference_launch, shell_command
from engy_node.miner.sglang.leftovers import RUN_ID_ENV, RunRecord, read_record, write_record
from engy_node.miner.sglang.supervisor import ModelServerError, ModelServerSupervisor, SupervisorSettings
from engy_node.retry import backoff_delay
from tests.waiting import logged, wait_until_async

# ---- settings ------------------------------------------------------------------------------------


def test_the_default_startup_failures_give_up_after_about_fifteen_seconds_of_backoff():
    # SupervisorSettings.max_startup_failures' docstring: the waits between 5 failed starts.
    settings = SupervisorSettings()
    waits = [
        backoff_delay(consecutive_failures=n, jitter=0.0, base_s=settings.restart_base_s, cap_s=settings.restart_cap_s)
        for n in range(1, settings.max_startup_failures)
    ]
    assert sum(waits) == 15.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("probe_interval_s", 0), ("stop_grace_s", -1.0), ("max_startup_failures", 1.5), ("log_tail_lines", True)],
)
def test_settings_refuse_nonsense_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SupervisorSettings(**{field: value})


# ---- the supervisor, with real children ----------------------------------------------------------

# A stand-in model server for the cases the reference server cannot act out on cue.
# argv: port, mode, marker file (exists after the first start, so "-once" modes misbehave once).
CHILD_SCRIPT = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, threading, time

    port, mode, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    first = not os.path.exists(marker)
    open(marker, "a").close()
    LIFETIME_S = 60  # a child a failing test forgets still goes away on its own
    healthy_answered = threading.Event()

    if mode == "oom-at-init":
        print("[2025-05-01 10:00:00 TP0] Load weight end. type=Qwen3MoeForCausalLM, avail mem=0.41 GB, mem usage=21.73 GB.")
        print("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")
        sys.exit(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                self.answer(503 if mode == "never-ready" else 200, b"")
                healthy_answered.set()
            elif self.path == "/metrics" and mode == "stall-once":
                running = 1 if first else 0
                self.answer(200, f"sglang:num_running_reqs {running}\\nsglang:generation_tokens_total 42\\n".encode())
            else:
                self.answer(404, b"")

        def answer(self, status, body):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"child pid {os.getpid()}", flush=True)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"grandchild pid {grandchild.pid}", flush=True)
    if mode == "crash-once" and first:
        healthy_answered.wait(10)
        time.sleep(0.2)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total capacity of "
              "23.53 GiB of which 512.00 MiB is free.", flush=True)
        sys.exit(1)
    time.sleep(LIFETIME_S)
    """
)

# Fast everything, so each scripted case takes about a second.
FAST = SupervisorSettings(
    startup_timeout_s=10,
    startup_poll_interval_s=0.05,
    probe_interval_s=0.05,
    probe_timeout_s=2,
    stall_after_s=0.3,
    max_startup_failures=3,
    restart_base_s=0.01,
    restart_cap_s=0.02,
    stop_grace_s=5,
)
TEST_DEADLINE_S = 30


def free_port() -> int:
    """A port nothing listens on right now (the supervisor must know it before the child starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scripted_spec(tmp_path: Path, mode: str) -> LaunchSpec:
    script = tmp_path / "child.py"
    script.write_text(CHILD_SCRIPT)
    port = free_port()
    argv = (sys.executable, str(script), str(port), mode, str(tmp_path / "started-once"))
    return LaunchSpec(kind="reference", argv=argv, env=(), base_url=f"http://127.0.0.1:{port}")


def is_running(pid: int) -> bool:
    """Whether the process is still running. One that has exited counts as gone even before it is
    reaped, as it does for the supervisor: a zombie holds no memory, and reaping an orphaned
    grandchild is init's job, not the supervisor's."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def model_server(hub: Hub) -> dict:
    return hub.states()["model_server"]


class WatchedHub(Hub):
    """A hub that wakes a waiting test whenever a component's state changes, so tests wait for the
    supervisor's own publications instead of polling. The supervisor publishes from its trio
    tasks, so a trio.Event may be set from `set_state`."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def set_state(self, component: str, **values: Any) -> None:
        super().set_state(component, **values)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for_model_server(self, condition: Callable[[dict], bool], *, timeout_s: float, what: str) -> None:
        """Return once `condition` holds for the model server's state; fail the test after `timeout_s`."""
        with trio.move_on_after(timeout_s):
            while not condition(model_server(self)):
                await self._changed.wait()
            return
        raise AssertionError(f"not {what} within {timeout_s} s")


class ChildLine(logging.Handler):
    """Catches the first line of the child's output that starts with `prefix` when the supervisor
    logs it, and sets `seen`. The supervisor logs each line from its reader task as it reads it,
    so a trio.Event may be set here."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.line: str | None = None
        self.seen = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.line is None and message.startswith(self.prefix):
            self.line = message
            self.seen.set()


@contextlib.contextmanager
def model_server_log(handler: logging.Handler) -> Iterator[None]:
    """`handler` receives every record of the supervisor's logger (the child's output is logged at
    info) while the block runs."""
    logger = logging.getLogger("engy.model_server")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_the_reference_server_is_supervised_from_start_to_ready_to_restart_to_stop(checkpoint, tmp_path):
    spec = reference_launch(
        python=sys.executable,
        home=tmp_path / "home",
        model="smollm2-135m",
        checkpoint=checkpoint,
        port=free_port(),
        dtype="bfloat16",
        device="cpu",
        max_running_requests=2,
    )
    settings = SupervisorSettings(
        startup_timeout_s=120,
        startup_poll_interval_s=0.1,
        probe_interval_s=0.2,
        probe_timeout_s=5,
        restart_base_s=0.05,
        restart_cap_s=0.1,
        stop_grace_s=10,
    )
    hub = WatchedHub()
    supervisor = ModelServerSupervisor(spec, hub, settings=settings)
    # What install_logging does for a node: every engy.* record goes into the hub's ring.
    with model_server_log(HubHandler(hub)), trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(supervisor.run)
            assert url == spec.base_url
            state = model_server(hub)
            assert (state["state"], state["restarts"], state["kind"]) == ("ready", 0, "reference")
            assert state["command"] == shell_command(spec)
            first_pid = state["pid"]

            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as client:
                response = await client.post(
                    "/generate",
                    json={"input_ids": [1, 504, 3575], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
                )
                assert response.status_code == 200
            await hub.wait_for_model_server(
                lambda state: (state.get("generation_tokens_total") or 0) >= 4 and state.get("ttft_p50_ms") is not None,
                timeout_s=10,
                what="scraped",
            )
            state = model_server(hub)
            assert state["itl_p50_ms"] is not None and state["running"] == 0 and state["queued"] == 0

            # The child's own log reached the hub's ring through the engy.model_server logger.
            events = hub.events_since(0, limit=10_000).events
            assert any(e.component == "model_server" and "ready to roll" in e.message for e in events)

            os.killpg(first_pid, signal.SIGKILL)
            await hub.wait_for_model_server(
                lambda state: state["restarts"] == 1 and state["state"] == "ready",
                timeout_s=60,
                what="restarted and ready again",
            )
            state = model_server(hub)
            second_pid = state["pid"]
            assert second_pid != first_pid
            assert state["last_failure"]["kind"] == "unknown"
            assert state["last_failure"]["summary"].startswith("was killed by SIGKILL")
            assert state["last_failure"]["phase"] == "runtime"
            nursery.cancel_scope.cancel()
    assert model_server(hub)["state"] == "stopped"
    assert not is_running(first_pid) and not is_running(second_pid)


async def test_a_child_that_crashes_after_becoming_ready_is_restarted_with_the_failure_recorded(tmp_path):
    hub = WatchedHub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "crash-once"), hub, settings=FAST, jitter=lambda: 0.0)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            first_pid = model_server(hub)["pid"]
            await hub.wait_for_model_server(
                lambda state: state["restarts"] == 1 and state["state"] == "ready",
                timeout_s=10,
                what="restarted and ready again",
            )
            state = model_server(hub)
            assert state["last_failure"]["kind"] == "cuda_oom"
            assert state["last_failure"]["phase"] == "runtime"
            assert state["last_failure"]["exit_code"] == 1
            assert "lower --mem-fraction-static" in state["last_failure"]["fix"]
            assert supervisor.last_failure is not None and supervisor.last_failure.kind == "cuda_oom"
            second_pid = state["pid"]
            assert second_pid != first_pid
            nursery.cancel_scope.cancel()
    assert not is_running(second_pid)


async def test_a_server_that_never_starts_makes_run_raise_with_the_classified_failure_and_its_fix(tmp_path):
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "oom-at-init"), hub, settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
        await supervisor.run()
    error = raised.value
    assert error.attempts == FAST.max_startup_failures
    assert error.failure.kind == "oom_at_init"
    assert "increase --mem-fraction-static" in error.failure.fix
    assert "increase --mem-fraction-static" in str(error) and "failed to start 3 times" in str(error)
    state = model_server(hub)
    assert (state["state"], state["restarts"], state["startup_failures"]) == ("failed", 2, 3)
    assert state["last_failure"]["kind"] == "oom_at_init"


async def test_a_failure_before_the_first_readiness_comes_out_of_nursery_start(tmp_path):
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "oom-at-init"), Hub(), settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            with pytest.raises(ModelServerError):
                await nursery.start(supervisor.run)


async def test_a_child_that_never_turns_healthy_is_stopped_at_the_startup_deadline(tmp_path):
    settings = SupervisorSettings(
        startup_timeout_s=0.5, startup_poll_interval_s=0.05, probe_timeout_s=1, max_startup_failures=1, stop_grace_s=5
    )
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "never-ready"), Hub(), settings=settings)
    with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
        await supervisor.run()
    assert raised.value.failure.kind == "startup_timeout"
    assert "startup_timeout_s" in raised.value.failure.fix
    pid = int(next(line for line in supervisor.log_tail if line.startswith("child pid")).split()[-1])
    assert not is_running(pid)


async def test_a_server_running_requests_without_producing_tokens_is_restarted_as_stalled(tmp_path):
    hub = WatchedHub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "stall-once"), hub, settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await hub.wait_for_model_server(
                lambda state: state["restarts"] == 1 and state["state"] == "ready",
                timeout_s=10,
                what="restarted after the stall",
            )
            assert model_server(hub)["last_failure"]["kind"] == "stalled"
            pid = model_server(hub)["pid"]
            nursery.cancel_scope.cancel()
    assert not is_running(pid)


async def test_an_operator_restart_replaces_the_child_without_counting_a_failure(tmp_path):
    hub = WatchedHub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "serve"), hub, settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            first_pid = model_server(hub)["pid"]
            await supervisor.restart()
            assert not is_running(first_pid)
            await hub.wait_for_model_server(lambda state: state["state"] == "ready", timeout_s=10, what="ready again")
            state = model_server(hub)
            assert (state["restarts"], state["last_failure"]) == (1, None)
            assert state["pid"] != first_pid
            second_pid = state["pid"]
            nursery.cancel_scope.cancel()
    assert not is_running(second_pid)


async def test_restart_refuses_when_the_supervisor_is_not_running(tmp_path):
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "serve"), Hub(), settings=FAST)
    with pytest.raises(RuntimeError, match="not running"):
        await supervisor.restart()


async def test_cancelling_kills_a_child_that_ignores_sigterm_and_everything_it_forked(tmp_path):
    settings = SupervisorSettings(startup_poll_interval_s=0.05, probe_interval_s=0.05, stop_grace_s=0.5)
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "stubborn"), hub, settings=settings)
    forked = ChildLine("grandchild pid")
    with model_server_log(forked), trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            with trio.move_on_after(10) as waited:
                await forked.seen.wait()
            assert not waited.cancelled_caught, "not forked within 10 s"
            child_pid = model_server(hub)["pid"]
            grandchild_pid = int(forked.line.split()[-1])
            assert is_running(grandchild_pid)
            nursery.cancel_scope.cancel()
    # Cancellation returns only once the supervisor has seen the whole process group gone.
    assert not is_running(child_pid)
    assert not is_running(grandchild_pid)


async def test_a_command_that_cannot_be_executed_counts_as_a_failed_start(tmp_path):
    spec = LaunchSpec(
        kind="sglang",
        argv=(str(tmp_path / "no-such-python"), "-m", "sglang.launch_server"),
        env=(),
        base_url=f"http://127.0.0.1:{free_port()}",
    )
    supervisor = ModelServerSupervisor(spec, Hub(), settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
        await supervisor.run()
    assert raised.value.failure.kind == "launch_failed"
    assert "no-such-python" in raised.value.failure.summary


async def test_a_port_that_already_answers_fails_the_start_without_spawning_a_child(tmp_path):
    spec = scripted_spec(tmp_path, "serve")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(spec.base_url.rsplit(":", 1)[1])))
        squatter.listen()
        supervisor = ModelServerSupervisor(spec, Hub(), settings=SupervisorSettings(max_startup_failures=1))
        with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
            await supervisor.run()
    assert raised.value.failure.kind == "port_in_use"
    assert supervisor.log_tail == ()
    assert not (tmp_path / "started-once").exists()


# ---- leftovers of an earlier run -----------------------------------------------------------------


def start_leftover(spec: LaunchSpec, record_path: Path, *, run_id: str = "earlier-run") -> subprocess.Popen:
    """What a node killed with its watcher leaves behind: the server running in its own session,
    unsupervised, and the run record naming it (written as the supervisor writes it)."""
    leftover = subprocess.Popen(
        list(spec.argv),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, RUN_ID_ENV: run_id},
    )
    write_record(
        record_path,
        RunRecord(
            pid=leftover.pid, start_time=psutil.Process(leftover.pid).create_time(), argv=spec.argv, run_id=run_id
        ),
    )
    return leftover


async def test_a_server_an_earlier_run_left_behind_is_stopped_before_the_port_check(tmp_path):
    spec = scripted_spec(tmp_path, "serve")
    record_path = tmp_path / "run" / "model_server.json"
    leftover = start_leftover(spec, record_path)
    try:
        # The leftover answers on the port, as it would after a real crash of its node. It is a
        # process of its own with its output discarded, so only asking it shows it is up.
        async with httpx.AsyncClient(trust_env=False) as http:
            await wait_until_async(lambda: _answers(http, spec.base_url), timeout_s=20, what="the leftover serving")
        hub = WatchedHub()
        supervisor = ModelServerSupervisor(spec, hub, settings=FAST, record_path=record_path)
        with logged("engy.model_server", "left by an earlier run") as found, trio.fail_after(TEST_DEADLINE_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(supervisor.run)
                assert f"pid {leftover.pid}" in found.message
                assert leftover.poll() is not None, "the leftover was stopped (and reaped: it is this test's child)"
                pid = model_server(hub)["pid"]
                record = read_record(record_path)
                assert record is not None and record.pid == pid and record.argv == spec.argv
                nursery.cancel_scope.cancel()
        assert not is_running(pid)
        assert read_record(record_path) is None, "a stop that saw the group gone removes the record"
    finally:
        leftover.kill()
        leftover.wait()


async def test_a_record_naming_a_live_process_that_is_not_ours_leaves_it_alone(tmp_path):
    spec = scripted_spec(tmp_path, "serve")
    record_path = tmp_path / "run" / "model_server.json"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        # The pid is the stranger's, the start time is not: the recorded server died and its pid
        # was given to another process since.
        started = psutil.Process(stranger.pid).create_time()
        write_record(record_path, RunRecord(pid=stranger.pid, start_time=started - 3600, argv=spec.argv, run_id="gone"))
        hub = WatchedHub()
        supervisor = ModelServerSupervisor(spec, hub, settings=FAST, record_path=record_path)
        with logged("engy.model_server", "left alone") as left_alone, trio.fail_after(TEST_DEADLINE_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(supervisor.run)
                assert f"pid {stranger.pid}" in left_alone.message
                assert stranger.poll() is None and is_running(stranger.pid)
                assert read_record(record_path).pid == model_server(hub)["pid"], "the record now names our server"
                nursery.cancel_scope.cancel()
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


async def _answers(http: httpx.AsyncClient, base_url: str) -> bool:
    try:
        return (await http.get(base_url + "/health", timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


async def test_an_unreadable_record_is_reported_and_replaced_without_stopping_anything(tmp_path):
    spec = scripted_spec(tmp_path, "serve")
    record_path = tmp_path / "run" / "model_server.json"
    record_path.parent.mkdir()
    record_path.write_text('{"pid": 1, "start_time": "yesterday"}')
    hub = WatchedHub()
    supervisor = ModelServerSupervisor(spec, hub, settings=FAST, record_path=record_path)
    with logged("engy.model_server", "is unusable") as reported, trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            assert "start_time must be a positive number" in reported.message
            assert read_record(record_path).pid == model_server(hub)["pid"]
            nursery.cancel_scope.cancel()
