"""Live GPU readings for the node manager: what each GPU is doing now, and what a home miner
should do about it.

`gpu.detect()` answers "what GPUs does this machine have" once, for the planner. This module
answers "how are they running" every second, for the TUI and the control API: `sample()` reads
temperature (and the slowdown/shutdown thresholds), fan, power, VRAM, utilisation, clocks, the
PCIe link (current vs max) and the decoded clock-event (throttle) reasons; `assess()` turns a
sample into findings that name the fix ("GPU 1 runs at PCIe x8 (max x16): check the
riser/slot"); `run_gpu_monitor()` does both on a timer and publishes the result to the hub as
plain dicts (see `run_gpu_monitor` for the shape). Xid errors are events, not readings: it also
receives them as they come (`xid_events`) and adds their findings (`xids`).

Failure posture, the same as `gpu.detect()`'s:

* A reading NVML does not offer (`NVMLError_NotSupported`, or `NVMLError_NoPermission` for an
  unprivileged user) is None, shown as "n/a": never a crash and never a made-up 0. Both are
  steady states of a card or a user, so they are silent.
* Any other NVML error on a reading also leaves it None but is named in the sample's `errors`,
  and `assess` turns it into a finding. `NVMLError_GpuIsLost` (the card fell off the bus, the
  classic riser or power fault) marks the sample `lost` and stops reading that GPU for this
  round: every further call would fail the same way, slowly.
* No NVML at all (no driver, no GPU) is CPU mode: the monitor publishes `gpu.detect()`'s reason
  once and idles. NVML failing later (the driver unloaded) is published as `error`, and the last
  readings are left in place with their `sampled_at`, so a reader sees them go stale rather than
  vanish.

The thresholds `assess` and the TUI share live here (`temperature_band`, `NEAR_SLOWDOWN_C`, ...)
so the colour of a cell and the warning under the table never disagree.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, TypeVar

import pynvml
import trio

from engy_node.hardware.gpu import (
    CPU_MODE,
    MemoryReading,
    NvmlApi,
    Pynvml,
    ThresholdKind,
    decode_clock_event_reasons,
    detect,
)
from engy_node.hardware.xid_events import EventApi, PynvmlEvents, XidEvent, watch_xids
from engy_node.hardware.xids import explain, record_xid, xid_findings
from engy_node.hub import Hub
from engy_node.snapshots import Finding, GpuSample, XidRecord

__all__ = [
    "FALLBACK_SLOWDOWN_C",
    "LOADED_UTIL_PERCENT",
    "NEAR_SLOWDOWN_C",
    "THROTTLE_LABELS",
    "WARM_FRACTION",
    "MonitorApi",
    "MonitorPynvml",
    "TemperatureBand",
    "ThresholdKind",
    "assess",
    "monitor_api",
    "run_gpu_monitor",
    "sample",
    "temperature_band",
]

log = logging.getLogger("engy.gpus")

STATE_COMPONENT = "gpus"

TemperatureBand = Literal["cool", "warm", "hot", "limit"]

WARM_FRACTION = 0.75
"""Below this fraction of the slowdown temperature a GPU is "cool". With the usual 87-90 °C
slowdown that is about 65 °C: an idle or lightly loaded card sits below it, a card at full load
usually above it, which is normal but worth a glance."""

NEAR_SLOWDOWN_C = 5
"""Within this many °C of the slowdown temperature a GPU is "hot" and `assess` warns. Close enough
not to fire at ordinary full-load temperatures (65-75 °C on a well-cooled 4090), far enough below
slowdown that the owner can act before the card starts shedding clocks."""

FALLBACK_SLOWDOWN_C = 90
"""The reference when a GPU does not report its slowdown temperature: HiveOS autofan's default
critical temperature (DEF_CRITICAL_TEMP=90), the figure home miners already work to."""

LOADED_UTIL_PERCENT = 50
"""Above this GPU utilisation a PCIe generation below max counts as a problem. The generation
drops at idle to save power (a 4090 idles at gen 1), so only a link that stays low under load
means a riser, slot or BIOS setting holds it back; the width does not drop at idle."""

THROTTLE_LABELS = {
    "gpu_idle": "idle",
    "applications_clocks": "app clocks",
    "sw_power_cap": "power cap",
    "hw_slowdown": "HW slowdown",
    "sync_boost": "sync boost",
    "sw_thermal": "SW thermal",
    "hw_thermal": "HW thermal",
    "hw_power_brake": "power brake",
    "display_clock": "display clock",
    "board_limit": "board limit",
    "reliability": "reliability",
}
"""Short words for `decode_clock_event_reasons` names; an unknown bit keeps its hex name."""

# The reasons that cost throughput because something is wrong. The power cap is left out on
# purpose: a card at full load holding its power limit is working as set, and the throttle
# column already shows "power cap". Idle, sync boost and application/display clocks are not
# slowdowns at all.
THERMAL_REASONS = frozenset({"sw_thermal", "hw_thermal"})
PROBLEM_REASONS = THERMAL_REASONS | {"hw_slowdown", "hw_power_brake"}

COOLING_FIX = "improve cooling (case airflow, dust, fan curve) or lower the power limit"
POWER_FIX = "check the PSU and the GPU's power cables (a power brake or power spike, not heat)"


class MonitorApi(NvmlApi, EventApi, Protocol):
    """`NvmlApi` plus the calls only live monitoring makes: the thresholds and NVML's events."""

    def temperature_threshold(self, handle: object, kind: ThresholdKind) -> int:
        """The GPU's own slowdown or shutdown temperature, °C."""
        ...


