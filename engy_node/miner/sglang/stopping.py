"""Stopping the model server's process tree, and what an earlier run left behind.

The supervisor (`supervisor.py`) decides *when* a child must go; this module is *how*: signals
to a whole process group with a grace period, bounded waits, and the run record that lets a
later start find and stop a server a dead node could not. It is apart from the supervisor's
loop because every piece here must hold on its own under cancellation (each stop runs shielded:
an orphaned sglang keeps its GPUs' memory until someone finds and kills it) and must never
signal a process that is not ours (a reused pid is recognised by its start time).

Stopping: the child starts in a new session, so it and everything it forks (sglang's scheduler
and detokenizer processes, one per GPU rank) share one process group. Stopping sends SIGTERM
to the whole group, waits `stop_grace_s` under a shielded scope, then sends SIGKILL to the
group; it also runs after a child exits on its own, because sglang's rank processes can
outlive a crashed main process and would keep holding GPU memory.

Dying without stopping: the child runs on a lifeline (`engy_node.miner.lifeline`), so when the
node dies without stopping it (SIGKILL, the OOM killer) a watcher in its group stops the group
the same way, SIGTERM, the grace, SIGKILL. The supervisor's child is still the model server
itself (the guard execs it), so pid, group, output and exit code are as without it. With a
`record_path`, every child is recorded there (`leftovers.RunRecord`) until its group is gone,
and each start first stops whatever an earlier run recorded and left running (a watcher that
was killed too, a node restarted within the watcher's grace), recognised by start time and
run id so a reused pid is never signalled. Only a grandchild that moves itself to another
session and drops the run id from its environment still escapes; the next start then finds
the port taken and fails as `port_in_use`, naming how to free it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import trio

from engy_node.miner.sglang.leftovers import (
    START_TIME_TOLERANCE_S,
    ProcessView,
    RecordError,
    RunRecord,
    describe_all,
    observe_group,
    ours,
    read_record,
    remove_record,
    start_time_of,
    write_record,
)

__all__ = ["KILL_WAIT_S", "group_alive", "record_child", "signal_group", "stop_leftover", "stop_tree"]

log = logging.getLogger("engy.model_server")

# After SIGKILL the kernel tears the processes down at once; this only bounds a process stuck in
# uninterruptible IO (a hung GPU driver call) so shutdown still finishes.
KILL_WAIT_S = 5.0
# How often the process group is checked for survivors while waiting for it to go.
GROUP_POLL_S = 0.05


def signal_group(pgid: int, signum: int) -> bool:
    """Send `signum` to the process group (0: only check that it exists); False when no process
    of it is left to receive it."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:
        # The group id now belongs to another user's processes: ours are gone.
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies waiting to be reaped do not count:
    they hold no memory, and where nothing reaps them, in a container without an init, they
    would otherwise keep every stop waiting out its full deadline)."""
    if not signal_group(pgid, 0):
        return False
    import psutil  # only needed when the group outlives its leader, which is rare

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue  # gone while we looked
    return False


async def wait_group_gone(pgid: int) -> None:
    """Return once no process of the group is running (the caller bounds the wait)."""
    while group_alive(pgid):
        await trio.sleep(GROUP_POLL_S)


async def stop_tree(process: trio.Process, *, grace_s: float) -> bool:
    """SIGTERM the child's process group, wait `grace_s`, then SIGKILL it. Idempotent.
    Returns whether the group is gone.

    Runs shielded: it is the cleanup of a cancelled supervisor, and an orphaned sglang keeps
    its GPUs' memory until someone finds and kills it.
    """
    pgid = process.pid  # the session leader's pid is its group id (start_new_session)
    with trio.CancelScope(shield=True):
        if process.returncode is None or group_alive(pgid):
            if process.returncode is None:
                log.info("stopping the model server (pid %d): SIGTERM to its process group", pgid)
            signal_group(pgid, signal.SIGTERM)
            with trio.move_on_after(grace_s) as grace:
                await process.wait()
                await wait_group_gone(pgid)
            if grace.cancelled_caught:
                log.warning(
                    "model server (process group %d) still running %g s after SIGTERM; sending SIGKILL",
                    pgid,
                    grace_s,
                )
                signal_group(pgid, signal.SIGKILL)
                with trio.move_on_after(KILL_WAIT_S) as kill_wait:
                    await process.wait()
                    await wait_group_gone(pgid)
                if kill_wait.cancelled_caught:
                    log.error(
                        "model server process group %d survived SIGKILL for %g s; check `ps -g %d`",
                        pgid,
                        KILL_WAIT_S,
                        pgid,
                    )
                    return False
    return True


async def record_child(path: Path, pid: int, run_id: str, argv: Sequence[str]) -> None:
    """Record the child at `path` for a later start in this home (see the module docstring)."""
    import psutil

    try:
        started = start_time_of(pid)
    except psutil.Error:
        return  # already gone: nothing can be left behind
    record = RunRecord(pid=pid, start_time=started, argv=tuple(argv), run_id=run_id)
    try:
        await trio.to_thread.run_sync(write_record, path, record)
    except OSError as error:
        log.warning(
            "cannot record the model server in %s (%s: %s); a server this run leaves behind will not be "
            "found by the next start",
            path,
            type(error).__name__,
            error,
        )


async def stop_leftover(path: Path, *, grace_s: float) -> None:
    """Stop what an earlier run recorded at `path` and left running. Runs shielded and
    bounded like `stop_tree`: a leftover sglang keeps its GPUs' memory."""
    with trio.CancelScope(shield=True):
        try:
            record = await trio.to_thread.run_sync(read_record, path)
        except RecordError as error:
            log.warning(
                "the model server record %s is unusable (%s); nothing is stopped on its word, and it is removed",
                path,
                error,
            )
            await trio.to_thread.run_sync(remove_record, path)
            return
        if record is None:
            return
        mine, others = ours(record, await trio.to_thread.run_sync(observe_group, record))
        if others:
            log.warning(
                "%s names pid %d (run %s), but %s %s no process of that model server: left alone",
                path,
                record.pid,
                record.run_id[:8],
                describe_all(others),
                "is" if len(others) == 1 else "are",
            )
        if not mine:
            log.info("the model server an earlier run recorded in %s (pid %d) is no longer running", path, record.pid)
        else:
            log.warning(
                "a model server left by an earlier run in this home is still running: %s; stopping it "
                "(SIGTERM, then SIGKILL after %g s)",
                describe_all(mine),
                grace_s,
            )
            survivors = await _stop_processes(mine, grace_s=grace_s)
            if survivors:
                log.error(
                    "the leftover model server survived SIGKILL for %g s: %s; stop it by hand (`kill -9 PID`)",
                    KILL_WAIT_S,
                    describe_all(survivors),
                )
                return  # keep the record: the next start tries again
            log.info("stopped the leftover model server (%d process(es))", len(mine))
        await trio.to_thread.run_sync(remove_record, path)


