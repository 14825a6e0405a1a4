"""Tests for engy_node.hub: the event ring and its polling readers, component states, snapshots,
the logging handler and `install_logging`, and concurrent producers."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from engy_node.hub import Event, EventBatch, Hub, HubHandler, install_logging
from engy_node.metrics import Registry
from engy_node.snapshots import STATE_SCHEMA, SchemaError


def emit_n(hub: Hub, count: int, *, start: int = 0) -> None:
    for i in range(start, start + count):
        hub.emit("info", "test", f"message {i}", ts=float(i))


# --- the ring and events_since ----------------------------------------------------------------


def test_emit_numbers_events_from_zero_and_keeps_what_it_was_given():
    hub = Hub()
    first = hub.emit("info", "serve.engine", "loaded", ts=12.5)
    second = hub.emit("warning", "node", "slow")
    assert first == Event(0, 12.5, "info", "serve.engine", "loaded")
    assert second.seq == 1
    assert second.ts > 0


def test_a_fresh_hub_has_no_events_and_the_reader_stays_at_zero():
    batch = Hub().events_since(0)
    assert batch == EventBatch((), 0, 0)


def test_events_since_returns_everything_after_the_given_seq_and_the_seq_to_pass_next():
    hub = Hub()
    emit_n(hub, 5)
    batch = hub.events_since(0)
    assert [e.seq for e in batch.events] == [0, 1, 2, 3, 4]
    assert batch.next_seq == 5
    assert batch.missed == 0

    later = hub.events_since(3)
    assert [e.seq for e in later.events] == [3, 4]
    assert later.next_seq == 5

    assert hub.events_since(batch.next_seq) == EventBatch((), 5, 0)
    emit_n(hub, 2, start=5)
    assert [e.message for e in hub.events_since(batch.next_seq).events] == ["message 5", "message 6"]


def test_a_reader_following_next_seq_sees_every_event_exactly_once():
    hub = Hub(ring_size=100)
    seen = []
    seq = 0
    for round_ in range(10):
        emit_n(hub, round_)  # a different number of events each round, none at first
        batch = hub.events_since(seq)
        assert batch.missed == 0
        seen.extend(e.seq for e in batch.events)
        seq = batch.next_seq
    assert seen == list(range(sum(range(10))))


def test_limit_caps_a_batch_and_next_seq_continues_where_it_stopped():
    hub = Hub()
    emit_n(hub, 10)
    first = hub.events_since(0, limit=4)
    assert [e.seq for e in first.events] == [0, 1, 2, 3]
    assert first.next_seq == 4
    second = hub.events_since(first.next_seq, limit=4)
    assert [e.seq for e in second.events] == [4, 5, 6, 7]
    third = hub.events_since(second.next_seq, limit=4)
    assert [e.seq for e in third.events] == [8, 9]
    assert third.next_seq == 10
    assert first.missed == second.missed == third.missed == 0


def test_a_reader_behind_an_overflowed_ring_is_told_how_many_it_missed():
    hub = Hub(ring_size=3)
    emit_n(hub, 8)  # seqs 0..7; the ring keeps 5, 6, 7
    batch = hub.events_since(0)
    assert [e.seq for e in batch.events] == [5, 6, 7]
    assert batch.missed == 5
    assert batch.next_seq == 8

    partly_behind = hub.events_since(4)
    assert partly_behind.missed == 1
    assert [e.seq for e in partly_behind.events] == [5, 6, 7]

    caught_up = hub.events_since(6)
    assert caught_up.missed == 0
    assert [e.seq for e in caught_up.events] == [6, 7]


def test_missed_and_limit_combine_when_an_overflowed_reader_takes_a_small_batch():
    hub = Hub(ring_size=4)
    emit_n(hub, 10)  # the ring keeps 6..9
    batch = hub.events_since(1, limit=2)
    assert batch.missed == 5
    assert [e.seq for e in batch.events] == [6, 7]
    assert batch.next_seq == 8


def test_a_reader_ahead_of_the_producer_gets_what_the_ring_holds_and_misses_nothing():
    hub = Hub()
    emit_n(hub, 3)
    batch = hub.events_since(10)
    assert [e.seq for e in batch.events] == [0, 1, 2]
    assert batch.missed == 0
    assert Hub().events_since(5).events == ()


def test_a_reader_ahead_of_the_producer_is_brought_back_to_the_producers_next_seq():
    """A reader can only be ahead when the node it polls restarted (seqs start again at 0). If
    next_seq stayed at the reader's own value, every event up to it would be skipped silently."""
    hub = Hub()
    emit_n(hub, 3)
    batch = hub.events_since(10)
    assert batch.next_seq <= 3
    emit_n(hub, 2, start=3)
    assert [e.seq for e in hub.events_since(batch.next_seq).events][-2:] == [3, 4]


# --- states and snapshot ----------------------------------------------------------------------


