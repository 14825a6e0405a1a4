"""The alert task end to end: a real hub, the task posting to a real HTTP receiver on 127.0.0.1
in each chat service's shape, one notification per episode and a recovery message; a receiver
that fails is retried, then given up and reported."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from engy_node.alerts.settings import AlertsSection
from engy_node.alerts.task import run_alerts
from engy_node.control import fetch_status, read_endpoint, read_token
from engy_node.hub import Hub
from engy_node.local.status import status_text
from engy_node.snapshots import NodeInfo, decode_states
from tests.waiting import ProcessOutput

WAIT_S = 30.0
"""A bound on each wait for the task, never a timing claim."""


class Receiver:
    """A webhook receiver: records each POST (path, JSON body); answers `status`."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.posts: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def bodies(self, path: str) -> list[dict]:
        with self.lock:
            return [body for where, body in self.posts if where == path]


@contextmanager
def receiver(status: int = 200) -> Iterator[tuple[Receiver, str]]:
    record = Receiver(status)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with record.lock:
                record.posts.append((self.path, body))
            self.send_response(record.status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield record, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


async def checks_after(hub: Hub, count: int) -> None:
    """Wait until the task has run `count` more checks."""
    seen: set[float] = set()
    with trio.fail_after(WAIT_S):
        while len(seen) < count + 1:
            checked = hub.states().get("alerts", {}).get("checked_at")
            if checked is not None:
                seen.add(checked)
            await trio.sleep(0.01)


def firing_gauge(hub: Hub) -> dict[str, float]:
    """`engy_alerts_firing` by rule, the rules at 0 left out."""
    children = hub.registry.snapshot()["engy_alerts_firing"]["children"]
    return {child["labels"]["rule"]: child["value"] for child in children if child["value"]}


PULLED = {
    "workers": [
        {
            "miner": "5Miner",
            "model": "smollm2-135m",
            "state": "pulled",
            "reason": "3 failures in a row within 5 min",
            "history": [{"from": "active", "to": "pulled", "code": "failures-in-a-row"}],
        }
    ]
}


async def test_an_alert_reaches_each_webhook_once_then_its_recovery() -> None:
    with receiver() as (record, base):
        section = AlertsSection(
            webhooks=f"json={base}/json,discord={base}/discord,slack={base}/slack,"
            f"telegram={base}/bot123:abc/sendMessage?chat_id=42",
            check_s=0.02,
            timeout_s=5.0,
        )
        hub = Hub()
        hub.set_state("traffic", **PULLED)
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_alerts, section, hub, node="rig-1"))
            await checks_after(hub, 5)
            states = decode_states(hub.states(), strict=True)
            assert states.alerts is not None and [a.key for a in states.alerts.firing] == [
                "breaker_open:5Miner smollm2-135m"
            ]
            assert "⚠ alert breaker_open: 5Miner smollm2-135m: breaker open" in status_text(NodeInfo(), states)
            assert firing_gauge(hub) == {"breaker_open": 1.0}
            hub.set_state("traffic", workers=[{**PULLED["workers"][0], "state": "active"}])
            await checks_after(hub, 5)
            assert firing_gauge(hub) == {}
            nursery.cancel_scope.cancel()

        events = [body["status"] for body in record.bodies("/json")]
        assert events == ["firing", "resolved"]
        firing, resolved = record.bodies("/json")
        assert firing["key"] == resolved["key"] == "breaker_open:5Miner smollm2-135m"
        assert firing["node"] == "rig-1" and firing["level"] == "error"
        assert "3 failures in a row" in firing["text"]
        assert resolved["message"].startswith("✅ RESOLVED [rig-1] breaker_open:")
        marks = ["🔴 FIRING", "✅ RESOLVED"]
        assert [body["content"].split(" [")[0] for body in record.bodies("/discord")] == marks
        assert [body["text"].split(" [")[0] for body in record.bodies("/slack")] == marks
        telegram = record.bodies("/bot123:abc/sendMessage")
        assert [(body["chat_id"], body["text"].split(" [")[0]) for body in telegram] == [("42", m) for m in marks]
        state = decode_states(hub.states(), strict=True).alerts
        assert state is not None and state.firing == () and state.sent == 8 and state.failed == 0


async def test_a_failing_webhook_is_retried_then_reported(caplog) -> None:
    with receiver(status=500) as (record, base):
        section = AlertsSection(webhooks=f"json={base}/hook", check_s=0.02, timeout_s=5.0, retries=1)
        hub = Hub()
        hub.set_state("traffic", **PULLED)
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_alerts, section, hub, node="rig-1"))
            with trio.fail_after(WAIT_S):
                while not hub.states().get("alerts", {}).get("failed"):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert [body["status"] for body in record.bodies("/hook")] == ["firing", "firing"]
        state = decode_states(hub.states(), strict=True)
        assert state.alerts is not None and state.alerts.failed == 1
        assert state.alerts.last_error == "json: HTTP 500: ok"
        assert "1 alert notification(s) not delivered: json: HTTP 500" in status_text(NodeInfo(), state)
        assert "not delivered to the json webhook after 2 tries: HTTP 500" in caplog.text


def test_a_real_miner_node_posts_its_link_alert_once(tmp_path) -> None:
    """`engy-node --role miner` as a user runs it, its gateway refusing connections: the alert
    task posts `miner_link` to the webhook once, however many checks run while it fires."""
    with contextlib.ExitStack() as stack:
        record, base = stack.enter_context(receiver())
        # Bound and never listening: a connection to either port is refused at once.
        gateway, server = (stack.enter_context(socket.socket()) for _ in range(2))
        for sock in (gateway, server):
            sock.bind(("127.0.0.1", 0))
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "ENGY_MINER__MINER_KEY": "mk_test",
            "ENGY_MINER__GATEWAY_URL": f"ws://127.0.0.1:{gateway.getsockname()[1]}/gw",
            "ENGY_MINER__SERVE_URLS": f"http://127.0.0.1:{server.getsockname()[1]}",
            "ENGY_ALERTS__WEBHOOKS": f"json={base}/hook",
            "ENGY_ALERTS__CHECK_S": "0.2",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "--role", "miner"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        output = ProcessOutput(process, tmp_path / "node.log")
        try:
            output.wait_for(r"alert firing: miner_link:miner", timeout_s=WAIT_S, what="the alert firing")
            checks_seen(tmp_path / "data", 5)
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            output.wait_ended(timeout_s=30, what="the node's output complete")
    posts = record.bodies("/hook")
    assert [(body["status"], body["key"]) for body in posts] == [("firing", "miner_link:miner")]
    assert "Connect" in posts[0]["text"] and process.returncode == 0


def checks_seen(data_dir, count: int) -> None:
    """Wait until the running node's alert task has run `count` checks, read from its control
    API's `alerts` state (blocking: the node is another process)."""
    endpoint = read_endpoint(data_dir)
    token = read_token(endpoint.token_file)
    seen: set[float] = set()
    deadline = time.monotonic() + WAIT_S
    while len(seen) < count:
        assert time.monotonic() < deadline, f"only {len(seen)} alert checks within {WAIT_S} s"
        checked = fetch_status(endpoint.url, token)["states"].get("alerts", {}).get("checked_at")
        if checked is not None:
            seen.add(checked)
        time.sleep(0.05)
