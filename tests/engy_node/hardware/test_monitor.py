"""Live GPU monitoring: sampling through the fake NVML (the same code path as the real library),
every finding `assess` makes and the cases where it must stay quiet, and the trio service that
publishes both to the hub, including CPU mode and an NVML that stops answering."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math

import pynvml
import pytest
import trio
import trio.testing

from engy_node.errors import ConfigError
from engy_node.hardware.fake_nvml import FAKE_GPU_MODELS, FakeGpu, FakeNvml
from engy_node.hardware.gpu import GIB, MIB
from engy_node.hardware.monitor import (
    COOLING_FIX,
    FALLBACK_SLOWDOWN_C,
    POWER_FIX,
    MonitorApi,
    MonitorPynvml,
    assess,
    monitor_api,
    run_gpu_monitor,
    sample,
    temperature_band,
)
from engy_node.hub import Hub
from engy_node.snapshots import Finding, GpuSample
from tests.waiting import Changes

WAIT_S = 10.0
TP = "; tensor-parallel all-reduce is slower through it"


def busy(model: str, **changes: object) -> FakeGpu:
    """A card serving a model: loaded, warm, near its power limit, VRAM nearly full."""
    gpu = FAKE_GPU_MODELS[model]
    loaded = dataclasses.replace(
        gpu,
        temperature_c=64,
        fan_percent=48,
        power_draw_w=301,
        gpu_util_percent=93,
        memory_util_percent=41,
        memory_used_mib=gpu.memory_total_mib - 2150,
        sm_clock_mhz=2520,
        mem_clock_mhz=gpu.mem_clock_max_mhz,
        clock_event_reasons=0,
    )
    return dataclasses.replace(loaded, **changes)


def rig() -> FakeNvml:
    """4x RTX 4090 + 1x RTX 5090 serving: GPU 1 on a x8 riser, GPU 2 overheating and throttling,
    GPU 3 on a board whose fan speed NVML does not report."""
    return FakeNvml(
        [
            busy("RTX4090"),
            busy("RTX4090", temperature_c=71, fan_percent=55, power_draw_w=318, pcie_width=8),
            busy(
                "RTX4090",
                temperature_c=88,
                fan_percent=100,
                sm_clock_mhz=1260,
                clock_event_reasons=pynvml.nvmlClocksEventReasonHwSlowdown
                | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
            ),
            busy("RTX4090", unsupported=frozenset({"fan_speed"})),
            busy("RTX5090", temperature_c=58, power_draw_w=402),
        ]
    )


def sample_of(*gpus: FakeGpu, **nvml: object) -> tuple[GpuSample, ...]:
    api = FakeNvml(gpus, **nvml)
    api.init()
    return sample(api)


def gpu(**readings: object) -> GpuSample:
    """A healthy loaded GPU 0 as `sample` reads it, with `readings` changed."""
    healthy = GpuSample(
        index=0,
        name="NVIDIA GeForce RTX 4090",
        temperature_c=64,
        temperature_slowdown_c=87,
        temperature_shutdown_c=90,
        fan_percent=48,
        power_draw_w=301.0,
        power_limit_w=450.0,
        memory_used_bytes=22 * GIB,
        memory_total_bytes=24 * GIB,
        gpu_util_percent=93,
        memory_util_percent=41,
        sm_clock_mhz=2520,
        sm_clock_max_mhz=3120,
        mem_clock_mhz=10501,
        mem_clock_max_mhz=10501,
        pcie_gen=4,
        pcie_width=16,
        pcie_gen_max=4,
        pcie_width_max=16,
        clock_event_reasons=(),
    )
    return dataclasses.replace(healthy, **readings)


def kinds(findings: tuple[Finding, ...]) -> list[tuple[int, str]]:
    return [(f.gpu, f.kind) for f in findings]


# ---- sampling -----------------------------------------------------------------------------------


def test_every_reading_of_a_loaded_gpu_is_sampled():
    first = sample_of(busy("RTX4090"))[0]

    assert first == GpuSample(
        index=0,
        name="NVIDIA GeForce RTX 4090",
        temperature_c=64,
        temperature_slowdown_c=87,
        temperature_shutdown_c=90,
        fan_percent=48,
        power_draw_w=301.0,
        power_limit_w=450.0,
        memory_used_bytes=(24564 - 2150) * MIB,
        memory_total_bytes=24564 * MIB,
        gpu_util_percent=93,
        memory_util_percent=41,
        sm_clock_mhz=2520,
        sm_clock_max_mhz=3120,
        mem_clock_mhz=10501,
        mem_clock_max_mhz=10501,
        pcie_gen=4,
        pcie_width=16,
        pcie_gen_max=4,
        pcie_width_max=16,
        clock_event_reasons=(),
        errors=(),
        lost=False,
    )


def test_the_rig_is_sampled_gpu_by_gpu_with_its_faults_visible():
    samples = sample(_started(rig()))

    assert [s.index for s in samples] == [0, 1, 2, 3, 4]
    assert [s.name for s in samples] == ["NVIDIA GeForce RTX 4090"] * 4 + ["NVIDIA GeForce RTX 5090"]
    assert (samples[1].pcie_gen, samples[1].pcie_width, samples[1].pcie_gen_max, samples[1].pcie_width_max) == (
        4,
        8,
        4,
        16,
    )
    assert samples[2].clock_event_reasons == ("hw_slowdown", "hw_thermal")
    assert (samples[4].pcie_gen_max, samples[4].power_limit_w) == (5, 575.0)
    assert all(s.errors == () and not s.lost for s in samples)


def test_a_reading_nvml_does_not_support_is_none_not_zero_and_not_an_error():
    fanless = sample(_started(rig()))[3]

    assert fanless.fan_percent is None
    assert fanless.errors == ()
    assert fanless.temperature_c == 64, "the rest of the GPU is still read"


def test_a_reading_this_user_may_not_see_is_none_and_silent():
    restricted = sample_of(busy("RTX4090", forbidden=frozenset({"power_limit_mw", "temperature_threshold"})))[0]

    assert (restricted.power_limit_w, restricted.temperature_slowdown_c, restricted.temperature_shutdown_c) == (
        None,
        None,
        None,
    )
    assert restricted.power_draw_w == 301.0
    assert restricted.errors == ()


def test_any_other_nvml_error_leaves_the_reading_none_and_names_it():
    old_driver = sample_of(busy("RTX4090"), missing_functions=frozenset({"temperature_threshold"}))[0]

    assert old_driver.temperature_slowdown_c is None
    assert old_driver.errors == (
        "slowdown temperature (Function Not Found)",
        "shutdown temperature (Function Not Found)",
    )
    assert not old_driver.lost


def test_a_lost_gpu_is_marked_and_not_read_further_while_the_others_are():
    samples = sample_of(busy("RTX4090", broken=frozenset({"temperature"})), busy("RTX4090"))

    assert samples[0].lost
    assert samples[0].errors == ("temperature (GPU is lost)",)
    assert samples[0].name == "NVIDIA GeForce RTX 4090", "read before it was lost"
    assert (samples[0].fan_percent, samples[0].memory_total_bytes, samples[0].pcie_width) == (None, None, None)
    assert samples[1].temperature_c == 64 and not samples[1].lost


def test_a_gpu_that_cannot_be_opened_still_has_its_row():
    samples = sample_of(busy("RTX4090"), busy("RTX4090", broken=frozenset({"handle"})))

    assert samples[1] == GpuSample(index=1, errors=("handle (GPU is lost)",), lost=True)


def test_memory_falls_back_to_the_v1_call_on_drivers_without_v2():
    old = sample_of(busy("RTX4090"), missing_functions=frozenset({"memory_info_v2"}))[0]

    assert old.memory_total_bytes == 24564 * MIB
    assert old.memory_used_bytes == (24564 - 2150 + 330) * MIB, "v1 counts the driver's reservation as used"
    assert old.errors == ()


def test_failing_to_count_the_gpus_raises_the_nvml_error():
    api = _started(FakeNvml.from_spec("RTX4090"))
    api.missing_functions = frozenset({"device_count"})

    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        sample(api)


def test_a_sample_is_json_ready():
    data = sample(_started(rig()))[2].as_dict()

    assert data["clock_event_reasons"] == ["hw_slowdown", "hw_thermal"]
    assert data["errors"] == []
    assert json.loads(json.dumps(data)) == data


def test_the_threshold_call_has_the_same_signature_on_the_fake_and_the_real_library():
    expected = inspect.signature(MonitorApi.temperature_threshold)

    assert inspect.signature(FakeNvml.temperature_threshold) == expected
    assert inspect.signature(MonitorPynvml.temperature_threshold) == expected


def test_fake_gpus_come_from_the_same_spec_strings_as_fake_gpus_elsewhere():
    api = monitor_api("4xRTX4090,1xRTX5090")

    assert isinstance(api, FakeNvml)
    assert [g.model for g in api.gpus] == ["RTX4090"] * 4 + ["RTX5090"]
    assert isinstance(monitor_api(), MonitorPynvml)
    with pytest.raises(ConfigError, match="unknown GPU model"):
        monitor_api("2xGTX9999")


def _started(api: FakeNvml) -> FakeNvml:
    api.init()
    return api


# ---- temperature bands --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "slowdown", "band"),
    [
        (None, 87, None),
        (65, 87, "cool"),  # 75 % of 87 is 65.25
        (66, 87, "warm"),
        (81, 87, "warm"),
        (82, 87, "hot"),  # 5 °C below slowdown
        (86, 87, "hot"),
        (87, 87, "limit"),
        (95, 87, "limit"),
        (84, None, "warm"),  # against the 90 °C fallback
        (85, None, "hot"),
        (90, None, "limit"),
    ],
)
def test_temperature_bands_are_measured_against_the_gpus_own_slowdown(temperature, slowdown, band):
    assert temperature_band(temperature, slowdown) == band


def test_the_fallback_slowdown_is_hiveos_autofans_critical_temperature():
    assert FALLBACK_SLOWDOWN_C == 90


# ---- findings -----------------------------------------------------------------------------------


def test_a_healthy_rig_has_no_findings():
    assert assess([gpu(), gpu(index=1, pcie_gen=1, gpu_util_percent=0, clock_event_reasons=("gpu_idle",))]) == ()


def test_the_rig_gets_one_finding_per_fault_in_gpu_order():
    findings = assess(sample(_started(rig())))

    assert kinds(findings) == [(1, "pcie"), (2, "throttling"), (2, "fan")]
    assert findings[0].text == f"GPU 1 runs at PCIe x8 (max x16): check the riser/slot{TP}"
    assert (
        findings[1].text
        == f"GPU 2 is throttling: HW slowdown, HW thermal (temperature 88°C ≥ 87°C slowdown): {COOLING_FIX}"
    )


def test_a_narrow_link_is_named_with_the_fix_and_the_multi_gpu_cost_only_with_several_gpus():
    (alone,) = assess([gpu(pcie_width=8)])
    assert (alone.kind, alone.level) == ("pcie", "warning")
    assert alone.text == "GPU 0 runs at PCIe x8 (max x16): check the riser/slot"
    (shared,) = assess([gpu(), gpu(index=1, pcie_width=4)])
    assert shared.text == f"GPU 1 runs at PCIe x4 (max x16): check the riser/slot{TP}"


def test_a_narrow_link_counts_even_at_idle_since_the_width_does_not_drop_to_save_power():
    assert kinds(assess([gpu(pcie_width=8, gpu_util_percent=0)])) == [(0, "pcie")]


def test_a_slow_generation_counts_only_under_load():
    (loaded,) = assess([gpu(pcie_gen=3)])
    assert (
        loaded.text
        == "GPU 0 runs at PCIe 3.0 under load (max 4.0): check the riser/slot and the slot's PCIe speed in the BIOS"
    )
    assert assess([gpu(pcie_gen=1, gpu_util_percent=0)]) == (), "gen 1 at idle is power saving"
    assert assess([gpu(pcie_gen=1, gpu_util_percent=None)]) == (), "no utilisation reading: no claim"


def test_a_link_below_max_on_both_counts_is_one_finding():
    (both,) = assess([gpu(pcie_gen=3, pcie_width=8)])
    assert both.text.startswith(
        "GPU 0 runs at PCIe 3.0 x8 (max 4.0 x16): check the riser/slot and the slot's PCIe speed"
    )


def test_an_unreported_link_is_no_finding():
    assert assess([gpu(pcie_gen=None, pcie_width=None, pcie_gen_max=None, pcie_width_max=None)]) == ()
    assert assess([gpu(pcie_width=8, pcie_width_max=None)]) == ()


@pytest.mark.parametrize(
    ("readings", "text"),
    [
        (
            dict(temperature_c=88, clock_event_reasons=("hw_slowdown",)),
            f"GPU 0 is throttling: HW slowdown (temperature 88°C ≥ 87°C slowdown): {COOLING_FIX}",
        ),
        (
            dict(temperature_c=84, clock_event_reasons=("sw_thermal",)),
            f"GPU 0 is throttling: SW thermal (temperature 84°C, slowdown at 87°C): {COOLING_FIX}",
        ),
        (
            dict(temperature_c=60, clock_event_reasons=("hw_slowdown",)),
            f"GPU 0 is throttling: HW slowdown (temperature 60°C, slowdown at 87°C): {POWER_FIX}",
        ),
        (
            dict(temperature_c=60, clock_event_reasons=("sw_power_cap", "hw_power_brake")),
            f"GPU 0 is throttling: power brake (temperature 60°C, slowdown at 87°C): {POWER_FIX}",
        ),
        (
            dict(temperature_c=None, clock_event_reasons=("hw_slowdown",)),
            f"GPU 0 is throttling: HW slowdown: {COOLING_FIX}; {POWER_FIX}",
        ),
        (
            dict(temperature_c=88, temperature_slowdown_c=None, clock_event_reasons=("hw_thermal", "hw_power_brake")),
            f"GPU 0 is throttling: HW thermal, power brake (temperature 88°C): {COOLING_FIX}; {POWER_FIX}",
        ),
    ],
    ids=["hw-slowdown-hot", "sw-thermal", "hw-slowdown-cool-means-power", "power-brake", "no-temperature", "both"],
)
def test_throttling_is_named_with_its_evidence_and_the_fix_that_fits_the_cause(readings, text):
    (finding,) = assess([gpu(**readings)])
    assert (finding.kind, finding.level, finding.text) == ("throttling", "warning", text)


@pytest.mark.parametrize(
    "reasons",
    [(), ("gpu_idle",), ("sw_power_cap",), ("sync_boost", "applications_clocks", "display_clock"), None],
)
def test_a_gpu_holding_its_power_limit_idling_or_unreported_is_not_throttling(reasons):
    assert assess([gpu(clock_event_reasons=reasons)]) == ()


def test_a_gpu_near_its_slowdown_gets_a_temperature_warning():
    (finding,) = assess([gpu(temperature_c=84)])
    assert (finding.kind, finding.level) == ("temperature", "warning")
    assert finding.text == f"GPU 0 is at 84°C, 3°C below its 87°C slowdown: {COOLING_FIX}"


def test_a_gpu_at_its_slowdown_without_a_throttle_reason_still_gets_a_warning():
    (finding,) = assess([gpu(temperature_c=87)])
    assert finding.text == f"GPU 0 is at 87°C, at or above its 87°C slowdown: {COOLING_FIX}"


def test_without_its_own_slowdown_a_gpu_is_judged_against_the_fallback_and_says_so():
    (finding,) = assess([gpu(temperature_c=86, temperature_slowdown_c=None)])
    assert finding.text == (
        f"GPU 0 is at 86°C, near the 90°C where GPUs commonly slow down "
        f"(this one does not report its own): {COOLING_FIX}"
    )


@pytest.mark.parametrize("temperature", [None, 64, 75, 81])
def test_a_cool_or_warm_gpu_gets_no_temperature_warning(temperature):
    assert assess([gpu(temperature_c=temperature)]) == ()


def test_a_throttling_gpu_gets_the_throttling_finding_not_a_second_temperature_one():
    assert kinds(assess([gpu(temperature_c=88, clock_event_reasons=("hw_thermal",))])) == [(0, "throttling")]


def test_a_fan_at_full_speed_is_a_warning():
    (finding,) = assess([gpu(fan_percent=100)])
    assert (finding.kind, finding.level) == ("fan", "warning")
    assert finding.text == (
        "GPU 0's fan runs at 100%: it cannot cool any harder; improve case airflow or lower the power limit"
    )


@pytest.mark.parametrize("fan", [None, 0, 99])
def test_a_fan_below_full_speed_or_unreported_is_no_finding(fan):
    assert assess([gpu(fan_percent=fan)]) == ()


def test_a_lost_gpu_is_one_error_with_the_fix_and_nothing_else():
    lost = GpuSample(index=3, errors=("handle (GPU is lost)",), lost=True, pcie_width=8, pcie_width_max=16)
    (finding,) = assess([lost])
    assert (finding.gpu, finding.kind, finding.level) == (3, "lost", "error")
    assert finding.text == (
        "GPU 3 stopped answering NVML (GPU is lost): reboot the machine; if it happens again, "
        "reseat the card and its riser and check its power cables"
    )


def test_readings_nvml_failed_on_are_named():
    (finding,) = assess([gpu(fan_percent=None, errors=("fan speed (Unknown Error)",))])
    assert (finding.kind, finding.level) == ("read_errors", "warning")
    assert finding.text == "GPU 0: NVML failed to read fan speed (Unknown Error); those readings show n/a"


# ---- the service --------------------------------------------------------------------------------


async def wait_for(condition, what: str) -> None:
    with trio.fail_after(WAIT_S):
        while not condition():
            await trio.sleep(0.01)


class RoundsHub(Hub):
    """A hub that counts the monitor's updates: it publishes once a round, good or failed."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds = 0
        self.changes = Changes()

    def set_state(self, component: str, **values) -> None:
        super().set_state(component, **values)
        if component == "gpus":
            self.rounds += 1
            self.changes.notify()


