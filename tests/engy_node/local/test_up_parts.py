"""The parts of `engy-node up` that decide things without running a network: ports, and the
network file's life (written private, removed only by the process that wrote it)."""

from __future__ import annotations

import os

import pytest

from engy_node.calibration import SIMULATED_CHEATS
from engy_node.config import load_config
from engy_node.errors import EngyError
from engy_node.local.up import (
    HOTKEY_NAMES,
    MINERS,
    LocalIdentities,
    local_config,
    network_file,
    parse_cheats,
    port_plan,
    read_network,
    remove_network,
    write_network,
)


def test_a_port_base_lays_out_four_consecutive_ports():
    assert port_plan(9000, buyer=None, miner=None, provider=None, control=None) == {
        "buyer": 9000,
        "miner": 9001,
        "provider": 9002,
        "control": 9003,
    }


def test_a_single_port_flag_wins_over_the_base():
    assert port_plan(9000, buyer=None, miner=7000, provider=None, control=0)["miner"] == 7000
    assert port_plan(9000, buyer=None, miner=7000, provider=None, control=0)["control"] == 0


def test_port_base_zero_picks_free_ports_everywhere():
    assert set(port_plan(0, buyer=None, miner=None, provider=None, control=None).values()) == {0}


def test_without_a_base_only_the_flags_given_are_set():
    assert port_plan(None, buyer=8000, miner=None, provider=None, control=None) == {
        "buyer": 8000,
        "miner": None,
        "provider": None,
        "control": None,
    }


@pytest.mark.parametrize("base", [65533, 70000, -1])
def test_a_base_that_leaves_no_room_for_four_ports_is_refused(base):
    with pytest.raises(EngyError, match="--port-base"):
        port_plan(base, buyer=None, miner=None, provider=None, control=None)


def test_the_network_file_is_private_and_removed_only_by_its_writer(tmp_path):
    config = load_config(home=tmp_path, env={})
    write_network(config, {"pid": os.getpid(), "buyer_key": "engy-sk-x"})
    assert (network_file(config).stat().st_mode & 0o777) == 0o600
    remove_network(config, os.getpid() + 1)  # another process's exit: not its file
    assert read_network(config)["buyer_key"] == "engy-sk-x"
    remove_network(config, os.getpid())
    assert not network_file(config).exists()


def test_cheat_flags_name_a_local_miner_and_a_simulated_cheat():
    assert parse_cheats([]) == {}
    assert parse_cheats(["miner-2=noise-1%"]) == {"miner-2": "noise-1%"}
    assert parse_cheats([" miner-1 = quantised-8bit", "miner-2=noise-0.1%"]) == {
        "miner-1": "quantised-8bit",
        "miner-2": "noise-0.1%",
    }


@pytest.mark.parametrize(
    ("specs", "fragments"),
    [
        (["miner-2"], ["MINER=CHEAT", "miner-2=noise-1%"]),
        (["=noise-1%"], ["MINER=CHEAT"]),
        (["miner-9=noise-1%"], ["no local miner 'miner-9'", *MINERS]),
        (["miner-2=noise-2%"], ["'noise-2%' is not a simulated cheat", *SIMULATED_CHEATS]),
        (["miner-2=noise-1%", "miner-2=quantised-8bit"], ["already simulates 'noise-1%'"]),
    ],
)
def test_a_wrong_cheat_flag_is_refused_with_the_names_there_are(specs, fragments):
    with pytest.raises(EngyError) as refused:
        parse_cheats(specs)
    assert all(fragment in str(refused.value) for fragment in fragments), str(refused.value)


def test_a_miner_simulating_a_cheat_is_not_first_party_so_it_can_be_pulled(tmp_path):
    config = load_config(home=tmp_path, env={})
    identities = LocalIdentities(1, "engy-sk-x", {name: f"5{name}" for name in HOTKEY_NAMES})
    honest = local_config(config, identities, {})
    assert honest.gateway.first_party.split(",") == [f"5{name}" for name in MINERS]
    cheating = local_config(config, identities, {}, {MINERS[-1]: "noise-1%"})
    assert cheating.gateway.first_party.split(",") == [f"5{name}" for name in MINERS[:-1]]
