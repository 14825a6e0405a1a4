"""Xid errors: the pure table and findings, the alert they fire and its recovery, NVML's event
calls through the fake NVML (an Xid delivered, drivers and GPUs without events), and the monitor
carrying them into the hub's `gpus` state."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pynvml
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from engy_node.alerts.rules import Book, Limits, evaluate
from engy_node.hardware.fake_nvml import FAKE_GPU_MODELS, FakeNvml
from engy_node.hardware.monitor import MonitorPynvml, run_gpu_monitor
from engy_node.hardware.xid_events import (
    XidEvent,
    XidWatch,
    next_xid,
    open_xid_events,
    watch_xids,
)
from engy_node.hardware.xids import XID_EXPLANATIONS, XID_RECENT_S, explain, record_xid, xid_findings
from engy_node.hub import Hub
from engy_node.snapshots import GpusState, NodeStates, XidRecord, decode_states
from tests.waiting import Changes, logged

WAIT_S = 10.0
RTX4090 = FAKE_GPU_MODELS["RTX4090"]
NO_EVENTS = dataclasses.replace(RTX4090, event_types=0)


# ---- the table and the findings (pure) ---------------------------------------------------------


def test_the_common_xids_are_explained_with_a_fix() -> None:
    assert set(XID_EXPLANATIONS) >= {13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}
    assert explain(79).what == "GPU has fallen off the bus" and explain(79).level == "error"
    assert "riser" in explain(79).fix
    assert explain(13).level == "warning", "usually the application's own fault"
    assert explain(48).level == explain(95).level == "error"


@given(st.integers(min_value=0, max_value=2**64 - 1).filter(lambda xid: xid not in XID_EXPLANATIONS))
def test_an_unlisted_xid_points_at_the_catalog_and_the_kernel_log(xid: int) -> None:
    meaning = explain(xid)
    assert meaning.level == "warning"
    assert "docs.nvidia.com/deploy/xid-errors" in meaning.fix and "dmesg" in meaning.fix


def test_records_keep_each_gpus_last_xid_when_and_how_many() -> None:
    records = record_xid({}, 1, 13, 100.0)
    records = record_xid(records, 0, 31, 110.0)
    records = record_xid(records, 1, 79, 120.0)
    assert records == {1: XidRecord(gpu=1, xid=79, at=120.0, count=2), 0: XidRecord(gpu=0, xid=31, at=110.0, count=1)}


def test_an_xid_is_a_finding_until_the_gpu_has_been_quiet_for_the_recent_window() -> None:
    records = [XidRecord(gpu=2, xid=79, at=100.0, count=3), XidRecord(gpu=0, xid=13, at=50.0)]
    (gpu0, gpu2) = xid_findings(records, now=100.0)
    assert (gpu0.gpu, gpu0.kind, gpu0.level) == (0, "xid", "warning")
    assert gpu2.text == (
        f"GPU 2 reported Xid 79, GPU has fallen off the bus (3 Xids since the monitor started): {explain(79).fix}"
    )
    assert [f.gpu for f in xid_findings(records, now=50.0 + XID_RECENT_S)] == [2]
    assert xid_findings(records, now=100.0 + XID_RECENT_S) == ()


def test_an_xid_alert_fires_per_gpu_and_xid_and_recovers_when_the_gpu_is_quiet() -> None:
    def check(book: Book, records: dict[int, XidRecord], now: float):
        gpus = GpusState(findings=xid_findings(records.values(), now), xids=tuple(records.values()))
        return evaluate(book, NodeStates(gpus=gpus), Limits(), now)

    records = record_xid({}, 0, 13, 100.0)
    book, notes = check(Book(), records, 100.0)
    assert [(n.kind, n.alert.key, n.alert.level) for n in notes] == [("firing", "gpu:gpu0 xid 13", "warning")]
    assert notes[0].alert.text.startswith("GPU 0: GPU 0 reported Xid 13, graphics engine exception")
    book, notes = check(book, records, 200.0)
    assert notes == (), "notified once"
    records = record_xid(records, 0, 79, 300.0)
    book, notes = check(book, records, 300.0)
    assert [(n.kind, n.alert.key) for n in notes] == [("resolved", "gpu:gpu0 xid 13"), ("firing", "gpu:gpu0 xid 79")]
    assert notes[1].alert.level == "error" and "2 Xids since the monitor started" in notes[1].alert.text
    book, notes = check(book, records, 300.0 + XID_RECENT_S)
    assert [(n.kind, n.alert.key) for n in notes] == [("resolved", "gpu:gpu0 xid 79")]
    assert book.firing == {}


# ---- NVML's event calls, through the fake NVML -------------------------------------------------


def started(fake: FakeNvml) -> FakeNvml:
    fake.init()
    return fake


def test_every_gpu_that_offers_xid_events_is_registered_and_the_others_are_named() -> None:
    api = started(
        FakeNvml([RTX4090, NO_EVENTS, dataclasses.replace(RTX4090, unsupported=frozenset({"register_events"}))])
    )
    watch = open_xid_events(api)
    assert (watch.gpus, watch.unwatched) == ((0,), ("GPU 1 (the driver offers no Xid events)", "GPU 2 (Not Supported)"))
    assert api.event_sets_freed == 0


@pytest.mark.parametrize(
    ("api", "why", "freed"),
    [
        (
            FakeNvml([NO_EVENTS, NO_EVENTS]),
            ("GPU 0 (the driver offers no Xid events)", "GPU 1 (the driver offers no Xid events)"),
            1,
        ),
        (
            FakeNvml([RTX4090], missing_functions=frozenset({"event_set_create"})),
            ("no event set (Function Not Found)",),
            0,
        ),
    ],
    ids=["no-gpu-offers-events", "old-driver"],
)
def test_with_nothing_to_watch_there_is_no_event_set_left_open(api: FakeNvml, why: tuple[str, ...], freed: int) -> None:
    assert open_xid_events(started(api)) == XidWatch(None, (), why)
    assert api.event_sets_freed == freed, "a set created is freed; none created, none freed"


def test_an_xid_comes_with_its_gpu_and_number_and_a_quiet_wait_is_none() -> None:
    api = started(FakeNvml([RTX4090, RTX4090]))
    watch = open_xid_events(api)
    assert next_xid(api, watch.event_set, 0) is None
    api.raise_xid(1, 79)
    assert next_xid(api, watch.event_set, 0) == XidEvent(gpu=1, xid=79)
    assert next_xid(api, watch.event_set, 0) is None


def test_registering_an_event_type_a_gpu_does_not_offer_is_not_supported() -> None:
    api = started(FakeNvml([NO_EVENTS]))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        api.register_events(api.handle(0), pynvml.nvmlEventTypeXidCriticalError, api.event_set_create())


def test_the_event_calls_have_the_same_signatures_on_the_fake_and_the_real_library() -> None:
    for name in ("device_index", "event_set_create", "supported_event_types", "register_events", "event_set_free"):
        assert inspect.signature(getattr(FakeNvml, name)).parameters.keys() == (
            inspect.signature(getattr(MonitorPynvml, name)).parameters.keys()
        ), name
    assert inspect.signature(FakeNvml.event_set_wait).parameters.keys() == (
        inspect.signature(MonitorPynvml.event_set_wait).parameters.keys()
    )


async def test_the_watcher_delivers_xids_logs_unwatched_gpus_once_and_frees_its_set() -> None:
    api = started(FakeNvml([RTX4090, NO_EVENTS]))
    seen: list[XidEvent] = []
    changes = Changes()

    def on_xid(event: XidEvent) -> None:
        seen.append(event)
        changes.notify()

    with logged("engy.gpus", "Xid errors not watched on GPU 1") as unwatched:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_xids, api, on_xid)
            # Said once the set is registered: an Xid raised before that is not the watcher's to see.
            await unwatched.wait(timeout_s=WAIT_S, what="the unwatched GPU named")
            api.raise_xid(0, 13)
            api.raise_xid(0, 43)
            await changes.wait_for(lambda: len(seen) == 2, timeout_s=WAIT_S, what="two Xids delivered")
            nursery.cancel_scope.cancel()
    assert seen == [XidEvent(0, 13), XidEvent(0, 43)]
    assert "the driver offers no Xid events" in (unwatched.message or "")
    assert api.event_sets_freed == 1


# ---- the monitor carries them into the hub -----------------------------------------------------


async def test_the_monitor_publishes_each_gpus_xids_and_their_finding_and_the_alert_fires(caplog) -> None:
    hub, api = Hub(), FakeNvml([NO_EVENTS, RTX4090])
    changes = Changes()
    set_state = hub.set_state

    def observed(component: str, **values: object) -> None:
        set_state(component, **values)
        changes.notify()

    hub.set_state = observed  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="engy.gpus"), logged("engy.gpus", "Xid errors not watched") as ready:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: run_gpu_monitor(hub, api=api, interval_s=0.01, task_status=task_status)
            )
            assert hub.states()["gpus"]["xids"] == []
            # Said once the watcher's set is registered: an Xid before that is not its to see.
            await ready.wait(timeout_s=WAIT_S, what="GPU 0 named as unwatched")
            api.raise_xid(1, 79)
            await changes.wait_for(
                lambda: any(f["kind"] == "xid" for f in hub.states()["gpus"]["findings"]),
                timeout_s=WAIT_S,
                what="the Xid's finding",
            )
            nursery.cancel_scope.cancel()
    states = decode_states(hub.states(), strict=True)
    assert states.gpus is not None
    ((record),) = states.gpus.xids
    assert (record.gpu, record.xid, record.count) == (1, 79, 1)
    assert [(f.gpu, f.kind, f.level) for f in states.gpus.findings] == [(1, "xid", "error")]
    _, notes = evaluate(Book(), states, Limits(), record.at)
    assert [n.alert.key for n in notes] == ["gpu:gpu1 xid 79"]
    xid_lines = [r for r in caplog.records if r.getMessage().startswith("GPU 1 reported Xid 79")]
    assert [r.levelname for r in xid_lines] == ["ERROR"], "logged once, as it came, not again as a finding"
    assert (api.shutdown_calls, api.event_sets_freed) == (2, 1)
