"""`engy-node status [--json]` for every role: the summary's documented fields (docs/control-api.md
against `engy_node.status_summary`, both ways), the pure summary over states as their producers
shape them, and the command's JSON and exit code against real nodes on 127.0.0.1: a gateway, a
miner and a verifier in one process, a validator whose chain and provider do not answer, a node
whose control API refuses the token, and no node at all."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from engy_node.cli import main
from engy_node.commands.health import judged_roles, validator_outage
from engy_node.control import Actions, serve_control
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.keys import create_wallet
from engy_node.miner.role import MinerMetrics
from engy_node.miner.serving import RequestOutcome
from engy_node.protocol.gates import GateTerms, explain
from engy_node.snapshots import NodeInfo, ValidatorState, decode_states
from engy_node.status_summary import (
    STATUS_NOT_WORKING,
    STATUS_OK,
    STATUS_STALLED,
    STATUS_UNREACHABLE,
    RoleVerdict,
    StatusSummary,
    exit_code,
    summarize,
    summary_lines,
)
from engy_node.testing.faults import ProcessAccount
from tests.faults.nodes import NodeProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
MAP_KEYS = {"verifier.by_proof": "<proof>"}
"""The placeholder the document writes for the keys of each map."""
STATUS_TIMEOUT_S = 90
MINER = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
VALIDATOR = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"


# ---- the documented fields -------------------------------------------------------------------


def summary_rows(kind: type = StatusSummary, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(path, JSON type) of every field of the summary, depth first, as the document writes them."""
    hints = typing.get_type_hints(kind)
    for field in dataclasses.fields(kind):
        yield from described(prefix + str(field.metadata.get("key", field.name)), hints[field.name])


def described(path: str, hint: typing.Any) -> Iterator[tuple[str, str]]:
    args = typing.get_args(hint)
    nullable = type(None) in args
    if nullable:
        (hint,) = [arg for arg in args if arg is not type(None)]
        args = typing.get_args(hint)
    null = " or null" if nullable else ""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        yield path, f"object{null}"
        yield from summary_rows(hint, f"{path}.")
    elif origin is tuple and dataclasses.is_dataclass(args[0]):
        yield path, f"array of objects{null}"
        yield from summary_rows(args[0], f"{path}[].")
    elif origin is tuple:
        yield path, f"array of {SCALARS[args[0]]}s{null}"
    elif origin is dict:
        yield path, f"object{null}"
        yield from summary_rows(args[1], f"{path}.{MAP_KEYS[path]}.")
    else:
        yield path, SCALARS[hint] + null


def documented_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "control-api.md").read_text(encoding="utf-8")
    section = text.split("\n## `engy-node status --json`", 1)
    assert len(section) == 2, "docs/control-api.md has no `engy-node status --json` section"
    body = section[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", body, flags=re.MULTILINE)


def test_the_document_lists_every_summary_field_with_its_type():
    from engy_node.status_summary import SUMMARY_SCHEMA

    text = (ROOT / "docs" / "control-api.md").read_text(encoding="utf-8")
    assert f"## `engy-node status --json` (summary schema {SUMMARY_SCHEMA})" in text
    expected = list(summary_rows())
    assert documented_rows() == expected, (
        "docs/control-api.md's summary tables differ from engy_node/status_summary.py; a removed or retyped "
        "field needs SUMMARY_SCHEMA raised. The code's fields:\n" + "\n".join(f"{p}: {t}" for p, t in expected)
    )


def test_a_summary_encodes_to_the_documented_types():
    """Every documented path of a full summary holds a value of its documented type."""
    states = decode_states(network_states(), strict=True)
    summary = summarize(NodeInfo(hotkeys={"miner-1": MINER}), states, miner_metrics(), [RoleVerdict("miner", 0, "ok")])
    encoded = json.loads(json.dumps(encode(summary)))
    checks = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
        "array of objects": list,
        "array of strings": list,
    }
    for path, kind in summary_rows():
        for value in values_at(encoded, path.split(".")):
            if value is None:
                assert kind.endswith(" or null"), path
            else:
                assert isinstance(value, checks[kind.removesuffix(" or null")]), (path, value)


