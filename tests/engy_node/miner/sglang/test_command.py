"""The model-server command builders: the sglang command in the published reference form, flag
for flag, the reference server's command, the arguments they refuse, and the shell text a user
pastes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.miner.sglang.command import LaunchSpec, reference_launch, sglang_launch, shell_command

QWEN_PATH = "/data/models/Qwen/Qwen3.6-35B-A3B-FP8"

# The published reference command (docs/architecture.md), as one string, with deterministic inference on
# (issue 9: seeded sampled answers are verified by replaying the draw).
PUBLISHED = (
    f"python -m sglang.launch_server --model-path {QWEN_PATH} --served-model-name Qwen3.6 --tp-size 4 "
    "--trust-remote-code --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.83 --chunked-prefill-size 8192 "
    "--max-running-requests 8 --context-length 262144 --enable-return-hidden-states --enable-cache-report "
    "--enable-metrics --enable-deterministic-inference --host 127.0.0.1 --port 8000"
)
PUBLISHED_PLAN = dict(
    python="python",
    checkpoint=QWEN_PATH,
    served_model_name="Qwen3.6",
    tp=4,
    kv_cache_dtype="fp8_e4m3",
    mem_fraction_static=0.83,
    chunked_prefill_size=8192,
    max_running_requests=8,
    context_length=262144,
    host="127.0.0.1",
    port=8000,
)


# ---- command builders ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({}, PUBLISHED, id="published-4x4090"),
        pytest.param(
            {"tp": 2, "dp": 2}, PUBLISHED.replace("--tp-size 4", "--tp-size 2 --dp-size 2"), id="dp-follows-tp"
        ),
        pytest.param({"dp": 1}, PUBLISHED, id="dp-1-adds-no-flag"),
        pytest.param(
            {"tp": 2, "extra_flags": ("--disable-custom-all-reduce", "--attention-backend", "triton")},
            PUBLISHED.replace("--tp-size 4", "--tp-size 2") + " --disable-custom-all-reduce --attention-backend triton",
            id="extra-flags-come-last",
        ),
        pytest.param(
            {
                "tp": 1,
                "kv_cache_dtype": None,
                "mem_fraction_static": None,
                "chunked_prefill_size": None,
                "max_running_requests": None,
                "context_length": None,
            },
            f"python -m sglang.launch_server --model-path {QWEN_PATH} --served-model-name Qwen3.6 --tp-size 1 "
            "--trust-remote-code --enable-return-hidden-states --enable-cache-report --enable-metrics "
            "--enable-deterministic-inference --host 127.0.0.1 --port 8000",
            id="unset-values-leave-sglang-defaults",
        ),
        pytest.param({"chunked_prefill_size": -1}, PUBLISHED.replace("8192", "-1"), id="chunked-prefill-off"),
        pytest.param(
            {"mem_fraction_static": 0.8333333}, PUBLISHED.replace("0.83", "0.8333333"), id="fraction-kept-exact"
        ),
    ],
)
def test_the_sglang_command_is_the_published_reference_form_flag_for_flag(changes, expected):
    spec = sglang_launch(**{**PUBLISHED_PLAN, **changes})
    assert spec.argv == tuple(expected.split(" "))
    assert spec.kind == "sglang"
    assert spec.base_url == "http://127.0.0.1:8000"
    assert spec.health_path == "/health"
    # /health must not run a generation per liveness probe (sglang #35884).
    assert spec.env == (("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0"),)


@pytest.mark.parametrize(
    ("host", "base_url"),
    [("0.0.0.0", "http://127.0.0.1:8000"), ("::", "http://[::1]:8000"), ("10.0.0.5", "http://10.0.0.5:8000")],
)
def test_a_server_bound_to_every_interface_is_probed_over_loopback(host, base_url):
    assert sglang_launch(**{**PUBLISHED_PLAN, "host": host}).base_url == base_url


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"tp": 0}, "tp"),
        ({"dp": 0}, "dp"),
        ({"mem_fraction_static": 1.0}, "mem_fraction_static"),
        ({"mem_fraction_static": 0.0}, "mem_fraction_static"),
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"extra_flags": ("--port", "9000")}, "--port"),
        ({"extra_flags": ("--tp-size=2",)}, "--tp-size"),
    ],
)
def test_a_wrong_plan_value_is_refused_naming_the_argument(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sglang_launch(**{**PUBLISHED_PLAN, **changes})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param(
            dict(
                python="/venv/bin/python",
                home="/tmp/h",
                model="smollm2-135m",
                checkpoint="/ckpt",
                host="127.0.0.1",
                port=30001,
                dtype="bfloat16",
                device="cpu",
                max_running_requests=4,
            ),
            "/venv/bin/python -m engy_node --home /tmp/h serve --model smollm2-135m --checkpoint /ckpt "
            "--host 127.0.0.1 --port 30001 --dtype bfloat16 --device cpu --max-running-requests 4",
            id="everything-set",
        ),
        pytest.param(
            dict(python="python3", home=Path("/tmp/h"), model="smollm2-135m", port=30000),
            "python3 -m engy_node --home /tmp/h serve --model smollm2-135m --host 127.0.0.1 --port 30000",
            id="defaults-left-to-the-server-config",
        ),
        pytest.param(
            dict(python="python3", home="/tmp/h", model="smollm2-135m", port=30000, simulate_cheat="noise-1%"),
            "python3 -m engy_node --home /tmp/h serve --model smollm2-135m --host 127.0.0.1 --port 30000 "
            "--simulate-cheat noise-1%",
            id="a-simulated-cheat",
        ),
    ],
)
def test_the_reference_command_runs_engy_node_serve(kwargs, expected):
    spec = reference_launch(**kwargs)
    assert spec.argv == tuple(expected.split(" "))
    assert (spec.kind, spec.env, spec.health_path) == ("reference", (), "/health")
    assert spec.base_url == f"http://127.0.0.1:{kwargs['port']}"


def test_an_empty_simulated_cheat_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="simulate_cheat"):
        reference_launch(python="python3", home="/tmp/h", model="smollm2-135m", port=30000, simulate_cheat="")


def test_the_shell_text_of_the_published_command_is_ready_to_paste():
    assert shell_command(sglang_launch(**PUBLISHED_PLAN)) == f"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 {PUBLISHED}"


@given(
    words=st.lists(st.text(st.characters(exclude_characters="\x00"), min_size=0, max_size=12), min_size=1, max_size=6),
    value=st.text(st.characters(exclude_characters="\x00"), max_size=12),
)
def test_the_shell_text_splits_back_into_the_exact_environment_and_argv(words, value):
    spec = LaunchSpec(kind="sglang", argv=tuple(words), env=(("A_VAR", value), ("B", "x y")), base_url="http://h:1")
    assert shlex.split(shell_command(spec)) == [f"A_VAR={value}", "B=x y", *words]


def test_a_checkpoint_path_with_spaces_and_quotes_survives_the_shell_round_trip():
    spec = sglang_launch(**{**PUBLISHED_PLAN, "checkpoint": '/models/it\'s a "model" $HOME'})
    assert shlex.split(shell_command(spec))[1:] == list(spec.argv)


def test_the_gemm_capture_puts_its_shim_on_the_path_and_turns_off_what_it_cannot_see():
    spec = sglang_launch(**PUBLISHED_PLAN, gemm_capture_port=8101)
    assert shlex.join(spec.argv).startswith(PUBLISHED + " --disable-cuda-graph --disable-radix-cache")
    env = dict(spec.env)
    assert env["ENGY_GEMM_CAPTURE_PORT"] == "8101"
    assert (Path(env["PYTHONPATH"]) / "sitecustomize.py").is_file()
    assert "PYTHONPATH" not in dict(sglang_launch(**PUBLISHED_PLAN).env)
    with pytest.raises(ValueError, match="--disable-cuda-graph"):
        sglang_launch(**PUBLISHED_PLAN, gemm_capture_port=8101, extra_flags=["--disable-cuda-graph"])
    with pytest.raises(ValueError, match="port"):
        sglang_launch(**PUBLISHED_PLAN, gemm_capture_port=0)
