"""`engy-node diagnose`: the pure helpers (masking, scrubbing, names, reports), then whole bundles
from a planted home: what they hold, that no planted secret or buyer file gets in, the 0600
mode, a running node's status, and the CLI."""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import platform
import stat
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pynvml
import pytest
import trio

from engy_node import __version__, cli
from engy_node.config import config_document, load_config
from engy_node.control import Actions, control_token, serve_control
from engy_node.diagnose import (
    MASK,
    NOT_INSTALLED,
    PACKAGES,
    DiagnoseError,
    Scrubber,
    build_manifest,
    bundle_stem,
    collect,
    gpu_document,
    is_secret_field,
    last_lines,
    mask_value,
    masked_config,
    model_server_report,
    secret_values,
    versions,
)
from engy_node.hardware.fake_nvml import FakeNvml
from engy_node.hardware.gpu import CPU_MODE, detect
from engy_node.hub import Hub

BUYER_KEY = "engy-sk-Qm9vYmFyQmF6UXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG1u"
MINER_KEY = "engy-mk-TWluZXJLZXlGb3JUZXN0c09ubHlfXzEyMzQ1Njc4OTBhYmNk"
WALLET_SEED = "0xwalletseedthatmustneverleave"
STORE_MARKER = "STORE-ROW-balance-of-alice"
NOW = dt.datetime(2026, 1, 5, 12, 30, 45, tzinfo=dt.UTC)
NO_NVML = FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound)


# ---- pure helpers ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["miner_key", "api_key", "control_token", "password", "db_secret", "MINER_KEY"])
def test_fields_named_for_a_secret_are_secret(name):
    assert is_secret_field(name)


@pytest.mark.parametrize(
    "name",
    [
        "wallet_hotkey",
        "master_hotkey",
        "keepalive_s",
        "chunk_tokens",
        "probe_max_tokens",
        "wallet_name",
        "wallets_path",
        "gateway_url",
    ],
)
def test_hotkeys_paths_and_token_counts_are_not_secret(name):
    assert not is_secret_field(name)


def test_a_mask_keeps_the_last_four_characters_only_of_a_long_value():
    assert mask_value("") == "(empty)" and mask_value(None) == "(empty)"
    assert mask_value(MINER_KEY) == MASK + MINER_KEY[-4:]
    assert mask_value("short-secret"[:8]) == MASK, "a short secret is hidden whole"


def test_the_config_is_masked_by_field_name_at_any_depth(tmp_path):
    config = load_config(home=tmp_path, env={}, overrides={"miner": {"miner_key": MINER_KEY, "wallet_hotkey": "hk1"}})
    document = config_document(config)
    masked = masked_config(document)
    assert masked["miner"]["miner_key"] == MASK + MINER_KEY[-4:]
    assert masked["miner"]["wallet_hotkey"] == "hk1" and masked["miner"]["chunk_tokens"] == 4096
    assert masked["paths"] == document["paths"]
    assert masked_config({"a": [{"api_key": ""}]}) == {"a": [{"api_key": "(empty)"}]}
    assert secret_values(document) == [MINER_KEY]


def test_the_scrubber_removes_keys_tokens_url_passwords_and_literal_secrets():
    scrubber = Scrubber(["s3cret-literal-value", "abc"])
    text = (
        f"buyer {BUYER_KEY}, miner={MINER_KEY}; Authorization: Bearer tok.en-123 "
        "wss://user:hunter22@gw.example/gw and s3cret-literal-value and abc"
    )
    scrubbed = scrubber.text(text)
    assert f"buyer engy-sk-{MASK}, miner=engy-mk-{MASK}" in scrubbed
    assert f"Bearer {MASK} " in scrubbed and f"wss://user:{MASK}@gw.example/gw" in scrubbed
    assert "s3cret-literal-value" not in scrubbed and scrubbed.endswith("and abc"), "too short to scrub as a literal"
    assert scrubber.data({BUYER_KEY: [f"x {BUYER_KEY}", 3, None]}) == {
        f"engy-sk-{MASK}": [f"x engy-sk-{MASK}", 3, None]
    }