def values_at(value: typing.Any, parts: list[str]) -> Iterator[typing.Any]:
    if not parts:
        yield value
        return
    part, rest = parts[0], parts[1:]
    if value is None:
        return
    if part.startswith("<"):
        for item in value.values():
            yield from values_at(item, rest)
    elif part.endswith("[]"):
        for item in value[part[:-2]]:
            yield from values_at(item, rest)
    else:
        yield from values_at(value[part], rest)


# ---- the summary, pure -----------------------------------------------------------------------


def encode(summary: StatusSummary) -> typing.Any:
    from engy_node.status_summary import encode as encode_summary

    return encode_summary(summary)


def miner_metrics() -> dict:
    """What a miner's `MinerMetrics` put in the registry after two answers and a failure."""
    hub = Hub()
    metrics = MinerMetrics(hub)
    metrics.record(RequestOutcome(ok=True, prompt_tokens=10, completion_tokens=5, ttft_s=0.2, tpot_s=0.02))
    metrics.record(RequestOutcome(ok=True, prompt_tokens=10, completion_tokens=5, ttft_s=0.4, tpot_s=0.03))
    metrics.record(RequestOutcome(ok=False, error_class="timeout"))
    return json.loads(json.dumps(hub.registry.snapshot()))


def network_states() -> dict:
    """A local network's states, as the producers shape them (see tests/engy_node/local/test_status.py)."""
    return {
        "miner-1": {"model": "smollm2-135m", "plan": "cpu", "legs_up": 1, "legs": 1, "max_inflight": 4},
        "model_server.miner-1": {"state": "ready", "kind": "reference", "restarts": 1},
        "gateway": {"state": "ready", "legs": [{"leg": "l1", "miner": MINER, "model": "smollm2-135m"}]},
        "traffic": {
            "workers": [
                {
                    "miner": MINER,
                    "model": "smollm2-135m",
                    "state": "active",
                    "eligible": True,
                    "connected": True,
                    "lifetime": {"served": 40, "failed": 2, "audited": 8, "pass": 6, "cheat": 0, "unproven": 2},
                },
                {
                    "miner": "5Slow",
                    "model": "smollm2-135m",
                    "state": "pulled",
                    "lifetime": {"served": 5, "failed": 5, "audited": 0},
                    "history": [{"from": "active", "to": "pulled", "code": "slow-ttft"}],
                },
                {
                    "miner": "5Cheat",
                    "model": "smollm2-135m",
                    "state": "pulled",
                    "lifetime": {"served": 1, "failed": 0, "audited": 1, "cheat": 1},
                    "history": [{"from": "active", "to": "pulled", "code": "cheat"}],
                },
            ]
        },
        "chain": {
            "netuid": 2,
            "neurons": [
                {"uid": 1, "hotkey": VALIDATOR, "permit": True},
                {"uid": 2, "hotkey": MINER, "incentive": 0.56},
            ],
            "weights": {"1": {"2": 65535}},
        },
        "validator": {"hotkey": VALIDATOR, "uid": 1, "permit": True, "last_applied": 4, "last_submit_block": 300},
        "verifier": {"state": "running", "verdicts": {"pass": 6, "cheat": 1, "unproven": 2}},
        "alerts": {"firing": [{"key": "breaker_open:5Slow", "rule": "breaker_open", "subject": "5Slow", "since": 1.0}]},
    }


def test_a_local_network_s_miner_gets_its_gateway_verdicts_and_chain_incentive_by_its_hotkey():
    states = decode_states(network_states(), strict=True)
    summary = summarize(NodeInfo(hotkeys={"miner-1": MINER}), states, miner_metrics(), [])
    (miner,) = summary.miners
    assert (miner.name, miner.hotkey, miner.server_state, miner.server_restarts) == ("miner-1", MINER, "ready", 1)
    assert (miner.traffic_state, miner.served, miner.failed, miner.audited) == ("active", 40, 2, 8)
    assert miner.pass_rate == 0.75 and (miner.incentive, miner.weighted_by) == (0.56, 1)
    assert summary.serving is not None
    assert (summary.serving.requests_ok, summary.serving.requests_failed) == (2, 1)
    assert summary.serving.ttft_p99_ms == 400.0 and summary.serving.tpot_p99_ms == 30.0
    gateway = summary.gateway
    assert gateway is not None and (gateway.miners, gateway.legs, gateway.eligible) == (1, 1, 1)
    assert (gateway.requests, gateway.errors, gateway.audited) == (53, 7, 9)
    assert gateway.breaker_open == ("5Slow/smollm2-135m",) and gateway.pulled == ("5Cheat/smollm2-135m",)
    assert summary.verifier is not None and summary.verifier.verdicts.cheat == 1
    assert summary.validator is not None and (summary.validator.last_epoch, summary.validator.uid) == (4, 1)
    assert [alert.rule for alert in summary.alerts] == ["breaker_open"]


