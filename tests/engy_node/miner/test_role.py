"""`engy-node --role miner` as an operator runs it: decisions, plan preview, CPU mode end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest
import trio

from engy_node import proof
from engy_node.config import load_config
from engy_node.errors import ConfigError
from engy_node.hardware.fake_nvml import FakeNvml
from engy_node.hardware.gpu import detect
from engy_node.miner.role import MinerError, decide, with_capture_weights_root
from engy_node.models import SMOLLM2_135M, model_root
from engy_node.protocol.gemm import FEATURE_GEMM
from engy_node.protocol.miner import FEATURE_SEEDED, OUR_FEATURES, Message, ServeRequest
from engy_node.testing.gateway import GatewayHarness


@pytest.fixture
def qwen_checkpoint(tmp_path):
    """Qwen3.6's config.json with a sparse 35.1 GB shard: enough to plan, nothing to load."""
    from pathlib import Path

    directory = tmp_path / "qwen"
    directory.mkdir()
    fixture = Path(__file__).parents[2] / "fixtures" / "qwen3.6-35b-a3b-fp8" / "config.json"
    (directory / "config.json").write_bytes(fixture.read_bytes())
    with (directory / "model.safetensors").open("wb") as shard:
        shard.truncate(35_100_000_000)
    return directory


def miner_config(tmp_path, **miner):
    return load_config(home=tmp_path / "home", env={}, overrides={"miner": miner})


def test_cpu_mode_plans_the_reference_server_on_the_embedded_model(tmp_path, checkpoint):
    setup = decide(miner_config(tmp_path), detect())
    assert setup.inventory.cpu_mode
    assert setup.plan.server == "reference" and setup.launch.kind == "reference"
    assert "serve" in setup.launch.argv and "--max-running-requests" in setup.launch.argv
    assert setup.max_inflight == setup.plan.max_inflight


def test_a_simulated_cheat_is_handed_to_the_reference_server_it_launches(tmp_path, checkpoint):
    setup = decide(miner_config(tmp_path, simulate_cheat="noise-1%"), detect())
    assert setup.launch.argv[-2:] == ("--simulate-cheat", "noise-1%")
    assert "--simulate-cheat" not in decide(miner_config(tmp_path), detect()).launch.argv


def test_a_simulated_cheat_is_refused_where_no_reference_server_is_launched(tmp_path, checkpoint, qwen_checkpoint):
    with pytest.raises(MinerError, match="start that server with --simulate-cheat"):
        decide(miner_config(tmp_path, simulate_cheat="noise-1%", serve_urls="http://127.0.0.1:8000"), detect())
    config = miner_config(tmp_path, model="qwen3.6-35b-a3b", checkpoint=str(qwen_checkpoint), simulate_cheat="noise-1%")
    with pytest.raises(MinerError, match="only the reference server simulates a cheat"):
        decide(config, detect(nvml=FakeNvml.from_spec("4xRTX4090")))


def test_an_unknown_simulated_cheat_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"miner.simulate_cheat = 'noise'.*noise-1%.*quantised-4bit"):
        miner_config(tmp_path, simulate_cheat="noise")


def test_four_4090s_get_the_published_sglang_command(tmp_path, qwen_checkpoint):
    config = miner_config(tmp_path, model="qwen3.6-35b-a3b", checkpoint=str(qwen_checkpoint), serve_port=8000)
    setup = decide(config, detect(nvml=FakeNvml.from_spec("4xRTX4090")))
    argv = " ".join(setup.launch.argv)
    assert (
        "-m sglang.launch_server --model-path "
        + str(qwen_checkpoint)
        + " --served-model-name qwen3.6-35b-a3b --tp-size 4 "
        "--trust-remote-code --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.83 --chunked-prefill-size 8192 "
        "--max-running-requests 8 --context-length 262144 --enable-return-hidden-states --enable-cache-report "
        "--enable-metrics --enable-deterministic-inference --host 127.0.0.1 --port 8000 --disable-custom-all-reduce"
    ) in argv
    assert dict(setup.launch.env)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert setup.max_inflight == 8


