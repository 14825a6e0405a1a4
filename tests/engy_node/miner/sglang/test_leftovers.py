"""The run record and the rules that say which running processes an earlier run left behind.

The rules are the safety of the leftover sweep: a process they wrongly call ours gets killed.
So each way a pid or a group id can come to name someone else's process has a case here.
"""

from __future__ import annotations

import pytest

from engy_node.miner.sglang.leftovers import (
    ProcessView,
    RecordError,
    RunRecord,
    ours,
    read_record,
    remove_record,
    write_record,
)

ARGV = ("/venv/bin/python", "-m", "sglang.launch_server", "--port", "30000")
RECORD = RunRecord(pid=4242, start_time=1_760_000_000.25, argv=ARGV, run_id="run-a")


def view(
    pid: int, *, pgid: int = 4242, start_time: float = 1_760_000_000.25, cmdline=ARGV, run_id: str | None = "run-a"
):
    return ProcessView(pid=pid, pgid=pgid, start_time=start_time, cmdline=tuple(cmdline), run_id=run_id)


def pids(views) -> list[int]:
    return sorted(v.pid for v in views)


def test_the_recorded_leader_and_its_whole_group_are_ours():
    rank = view(4300, start_time=1_760_000_003.0, cmdline=("sglang::scheduler_TP0",), run_id=None)
    mine, others = ours(RECORD, [view(4242), rank])
    assert (pids(mine), others) == ([4242, 4300], [])


def test_a_retitled_leader_is_recognised_by_its_run_id():
    mine, _ = ours(RECORD, [view(4242, cmdline=("sglang::main",))])
    assert pids(mine) == [4242]


def test_a_retitled_leader_without_the_run_id_is_left_alone_with_its_group():
    mine, others = ours(
        RECORD, [view(4242, cmdline=("sglang::main",), run_id=None), view(4300, cmdline=("other",), run_id=None)]
    )
    assert (mine, pids(others)) == ([], [4242, 4300])


def test_a_reused_pid_is_never_ours_even_with_the_same_command_line():
    # Same pid and command, started later: another run of the same command, perhaps another
    # home's, whose environment does not carry this record's run id.
    mine, others = ours(
        RECORD,
        [
            view(4242, start_time=1_760_000_500.0, run_id="run-b"),
            view(4300, start_time=1_760_000_501.0, run_id="run-b"),
        ],
    )
    assert (mine, pids(others)) == ([], [4242, 4300])


def test_with_the_leader_gone_only_processes_carrying_the_run_id_are_ours():
    mine, others = ours(
        RECORD,
        [view(4300, cmdline=("sglang::scheduler_TP0",)), view(4301, cmdline=("sglang::detokenizer",), run_id=None)],
    )
    assert (pids(mine), pids(others)) == ([4300], [4301])


def test_start_times_within_a_clock_tick_match_and_beyond_it_do_not():
    assert pids(ours(RECORD, [view(4242, start_time=RECORD.start_time + 0.01)])[0]) == [4242]
    assert ours(RECORD, [view(4242, start_time=RECORD.start_time + 1.0)])[0] == []


def test_a_record_survives_the_round_trip_through_its_file(tmp_path):
    path = tmp_path / "run" / "model_server.json"
    assert read_record(path) is None
    write_record(path, RECORD)
    assert read_record(path) == RECORD
    assert list(path.parent.iterdir()) == [path], "no temporary file is left beside it"
    remove_record(path)
    assert read_record(path) is None


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"pid": true, "start_time": 1.0, "argv": ["x"], "run_id": "r"}', "pid"),
        ('{"pid": 0, "start_time": 1.0, "argv": ["x"], "run_id": "r"}', "pid"),
        ('{"pid": 5, "start_time": "now", "argv": ["x"], "run_id": "r"}', "start_time"),
        ('{"pid": 5, "start_time": 1.0, "argv": [], "run_id": "r"}', "argv"),
        ('{"pid": 5, "start_time": 1.0, "argv": ["x"], "run_id": ""}', "run_id"),
    ],
)
def test_a_malformed_record_is_refused_naming_what_is_wrong(tmp_path, text, field):
    path = tmp_path / "model_server.json"
    path.write_text(text)
    with pytest.raises(RecordError, match=field):
        read_record(path)
