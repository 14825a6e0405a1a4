"""The light loop's persisted state (engy_node.validator.state): written atomically in the public
validator's format, read field by field, and advanced only as a confirmed submission allows."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.protocol import epoch
from engy_node.validator.state import (
    EMPTY,
    FILE_PROBLEM,
    ValidatorState,
    after_submit,
    atomic_write_json,
    read_state,
    write_state,
)

HOTKEY_A = "5DXSBCCKH5ENuyHFNaAvtaMfbhEEWpjSJB4rzc4mJfsc1uvJ"
HOTKEY_B = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
DIGEST = "ab" * 32
OTHER_DIGEST = "cd" * 32

FULL = ValidatorState(
    last_applied=7,
    last_submit_block=1234,
    last_submit_ts=1_700_000_000.5,
    cached_weights=((HOTKEY_A, 40000), (HOTKEY_B, 25535)),
    cached_digest=DIGEST,
)
FULL_DOCUMENT = {
    "last_applied": 7,
    "last_submit_block": 1234,
    "last_submit_ts": 1_700_000_000.5,
    "cached_weights": [[HOTKEY_A, 40000], [HOTKEY_B, 25535]],
    "cached_digest": DIGEST,
}


def write_document(path: Path, document: Any) -> Path:
    path.write_text(json.dumps(document))
    return path


# ---- strategies ------------------------------------------------------------------------------

BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
hotkeys = st.text(alphabet=BASE58, min_size=1, max_size=64)
valid_weights = (
    st.lists(
        st.tuples(hotkeys, st.integers(min_value=0, max_value=65535)), min_size=1, max_size=8, unique_by=lambda p: p[0]
    )
    .filter(lambda pairs: sum(weight for _, weight in pairs) > 0)
    .map(tuple)
)
valid_states = st.builds(
    ValidatorState,
    last_applied=st.none() | st.integers(min_value=0, max_value=2**63),
    last_submit_block=st.none() | st.integers(min_value=0, max_value=2**63),
    last_submit_ts=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    cached_weights=st.none() | valid_weights,
    cached_digest=st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)


# ---- reading ---------------------------------------------------------------------------------


def test_a_missing_file_is_a_fresh_validator(tmp_path: Path) -> None:
    assert read_state(tmp_path / "state.json") == (EMPTY, ())


def test_a_full_state_reads_back_exactly(tmp_path: Path) -> None:
    assert read_state(write_document(tmp_path / "state.json", FULL_DOCUMENT)) == (FULL, ())


def test_a_file_written_by_the_public_validator_reads(tmp_path: Path) -> None:
    # Its write_state: json.dump of these five keys, an integer time allowed, and nulls for a
    # standby submission (no cache) or an unknown block.
    path = tmp_path / "state.json"
    path.write_text(
        '{"last_applied": 3, "last_submit_block": null, "last_submit_ts": 1700000000, '
        '"cached_weights": null, "cached_digest": null}'
    )
    state, problems = read_state(path)
    assert problems == ()
    assert state == ValidatorState(last_applied=3, last_submit_ts=1_700_000_000.0)
    assert isinstance(state.last_submit_ts, float)


def test_null_and_absent_fields_read_as_unknown_without_a_problem(tmp_path: Path) -> None:
    assert read_state(write_document(tmp_path / "s.json", {})) == (EMPTY, ())
    nulls = dict.fromkeys(FULL_DOCUMENT)
    assert read_state(write_document(tmp_path / "s.json", nulls)) == (EMPTY, ())


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    document = {**FULL_DOCUMENT, "version": 2, "note": {"anything": [1, 2]}}
    assert read_state(write_document(tmp_path / "s.json", document)) == (FULL, ())


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"not json",
        b"\xff\xfe{}",
        b"[1, 2]",
        b'"state"',
        b"42",
        b"null",
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["empty", "truncated", "text", "bad-utf8", "list", "string", "number", "null", "deeply-nested"],
)
def test_a_file_that_is_not_a_json_object_reads_as_empty_with_a_file_problem(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    assert read_state(path) == (EMPTY, (FILE_PROBLEM,))


def test_a_path_that_cannot_be_read_as_a_file_is_a_file_problem(tmp_path: Path) -> None:
    assert read_state(tmp_path) == (EMPTY, (FILE_PROBLEM,))


INVALID_VALUES: dict[str, list[Any]] = {
    "last_applied": [True, False, -1, 7.0, "7", [7], {"epoch": 7}],
    "last_submit_block": [True, -5, 1234.0, "1234", []],
    "last_submit_ts": [True, "1700000000", [1.0], {}, "NaN"],
    "cached_weights": [
        [],
        {},
        "weights",
        [[HOTKEY_A]],
        [[HOTKEY_A, 1, 2]],
        f'[["{HOTKEY_A}", 1]]',
        [{"hotkey": HOTKEY_A, "weight": 1}],
        [[HOTKEY_A, 0]],
        [[HOTKEY_A, 0], [HOTKEY_B, 0]],
        [[HOTKEY_A, 1], [HOTKEY_A, 2]],
        [[HOTKEY_A, -1]],
        [[HOTKEY_A, 65536]],
        [[HOTKEY_A, True]],
        [[HOTKEY_A, 1.0]],
        [[HOTKEY_A, "1"]],
        [[1, 1]],
        [[None, 1]],
        [["", 1]],
        [["5Dx0", 1]],
        [["5DxO", 1]],
        [["5DxI", 1]],
        [["5Dxl", 1]],
        [["5D x", 1]],
        [[HOTKEY_A + "\n", 1]],
        [["1" * 65, 1]],
        [[HOTKEY_A, 1], "junk"],
    ],
    "cached_digest": ["", DIGEST.upper(), DIGEST[:-1], DIGEST + "0", "g" * 64, " " + DIGEST[1:], 12, True, [DIGEST]],
}


@pytest.mark.parametrize(
    ("field", "bad"),
    [(field, bad) for field, values in INVALID_VALUES.items() for bad in values],
)
def test_an_invalid_field_is_discarded_alone_and_named(tmp_path: Path, field: str, bad: Any) -> None:
    path = write_document(tmp_path / "state.json", {**FULL_DOCUMENT, field: bad})
    state, problems = read_state(path)
    assert problems == (field,)
    assert state == ValidatorState(**{**_fields(FULL), field: None})


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_a_timestamp_that_is_not_finite_is_discarded(tmp_path: Path, token: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(FULL_DOCUMENT).replace("1700000000.5", token))
    state, problems = read_state(path)
    assert problems == ("last_submit_ts",)
    assert state.last_submit_ts is None
    assert state.last_applied == 7 and state.cached_weights == FULL.cached_weights


def test_every_invalid_field_is_named_in_field_order(tmp_path: Path) -> None:
    document = {
        "cached_digest": "nope",
        "cached_weights": [],
        "last_submit_ts": True,
        "last_submit_block": -1,
        "last_applied": "x",
    }
    state, problems = read_state(write_document(tmp_path / "s.json", document))
    assert state == EMPTY
    assert problems == ("last_applied", "last_submit_block", "last_submit_ts", "cached_weights", "cached_digest")


def test_the_edges_of_the_valid_ranges_are_accepted(tmp_path: Path) -> None:
    document = {
        "last_applied": 0,
        "last_submit_block": 0,
        "last_submit_ts": 0,
        "cached_weights": [["1", 0], ["z" * 64, 65535]],
        "cached_digest": "0" * 64,
    }
    state, problems = read_state(write_document(tmp_path / "s.json", document))
    assert problems == ()
    assert state == ValidatorState(0, 0, 0.0, (("1", 0), ("z" * 64, 65535)), "0" * 64)


# The cached vector goes to the chain as it is, so it is held to the epoch parser's rule. The
# parser's own check is the oracle here.
near_weights = valid_weights.map(lambda pairs: [list(pair) for pair in pairs]) | st.lists(
    st.one_of(
        st.lists(
            st.one_of(hotkeys, st.sampled_from(["", "0", "O", "I", "l", " ", "1" * 65]), st.integers(), st.booleans()),
            min_size=0,
            max_size=3,
        ),
        st.tuples(hotkeys, st.integers(min_value=0, max_value=65535)).map(list),
        st.tuples(st.sampled_from([HOTKEY_A, HOTKEY_B, "1"]), st.integers(min_value=-2, max_value=65537)).map(list),
        st.tuples(hotkeys, st.floats(allow_nan=False) | st.booleans() | st.none()).map(list),
    ),
    max_size=5,
)


@given(raw=near_weights)
def test_the_cached_vector_is_held_to_the_epoch_parsers_rule(raw: list) -> None:
    try:
        expected: Any = epoch.read_weights(raw)
    except epoch.EpochPayloadError:
        expected = None
    with tempfile.TemporaryDirectory() as directory:
        path = write_document(Path(directory) / "s.json", {"cached_weights": raw})
        state, problems = read_state(path)
    assert state.cached_weights == expected
    assert problems == (() if expected is not None else ("cached_weights",))


# ---- writing ---------------------------------------------------------------------------------


def test_write_uses_the_public_validators_keys_and_shapes(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, FULL)
    assert json.loads(path.read_text()) == FULL_DOCUMENT


def test_unknown_fields_are_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, ValidatorState(last_applied=2, last_submit_ts=5.0))
    assert json.loads(path.read_text()) == {
        "last_applied": 2,
        "last_submit_block": None,
        "last_submit_ts": 5.0,
        "cached_weights": None,
        "cached_digest": None,
    }


@given(state=valid_states)
def test_every_valid_state_reads_back_as_written(state: ValidatorState) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state.json"
        write_state(path, state)
        assert read_state(path) == (state, ())


def test_write_creates_the_parent_directory_and_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.json"
    write_state(path, FULL)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_state(path) == (FULL, ())


def test_write_replaces_the_previous_file_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, FULL)
    os.chmod(path, 0o644)
    write_state(path, EMPTY)
    assert read_state(path) == (EMPTY, ())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_write_fsyncs_the_new_content_before_moving_it_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def replace(source: Any, target: Any) -> None:
        events.append("replace")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_state(tmp_path / "state.json", FULL)
    assert events == ["fsync", "replace"]


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("last_applied", -1),
        ("last_applied", True),
        ("last_submit_block", 1.5),
        ("last_submit_ts", float("nan")),
        ("last_submit_ts", float("inf")),
        ("cached_weights", ()),
        ("cached_weights", ((HOTKEY_A, 0),)),
        ("cached_weights", ((HOTKEY_A, 1), (HOTKEY_A, 2))),
        ("cached_weights", (("not base58 0", 1),)),
        ("cached_digest", "ABC"),
    ],
)
def test_a_state_that_would_not_read_back_is_refused_and_the_old_file_kept(
    tmp_path: Path, field: str, bad: Any
) -> None:
    path = tmp_path / "state.json"
    write_state(path, FULL)
    with pytest.raises(ValueError, match=field):
        write_state(path, ValidatorState(**{**_fields(FULL), field: bad}))
    assert read_state(path) == (FULL, ())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    write_state(path, FULL)

    def fail(source: Any, target: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk gone"):
        write_state(path, EMPTY)
    monkeypatch.undo()
    assert read_state(path) == (FULL, ())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_write_onto_a_directory_fails_cleanly(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.mkdir()
    with pytest.raises(OSError):
        write_state(target, FULL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_atomic_write_json_refuses_what_is_not_plain_json_before_touching_the_disk(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"ts": float("nan")})
    with pytest.raises(TypeError):
        atomic_write_json(tmp_path / "x.json", {"ts": object()})
    assert list(tmp_path.iterdir()) == []


# ---- the transition after a submission -------------------------------------------------------


def test_a_scored_submission_moves_every_field() -> None:
    after = after_submit(
        FULL,
        epoch_index=8,
        block=1500,
        now=1_700_001_000.0,
        weights=[(HOTKEY_B, 65535)],
        digest=OTHER_DIGEST,
        standby=False,
    )
    assert after == ValidatorState(8, 1500, 1_700_001_000.0, ((HOTKEY_B, 65535),), OTHER_DIGEST)


def test_a_standby_submission_moves_only_the_anchor_and_keeps_the_cache() -> None:
    after = after_submit(
        FULL,
        epoch_index=8,
        block=1500,
        now=1_700_001_000.0,
        weights=[(HOTKEY_B, 65535)],
        digest=OTHER_DIGEST,
        standby=True,
    )
    assert after == ValidatorState(8, 1500, 1_700_001_000.0, FULL.cached_weights, FULL.cached_digest)


def test_a_first_submission_on_standby_leaves_no_cache_to_resubmit() -> None:
    after = after_submit(
        EMPTY, epoch_index=0, block=None, now=5.0, weights=[(HOTKEY_A, 65535)], digest=None, standby=True
    )
    assert after == ValidatorState(last_applied=0, last_submit_ts=5.0)


def test_a_resubmission_of_the_cache_without_its_digest_records_no_digest() -> None:
    after = after_submit(
        FULL, epoch_index=7, block=1400, now=9.0, weights=FULL.cached_weights, digest=None, standby=False
    )
    assert after.cached_weights == FULL.cached_weights and after.cached_digest is None


def test_the_weights_are_stored_as_tuples_whatever_sequence_came_in() -> None:
    lists: Any = [[HOTKEY_A, 5]]
    after = after_submit(EMPTY, epoch_index=1, block=2, now=3.0, weights=lists, digest=DIGEST, standby=False)
    assert after.cached_weights == ((HOTKEY_A, 5),)
    assert isinstance(after.cached_weights, tuple) and isinstance(after.cached_weights[0], tuple)


@given(
    before=valid_states,
    epoch_index=st.integers(min_value=0, max_value=10**6),
    block=st.none() | st.integers(min_value=0, max_value=10**9),
    now=st.floats(allow_nan=False, allow_infinity=False),
    weights=valid_weights,
    digest=st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    standby=st.booleans(),
)
def test_the_state_after_any_submission_survives_a_write_and_read(
    before: ValidatorState,
    epoch_index: int,
    block: int | None,
    now: float,
    weights: tuple[tuple[str, int], ...],
    digest: str | None,
    standby: bool,
) -> None:
    after = after_submit(
        before, epoch_index=epoch_index, block=block, now=now, weights=weights, digest=digest, standby=standby
    )
    assert (after.last_applied, after.last_submit_block, after.last_submit_ts) == (epoch_index, block, now)
    expected_cache = (before.cached_weights, before.cached_digest) if standby else (weights, digest)
    assert (after.cached_weights, after.cached_digest) == expected_cache
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state.json"
        write_state(path, after)
        assert read_state(path) == (after, ())


def _fields(state: ValidatorState) -> dict[str, Any]:
    return {name: getattr(state, name) for name in ValidatorState.__dataclass_fields__}
