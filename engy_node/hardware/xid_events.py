"""Receiving NVIDIA Xid errors as they happen: NVML's event API, in a worker thread.

Throttling, temperatures and links are readings the monitor samples every second; an Xid is an
event the driver raises once, so sampling would miss it. NVML delivers it through an event set:
`nvmlEventSetCreate`, `nvmlDeviceRegisterEvents(handle, nvmlEventTypeXidCriticalError, set)` per
GPU, then `nvmlEventSetWait_v2(set, timeout_ms)`, which blocks until an event comes (its
`eventData` is the Xid number) or raises `NVMLError_Timeout`. `watch_xids` runs each wait in a
worker thread with a short timeout (`XID_WAIT_MS`), so cancelling the watcher takes at most that
long, and the set is freed before NVML is shut down (`nvmlEventSetFree`).

Not every driver offers the events (Windows and WSL do not; NVML then answers
`NVMLError_NotSupported`, or an empty mask from `nvmlDeviceGetSupportedEventTypes`). That is
said once in the log, per GPU, and the node runs on: an Xid there is seen only through what it
causes (a lost GPU, a model server that dies).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import pynvml
import trio

__all__ = [
    "XID_EVENT",
    "XID_WAIT_MS",
    "EventApi",
    "NvmlEventData",
    "PynvmlEvents",
    "XidEvent",
    "XidWatch",
    "next_xid",
    "open_xid_events",
    "watch_xids",
]

log = logging.getLogger("engy.gpus")

XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
XID_WAIT_MS = 500
"""One wait's NVML timeout: how long cancelling the watcher can take. A wait that times out costs
one wake-up of an idle thread."""
RETRY_S = 5.0
"""After a wait failed for a reason other than its timeout (a GPU lost from the bus fails every
wait at once), the watcher waits this long before the next."""


class NvmlEventData(Protocol):
    """What `nvmlEventSetWait_v2` returns (`pynvml.c_nvmlEventData_t`)."""

    @property
    def device(self) -> object: ...
    @property
    def eventType(self) -> int: ...  # noqa: N802 - NVML's field name
    @property
    def eventData(self) -> int: ...  # noqa: N802 - NVML's field name


class EventApi(Protocol):
    """NVML's event calls, on the same handles as `gpu.NvmlApi`. Every call may raise
    `pynvml.NVMLError`; `event_set_wait` raises `NVMLError_Timeout` when nothing came."""

    def device_count(self) -> int: ...
    def handle(self, index: int) -> object: ...
    def device_index(self, handle: object) -> int:
        """`nvmlDeviceGetIndex`: the NVML index of an event's `device`."""
        ...

    def event_set_create(self) -> object: ...
    def supported_event_types(self, handle: object) -> int: ...
    def register_events(self, handle: object, event_types: int, event_set: object) -> None: ...
    def event_set_wait(self, event_set: object, timeout_ms: int) -> NvmlEventData: ...
    def event_set_free(self, event_set: object) -> None: ...


class PynvmlEvents:
    """`EventApi`'s own calls on the real library."""

    def device_index(self, handle: object) -> int:
        return pynvml.nvmlDeviceGetIndex(handle)

    def event_set_create(self) -> object:
        return pynvml.nvmlEventSetCreate()

    def supported_event_types(self, handle: object) -> int:
        return pynvml.nvmlDeviceGetSupportedEventTypes(handle)

    def register_events(self, handle: object, event_types: int, event_set: object) -> None:
        pynvml.nvmlDeviceRegisterEvents(handle, event_types, event_set)

    def event_set_wait(self, event_set: object, timeout_ms: int) -> NvmlEventData:
        return pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)

    def event_set_free(self, event_set: object) -> None:
        pynvml.nvmlEventSetFree(event_set)


@dataclasses.dataclass(frozen=True, slots=True)
class XidEvent:
    gpu: int
    xid: int