def test_a_miner_a_gate_zeroed_names_the_gate_and_the_measurement_in_the_summary_and_its_line():
    finding = explain(
        {"hotkey": MINER, "model": "smollm2-135m", "gate_reason": "ttft_p99", "ttft_p99_ms": 45_000, "counted": 120},
        GateTerms(30_000, 2_000),
        epoch=7,
    )
    epoch = {"index": 7, "weight": 0, "rows": 1, "gated": [dataclasses.asdict(finding)]}
    states = decode_states({"miner-1": {"model": "smollm2-135m", "epoch": epoch}}, strict=True)
    summary = summarize(NodeInfo(hotkeys={"miner-1": MINER}), states, {}, [])
    (miner,) = summary.miners
    gated = "ttft_p99 on smollm2-135m: TTFT p99 45,000 ms over 120 requests (ceiling 30,000 ms)"
    assert (miner.epoch, miner.epoch_weight, miner.gated) == (7, 0, (gated,))
    assert encode(summary)["miners"][0]["gated"] == [gated]
    assert any(line.endswith(f" · ✘ gated in epoch 7: {gated}") for line in summary_lines(summary))


def test_what_a_standalone_miner_cannot_know_is_null_not_zero():
    states = decode_states({"miner": {"model": "smollm2-135m", "legs_up": 0, "legs": 1, "link_error": "refused"}})
    summary = summarize(NodeInfo(), states, {}, [])
    (miner,) = summary.miners
    assert (miner.served, miner.pass_rate, miner.incentive, miner.weighted_by, miner.server_state) == (None,) * 5
    assert (miner.epoch, miner.epoch_weight, miner.gated) == (None, None, ())
    assert miner.link_error == "refused"
    assert summary.serving is not None and summary.serving.requests_ok is None and summary.serving.ttft_p99_ms is None
    assert summary.gateway is summary.validator is summary.verifier is None


def test_a_gateway_older_than_lifetime_totals_has_unknown_requests():
    states = decode_states({"gateway": {"state": "ready"}, "traffic": {"workers": [{"miner": "5M", "state": "new"}]}})
    gateway = summarize(NodeInfo(), states, {}, []).gateway
    assert gateway is not None and gateway.requests is gateway.errors is gateway.audited is None
    assert gateway.eligible == 0


@pytest.mark.parametrize(
    ("codes", "expected"),
    [((), STATUS_OK), ((0, 0), STATUS_OK), ((0, 3), STATUS_NOT_WORKING), ((3, 1, 0), STATUS_STALLED)],
)
def test_the_exit_code_is_the_worst_verdict_a_stalled_loop_first(codes, expected):
    assert exit_code([RoleVerdict("miner", code, "") for code in codes]) == expected


def test_a_local_network_s_roles_are_judged_as_the_roles_they_are():
    listed = ["chain", "gateway", "miner-1", "miner-2", "validator", "verifier"]
    assert judged_roles(listed) == ["gateway", "miner", "validator", "verifier"]


def test_a_validator_that_never_landed_weights_is_in_an_outage_while_the_chain_or_provider_fails():
    assert validator_outage(None) is None
    assert validator_outage(ValidatorState()) is None
    down = validator_outage(ValidatorState(chain_error="RpcConnectionError: refused"))
    assert down is not None and "chain is unreachable: RpcConnectionError" in down and "validator.network" in down
    no_payload = validator_outage(ValidatorState(provider_error="404"))
    assert no_payload is not None and "validator.provider_url" in no_payload
    assert validator_outage(ValidatorState(provider_error="404", cached_vector=True)) is None
    assert validator_outage(ValidatorState(chain_error="refused", last_submit_ts=1.0)) is None, (
        "one that landed weights is judged by the activity cutoff"
    )


