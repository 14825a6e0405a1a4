"""validators: one row per validator, its latest heartbeat whatever order heartbeats land in."""

from __future__ import annotations

import dataclasses

import pytest

from engy_node.gateway.store import ValidatorHeartbeat

DIGEST = "ab" * 32


def heartbeat(**overrides) -> ValidatorHeartbeat:
    fields = dict(
        hotkey="5Val", version="0.4.1", synced_epoch=7, consensus_epoch=7, consensus_digest=DIGEST, received_at=1_000.0
    )
    return ValidatorHeartbeat(**{**fields, **overrides})


def test_each_validator_keeps_its_latest_heartbeat(store):
    assert store.validator_heartbeats() == []
    store.record_heartbeat(heartbeat(hotkey="5Zed"))
    store.record_heartbeat(heartbeat())
    newer = heartbeat(
        version="0.5.0+local", synced_epoch=8, consensus_epoch=None, consensus_digest=None, received_at=1_060.0
    )
    store.record_heartbeat(newer)
    assert store.validator_heartbeats() == [newer, heartbeat(hotkey="5Zed")]


def test_a_heartbeat_older_than_the_stored_one_is_ignored(store):
    store.record_heartbeat(heartbeat(synced_epoch=8, received_at=2_000.0))
    store.record_heartbeat(heartbeat(synced_epoch=7, received_at=1_999.0))
    assert [hb.synced_epoch for hb in store.validator_heartbeats()] == [8]


def test_a_validator_that_has_synced_nothing_yet_is_recorded(store):
    empty = heartbeat(synced_epoch=None, consensus_epoch=None, consensus_digest=None)
    store.record_heartbeat(empty)
    assert store.validator_heartbeats() == [empty]


@pytest.mark.parametrize(
    "overrides",
    [
        {"hotkey": ""},
        {"hotkey": "5 Val"},
        {"version": ""},
        {"version": "v 1 2"},
        {"version": " 1"},
        {"version": "x" * 129},
        {"synced_epoch": -1},
        {"synced_epoch": 1.0},
        {"consensus_epoch": True},
        {"consensus_digest": DIGEST.upper()},
        {"consensus_digest": "ab"},
        {"consensus_digest": ""},
        {"received_at": float("-inf")},
    ],
)
def test_a_malformed_heartbeat_is_refused(overrides):
    with pytest.raises(ValueError):
        heartbeat(**overrides)


def test_the_public_light_validators_version_format_is_accepted():
    assert heartbeat(version="engy-lv 0.4.4").version == "engy-lv 0.4.4"


def test_record_heartbeat_takes_only_heartbeats(store):
    with pytest.raises(TypeError, match="ValidatorHeartbeat"):
        store.record_heartbeat(dataclasses.asdict(heartbeat()))


def test_the_heartbeat_has_no_field_that_can_hold_text():
    marker = "ZDR canary: the heron sings at midnight"
    for field in dataclasses.fields(ValidatorHeartbeat):
        with pytest.raises(ValueError):
            heartbeat(**{field.name: marker})
