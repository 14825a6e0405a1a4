"""The fleet file, the ssh tunnel command and the retry schedule of the fleet view
(`engy_node.fleet_view`): every mistake a fleet file can hold is refused naming the fix, any
valid file reads back what it says, and the tunnel command can never be turned into an option
or bind beyond loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.errors import ConfigError
from engy_node.fleet_view import (
    EXAMPLE,
    RETRY_CAP_S,
    FleetNode,
    load_fleet,
    parse_fleet,
    retry_in,
    ssh_command,
)


def test_the_documented_example_reads_as_written(tmp_path):
    nodes = parse_fleet(EXAMPLE, base_dir=tmp_path)
    assert nodes == [
        FleetNode("rig-a", url="http://127.0.0.1:18083", token_file=Path.home() / ".config/engy/rig-a.token"),
        FleetNode("rig-b", ssh="miner@rig-b", port=18083, token_file=tmp_path / "rig-b.token"),
    ]
    assert [node.via for node in nodes] == ["http://127.0.0.1:18083", "ssh miner@rig-b:18083"]


def test_a_missing_fleet_file_is_refused_with_an_example_to_write(tmp_path):
    with pytest.raises(ConfigError, match=r"no fleet file at .*fleet\.toml: write one") as raised:
        load_fleet(tmp_path / "fleet.toml")
    assert "[[node]]" in str(raised.value)


def test_a_relative_token_file_is_read_beside_the_fleet_file(tmp_path):
    (tmp_path / "fleet.toml").write_text('[[node]]\nname = "a"\nurl = "http://127.0.0.1:1/"\ntoken_file = "a.token"\n')
    assert load_fleet(tmp_path / "fleet.toml") == [
        FleetNode("a", url="http://127.0.0.1:1", token_file=tmp_path / "a.token")
    ]


NODE = '[[node]]\nname = "a"\n'
URL = 'url = "http://127.0.0.1:18083"\n'
TOKEN = 'token = "t"\n'


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("[[node", "is not valid TOML"),
        ("", "lists no nodes: add one [[node]] table per node"),
        ('title = "x"\n' + NODE + URL + TOKEN, "unknown top-level key(s) 'title'"),
        (NODE + URL + TOKEN + 'tokn_file = "x"\n', "unknown key 'tokn_file'; did you mean 'token_file'?"),
        ("[[node]]\n" + URL + TOKEN, 'needs a name: name = "rig-a"'),
        ('[[node]]\nname = "-x"\n' + URL + TOKEN, "needs a name"),
        (NODE + TOKEN, "needs exactly one of url"),
        (NODE + URL + 'ssh = "h"\nport = 1\n' + TOKEN, "needs exactly one of url"),
        (NODE + 'url = "127.0.0.1:18083"\n' + TOKEN, 'is not an http(s) URL; write url = "http://127.0.0.1:18083"'),
        (NODE + 'ssh = "-oProxyCommand=x"\nport = 1\n' + TOKEN, "is not an ssh destination"),
        (NODE + 'ssh = "a b"\nport = 1\n' + TOKEN, "no spaces, no leading -"),
        (NODE + 'ssh = "h"\n' + TOKEN, "needs port = N: the control API's port on that host"),
        (NODE + 'ssh = "h"\nport = 70000\n' + TOKEN, "1..65535"),
        (NODE + 'ssh = "h"\nport = true\n' + TOKEN, "got True"),
        (NODE + URL + "port = 1\n" + TOKEN, "port goes with ssh; with url, put the port in the URL"),
        (NODE + URL, "needs exactly one of token_file"),
        (NODE + URL + TOKEN + 'token_file = "x"\n', "needs exactly one of token_file"),
        (NODE + URL + 'token = " "\n', "token must be the text of the node's control.token"),
        (NODE + URL + "token_file = 3\n", 'token_file must be a path, e.g. token_file = "rig-a.token"'),
        (NODE + URL + TOKEN + NODE + URL + TOKEN, "two nodes are named 'a'; give each [[node]] its own name"),
        ("node = 3\n", "lists no nodes"),
    ],
)
def test_each_mistake_is_refused_naming_the_file_the_node_and_the_fix(text, fix):
    with pytest.raises(ConfigError) as raised:
        parse_fleet(text, where="fleet.toml")
    message = str(raised.value)
    assert message.startswith("fleet.toml") and fix in message


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
hosts = st.from_regex(r"([a-z][a-z0-9]{0,8}@)?[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True)
ports = st.integers(1, 65535)
tokens = st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True)


@st.composite
def fleet_nodes(draw: st.DrawFn) -> list[FleetNode]:
    chosen = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    nodes = []
    for name in chosen:
        token = draw(st.one_of(st.builds(lambda t: ("token", t), tokens), st.builds(lambda t: ("file", t), names)))
        tokens_of = {"token": token[1]} if token[0] == "token" else {"token_file": Path("/fleet") / f"{token[1]}.token"}
        if draw(st.booleans()):
            nodes.append(FleetNode(name, url=f"http://127.0.0.1:{draw(ports)}", **tokens_of))
        else:
            nodes.append(FleetNode(name, ssh=draw(hosts), port=draw(ports), **tokens_of))
    return nodes


def as_toml(nodes: list[FleetNode]) -> str:
    tables = []
    for node in nodes:
        fields = {"name": node.name, "url": node.url, "ssh": node.ssh, "port": node.port, "token": node.token}
        fields["token_file"] = node.token_file.name if node.token_file is not None else None
        tables.append(
            "[[node]]\n"
            + "".join(f"{key} = {json.dumps(value)}\n" for key, value in fields.items() if value is not None)
        )
    return "\n".join(tables)


@given(fleet_nodes())
def test_any_valid_fleet_reads_back_what_it_says(nodes):
    assert parse_fleet(as_toml(nodes), base_dir=Path("/fleet")) == nodes


@given(hosts, ports, ports)
def test_the_tunnel_forwards_loopback_to_loopback_and_the_host_is_never_an_option(host, local, remote):
    command = ssh_command(host, local_port=local, remote_port=remote)
    assert command[:4] == ["ssh", "-N", "-L", f"127.0.0.1:{local}:127.0.0.1:{remote}"]
    assert command[-2:] == ["--", host]
    assert "BatchMode=yes" in command and "ExitOnForwardFailure=yes" in command


@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/x", "", "a b", "-"])
def test_a_host_that_ssh_would_read_as_an_option_is_refused(host):
    with pytest.raises(ValueError, match="not an ssh destination"):
        ssh_command(host, local_port=1, remote_port=1)


@pytest.mark.parametrize("port", [0, 65536, True])
def test_ports_outside_1_to_65535_are_refused(port):
    with pytest.raises(ValueError, match="1..65535"):
        ssh_command("h", local_port=port, remote_port=1)


@given(st.integers(1, 200), st.floats(0, 1, exclude_max=True))
def test_retries_back_off_and_never_wait_past_the_cap(failures, jitter):
    assert 0 < retry_in(failures, jitter=jitter) <= retry_in(failures + 1, jitter=jitter) <= RETRY_CAP_S
