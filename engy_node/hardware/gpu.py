"""What GPUs this machine has, read through NVML: one frozen `GpuInventory` per `detect()` call.

The inventory holds everything the miner shows and the planner decides with: per GPU the name,
UUID, PCI bus id, compute capability, VRAM, utilisation, temperature, power, fan, clocks, decoded
clock-event (throttle) reasons and PCIe link (current vs max); across GPUs the P2P read status;
for the system the driver and CUDA driver versions.

Trust and failure posture:

* NVML is the only source. It reads the driver's view without creating a CUDA context (nothing
  here imports torch or touches `torch.cuda`), so detection costs no VRAM and cannot disturb a
  model server already running on the GPUs.
* No NVML is a normal state, not an error: no driver, no `libnvidia-ml.so`, no GPU, or an
  `nvmlInit` that fails all give `available=False` with a plain `reason` that ends in "running
  in CPU mode". `detect()` never raises: a miner without a GPU still runs the reference server.
* Every per-GPU read is optional. Consumer cards answer `NVMLError_NotSupported` for some calls
  (fan speed on some boards, clocks under some drivers); such a field stays None and the rest of
  the GPU is kept. NotSupported is silent because it is normal; any other NVML error on a field
  (GPU lost, unknown error) is also tolerated but named in `warnings`, so a GPU that reports
  less than it should says why. A GPU whose handle cannot be opened is left out and named there.
* Memory comes from the v2 call when the driver has it: v1's "used" includes memory the driver
  reserves (drivers >= 510), which would make an idle card look partly full.
* The current PCIe generation drops at idle to save power (a 4090 idles at gen 1), so a link
  below its max is only a problem when it stays there under load; the width does not drop.

All NVML access goes through `NvmlApi`, a small interface with the calls used here; `Pynvml`
implements it on `nvidia-ml-py`. `engy_node.hardware.fake_nvml.FakeNvml` implements it on made-up
devices for tests and for previewing plans without a GPU (`engy-node --fake-gpus 4xRTX4090`),
raising the same `pynvml` error classes the real library does, so both paths run the same code
here.

Blocking: NVML calls block (a few ms each, longer on a busy driver). Call `detect()` from trio as
`await trio.to_thread.run_sync(detect)`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Literal, NamedTuple, Protocol, TypedDict, TypeVar

import pynvml

__all__ = [
    "GpuInfo",
    "GpuInventory",
    "MemoryReading",
    "NvmlApi",
    "Pynvml",
    "cuda_version_text",
    "decode_clock_event_reasons",
    "detect",
]

log = logging.getLogger("engy.miner.gpu")

MIB = 1024 * 1024
GIB = 1024 * MIB

# pynvml declares `NVML_P2P_CAPS_INDEX_READ = 0,` (a stray trailing comma makes it the tuple
# `(0,)`), which ctypes refuses as an argument; the C enum value is 0.
P2P_CAPS_INDEX_READ = 0

P2P_STATUS_NAMES = {
    pynvml.NVML_P2P_STATUS_OK: "ok",
    pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: "chipset_not_supported",
    pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED: "gpu_not_supported",
    pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: "topology_not_supported",
    pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY: "disabled_by_regkey",
    pynvml.NVML_P2P_STATUS_NOT_SUPPORTED: "not_supported",
    pynvml.NVML_P2P_STATUS_UNKNOWN: "unknown",
}

# Bit -> short name, in bit order. NVML renamed "ClocksThrottleReason" to "ClocksEventReason";
# the bits are the same. Board limit and reliability exist only under the old name.
CLOCK_EVENT_REASON_NAMES = (
    (pynvml.nvmlClocksEventReasonGpuIdle, "gpu_idle"),
    (pynvml.nvmlClocksEventReasonApplicationsClocksSetting, "applications_clocks"),
    (pynvml.nvmlClocksEventReasonSwPowerCap, "sw_power_cap"),
    (pynvml.nvmlClocksEventReasonHwSlowdown, "hw_slowdown"),
    (pynvml.nvmlClocksEventReasonSyncBoost, "sync_boost"),
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, "sw_thermal"),
    (pynvml.nvmlClocksEventReasonHwThermalSlowdown, "hw_thermal"),
    (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, "hw_power_brake"),
    (pynvml.nvmlClocksEventReasonDisplayClockSetting, "display_clock"),
    (pynvml.nvmlClocksThrottleReasonBoardLimit, "board_limit"),
    (pynvml.nvmlClocksThrottleReasonReliability, "reliability"),
)

_KNOWN_REASON_BITS = sum(bit for bit, _ in CLOCK_EVENT_REASON_NAMES)

CPU_MODE = "running in CPU mode"

ClockKind = Literal["sm", "mem"]
LinkEnd = Literal["current", "max"]
ThresholdKind = Literal["slowdown", "shutdown"]


class MemoryReading(NamedTuple):
    """Bytes, as NVML reports them; `reserved` only from the v2 call."""

    total: int
    used: int
    free: int
    reserved: int | None = None


class NvmlApi(Protocol):
    """The NVML calls this module makes, with plain Python results.

    Handles are opaque. Every call may raise `pynvml.NVMLError` (a subclass per error code:
    `NVMLError_NotSupported`, `NVMLError_FunctionNotFound` on an old driver, ...).
    """

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int:
        """As NVML encodes it: 12080 means CUDA 12.8."""
        ...

    def device_count(self) -> int: ...
    def handle(self, index: int) -> object: ...
    def name(self, handle: object) -> str: ...
    def uuid(self, handle: object) -> str: ...
    def pci_bus_id(self, handle: object) -> str: ...
    def compute_capability(self, handle: object) -> tuple[int, int]: ...
    def memory_info_v2(self, handle: object) -> MemoryReading: ...
    def memory_info_v1(self, handle: object) -> MemoryReading: ...
    def utilization(self, handle: object) -> tuple[int, int]:
        """(GPU %, memory-controller %) over the driver's last sample window."""
        ...

    def temperature(self, handle: object) -> int: ...
    def power_usage_mw(self, handle: object) -> int: ...
    def power_limit_mw(self, handle: object) -> int:
        """The enforced limit (what the card actually holds to), in milliwatts."""
        ...

    def fan_speed(self, handle: object) -> int: ...
    def clock_mhz(self, handle: object, kind: ClockKind) -> int: ...
    def max_clock_mhz(self, handle: object, kind: ClockKind) -> int: ...
    def clock_event_reasons(self, handle: object) -> int: ...
    def pcie_link_gen(self, handle: object, end: LinkEnd) -> int: ...
    def pcie_link_width(self, handle: object, end: LinkEnd) -> int: ...
    def p2p_read_status(self, handle_a: object, handle_b: object) -> int: ...


