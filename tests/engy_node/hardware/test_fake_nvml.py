"""The fake NVML behaves like the real library at the interface `gpu.detect` uses: the same
calls with the same signatures, the same error classes, and the spec strings `--fake-gpus`
accepts. What detection makes of the fake's devices is tested in `miner/test_gpu.py`."""

from __future__ import annotations

import dataclasses
import inspect

import pynvml
import pytest

from engy_node.errors import ConfigError
from engy_node.hardware.fake_nvml import FAKE_GPU_MODELS, FakeNvml, parse_fake_gpu_spec
from engy_node.hardware.gpu import NvmlApi, Pynvml

NVML_CALLS = sorted(name for name, value in vars(NvmlApi).items() if callable(value) and not name.startswith("_"))


def test_the_interface_lists_the_calls_detection_makes():
    assert {"init", "shutdown", "device_count", "handle", "memory_info_v2", "p2p_read_status"} <= set(NVML_CALLS)


@pytest.mark.parametrize("call", NVML_CALLS)
def test_the_fake_and_the_real_library_answer_every_call_with_the_interfaces_signature(call):
    expected = inspect.signature(getattr(NvmlApi, call))
    assert inspect.signature(getattr(FakeNvml, call)) == expected
    assert inspect.signature(getattr(Pynvml, call)) == expected


def test_the_fake_refuses_calls_before_init_like_nvml():
    nvml = FakeNvml.from_spec("RTX4090")

    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.device_count()


@pytest.mark.parametrize(
    ("nvml", "error"),
    [
        (
            FakeNvml([dataclasses.replace(FAKE_GPU_MODELS["RTX4090"], unsupported=frozenset({"fan_speed"}))]),
            pynvml.NVMLError_NotSupported,
        ),
        (
            FakeNvml([dataclasses.replace(FAKE_GPU_MODELS["RTX4090"], broken=frozenset({"fan_speed"}))]),
            pynvml.NVMLError_GpuIsLost,
        ),
        (
            FakeNvml([FAKE_GPU_MODELS["RTX4090"]], missing_functions=frozenset({"fan_speed"})),
            pynvml.NVMLError_FunctionNotFound,
        ),
    ],
    ids=["unsupported", "broken", "missing function"],
)
def test_the_fake_fails_with_nvmls_own_error_classes(nvml, error):
    nvml.init()
    with pytest.raises(error):
        nvml.fan_speed(nvml.handle(0))
    assert nvml.temperature(nvml.handle(0)) == 41, "other calls on the same GPU still answer"


def test_a_handle_for_a_gpu_that_is_not_there_is_an_invalid_argument_like_nvml():
    nvml = FakeNvml.from_spec("2xRTX4090")
    nvml.init()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.handle(2)


@pytest.mark.parametrize(
    ("spec", "models"),
    [
        ("4xRTX4090", ["RTX4090"] * 4),
        ("2xRTX5090", ["RTX5090"] * 2),
        ("RTX4090,RTX5090", ["RTX4090", "RTX5090"]),
        ("1x rtx4090, 2 × RTX5090", ["RTX4090", "RTX5090", "RTX5090"]),
        ("RTX4090", ["RTX4090"]),
    ],
)
def test_fake_gpu_specs_parse(spec, models):
    assert [gpu.model for gpu in parse_fake_gpu_spec(spec)] == models


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "at ''"),
        ("4xGTX1080", "unknown GPU model 'GTX1080'"),
        ("4RTX4090", "unknown GPU model '4RTX4090'"),
        ("0xRTX4090", "asks for 0 GPUs"),
        ("RTX4090,", "at ''"),
        ("4x RTX 4090", "at '4x RTX 4090'"),
        ("65xRTX4090", "asks for 65 GPUs; at most 64"),
    ],
)
def test_bad_fake_gpu_specs_name_the_problem_and_the_accepted_forms(spec, problem):
    with pytest.raises(ConfigError) as caught:
        parse_fake_gpu_spec(spec)

    message = str(caught.value)
    assert problem in message
    if "at most" not in problem:
        assert "accepted forms: '4xRTX4090', '2xRTX5090', 'RTX4090,RTX5090' (models: RTX4090, RTX5090)" in message
