"""The fleet view (`engy-tui --fleet`): its rows as a plain function over fixed node states, the
screen under Pilot with one SVG snapshot, and a fleet of three real `engy-node --role gateway`
processes plus two entries that cannot answer (nothing listening; an ssh tunnel that cannot open)
on one screen, with Enter opening a node's tabs and Esc coming back.

As in test_manager.py, Pilot tests are plain functions driving the app with `asyncio.run`, and
waits are bounded loops over `pilot.pause()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from textual.widgets import DataTable, Static

from engy_node.control import Actions, serve_control
from engy_node.fleet_view import FleetNode
from engy_node.hub import Hub
from engy_node.snapshots import STATE_SCHEMA
from engy_tui.app import build_app, main
from engy_tui.fleet_bridge import FleetBridge, NodeWatch, TunnelError, open_tunnel
from engy_tui.node_bridge import snapshot_of
from engy_tui.screens.fleet import COLUMNS, FleetManager, FleetScreen, fleet_rows
from tests.waiting import ProcessOutput

NOW = 1_800_000_000.0
SIZE = (160, 24)
WAIT_S = 30.0
STOP_S = 30.0
GIB = 1024**3


def metrics(ttft_p99: float, tpot_p99: float, ok: int, failed: int) -> dict:
    def histogram(p99: float) -> dict:
        window = {"count": 50, "sum": 1.0, "mean": 0.1, "p50": p99 / 3, "p95": p99 / 2, "p99": p99, "max": p99}
        return {"type": "histogram", "children": [{"labels": {}, "window": window}]}

    return {
        "engy_miner_ttft_seconds": histogram(ttft_p99),
        "engy_miner_tpot_seconds": histogram(tpot_p99),
        "engy_miner_requests_total": {
            "type": "counter",
            "children": [
                {"labels": {"outcome": "ok"}, "value": ok},
                {"labels": {"outcome": "timeout"}, "value": failed},
            ],
        },
    }


def gpu(index: int, *, temperature: int, util: int, used_gb: float) -> dict:
    return {
        "index": index,
        "name": "RTX 4090",
        "temperature_c": temperature,
        "gpu_util_percent": util,
        "memory_used_bytes": int(used_gb * GIB),
        "memory_total_bytes": 24 * GIB,
    }


MINER_STATES = {
    "miner": {"model": "qwen3.6-35b-a3b", "hotkey": "5Rig", "legs": 2, "legs_up": 2},
    "gpus": {
        "samples": [gpu(0, temperature=64, util=93, used_gb=21.9), gpu(1, temperature=71, util=91, used_gb=21.9)],
        "findings": [{"gpu": 1, "kind": "pcie", "level": "warning", "text": "GPU 1 runs at PCIe x8 (max x16)"}],
    },
    "chain": {"neurons": [{"uid": 17, "hotkey": "5Rig", "incentive": 0.0231}]},
    "alerts": {"firing": []},
}
GATEWAY_STATES = {
    "gateway": {"state": "serving"},
    "traffic": {
        "workers": [
            {"miner": "5Rig", "lifetime": {"served": 1204, "pass": 1199, "cheat": 0, "unproven": 2}},
            {"miner": "5Other", "lifetime": {"served": 88, "pass": 85, "cheat": 3, "unproven": 0}},
        ]
    },
    "alerts": {
        "firing": [
            {
                "key": "breaker_open:5Other",
                "rule": "breaker_open",
                "level": "error",
                "subject": "5Other",
                "text": "breaker open after 3 cheats; the miner is pulled",
            }
        ]
    },
}


def watch(name: str, states: dict, *, roles: list[str], metrics_: dict | None = None, **fields) -> NodeWatch:
    body = {"schema": STATE_SCHEMA, "states": states, "metrics": metrics_ or {}}
    snapshot = snapshot_of({"roles": roles}, body, taken_at=NOW - 1, connected=True)
    return NodeWatch(FleetNode(name, url=f"http://127.0.0.1:1808{len(name)}", token="t"), snapshot=snapshot, **fields)


def three_nodes() -> list[NodeWatch]:
    rig = watch("rig-a", MINER_STATES, roles=["miner"], metrics_=metrics(0.690, 0.035, ok=18_402, failed=3))
    gateway = watch("gw-1", GATEWAY_STATES, roles=["gateway"], url="http://127.0.0.1:18083")
    gone = NodeWatch(
        FleetNode("rig-b", ssh="miner@rig-b", port=18083, token_file=Path("rig-b.token")),
        error="ssh to miner@rig-b exited with status 255: ssh: connect to host rig-b port 22: Connection refused",
        failures=3,
        retry_at=NOW + 8,
    )
    return [rig, gateway, gone]


def texts(rows) -> dict[str, list[str]]:
    return {row.key: [cell.text for cell in row.cells] for row in rows}


def test_rows_say_each_nodes_figures_its_gpus_and_why_a_node_is_unreachable():
    rows = texts(fleet_rows(three_nodes(), now=NOW))
    assert list(rows) == ["rig-a", "rig-a/gpu0", "rig-a/gpu1", "gw-1", "rig-b"]
    named = {key: dict(zip(COLUMNS, cells, strict=True)) for key, cells in rows.items()}
    assert named["rig-a"] | {"note": ""} == {
        "node": "rig-a",
        "roles": "miner",
        "state": "● up",
        "served": "18,402",
        "pass": "—",
        "TTFT p99": "690 ms",
        "TPOT p99": "35.0 ms",
        "incentive": "0.0231",
        "alerts": "none ✔",
        "note": "",
    }
    assert named["rig-a/gpu0"]["state"] == "64°C · 93% · 21.9/24.0 GB"
    assert named["rig-a/gpu1"]["alerts"] == "⚠ 1" and "PCIe x8" in named["rig-a/gpu1"]["note"]
    assert named["gw-1"]["served"] == "1,292" and named["gw-1"]["pass"] == "99.6%"
    assert named["gw-1"]["alerts"] == "✘ 1" and named["gw-1"]["note"].startswith("5Other: breaker open")
    assert named["rig-b"]["state"] == "✘ unreachable, retry in 8 s"
    assert named["rig-b"]["note"].startswith("ssh to miner@rig-b exited with status 255")


def test_an_unreachable_node_keeps_what_it_last_said_greyed_and_says_when_it_answered():
    answered = three_nodes()[0]
    lost = dataclasses.replace(answered, error="no engy node answers at http://127.0.0.1:18086", failures=1)
    row = fleet_rows([lost], now=NOW + 60)[0]
    assert row.cells[3].text == "18,402" and row.cells[3].style == "na"
    assert "last answered 61 s ago" in row.detail and "no engy node answers" in row.detail


def test_a_node_that_has_not_answered_yet_is_connecting_with_dashes_not_zeros():
    row = fleet_rows([NodeWatch(FleetNode("new", url="http://127.0.0.1:1", token="t"))], now=NOW)[0]
    assert [cell.text for cell in row.cells][2:9] == ["… connecting", "—", "—", "—", "—", "—", "—"]


def test_a_node_of_a_newer_schema_is_read_liberally_and_says_to_upgrade():
    body = {"schema": STATE_SCHEMA + 1, "states": {"alerts": {"firing": [], "renamed_later": 1}, "new_thing": {}}}
    snapshot = snapshot_of({"roles": ["gateway"]}, body, taken_at=NOW, connected=True)
    row = fleet_rows([NodeWatch(FleetNode("next", url="http://127.0.0.1:1", token="t"), snapshot=snapshot)], now=NOW)[0]
    cells = dict(zip(COLUMNS, (cell.text for cell in row.cells), strict=True))
    assert cells["state"] == "● up" and cells["alerts"] == "none ✔"
    assert cells["note"].startswith(f"⚠ its state schema {STATE_SCHEMA + 1} is newer")
    assert "upgrade engy-tui" in row.detail


def fixed_app() -> FleetManager:
    fleet = FleetBridge([w.node for w in three_nodes()])
    fleet.watches = {w.node.name: w for w in three_nodes()}
    return FleetManager(fleet, source="fleet.toml", dial=False, clock=lambda: NOW)


def test_fleet_snapshot(snap_compare):
    async def settle(pilot) -> None:
        await pilot.pause()

    assert snap_compare(fixed_app(), terminal_size=SIZE, run_before=settle)


def test_over_the_fleet_node_keys_do_nothing_and_an_unreachable_node_says_why_on_enter():
    app = fixed_app()

    async def body() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen), "the fleet screen shown")
            await pilot.press("2", "p")  # the miner tab and traffic keys belong to a node's tabs
            assert isinstance(app.screen, FleetScreen)
            table = app.screen.query_one(DataTable)
            table.move_cursor(row=4)
            await pilot.press("enter")
            await wait_for(
                pilot,
                lambda: any("rig-b does not answer: ssh to miner@rig-b" in str(n.message) for n in app._notifications),
                "the reason notified",
            )
            assert isinstance(app.screen, FleetScreen) and app.opened is None
            await pilot.press("q")

    asyncio.run(body())


def test_a_fleet_file_that_is_not_there_is_refused_before_the_screen_opens(tmp_path, capsys):
    assert main(["--home", str(tmp_path), "--fleet", str(tmp_path / "fleet.toml")]) == 2
    assert f"engy-tui: no fleet file at {tmp_path / 'fleet.toml'}: write one" in capsys.readouterr().err


def test_the_palette_opens_a_node_by_name_and_goes_back_to_the_fleet():
    app = fixed_app()
    app.fleet.watches["gw-1"] = dataclasses.replace(app.fleet.watches["gw-1"], token="t")

    async def body() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen), "the fleet screen shown")
            await pilot.press("ctrl+p")
            await pilot.press(*"node gw-1", "enter")
            await wait_for(pilot, lambda: app.opened == "gw-1", "gw-1 opened from the palette")
            assert not isinstance(app.screen, FleetScreen) and app.bridge is not None
            await pilot.press("ctrl+p")
            await pilot.press(*"back to the fleet", "enter")
            await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen), "back on the fleet")
            assert app.opened is None and app.bridge is None
            await pilot.press("q")

    asyncio.run(body())


# ---- the watcher --------------------------------------------------------------------------------


async def test_a_tunnel_that_cannot_open_quotes_ssh():
    """Real ssh, to a loopback port nothing serves: it exits at once and says why."""
    with pytest.raises(TunnelError) as raised:
        async with open_tunnel(f"ssh://127.0.0.1:{free_port()}", local_port=free_port(), remote_port=18083):
            pytest.fail("the tunnel opened")
    assert "exited with status 255" in str(raised.value) and "Connection refused" in str(raised.value)
    assert not raised.value.opened


async def test_an_unreachable_node_says_why_and_is_dialled_again_until_it_answers(tmp_path):
    """No node, and no token file yet: the row's reason is the missing token; once a node serves
    there, a retry finds it (the token is read at each dial, not once)."""
    port = free_port()
    node = FleetNode("late", url=f"http://127.0.0.1:{port}", token_file=tmp_path / "control.token")
    fleet = FleetBridge([node], jitter=lambda: 0.0)

    async def until(condition: Callable[[], bool], what: str) -> None:
        with trio.move_on_after(WAIT_S):
            while not condition():
                await trio.sleep(0.05)
        assert condition(), f"not {what} within {WAIT_S} s"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fleet._run)
        await until(lambda: fleet.watches["late"].failures >= 1, "a failed attempt recorded")
        first = fleet.watches["late"]
        assert first.error is not None and "no control token at" in first.error and first.retry_at is not None
        await nursery.start(
            lambda task_status: serve_control(
                Hub(),
                data_dir=tmp_path,
                actions=Actions(),
                node_info={"roles": ["gateway"]},
                port=port,
                task_status=task_status,
            )
        )
        await until(lambda: fleet.watches["late"].up, "the node up after a retry")
        assert fleet.watches["late"].failures == 0 and fleet.watches["late"].snapshot.node.roles == ("gateway",)
        nursery.cancel_scope.cancel()


FORWARDER = """#!{python}
# Stands in for ssh where no sshd runs: does what `ssh -N -L` does (forward a loopback port).
import os, socket, sys, threading

