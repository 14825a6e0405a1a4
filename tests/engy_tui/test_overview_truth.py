"""The Overview tells the same story as the other tabs (issue 34): a miner whose link to the
gateway is down is an error with its reason in the requests panel, never "none ✔" beside a Miner
tab that shows the link ✘; its lifetime total names its source (the miners' count, probes
included), which the demo traffic's "sent" and the gateway's billed requests are parts of. Driven with Pilot over the snapshot test's deterministic node (under
`asyncio.run`, as the other Pilot tests), with the miners' metrics from a real registry."""

from __future__ import annotations

import asyncio
import dataclasses

from textual.widgets import Static

from engy_tui.manager import NodeManager
from engy_tui.node_bridge import NodeSnapshot
from tests.engy_tui.test_manager_screens import EVENTS, node_snapshot
from tests.engy_tui.test_narrow_screens import cut_lines
from tests.engy_tui.test_requests_panel import Miner
from tests.engy_tui.test_validator_panel import NOW

SIZE = (100, 30)
DNS_FAILURE = "cannot reach wss://gw.example/gw: DNS lookup failed (Name or service not known)"


def with_link_down(snapshot: NodeSnapshot, metrics: dict, **link: object) -> NodeSnapshot:
    miner = dataclasses.replace(snapshot.states.miners["miner-1"], legs_up=0, **link)
    states = dataclasses.replace(snapshot.states, miners={**snapshot.states.miners, "miner-1": miner})
    return dataclasses.replace(snapshot, states=states, metrics=metrics)


def traffic_text(app: NodeManager) -> str:
    return str(app.query_one("#traffic", Static).render())


def notes_text(app: NodeManager) -> str:
    return str(app.query_one("#notes", Static).render())


async def show_two_frames(app: NodeManager, pilot, clock: list[float], **link: object) -> None:
    """Two frames two seconds apart, no request failing in between: the panel has a window."""
    miner = Miner()
    clock[0] = NOW - 2
    app.show_snapshot(with_link_down(node_snapshot(), miner.serve(3), **link), events=EVENTS)
    clock[0] = NOW
    app.show_snapshot(with_link_down(node_snapshot(), miner.serve(3), **link), events=[])
    await pilot.pause()


def test_a_miner_link_down_is_an_error_with_its_reason_not_none():
    clock = [NOW]

    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: clock[0])
        async with app.run_test(size=SIZE) as pilot:
            await show_two_frames(app, pilot, clock, link_error=DNS_FAILURE)
            traffic = traffic_text(app)
            assert "none" not in traffic and "✔" not in traffic.split("errors", 1)[1]
            assert "✘ 1 miner link down" in traffic
            assert f"✘ miner-1 has no leg up at the gateway: {DNS_FAILURE}" in notes_text(app)
            assert not cut_lines(app), "the requests panel fits 100 columns"

    asyncio.run(scenario())


def test_the_lifetime_total_names_whose_count_it_is():
    clock = [NOW]

    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: clock[0])
        async with app.run_test(size=SIZE) as pilot:
            await show_two_frames(app, pilot, clock)
            served = traffic_text(app).splitlines()[2]
            assert served.startswith("served    6 requests since the node started, 0 failed")
            assert served.endswith("(the miners' count, probes included)")
            overview = str(app.query_one("#overview-text", Static).render())
            assert "demo traffic  running: 41 sent by the demo buyer, 41 ok, 0 failed" in overview

    asyncio.run(scenario())


def test_a_denied_miner_quotes_the_gateways_reason():
    clock = [NOW]
    denied = "hotkey 5Fgo…RUgd is not registered on netuid 53: register it with btcli subnet register"

    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: clock[0])
        async with app.run_test(size=SIZE) as pilot:
            await show_two_frames(app, pilot, clock, denied=denied)
            assert "✘ 1 miner link down" in traffic_text(app)
            assert denied in notes_text(app)

    asyncio.run(scenario())


def test_a_miner_link_down_snapshot(snap_compare, utc):
    clock = [NOW]
    app = NodeManager(None, clock=lambda: clock[0])

    async def show(pilot) -> None:
        await show_two_frames(app, pilot, clock, link_error=DNS_FAILURE)

    assert snap_compare(app, terminal_size=SIZE, run_before=show)
