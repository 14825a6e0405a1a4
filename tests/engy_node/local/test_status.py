"""`engy-node status`'s page: the hub states as their producers shape them, rendered to text.

The realistic document below is built with the keys each producer publishes (the local network's
chain snapshot from `DevChain.neurons()`/`weights()` in `local.up`, the light validator's
`_observe`/`_publish_weights`/`_stamp`, the epoch publisher, the control plane's workers from
`TrafficState.to_json()`, the verifier, the demo traffic) and the node block of a local network
(`cli.node_info`'s keys plus `network` and the `hotkeys` by local name). It is rendered both as
the hub holds it and as the control API answers it (through JSON).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.local.status import format_status
from engy_node.protocol.gates import FIXES, GateTerms, epoch_answer, miner_epoch

NOW = 1_800_000_000.0
VALIDATOR = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
MINER_1 = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
MINER_2 = "5FLSigC9HGRKVhB9FiEo4Y3koPsNmBmLJbpXg2mp1hXcS59Y"
STRANGER = "5DAAnrj7VHTznn2AWBemMuyBwZWs6FNFjdyVXUeYum3PTXFy"
OWNER = "5HGjWAeFDfFCWPsjFQdVV2Msvz2XtMktvgocEZcCj68kUMaw"
DIGEST = "ab12cd34ef56" + "0" * 52
PINNED_ROOT = "9fc5eb146e572c81dcabbbd078369852d59a5e2bfd72f45a06bf6514b079d807"


def neuron(
    uid: int, hotkey: str, *, stake: float, permit: bool, last_update: int, incentive: float, emission: float
) -> dict:
    return {
        "uid": uid,
        "hotkey": hotkey,
        "stake": stake,
        "permit": permit,
        "active": True,
        "last_update": last_update,
        "incentive": incentive,
        "dividends": 0.0,
        "emission": emission,
    }


def worker(miner: str, model: str, state: str, since: float, reason: str) -> dict:
    return {
        "miner": miner,
        "model": model,
        "state": state,
        "since": since,
        "reason": reason,
        "eligible": state == "active",
        "first_party": False,
        "connected": True,
        "until": None,
        "strikes": 0,
        "round": {"probes": 3, "ok": 3, "pass": 3, "unproven": 0, "cheat": 0},
        "window": {"requests": 40, "failed": 0, "verdicts": 5, "unproven": 0},
        "history": [{"from": "new", "to": "probing", "reason": "connected", "at": since - 60, "code": "connected"}],
    }


def full_document() -> dict:
    return {
        "node": {
            "version": "0.3.0",
            "pid": 4242,
            "roles": ["chain", "gateway", "miner-1", "miner-2", "validator", "verifier"],
            "started_at": NOW - 3_700,
            "home": "/tmp/engy-home",
            "netuid": 2,
            "network": "local",
            "hotkeys": {"owner": OWNER, "validator": VALIDATOR, "miner-1": MINER_1, "miner-2": MINER_2},
        },
        "states": {
            "chain": {
                "network": "dev chain",
                "netuid": 2,
                "block": 1234,
                "block_time_s": 12.0,
                "tempo": 360,
                "epochs_run": 3,
                "neurons": [
                    neuron(0, VALIDATOR, stake=1000.0, permit=True, last_update=1100, incentive=0.0, emission=0.5),
                    neuron(1, MINER_1, stake=0.0, permit=False, last_update=900, incentive=0.75, emission=0.123456),
                    neuron(2, MINER_2, stake=0.0, permit=False, last_update=900, incentive=0.25, emission=0.04),
                    neuron(3, STRANGER, stake=2.5, permit=False, last_update=5, incentive=0.0, emission=0.0),
                ],
                "weights": {"0": {"1": 49151, "2": 16384}},
            },
            "validator": {
                "block": 1234,
                "block_time_s": 12.0,
                "uid": 0,
                "permit": True,
                "last_update": 1100,
                "weights_rate_limit": 100,
                "activity_cutoff": 5000,
                "tempo": 360,
                "commit_reveal": False,
                "submitted_epoch": 3,
                "submitted_block": 1100,
                "weights": [
                    {"uid": 1, "hotkey": MINER_1, "weight": 49151},
                    {"uid": 2, "hotkey": MINER_2, "weight": 16384},
                ],
                "last_tick": NOW - 30,
                "last_outcome": "applied",
                "last_applied": 3,
                "last_submit_block": 1100,
                "last_submit_ts": NOW - 1608,
                "blocks_since_submit": 134,
                "next_resubmit_in_blocks": 226,
            },
            "epochs": {"latest": 3, "digest": DIGEST, "weights": [[MINER_1, 49151], [MINER_2, 16384]]},
            "gateway": {
                "state": "ready",
                "legs": [
                    {"leg": "0a1b2c3d", "miner": MINER_1, "model": "smollm2-135m", "gemm_audit": True},
                    {"leg": "4e5f6a7b", "miner": MINER_2, "model": "smollm2-135m", "gemm_audit": False},
                ],
                "prompt_cache": {"prompt_tokens": 12_000, "cached_tokens": 4_500, "hit_rate": 0.375},
            },
            "traffic": {
                "workers": [
                    {
                        **worker(MINER_1, "smollm2-135m", "active", NOW - 600, "qualified: 3 of 3 probes passed"),
                        "lifetime": {
                            "audited": 5,
                            "pass": 5,
                            "proofs": {"toploc": {"pass": 3}, "gemm": {"pass": 2}},
                        },
                    },
                    {
                        **worker(MINER_2, "smollm2-135m", "active", NOW - 600, "qualified: 3 of 3 probes passed"),
                        "lifetime": {"audited": 1, "pass": 1, "proofs": {"toploc": {"pass": 1}}},
                    },
                    worker(STRANGER, "smollm2-135m", "probing", NOW - 45, "connected"),
                ]
            },
            "verifier": {
                "state": "running",
                "gateway": "http://127.0.0.1:8090",
                "hotkey": VALIDATOR,
                "verdicts": {"pass": 10, "unproven": 1},
                "proofs": {"toploc": {"pass": 8}, "gemm": {"pass": 2, "unproven": 1}},
            },
            "miner-1": {
                "model": "smollm2-135m",
                "weights_root": PINNED_ROOT,
                "weights_pinned": True,
                "proofs": "GEMM audits + TOPLOC",
                "proofs_detail": "engy-activations-v2, up to 3929 positions an answer",
            },
            "miner-2": {
                "model": "qwen3.6-35b-a3b",
                "weights_root": "cd" * 32,
                "weights_pinned": False,
                "proofs": "TOPLOC alone",
                "proofs_detail": "the model server http://127.0.0.1:30000 does not commit its activations",
            },
            "miner-10": {"model": "smollm2-135m"},
            "traffic_generator": {
                "paused": False,
                "sent": 12,
                "succeeded": 11,
                "failed": 1,
                "output_chars": 950,
                "last_error": "HTTP 500: boom",
            },
        },
        "metrics": {},
        "last_seq": 99,
    }


def section(text: str, prefix: str) -> list[str]:
    """The lines of the section whose first line starts with `prefix`, up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def as_json(document: dict) -> dict:
    return json.loads(json.dumps(document))