def test_a_model_that_does_not_fit_is_refused_with_the_reason(tmp_path, qwen_checkpoint):
    config = miner_config(tmp_path, model="qwen3.6-35b-a3b", checkpoint=str(qwen_checkpoint))
    with pytest.raises(MinerError, match="need at least 2 GPUs"):
        decide(config, detect(nvml=FakeNvml.from_spec("1xRTX4090")))


def test_a_gpu_model_without_a_checkpoint_names_the_flag(tmp_path):
    with pytest.raises(MinerError, match="--checkpoint DIR"):
        decide(miner_config(tmp_path, model="qwen3.6-35b-a3b"), detect())


def test_an_already_running_server_is_used_instead_of_launching_one(tmp_path, checkpoint):
    setup = decide(
        miner_config(tmp_path, serve_urls="http://127.0.0.1:8000/, http://127.0.0.1:8001", max_inflight=12), detect()
    )
    assert setup.launch is None and setup.plan is None
    assert setup.serve_urls == ("http://127.0.0.1:8000", "http://127.0.0.1:8001") and setup.max_inflight == 12


def test_gemm_capture_arms_the_sglang_server_on_one_gpu_with_the_flags_it_needs(tmp_path, checkpoint):
    setup = decide(miner_config(tmp_path, gemm_capture=True), detect(nvml=FakeNvml.from_spec("1xRTX4090")))
    assert setup.launch.kind == "sglang" and setup.launch.argv[-2:] == ("--disable-cuda-graph", "--disable-radix-cache")
    (capture_url,) = setup.capture_urls
    env = dict(setup.launch.env)
    assert capture_url == f"http://127.0.0.1:{env['ENGY_GEMM_CAPTURE_PORT']}"
    assert env["PYTHONPATH"].endswith("capture_site")
    assert f"GEMM capture: {capture_url}" in setup.describe()
    armed = with_capture_weights_root(setup, "ab" * 32)
    assert dict(armed.launch.env)["ENGY_GEMM_WEIGHTS_ROOT"] == "ab" * 32 and armed.launch.argv == setup.launch.argv
    plain = decide(miner_config(tmp_path), detect(nvml=FakeNvml.from_spec("1xRTX4090")))
    assert plain.capture_urls == () and "ENGY_GEMM_CAPTURE_PORT" not in dict(plain.launch.env)
    assert with_capture_weights_root(plain, "ab" * 32) == plain
    on_cpu = decide(miner_config(tmp_path, gemm_capture=True), detect())
    assert on_cpu.launch.kind == "reference" and on_cpu.capture_urls == (), "the reference server commits itself"


def test_gemm_capture_is_refused_for_a_plan_over_several_gpus_or_a_model_it_cannot_hook(
    tmp_path, checkpoint, qwen_checkpoint
):
    with pytest.raises(MinerError, match=r"dp 2.*capture port of its own.*miner.gemm_capture_urls"):
        decide(miner_config(tmp_path, gemm_capture=True), detect(nvml=FakeNvml.from_spec("2xRTX4090")))
    config = miner_config(tmp_path, model="qwen3.6-35b-a3b", checkpoint=str(qwen_checkpoint), gemm_capture=True)
    with pytest.raises(MinerError, match=r"qwen3.6-35b-a3b is a Qwen3_5MoeForConditionalGeneration: unset"):
        decide(config, detect(nvml=FakeNvml.from_spec("4xRTX4090")))


