"""load_balancer: the HAProxy configuration of a fleet — every leg routed by path to its host with
the others as backups, buyers to every host, layouts that cannot work refused — and accepted by
HAProxy itself (`haproxy -c`), and printed by `engy-node gateway haproxy-config`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.fleet.load_balancer import FleetHost, check_layout, haproxy_config, parse_host


def fleet(legs_per_host: list[int]) -> list[FleetHost]:
    hosts, first = [], 0
    for index, legs in enumerate(legs_per_host):
        hosts.append(
            FleetHost(
                name=f"gw-{index}",
                address=f"10.0.0.{index + 1}",
                buyer_port=8080,
                miner_port=8081,
                first_leg=first,
                legs=legs,
            )
        )
        first += legs
    return hosts


@given(st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_every_leg_goes_to_its_host_first_and_to_every_other_host_as_backup(legs_per_host):
    hosts = fleet(legs_per_host)
    text = haproxy_config(hosts)
    routes = dict(re.findall(r"use_backend (legs_\S+) if \{ path_reg \^/gw/\(([0-9|]+)\)\$ \}", text))
    routed = sorted(int(leg) for legs in routes.values() for leg in legs.split("|"))
    assert routed == list(range(sum(legs_per_host))), "each leg has exactly one route"
    for host in hosts:
        backend = text.split(f"backend legs_{host.name}\n", 1)[1].split("\n\n", 1)[0]
        servers = re.findall(r"server (\S+) (\S+) .*?( backup)?$", backend, re.M)
        assert servers[0][:2] == (host.name, f"{host.address}:{host.miner_port}") and servers[0][2] == ""
        assert sorted(name for name, _, backup in servers[1:] if backup) == sorted(
            h.name for h in hosts if h is not host
        )
    buyers = text.split("backend buyers\n", 1)[1].split("\n\n", 1)[0]
    assert len(re.findall(r"^    server ", buyers, re.M)) == len(hosts)


@pytest.mark.parametrize(
    ("legs", "message"),
    [
        ([(0, 2), (3, 1)], "cover 0..2 once each"),
        ([(0, 2), (1, 2)], "cover 0..3 once each"),
        ([(1, 1)], "cover 0..0 once each"),
    ],
)
def test_a_layout_whose_legs_do_not_tile_the_fleet_is_refused(legs, message):
    hosts = [
        FleetHost(
            name=f"gw-{i}", address="127.0.0.1", buyer_port=8080 + i, miner_port=9080 + i, first_leg=first, legs=count
        )
        for i, (first, count) in enumerate(legs)
    ]
    with pytest.raises(ValueError, match=message):
        check_layout(hosts)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("gw-a=10.0.0.1:8080:8081:0:2", FleetHost("gw-a", "10.0.0.1", 8080, 8081, 0, 2)),
        ("gw-b=[::1]:18080:18081:2:1", FleetHost("gw-b", "::1", 18080, 18081, 2, 1)),
        ("gw-c=gw-c.internal:80:81:3:4", FleetHost("gw-c", "gw-c.internal", 80, 81, 3, 4)),
    ],
)
def test_a_host_is_named_on_the_command_line_as_name_address_ports_and_legs(spec, expected):
    assert parse_host(spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "gw-a",
        "gw-a=10.0.0.1:8080",
        "=10.0.0.1:1:2:0:1",
        "gw a=h:1:2:0:1",
        "gw-a=h:0:2:0:1",
        "gw-a=h:1:2:0:0",
        "gw-a=h:x:2:0:1",
    ],
)
def test_a_malformed_host_is_refused_with_the_format(spec):
    with pytest.raises(ValueError):
        parse_host(spec)


def test_haproxy_accepts_the_configuration_the_cli_prints(tmp_path, haproxy_binary):
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "engy_node",
            "--home",
            str(tmp_path),
            "gateway",
            "haproxy-config",
            "--host",
            "gw-a=10.0.0.1:8080:8081:0:2",
            "--host",
            "gw-b=10.0.0.2:8080:8081:2:2",
            "--buyer-port",
            "18080",
            "--miner-port",
            "18081",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    assert "bind 0.0.0.0:18080" in printed.stdout and "gateway.fleet_legs = 4" in printed.stdout
    config = tmp_path / "haproxy.cfg"
    config.write_text(printed.stdout)
    checked = subprocess.run([haproxy_binary, "-c", "-f", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_cli_names_the_fix_for_a_layout_that_cannot_work(tmp_path):
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "engy_node",
            "--home",
            str(tmp_path),
            "gateway",
            "haproxy-config",
            "--host",
            "gw-a=10.0.0.1:8080:8081:0:2",
            "--host",
            "gw-b=10.0.0.2:8080:8081:3:2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 2 and "gateway.fleet_offset" in printed.stderr and "Traceback" not in printed.stderr


def test_the_configuration_in_the_operators_docs_is_the_one_the_generator_writes():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "scale-out.md").read_text()
    shown = docs.split("```haproxy\n", 1)[1].split("```", 1)[0]
    written = haproxy_config([parse_host("gw-a=10.0.0.1:8080:8081:0:2"), parse_host("gw-b=10.0.0.2:8080:8081:2:2")])
    assert shown == "".join(line + "\n" for line in written.splitlines() if not line.startswith("#"))
