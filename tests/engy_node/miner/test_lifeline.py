"""The lifeline guard on its own: its command line, that the guarded command is the child itself,
and that the group goes once the lifeline breaks, a child that ignores SIGTERM included.

"The lifeline breaks" is played here by closing the write end, which is what the kernel does
for a node that dies: the watcher cannot tell the two apart. The whole-node case (a miner
killed with SIGKILL) is in test_lifecycle.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from engy_node.miner.lifeline import EXEC_FAILED_EXIT_CODE, guarded_argv, parse_args
from tests.waiting import wait_until


def test_the_guarded_command_line_parses_back_to_its_parts():
    argv = guarded_argv(
        ["python", "-m", "sglang.launch_server", "--port", "30000"],
        python="/venv/bin/python",
        lifeline_fd=7,
        grace_s=15,
    )
    assert argv[:3] == ["/venv/bin/python", "-m", "engy_node.miner.lifeline"]
    assert parse_args(argv[3:]) == (7, 15.0, ["python", "-m", "sglang.launch_server", "--port", "30000"])


@pytest.mark.parametrize(
    "words",
    [
        [],
        ["--fd", "3", "--grace", "1"],
        ["--fd", "3", "--", "x"],
        ["--fd", "3", "--grace", "0", "--", "x"],
        ["--fd", "3", "--grace", "1", "--"],
    ],
)
def test_a_malformed_guard_command_line_is_refused(words):
    with pytest.raises(ValueError):
        parse_args(words)


def test_guarded_argv_refuses_an_empty_command_and_a_zero_grace():
    with pytest.raises(ValueError, match="command"):
        guarded_argv([], python="python", lifeline_fd=3, grace_s=1)
    with pytest.raises(ValueError, match="grace_s"):
        guarded_argv(["x"], python="python", lifeline_fd=3, grace_s=0)


def start_guarded(command: list[str], *, grace_s: float) -> tuple[subprocess.Popen, int]:
    """Start `command` on a lifeline as the supervisor does; returns the child and the write end."""
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            guarded_argv(command, python=sys.executable, lifeline_fd=read_end, grace_s=grace_s),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            pass_fds=(read_end,),
        )
    finally:
        os.close(read_end)
    return child, write_end


def group_running(pgid: int) -> list[int]:
    running = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                running.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return running


def test_the_child_is_the_command_itself_with_its_output_and_exit_code():
    child, write_end = start_guarded(
        [sys.executable, "-c", "import os; print('pid', os.getpid()); raise SystemExit(3)"], grace_s=5
    )
    try:
        output, _ = child.communicate(timeout=60)
    finally:
        os.close(write_end)
    assert output.split() == ["pid", str(child.pid)], "the guard execs the command in place and prints nothing"
    assert child.returncode == 3


def test_a_command_that_cannot_be_executed_says_so_in_the_supervisors_words(tmp_path):
    missing = str(tmp_path / "no-such-python")
    child, write_end = start_guarded([missing, "-m", "sglang.launch_server"], grace_s=5)
    try:
        output, _ = child.communicate(timeout=60)
    finally:
        os.close(write_end)
    assert child.returncode == EXEC_FAILED_EXIT_CODE
    assert output.startswith("engy: cannot execute the model server command: ") and missing in output


def test_the_group_goes_when_the_lifeline_breaks_even_a_process_that_ignores_sigterm():
    stubborn = textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("grandchild", grandchild.pid, flush=True)
        time.sleep(60)
    """)
    child, write_end = start_guarded([sys.executable, "-c", stubborn], grace_s=0.5)
    try:
        line = child.stdout.readline().split()
        assert line[0] == "grandchild", line
        grandchild = int(line[1])
        assert grandchild in group_running(child.pid)
        assert len(group_running(child.pid)) == 3, "the command, its child and the watcher"
    finally:
        os.close(write_end)
    # The group is other processes that announce nothing as they go: a bounded poll.
    wait_until(lambda: not group_running(child.pid), timeout_s=30, what="the whole group gone after the lifeline broke")
    assert child.wait(timeout=10) == -9, "SIGTERM was ignored, so the grace ended in SIGKILL"