@pytest.mark.parametrize("transport", [lambda document: document, as_json], ids=["hub", "json"])
def test_a_full_document_renders_every_section(transport):
    text = format_status(transport(full_document()), now=NOW)

    assert (
        text.splitlines()[0]
        == "engy-node 0.3.0 (pid 4242): chain, gateway, miner-1, miner-2, validator, verifier, up 61 min"
    )

    chain = section(text, "chain ")
    assert chain[0] == "chain      dev chain, netuid 2, block 1234 (12.0 s blocks), tempo 360, epochs run 3"
    rows = {line.split()[1]: line.split() for line in chain[2:6]}
    assert rows["validator"] == ["0", "validator", "1000.00", "yes", "1100", "0.0000", "0.5000"]
    assert rows["miner-1"] == ["1", "miner-1", "0.00", "no", "900", "0.7500", "0.1235"]
    assert rows["miner-2"] == ["2", "miner-2", "0.00", "no", "900", "0.2500", "0.0400"]
    assert rows[f"{STRANGER[:10]}…"][0] == "3"
    assert chain[6] == "  weights on chain from uid 0: uid 1: 49151, uid 2: 16384"
    assert len(chain) == 7

    validator = section(text, "validator ")
    assert "uid 0, permit yes" in validator[0]
    assert validator[1] == "  epoch 3 on chain, last submit at block 1100 (134 blocks ago, next resubmit in 226 blocks)"
    assert validator[2] == "  last tick 30 s ago: applied"

    assert section(text, "epoch ") == [
        "epoch      latest published 3 (digest ab12cd34ef56…): miner-1 75.0%, miner-2 25.0%"
    ]

    miners = section(text, "miners ")
    assert miners[1].split(None, 3)[:3] == ["miner-1", "smollm2-135m", "active"]
    assert miners[1].endswith("active for 10 min: qualified: 3 of 3 probes passed")
    # Which proofs judge each miner, and its verdicts by the proof that judged them.
    assert miners[2] == "               proofs GEMM audits + TOPLOC; verdicts toploc 3 pass · gemm 2 pass"
    assert miners[3].startswith("  miner-2 ")
    assert miners[4] == (
        "               proofs TOPLOC alone ⚠ (its hello announces no GEMM audits: a miner on altered weights "
        "may pass); verdicts toploc 1 pass"
    )
    assert miners[5].startswith(f"  {STRANGER[:10]}…")
    assert miners[5].endswith("probing for 45 s: connected")
    assert len(miners) == 6, "a miner with no legs and no verdicts has no proofs line"

    # The node's own miners, in natural order, with the weights their model servers loaded.
    serving = section(text, "serving ")
    assert serving[0] == "serving    this node's miners"
    assert [line for line in serving if not line.startswith("    ")][1:] == [
        "  miner-1 · smollm2-135m · plan n/a",
        "  miner-2 · qwen3.6-35b-a3b · plan n/a",
        "  miner-10 · smollm2-135m · plan n/a",
    ]
    assert [line for line in serving if "weights_root" in line] == [
        "    weights_root  9fc5eb146e57… (the catalog's pin)",
        "    weights_root  cdcdcdcdcdcd… (the catalog pins none)",
        "    weights_root  not checked yet",
    ]
    assert [line for line in serving if "proofs" in line] == [
        "    proofs        GEMM audits + TOPLOC: engy-activations-v2, up to 3929 positions an answer",
        "    proofs        TOPLOC alone: the model server http://127.0.0.1:30000 does not commit its activations",
    ]
    assert section(text, "verifier ") == [
        "verifier   running; verdicts: pass 10, cheat 0, unproven 1",
        "  by proof  toploc 8 pass · gemm 2 pass, 1 unproven",
    ]
    assert section(text, "gateway ") == [
        "gateway    ready; 2 miner leg(s); prefix cache: 37.5 % of 12000 prompt tokens from the miners' caches"
    ]
    assert section(text, "demo traffic") == [
        "demo traffic  running: 12 sent by the demo buyer, 11 ok, 1 failed (last error: HTTP 500: boom)"
    ]

    # Local names stand in for every hotkey the local network named.
    for ss58 in (VALIDATOR, MINER_1, MINER_2):
        assert ss58 not in text and ss58[:10] not in text
    assert STRANGER not in text  # an unnamed hotkey is shortened, never printed whole


