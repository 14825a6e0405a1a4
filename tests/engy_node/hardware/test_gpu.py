"""GPU detection through the NVML interface: fake devices for every shape of machine, and the
real library on this machine (GPU-less or not)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import pynvml
import pytest
import trio

from engy_node.hardware.fake_nvml import FAKE_GPU_MODELS, FakeNvml
from engy_node.hardware.gpu import (
    MIB,
    P2P_CAPS_INDEX_READ,
    GpuInfo,
    cuda_version_text,
    decode_clock_event_reasons,
    detect,
)

RTX4090 = FAKE_GPU_MODELS["RTX4090"]
RTX5090 = FAKE_GPU_MODELS["RTX5090"]


def test_four_rtx_4090s_are_read_in_full_and_nvml_is_shut_down():
    nvml = FakeNvml.from_spec("4xRTX4090")
    inventory = detect(nvml=nvml)

    assert inventory.available and not inventory.cpu_mode
    assert inventory.reason == "4 NVIDIA GPUs found (NVIDIA GeForce RTX 4090)"
    assert inventory.driver_version == "570.133.07"
    assert inventory.cuda_driver_version == "12.8"
    assert inventory.warnings == ()
    assert [gpu.index for gpu in inventory.gpus] == [0, 1, 2, 3]
    gpu = inventory.gpus[0]
    assert gpu.name == "NVIDIA GeForce RTX 4090"
    assert gpu.compute_capability == (8, 9)
    assert gpu.memory_total_bytes == 24564 * MIB
    assert gpu.memory_reserved_bytes == 330 * MIB
    assert gpu.memory_used_bytes == 1 * MIB
    assert gpu.memory_free_bytes == (24564 - 330 - 1) * MIB
    assert (gpu.power_draw_w, gpu.power_limit_w) == (21.0, 450.0)
    assert (gpu.temperature_c, gpu.fan_percent) == (41, 30)
    assert (gpu.gpu_util_percent, gpu.memory_util_percent) == (0, 0)
    assert (gpu.sm_clock_mhz, gpu.sm_clock_max_mhz, gpu.mem_clock_mhz, gpu.mem_clock_max_mhz) == (210, 3120, 405, 10501)
    assert gpu.clock_event_reasons == ("gpu_idle",)
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.pcie_gen_max, gpu.pcie_width_max) == (4, 16, 4, 16)
    assert gpu.pcie_downgraded is False
    assert gpu.describe() == "GPU0 NVIDIA GeForce RTX 4090 24.0 GiB cc 8.9 PCIe 4.0 x16 (max 4.0 x16) 41 °C"
    assert len({g.uuid for g in inventory.gpus}) == 4 and all(g.uuid.startswith("GPU-") for g in inventory.gpus)
    assert [g.pci_bus_id for g in inventory.gpus] == [f"00000000:0{i}:00.0" for i in range(1, 5)]
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1)


def test_geforce_cards_report_no_p2p_between_each_other():
    inventory = detect(nvml=FakeNvml.from_spec("4xRTX4090"))

    assert inventory.p2p_status[0] == (None, "not_supported", "not_supported", "not_supported")
    assert inventory.p2p_ok(0, 1) is False
    assert inventory.p2p_ok(2, 2) is True
    matrix = inventory.p2p_ok_matrix
    assert all(matrix[a][b] is (a == b) for a in range(4) for b in range(4))


def test_p2p_can_be_made_available_for_fakes():
    inventory = detect(nvml=FakeNvml.from_spec("2xRTX4090", p2p_ok=True))

    assert inventory.p2p_status == ((None, "ok"), ("ok", None))
    assert inventory.p2p_ok_matrix == ((True, True), (True, True))


def test_two_rtx_5090s_report_blackwell_values():
    inventory = detect(nvml=FakeNvml.from_spec("2xRTX5090"))

    gpu = inventory.gpus[1]
    assert gpu.name == "NVIDIA GeForce RTX 5090"
    assert gpu.compute_capability == (12, 0)
    assert gpu.memory_total_bytes == 32607 * MIB
    assert gpu.power_limit_w == 575.0
    assert gpu.describe() == "GPU1 NVIDIA GeForce RTX 5090 31.8 GiB cc 12.0 PCIe 5.0 x16 (max 5.0 x16) 38 °C"


def test_mixed_gpus_keep_the_spec_order_and_are_all_named():
    inventory = detect(nvml=FakeNvml.from_spec("RTX4090,RTX5090"))

    assert [gpu.name for gpu in inventory.gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 5090"]
    assert inventory.reason == "2 NVIDIA GPUs found (NVIDIA GeForce RTX 4090, NVIDIA GeForce RTX 5090)"


def test_unsupported_calls_leave_their_fields_none_and_keep_the_rest():
    quiet_card = dataclasses.replace(
        RTX4090,
        unsupported=frozenset({"fan_speed", "temperature", "clock_event_reasons", "pcie_link_gen", "power_usage_mw"}),
    )
    inventory = detect(nvml=FakeNvml([RTX4090, quiet_card]))

    gpu = inventory.gpus[1]
    assert (gpu.fan_percent, gpu.temperature_c, gpu.clock_event_reasons, gpu.power_draw_w) == (None, None, None, None)
    assert (gpu.pcie_gen, gpu.pcie_gen_max) == (None, None)
    assert (gpu.pcie_width, gpu.pcie_width_max) == (16, 16)
    assert gpu.name == "NVIDIA GeForce RTX 4090" and gpu.memory_total_bytes == 24564 * MIB
    assert gpu.power_limit_w == 450.0
    assert gpu.describe() == "GPU1 NVIDIA GeForce RTX 4090 24.0 GiB cc 8.9 PCIe ? x16 (max ? x16)"
    assert inventory.gpus[0].temperature_c == 41
    assert inventory.warnings == (), "NotSupported is a normal answer, not a warning"


def test_other_nvml_errors_on_a_field_are_tolerated_and_named_in_warnings():
    failing = dataclasses.replace(RTX4090, broken=frozenset({"utilization"}))
    inventory = detect(nvml=FakeNvml([failing]))

    gpu = inventory.gpus[0]
    assert (gpu.gpu_util_percent, gpu.memory_util_percent) == (None, None)
    assert gpu.temperature_c == 41
    assert inventory.warnings == ("GPU0 utilization: GPU is lost",)


def test_a_gpu_that_cannot_be_opened_is_left_out_and_named():
    lost = dataclasses.replace(RTX4090, broken=frozenset({"handle"}))
    inventory = detect(nvml=FakeNvml([RTX4090, lost, RTX4090]))

    assert inventory.available
    assert [gpu.index for gpu in inventory.gpus] == [0, 2]
    assert inventory.warnings == ("GPU1 left out: NVML cannot open it (GPU is lost)",)
    assert inventory.p2p_status == ((None, "not_supported"), ("not_supported", None))


def test_no_gpu_that_can_be_opened_means_cpu_mode():
    lost = dataclasses.replace(RTX4090, broken=frozenset({"handle"}))
    inventory = detect(nvml=FakeNvml([lost]))

    assert inventory.cpu_mode
    assert inventory.reason == "NVML lists 1 GPU(s) but none could be opened: running in CPU mode"


def test_memory_falls_back_to_v1_on_a_driver_without_the_v2_call():
    inventory = detect(nvml=FakeNvml([RTX4090], missing_functions=frozenset({"memory_info_v2"})))

    gpu = inventory.gpus[0]
    assert gpu.memory_total_bytes == 24564 * MIB
    assert gpu.memory_reserved_bytes is None
    assert gpu.memory_used_bytes == (330 + 1) * MIB, "v1 counts the driver's reservation as used"
    assert inventory.warnings == ()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            pynvml.NVMLError_LibraryNotFound,
            "no NVIDIA driver found (libnvidia-ml.so not loadable): running in CPU mode",
        ),
        (
            pynvml.NVMLError_DriverNotLoaded,
            "NVIDIA driver not loaded (is the nvidia kernel module installed and loaded?): running in CPU mode",
        ),
        (
            pynvml.NVMLError_NoPermission,
            "no permission to open the NVIDIA devices (check /dev/nvidia* access): running in CPU mode",
        ),
        (
            pynvml.NVMLError_LibRmVersionMismatch,
            "NVIDIA driver and library versions differ (reboot after a driver update): running in CPU mode",
        ),
        (pynvml.NVMLError_Unknown, "NVML failed to start (Unknown Error): running in CPU mode"),
    ],
)
def test_nvml_failing_to_start_is_cpu_mode_with_a_plain_reason(error, reason):
    nvml = FakeNvml.from_spec("4xRTX4090", p2p_ok=True)
    nvml.init_error = error
    inventory = detect(nvml=nvml)

    assert inventory.cpu_mode and not inventory.available
    assert inventory.reason == reason
    assert inventory.gpus == ()
    assert inventory.summary() == reason
    assert nvml.shutdown_calls == 0, "nothing to shut down after a failed init"


def test_a_driver_without_gpus_is_cpu_mode():
    nvml = FakeNvml([])
    inventory = detect(nvml=nvml)

    assert inventory.cpu_mode
    assert inventory.reason == "NVIDIA driver found but no GPU: running in CPU mode"
    assert inventory.driver_version == "570.133.07"
    assert nvml.shutdown_calls == 1


def test_an_unexpected_exception_from_the_backend_is_cpu_mode_not_a_crash():
    class Quirky(FakeNvml):
        def device_count(self) -> int:
            raise RuntimeError("driver returned garbage")

    nvml = Quirky([RTX4090])
    inventory = detect(nvml=nvml)

    assert inventory.cpu_mode
    assert inventory.reason == "GPU detection failed (RuntimeError: driver returned garbage): running in CPU mode"
    assert nvml.shutdown_calls == 1


def test_real_detection_on_this_machine_matches_whether_it_has_a_driver():
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        has_driver = True
    except OSError:
        has_driver = False

    inventory = detect()

    if not has_driver:
        assert inventory.cpu_mode
        assert inventory.reason == "no NVIDIA driver found (libnvidia-ml.so not loadable): running in CPU mode"
    else:  # a GPU machine: real devices, or CPU mode with the reason the driver gave
        assert inventory.gpus or (inventory.cpu_mode and inventory.reason)


async def test_detection_runs_in_a_worker_thread_from_trio():
    inventory = await trio.to_thread.run_sync(functools.partial(detect, nvml=FakeNvml.from_spec("2xRTX4090")))

    assert len(inventory.gpus) == 2


def test_a_pcie_downgrade_is_visible():
    riser = dataclasses.replace(RTX4090, pcie_gen=1, pcie_width=4)
    inventory = detect(nvml=FakeNvml([riser]))

    gpu = inventory.gpus[0]
    assert gpu.pcie_downgraded is True
    assert "PCIe 1.0 x4 (max 4.0 x16)" in gpu.describe()


def test_pcie_downgrade_is_unknown_without_link_data():
    assert GpuInfo(index=0).pcie_downgraded is None
    assert GpuInfo(index=0).describe() == "GPU0 unknown GPU ? GiB cc ?"


def test_throttle_reasons_are_decoded_and_shown_when_they_hold_clocks():
    hot = dataclasses.replace(
        RTX4090,
        clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    )
    gpu = detect(nvml=FakeNvml([hot])).gpus[0]

    assert gpu.clock_event_reasons == ("sw_power_cap", "hw_thermal")
    assert gpu.describe().endswith("41 °C clocks held by sw_power_cap,hw_thermal")


def test_unknown_throttle_bits_are_kept_as_hex():
    assert decode_clock_event_reasons(0) == ()
    assert decode_clock_event_reasons(0x1 | 0x800 | 0x10000) == ("gpu_idle", "0x800", "0x10000")


@pytest.mark.parametrize(("encoded", "text"), [(12080, "12.8"), (12020, "12.2"), (13000, "13.0"), (11080, "11.8")])
def test_cuda_driver_versions_read_as_text(encoded, text):
    assert cuda_version_text(encoded) == text


def test_p2p_is_queried_with_the_read_capability_as_a_plain_int():
    # pynvml spells the constant with a trailing comma, making it a tuple ctypes rejects.
    assert P2P_CAPS_INDEX_READ == 0 and isinstance(P2P_CAPS_INDEX_READ, int)
