"""Every tab of the node manager as an SVG snapshot, from one deterministic node: a local network
with its dev chain and validator, two miners at the gateway, and the fake rig of 4× RTX 4090 and
1× RTX 5090 from the GPU monitor's tests. No bridge and a fixed clock, so nothing in a frame
depends on timing."""

from __future__ import annotations

import pytest

from engy_node.hardware.monitor import assess, sample
from engy_tui.manager import NodeManager
from engy_tui.node_bridge import NodeSnapshot, snapshot_of
from tests.engy_node.hardware.test_monitor import rig
from tests.engy_tui.test_miner_panel import local_network
from tests.engy_tui.test_validator_panel import NAMES, NOW, local_chain, local_validator

SIZE = (160, 45)


def gpus_state() -> dict:
    api = rig()
    api.init()
    samples = sample(api)
    return {
        "samples": [gpu.as_dict() for gpu in samples],
        "findings": [f.as_dict() for f in assess(samples)],
        "reason": None,
        "error": None,
        "sampled_at": NOW - 1,
    }


def worker(name: str, state: str, reason: str, *, served: int, passed: int) -> dict:
    return {
        "miner": NAMES[name],
        "model": "smollm2-135m",
        "state": state,
        "since": NOW - 420,
        "reason": reason,
        "eligible": state == "active",
        "first_party": True,
        "connected": True,
        "until": None,
        "strikes": 0,
        "window": {"requests": 3, "failed": 0, "verdicts": 2, "unproven": 0},
        "lifetime": {"served": served, "failed": 0, "audited": passed, "pass": passed, "cheat": 0, "unproven": 0},
        "history": [],
    }


def node_snapshot() -> NodeSnapshot:
    states = {
        "chain": local_chain(),
        "validator": local_validator(),
        "gpus": gpus_state(),
        "gateway": {
            "state": "ready",
            "buyer_url": "http://127.0.0.1:8080",
            "miner_url": "ws://127.0.0.1:8081/gw",
            "provider_url": "http://127.0.0.1:8082",
            "models": ["smollm2-135m"],
            "worker": 0,
            "workers": 1,
        },
        "traffic": {
            "workers": [
                # Their verdicts add up to the verifier's 23: every tab tells the same story.
                worker(
                    "miner-1", "active", "connected: first-party, eligible without qualification", served=19, passed=9
                ),
                worker(
                    "miner-2", "active", "connected: first-party, eligible without qualification", served=28, passed=14
                ),
            ]
        },
        "epochs": {
            "latest": 238170,
            "digest": "5de557b0" + "0" * 52 + "6ee1",
            "weights": [[NAMES["miner-2"], 52428], [NAMES["miner-1"], 13107]],
        },
        "verifier": {"state": "running", "verdicts": {"pass": 23, "cheat": 0, "unproven": 0}},
        "traffic_generator": {
            "paused": False,
            "sent": 41,
            "succeeded": 41,
            "failed": 0,
            "output_chars": 7020,
            "last_error": None,
        },
        "network": {
            "buyer_api": "http://127.0.0.1:8080/v1",
            "provider_api": "http://127.0.0.1:8082",
            "miner_ws": "ws://127.0.0.1:8081/gw",
            "details": "/home/you/.local/share/engy/local/network.json",
        },
    }
    miners = local_network()
    states.update({name: miners[name] for name in miners if name.startswith(("miner-", "model_server"))})
    node = {
        "version": "0.1.0",
        "pid": 4242,
        "roles": ["chain", "gateway", "miner-1", "miner-2", "validator", "verifier"],
        "network": "local",
        "started_at": NOW - 600,
        "hotkeys": NAMES,
    }
    return snapshot_of(node, {"states": states}, taken_at=NOW - 0.2, connected=True)


EVENTS = [
    {
        "seq": 1,
        "ts": NOW - 5,
        "level": "info",
        "component": "validator",
        "message": "epoch 238170: weights for 2 uid(s) on chain at block 1,143, included as 1144-0001",
    },
    {
        "seq": 2,
        "ts": NOW - 3,
        "level": "warning",
        "component": "gateway.traffic",
        "message": "miner 5Fgo…RUgd (smollm2-135m): slow TTFT p99 2,185 ms",
    },
    {
        "seq": 3,
        "ts": NOW - 1,
        "level": "info",
        "component": "verifier",
        "message": "job 5f0c… (smollm2-135m, 22 output tokens): pass (ok) in 0.50 s",
    },
]


@pytest.mark.parametrize("tab", ["1", "2", "3", "4", "5", "6", "7"])
def test_each_tab_of_the_node_manager(snap_compare, utc, tab):
    app = NodeManager(None, clock=lambda: NOW)

    async def show(pilot) -> None:
        app.show_snapshot(node_snapshot(), events=EVENTS)
        await pilot.press(tab)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=show)