def test_set_state_merges_new_values_over_the_components_previous_state():
    hub = Hub()
    hub.set_state("serve", state="loading", model="smollm2-135m")
    hub.set_state("serve", state="ready", url="http://127.0.0.1:30000")
    hub.set_state("miner", inflight=0)
    assert hub.states() == {
        "serve": {"state": "ready", "model": "smollm2-135m", "url": "http://127.0.0.1:30000"},
        "miner": {"inflight": 0},
    }


def test_set_state_refuses_a_field_or_component_no_snapshot_type_declares():
    hub = Hub()
    with pytest.raises(SchemaError, match=r"'miner': gpus, status not declared by MinerState"):
        hub.set_state("miner", status="idle", gpus=2, inflight=0)
    with pytest.raises(SchemaError, match="'minr' has no snapshot type"):
        hub.set_state("minr", inflight=0)
    assert hub.states() == {}, "a refused state changes nothing"
    hub.set_state("miner-2", inflight=1)
    hub.set_state("model_server.miner-2", state="ready")
    hub.set_state("verifier", verdicts={"pass": 1, "cheat": 0, "unproven": 0})
    assert set(hub.states()) == {"miner-2", "model_server.miner-2", "verifier"}


def test_states_returns_copies_that_callers_cannot_use_to_change_the_hub():
    hub = Hub()
    hub.set_state("serve", state="ready")
    copy = hub.states()
    copy["serve"]["state"] = "tampered"
    copy["intruder"] = {}
    assert hub.states() == {"serve": {"state": "ready"}}


def test_a_state_read_earlier_does_not_change_when_the_component_updates():
    hub = Hub()
    hub.set_state("serve", state="loading")
    before = hub.states()
    hub.set_state("serve", state="ready")
    assert before == {"serve": {"state": "loading"}}


def test_a_snapshot_holds_states_metrics_and_the_last_seq():
    registry = Registry()
    hub = Hub(registry=registry)
    assert hub.registry is registry
    empty = hub.snapshot()
    assert set(empty) == {"schema", "states", "metrics", "last_seq"}
    assert empty["schema"] == STATE_SCHEMA
    assert empty["last_seq"] == -1
    assert empty["states"] == {}
    assert empty["metrics"] == registry.snapshot()

    hub.set_state("serve", state="ready")
    emit_n(hub, 3)
    snap = hub.snapshot()
    assert snap["last_seq"] == 2
    assert snap["states"] == {"serve": {"state": "ready"}}
    json.dumps(snap)  # plain JSON-ready data
    snap["states"]["serve"]["state"] = "changed"
    assert hub.states()["serve"]["state"] == "ready"


def test_a_hub_without_a_registry_makes_its_own():
    assert isinstance(Hub().registry, Registry)
    assert Hub().registry is not Hub().registry


# --- the logging handler ----------------------------------------------------------------------


def make_logger(name: str, hub: Hub, engy_logger: logging.Logger) -> logging.Logger:
    for handler in list(engy_logger.handlers):
        engy_logger.removeHandler(handler)
    engy_logger.addHandler(HubHandler(hub))
    engy_logger.setLevel(logging.DEBUG)
    engy_logger.propagate = False
    return logging.getLogger(name)


@pytest.mark.parametrize(
    ("logger_name", "component"),
    [("engy.serve.engine", "serve.engine"), ("engy", "node"), ("engy.gateway", "gateway")],
)
def test_the_handler_names_the_component_after_the_logger_without_the_engy_prefix(engy_logger, logger_name, component):
    hub = Hub()
    make_logger(logger_name, hub, engy_logger).info("hello %s", "world")
    (event,) = hub.events_since(0).events
    assert event.component == component
    assert event.message == "hello world"
    assert event.level == "info"


def test_the_handler_records_every_level_in_lower_case_including_debug(engy_logger):
    hub = Hub()
    log = make_logger("engy.x", hub, engy_logger)
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("c")
    assert [e.level for e in hub.events_since(0).events] == ["debug", "info", "warning", "error", "critical"]


def test_the_handler_uses_the_records_creation_time(engy_logger):
    hub = Hub()
    handler = HubHandler(hub)
    record = logging.LogRecord("engy.x", logging.INFO, __file__, 1, "at %d", (7,), None)
    record.created = 1234.5
    handler.emit(record)
    (event,) = hub.events_since(0).events
    assert event.ts == 1234.5
    assert event.message == "at 7"


def test_an_exception_is_appended_to_the_message(engy_logger):
    hub = Hub()
    log = make_logger("engy.serve", hub, engy_logger)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("request failed")
    (event,) = hub.events_since(0).events
    assert event.message == "request failed (ValueError: boom)"
    assert event.level == "error"


def test_a_record_that_cannot_be_formatted_does_not_raise(engy_logger, monkeypatch):
    hub = Hub()
    handler = HubHandler(hub)
    reported = []
    monkeypatch.setattr(handler, "handleError", lambda record: reported.append(record))
    record = logging.LogRecord("engy.x", logging.INFO, __file__, 1, "%d items", ("not a number",), None)
    handler.emit(record)
    assert reported == [record]
    assert hub.events_since(0).events == ()


