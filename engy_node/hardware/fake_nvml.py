"""Fake NVML: `NvmlApi` on made-up GPUs, for tests and for previewing plans without a GPU.

`engy-node --fake-gpus 4xRTX4090` plans for GPUs this machine does not have, and the miner's
tests cover every shape of machine (GeForce cards without P2P, a GPU that cannot be opened, an
old driver without the v2 memory call) without one. Both go through `gpu.detect(nvml=...)`, so
the fake must behave like the real library at the interface: it answers every `NvmlApi` call,
refuses calls before `init()`, and fails with the same `pynvml` error classes NVML raises
(`NVMLError_NotSupported`, `NVMLError_GpuIsLost`, `NVMLError_FunctionNotFound`, ...). Then
`detect()` runs the same code on fakes as on real devices, and what it tolerates in tests it
tolerates on a real driver.

The devices in `FAKE_GPU_MODELS` are stock cards as NVML reports them at idle, except the PCIe
link, which they report as it runs under load (see `FakeGpu.pcie_gen`), so plans previewed on
fakes are the plans the same machine would get.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import uuid
from collections.abc import Sequence

import pynvml

from engy_node.errors import ConfigError
from engy_node.hardware.gpu import MIB, ClockKind, LinkEnd, MemoryReading, ThresholdKind

__all__ = [
    "FAKE_GPU_MODELS",
    "FakeEventData",
    "FakeGpu",
    "FakeNvml",
    "parse_fake_gpu_spec",
]


@dataclasses.dataclass(frozen=True, slots=True)
class FakeGpu:
    """One made-up GPU. Defaults in `FAKE_GPU_MODELS` are an idle card as NVML reports it."""

    model: str
    """Short model key, as in a fake spec string (`RTX4090`)."""
    name: str
    memory_total_mib: int
    compute_capability: tuple[int, int]
    power_limit_w: int
    power_draw_w: int = 25
    temperature_c: int = 41
    temperature_slowdown_c: int = 87
    """Values `nvidia-smi -q` commonly shows (slowdown 87-89 °C, shutdown 90-92 °C); each
    board's firmware sets its own."""
    temperature_shutdown_c: int = 90
    fan_percent: int = 30
    memory_used_mib: int = 1
    memory_reserved_mib: int = 330
    gpu_util_percent: int = 0
    memory_util_percent: int = 0
    sm_clock_mhz: int = 210
    sm_clock_max_mhz: int = 3120
    mem_clock_mhz: int = 405
    mem_clock_max_mhz: int = 10501
    clock_event_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    pcie_gen: int = 4
    """A real idle card reports gen 1 here; the fake reports the link as it runs under load,
    so plans previewed on fakes show no spurious downgrade."""
    pcie_width: int = 16
    pcie_gen_max: int = 4
    pcie_width_max: int = 16
    event_types: int = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypePState | pynvml.nvmlEventTypeClock
    """What `nvmlDeviceGetSupportedEventTypes` answers: Xid, P-state and clock events (the ECC
    events need ECC on); 0 as on Windows, where NVML offers no events."""
    unsupported: frozenset[str] = frozenset()
    """`NvmlApi` method names this GPU answers with `NVMLError_NotSupported`."""
    broken: frozenset[str] = frozenset()
    """`NvmlApi` method names this GPU answers with `NVMLError_GpuIsLost` (`handle` included:
    the GPU cannot even be opened)."""
    forbidden: frozenset[str] = frozenset()
    """`NvmlApi` method names this GPU answers with `NVMLError_NoPermission`, as NVML does for
    some readings to a user without the rights to them."""


FAKE_GPU_MODELS: dict[str, FakeGpu] = {
    # A stock RTX 4090 as NVML reports it: 24564 MiB, 450 W default limit, compute capability
    # 8.9, PCIe 4.0 x16; clocks are typical, not any one board's.
    "RTX4090": FakeGpu(
        model="RTX4090",
        name="NVIDIA GeForce RTX 4090",
        memory_total_mib=24564,
        compute_capability=(8, 9),
        power_limit_w=450,
        power_draw_w=21,
        temperature_c=41,
    ),
    # A stock RTX 5090: 32607 MiB, 575 W, compute capability 12.0, PCIe 5.0 x16; typical clocks.
    "RTX5090": FakeGpu(
        model="RTX5090",
        name="NVIDIA GeForce RTX 5090",
        memory_total_mib=32607,
        compute_capability=(12, 0),
        power_limit_w=575,
        power_draw_w=30,
        temperature_c=38,
        sm_clock_max_mhz=3090,
        mem_clock_max_mhz=14001,
        pcie_gen=5,
        pcie_gen_max=5,
    ),
}