async def test_the_monitor_publishes_samples_and_findings_to_the_hub_and_shuts_nvml_down():
    hub, api = Hub(), rig()
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_gpu_monitor(hub, api=api, interval_s=0.01, task_status=task_status))
        state = hub.states()["gpus"]
        assert state["reason"] is None and state["error"] is None
        assert [s["index"] for s in state["samples"]] == [0, 1, 2, 3, 4]
        assert state["samples"][3]["fan_percent"] is None
        assert [(f["gpu"], f["kind"]) for f in state["findings"]] == [(1, "pcie"), (2, "throttling"), (2, "fan")]
        assert state["findings"][0]["text"].startswith("GPU 1 runs at PCIe x8 (max x16): check the riser/slot")
        first = state["sampled_at"]
        await wait_for(lambda: hub.states()["gpus"]["sampled_at"] > first, "a second round")
        nursery.cancel_scope.cancel()
    # detect() for the CPU-mode decision, then the monitor's own session: both closed.
    assert (api.init_calls, api.shutdown_calls) == (2, 2)
    assert json.loads(json.dumps(hub.snapshot()))["states"]["gpus"]["samples"][2]["clock_event_reasons"] == [
        "hw_slowdown",
        "hw_thermal",
    ]


async def test_findings_are_logged_when_they_appear_and_when_they_clear(caplog):
    hub, api = Hub(), rig()
    with caplog.at_level(logging.INFO, logger="engy.gpus"):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: run_gpu_monitor(hub, api=api, interval_s=0.01, task_status=task_status)
            )
            first = hub.states()["gpus"]["sampled_at"]
            await wait_for(lambda: hub.states()["gpus"]["sampled_at"] > first, "a second round")
            api.gpus = (api.gpus[0], busy("RTX4090"), *api.gpus[2:])  # the riser is replaced
            await wait_for(lambda: all(f["gpu"] != 1 for f in hub.states()["gpus"]["findings"]), "the fix to show")
            nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records if r.name == "engy.gpus"]
    pcie = [m for m in messages if "PCIe x8" in m]
    assert len(pcie) == 2, "once when it appears, once when it clears, not every round"
    assert pcie[1].startswith("cleared: GPU 1 runs at PCIe x8")
    assert sum("GPU 2 is throttling" in m for m in messages) == 1


