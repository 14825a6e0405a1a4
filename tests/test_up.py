"""`engy-node up` as a person runs it: a working network, the official SDK against it, a clean
stop on SIGTERM, and the same key and balance after a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai
import psutil

from tests.waiting import ProcessOutput

START_TIMEOUT_S = 180
READY_LINE = "engy local network is up."


class Up:
    """`engy-node up`, its output copied to `up.log` as it comes; ready once it prints its banner,
    which it does after writing `network.json` and once the gateway has admitted the miner (the
    test sends a request at once, as a person would)."""

    def __init__(self, home) -> None:
        self.home = home
        self.log_path = home / "up.log"
        self.network_path = home / "data" / "local" / "network.json"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", str(home), "up", "--port", "0", "--miner-port", "0", "--provider-port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.output = ProcessOutput(self.process, self.log_path)
        try:
            self.output.wait_for(READY_LINE, timeout_s=START_TIMEOUT_S, what="the local network up")
        except AssertionError:
            self.process.terminate()  # SIGTERM, so that it stops its model server too
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
            raise
        self.network = json.loads(self.network_path.read_text())

    def stop(self) -> int:
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.output.wait_ended(timeout_s=30, what="engy-node up's output complete")
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "a child outlived engy-node up"
        return code


def test_up_serves_the_openai_sdk_stops_cleanly_and_keeps_its_state(checkpoint, tmp_path):
    first = Up(tmp_path)
    try:
        network = first.network
        assert network["buyer_key"].startswith("engy-sk-") and network["miner_ws"].startswith("ws://127.0.0.1:")
        assert (first.network_path.stat().st_mode & 0o777) == 0o600
        client = openai.OpenAI(base_url=network["buyer_api"], api_key=network["buyer_key"], max_retries=0, timeout=120)
        completion = client.chat.completions.create(model="smollm2-135m", max_tokens=32,
                                                    messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in completion.choices[0].message.content
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    finally:
        assert first.stop() == 0
    assert "buyer key" in first.log_path.read_text()
    assert network["buyer_key"] not in (tmp_path / "data" / "logs" / "engy-node.log").read_text(), "secrets are never logged"

    balance_after_first = subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", "balance", str(network["buyer_account"])],
        capture_output=True, text=True, timeout=60)
    assert balance_after_first.returncode == 0, balance_after_first.stderr

    second = Up(tmp_path)
    try:
        assert second.network["buyer_key"] == network["buyer_key"]
        assert second.network["hotkeys"] == network["hotkeys"]
        client = openai.OpenAI(base_url=second.network["buyer_api"], api_key=second.network["buyer_key"], max_retries=0, timeout=120)
        client.chat.completions.create(model="smollm2-135m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    finally:
        assert second.stop() == 0
    balance_after_second = subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", "balance", str(network["buyer_account"])],
        capture_output=True, text=True, timeout=60)
    assert balance_after_second.stdout != balance_after_first.stdout, "the second run spent from the same account"


def test_gateway_admin_creates_credits_and_reports_a_buyer(tmp_path):
    def admin(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    created = admin("create-buyer", "acme")
    assert "engy-sk-" in created
    assert "$25.500000" in admin("credit", "1", "25.50")
    assert "$25.500000" in admin("balance", "1")
    assert "requests" in admin("usage", "1").lower()
    assert "engy-mk-" in admin("register-miner", "rig-7")
    assert "rig-7" in admin("miners")
    bad = subprocess.run([sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", "credit", "1", "-3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "engy-node:" in bad.stderr
