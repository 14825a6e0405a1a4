"""The hub's snapshot types: every state a component publishes decodes into its type and back,
unknown or ill-typed data never breaks a liberal reader, and a strict reader names what is off."""

from __future__ import annotations

import json
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.hub import Hub
from engy_node.snapshots import (
    MINER,
    SINGLE_COMPONENTS,
    ChainState,
    GatewayLeg,
    GatewayState,
    MinerState,
    ModelServerState,
    NodeStates,
    SchemaError,
    TrafficPolicyState,
    VerifierState,
    decode,
    decode_states,
    encode,
    miner_of_server,
    server_component,
    state_type,
    wire_keys,
)

SNAPSHOT_TYPES = sorted({*SINGLE_COMPONENTS.values(), MinerState, ModelServerState}, key=lambda kind: kind.__name__)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)


@pytest.mark.parametrize("kind", SNAPSHOT_TYPES, ids=lambda kind: kind.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_snapshot_survives_the_wire_unchanged(kind, data):
    snapshot = data.draw(st.from_type(kind))
    wire = json.dumps(encode(snapshot))
    # Compared as JSON text, since a NaN reading never equals itself.
    assert json.dumps(encode(decode(kind, json.loads(wire), strict=True))) == wire


@settings(max_examples=300, deadline=None)
@given(states=st.dictionaries(st.sampled_from([*SINGLE_COMPONENTS, "miner-1", "model_server", "x"]), json_values))
def test_a_liberal_reader_takes_any_json_without_raising(states):
    decoded = decode_states(states)
    assert isinstance(decoded, NodeStates)


def test_a_liberal_reader_keeps_what_it_can_and_skips_what_it_cannot():
    decoded = decode_states(
        {
            "gateway": {"state": "ready", "workers": "two", "legs": [{"leg": "a", "capacity": 4}, "junk"], "new": 1},
            "verifier": {"verdicts": {"pass": 3, "cheat": 1}},
            "chain": {"weights": {"1": {"3": 65535}}},
            "someday": {"a": 1},
        }
    )
    assert decoded.gateway == GatewayState(state="ready", legs=(GatewayLeg(leg="a", capacity=4),))
    assert decoded.verifier == VerifierState(verdicts=decoded.verifier.verdicts)
    assert (decoded.verifier.verdicts.passed, decoded.verifier.verdicts.total) == (3, 4)
    assert decoded.chain == ChainState(weights={1: {3: 65535}}), "JSON's string keys come back as uids"


def test_a_strict_reader_names_the_field_that_is_off():
    with pytest.raises(SchemaError, match=r"gateway: new not declared by GatewayState"):
        decode_states({"gateway": {"state": "ready", "new": 1}}, strict=True)
    with pytest.raises(SchemaError, match=r"gateway.workers: 'two' is not a int"):
        decode_states({"gateway": {"workers": "two"}}, strict=True)
    with pytest.raises(SchemaError, match=r"traffic.workers\[0\].round: passes not declared by ProbeRound"):
        decode(TrafficPolicyState, {"workers": [{"round": {"probes": 1, "passes": 2}}]}, strict=True, where="traffic")
    with pytest.raises(SchemaError, match="'someday' has no snapshot type"):
        decode_states({"someday": {}}, strict=True)


def test_miners_and_their_servers_are_found_under_every_name_a_node_gives_them():
    assert state_type("miner") is state_type("miner-12") is MinerState
    assert state_type("model_server") is state_type("model_server.miner-2") is ModelServerState
    assert state_type("miner-") is None and state_type("model_server.") is None and state_type("minerx") is None
    for miner in (MINER, "miner-1", "miner-10"):
        assert miner_of_server(server_component(miner)) == miner
    decoded = decode_states({"model_server.miner-10": {"state": "ready"}, "miner-2": {}, "model_server": {}})
    assert decoded.miner_names() == ["miner", "miner-2", "miner-10"]
    assert decoded.model_servers["miner-10"].state == "ready"


def test_the_hub_accepts_exactly_the_fields_each_type_declares():
    hub = Hub()
    for component, kind in SINGLE_COMPONENTS.items():
        hub.set_state(component, **{key: None for key in wire_keys(kind)})
    with pytest.raises(SchemaError):
        hub.set_state("audit", waitng=1)


def test_every_snapshot_field_has_a_type_the_codec_knows():
    for kind in SNAPSHOT_TYPES:
        for name, hint in typing.get_type_hints(kind).items():
            assert hint is not typing.Any, f"{kind.__name__}.{name} is untyped: the TUI could not rely on it"
        decode(kind, {}, strict=True)  # every field has a default: a node may not have reported it yet


def test_numbers_past_what_a_field_holds_are_refused_not_raised():
    decoded = decode_states(
        {"model_server": {"gen_throughput": 10**400, "restarts": 2}, "chain": {"weights": {"9" * 5000: {"1": 1}}}}
    )
    assert decoded.model_servers["miner"].gen_throughput is None and decoded.model_servers["miner"].restarts == 2
    assert decoded.chain is not None and decoded.chain.weights == {}
    with pytest.raises(SchemaError, match="gen_throughput"):
        decode_states({"model_server": {"gen_throughput": 10**400}}, strict=True)
    assert decode_states({"miner-" + "9" * 5000: {}, "miner-2": {}}).miner_names()[0] == "miner-2"
    assert decode_states({"chain": {"weights": {"²": {"1": 1}, "3": {"²": 2}}}}).chain.weights == {3: {}}