class Pynvml:
    """`NvmlApi` on the real library (`nvidia-ml-py`, imported as `pynvml`)."""

    _CLOCKS = {"sm": pynvml.NVML_CLOCK_SM, "mem": pynvml.NVML_CLOCK_MEM}

    def init(self) -> None:
        pynvml.nvmlInit()

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def driver_version(self) -> str:
        return pynvml.nvmlSystemGetDriverVersion()

    def cuda_driver_version(self) -> int:
        return pynvml.nvmlSystemGetCudaDriverVersion()

    def device_count(self) -> int:
        return pynvml.nvmlDeviceGetCount()

    def handle(self, index: int) -> object:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def name(self, handle: object) -> str:
        return pynvml.nvmlDeviceGetName(handle)

    def uuid(self, handle: object) -> str:
        return pynvml.nvmlDeviceGetUUID(handle)

    def pci_bus_id(self, handle: object) -> str:
        bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
        return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

    def compute_capability(self, handle: object) -> tuple[int, int]:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)

    def memory_info_v2(self, handle: object) -> MemoryReading:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return MemoryReading(total=info.total, used=info.used, free=info.free, reserved=info.reserved)

    def memory_info_v1(self, handle: object) -> MemoryReading:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return MemoryReading(total=info.total, used=info.used, free=info.free)

    def utilization(self, handle: object) -> tuple[int, int]:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return rates.gpu, rates.memory

    def temperature(self, handle: object) -> int:
        return pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)

    def power_usage_mw(self, handle: object) -> int:
        return pynvml.nvmlDeviceGetPowerUsage(handle)

    def power_limit_mw(self, handle: object) -> int:
        return pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)

    def fan_speed(self, handle: object) -> int:
        return pynvml.nvmlDeviceGetFanSpeed(handle)

    def clock_mhz(self, handle: object, kind: ClockKind) -> int:
        return pynvml.nvmlDeviceGetClockInfo(handle, self._CLOCKS[kind])

    def max_clock_mhz(self, handle: object, kind: ClockKind) -> int:
        return pynvml.nvmlDeviceGetMaxClockInfo(handle, self._CLOCKS[kind])

    def clock_event_reasons(self, handle: object) -> int:
        try:
            return pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        except pynvml.NVMLError_FunctionNotFound:
            # Drivers before the rename only export the "throttle" name of the same call.
            return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    def pcie_link_gen(self, handle: object, end: LinkEnd) -> int:
        if end == "current":
            return pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        return pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)

    def pcie_link_width(self, handle: object, end: LinkEnd) -> int:
        if end == "current":
            return pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
        return pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)

    def p2p_read_status(self, handle_a: object, handle_b: object) -> int:
        return pynvml.nvmlDeviceGetP2PStatus(handle_a, handle_b, P2P_CAPS_INDEX_READ)