async def _stop_processes(views: Sequence[ProcessView], *, grace_s: float) -> list[ProcessView]:
    """SIGTERM each process, wait up to `grace_s` for all of them, SIGKILL the rest, wait up to
    `KILL_WAIT_S`. Returns those still running. A process whose start time no longer matches
    what was seen (its pid was reused meanwhile) is never signalled."""
    import psutil

    processes: dict[int, tuple[ProcessView, psutil.Process]] = {}
    for view in views:
        try:
            process = psutil.Process(view.pid)
            if abs(process.create_time() - view.start_time) <= START_TIME_TOLERANCE_S:
                processes[view.pid] = (view, process)
        except psutil.Error:
            continue  # already gone

    def running() -> list[tuple[ProcessView, psutil.Process]]:
        alive = []
        for view, process in processes.values():
            try:
                # psutil refuses to signal or report a pid that now names another process.
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append((view, process))
            except psutil.Error:
                continue
        return alive

    for deadline, signum in ((grace_s, signal.SIGTERM), (KILL_WAIT_S, signal.SIGKILL)):
        for _, process in running():
            try:
                process.send_signal(signum)
            except psutil.Error:
                continue
        with trio.move_on_after(deadline):
            while running():
                await trio.sleep(GROUP_POLL_S)
            return []
    return [view for view, _ in running()]