def test_without_local_names_hotkeys_are_shortened():
    document = full_document()
    del document["node"]["hotkeys"]
    text = format_status(document, now=NOW)
    assert f"{MINER_1[:10]}… 75.0%" in text
    assert "miner-1 75.0%" not in text
    assert section(text, "chain ")[3].split()[:2] == ["1", f"{MINER_1[:10]}…"]


def test_a_validator_that_names_its_hotkey_is_shown_by_its_local_name():
    document = full_document()
    document["states"]["validator"].update(hotkey=VALIDATOR, provider="http://127.0.0.1:8090")
    line = section(format_status(document, now=NOW), "validator ")[0]
    assert line == "validator  validator uid 0, permit yes, provider http://127.0.0.1:8090"


HOME_MINER = {
    "model": "qwen3.6-35b-a3b",
    "max_inflight": 32,
    "plan": "tp 2 × dp 1 on 2× NVIDIA GeForce RTX 4090",
    "weights_root": PINNED_ROOT,
    "weights_pinned": True,
}
DNS_ERROR = "cannot read http://nonexistent.invalid/gw/meta: ConnectError: [Errno -2] Name or service not known"


def miner_section(miner: dict, server: dict | None = None) -> list[str]:
    states = {"miner": miner, **({"model_server": server} if server else {})}
    return section(format_status({"node": {"roles": ["miner"]}, "states": states}, now=NOW), "serving ")