FAKE_SPEC_FORMS = "'4xRTX4090', '2xRTX5090', 'RTX4090,RTX5090' (models: " + ", ".join(FAKE_GPU_MODELS) + ")"
_FAKE_ITEM = re.compile(r"^(?:(\d+)\s*[x×]\s*)?([a-z0-9]+)$", re.IGNORECASE)
MAX_FAKE_GPUS = 64


def parse_fake_gpu_spec(spec: str) -> tuple[FakeGpu, ...]:
    """`"4xRTX4090"`, `"2xRTX5090"`, `"RTX4090,RTX5090"` (mixed, in that order) -> fake GPUs.

    Errors: `ConfigError` naming the bad part and the accepted forms.
    """
    gpus: list[FakeGpu] = []
    for item in spec.split(","):
        match = _FAKE_ITEM.match(item.strip())
        if not match:
            raise ConfigError(
                f"cannot read fake GPU spec {spec!r} at {item.strip()!r}; accepted forms: {FAKE_SPEC_FORMS}"
            )
        count_text, model_text = match.groups()
        model = FAKE_GPU_MODELS.get(model_text.upper())
        if model is None:
            raise ConfigError(
                f"unknown GPU model {model_text!r} in fake GPU spec {spec!r}; accepted forms: {FAKE_SPEC_FORMS}"
            )
        count = 1 if count_text is None else int(count_text)
        if count < 1:
            raise ConfigError(f"fake GPU spec {spec!r} asks for {count} GPUs; accepted forms: {FAKE_SPEC_FORMS}")
        gpus.extend([model] * count)
    if len(gpus) > MAX_FAKE_GPUS:
        raise ConfigError(f"fake GPU spec {spec!r} asks for {len(gpus)} GPUs; at most {MAX_FAKE_GPUS}")
    return tuple(gpus)


@dataclasses.dataclass(frozen=True, slots=True)
class _FakeHandle:
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class FakeEventData:
    """`pynvml.c_nvmlEventData_t`'s fields."""

    device: object
    eventType: int  # noqa: N815 - NVML's field name
    eventData: int  # noqa: N815 - NVML's field name
    gpuInstanceId: int = 0  # noqa: N815 - NVML's field name
    computeInstanceId: int = 0  # noqa: N815 - NVML's field name


@dataclasses.dataclass(eq=False)
class _FakeEventSet:
    registered: dict[int, int] = dataclasses.field(default_factory=dict)
    """GPU index -> the event types registered for it."""
    pending: collections.deque[FakeEventData] = dataclasses.field(default_factory=collections.deque)
    freed: bool = False


