"""The Overview tab shows the node's firing alerts first (the `alerts` state, engy_node.alerts),
with their fix, and a line when notifications could not be delivered; a node with none firing
shows no alert line. Driven with Pilot over the snapshot test's deterministic node (under
`asyncio.run`, as the other Pilot tests)."""

from __future__ import annotations

import asyncio
import dataclasses

from textual.widgets import Static

from engy_tui.manager import NodeManager
from engy_tui.node_bridge import snapshot_of
from tests.engy_tui.test_manager_screens import EVENTS, SIZE, node_snapshot
from tests.engy_tui.test_validator_panel import NOW

ALERTS = {
    "firing": [
        {
            "key": "breaker_open:5Fgo smollm2-135m",
            "rule": "breaker_open",
            "level": "error",
            "subject": "5Fgo smollm2-135m",
            "text": "5Fgo smollm2-135m: breaker open: ttft p99 2185 ms > 2000 ms over 40 requests",
            "since": NOW - 60,
            "notified_at": NOW - 60,
        }
    ],
    "webhooks": 1,
    "sent": 0,
    "failed": 1,
    "last_error": "discord: HTTP 404: Unknown Webhook",
    "checked_at": NOW - 1,
}


def overview(app: NodeManager) -> str:
    return str(app.query_one("#overview-text", Static).render())


def test_the_overview_leads_with_the_firing_alerts() -> None:
    base = node_snapshot()
    states = {"alerts": ALERTS}
    snapshot = snapshot_of(dataclasses.asdict(base.node), {"states": states}, taken_at=NOW - 0.2, connected=True)
    with_alerts = dataclasses.replace(base, states=dataclasses.replace(base.states, alerts=snapshot.states.alerts))
    app = NodeManager(None, clock=lambda: NOW)

    async def body() -> None:
        async with app.run_test(size=SIZE) as pilot:
            app.show_snapshot(base, events=EVENTS)
            await pilot.press("1")
            await pilot.pause()
            assert "⚠ alert" not in overview(app)
            app.show_snapshot(with_alerts, events=[])
            await pilot.pause()
            lines = overview(app).splitlines()
            assert (
                lines[1]
                == "⚠ alert breaker_open: 5Fgo smollm2-135m: breaker open: ttft p99 2185 ms > 2000 ms over 40 requests"
            )
            assert lines[2] == "⚠ 1 alert notification(s) not delivered: discord: HTTP 404: Unknown Webhook"

    asyncio.run(body())