def test_a_miner_node_has_a_section_with_its_plan_server_link_and_weights():
    server = {"state": "ready", "kind": "sglang", "restarts": 1}
    assert miner_section({**HOME_MINER, "legs_up": 4, "legs": 4, "inflight": 12}, server) == [
        "serving    this node's miners",
        "  miner · qwen3.6-35b-a3b · plan tp 2 × dp 1 on 2× NVIDIA GeForce RTX 4090",
        "    model server  ready (sglang, 1 restart)",
        "    link          4/4 legs up · in flight 12/32",
        "    weights_root  9fc5eb146e57… (the catalog's pin)",
    ]
    crashed = {
        "state": "failed",
        "kind": "sglang",
        "restarts": 3,
        "last_failure": {"kind": "cuda_oom", "summary": "CUDA out of memory", "fix": "lower --mem-fraction-static"},
    }
    assert miner_section(HOME_MINER, crashed)[2] == (
        "    model server  failed (sglang, 3 restarts) ✘ CUDA out of memory → lower --mem-fraction-static"
    )


def test_a_miner_simulating_a_cheat_says_so_under_its_weights():
    lines = miner_section({**HOME_MINER, "simulated_cheat": "noise-1%"})
    assert lines[-1] == (
        "    ⚠ SIMULATED CHEAT  serves weights altered by noise-1% while claiming this root "
        "(miner.simulate_cheat: demos and tests only)"
    )
    assert not any("SIMULATED" in line for line in miner_section(HOME_MINER))


def test_a_reference_server_run_alone_shows_its_state_model_and_weights_root():
    ready = {
        "state": "ready",
        "url": "http://127.0.0.1:30000",
        "model": "smollm2-135m",
        "device": "cpu",
        "dtype": "bfloat16",
        "weights_root": PINNED_ROOT,
        "weights_pinned": True,
    }

    def serve_section(serve: dict) -> list[str]:
        return section(format_status({"node": {"roles": ["serve"]}, "states": {"serve": serve}}, now=NOW), "serve ")

    assert serve_section(ready) == [
        "serve      the reference server: ready at http://127.0.0.1:30000",
        "  model         smollm2-135m on cpu, bfloat16",
        "  weights_root  9fc5eb146e57… (the catalog's pin)",
    ]
    assert serve_section({"state": "loading", "model": "smollm2-135m"}) == [
        "serve      the reference server: loading",
        "  model         smollm2-135m",
        "  weights_root  not checked yet",
    ]
    assert serve_section({**ready, "weights_pinned": False, "simulated_cheat": "noise-1%"})[-2:] == [
        "  weights_root  9fc5eb146e57… (the catalog pins none)",
        "  ⚠ SIMULATED CHEAT  serves weights altered by noise-1% while claiming this root "
        "(serve.simulate_cheat: demos and tests only)",
    ]
    assert serve_section({**ready, "state": "stopped"})[0] == "serve      the reference server: stopped"