# --- install_logging --------------------------------------------------------------------------


def test_install_logging_routes_engy_loggers_to_the_hub_and_a_log_file(engy_logger, tmp_path, capsys):
    hub = Hub()
    log_dir = tmp_path / "data" / "logs"
    install_logging(hub, level="info", log_dir=log_dir)
    log = logging.getLogger("engy.serve.engine")
    log.debug("detail for support")
    log.info("model loaded")
    for handler in engy_logger.handlers:
        handler.flush()

    log_file = log_dir / "engy-node.log"
    assert log_file.is_file()
    text = log_file.read_text(encoding="utf-8")
    assert "model loaded" in text
    assert "engy.serve.engine" in text
    assert "detail for support" not in text  # the file is at `level`
    # The hub keeps debug too.
    assert [(e.level, e.message) for e in hub.events_since(0).events] == [
        ("debug", "detail for support"),
        ("info", "model loaded"),
    ]
    assert engy_logger.propagate is False


def test_install_logging_at_debug_writes_debug_records_to_the_file(engy_logger, tmp_path, capsys):
    install_logging(Hub(), level="debug", log_dir=tmp_path)
    logging.getLogger("engy").debug("fine detail")
    for handler in engy_logger.handlers:
        handler.flush()
    assert "fine detail" in (tmp_path / "engy-node.log").read_text(encoding="utf-8")


def test_install_logging_twice_replaces_its_handlers_instead_of_duplicating_them(engy_logger, tmp_path, capsys):
    first, second = Hub(), Hub()
    install_logging(first, log_dir=tmp_path)
    install_logging(second, log_dir=tmp_path)
    logging.getLogger("engy.node").warning("once")
    assert first.events_since(0).events == ()
    assert [e.message for e in second.events_since(0).events] == ["once"]
    assert len(engy_logger.handlers) == 3  # hub, stderr, file


def test_install_logging_tolerates_a_log_dir_that_cannot_be_created(engy_logger, tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    hub = Hub()
    install_logging(hub, level="info", log_dir=blocker / "logs")
    logging.getLogger("engy.node").info("still logging")
    assert [e.message for e in hub.events_since(0).events] == ["still logging"]
    err = capsys.readouterr().err
    assert "cannot open a log file" in err
    assert "still logging" in err
    assert blocker.read_text() == "a regular file"


def test_install_logging_without_a_log_dir_logs_to_the_hub_and_stderr_only(engy_logger, capsys):
    hub = Hub()
    install_logging(hub, level="warning")
    log = logging.getLogger("engy.gateway")
    log.info("quiet")
    log.warning("loud")
    err = capsys.readouterr().err
    assert "loud" in err
    assert "quiet" not in err
    assert [e.message for e in hub.events_since(0).events] == ["quiet", "loud"]


# --- thread safety ----------------------------------------------------------------------------


def test_concurrent_producers_get_unique_consecutive_seqs_and_lose_nothing():
    threads_count, per_thread = 8, 500
    hub = Hub(ring_size=threads_count * per_thread)
    barrier = threading.Barrier(threads_count)
    returned: list[list[int]] = [[] for _ in range(threads_count)]

    def produce(index: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            returned[index].append(hub.emit("info", f"thread{index}", str(i)).seq)
            if i % 50 == 0:
                hub.set_state(f"miner-{index + 1}", inflight=i)
                hub.events_since(0, limit=10)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    total = threads_count * per_thread
    all_seqs = sorted(seq for seqs in returned for seq in seqs)
    assert all_seqs == list(range(total))
    for seqs in returned:
        assert seqs == sorted(seqs)  # each producer sees its own events in order

    batch = hub.events_since(0, limit=total)
    assert [e.seq for e in batch.events] == list(range(total))
    for index in range(threads_count):
        mine = [int(e.message) for e in batch.events if e.component == f"thread{index}"]
        assert mine == list(range(per_thread))
    assert hub.snapshot()["last_seq"] == total - 1


def test_set_log_level_changes_stderr_and_file_but_the_hub_keeps_everything(engy_logger, tmp_path):
    from engy_node.hub import set_log_level

    hub = Hub()
    install_logging(hub, level="info", log_dir=tmp_path)
    set_log_level("error")
    logging.getLogger("engy.test").warning("kept in the hub only")
    assert "kept in the hub only" in hub.events_since(0).events[-1].message
    assert "kept in the hub only" not in (tmp_path / "engy-node.log").read_text()
    set_log_level("debug")
    logging.getLogger("engy.test").debug("now in the file too")
    assert "now in the file too" in (tmp_path / "engy-node.log").read_text()
    with pytest.raises(ValueError, match="choose one of"):
        set_log_level("loud")