@pytest.mark.parametrize(
    ("api", "reason"),
    [
        (
            FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound),
            "no NVIDIA driver found (libnvidia-ml.so not loadable): running in CPU mode",
        ),
        (FakeNvml([]), "NVIDIA driver found but no GPU: running in CPU mode"),
    ],
    ids=["no-driver", "no-gpu"],
)
async def test_without_nvml_the_monitor_publishes_the_cpu_mode_reason_once_and_idles(api, reason, caplog, mock_clock):
    hub = Hub()
    with caplog.at_level(logging.INFO, logger="engy.gpus"):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: run_gpu_monitor(hub, api=api, interval_s=0.01, task_status=task_status)
            )
            assert hub.states()["gpus"] == {
                "samples": [],
                "findings": [],
                "reason": reason,
                "error": None,
                "sampled_at": hub.states()["gpus"]["sampled_at"],
            }
            # An idle monitor must not retry: once it has settled, nothing in this run waits on a
            # timer that could wake it (the mock clock stands still, so one that did would still be waiting).
            await trio.testing.wait_all_tasks_blocked()
            assert trio.lowlevel.current_statistics().seconds_to_next_deadline == math.inf
            nursery.cancel_scope.cancel()
    assert api.init_calls == 1
    assert [r.getMessage() for r in caplog.records if r.name == "engy.gpus"] == [f"GPU monitor idle: {reason}"]


