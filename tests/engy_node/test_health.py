"""`engy-node health` for every role (engy_node.commands.health): the pure judges over
hand-made states, and the command against a real control API on 127.0.0.1 serving a hub's
states, so the exit code is what a service manager or a container's health check sees."""

from __future__ import annotations

import functools
from pathlib import Path

import trio

from engy_node.cli import main
from engy_node.commands.health import HEALTH_DOWN, HEALTH_NOT_WORKING, HEALTH_OK, judge
from engy_node.control import Actions, serve_control
from engy_node.hub import Hub
from engy_node.snapshots import (
    GatewayLeg,
    GatewayState,
    MinerState,
    ModelServerState,
    NodeStates,
    ServerFailure,
    TrafficPolicyState,
    TrafficStanding,
    VerifierState,
)


def test_a_miner_with_legs_up_is_healthy_and_one_without_says_why() -> None:
    assert judge("miner", NodeStates(miners={"miner": MinerState(legs_up=2, legs=2)})) == (
        HEALTH_OK,
        "ok: miner: 2/2 legs up",
    )
    denied = NodeStates(miners={"miner": MinerState(legs_up=0, legs=2, denied="hotkey not registered")})
    assert judge("miner", denied) == (HEALTH_NOT_WORKING, "miner: no leg up at the gateway: hotkey not registered")
    crashed = NodeStates(
        miners={"miner": MinerState(legs_up=2)},
        model_servers={
            "miner": ModelServerState(state="failed", last_failure=ServerFailure(summary="OOM", fix="lower it"))
        },
    )
    assert judge("miner", crashed) == (HEALTH_NOT_WORKING, "miner: its model server is failed: OOM — lower it")
    assert judge("miner", NodeStates())[0] == HEALTH_NOT_WORKING


def test_a_gateway_needs_an_eligible_connected_miner() -> None:
    leg = (GatewayLeg(leg="l1", miner="5M"),)
    assert judge("gateway", NodeStates(gateway=GatewayState(state="ready", legs=leg)))[0] == HEALTH_OK
    assert judge("gateway", NodeStates(gateway=GatewayState(state="draining", legs=leg)))[0] == HEALTH_NOT_WORKING
    assert judge("gateway", NodeStates(gateway=GatewayState(state="ready")))[0] == HEALTH_NOT_WORKING
    pulled = TrafficPolicyState(workers=(TrafficStanding(miner="5M", state="pulled", connected=True),))
    code, message = judge("gateway", NodeStates(gateway=GatewayState(state="ready", legs=leg), traffic=pulled))
    assert code == HEALTH_NOT_WORKING and "5M pulled" in message
    active = TrafficPolicyState(workers=(TrafficStanding(miner="5M", state="active", connected=True, eligible=True),))
    assert judge("gateway", NodeStates(gateway=GatewayState(state="ready", legs=leg), traffic=active))[0] == HEALTH_OK


def test_a_verifier_must_be_running() -> None:
    assert judge("verifier", NodeStates(verifier=VerifierState(state="running")))[0] == HEALTH_OK
    assert judge("verifier", NodeStates())[0] == HEALTH_NOT_WORKING


def test_no_node_running_is_down(tmp_path: Path, capsys) -> None:
    assert main(["--home", str(tmp_path), "health", "--role", "miner"]) == HEALTH_DOWN
    assert capsys.readouterr().out.startswith("not running: no engy node is serving")


async def test_health_reads_the_running_node_s_roles_and_states(tmp_path: Path) -> None:
    hub = Hub()
    data_dir = tmp_path / "data"
    hub.set_state("miner", legs_up=0, legs=1, link_error="connection refused (wss://gw.example/gw)")
    hub.set_state("gateway", state="ready", legs=[{"leg": "l1", "miner": "5M"}])
    info = {"roles": ["miner", "gateway"]}
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve_control, hub, data_dir=data_dir, actions=Actions(), node_info=info))
        home = ["--home", str(tmp_path)]
        assert await trio.to_thread.run_sync(main, [*home, "health"]) == HEALTH_NOT_WORKING
        assert await trio.to_thread.run_sync(main, [*home, "health", "--role", "gateway"]) == HEALTH_OK
        hub.set_state("miner", legs_up=1, link_error=None)
        assert await trio.to_thread.run_sync(main, [*home, "health"]) == HEALTH_OK
        nursery.cancel_scope.cancel()