@dataclasses.dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML saw it at detection time. Any field but `index` may be None (not
    reported by this GPU or driver)."""

    index: int
    """NVML index, which is PCI bus order. CUDA numbers GPUs fastest-first unless
    `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so whoever launches CUDA processes sets that."""
    name: str | None = None
    uuid: str | None = None
    """Stable across reboots and slot changes, unlike the index."""
    pci_bus_id: str | None = None
    compute_capability: tuple[int, int] | None = None
    """(8, 9) on an RTX 4090 (Ada), (12, 0) on an RTX 5090 (consumer Blackwell, sm_120)."""
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    """Held by the driver; only the v2 memory call reports it (else None)."""
    gpu_util_percent: int | None = None
    memory_util_percent: int | None = None
    temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    fan_percent: int | None = None
    """The requested fan speed, not a measurement: a blocked fan still reads its target."""
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    clock_event_reasons: tuple[str, ...] | None = None
    """Why clocks are below max right now, decoded (`gpu_idle`, `sw_power_cap`, `hw_thermal`...)."""
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None

    @property
    def pcie_downgraded(self) -> bool | None:
        """True when the link runs below what this GPU and slot allow (None: not reported).
        The generation also drops at idle, so judge this under load."""
        pairs = ((self.pcie_gen, self.pcie_gen_max), (self.pcie_width, self.pcie_width_max))
        known = [(now, most) for now, most in pairs if now is not None and most is not None]
        if not known:
            return None
        return any(now < most for now, most in known)

    def describe(self) -> str:
        """One line for logs, e.g. `GPU0 NVIDIA GeForce RTX 4090 24.0 GiB cc 8.9 PCIe 4.0 x16
        (max 4.0 x16) 41 °C`; unreported values show as `?`."""
        parts = [f"GPU{self.index}", self.name or "unknown GPU"]
        parts.append(f"{self.memory_total_bytes / GIB:.1f} GiB" if self.memory_total_bytes is not None else "? GiB")
        parts.append(
            "cc " + (f"{self.compute_capability[0]}.{self.compute_capability[1]}" if self.compute_capability else "?")
        )
        if any(v is not None for v in (self.pcie_gen, self.pcie_width, self.pcie_gen_max, self.pcie_width_max)):
            parts.append(
                f"PCIe {_link(self.pcie_gen, self.pcie_width)} (max {_link(self.pcie_gen_max, self.pcie_width_max)})"
            )
        if self.temperature_c is not None:
            parts.append(f"{self.temperature_c} °C")
        throttling = [r for r in self.clock_event_reasons or () if r != "gpu_idle"]
        if throttling:
            parts.append("clocks held by " + ",".join(throttling))
        return " ".join(parts)


def _link(gen: int | None, width: int | None) -> str:
    return f"{'?' if gen is None else f'{gen}.0'} x{'?' if width is None else width}"


@dataclasses.dataclass(frozen=True, slots=True)
class GpuInventory:
    """The result of one `detect()`: the GPUs, their P2P matrix and the system facts."""

    available: bool
    """NVML answered and found at least one usable GPU."""
    reason: str
    """One plain sentence: what was found, or why this is CPU mode."""
    gpus: tuple[GpuInfo, ...] = ()
    p2p_status: tuple[tuple[str | None, ...], ...] = ()
    """[a][b]: NVML's P2P read status from GPU a to GPU b (`ok`, `not_supported`,
    `chipset_not_supported`, ...); None on the diagonal and where NVML could not say."""
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    """The newest CUDA the driver supports, as text ("12.8")."""
    warnings: tuple[str, ...] = ()
    """NVML errors that cost a field or a GPU (NotSupported excluded: it is normal)."""

    @property
    def cpu_mode(self) -> bool:
        return not self.available

    def p2p_ok(self, a: int, b: int) -> bool | None:
        """Whether GPU a can read GPU b's memory directly (None: unknown). Positions are
        positions in `gpus`, not NVML indices."""
        if a == b:
            return True
        status = self.p2p_status[a][b]
        return None if status is None else status == "ok"

    @property
    def p2p_ok_matrix(self) -> tuple[tuple[bool | None, ...], ...]:
        """`p2p_ok` for every pair, the shape the planner takes."""
        count = len(self.gpus)
        return tuple(tuple(self.p2p_ok(a, b) for b in range(count)) for a in range(count))

    def summary(self) -> str:
        """One line for logs and the diagnostics bundle."""
        if not self.available:
            return self.reason
        versions = ", ".join(
            text
            for text in (
                f"driver {self.driver_version}" if self.driver_version else "",
                f"CUDA {self.cuda_driver_version}" if self.cuda_driver_version else "",
            )
            if text
        )
        return f"{self.reason}; {versions}" if versions else self.reason


def cuda_version_text(encoded: int) -> str:
    """NVML's CUDA version integer as text: 12080 -> "12.8", 13000 -> "13.0"."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Short names for the set bits; an unknown bit shows as its hex value rather than vanish."""
    names = [name for bit, name in CLOCK_EVENT_REASON_NAMES if mask & bit]
    unknown = mask & ~_KNOWN_REASON_BITS
    names.extend(f"0x{1 << shift:x}" for shift in range(unknown.bit_length()) if unknown >> shift & 1)
    return tuple(names)


def detect(*, nvml: NvmlApi | None = None) -> GpuInventory:
    """Read every GPU through `nvml` (default: the real library). Never raises.

    Errors: none escape. NVML failing to start, or finding no GPU, gives `available=False` with
    the reason; per-GPU failures leave fields None (see the module docstring).

    Resources: NVML is initialised and shut down inside this call.

    Blocking: yes; from trio, `await trio.to_thread.run_sync(detect)`.
    """
    api: NvmlApi = Pynvml() if nvml is None else nvml
    try:
        api.init()
    except pynvml.NVMLError as err:
        return GpuInventory(available=False, reason=_init_failure_reason(err))
    try:
        return _read_inventory(api)
    except Exception as err:  # broad on purpose: a quirk of one driver must not stop the node
        log.warning("GPU detection failed (%s: %s)", type(err).__name__, err)
        return GpuInventory(available=False, reason=f"GPU detection failed ({type(err).__name__}: {err}): {CPU_MODE}")
    finally:
        try:
            api.shutdown()
        except pynvml.NVMLError as err:
            log.debug("nvmlShutdown failed (%s)", err)


def _init_failure_reason(err: pynvml.NVMLError) -> str:
    if isinstance(err, pynvml.NVMLError_LibraryNotFound):
        return f"no NVIDIA driver found (libnvidia-ml.so not loadable): {CPU_MODE}"
    if isinstance(err, pynvml.NVMLError_DriverNotLoaded):
        return f"NVIDIA driver not loaded (is the nvidia kernel module installed and loaded?): {CPU_MODE}"
    if isinstance(err, pynvml.NVMLError_NoPermission):
        return f"no permission to open the NVIDIA devices (check /dev/nvidia* access): {CPU_MODE}"
    if isinstance(err, pynvml.NVMLError_LibRmVersionMismatch):
        return f"NVIDIA driver and library versions differ (reboot after a driver update): {CPU_MODE}"
    return f"NVML failed to start ({err}): {CPU_MODE}"


T = TypeVar("T")


class _Reader:
    """Runs optional NVML calls: an error leaves the value None and, unless it is NotSupported,
    becomes a warning naming the GPU and the field."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def read(self, where: str, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError as err:
            self.warnings.append(f"{where}: {err}")
            return None


class _Versions(TypedDict):
    """The system facts every `GpuInventory` carries, GPUs or none."""

    driver_version: str | None
    cuda_driver_version: str | None


def _read_inventory(api: NvmlApi) -> GpuInventory:
    reader = _Reader()
    driver = reader.read("driver version", api.driver_version)
    cuda = reader.read("CUDA driver version", api.cuda_driver_version)
    versions: _Versions = {
        "driver_version": driver,
        "cuda_driver_version": None if cuda is None else cuda_version_text(cuda),
    }
    try:
        count = api.device_count()
    except pynvml.NVMLError as err:
        return GpuInventory(available=False, reason=f"NVML could not count GPUs ({err}): {CPU_MODE}", **versions)
    if count == 0:
        return GpuInventory(available=False, reason=f"NVIDIA driver found but no GPU: {CPU_MODE}", **versions)

    handles: list[object] = []
    gpus: list[GpuInfo] = []
    for index in range(count):
        try:
            handle = api.handle(index)
        except pynvml.NVMLError as err:
            reader.warnings.append(f"GPU{index} left out: NVML cannot open it ({err})")
            continue
        handles.append(handle)
        gpus.append(_read_gpu(api, reader, index, handle))
    if not gpus:
        return GpuInventory(
            available=False,
            reason=f"NVML lists {count} GPU(s) but none could be opened: {CPU_MODE}",
            warnings=tuple(reader.warnings),
            **versions,
        )

    p2p = tuple(
        tuple(
            None
            if a == b
            else _p2p_name(
                reader.read(
                    f"P2P GPU{gpus[a].index}->GPU{gpus[b].index}",
                    functools.partial(api.p2p_read_status, handles[a], handles[b]),
                )
            )
            for b in range(len(gpus))
        )
        for a in range(len(gpus))
    )
    names = sorted({gpu.name or "unknown GPU" for gpu in gpus})
    found = f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) != 1 else ''} found ({', '.join(names)})"
    return GpuInventory(
        available=True, reason=found, gpus=tuple(gpus), p2p_status=p2p, warnings=tuple(reader.warnings), **versions
    )


def _p2p_name(status: int | None) -> str | None:
    if status is None:
        return None
    return P2P_STATUS_NAMES.get(status, f"status_{status}")


def _read_gpu(api: NvmlApi, reader: _Reader, index: int, handle: object) -> GpuInfo:
    def read(field: str, call: Callable[[], T]) -> T | None:
        return reader.read(f"GPU{index} {field}", call)

    memory = _read_memory(api, reader, index, handle)
    utilization = read("utilization", lambda: api.utilization(handle))
    power = read("power draw", lambda: api.power_usage_mw(handle))
    limit = read("power limit", lambda: api.power_limit_mw(handle))
    reasons = read("clock event reasons", lambda: api.clock_event_reasons(handle))
    return GpuInfo(
        index=index,
        name=read("name", lambda: api.name(handle)),
        uuid=read("uuid", lambda: api.uuid(handle)),
        pci_bus_id=read("PCI bus id", lambda: api.pci_bus_id(handle)),
        compute_capability=read("compute capability", lambda: api.compute_capability(handle)),
        memory_total_bytes=None if memory is None else memory.total,
        memory_used_bytes=None if memory is None else memory.used,
        memory_free_bytes=None if memory is None else memory.free,
        memory_reserved_bytes=None if memory is None else memory.reserved,
        gpu_util_percent=None if utilization is None else utilization[0],
        memory_util_percent=None if utilization is None else utilization[1],
        temperature_c=read("temperature", lambda: api.temperature(handle)),
        power_draw_w=None if power is None else power / 1000,
        power_limit_w=None if limit is None else limit / 1000,
        fan_percent=read("fan speed", lambda: api.fan_speed(handle)),
        sm_clock_mhz=read("SM clock", lambda: api.clock_mhz(handle, "sm")),
        sm_clock_max_mhz=read("max SM clock", lambda: api.max_clock_mhz(handle, "sm")),
        mem_clock_mhz=read("memory clock", lambda: api.clock_mhz(handle, "mem")),
        mem_clock_max_mhz=read("max memory clock", lambda: api.max_clock_mhz(handle, "mem")),
        clock_event_reasons=None if reasons is None else decode_clock_event_reasons(reasons),
        pcie_gen=read("PCIe generation", lambda: api.pcie_link_gen(handle, "current")),
        pcie_width=read("PCIe width", lambda: api.pcie_link_width(handle, "current")),
        pcie_gen_max=read("max PCIe generation", lambda: api.pcie_link_gen(handle, "max")),
        pcie_width_max=read("max PCIe width", lambda: api.pcie_link_width(handle, "max")),
    )


def _read_memory(api: NvmlApi, reader: _Reader, index: int, handle: object) -> MemoryReading | None:
    try:
        return api.memory_info_v2(handle)
    except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NotSupported):
        # Drivers older than 510 have no v2 call; v1 is right for them (nothing reserved).
        return reader.read(f"GPU{index} memory", lambda: api.memory_info_v1(handle))
    except pynvml.NVMLError as err:
        reader.warnings.append(f"GPU{index} memory: {err}")
        return None