def test_a_literal_secret_inside_another_is_removed_whole():
    assert Scrubber(["secret-one", "secret-one-and-more"]).text("[secret-one-and-more]") == f"[{MASK}]"


def test_the_bundle_name_carries_a_safe_host_and_the_utc_time():
    assert bundle_stem("rig-7.lan", NOW) == "engy-diagnose-rig-7.lan-20260105T123045Z"
    assert bundle_stem("we/ird host", NOW) == "engy-diagnose-we-ird-host-20260105T123045Z"
    assert bundle_stem("", NOW).startswith("engy-diagnose-host-")
    east = NOW.astimezone(dt.timezone(dt.timedelta(hours=9)))
    assert bundle_stem("h", east) == bundle_stem("h", NOW)


def test_last_lines_keeps_the_tail_and_tolerates_any_bytes():
    assert last_lines(b"a\nb\nc\n", 2) == ["b", "c"]
    assert last_lines(b"a\n\xff\n", 5) == ["a", "\ufffd"]
    assert last_lines(b"a\n", 0) == []


def test_versions_come_from_metadata_and_say_what_is_missing():
    def lookup(name):
        if name == "torch":
            return "2.9.0"
        raise metadata.PackageNotFoundError(name)

    document = versions("rig", lookup=lookup)
    assert document["engy_node"] == __version__ and document["host"] == "rig"
    assert document["packages"]["torch"] == "2.9.0"
    assert set(document["packages"]) == set(PACKAGES)
    assert document["packages"]["sglang"] == NOT_INSTALLED


def test_the_model_server_report_has_the_command_the_failure_and_the_output_tail():
    status = {
        "states": {
            "model_server": {
                "state": "ready",
                "kind": "sglang",
                "url": "http://127.0.0.1:3",
                "restarts": 1,
                "command": "python -m sglang.launch_server --tp 2",
                "last_failure": {"kind": "oom", "summary": "out of memory", "fix": "lower it"},
            },
            "gateway": {"state": "ready"},
        }
    }
    events = [{"component": "model_server", "level": "info", "message": f"line {i}"} for i in range(5)]
    events.append({"component": "gateway", "level": "info", "message": "not the model server"})
    report = model_server_report(status, events, lines=3)
    assert "command: python -m sglang.launch_server --tp 2" in report
    assert "last failure: oom: out of memory (fix: lower it)" in report
    assert "line 1" not in report and "info line 4" in report and "not the model server" not in report
    assert model_server_report({"states": {"gateway": {"state": "ready"}}}, events) is None


def test_the_manifest_lists_what_is_never_collected_and_why():
    manifest = build_manifest(
        created_at=NOW,
        data_dir=Path("/d"),
        config_file=Path("/n.toml"),
        files={"a.json": 3},
        skipped=[("node/", "no node")],
        errors=["x: y"],
    )
    whats = [entry["what"] for entry in manifest["skipped"]]
    assert "gateway store (SQLite)" in whats and "control.token" in whats and whats[-1] == "node/"
    assert manifest["files"] == [{"name": "a.json", "bytes": 3}] and manifest["errors"] == ["x: y"]
    assert manifest["created_at"] == "2026-01-05T12:30:45+00:00"


def test_gpu_facts_from_fake_gpus_are_json():
    document = json.loads(json.dumps(gpu_document(detect(nvml=FakeNvml.from_spec("2xRTX4090")))))
    assert document["available"] and not document["cpu_mode"]
    assert document["driver_version"] == "570.133.07" and document["cuda_driver_version"] == "12.8"
    assert [gpu["compute_capability"] for gpu in document["gpus"]] == [[8, 9], [8, 9]]
    assert document["gpus"][0]["describe"].startswith("GPU0 NVIDIA GeForce RTX 4090")
    assert document["p2p_status"] == [[None, "not_supported"], ["not_supported", None]]


