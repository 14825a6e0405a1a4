"""The model server's lifeline: its process group dies with the node, however the node dies.

A model server the node started must not outlive it: an orphaned sglang keeps its GPUs' memory
and its port, and the next start beside it fails or, worse, serves next to it. Stopping the
group from the node covers every stop the node lives through; this module covers the ones it
does not (SIGKILL, the OOM killer, a crash in native code).

Why not the kernel's parent-death signal (PR_SET_PDEATHSIG): it fires when the *thread* that
forked the child exits, not the process. trio starts processes from a worker thread
(`trio.to_thread.run_sync(subprocess.Popen, ...)` in trio/_subprocess.py), and its thread cache
ends a worker after 10 s idle (IDLE_TIMEOUT in trio/_core/_thread_cache.py), so a healthy node
would kill its model server ten seconds after starting it. Polling the parent pid would need a
loop inside the server, which sglang does not have.

The shape. The supervisor starts `python -m engy_node.miner.lifeline --fd N --grace S -- COMMAND`
as the leader of a new session. Descriptor N is the read end of a pipe whose only write end the
node holds. The guard forks a watcher, then execs COMMAND in place, so the supervisor's child
*is* the model server: the same pid, leading the group, its output, exit code and signals
reaching the supervisor unchanged. The watcher stays in the group, detached from the output
pipe, blocked reading descriptor N. That read returns end-of-file only once every write end is
closed: when the node closed it after stopping the group, or when the kernel closed it because
the node died. On end-of-file the watcher sends SIGTERM to the group, waits up to the grace for
the rest of it to go, then sends SIGKILL to the group, itself included.

What it costs: one small sleeping process per model server (a fork of a bare interpreter that
loaded only this module). On a normal stop the supervisor's SIGTERM to the group ends the
watcher along with the server.

What escapes: a process that leaves the group (setsid), and everything if the watcher itself
is killed first. The supervisor's run record (`engy_node.miner.sglang.leftovers`) finds those
at the next start in the same home.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["guarded_argv", "main", "parse_args"]

MODULE = "engy_node.miner.lifeline"
WATCH_POLL_S = 0.1
"""How often the watcher checks, after the node died, whether the rest of the group is gone."""
EXEC_FAILED_EXIT_CODE = 127
"""What a shell returns for a command it cannot run; the supervisor classifies the line it prints."""
USAGE_EXIT_CODE = 2


def guarded_argv(command: Sequence[str], *, python: str, lifeline_fd: int, grace_s: float) -> list[str]:
    """The command line that runs `command` on a lifeline read from descriptor `lifeline_fd`.

    Pure. `python` must be an interpreter that can import engy_node (the node's own)."""
    if not command:
        raise ValueError("command must name a program")
    if not grace_s > 0:
        raise ValueError(f"grace_s must be positive, got {grace_s!r}")
    return [python, "-m", MODULE, "--fd", str(lifeline_fd), "--grace", repr(float(grace_s)), "--", *command]


def parse_args(argv: Sequence[str]) -> tuple[int, float, list[str]]:
    """(descriptor, grace in seconds, command) from `--fd N --grace S -- COMMAND...`. Raises
    ValueError naming what is wrong."""
    words = list(argv)
    if "--" not in words:
        raise ValueError("expected --fd N --grace S -- COMMAND...")
    split = words.index("--")
    options, command = words[:split], words[split + 1 :]
    if len(options) != 4 or options[0] != "--fd" or options[2] != "--grace":
        raise ValueError(f"expected --fd N --grace S before --, got {' '.join(options)!r}")
    fd, grace_s = int(options[1]), float(options[3])
    if fd < 0 or not 0 < grace_s < float("inf"):
        raise ValueError(f"--fd must be a descriptor and --grace a positive number of seconds, got {fd} and {grace_s}")
    if not command:
        raise ValueError("no command after --")
    return fd, grace_s, command


def main(argv: Sequence[str] | None = None) -> int:
    """Fork the watcher, then exec the command. Returns only when the command cannot be run."""
    try:
        fd, grace_s, command = parse_args(sys.argv[1:] if argv is None else argv)
        os.fstat(fd)  # without its lifeline the server would be unguarded: refuse to start it
    except (ValueError, OSError) as error:
        print(f"{MODULE}: {error}", file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE
    if os.fork() == 0:
        _watch(fd, grace_s)
    os.close(fd)  # the server never needs the lifeline; only the watcher holds it
    # Python ignores these at start-up and an ignored signal stays ignored across exec; the
    # server gets the defaults that subprocess.Popen would have given it (restore_signals).
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        # Imported only here: it loads the supervisor's package, which the happy path never needs.
        from engy_node.miner.sglang.failures import LAUNCH_FAILED_PREFIX

        print(f"{LAUNCH_FAILED_PREFIX}{command[0]}: {type(error).__name__}: {error.strerror}", flush=True)
    return EXEC_FAILED_EXIT_CODE


def _watch(fd: int, grace_s: float) -> NoReturn:
    """The watcher: wait for the lifeline to break, then stop the group. Never returns."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            # Off the output pipe, so the server's output ends when the server does.
            os.dup2(devnull, std)
        # Bounded by the node's life: nobody writes to the lifeline, so the read returns only at
        # end-of-file (a stray byte is read and ignored).
        while os.read(fd, 64):
            pass
        _stop_group(os.getpgrp(), grace_s)
    finally:
        os._exit(0)


def _stop_group(group: int, grace_s: float) -> None:
    """SIGTERM the group (not this process), wait up to `grace_s` for it, then SIGKILL it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _others_running(group):
            time.sleep(WATCH_POLL_S)
    finally:
        os.killpg(group, signal.SIGKILL)


def _others_running(group: int) -> bool:
    """Whether a process of `group` other than this one is still running (zombies do not count)."""
    import psutil  # only after the node died, which is rare

    me = os.getpid()
    for process in psutil.process_iter(["status"]):
        try:
            if (
                process.pid != me
                and os.getpgid(process.pid) == group
                and process.info["status"] != psutil.STATUS_ZOMBIE
            ):
                return True
        except (OSError, psutil.Error):
            continue  # gone while we looked
    return False


if __name__ == "__main__":
    sys.exit(main())