def test_a_miner_a_gate_zeroed_says_which_gate_by_how_much_the_fix_and_the_next_chance():
    row = {"hotkey": "5Home", "model": "qwen3.6-35b-a3b", "counted": 312, "ttft_p99_ms": 14_250}
    result = {"epoch_index": 12, "start": int(NOW) - 3_000, "end": int(NOW) - 600, "weights": []}
    result["rows"] = [{**row, "score": 0, "gate_reason": "ttft_p99"}]
    terms = {"qwen3.6-35b-a3b": GateTerms(10_000, 200)}
    answer = epoch_answer(result, hotkey="5Home", terms=terms, epoch_s=2_400, grace_s=300)
    epoch = dataclasses.asdict(miner_epoch(answer, now=NOW))
    assert miner_section({**HOME_MINER, "epoch": epoch})[5:] == [
        "    epoch         12: weight 0 of 65,535 ✘ gated",
        "      ✘ ttft_p99 on qwen3.6-35b-a3b: TTFT p99 14,250 ms over 312 requests (ceiling 10,000 ms)",
        "        → fix: " + FIXES["ttft_p99"],
        "      next chance: epoch 13 ends 2027-01-15 08:30:00 UTC (in 30 min, ~150 blocks), its result published "
        "at 2027-01-15 08:35:00 UTC",
    ]
    # A local network publishes its dev chain, whose blocks come every second: the same 30 min.
    states = {"miner": {**HOME_MINER, "epoch": epoch}, "chain": {"network": "local", "block_time_s": 1.0}}
    local = section(format_status({"node": {"roles": ["miner"]}, "states": states}, now=NOW), "serving ")
    assert local[-1].startswith("      next chance: epoch 13 ends 2027-01-15 08:30:00 UTC (in 30 min, ~1,800 blocks)")
    # A miner started on its own publishes no chain: its gateway on that dev chain told its block time.
    told = dataclasses.asdict(miner_epoch({**answer, "block_time_s": 1.0}, now=NOW))
    assert miner_section({**HOME_MINER, "epoch": told})[-1].startswith(
        "      next chance: epoch 13 ends 2027-01-15 08:30:00 UTC (in 30 min, ~1,800 blocks)"
    )
    result["rows"] = [{**row, "score": 900, "gate_reason": None}]
    result["weights"] = [["5Home", 65535]]
    answer = epoch_answer(result, hotkey="5Home", terms=terms, epoch_s=2_400, grace_s=300)
    epoch = {**dataclasses.asdict(miner_epoch(answer, now=NOW)), "error": "https://gw/gw/epoch/latest: HTTP 502"}
    assert miner_section({**HOME_MINER, "epoch": epoch})[5:] == [
        "    epoch         12: weight 65,535 of 65,535 ✔",
        "      ⚠ the last look failed: https://gw/gw/epoch/latest: HTTP 502",
    ]
    waiting = {"error": "https://gw/gw/epoch/latest?hotkey=5Home: no epoch has been published yet"}
    assert miner_section({**HOME_MINER, "epoch": waiting})[5:] == [
        "    epoch         n/a: https://gw/gw/epoch/latest?hotkey=5Home: no epoch has been published yet"
    ]


def test_a_miner_whose_link_is_down_or_denied_quotes_why_with_the_fix():
    down = miner_section({**HOME_MINER, "link_error": DNS_ERROR})
    assert down[3:6] == [
        "    link          legs n/a · in flight n/a/32",
        f'                  ✘ cannot reach the gateway: "{DNS_ERROR}"',
        "                  → check the gateway URL (GW, miner.gateway_url) and this machine's network and DNS",
    ]
    denied = miner_section({**HOME_MINER, "legs_up": 0, "legs": 1, "denied": "unknown miner key"})
    assert denied[3:5] == [
        "    link          0/1 legs up · in flight n/a/32",
        '                  ✘ the gateway denies this miner: "unknown miner key"',
    ]


def test_a_validator_outage_names_the_chain_and_provider_errors():
    validator = {
        "hotkey": VALIDATOR,
        "chain_error": "RpcConnectionError: could not connect",
        "provider_error": "https://p/api/subnet/v1/epoch/latest: ConnectError: refused",
        "cached_vector": False,
    }
    lines = section(format_status({"states": {"validator": validator}}, now=NOW), "validator ")
    assert (
        lines[2]
        == "  ✘ chain unreachable: RpcConnectionError: could not connect → check validator.network and the connection"
    )
    assert lines[3].startswith(
        "  ⚠ provider gave no usable payload: https://p/api/subnet/v1/epoch/latest: ConnectError"
    )
    assert "(no cached vector: nothing is submitted)" in lines[3]