# ---- a planted home --------------------------------------------------------------------------
def plant_home(home: Path) -> dict[str, str]:
    """A home with secrets everywhere a careless bundle would pick them up; returns them."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "node.toml").write_text(f'[miner]\nminer_key = "{MINER_KEY}"\nwallet_name = "rig-wallet"\n')
    data = home / "data"
    token = control_token(data)
    logs = data / "logs"
    logs.mkdir(parents=True)
    lines = [f"2026-01-05 12:00:{i % 60:02d} INFO    engy.gateway: request {i}" for i in range(3000)]
    lines += [
        f"INFO engy.local: buyer key {BUYER_KEY}",
        f"INFO engy.miner: hello with {MINER_KEY}",
        f"DEBUG engy.control: token {token} and Authorization: Bearer {token}",
        "INFO engy.node: the last line",
    ]
    (logs / "engy-node.log").write_text("\n".join(lines) + "\n")
    (logs / "engy-node-gateway-1.log").write_text(f"INFO [gateway-1] engy.gateway: key {BUYER_KEY}\n")
    (logs / "unrelated.txt").write_text(f"{BUYER_KEY}\n")
    server_logs = data / "model-server" / "data" / "logs"
    server_logs.mkdir(parents=True)
    (server_logs / "engy-node.log").write_text("INFO engy.serve: ready to roll!\n")
    local = data / "local"
    miner_logs = local / "miner-a" / "model-server" / "data" / "logs"
    miner_logs.mkdir(parents=True)
    (miner_logs / "engy-node.log").write_text(f"INFO engy.serve: miner-a's server; token {token}\n")
    (local / "network.json").write_text(json.dumps({"buyer_key": BUYER_KEY, "buyer_api": "http://127.0.0.1:8080/v1"}))
    (local / "buyer.json").write_text(json.dumps({"buyer_account": 1, "buyer_key": BUYER_KEY}))
    wallet = data / "wallets" / "engy-local" / "hotkeys"
    wallet.mkdir(parents=True)
    (wallet / "miner-a").write_text(json.dumps({"secretSeed": WALLET_SEED}))
    (data / "gateway.sqlite3").write_text(STORE_MARKER)
    return {
        "buyer key": BUYER_KEY,
        "miner key": MINER_KEY,
        "control token": token,
        "wallet seed": WALLET_SEED,
        "store row": STORE_MARKER,
    }


def extract(bundle: Path) -> dict[str, bytes]:
    """Every file in the bundle, by its path below the top folder (which must be the only one)."""
    with tarfile.open(bundle, "r:gz") as archive:
        members = archive.getmembers()
        tops = {member.name.split("/", 1)[0] for member in members}
        assert len(tops) == 1 and next(iter(tops)).startswith("engy-diagnose-")
        assert all(member.isfile() and member.mode == 0o600 for member in members)
        return {member.name.split("/", 1)[1]: archive.extractfile(member).read() for member in members}


def assert_no_secret(files: dict[str, bytes], secrets: dict[str, str]) -> None:
    for name, data in files.items():
        for what, secret in secrets.items():
            assert secret.encode() not in data, f"the {what} leaked into {name}"
    assert not any(
        Path(name).name in ("network.json", "buyer.json", "control.token", "node.toml", "gateway.sqlite3")
        for name in files
    )
    assert not any("wallets" in name for name in files)


def test_a_bundle_holds_versions_masked_config_gpus_logs_and_a_manifest_and_no_secret(tmp_path):
    secrets = plant_home(tmp_path / "home")
    config = load_config(home=tmp_path / "home", env={})
    bundle = collect(config, output=tmp_path / "out.tar.gz", log_lines=100, now=NOW, nvml=NO_NVML)

    assert bundle.path == tmp_path / "out.tar.gz"
    assert stat.S_IMODE(bundle.path.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file is left behind"
    files = extract(bundle.path)
    assert_no_secret(files, secrets)
    assert set(files) == {
        "versions.json",
        "config.json",
        "gpus.json",
        "logs/engy-node.log",
        "logs/engy-node-gateway-1.log",
        "logs/model-server/engy-node.log",
        "logs/local/miner-a/model-server/engy-node.log",
        "node/README.txt",
        "manifest.json",
    }
    assert json.loads(files["versions.json"])["engy_node"] == __version__
    config_json = json.loads(files["config.json"])
    assert config_json["miner"]["miner_key"] == MASK + MINER_KEY[-4:]
    assert config_json["miner"]["wallet_name"] == "rig-wallet"
    gpus = json.loads(files["gpus.json"])
    assert gpus["cpu_mode"] and gpus["reason"].endswith(CPU_MODE) and gpus["gpus"] == []

    node_log = files["logs/engy-node.log"].decode().splitlines()
    assert len(node_log) == 100 and node_log[-1] == "INFO engy.node: the last line"
    assert f"buyer key engy-sk-{MASK}" in node_log[-4] and f"Bearer {MASK}" in node_log[-2]
    assert files["logs/model-server/engy-node.log"] == b"INFO engy.serve: ready to roll!\n"
    assert b"no engy node" in files["node/README.txt"].lower()

    manifest = json.loads(files["manifest.json"])
    assert manifest["data_dir"] == str(config.paths.data_dir)
    assert {entry["name"] for entry in manifest["files"]} == set(files) - {"manifest.json"}
    assert "node/" in [entry["what"] for entry in manifest["skipped"]] and manifest["errors"] == []
    assert bundle.log_files == 4 and not bundle.node_running and bundle.errors == ()
    assert "CPU mode" in bundle.summary() and "4 log file(s)" in bundle.summary()


def test_gpus_on_this_machine_are_reported_as_detect_sees_them(tmp_path):
    bundle = collect(load_config(home=tmp_path, env={}), output=tmp_path, now=NOW)
    gpus = json.loads(extract(bundle.path)["gpus.json"])
    inventory = detect()
    assert gpus["available"] == inventory.available and len(gpus["gpus"]) == len(inventory.gpus)
    assert gpus["available"] or gpus["reason"].endswith(CPU_MODE)


def test_fake_gpus_reach_the_bundle(tmp_path):
    bundle = collect(load_config(home=tmp_path, env={}), output=tmp_path, now=NOW, nvml=FakeNvml.from_spec("RTX5090"))
    gpus = json.loads(extract(bundle.path)["gpus.json"])
    assert gpus["available"] and gpus["gpus"][0]["name"] == "NVIDIA GeForce RTX 5090"
    assert "1 GPU(s)" in bundle.summary()


def test_a_directory_as_output_gets_the_default_name(tmp_path):
    bundle = collect(load_config(home=tmp_path / "home", env={}), output=tmp_path, now=NOW, nvml=NO_NVML)
    assert bundle.path.parent == tmp_path
    assert bundle.path.name == bundle_stem(platform.node(), NOW) + ".tar.gz"
    assert "logs/" in [entry["what"] for entry in json.loads(extract(bundle.path)["manifest.json"])["skipped"]]


def test_an_output_path_that_cannot_be_written_names_the_flag(tmp_path):
    config = load_config(home=tmp_path, env={})
    with pytest.raises(DiagnoseError, match="--output"):
        collect(config, output=tmp_path / "no" / "such" / "dir" / "b.tar.gz", nvml=NO_NVML)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(DiagnoseError, match="--output"):
            collect(config, output=locked / "b.tar.gz", nvml=NO_NVML)


def test_a_control_record_left_by_a_dead_node_is_an_error_in_the_bundle_not_a_failure(tmp_path):
    data = tmp_path / "data"
    token = control_token(data)
    (data / "control.json").write_text(
        json.dumps({"url": "http://127.0.0.1:9", "token_file": str(data / "control.token")})
    )
    bundle = collect(load_config(home=tmp_path, env={}), output=tmp_path / "b.tar.gz", nvml=NO_NVML)
    files = extract(bundle.path)
    assert "no engy node answers at http://127.0.0.1:9" in files["errors.txt"].decode()
    assert "node/README.txt" in files and "node/status.json" not in files
    assert bundle.errors and "errors.txt" in bundle.summary()
    assert_no_secret(files, {"control token": token})


async def test_a_running_node_gives_its_status_metrics_events_and_model_server(nursery, tmp_path):
    secrets = plant_home(tmp_path)
    config = load_config(home=tmp_path, env={})
    hub = Hub(ring_size=100)
    hub.set_state(
        "model_server",
        state="ready",
        kind="reference",
        url="http://127.0.0.1:30001",
        command="python -m engy_node --home /h serve --model smollm2-135m",
        restarts=0,
    )
    hub.emit("info", "model_server", "ready to roll! (smollm2-135m on http://127.0.0.1:30001)")
    hub.emit("info", "gateway", f"created buyer key {BUYER_KEY}")
    hub.registry.gauge("engy_test_inflight", "requests in flight").set(3)
    await nursery.start(
        functools.partial(
            serve_control,
            hub,
            data_dir=config.paths.data_dir,
            actions=Actions(),
            node_info={"version": __version__, "roles": ["miner"]},
        )
    )

    bundle = await trio.to_thread.run_sync(
        functools.partial(collect, config, output=tmp_path / "b.tar.gz", nvml=NO_NVML)
    )

    files = extract(bundle.path)
    assert_no_secret(files, secrets)
    status = json.loads(files["node/status.json"])
    assert status["node"]["roles"] == ["miner"] and status["states"]["model_server"]["state"] == "ready"
    assert b"engy_test_inflight 3.0" in files["node/metrics.txt"]
    messages = [event["message"] for event in json.loads(files["node/events.json"])["events"]]
    assert f"created buyer key engy-sk-{MASK}" in messages
    report = files["node/model-server.txt"].decode()
    assert "command: python -m engy_node --home /h serve" in report and "ready to roll!" in report
    assert "node/README.txt" not in files and "errors.txt" not in files
    assert bundle.node_running and "node status, metrics and events" in bundle.summary()


# ---- the CLI ---------------------------------------------------------------------------------
def test_the_cli_writes_the_bundle_and_prints_its_path_and_summary(tmp_path):
    secrets = plant_home(tmp_path / "home")
    output = tmp_path / "bundle.tar.gz"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engy_node",
            "--home",
            str(tmp_path / "home"),
            "diagnose",
            "--output",
            str(output),
            "--log-lines",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert printed[0] == str(output) and "config (secrets masked)" in printed[1]
    assert stat.S_IMODE(output.stat().st_mode) == 0o600
    files = extract(output)
    assert_no_secret(files, secrets)
    assert len(files["logs/engy-node.log"].decode().splitlines()) == 10
    assert json.loads(files["config.json"])["miner"]["miner_key"] == MASK + MINER_KEY[-4:]


def test_the_cli_still_writes_a_bundle_when_the_config_is_broken(tmp_path, capsys):
    (tmp_path / "node.toml").write_text("[minr]\nmodel = 'x'\n")
    code = cli.main(["--home", str(tmp_path), "diagnose", "--output", str(tmp_path / "b.tar.gz")])
    assert code == 0
    files = extract(tmp_path / "b.tar.gz")
    config_json = json.loads(files["config.json"])
    assert "did you mean 'miner'" in config_json["error"] and config_json["miner"]["model"] == "smollm2-135m"
    assert "did you mean 'miner'" in files["errors.txt"].decode()
    assert capsys.readouterr().out.splitlines()[0] == str(tmp_path / "b.tar.gz")


def test_the_cli_names_the_flag_when_the_output_cannot_be_written(tmp_path, capsys):
    code = cli.main(["--home", str(tmp_path), "diagnose", "--output", str(tmp_path / "missing" / "b.tar.gz")])
    assert code == 2
    assert "engy-node: diagnose: cannot write the bundle" in capsys.readouterr().err