def test_capture_ports_of_servers_the_operator_runs_pair_with_them_in_order(tmp_path, checkpoint):
    urls = "http://127.0.0.1:8000, http://127.0.0.1:8001"
    setup = decide(miner_config(tmp_path, serve_urls=urls, gemm_capture_urls="http://127.0.0.1:9000/,"), detect())
    assert setup.capture_urls == ("http://127.0.0.1:9000", "")
    assert decide(miner_config(tmp_path, serve_urls=urls), detect()).capture_urls == ()
    with pytest.raises(MinerError, match="names 1 capture port.*for 2 model server"):
        decide(miner_config(tmp_path, serve_urls=urls, gemm_capture_urls="http://127.0.0.1:9000"), detect())
    with pytest.raises(MinerError, match="name its ports in miner.gemm_capture_urls"):
        decide(miner_config(tmp_path, serve_urls=urls, gemm_capture=True), detect())
    with pytest.raises(MinerError, match="set miner.gemm_capture = true"):
        decide(miner_config(tmp_path, gemm_capture_urls="http://127.0.0.1:9000"), detect())


def test_fake_gpus_print_the_plan_and_command_and_launch_nothing(tmp_path, qwen_checkpoint):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engy_node",
            "--home",
            str(tmp_path / "h"),
            "--role",
            "miner",
            "--fake-gpus",
            "4xRTX4090",
            "--model",
            "qwen3.6-35b-a3b",
            "--checkpoint",
            str(qwen_checkpoint),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "plan: tp 4 × dp 1" in result.stdout
    assert "command: " in result.stdout and "-m sglang.launch_server" in result.stdout
    assert "nothing was launched" in result.stdout


def test_the_public_miners_environment_is_accepted(tmp_path, qwen_checkpoint):
    env = {**os.environ, "MODEL": "qwen3.6-35b-a3b", "MAX_INFLIGHT": "6", "GW": "wss://gw.example/gw"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engy_node",
            "--home",
            str(tmp_path / "h"),
            "--role",
            "miner",
            "--fake-gpus",
            "2xRTX5090",
            "--checkpoint",
            str(qwen_checkpoint),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "model: qwen3.6-35b-a3b" in result.stdout and "max in flight: 6" in result.stdout
    assert "--tp-size 2" in result.stdout and "--attention-backend triton" in result.stdout


async def test_cpu_mode_miner_serves_the_gateway_with_verifiable_proofs_and_stops_cleanly(
    nursery, tmp_path, checkpoint, runner
):
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    log_path = tmp_path / "miner.log"
    env = {**os.environ, "MINER_KEY": "mk-cpu", "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        miner = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "engy_node",
                "--home",
                str(tmp_path / "home"),
                "--role",
                "miner",
                "--gateway",
                harness.url,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        await harness.wait_for(lambda: 0 in harness.legs, timeout=120)
        hello = harness.legs[0].hello
        assert hello.miner_key == "mk-cpu" and hello.model == "smollm2-135m" and hello.hw["gpu_count"] == 0
        assert hello.model_root == model_root(checkpoint)
        assert hello.features == OUR_FEATURES | {FEATURE_SEEDED, FEATURE_GEMM}, (
            "a server the miner launched samples deterministically, and the reference server commits its activations"
        )
        request = ServeRequest(
            messages=(Message("user", "What is the capital of France?"),),
            max_tokens=32,
            engy_request_id=uuid.uuid4().hex,
        )
        record = await harness.result(await harness.serve(request, stream=True))
        assert record.response.error is None, record.response.error
        commitment = proof.Commitment.from_wire(record.response.commitment)
        ids = runner.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        verdict = proof.verify_commitment(
            commitment,
            model=SMOLLM2_135M,
            canonical_root=model_root(checkpoint),
            expected_prompt_ids=ids,
            recompute=runner.prefill,
            greedy=True,
        )
        assert verdict.kind == "pass", verdict
        children = psutil.Process(miner.pid).children(recursive=True)
        assert children, "the miner supervises a reference server child"
    finally:
        miner.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            code = await miner.wait()
    text = log_path.read_text()
    assert code == 0, text
    assert "CPU mode" in text
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], (
        "no orphaned model server"
    )