def test_missing_components_are_omitted():
    document = full_document()
    states = document["states"]
    kept = {"traffic_generator": states["traffic_generator"]}
    document["states"] = kept
    lines = format_status(document, now=NOW).splitlines()
    assert [line for line in lines if line] == [
        lines[0],
        "demo traffic  running: 12 sent by the demo buyer, 11 ok, 1 failed (last error: HTTP 500: boom)",
    ]

    document["states"] = {}
    assert format_status(document, now=NOW).splitlines() == [lines[0]]


def test_a_paused_generator_and_an_old_error_after_recovery():
    text = format_status(
        {
            "states": {
                "traffic_generator": {"paused": True, "sent": 3, "succeeded": 3, "failed": 0, "last_error": "stale"}
            }
        },
        now=NOW,
    )
    assert text.splitlines()[-1] == "demo traffic  paused: 3 sent by the demo buyer, 3 ok, 0 failed"


def test_an_empty_document_is_a_header_of_unknowns():
    assert format_status({}, now=NOW) == "engy-node ? (pid ?): n/a"
    assert format_status({"node": None, "states": None}, now=NOW) == "engy-node ? (pid ?): n/a"


def test_empty_components_say_n_a():
    text = format_status(
        {
            "node": {},
            "states": {
                name: {} for name in ("chain", "validator", "epochs", "traffic", "verifier", "traffic_generator")
            },
        },
        now=NOW,
    )
    assert section(text, "chain ") == [
        "chain      n/a, netuid n/a, block n/a (n/a s blocks), tempo n/a, epochs run n/a"
    ]
    assert section(text, "validator ") == [
        "validator  n/a uid n/a, permit n/a, provider n/a",
        "  nothing submitted yet",
    ]
    assert section(text, "epoch ") == ["epoch      latest published n/a (digest …): no weights"]
    assert section(text, "miners ") == ["miners     eligibility at the gateway", "  none connected yet"]
    assert section(text, "verifier ") == ["verifier   n/a; verdicts: none yet"]
    assert section(text, "demo traffic") == ["demo traffic  running: 0 sent by the demo buyer, 0 ok, 0 failed"]


def test_fields_present_but_null_say_n_a():
    """Producers publish None for what they do not know yet (a validator not registered, a
    resubmit not scheduled); none of it may break the page."""
    text = format_status(
        {
            "node": {"version": None, "pid": None, "roles": None, "started_at": None, "hotkeys": None},
            "states": {
                "chain": {
                    "network": None,
                    "neurons": [
                        {
                            "uid": None,
                            "hotkey": None,
                            "stake": None,
                            "permit": None,
                            "last_update": None,
                            "incentive": None,
                            "emission": None,
                        }
                    ],
                    "weights": {"0": {}},
                },
                "validator": {
                    "uid": None,
                    "permit": None,
                    "last_applied": 2,
                    "last_submit_block": None,
                    "blocks_since_submit": None,
                    "last_tick": None,
                },
                "epochs": {"latest": None, "digest": None, "weights": None},
                "traffic": {"workers": [{"miner": None, "model": None, "state": None, "since": None, "reason": None}]},
                "verifier": {"state": None, "verdicts": None},
                "traffic_generator": {"paused": None, "sent": None, "succeeded": None, "failed": None},
            },
        },
        now=NOW,
    )
    assert "None" not in text
    row = section(text, "chain ")[2].split()
    assert row == ["n/a", "n/a", "n/a", "no", "n/a", "n/a", "n/a"]
    assert section(text, "chain ")[3] == "  weights on chain from uid 0: none"
    assert section(text, "validator ")[1] == "  epoch 2 on chain, last submit at block n/a"
    assert section(text, "miners ")[1].split() == ["n/a", "n/a", "n/a:"]
    assert section(text, "verifier ") == ["verifier   n/a; verdicts: none yet"]


def test_ages_read_as_seconds_minutes_and_hours():
    def uptime(seconds: float) -> str:
        return format_status({"node": {"started_at": NOW - seconds}}, now=NOW).split(", up ")[1]

    assert [uptime(s) for s in (0, 119, 120, 7199, 7200, 90_061)] == [
        "0 s",
        "119 s",
        "2 min",
        "119 min",
        "2 h 0 min",
        "25 h 1 min",
    ]
    assert uptime(-5) == "0 s"  # a clock step back is not a negative age