spec = sys.argv[sys.argv.index("-L") + 1]
bind, local, host, remote = spec.split(":")
with open(os.environ["FORWARDER_PIDS"], "a") as pids:
    pids.write(f"{{os.getpid()}}\\n")
server = socket.create_server((bind, int(local)))

def pipe(source, sink):
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        sink.close()

while True:
    client, _ = server.accept()
    upstream = socket.create_connection((host, int(remote)))
    threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
"""


async def test_a_node_behind_a_tunnel_is_read_through_it_and_the_tunnel_ends_with_the_watch(tmp_path, monkeypatch):
    """The tunnel's lifecycle with a forwarder in ssh's place (no sshd here): the node is read
    through the tunnel's local end, and once the watch is cancelled the process is gone."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FORWARDER.format(python=sys.executable))
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FORWARDER_PIDS", str(tmp_path / "pids"))
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(
            lambda task_status: serve_control(
                Hub(),
                data_dir=tmp_path / "node",
                actions=Actions(),
                node_info={"roles": ["miner"]},
                task_status=task_status,
            )
        )
        remote_port = int(endpoint.url.rsplit(":", 1)[1])
        fleet = FleetBridge([FleetNode("far", ssh="miner@far", port=remote_port, token_file=endpoint.token_file)])
        async with trio.open_nursery() as watching:
            watching.start_soon(fleet._run)
            with trio.move_on_after(WAIT_S):
                while not fleet.watches["far"].up:
                    await trio.sleep(0.05)
            watch = fleet.watches["far"]
            assert watch.up and watch.snapshot is not None and watch.snapshot.node.roles == ("miner",)
            assert watch.url is not None and watch.url != endpoint.url  # read through the tunnel
            watching.cancel_scope.cancel()
        [pid] = [int(line) for line in (tmp_path / "pids").read_text().split()]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # ended and reaped with the watch
        nursery.cancel_scope.cancel()