class MonitorPynvml(PynvmlEvents, Pynvml):
    """`MonitorApi` on the real library."""

    _THRESHOLDS = {
        "slowdown": pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        "shutdown": pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    }

    def temperature_threshold(self, handle: object, kind: ThresholdKind) -> int:
        return pynvml.nvmlDeviceGetTemperatureThreshold(handle, self._THRESHOLDS[kind])


def monitor_api(fake_gpus: str = "") -> MonitorApi:
    """The real NVML, or with `fake_gpus` (`"4xRTX4090,1xRTX5090"`, the `--fake-gpus` forms) the
    fake one, for demos and tests on machines without those GPUs.

    Errors: `ConfigError` for a spec `parse_fake_gpu_spec` cannot read.
    """
    if not fake_gpus:
        return MonitorPynvml()
    from engy_node.hardware.fake_nvml import FakeNvml  # only fake GPUs load the fakes

    return FakeNvml.from_spec(fake_gpus)


T = TypeVar("T")


class _GpuReader:
    """Runs one GPU's optional reads, sorting failures as the module docstring describes."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.lost = False

    def read(self, field: str, call: Callable[[], T]) -> T | None:
        if self.lost:
            return None
        try:
            return call()
        except pynvml.NVMLError as err:
            self.failed(field, err)
            return None

    def failed(self, field: str, err: pynvml.NVMLError) -> None:
        if isinstance(err, (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission)):
            return
        self.lost = isinstance(err, pynvml.NVMLError_GpuIsLost)
        self.errors.append(f"{field} ({err})")


def sample(api: MonitorApi) -> tuple[GpuSample, ...]:
    """Read every GPU once. `api` must be initialised; this neither starts nor stops NVML.

    Errors: per-GPU failures stay inside the samples (see the module docstring). A failure to
    count the GPUs raises that `pynvml.NVMLError`: without a count there is nothing to report.

    Blocking: yes, a few ms per call; from trio, `await trio.to_thread.run_sync(sample, api)`.
    """
    samples = []
    for index in range(api.device_count()):
        reader = _GpuReader()
        handle = reader.read("handle", functools.partial(api.handle, index))
        if handle is None:
            samples.append(GpuSample(index=index, errors=tuple(reader.errors), lost=reader.lost))
        else:
            samples.append(_sample_gpu(api, reader, index, handle))
    return tuple(samples)


def _sample_gpu(api: MonitorApi, reader: _GpuReader, index: int, handle: object) -> GpuSample:
    read = reader.read
    name = read("name", lambda: api.name(handle))
    temperature = read("temperature", lambda: api.temperature(handle))
    slowdown = read("slowdown temperature", lambda: api.temperature_threshold(handle, "slowdown"))
    shutdown = read("shutdown temperature", lambda: api.temperature_threshold(handle, "shutdown"))
    fan = read("fan speed", lambda: api.fan_speed(handle))
    power = read("power draw", lambda: api.power_usage_mw(handle))
    limit = read("power limit", lambda: api.power_limit_mw(handle))
    memory = _read_memory(api, reader, handle)
    utilization = read("utilization", lambda: api.utilization(handle))
    sm_clock = read("SM clock", lambda: api.clock_mhz(handle, "sm"))
    sm_clock_max = read("max SM clock", lambda: api.max_clock_mhz(handle, "sm"))
    mem_clock = read("memory clock", lambda: api.clock_mhz(handle, "mem"))
    mem_clock_max = read("max memory clock", lambda: api.max_clock_mhz(handle, "mem"))
    pcie_gen = read("PCIe generation", lambda: api.pcie_link_gen(handle, "current"))
    pcie_width = read("PCIe width", lambda: api.pcie_link_width(handle, "current"))
    pcie_gen_max = read("max PCIe generation", lambda: api.pcie_link_gen(handle, "max"))
    pcie_width_max = read("max PCIe width", lambda: api.pcie_link_width(handle, "max"))
    reasons = read("clock event reasons", lambda: api.clock_event_reasons(handle))
    return GpuSample(
        index=index,
        name=name,
        temperature_c=temperature,
        temperature_slowdown_c=slowdown,
        temperature_shutdown_c=shutdown,
        fan_percent=fan,
        power_draw_w=None if power is None else power / 1000,
        power_limit_w=None if limit is None else limit / 1000,
        memory_used_bytes=None if memory is None else memory.used,
        memory_total_bytes=None if memory is None else memory.total,
        gpu_util_percent=None if utilization is None else utilization[0],
        memory_util_percent=None if utilization is None else utilization[1],
        sm_clock_mhz=sm_clock,
        sm_clock_max_mhz=sm_clock_max,
        mem_clock_mhz=mem_clock,
        mem_clock_max_mhz=mem_clock_max,
        pcie_gen=pcie_gen,
        pcie_width=pcie_width,
        pcie_gen_max=pcie_gen_max,
        pcie_width_max=pcie_width_max,
        clock_event_reasons=None if reasons is None else decode_clock_event_reasons(reasons),
        errors=tuple(reader.errors),
        lost=reader.lost,
    )


def _read_memory(api: MonitorApi, reader: _GpuReader, handle: object) -> MemoryReading | None:
    if reader.lost:
        return None
    try:
        return api.memory_info_v2(handle)
    except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NotSupported):
        # Drivers older than 510 have no v2 call; v1 is right for them (nothing reserved).
        return reader.read("memory", lambda: api.memory_info_v1(handle))
    except pynvml.NVMLError as err:
        reader.failed("memory", err)
        return None


# ---- assessment (pure) -------------------------------------------------------------------------


def temperature_band(temperature_c: int | None, slowdown_c: int | None) -> TemperatureBand | None:
    """How close `temperature_c` is to the slowdown temperature (`FALLBACK_SLOWDOWN_C` when the
    GPU does not report one): `cool` below `WARM_FRACTION` of it, `warm` up to `NEAR_SLOWDOWN_C`
    below it, `hot` from there, `limit` at or above it. None when there is no temperature."""
    if temperature_c is None:
        return None
    reference = FALLBACK_SLOWDOWN_C if slowdown_c is None else slowdown_c
    if temperature_c >= reference:
        return "limit"
    if temperature_c >= reference - NEAR_SLOWDOWN_C:
        return "hot"
    if temperature_c >= WARM_FRACTION * reference:
        return "warm"
    return "cool"


def assess(samples: Sequence[GpuSample]) -> tuple[Finding, ...]:
    """The findings for these samples, by GPU, each with its fix. Pure."""
    several = len(samples) > 1
    findings: list[Finding] = []
    for gpu in samples:
        if gpu.lost:
            findings.append(
                Finding(
                    gpu.index,
                    "lost",
                    "error",
                    f"GPU {gpu.index} stopped answering NVML (GPU is lost): reboot the machine; if it happens "
                    "again, reseat the card and its riser and check its power cables",
                )
            )
            continue
        pcie = _pcie_finding(gpu, several=several)
        throttling = _throttling_finding(gpu)
        temperature = None if throttling is not None else _temperature_finding(gpu)
        fan = _fan_finding(gpu)
        findings += [f for f in (pcie, throttling, temperature, fan) if f is not None]
        if gpu.errors:
            findings.append(
                Finding(
                    gpu.index,
                    "read_errors",
                    "warning",
                    f"GPU {gpu.index}: NVML failed to read {', '.join(gpu.errors)}; those readings show n/a",
                )
            )
    return tuple(findings)


def _pcie_finding(gpu: GpuSample, *, several: bool) -> Finding | None:
    narrow = gpu.pcie_width is not None and gpu.pcie_width_max is not None and gpu.pcie_width < gpu.pcie_width_max
    loaded = gpu.gpu_util_percent is not None and gpu.gpu_util_percent >= LOADED_UTIL_PERCENT
    slow = loaded and gpu.pcie_gen is not None and gpu.pcie_gen_max is not None and gpu.pcie_gen < gpu.pcie_gen_max
    if not (narrow or slow):
        return None
    if narrow and slow:
        link = f"PCIe {gpu.pcie_gen}.0 x{gpu.pcie_width} (max {gpu.pcie_gen_max}.0 x{gpu.pcie_width_max})"
    elif narrow:
        link = f"PCIe x{gpu.pcie_width} (max x{gpu.pcie_width_max})"
    else:
        link = f"PCIe {gpu.pcie_gen}.0 under load (max {gpu.pcie_gen_max}.0)"
    fix = "check the riser/slot" + (" and the slot's PCIe speed in the BIOS" if slow else "")
    if several:
        fix += "; tensor-parallel all-reduce is slower through it"
    return Finding(gpu.index, "pcie", "warning", f"GPU {gpu.index} runs at {link}: {fix}")


def _throttling_finding(gpu: GpuSample) -> Finding | None:
    reasons = set(gpu.clock_event_reasons or ())
    problems = [name for name in THROTTLE_LABELS if name in reasons & PROBLEM_REASONS]
    if not problems:
        return None
    labels = ", ".join(THROTTLE_LABELS[name] for name in problems)
    band = temperature_band(gpu.temperature_c, gpu.temperature_slowdown_c)
    hot = band in ("hot", "limit")
    fixes = []
    if reasons & THERMAL_REASONS or ("hw_slowdown" in reasons and hot):
        fixes.append(COOLING_FIX)
    if "hw_power_brake" in reasons or ("hw_slowdown" in reasons and band is not None and not hot):
        fixes.append(POWER_FIX)
    if not fixes:
        # HW slowdown and no temperature reading: heat and power delivery are equally likely.
        fixes = [COOLING_FIX, POWER_FIX]
    return Finding(
        gpu.index,
        "throttling",
        "warning",
        f"GPU {gpu.index} is throttling: {labels}{_temperature_evidence(gpu)}: {'; '.join(fixes)}",
    )


def _temperature_evidence(gpu: GpuSample) -> str:
    temperature, slowdown = gpu.temperature_c, gpu.temperature_slowdown_c
    if temperature is None:
        return ""
    if slowdown is None:
        return f" (temperature {temperature}°C)"
    if temperature >= slowdown:
        return f" (temperature {temperature}°C ≥ {slowdown}°C slowdown)"
    return f" (temperature {temperature}°C, slowdown at {slowdown}°C)"


def _temperature_finding(gpu: GpuSample) -> Finding | None:
    band = temperature_band(gpu.temperature_c, gpu.temperature_slowdown_c)
    if band not in ("hot", "limit"):
        return None
    temperature = gpu.temperature_c
    assert temperature is not None  # temperature_band gives a band only for a reading
    if gpu.temperature_slowdown_c is None:
        where = f"near the {FALLBACK_SLOWDOWN_C}°C where GPUs commonly slow down (this one does not report its own)"
    elif band == "limit":
        where = f"at or above its {gpu.temperature_slowdown_c}°C slowdown"
    else:
        where = f"{gpu.temperature_slowdown_c - temperature}°C below its {gpu.temperature_slowdown_c}°C slowdown"
    return Finding(
        gpu.index, "temperature", "warning", f"GPU {gpu.index} is at {temperature}°C, {where}: {COOLING_FIX}"
    )


def _fan_finding(gpu: GpuSample) -> Finding | None:
    if gpu.fan_percent is None or gpu.fan_percent < 100:
        return None
    return Finding(
        gpu.index,
        "fan",
        "warning",
        f"GPU {gpu.index}'s fan runs at {gpu.fan_percent}%: it cannot cool any harder; "
        "improve case airflow or lower the power limit",
    )


# ---- the service -------------------------------------------------------------------------------


async def run_gpu_monitor(
    hub: Hub,
    *,
    api: MonitorApi | None = None,
    interval_s: float = 1.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample every GPU each `interval_s` in a worker thread and publish to `hub` under "gpus":

        samples     [GpuSample.as_dict(), ...]  by NVML index; [] in CPU mode
        findings    [Finding.as_dict(), ...]    {"gpu", "kind", "level", "text"}, by GPU
        xids        [XidRecord.as_dict(), ...]  {"gpu", "xid", "at", "count"}: each GPU's last Xid
        reason      None, or why this is CPU mode (then nothing else is ever sampled)
        error       None, or why the last round failed (samples/sampled_at keep the last good one)
        sampled_at  wall-clock time (time.time()) of the samples

    Ready (`task_status.started()`) once the first state is published, so a caller that starts
    this with `nursery.start` can read the hub at once. `api` defaults to the real NVML.

    Resources: NVML is initialised here and shut down when this is cancelled, after the Xid
    watcher (`xid_events.watch_xids`, its own worker thread) has freed its event set. `gpu.detect()`
    runs once first for the CPU-mode decision and its reason; NVML counts initialisations, so
    the miner's own `detect()` can run alongside.

    Errors: none escape but cancellation. A failed round is logged once per distinct error (and
    its recovery once), not every second.
    """
    api = MonitorPynvml() if api is None else api
    inventory = await trio.to_thread.run_sync(functools.partial(detect, nvml=api))
    if inventory.cpu_mode:
        await _idle_in_cpu_mode(hub, inventory.reason, task_status)
        return
    try:
        await trio.to_thread.run_sync(api.init)
    except pynvml.NVMLError as err:
        # detect() got through a moment ago; the driver went away in between.
        await _idle_in_cpu_mode(hub, f"NVML failed to start ({err}): {CPU_MODE}", task_status)
        return
    xids: dict[int, XidRecord] = {}

    def on_xid(event: XidEvent) -> None:
        meaning = explain(event.xid)
        log.log(
            logging.ERROR if meaning.level == "error" else logging.WARNING,
            "GPU %d reported Xid %d, %s: %s",
            event.gpu,
            event.xid,
            meaning.what,
            meaning.fix,
        )
        xids.update(record_xid(xids, event.gpu, event.xid, time.time()))
        hub.set_state(STATE_COMPONENT, xids=[r.as_dict() for _, r in sorted(xids.items())])

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_xids, api, on_xid)
            await _sample_forever(hub, api, interval_s, xids, task_status)
    finally:
        # Shielded: this runs on cancellation, and NVML must be shut down even then.
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(api.shutdown)
            except pynvml.NVMLError as err:
                log.debug("nvmlShutdown failed (%s)", err)