# ---- the command against a control API ---------------------------------------------------------


def status(home: Path, *extra: str) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(home), "status", *extra],
        capture_output=True,
        text=True,
        timeout=STATUS_TIMEOUT_S,
    )
    return result.returncode, result.stdout, result.stderr


def test_no_node_is_exit_2_with_json_saying_how_to_find_it(tmp_path, capsys):
    assert main(["--home", str(tmp_path), "status", "--json"]) == STATUS_UNREACHABLE
    captured = capsys.readouterr()
    summary = json.loads(captured.out)["summary"]
    assert summary["exit_code"] == STATUS_UNREACHABLE and summary["roles"] == [] and summary["miners"] == []
    assert "no engy node is serving" in summary["error"] and "--home" in summary["error"]
    assert "--home" in captured.err
    assert main(["--home", str(tmp_path), "status"]) == STATUS_UNREACHABLE
    assert capsys.readouterr().out == "", "the text form prints the reason on stderr alone"


async def test_a_node_of_several_roles_answers_per_role_and_exits_3_when_one_is_not_working(tmp_path):
    hub = Hub()
    for component, values in network_states().items():
        if component not in ("chain", "validator"):
            hub.set_state(component, **values)
    info = {"roles": ["gateway", "miner-1", "verifier"], "hotkeys": {"miner-1": MINER}}
    run = functools.partial(trio.to_thread.run_sync, functools.partial(status, tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(serve_control, hub, data_dir=tmp_path / "data", actions=Actions(), node_info=info)
        )
        code, out, _ = await trio.to_thread.run_sync(status, tmp_path, "--json")
        document = json.loads(out)
        summary = document["summary"]
        assert code == STATUS_OK == summary["exit_code"], summary["roles"]
        assert [(v["role"], v["code"]) for v in summary["roles"]] == [("gateway", 0), ("miner", 0), ("verifier", 0)]
        assert summary["miners"][0]["pass_rate"] == 0.75 and summary["gateway"]["breaker_open"]
        assert decode_states(document["states"], strict=True).miners["miner-1"].legs_up == 1, (
            "the states are the control API's, unchanged"
        )

        hub.set_state("miner-1", legs_up=0, denied="hotkey not registered on netuid 53")
        code, out, _ = await trio.to_thread.run_sync(status, tmp_path, "--json")
        summary = json.loads(out)["summary"]
        assert code == STATUS_NOT_WORKING == summary["exit_code"]
        miner_verdict = next(v for v in summary["roles"] if v["role"] == "miner")
        assert miner_verdict["code"] == 3 and "hotkey not registered" in miner_verdict["reason"]
        assert summary["miners"][0]["denied"] == "hotkey not registered on netuid 53"

        code, text, _ = await run()
        assert code == STATUS_NOT_WORKING
        assert "✘ miner: miner-1: no leg up at the gateway: hotkey not registered" in text
        assert "✔ gateway: ok" in text and "pass rate 75.0 %" in text and "breaker open: 5Slow/smollm2-135m" in text
        nursery.cancel_scope.cancel()


async def test_a_refused_token_is_exit_2_naming_the_token(tmp_path):
    data_dir = tmp_path / "data"
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve_control, Hub(), data_dir=data_dir, actions=Actions(), node_info={}))
        (data_dir / "control.token").write_text("a-token-the-node-does-not-hold")
        code, out, err = await trio.to_thread.run_sync(status, tmp_path, "--json")
        assert code == STATUS_UNREACHABLE and "refused the control token" in json.loads(out)["summary"]["error"]
        assert "refused the control token" in err
        nursery.cancel_scope.cancel()


# ---- real roles --------------------------------------------------------------------------------


