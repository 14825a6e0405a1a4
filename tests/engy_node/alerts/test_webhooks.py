"""The webhook message: a recovery says how long the alert fired, in the node's one duration
wording (`engy_node.durations`), the same as the TUI and `engy-node status`."""

from __future__ import annotations

import pytest

from engy_node.alerts.rules import Notification
from engy_node.alerts.state import Alert
from engy_node.alerts.webhooks import message

ALERT = Alert("gpu:0", "gpu", "error", "GPU 0", "GPU 0: Xid 79", since=1_800_000_000.0)


@pytest.mark.parametrize(
    ("fired_s", "shown"),
    [(95, "95 s"), (42 * 60 + 30, "42 min"), (3 * 3600 + 5 * 60, "3 h 5 min"), (2 * 86400 + 4 * 3600, "2 d 4 h")],
)
def test_a_recovery_says_how_long_the_alert_fired(fired_s, shown):
    note = Notification("resolved", ALERT, ALERT.since + fired_s)
    assert message(note, node="rig-1") == f"✅ RESOLVED [rig-1] gpu: GPU 0: Xid 79 (fired for {shown})"
    assert message(Notification("firing", ALERT, ALERT.since), node="rig-1") == "🔴 FIRING [rig-1] gpu: GPU 0: Xid 79"