async def test_nvml_failing_later_is_published_once_as_an_error_and_readings_go_stale(caplog):
    hub, api = RoundsHub(), rig()
    with caplog.at_level(logging.INFO, logger="engy.gpus"):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: run_gpu_monitor(hub, api=api, interval_s=0.01, task_status=task_status)
            )
            api.missing_functions = frozenset({"device_count"})
            await wait_for(lambda: hub.states()["gpus"]["error"] is not None, "the error")
            frozen, failed = hub.states()["gpus"], hub.rounds
            await hub.changes.wait_for(
                lambda: hub.rounds >= failed + 3, timeout_s=WAIT_S, what="three more failed rounds"
            )
            during = hub.states()["gpus"]
            api.missing_functions = frozenset()
            await wait_for(lambda: hub.states()["gpus"]["error"] is None, "the recovery")
            nursery.cancel_scope.cancel()
    assert during["error"] == "GPU readings failed (NVMLError_FunctionNotFound: Function Not Found)"
    assert (during["samples"], during["sampled_at"]) == (frozen["samples"], frozen["sampled_at"]), "kept, to go stale"
    messages = [r.getMessage() for r in caplog.records if r.name == "engy.gpus"]
    assert sum(m.startswith("GPU readings failed") for m in messages) == 1
    assert "GPU readings are back" in messages
