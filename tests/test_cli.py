"""`engy-node` as a user types it: exit codes and messages that name the fix."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from engy_node import __version__


def engy_node(*args: str, home=None) -> subprocess.CompletedProcess[str]:
    prefix = ["--home", str(home)] if home else []
    return subprocess.run(
        [sys.executable, "-m", "engy_node", *prefix, *args], capture_output=True, text=True, timeout=120
    )


def test_version_prints_the_package_version():
    result = engy_node("--version")
    assert result.returncode == 0 and __version__ in result.stdout


def test_no_command_prints_help_and_exits_2():
    result = engy_node()
    assert result.returncode == 2 and "usage: engy-node" in result.stderr


def test_a_validator_without_a_hotkey_names_the_flags_before_starting_anything(tmp_path):
    result = engy_node("--role", "validator", home=tmp_path)
    assert result.returncode == 2
    assert "--validator-wallet" in result.stderr and "roles validator" not in result.stderr


def test_a_validator_on_an_unknown_network_lists_the_known_ones(tmp_path):
    result = engy_node(
        "--role",
        "validator",
        "--network",
        "mainnet",
        "--validator-wallet",
        "v",
        "--validator-hotkey",
        "h",
        home=tmp_path,
    )
    assert result.returncode == 2 and "unknown chain network 'mainnet'" in result.stderr and "finney" in result.stderr


def test_health_without_a_validator_heartbeat_exits_1(tmp_path):
    result = engy_node("health", home=tmp_path)
    assert result.returncode == 1 and "no heartbeat" in result.stdout


def test_health_of_a_ticking_validator_that_never_set_weights_exits_3(tmp_path):
    from engy_node.validator.liveness import write_heartbeat

    now = time.time()
    started = now - 5000 * 12.0 - 60
    write_heartbeat(
        tmp_path / "data" / "validator" / "heartbeat.json",
        now=now,
        detail={"outcome": "chain-failed", "started": started},
    )
    result = engy_node("health", home=tmp_path)
    assert result.returncode == 3 and result.stdout.startswith("no weights set:")
    assert "validator.network" in result.stdout


def test_a_miner_without_a_gateway_names_the_setting_before_starting_anything(tmp_path):
    result = engy_node("--role", "miner", home=tmp_path)
    assert result.returncode == 2
    assert "no gateway: set GW" in result.stderr and "roles miner" not in result.stderr


def test_a_miner_without_a_key_or_hotkey_says_how_to_identify(tmp_path):
    result = engy_node("--role", "miner", "--gateway", "wss://gw.example/gw", home=tmp_path)
    assert result.returncode == 2 and "MINER_KEY" in result.stderr and "--wallet" in result.stderr


def test_a_gateway_url_that_is_not_a_websocket_is_refused(tmp_path):
    result = engy_node("--role", "miner", "--gateway", "https://gw.example/gw", home=tmp_path)
    assert result.returncode == 2 and "ws:// or wss://" in result.stderr


def test_an_unknown_role_lists_the_known_ones():
    result = engy_node("--role", "minr")
    assert (
        result.returncode == 2
        and "unknown role 'minr'" in result.stderr
        and "miner, validator, gateway" in result.stderr
    )


def test_serving_an_unknown_model_names_the_catalog(tmp_path):
    result = engy_node("serve", "--model", "gpt-99", "--port", "0", home=tmp_path)
    assert result.returncode == 2 and "unknown model 'gpt-99'" in result.stderr and "smollm2-135m" in result.stderr


def test_serving_a_non_embedded_model_without_a_checkpoint_says_how(tmp_path):
    result = engy_node("serve", "--model", "qwen3.6-35b-a3b", "--port", "0", home=tmp_path)
    assert result.returncode == 2 and "--checkpoint DIR" in result.stderr


def test_a_bad_config_file_is_reported_with_its_path(tmp_path):
    (tmp_path / "node.toml").write_text("[serve]\nprot = 1\n")
    result = engy_node("serve", home=tmp_path)
    assert result.returncode == 2 and "node.toml" in result.stderr and "did you mean 'port'" in result.stderr


def test_models_lists_the_catalog():
    result = engy_node("models")
    assert result.returncode == 0
    assert {line.split()[0] for line in result.stdout.splitlines()} == {"smollm2-135m", "qwen3.6-35b-a3b", "glm-5.2"}


def test_checkpoint_prints_the_embedded_models_path_and_root(checkpoint, tmp_path):
    from engy_node.models import model_root

    result = engy_node("checkpoint", home=tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["model_root"] == model_root(checkpoint)
    assert info["checkpoint"].startswith(str(tmp_path))


def test_a_gateway_port_in_use_is_reported_with_the_flag_to_change(tmp_path, checkpoint):
    import os
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "--role", "gateway"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "ENGY_GATEWAY__PORT": str(port), "ENGY_GATEWAY__MINER_PORT": "0"},
        )
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "--port" in result.stderr


def test_a_verifier_without_a_provider_or_a_hotkey_names_the_flags(tmp_path):
    result = engy_node("--role", "verifier", home=tmp_path)
    assert result.returncode == 2 and "--provider http://" in result.stderr
    result = engy_node("--role", "verifier", "--provider", "http://127.0.0.1:9", home=tmp_path)
    assert result.returncode == 2 and "--verifier-wallet and --verifier-hotkey" in result.stderr
