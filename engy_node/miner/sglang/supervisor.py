"""Keep the model server running: start the child, copy its log, wait for readiness, probe and
scrape it while up, and restart it with backoff when it exits, stops answering or stalls.

This is the imperative shell around the pure modules: `command` says what to run, `failures`
says why it failed and whether it has stalled, `output_lines` splits its output, and
`engy_node.retry.backoff_delay` is the backoff. Child processes, HTTP probes and clock reads
live here and in `stopping` (which signals and waits out a child's process group), nowhere else
in the package.

What it trusts: the child is a peer we do not control. Its exit code, its log and its HTTP
answers are evidence, never commands: nothing it prints or answers can crash the supervisor
(only repeated failed starts end `run`, see below), and its output is read in bounded lines
into a bounded tail. `/health` answering 200 is the only readiness signal: sglang's "The server
is fired up and ready to roll!" line comes at about the same moment, but log wording changes
between releases and a status code does not. Before each start the port must be free, since a
leftover server answering there would otherwise pass for ours. The log is authoritative for
*why* it failed; the supervisor's own observation (exit, timeout, failed probes, stall) only
for *that* it failed.

Failure posture: a server that dies after it has served is always restarted; the costlier
mistake for a miner is staying down while the gateway routes to it. A server that cannot
*start* is different: retrying a wrong `--mem-fraction-static` forever only hides the message
that says how to fix it, so after `max_startup_failures` consecutive failed starts `run` raises
`ModelServerError` carrying the classified failure and its fix. Every failure is logged with
its fix and recorded in the hub's `model_server` state, so the TUI and `engy-node diagnose`
show the same sentence the log does.

Stopping and what survives a dead node are `stopping.py`'s: the child runs in its own session
and process group, on a lifeline that stops the group when the node dies without stopping it,
and, with a `record_path`, is recorded so that the next start stops what this run left behind.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NoReturn

import httpx
import trio

from engy_node.errors import EngyError
from engy_node.hub import Hub
from engy_node.miner.lifeline import guarded_argv
from engy_node.miner.sglang.command import LaunchSpec, shell_command
from engy_node.miner.sglang.failures import (
    LAUNCH_FAILED_PREFIX,
    Detected,
    Failure,
    Phase,
    classify_failure,
    detect_stall,
)
from engy_node.miner.sglang.leftovers import RUN_ID_ENV, remove_record
from engy_node.miner.sglang.output_lines import LineBuffer
from engy_node.miner.sglang.stopping import KILL_WAIT_S, record_child, stop_leftover, stop_tree
from engy_node.retry import backoff_delay
from engy_node.serve.status import ServerStatus, fetch_status

__all__ = ["ModelServerError", "ModelServerSupervisor", "SupervisorSettings"]

log = logging.getLogger("engy.model_server")

HUB_COMPONENT = "model_server"

# Once the process group is gone its output is already in the pipe; this only bounds a process
# outside the group (one that called setsid) that still holds the pipe open.
OUTPUT_DRAIN_S = 2.0
READ_CHUNK_BYTES = 64 * 1024

State = Literal["starting", "ready", "unhealthy", "stalled", "timed_out", "exited", "restarting", "failed", "stopped"]

# The state published right after a failure, by what the supervisor saw (None: the child exited).
_STATE_AFTER: dict[Detected | None, State] = {
    None: "exited",
    "startup_timeout": "timed_out",
    "unhealthy": "unhealthy",
    "stalled": "stalled",
}


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorSettings:
    """How patiently the supervisor waits, probes and restarts. Durations are in seconds."""

    startup_timeout_s: float = 900.0
    """Longest a start may take before `/health` answers 200. sglang loads tens of GB of weights,
    JIT-compiles kernels on a machine's first launch and captures CUDA graphs: several minutes
    is normal, so 15 minutes; a start that hangs is still noticed the same hour."""
    startup_poll_interval_s: float = 1.0
    """Pause between readiness probes while starting."""
    probe_interval_s: float = 5.0
    """Pause between liveness-and-metrics polls once ready (sglang ops: every 5-10 s). Polls never
    overlap: the next starts only after the previous has finished or timed out."""
    probe_timeout_s: float = 10.0
    """Longest one probe may take. `/health` without generation answers in milliseconds; this
    covers an event loop busy tokenising a 262k-token prompt."""
    unhealthy_after_probes: int = 3
    """Consecutive failed liveness probes after which a ready server is restarted. One miss can be
    a hiccup; three in a row (15 to 45 s at the defaults, refused or timing out) is a server that
    stopped answering."""
    stall_after_s: float = 180.0
    """Requests running with no generated token for this long is a stall. It must exceed the
    longest legitimate silence: a full 262k-token prompt prefilled on consumer GPUs takes a minute
    or two, and sglang's running-request gauge updates only on batches (every 40 decode steps),
    so it can lag behind a server that has just gone idle."""
    max_startup_failures: int = 5
    """Consecutive failed starts (never ready) after which `run` gives up and raises. Five starts
    with the default backoff span about 15 s of waiting: enough for a transient cause (GPU memory
    still being released by the previous run, a slow network disk) to clear, few enough that a
    wrong flag is reported soon."""
    restart_base_s: float = 1.0
    """Backoff after the first failure; it doubles with each further failure in a row."""
    restart_cap_s: float = 60.0
    """Longest backoff between restarts."""
    stop_grace_s: float = 15.0
    """Time between SIGTERM and SIGKILL when stopping. sglang tears its rank processes and NCCL down
    in seconds; the reference server drains for 2 s. 15 s also fits systemd's default 90 s stop."""
    log_tail_lines: int = 200
    """Child output lines kept in memory for failure classification and the TUI."""
    max_line_bytes: int = 16 * 1024
    """Longest output line kept whole. sglang prints its resolved server args as one line of
    several KB at start; a runaway line (a tensor dump) is cut here and counted."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # A count's default is an int, a duration's a float; a duration may be given as an int.
            counts = type(field.default) is int
            if (
                isinstance(value, bool)
                or not isinstance(value, int if counts else int | float)
                or not 0 < value < math.inf
            ):
                kind = "a positive integer" if counts else "a positive number"
                raise ValueError(f"SupervisorSettings.{field.name} must be {kind}, got {value!r}")
        if self.restart_base_s > self.restart_cap_s:
            raise ValueError("SupervisorSettings.restart_base_s must not exceed restart_cap_s")


class ModelServerError(EngyError):
    """The model server could not be started; `failure` says why and what to change."""

    title = "model server"

    def __init__(self, failure: Failure, *, attempts: int, command: str) -> None:
        super().__init__(
            f"the model server failed to start {attempts} times in a row. {failure.summary.rstrip('.')}. "
            f"Fix: {failure.fix}. Command: {command}"
        )
        self.failure = failure
        self.attempts = attempts


@dataclasses.dataclass(frozen=True, slots=True)
class _Ended:
    """How one run of the child ended."""

    phase: Phase
    exit_code: int | None
    detected: Detected | None = None
    operator_restart: bool = False
    log_tail: tuple[str, ...] = ()
    """This run's own last output lines (the supervisor's tail spans restarts)."""


@dataclasses.dataclass(slots=True)
class _Attempt:
    """One child process, its output state, and the events its tasks signal."""

    process: trio.Process
    lines: LineBuffer
    tail: collections.deque[str]
    exited: trio.Event = dataclasses.field(default_factory=trio.Event)
    output_done: trio.Event = dataclasses.field(default_factory=trio.Event)
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _metric_fields(status: ServerStatus | None) -> dict[str, Any]:
    """The hub fields filled from one poll (all None when there is no poll to show)."""
    ttft = status.ttft if status else None
    itl = status.itl if status else None
    return {
        "running": status.running if status else None,
        "queued": status.queued if status else None,
        "generation_tokens_total": status.generation_tokens_total if status else None,
        "gen_throughput": status.gen_throughput if status else None,
        "ttft_p50_ms": _ms(ttft.p50_s) if ttft else None,
        "ttft_p95_ms": _ms(ttft.p95_s) if ttft else None,
        "itl_p50_ms": _ms(itl.p50_s) if itl else None,
        "itl_p95_ms": _ms(itl.p95_s) if itl else None,
        "poll_error": status.error if status else None,
    }


class ModelServerSupervisor:
    """Runs one model server (sglang or the reference server) and keeps it up.

    States, as published in the hub's `model_server` state: starting -> ready ->
    (unhealthy | stalled | exited) -> restarting -> starting ...; `failed` after giving up,
    `stopped` after cancellation. Hub fields: state, kind, url, command (shell text), pid,
    restarts, startup_failures, last_failure ({kind, summary, fix, phase, exit_code} or None),
    running, queued, generation_tokens_total, gen_throughput, ttft/itl p50/p95 in ms,
    poll_error, log_lines_truncated.

    `jitter` draws the backoff's random share in [0, 1); tests pass a constant. `record_path`
    is where the running child is recorded, so that a later start in the same home stops what
    this run left behind (see the module docstring); None records nothing and looks for nothing.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        hub: Hub,
        *,
        settings: SupervisorSettings = SupervisorSettings(),
        jitter: Callable[[], float] = random.random,
        hub_component: str = HUB_COMPONENT,
        record_path: Path | None = None,
    ) -> None:
        self.spec = spec
        self.record_path = record_path
        self.hub_component = hub_component
        # The child's output logs under the same name as its hub state, so a node with several
        # model servers (a local network) keeps their logs apart.
        self._output_log = log if hub_component == HUB_COMPONENT else logging.getLogger(f"engy.{hub_component}")
        self.settings = settings
        self.command = shell_command(spec)
        self._hub = hub
        self._jitter = jitter
        self._tail: collections.deque[str] = collections.deque(maxlen=settings.log_tail_lines)
        self._running = False
        self._restart_pending = False
        self._wake = trio.Event()
        self._attempt: _Attempt | None = None
        self.last_failure: Failure | None = None
        self.truncated_lines = 0
        """Output lines cut at `max_line_bytes`, across restarts."""
        self.state = "starting"
        """The server's state as last published: starting, ready, unhealthy, restarting, …"""

    @property
    def ready(self) -> bool:
        """The server answers its health probe: it can take requests."""
        return self.state == "ready"

    @property
    def log_tail(self) -> tuple[str, ...]:
        """The child's most recent output lines, across restarts, oldest first."""
        return tuple(self._tail)

    def _publish(self, **values: Any) -> None:
        if "state" in values:
            self.state = values["state"]
        self._hub.set_state(self.hub_component, **values)

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Start the model server and keep it running until cancelled.

        Readiness: `task_status.started(base_url)` is called once, the first time `/health`
        answers 200. Restarts after that are reported through the hub and the log only.

        Resources: one child process tree at a time (its own session and process group) and
        one HTTP client; both are gone when this returns or raises.

        Errors: raises `ModelServerError` (carrying `.failure`) after `max_startup_failures`
        consecutive failed starts; if that happens before the first readiness, it comes out
        of `nursery.start`. Failures after a successful start are restarted forever.

        Cancellation: the child's process group gets SIGTERM, then SIGKILL after
        `stop_grace_s`, under a shielded scope; when this returns no child process is left
        (see the module docstring for what can escape). The hub state becomes `stopped`.
        """
        if self._running:
            raise RuntimeError("this ModelServerSupervisor is already running")
        self._running = True
        final_state: State = "stopped"
        restarts = startup_failures = consecutive_failures = 0
        announced = False
        self._publish(
            state="starting",
            kind=self.spec.kind,
            url=self.spec.base_url,
            command=self.command,
            pid=None,
            restarts=0,
            startup_failures=0,
            last_failure=None,
            restart_in_s=None,
            log_lines_truncated=0,
            **_metric_fields(None),
        )
        # trust_env=False: an HTTP(S)_PROXY meant for the internet must never carry loopback probes.
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                while True:
                    ended = await self._run_child(client, first_ready=not announced, task_status=task_status)
                    announced = announced or ended.phase == "runtime"
                    if ended.phase == "runtime":
                        startup_failures = consecutive_failures = 0
                    if ended.operator_restart:
                        restarts += 1
                        log.info("model server restarted by the operator")
                        self._publish(state="restarting", restarts=restarts, pid=None)
                        continue

                    failure = classify_failure(
                        log_tail=ended.log_tail, exit_code=ended.exit_code, phase=ended.phase, detected=ended.detected
                    )
                    consecutive_failures += 1
                    if ended.phase == "startup":
                        startup_failures += 1
                    self.last_failure = failure
                    log.error("model server %s: %s. Fix: %s", failure.kind, failure.summary.rstrip("."), failure.fix)
                    self._publish(
                        state=_STATE_AFTER[ended.detected],
                        pid=None,
                        startup_failures=startup_failures,
                        last_failure={**failure.as_dict(), "phase": ended.phase, "exit_code": ended.exit_code},
                        **_metric_fields(None),
                    )
                    if startup_failures >= self.settings.max_startup_failures:
                        final_state = "failed"
                        raise ModelServerError(failure, attempts=startup_failures, command=self.command)

                    delay = backoff_delay(
                        consecutive_failures=consecutive_failures,
                        jitter=self._jitter(),
                        base_s=self.settings.restart_base_s,
                        cap_s=self.settings.restart_cap_s,
                    )
                    log.info("restarting the model server in %.1f s (failure %d in a row)", delay, consecutive_failures)
                    self._publish(state="restarting", restart_in_s=round(delay, 1))
                    self._wake = trio.Event()
                    with trio.move_on_after(delay):
                        # An operator's restart cuts the backoff short.
                        while not self._restart_pending:
                            await self._wake.wait()
                    self._restart_pending = False
                    restarts += 1
                    self._publish(restarts=restarts, restart_in_s=None)
        finally:
            self._running = False
            self._publish(state=final_state, pid=None)

    async def restart(self) -> None:
        """Stop the current child and start a fresh one at once (an operator's action).

        It counts as a restart but not as a failure, and skips any backoff in progress.
        Returns once the old child is gone. Raises RuntimeError when `run` is not running.
        Cancellation: the restart still happens; only the wait for it is abandoned.
        """
        if not self._running:
            raise RuntimeError("the model server supervisor is not running; nothing to restart")
        self._restart_pending = True
        self._wake.set()
        attempt = self._attempt
        if attempt is not None:
            # The watcher notices between probes; stopping is bounded by the grace period.
            bound = self.settings.probe_timeout_s + self.settings.stop_grace_s + KILL_WAIT_S + OUTPUT_DRAIN_S + 1.0
            with trio.fail_after(bound):
                await attempt.done.wait()

    # -- one child ---------------------------------------------------------------------------------

    async def _run_child(
        self, client: httpx.AsyncClient, *, first_ready: bool, task_status: trio.TaskStatus[str]
    ) -> _Ended:
        """Start the child, watch it until it ends or must be stopped, stop its process tree."""
        self._wake = trio.Event()
        self._restart_pending = False
        if self.record_path is not None:
            # Before the port check: a leftover holding the port would otherwise fail this start.
            await stop_leftover(self.record_path, grace_s=self.settings.stop_grace_s)
        log.info("starting the model server: %s", self.command)
        self._publish(state="starting", pid=None, **_metric_fields(None))
        if await self._port_answers():
            # Without this check a leftover server (from a node that was SIGKILLed) would answer
            # our readiness probe while our own child fails to bind, and be taken for it.
            line = f"{self.spec.base_url} answers before the model server has started: address already in use"
            log.error("%s", line)
            return _Ended(phase="startup", exit_code=None, log_tail=(line,))
        run_id = uuid.uuid4().hex
        # The node holds the only write end; the kernel closes it when the node dies, however it
        # dies, and the child's watcher then stops the group (engy_node.miner.lifeline).
        lifeline_read, lifeline_write = os.pipe()
        try:
            try:
                process = await trio.lowlevel.open_process(
                    guarded_argv(
                        self.spec.argv,
                        python=sys.executable,
                        lifeline_fd=lifeline_read,
                        grace_s=self.settings.stop_grace_s,
                    ),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    # A new session makes the child lead its own process group, so one killpg
                    # reaches every process it forks; it also keeps a terminal's Ctrl-C away from
                    # the child, so the node stops it in order instead.
                    start_new_session=True,
                    pass_fds=(lifeline_read,),
                    # Python children block-buffer a pipe; unbuffered, each line arrives as printed.
                    env={**os.environ, **dict(self.spec.env), RUN_ID_ENV: run_id, "PYTHONUNBUFFERED": "1"},
                )
            finally:
                os.close(lifeline_read)
        except OSError as err:
            os.close(lifeline_write)
            # Nothing started (a wrong python path, say): a failed start like any other.
            line = f"{LAUNCH_FAILED_PREFIX}{type(err).__name__}: {err}"
            log.error("%s", line)
            return _Ended(phase="startup", exit_code=None, log_tail=(line,))
        except BaseException:
            os.close(lifeline_write)
            raise

        attempt = _Attempt(
            process=process,
            lines=LineBuffer(max_line_bytes=self.settings.max_line_bytes),
            tail=collections.deque(maxlen=self.settings.log_tail_lines),
        )
        self._attempt = attempt
        self._publish(pid=process.pid)
        try:
            if self.record_path is not None:
                await record_child(self.record_path, process.pid, run_id, self.spec.argv)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_output, attempt)
                nursery.start_soon(self._wait_exit, attempt)
                ended = await self._await_ready(client, attempt)
                if ended is None:
                    log.info("model server ready on %s (pid %d)", self.spec.base_url, process.pid)
                    self._publish(state="ready")
                    if first_ready:
                        task_status.started(self.spec.base_url)
                    ended = await self._monitor(client, attempt)
                await stop_tree(process, grace_s=self.settings.stop_grace_s)
                # The last lines (the traceback) must be in the tail before it is classified.
                with trio.move_on_after(OUTPUT_DRAIN_S):
                    await attempt.output_done.wait()
                nursery.cancel_scope.cancel(reason="the model server has stopped")
        finally:
            gone = await stop_tree(process, grace_s=self.settings.stop_grace_s)
            # The group is gone (or survived SIGKILL, when the watcher's own SIGKILL is the last
            # word); either way the lifeline has done its work.
            os.close(lifeline_write)
            with trio.CancelScope(shield=True):
                if gone and self.record_path is not None:
                    await trio.to_thread.run_sync(remove_record, self.record_path)
                with trio.move_on_after(OUTPUT_DRAIN_S):
                    assert process.stdout is not None  # opened with stdout=PIPE
                    await process.stdout.aclose()
            attempt.done.set()
        return dataclasses.replace(ended, log_tail=tuple(attempt.tail))

    async def _await_ready(self, client: httpx.AsyncClient, attempt: _Attempt) -> _Ended | None:
        """None once `/health` answers 200; otherwise how the start ended."""
        with trio.move_on_after(self.settings.startup_timeout_s):
            while True:
                if attempt.exited.is_set():
                    return _Ended(phase="startup", exit_code=attempt.process.returncode)
                if self._restart_pending:
                    return _Ended(phase="startup", exit_code=None, operator_restart=True)
                if await self._probe_health(client):
                    return None
                with trio.move_on_after(self.settings.startup_poll_interval_s):
                    await self._wake.wait()
        log.warning("model server not ready after %g s; stopping it", self.settings.startup_timeout_s)
        return _Ended(phase="startup", exit_code=None, detected="startup_timeout")

    async def _port_answers(self) -> bool:
        """Whether something already accepts connections where the child is to listen."""
        url = httpx.URL(self.spec.base_url)
        # httpx leaves out a port that is the scheme's default: port 80 of an http:// base URL.
        port = url.port if url.port is not None else 80
        with trio.move_on_after(self.settings.probe_timeout_s):
            try:
                stream = await trio.open_tcp_stream(url.host, port)
            except OSError:
                return False  # refused: the port is free
            await stream.aclose()
            return True
        return False  # no answer at all: nothing accepts connections there

    async def _probe_health(self, client: httpx.AsyncClient) -> bool:
        url = self.spec.base_url + self.spec.health_path
        with trio.move_on_after(self.settings.probe_timeout_s):
            try:
                response = await client.get(url, timeout=self.settings.probe_timeout_s)
            except httpx.HTTPError:
                return False  # refused while it starts: the normal answer, not an error
            return response.status_code == 200
        return False

    async def _monitor(self, client: httpx.AsyncClient, attempt: _Attempt) -> _Ended:
        """Poll `/health` and the metrics until the server exits, must be restarted, or stalls.

        One poll at a time (sequential, each bounded by `probe_timeout_s`), so probes never pile
        up on a slow server.
        """
        settings = self.settings
        failed_probes = 0
        last_tokens: float | None = None
        last_progress_at = trio.current_time()
        stall_check_skipped = False
        while True:
            with trio.move_on_after(settings.probe_interval_s):
                await self._wake.wait()
            if attempt.exited.is_set():
                return _Ended(phase="runtime", exit_code=attempt.process.returncode)
            if self._restart_pending:
                return _Ended(phase="runtime", exit_code=None, operator_restart=True)

            status = await fetch_status(client, self.spec.base_url, timeout_s=settings.probe_timeout_s)
            if attempt.exited.is_set():
                # The poll failed because the process died: that is an exit, not unhealthiness.
                return _Ended(phase="runtime", exit_code=attempt.process.returncode)
            now = trio.current_time()
            if status.healthy:
                failed_probes = 0
                self._publish(state="ready", **_metric_fields(status))
            else:
                failed_probes += 1
                log.warning(
                    "model server health probe failed (%d of %d): %s",
                    failed_probes,
                    settings.unhealthy_after_probes,
                    status.error,
                )
                self._publish(state="unhealthy", poll_error=status.error)
                if failed_probes >= settings.unhealthy_after_probes:
                    return _Ended(phase="runtime", exit_code=None, detected="unhealthy")
                continue

            if status.running is None or status.generation_tokens_total is None:
                if not stall_check_skipped:
                    log.info(
                        "stall detection off: the server reports no running-request or token counts "
                        "(sglang needs --enable-metrics)"
                    )
                    stall_check_skipped = True
                continue
            tokens = float(status.generation_tokens_total)
            if last_tokens is None or tokens != last_tokens or status.running == 0:
                last_tokens, last_progress_at = tokens, now
            if detect_stall(
                running=status.running,
                generation_tokens_total=tokens,
                last_progress_tokens=last_tokens,
                seconds_since_progress=now - last_progress_at,
                stall_after_s=settings.stall_after_s,
            ):
                log.warning(
                    "model server stalled: %d requests running, no token generated for %.0f s",
                    status.running,
                    now - last_progress_at,
                )
                return _Ended(phase="runtime", exit_code=None, detected="stalled")

    async def _read_output(self, attempt: _Attempt) -> None:
        """Copy the child's output into the log and the tails until the pipe closes."""
        stream = attempt.process.stdout
        assert stream is not None  # opened with stdout=PIPE
        buffer = attempt.lines
        try:
            while True:
                try:
                    data = await stream.receive_some(READ_CHUNK_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                truncated_before = buffer.truncated
                lines = buffer.feed(data) if data else buffer.flush()
                for line in lines:
                    self._output_log.info("%s", line)
                    self._tail.append(line)
                    attempt.tail.append(line)
                if buffer.truncated != truncated_before:
                    self.truncated_lines += buffer.truncated - truncated_before
                    self._publish(log_lines_truncated=self.truncated_lines)
                if not data:
                    return
        finally:
            attempt.output_done.set()

    async def _wait_exit(self, attempt: _Attempt) -> None:
        await attempt.process.wait()
        attempt.exited.set()
        self._wake.set()
