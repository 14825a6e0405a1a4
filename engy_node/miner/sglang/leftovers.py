"""The run record of a supervised model server, and how a later start recognises what an earlier
run left behind.

Why: the lifeline (`engy_node.miner.lifeline`) stops a model server whose node died, but a
watcher that was itself killed, a grandchild that left the group, or a node restarted while the
watcher is still in its grace period leave a server running. The next start would find the
port taken (`port_in_use`) or, on another port, run a second server beside the first, each
holding GPU memory. So the supervisor records every child it starts, and before each start it
stops whatever of an earlier record is still running.

The record (`RunRecord`, one JSON file per supervised server in the node's data dir) holds the
child's pid, its start time as the kernel reports it, its argv and a run id that the child and
everything it forks carry in their environment (`RUN_ID_ENV`).

What counts as ours, decided by `ours` (pure): pids are reused, and killing a stranger's process
is the costlier mistake, so nothing is signalled on the pid alone.

* The leader (the recorded pid) is ours when its start time matches the record (a reused pid
  starts later) and its command line still matches the argv or its environment carries the run
  id (a process may retitle itself).
* Another process of its group is ours when the leader is: a group's id is not reused while the
  group exists, so the group of our live leader is ours.
* With the leader gone, a process is ours only when its environment carries the run id; one
  whose environment cannot be read is left alone and named in the log.

Reading the record is defensive: a file that cannot be parsed is reported and replaced, never
trusted for a pid.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_ID_ENV",
    "START_TIME_TOLERANCE_S",
    "ProcessView",
    "RecordError",
    "RunRecord",
    "describe_all",
    "observe_group",
    "ours",
    "read_record",
    "remove_record",
    "start_time_of",
    "write_record",
]

RUN_ID_ENV = "ENGY_MODEL_SERVER_RUN"
"""Set in the model server's environment; its forks (sglang's rank processes) inherit it."""
START_TIME_TOLERANCE_S = 0.05
"""Start times are kernel clock ticks (10 ms) turned into floats; a reused pid starts at least a
whole lifetime of the first process later."""


class RecordError(ValueError):
    """The record file exists but does not hold a record."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunRecord:
    """One model server this node started."""

    pid: int
    start_time: float
    """The process's start time, seconds since the epoch, as psutil reads it from the kernel."""
    argv: tuple[str, ...]
    run_id: str

    def to_json(self) -> str:
        return json.dumps(
            {"pid": self.pid, "start_time": self.start_time, "argv": list(self.argv), "run_id": self.run_id}
        )

    @classmethod
    def parse(cls, text: str) -> RunRecord:
        """Raises RecordError naming the field that is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise RecordError(f"not JSON ({error})") from None
        if not isinstance(raw, dict):
            raise RecordError("not a JSON object")
        pid, start_time, argv, run_id = raw.get("pid"), raw.get("start_time"), raw.get("argv"), raw.get("run_id")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
            raise RecordError(f"pid must be a positive integer, got {pid!r}")
        if isinstance(start_time, bool) or not isinstance(start_time, int | float) or start_time <= 0:
            raise RecordError(f"start_time must be a positive number, got {start_time!r}")
        if not isinstance(argv, list) or not argv or not all(isinstance(word, str) for word in argv):
            raise RecordError("argv must be a non-empty list of strings")
        if not isinstance(run_id, str) or not run_id:
            raise RecordError("run_id must be a non-empty string")
        return cls(pid=pid, start_time=float(start_time), argv=tuple(argv), run_id=run_id)


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessView:
    """What was seen of one running process."""

    pid: int
    pgid: int
    start_time: float
    cmdline: tuple[str, ...]
    run_id: str | None
    """The value of `RUN_ID_ENV` in its environment; None when unset or unreadable."""

    def describe(self) -> str:
        command = " ".join(self.cmdline) or "?"
        return f"pid {self.pid} ({command[:120]})"


def ours(record: RunRecord, seen: Iterable[ProcessView]) -> tuple[list[ProcessView], list[ProcessView]]:
    """(the processes that belong to the recorded server, the others), from processes seen in
    its group or at its pid. Pure; see the module docstring for the rules."""
    seen = list(seen)
    leader = next((view for view in seen if view.pid == record.pid), None)
    leader_ours = leader is not None and _is_recorded_leader(record, leader)
    mine: list[ProcessView] = []
    others: list[ProcessView] = []
    for view in seen:
        if view is leader:
            belongs = leader_ours
        else:
            belongs = (leader_ours and view.pgid == record.pid) or view.run_id == record.run_id
        (mine if belongs else others).append(view)
    return mine, others


def _is_recorded_leader(record: RunRecord, view: ProcessView) -> bool:
    if abs(view.start_time - record.start_time) > START_TIME_TOLERANCE_S:
        return False
    return view.cmdline == record.argv or view.run_id == record.run_id


# ---- IO: the record file and the process table ---------------------------------------------------


def write_record(path: Path, record: RunRecord) -> None:
    """Write the record atomically (a temporary file and a rename): a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(record.to_json() + "\n", encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_record(path: Path) -> RunRecord | None:
    """The record at `path`; None when there is none. Raises RecordError when it is unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise RecordError(f"cannot be read ({type(error).__name__}: {error})") from None
    return RunRecord.parse(text)


def remove_record(path: Path) -> None:
    path.unlink(missing_ok=True)


def start_time_of(pid: int) -> float:
    """The kernel's start time of `pid`, as the record stores it. Raises psutil.Error when gone."""
    import psutil

    return psutil.Process(pid).create_time()


def observe_group(record: RunRecord) -> list[ProcessView]:
    """Every running process at the recorded pid or in its process group (zombies excluded).
    Blocking: it walks the process table."""
    import psutil

    seen: list[ProcessView] = []
    for process in psutil.process_iter():
        try:
            pgid = os.getpgid(process.pid)
            if process.pid != record.pid and pgid != record.pid:
                continue
            with process.oneshot():
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue
                seen.append(
                    ProcessView(
                        pid=process.pid,
                        pgid=pgid,
                        start_time=process.create_time(),
                        cmdline=tuple(process.cmdline()),
                        run_id=_run_id_of(process),
                    )
                )
        except (OSError, psutil.Error):
            continue  # gone while we looked, or not ours to read
    return seen


def _run_id_of(process: Any) -> str | None:
    import psutil

    try:
        return process.environ().get(RUN_ID_ENV)
    except (OSError, psutil.Error):
        return None


def describe_all(views: Sequence[ProcessView]) -> str:
    return ", ".join(view.describe() for view in views)