class FakeNvml:
    """`NvmlApi` (and `gpu_monitor.MonitorApi`) on made-up GPUs, raising the same `pynvml`
    errors the real library raises.

    Calls before `init()` raise `NVMLError_Uninitialized`; a method named in a GPU's
    `unsupported` raises `NVMLError_NotSupported`, one in its `broken` raises
    `NVMLError_GpuIsLost`, one in its `forbidden` raises `NVMLError_NoPermission`; one named
    in `missing_functions` raises `NVMLError_FunctionNotFound` on every GPU (an old driver).
    `init_error` makes `init()` fail. GeForce cards report P2P `not_supported` between each
    other; `p2p_ok=True` makes every pair `ok`. `init_calls`/`shutdown_calls` count what
    reached the "driver".

    Events as NVML delivers them: `raise_xid(index, xid)` is the driver reporting an Xid on a
    GPU; each event set that GPU is registered in for Xid events gets it, and a thread blocked in
    `event_set_wait` on that set wakes with it; a wait with nothing pending blocks for its timeout
    and raises `NVMLError_Timeout`. Registering event types a GPU does not offer (its
    `event_types`) raises `NVMLError_NotSupported`; `event_sets_freed` counts `event_set_free`.
    """

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        p2p_ok: bool = False,
        init_error: type[pynvml.NVMLError] | None = None,
        missing_functions: frozenset[str] = frozenset(),
        driver_version: str = "570.133.07",
        cuda_driver_version: int = 12080,
    ) -> None:
        self.gpus = tuple(gpus)
        self.p2p_ok = p2p_ok
        self.init_error = init_error
        self.missing_functions = missing_functions
        self._driver_version = driver_version
        self._cuda_driver_version = cuda_driver_version
        self.init_calls = 0
        self.shutdown_calls = 0
        self.event_sets_freed = 0
        self._initialized = False
        self._event_sets: list[_FakeEventSet] = []
        self._events = threading.Condition()

    @classmethod
    def from_spec(cls, spec: str, *, p2p_ok: bool = False) -> FakeNvml:
        """Fake GPUs from a spec string (see `parse_fake_gpu_spec`)."""
        return cls(parse_fake_gpu_spec(spec), p2p_ok=p2p_ok)

    def _ready(self, function: str) -> None:
        if not self._initialized:
            raise pynvml.NVMLError_Uninitialized()
        if function in self.missing_functions:
            raise pynvml.NVMLError_FunctionNotFound()

    def _gpu(self, handle: object, function: str) -> tuple[int, FakeGpu]:
        self._ready(function)
        if not isinstance(handle, _FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        gpu = self.gpus[handle.index]
        if function in gpu.broken:
            raise pynvml.NVMLError_GpuIsLost()
        if function in gpu.unsupported:
            raise pynvml.NVMLError_NotSupported()
        if function in gpu.forbidden:
            raise pynvml.NVMLError_NoPermission()
        return handle.index, gpu

    def init(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error()
        self._initialized = True

    def shutdown(self) -> None:
        self._ready("shutdown")
        self.shutdown_calls += 1
        self._initialized = False

    def driver_version(self) -> str:
        self._ready("driver_version")
        return self._driver_version

    def cuda_driver_version(self) -> int:
        self._ready("cuda_driver_version")
        return self._cuda_driver_version

    def device_count(self) -> int:
        self._ready("device_count")
        return len(self.gpus)

    def handle(self, index: int) -> object:
        self._ready("handle")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        if "handle" in self.gpus[index].broken:
            raise pynvml.NVMLError_GpuIsLost()
        return _FakeHandle(index)

    def name(self, handle: object) -> str:
        return self._gpu(handle, "name")[1].name

    def uuid(self, handle: object) -> str:
        index, gpu = self._gpu(handle, "uuid")
        return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'engy-fake-gpu/{gpu.model}/{index}')}"

    def pci_bus_id(self, handle: object) -> str:
        index, _ = self._gpu(handle, "pci_bus_id")
        return f"00000000:{index + 1:02X}:00.0"

    def compute_capability(self, handle: object) -> tuple[int, int]:
        return self._gpu(handle, "compute_capability")[1].compute_capability

    def memory_info_v2(self, handle: object) -> MemoryReading:
        _, gpu = self._gpu(handle, "memory_info_v2")
        total, used, reserved = gpu.memory_total_mib * MIB, gpu.memory_used_mib * MIB, gpu.memory_reserved_mib * MIB
        return MemoryReading(total=total, used=used, free=total - used - reserved, reserved=reserved)

    def memory_info_v1(self, handle: object) -> MemoryReading:
        _, gpu = self._gpu(handle, "memory_info_v1")
        # v1 counts the driver's reservation as used, as real drivers >= 510 do.
        total, used = gpu.memory_total_mib * MIB, (gpu.memory_used_mib + gpu.memory_reserved_mib) * MIB
        return MemoryReading(total=total, used=used, free=total - used)

    def utilization(self, handle: object) -> tuple[int, int]:
        gpu = self._gpu(handle, "utilization")[1]
        return gpu.gpu_util_percent, gpu.memory_util_percent

    def temperature(self, handle: object) -> int:
        return self._gpu(handle, "temperature")[1].temperature_c

    def temperature_threshold(self, handle: object, kind: ThresholdKind) -> int:
        gpu = self._gpu(handle, "temperature_threshold")[1]
        return gpu.temperature_slowdown_c if kind == "slowdown" else gpu.temperature_shutdown_c

    def power_usage_mw(self, handle: object) -> int:
        return self._gpu(handle, "power_usage_mw")[1].power_draw_w * 1000

    def power_limit_mw(self, handle: object) -> int:
        return self._gpu(handle, "power_limit_mw")[1].power_limit_w * 1000

    def fan_speed(self, handle: object) -> int:
        return self._gpu(handle, "fan_speed")[1].fan_percent

    def clock_mhz(self, handle: object, kind: ClockKind) -> int:
        gpu = self._gpu(handle, "clock_mhz")[1]
        return gpu.sm_clock_mhz if kind == "sm" else gpu.mem_clock_mhz

    def max_clock_mhz(self, handle: object, kind: ClockKind) -> int:
        gpu = self._gpu(handle, "max_clock_mhz")[1]
        return gpu.sm_clock_max_mhz if kind == "sm" else gpu.mem_clock_max_mhz

    def clock_event_reasons(self, handle: object) -> int:
        return self._gpu(handle, "clock_event_reasons")[1].clock_event_reasons

    def pcie_link_gen(self, handle: object, end: LinkEnd) -> int:
        gpu = self._gpu(handle, "pcie_link_gen")[1]
        return gpu.pcie_gen if end == "current" else gpu.pcie_gen_max

    def pcie_link_width(self, handle: object, end: LinkEnd) -> int:
        gpu = self._gpu(handle, "pcie_link_width")[1]
        return gpu.pcie_width if end == "current" else gpu.pcie_width_max

    def p2p_read_status(self, handle_a: object, handle_b: object) -> int:
        self._gpu(handle_a, "p2p_read_status")
        self._gpu(handle_b, "p2p_read_status")
        return pynvml.NVML_P2P_STATUS_OK if self.p2p_ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def device_index(self, handle: object) -> int:
        return self._gpu(handle, "device_index")[0]

    def event_set_create(self) -> object:
        self._ready("event_set_create")
        event_set = _FakeEventSet()
        with self._events:
            self._event_sets.append(event_set)
        return event_set

    def _live_set(self, event_set: object) -> _FakeEventSet:
        if not isinstance(event_set, _FakeEventSet) or event_set.freed:
            raise pynvml.NVMLError_InvalidArgument()
        return event_set

    def supported_event_types(self, handle: object) -> int:
        return self._gpu(handle, "supported_event_types")[1].event_types

    def register_events(self, handle: object, event_types: int, event_set: object) -> None:
        index, gpu = self._gpu(handle, "register_events")
        live = self._live_set(event_set)
        if event_types & ~gpu.event_types:
            raise pynvml.NVMLError_NotSupported()
        with self._events:
            live.registered[index] = live.registered.get(index, 0) | event_types

    def event_set_wait(self, event_set: object, timeout_ms: int) -> FakeEventData:
        self._ready("event_set_wait")
        live = self._live_set(event_set)
        with self._events:
            if not self._events.wait_for(lambda: live.pending, timeout=timeout_ms / 1000):
                raise pynvml.NVMLError_Timeout()
            return live.pending.popleft()

    def event_set_free(self, event_set: object) -> None:
        self._ready("event_set_free")
        live = self._live_set(event_set)
        with self._events:
            live.freed = True
            self._event_sets.remove(live)
            self.event_sets_freed += 1

    def raise_xid(self, index: int, xid: int) -> None:
        """The driver reports Xid `xid` on GPU `index` (callable from any thread)."""
        event = FakeEventData(_FakeHandle(index), pynvml.nvmlEventTypeXidCriticalError, xid)
        with self._events:
            for event_set in self._event_sets:
                if event_set.registered.get(index, 0) & pynvml.nvmlEventTypeXidCriticalError:
                    event_set.pending.append(event)
            self._events.notify_all()