def wait_status(home: Path, expected: int, *, timeout_s: float, what: str) -> dict:
    """`status --json` until it exits `expected`; the document it printed then."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, out, err = status(home, "--json")
        if code == expected:
            return json.loads(out)
        assert time.monotonic() < deadline, f"{what}: status exited {code}: {out[-2000:]} {err}"
        time.sleep(1)


def test_a_real_gateway_miner_and_verifier_in_one_node(tmp_path, checkpoint):
    """One process runs the three roles: the miner dials its own gateway (a model server it did not
    launch, which no request reaches here), the verifier leases from it. Up, every role does its
    job (exit 0); the summary has each role's section."""
    home = tmp_path / "node"
    wallets = tmp_path / "wallets"
    verifier_hotkey = create_wallet(wallets, "v", "h")
    (home / "data").mkdir(parents=True)
    with Store.open(home / "data" / "gateway.sqlite3") as store:
        _, miner_key = store.register_miner("status-miner")
    buyer, miner, provider = free_port(), free_port(), free_port()
    env = {
        "ENGY_GATEWAY__PORT": str(buyer),
        "ENGY_GATEWAY__MINER_PORT": str(miner),
        "ENGY_GATEWAY__PROVIDER_PORT": str(provider),
        "ENGY_GATEWAY__QUALIFICATION": "false",
        "ENGY_GATEWAY__DRAIN_S": "2",
        "ENGY_GATEWAY__VERIFIERS": verifier_hotkey,
        "ENGY_VERIFIER__WALLETS_PATH": str(wallets),
        "MINER_KEY": miner_key,
    }
    args = [
        *("--role", "gateway", "--role", "miner", "--role", "verifier"),
        *("--gateway", f"ws://127.0.0.1:{miner}/gw", "--serve-url", f"http://127.0.0.1:{free_port()}"),
        *("--provider", f"http://127.0.0.1:{provider}", "--verifier-wallet", "v", "--verifier-hotkey", "h"),
    ]
    account = ProcessAccount(home)
    node = NodeProcess(home, args, env, account, name="node")
    node.start()
    try:
        node.wait_for(r"leg \S+ admitted", what="the miner admitted by its own gateway")
        document = wait_status(home, STATUS_OK, timeout_s=60, what="every role doing its job")
        summary = document["summary"]
        assert [v["role"] for v in summary["roles"]] == ["gateway", "miner", "verifier"]
        (miner_summary,) = summary["miners"]
        assert miner_summary["legs_up"] >= 1 and miner_summary["model"] == "smollm2-135m"
        assert miner_summary["server_state"] is None, "it uses a server it did not launch"
        assert summary["gateway"]["state"] == "ready" and summary["gateway"]["legs"] >= 1
        assert summary["verifier"]["state"] == "running"
        assert summary["serving"]["requests_ok"] == 0 and summary["serving"]["ttft_p99_ms"] is None
    finally:
        assert node.stop() == 0, node.text()
    account.note_marked()
    assert account.alive() == []
    code, out, _ = status(home, "--json")
    assert code == STATUS_UNREACHABLE and "no engy node" in json.loads(out)["summary"]["error"]


def test_a_real_validator_whose_chain_and_provider_do_not_answer_is_not_doing_its_job(tmp_path):
    home = tmp_path / "node"
    home.mkdir()
    wallets = tmp_path / "wallets"
    create_wallet(wallets, "v", "h")
    dead = f"127.0.0.1:{free_port()}"
    args = [
        *("--role", "validator", "--network", f"ws://{dead}", "--provider", f"http://{dead}"),
        *("--validator-wallet", "v", "--validator-hotkey", "h"),
    ]
    env = {"ENGY_VALIDATOR__WALLETS_PATH": str(wallets), "ENGY_VALIDATOR__POLL_S": "1"}
    account = ProcessAccount(home)
    node = NodeProcess(home, args, env, account, name="validator")
    node.start()
    try:
        document = wait_status(home, STATUS_NOT_WORKING, timeout_s=60, what="the validator's outage")
        summary = document["summary"]
        (verdict,) = summary["roles"]
        assert verdict["role"] == "validator" and "chain is unreachable" in verdict["reason"]
        assert summary["validator"]["chain_error"] and summary["validator"]["last_epoch"] is None
        health = subprocess.run(
            [sys.executable, "-m", "engy_node", "--home", str(home), "health"],
            capture_output=True,
            text=True,
            timeout=STATUS_TIMEOUT_S,
            env={**os.environ, **env},
        )
        assert health.returncode == 3 and "chain is unreachable" in health.stdout, "health agrees"
    finally:
        assert node.stop() == 0, node.text()
    account.note_marked()
    assert account.alive() == []