@dataclasses.dataclass(frozen=True, slots=True)
class XidWatch:
    """What `open_xid_events` set up."""

    event_set: object | None
    """None: no GPU's Xids can be watched (the set is already freed)."""
    gpus: tuple[int, ...]
    """The GPUs registered for Xid events."""
    unwatched: tuple[str, ...]
    """Why each other GPU (or all of them) is not, e.g. `"GPU 1 (Not Supported)"`."""


def open_xid_events(api: EventApi) -> XidWatch:
    """Create an event set and register every GPU that offers Xid events. Errors: none; what
    NVML refuses is in `unwatched`. Blocking: a few ms; call it from a worker thread."""
    try:
        event_set = api.event_set_create()
    except pynvml.NVMLError as err:
        return XidWatch(None, (), (f"no event set ({err})",))
    gpus: list[int] = []
    unwatched: list[str] = []
    try:
        count = api.device_count()
    except pynvml.NVMLError as err:
        count, unwatched = 0, [f"no GPU count ({err})"]
    for index in range(count):
        try:
            handle = api.handle(index)
            if not api.supported_event_types(handle) & XID_EVENT:
                unwatched.append(f"GPU {index} (the driver offers no Xid events)")
                continue
            api.register_events(handle, XID_EVENT, event_set)
        except pynvml.NVMLError as err:
            unwatched.append(f"GPU {index} ({err})")
            continue
        gpus.append(index)
    if not gpus:
        free_event_set(api, event_set)
        return XidWatch(None, (), tuple(unwatched))
    return XidWatch(event_set, tuple(gpus), tuple(unwatched))


def next_xid(api: EventApi, event_set: object, timeout_ms: int) -> XidEvent | None:
    """The next Xid within `timeout_ms`, else None (also for a non-Xid event). Errors: the
    `pynvml.NVMLError` of a wait that failed other than by timing out. Blocking."""
    try:
        event = api.event_set_wait(event_set, timeout_ms)
    except pynvml.NVMLError_Timeout:
        return None
    if not event.eventType & XID_EVENT:
        return None
    return XidEvent(gpu=api.device_index(event.device), xid=int(event.eventData))


def free_event_set(api: EventApi, event_set: object) -> None:
    try:
        api.event_set_free(event_set)
    except pynvml.NVMLError as err:
        log.debug("nvmlEventSetFree failed (%s)", err)


async def watch_xids(api: EventApi, on_xid: Callable[[XidEvent], None], *, wait_ms: int = XID_WAIT_MS) -> None:
    """Call `on_xid` for each Xid any GPU reports, until cancelled. `api` must be initialised
    and stay so until this returns; the event set is freed on the way out.

    Errors: none escape but cancellation. GPUs without Xid events are logged once; a wait that
    fails is logged once per distinct error and retried after `RETRY_S`."""
    watch = await trio.to_thread.run_sync(open_xid_events, api)
    if watch.unwatched:
        log.info(
            "Xid errors not watched on %s: an Xid there shows only through what it causes (a lost GPU, a model "
            "server that dies); `sudo dmesg | grep -i xid` lists them",
            ", ".join(watch.unwatched),
        )
    event_set = watch.event_set
    if event_set is None:
        await trio.sleep_forever()
    try:
        last_error: str | None = None
        while True:
            try:
                # Not abandoned on cancellation: the set must not be freed while a wait is in it.
                event = await trio.to_thread.run_sync(next_xid, api, event_set, wait_ms)
            except pynvml.NVMLError as err:
                error = f"{type(err).__name__}: {err}"
                if error != last_error:
                    log.warning("waiting for Xid events failed (%s); retrying every %g s", error, RETRY_S)
                last_error = error
                await trio.sleep(RETRY_S)
                continue
            if last_error is not None:
                log.info("Xid events are back")
                last_error = None
            if event is not None:
                on_xid(event)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(free_event_set, api, event_set)