async def _idle_in_cpu_mode(hub: Hub, reason: str, task_status: trio.TaskStatus[None]) -> None:
    log.info("GPU monitor idle: %s", reason)
    hub.set_state(STATE_COMPONENT, samples=[], findings=[], reason=reason, error=None, sampled_at=time.time())
    task_status.started()
    await trio.sleep_forever()


async def _sample_forever(
    hub: Hub, api: MonitorApi, interval_s: float, xids: dict[int, XidRecord], task_status: trio.TaskStatus[None]
) -> None:
    last_error: str | None = None
    active: dict[tuple[int, str], Finding] = {}
    started = False
    while True:
        try:
            samples = await trio.to_thread.run_sync(sample, api)
        except Exception as err:  # broad on purpose: a driver quirk must not stop the node
            error = f"GPU readings failed ({type(err).__name__}: {err})"
            if error != last_error:
                log.warning("%s; retrying every %g s", error, interval_s)
            last_error = error
            if started:
                hub.set_state(STATE_COMPONENT, error=error)
            else:
                # Nothing good to keep yet: publish the whole shape, empty.
                hub.set_state(STATE_COMPONENT, samples=[], findings=[], reason=None, error=error, sampled_at=None)
        else:
            if last_error is not None:
                log.info("GPU readings are back")
                last_error = None
            now = time.time()
            findings = sorted((*assess(samples), *xid_findings(xids.values(), now)), key=lambda f: f.gpu)
            _log_changes(active, findings)
            hub.set_state(
                STATE_COMPONENT,
                samples=[s.as_dict() for s in samples],
                findings=[f.as_dict() for f in findings],
                xids=[r.as_dict() for _, r in sorted(xids.items())],
                reason=None,
                error=None,
                sampled_at=now,
            )
        if not started:
            task_status.started()
            started = True
        await trio.sleep(interval_s)


def _log_changes(active: dict[tuple[int, str], Finding], findings: Sequence[Finding]) -> None:
    """Log a finding when it appears and when it clears, keyed by GPU and kind: its text carries
    live numbers and changes every round. An Xid's appearance is not logged here: each Xid is, as
    it comes (`run_gpu_monitor`'s `on_xid`)."""
    now = {(f.gpu, f.kind): f for f in findings}
    for key, finding in now.items():
        if key not in active and finding.kind != "xid":
            log.log(logging.ERROR if finding.level == "error" else logging.WARNING, "%s", finding.text)
    for key in active.keys() - now.keys():
        log.info("cleared: %s", active[key].text)
    active.clear()
    active.update(now)