async def test_a_token_file_that_cannot_be_read_is_the_nodes_reason_not_the_views_end(tmp_path):
    fleet = FleetBridge([FleetNode("odd", url=f"http://127.0.0.1:{free_port()}", token_file=tmp_path)])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fleet._run)
        with trio.move_on_after(WAIT_S):
            while fleet.watches["odd"].error is None:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert f"cannot read the token file {tmp_path}" in (fleet.watches["odd"].error or "")


# ---- three real nodes ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def three_gateways(tmp_path) -> Iterator[list[Path]]:
    """Three `engy-node --role gateway` processes (the cheapest role with a control API, a
    published state and an alert task), each in its own home on free loopback ports."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "ENGY_GATEWAY__PORT": "0",
        "ENGY_GATEWAY__MINER_PORT": "0",
        "ENGY_GATEWAY__PROVIDER_PORT": "0",
        "ENGY_GATEWAY__DRAIN_S": "1",
    }
    homes = [tmp_path / f"gw-{n}" for n in (1, 2, 3)]
    processes: list[subprocess.Popen] = []
    try:
        outputs = []
        for home in homes:
            process = subprocess.Popen(
                [sys.executable, "-m", "engy_node", "--home", str(home), "--role", "gateway"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            processes.append(process)
            outputs.append(ProcessOutput(process, tmp_path / f"{home.name}.log"))
        for output in outputs:
            output.wait_for("node running", timeout_s=WAIT_S, what="the gateway node running")
        yield homes
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_S)


async def wait_for(pilot, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {WAIT_S} s"
        await pilot.pause(0.05)


def test_a_fleet_of_three_local_nodes_shows_in_one_screen_and_opens_each_nodes_tabs(three_gateways, tmp_path):
    entries = []
    for home in three_gateways:
        endpoint = json.loads((home / "data" / "control.json").read_text())
        entries.append(
            f'[[node]]\nname = "{home.name}"\nurl = "{endpoint["url"]}"\ntoken_file = "{endpoint["token_file"]}"\n'
        )
    (tmp_path / "gone.token").write_text("not-used")
    entries.append(f'[[node]]\nname = "gone"\nurl = "http://127.0.0.1:{free_port()}"\ntoken_file = "gone.token"\n')
    # Nothing serves ssh on this loopback port, so ssh itself fails and the row quotes it.
    entries.append(f'[[node]]\nname = "tunnelled"\nssh = "ssh://127.0.0.1:{free_port()}"\nport = 18083\ntoken = "x"\n')
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text("\n".join(entries))
    app = build_app(["--home", str(tmp_path / "tui"), "--fleet", str(fleet_file)])
    assert isinstance(app, FleetManager)

    def rows() -> dict[str, dict[str, str]]:
        shown = fleet_rows(app.fleet.watches.values(), now=time.time())
        return {row.key: {c: cell.text for c, cell in zip(COLUMNS, row.cells, strict=True)} for row in shown}

    async def body() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(
                pilot,
                lambda: (
                    all(rows()[home.name]["state"] == "● up" for home in three_gateways)
                    and all(rows()[name]["state"].startswith("✘ unreachable") for name in ("gone", "tunnelled"))
                ),
                "three nodes up and two unreachable",
            )
            shown = rows()
            for home in three_gateways:
                assert shown[home.name] | {"note": ""} == {
                    "node": home.name,
                    "roles": "gateway",
                    "state": "● up",
                    "served": "0",
                    "pass": "0 judged",
                    "TTFT p99": "—",
                    "TPOT p99": "—",
                    "incentive": "—",
                    "alerts": "none ✔",
                    "note": "",
                }
            assert "no engy node answers" in shown["gone"]["note"]
            assert shown["tunnelled"]["note"].startswith("ssh to ssh://127.0.0.1:")
            table = app.screen.query_one(DataTable)
            assert table.row_count == 5

            await pilot.press("down", "enter")  # the second node's tabs
            await wait_for(pilot, lambda: app.opened == "gw-2", "gw-2 opened")
            header = lambda: str(app.query_one("#node-header", Static).render())  # noqa: E731
            await wait_for(pilot, lambda: "● attached" in header(), "gw-2's header filled in")
            assert "gateway" in header()
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen), "back on the fleet")
            assert app.opened is None and app.bridge is None
            await pilot.press("enter")  # again, and quit from its tabs: the node's bridge and the fleet stop
            await wait_for(pilot, lambda: app.opened == "gw-2" and "● attached" in header(), "gw-2 open again")
            opened.append(app.bridge)
            await pilot.press("q")

    opened: list = []
    asyncio.run(body())
    assert not app.fleet.running and opened[0] is not None and not opened[0].running
