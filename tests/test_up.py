"""`engy-node up` as a person runs it: the whole network on loopback (dev chain, gateway, two
miners, validator, verifier, demo traffic), the official SDK against it, an epoch closing and its
weights landing on the dev chain as incentive, a clean stop on SIGTERM, and the same keys,
balance and chain after a restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import psutil

from tests.waiting import ProcessOutput

START_TIMEOUT_S = 240
FIRST_WEIGHTS_TIMEOUT_S = 300
"""The issue's promise: within five minutes an epoch closes and its weights are on the chain."""
READY_LINE = "engy local network is up."
WEIGHTS_LINE = re.compile(r"engy\.validator: epoch (\d+): weights for 2 uid\(s\) on chain at block (\d+)")
"""The first epoch with both miners in it on chain (an epoch the network only started in may
hold too little traffic and burn to the owner instead)."""
INCENTIVE_LINE = re.compile(r"engy\.devchain: block (\d+): epoch \d+ on subnet 53, incentive \{2: [0-9.]+, 3: [0-9.]+\}")
"""A chain epoch paying both miners (uids 2 and 3: the owner is 0, the validator 1)."""


class Up:
    """`engy-node up`, its output copied to `up.log` as it comes; ready once it prints its banner,
    which it does after writing `network.json` and once the gateway has admitted both miners (the
    test sends a request at once, as a person would)."""

    def __init__(self, home, *extra: str) -> None:
        self.home = home
        self.log_path = home / "up.log"
        self.network_path = home / "data" / "local" / "network.json"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", str(home), "up", "--port-base", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.output = ProcessOutput(self.process, self.log_path)
        try:
            self.output.wait_for(READY_LINE, timeout_s=START_TIMEOUT_S, what="the local network up")
        except AssertionError:
            self.process.terminate()  # SIGTERM, so that it stops its model servers too
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
            raise
        self.network = json.loads(self.network_path.read_text())

    def status(self) -> dict:
        result = subprocess.run([sys.executable, "-m", "engy_node", "--home", str(self.home), "status", "--json"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def stop(self) -> int:
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.output.wait_ended(timeout_s=30, what="engy-node up's output complete")
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "a child outlived engy-node up"
        return code


def test_up_runs_the_whole_network_until_weights_land_then_restarts_with_its_state(checkpoint, tmp_path):
    first = Up(tmp_path, "--traffic")
    try:
        network = first.network
        assert network["buyer_key"].startswith("engy-sk-") and network["miner_ws"].startswith("ws://127.0.0.1:")
        assert (first.network_path.stat().st_mode & 0o777) == 0o600
        assert set(network["hotkeys"]) == {"owner", "master", "validator", "verifier", "miner-1", "miner-2"}
        assert network["control_api"]["url"].startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=network["buyer_api"], api_key=network["buyer_key"], max_retries=0, timeout=120)
        completion = client.chat.completions.create(model="smollm2-135m", max_tokens=32,
                                                    messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in completion.choices[0].message.content
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]

        landed = first.output.wait_for(WEIGHTS_LINE, timeout_s=FIRST_WEIGHTS_TIMEOUT_S, what="the validator's weights for both miners")
        epoch_index = int(landed.group(1))
        first.output.wait_for(INCENTIVE_LINE, timeout_s=120, what="a dev chain epoch paying both miners")
        status = first.status()
        chain = status["states"]["chain"]
        uids = {neuron["hotkey"]: neuron for neuron in chain["neurons"]}
        miners = [network["hotkeys"][name] for name in ("miner-1", "miner-2")]
        validator_uid = uids[network["hotkeys"]["validator"]]["uid"]
        assert set(chain["weights"][str(validator_uid)]) == {str(uids[m]["uid"]) for m in miners}

        # Read just after a chain epoch: the vector it used is the one the validator last applied.
        applied = status["states"]["validator"]["last_applied"]
        assert applied >= epoch_index
        published = httpx.get(f"{network['provider_api']}/api/subnet/v1/epoch/{applied}", timeout=30).json()
        rows = json.loads(published["result_json"])["rows"]
        score = {row["hotkey"]: row["score"] for row in rows}
        tokens = {row["hotkey"]: row["tokens"] for row in rows}
        assert all(tokens[m] > 0 for m in miners), "both honest miners served"
        for miner in miners:
            # Each honest miner's uid earns incentive in proportion to what it served (its score
            # is its tokens at the model's rate).
            assert abs(uids[miner]["incentive"] - score[miner] / sum(score.values())) < 0.01
        assert status["states"]["traffic_generator"]["succeeded"] > 0
        block_before_restart = chain["block"]
    finally:
        assert first.stop() == 0
    assert not first.network_path.exists(), "a clean exit removes network.json"
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
        status = second.status()
        assert status["states"]["chain"]["block"] >= block_before_restart, "the dev chain continues its blocks"
        assert status["states"]["chain"]["weights"], "the weights on chain survived the restart"
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