# ---- never raises ------------------------------------------------------------------------------
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70).map(lambda n: n * 2**400)
    | st.floats()
    | st.text(max_size=8)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=4),
    max_leaves=12,
)


def fields(**values) -> st.SearchStrategy:
    """A dict with any of these keys (each from its own strategy), or any JSON at all."""
    return st.fixed_dictionaries({}, optional=values) | JSON


NEURON = fields(
    uid=JSON,
    hotkey=st.sampled_from([VALIDATOR, MINER_1]) | JSON,
    stake=JSON,
    permit=JSON,
    last_update=JSON,
    incentive=JSON,
    emission=JSON,
)
NODE = fields(
    version=JSON,
    pid=JSON,
    roles=st.lists(JSON, max_size=3) | JSON,
    started_at=SCALARS,
    hotkeys=st.dictionaries(st.text(max_size=6), JSON, max_size=3) | JSON,
)
STATES = (
    st.fixed_dictionaries(
        {},
        optional={
            "chain": fields(
                network=JSON,
                netuid=JSON,
                block=JSON,
                block_time_s=JSON,
                tempo=JSON,
                epochs_run=JSON,
                neurons=st.lists(NEURON, max_size=3) | JSON,
                weights=st.dictionaries(
                    JSON.filter(lambda k: isinstance(k, (str, int))),
                    st.dictionaries(st.text(max_size=3) | st.integers(), JSON, max_size=3) | JSON,
                    max_size=3,
                )
                | JSON,
            ),
            "validator": fields(
                hotkey=JSON,
                uid=JSON,
                permit=JSON,
                provider=JSON,
                last_applied=JSON,
                last_submit_block=JSON,
                blocks_since_submit=JSON,
                next_resubmit_in_blocks=JSON,
                last_tick=SCALARS,
                last_outcome=JSON,
            ),
            "epochs": fields(
                latest=JSON, digest=JSON, weights=st.lists(st.tuples(JSON, SCALARS).map(list) | JSON, max_size=3) | JSON
            ),
            "traffic": fields(
                workers=st.lists(fields(miner=JSON, model=JSON, state=JSON, since=SCALARS, reason=JSON), max_size=3)
                | JSON
            ),
            "verifier": fields(state=JSON, verdicts=st.dictionaries(st.text(max_size=6), JSON, max_size=3) | JSON),
            "traffic_generator": fields(paused=JSON, sent=JSON, succeeded=JSON, failed=JSON, last_error=JSON),
        },
    )
    | JSON
)
DOCUMENT = st.fixed_dictionaries({}, optional={"node": NODE, "states": STATES, "metrics": JSON, "last_seq": JSON})


@settings(max_examples=400, deadline=None)
@given(document=DOCUMENT, now=st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=4e9))
def test_format_status_never_raises(document, now):
    text = format_status(document, now=now)
    assert isinstance(text, str) and text.startswith("engy-node ")


@settings(max_examples=100, deadline=None)
@given(now=st.floats(min_value=0, max_value=4e9), started=st.floats() | st.integers())
def test_uptime_is_never_negative_or_non_finite(now, started):
    header = format_status({"node": {"started_at": started}}, now=now)
    if ", up " in header:
        assert not header.split(", up ")[1].startswith("-")
    else:
        assert not (isinstance(started, (int, float)) and math.isfinite(started) and abs(started) < 1e15)


def test_a_local_network_says_where_to_call_it_and_where_the_key_is():
    from engy_node.local.status import format_status

    text = format_status(
        {
            "states": {
                "network": {
                    "buyer_api": "http://127.0.0.1:8080/v1",
                    "details": "/h/data/local/network.json",
                    "provider_api": "http://127.0.0.1:8082",
                    "miner_ws": "ws://127.0.0.1:8081/gw",
                }
            }
        },
        now=0.0,
    )
    assert "buyer API  http://127.0.0.1:8080/v1   (key in /h/data/local/network.json)" in text
    assert "miners dial ws://127.0.0.1:8081/gw" in text
