"""`engy-node up` as a person runs it: the whole network on loopback (dev chain, gateway, two
miners, validator, verifier, demo traffic), the official SDK against it, an epoch closing and its
weights landing on the dev chain as incentive, a clean stop on SIGTERM, and the same keys,
balance and chain after a restart — where both official SDKs run an agent's two-step tool-call
loop and a thinking request, streamed and whole, and are charged the price card's figure for
what the usage says, to the µUSD."""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest

from engy_node.control import read_token
from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing import billing
from engy_node.models import SMOLLM2_135M
from engy_node.snapshots import STATE_SCHEMA, decode_states
from engy_tui.manager import NodeManager
from engy_tui.node_bridge import NodeSnapshot, snapshot_of
from tests.sdk_usage import anthropic_usage, openai_usage
from tests.waiting import ProcessOutput

START_TIMEOUT_S = 240
QUIET_TIMEOUT_S = 120
"""How long the paused network may take to have every verdict read by the gateway."""
FIRST_WEIGHTS_TIMEOUT_S = 300
"""The issue's promise: within five minutes an epoch closes and its weights are on the chain."""
READY_LINE = "engy local network is up."
WEIGHTS_LINE = re.compile(r"engy\.validator: epoch (\d+): weights for 2 uid\(s\) on chain at block (\d+)")
"""The first epoch with both miners in it on chain (an epoch the network only started in may
hold too little traffic and burn to the owner instead)."""
INCENTIVE_LINE = re.compile(
    r"engy\.devchain: block (\d+): epoch \d+ on subnet 53, incentive \{2: [0-9.]+, 3: [0-9.]+\}"
)
"""A chain epoch paying both miners (uids 2 and 3: the owner is 0, the validator 1)."""


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_QUESTION = [
    {"role": "user", "content": "Call get_weather for Rome."},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    },
    {"role": "user", "content": "Call get_weather for Paris."},
]
THINK_QUESTION = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "<think>\nThree plus four is seven.\n</think>\n\n7"},
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "<think>\nOne plus one is two.\n</think>\n\n2"},
    {"role": "user", "content": "What is 2 + 3?"},
]
"""SmolLM2 was not trained to call tools or to think aloud, and its chat template renders neither
tools nor `enable_thinking`; earlier turns written in the Qwen3/Hermes format are enough for it
to answer in that format (greedily, with its first token ahead of the next by well over the
honest numeric drift: one thinking example left `<think>` only 0.25 logits ahead, and one run's
answer started without it), which the miner and the gateway then parse as a Qwen3 model's
output. So what is exercised is the real network's parsing, relaying and billing of tool calls
and reasoning, on the only model this machine can run."""


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
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
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
        """`engy-node status --json`, whose exit code is its summary's: 0, or 3 while a role is not
        doing its job yet (a miner qualifying, no weights set yet); never 2, since the node runs."""
        result = subprocess.run(
            [sys.executable, "-m", "engy_node", "--home", str(self.home), "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        document = json.loads(result.stdout)
        assert result.returncode == document["summary"]["exit_code"] != 2, result.stderr
        return document

    def status_when(self, condition, *, timeout_s: float) -> dict:
        """`status` once `condition(document)` holds, or the last one read after `timeout_s`: the
        chain's state reaches the node's hub once a second, so a status read the moment the chain
        logs an epoch may not hold it yet (a CI run read it 0.8 s after)."""
        deadline = time.monotonic() + timeout_s
        while True:
            document = self.status()
            if condition(document) or time.monotonic() > deadline:
                return document
            time.sleep(0.5)

    def stop(self) -> int:
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.output.wait_ended(timeout_s=30, what="engy-node up's output complete")
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], (
            "a child outlived engy-node up"
        )
        return code


def tabs_agree_with_the_verifier(up: Up) -> None:
    """The TUI's Miner, Gateway and Overview tabs, drawn from one status of the running network,
    give the verifier's verdict counts: each miner's verdicts at the gateway add up to them.

    The demo traffic is paused first and the status taken once nothing is waiting for a verdict
    and the gateway has read every verdict the verifier made (the control plane reads them from
    the store once a second, and may still probe a miner now and then)."""
    control = up.network["control_api"]
    token = read_token(Path(control["token_file"]))
    paused = httpx.post(
        f"{control['url']}/v1/actions/pause-traffic", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert paused.status_code == 200, paused.text
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while True:
        status = up.status()
        states = decode_states(status["states"], strict=True)
        assert states.verifier is not None and states.audit is not None and states.traffic is not None
        at_gateway = [worker.lifetime for worker in states.traffic.workers]
        if (
            states.audit.waiting == states.audit.leased == 0
            and all(lifetime is not None for lifetime in at_gateway)
            and sum(lifetime.audited for lifetime in at_gateway if lifetime) == states.verifier.verdicts.total
        ):
            break
        assert time.monotonic() < deadline, (
            f"the gateway's verdicts never matched the verifier's: {at_gateway} vs {states.verifier.verdicts}"
        )
        time.sleep(1)
    verdicts = states.verifier.verdicts
    assert verdicts.total > 0
    snapshot = snapshot_of(status["node"], status, taken_at=time.time(), connected=True)
    tabs = asyncio.run(tab_texts(snapshot, ["1", "2", "4"]))

    expected = (verdicts.passed, verdicts.cheat, verdicts.unproven)
    overview = re.search(r"verifier +running; verdicts: pass (\d+), cheat (\d+), unproven (\d+)", tabs["1"])
    assert overview is not None and tuple(map(int, overview.groups())) == expected, tabs["1"]

    per_miner = [
        tuple(int(n.replace(",", "")) for n in found)
        for found in re.findall(r"audited ([\d,]+): ([\d,]+) pass, ([\d,]+) cheat(?: ✘)?, ([\d,]+) unproven", tabs["2"])
    ]
    assert len(per_miner) == 2, tabs["2"]
    assert tuple(sum(column) for column in zip(*per_miner, strict=True)) == (verdicts.total, *expected), tabs["2"]
    node_tally = re.search(r"verifier: pass (\d+) +cheat (\d+)\D+unproven (\d+)", tabs["2"])
    assert node_tally is not None and tuple(map(int, node_tally.groups())) == expected, tabs["2"]

    # The gateway's miners table: the audited column is the last, its first number the count.
    rows = [
        re.split(r" {2,}", line.strip(" │"))
        for line in tabs["4"].splitlines()
        if re.match(r"miner-\d+/", line.strip(" │"))  # "miner/worker", not the epoch's weights below
    ]
    assert len(rows) == 2, tabs["4"]
    assert sum(int(re.match(r"[\d,]+", row[-1]).group().replace(",", "")) for row in rows) == verdicts.total, tabs["4"]


async def tab_texts(snapshot: NodeSnapshot, tabs: list[str]) -> dict[str, str]:
    """What the node manager shows on each of `tabs` (their keys) for `snapshot`, as text."""
    app = NodeManager(None, clock=time.time)
    shown = {}
    async with app.run_test(size=(200, 60)) as pilot:
        app.show_snapshot(snapshot, events=[])
        for tab in tabs:
            await pilot.press(tab)
            await pilot.pause()
            shown[tab] = screen_text(app.export_screenshot())
    return shown


def screen_text(svg: str) -> str:
    """The characters of a Textual screenshot, line by line."""
    rows: dict[float, list[tuple[float, str]]] = {}
    for x, y, text in re.findall(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>', svg):
        rows.setdefault(float(y), []).append((float(x), html.unescape(text).replace("\xa0", " ")))
    return "\n".join("".join(text for _, text in sorted(row)) for _, row in sorted(rows.items()))


@pytest.mark.minutes
def test_up_runs_the_whole_network_until_weights_land_then_restarts_with_its_state(checkpoint, tmp_path):
    first = Up(tmp_path, "--traffic")
    try:
        network = first.network
        assert network["buyer_key"].startswith("engy-sk-") and network["miner_ws"].startswith("ws://127.0.0.1:")
        assert (first.network_path.stat().st_mode & 0o777) == 0o600
        assert set(network["hotkeys"]) == {"owner", "master", "validator", "verifier", "miner-1", "miner-2"}
        assert network["control_api"]["url"].startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=network["buyer_api"], api_key=network["buyer_key"], max_retries=0, timeout=120)
        completion = client.chat.completions.create(
            model="smollm2-135m",
            max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in completion.choices[0].message.content
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
        # The demo buyer's TAO deposit on the dev chain, credited by the gateway's deposit watcher.
        deposit = network["deposit"]
        first.output.wait_for(
            re.escape(f"deposit {deposit['extrinsic_id']}: ") + ".* credited to account",
            timeout_s=120,
            what="the demo buyer's deposit credited",
        )

        landed = first.output.wait_for(
            WEIGHTS_LINE, timeout_s=FIRST_WEIGHTS_TIMEOUT_S, what="the validator's weights for both miners"
        )
        epoch_index = int(landed.group(1))
        first.output.wait_for(INCENTIVE_LINE, timeout_s=120, what="a dev chain epoch paying both miners")
        status = first.status_when(
            lambda document: all(miner["incentive"] for miner in document["summary"]["miners"]), timeout_s=30
        )
        assert status["schema"] == STATE_SCHEMA
        # Weights on chain, both miners paid: every role of the network does its job.
        summary = status["summary"]
        assert summary["exit_code"] == 0, summary["roles"]
        assert [verdict["role"] for verdict in summary["roles"]] == ["gateway", "miner", "validator", "verifier"]
        assert [miner["name"] for miner in summary["miners"]] == ["miner-1", "miner-2"]
        assert all(miner["incentive"] and miner["weighted_by"] == 1 for miner in summary["miners"])
        assert summary["validator"]["last_epoch"] >= epoch_index and summary["serving"]["requests_ok"] > 0
        # Strict: every component and field the whole network published is one its type declares.
        states = decode_states(status["states"], strict=True)
        assert states.miner_names() == ["miner-1", "miner-2"] and states.verifier is not None
        assert {name: miner.hotkey for name, miner in states.miners.items()} == {
            name: network["hotkeys"][name] for name in ("miner-1", "miner-2")
        }
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
        tabs_agree_with_the_verifier(first)
    finally:
        assert first.stop() == 0
    assert not first.network_path.exists(), "a clean exit removes network.json"
    assert "buyer key" in first.log_path.read_text()
    assert network["buyer_key"] not in (tmp_path / "data" / "logs" / "engy-node.log").read_text(), (
        "secrets are never logged"
    )

    balance_after_first = balance(tmp_path, network["buyer_account"])

    second = Up(tmp_path)
    try:
        assert second.network["buyer_key"] == network["buyer_key"]
        assert second.network["hotkeys"] == network["hotkeys"]
        status = second.status()
        assert status["states"]["chain"]["block"] >= block_before_restart, "the dev chain continues its blocks"
        assert status["states"]["chain"]["weights"], "the weights on chain survived the restart"
        client = openai.OpenAI(
            base_url=second.network["buyer_api"], api_key=second.network["buyer_key"], max_retries=0, timeout=120
        )
        client.chat.completions.create(model="smollm2-135m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        charged_before = charged_micro_usd(tmp_path, network["buyer_account"])
        usages = [usage for stream in (False, True) for usage in agent_turns(second.network, stream=stream)]
        assert any(usage.cached_tokens for usage in usages), (
            "a loop's second step reads its first step's prompt from the cache"
        )
        assert charged_micro_usd(tmp_path, network["buyer_account"]) - charged_before == sum(
            billing.charge(price=SMOLLM2_135M.price, usage=usage) for usage in usages
        )
    finally:
        assert second.stop() == 0
    assert balance(tmp_path, network["buyer_account"]) != balance_after_first, (
        "the second run spent from the same account"
    )
    assert second.network["deposit"] == network["deposit"], "the demo deposit is sent once per home"
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "engy_node",
            "--home",
            str(tmp_path),
            "gateway",
            "deposits",
            str(network["buyer_account"]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert listed.count(" deposit ") == 1 and f"deposit {network['deposit']['extrinsic_id']}" in listed, (
        "credited once and only once across the restart"
    )


def ask_openai(client: openai.OpenAI, *, stream: bool, **request):
    request = {"model": "smollm2-135m", "max_tokens": 48, "temperature": 0, **request}
    if not stream:
        return client.chat.completions.create(**request)
    with client.chat.completions.stream(stream_options={"include_usage": True}, **request) as events:
        return events.get_final_completion()


def ask_anthropic(client: anthropic.Anthropic, *, stream: bool, **request):
    # The SDK no longer takes `temperature`; the wire format still does, and greedy keeps the
    # model in the format the earlier turns show it.
    request = {"model": "smollm2-135m", "max_tokens": 48, "extra_body": {"temperature": 0}, **request}
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        return events.get_final_message()


def agent_turns(network: dict, *, stream: bool) -> list[Usage]:
    """A two-step tool-call loop and a thinking request on each SDK; the usage of each answer."""
    chat = openai.OpenAI(base_url=network["buyer_api"], api_key=network["buyer_key"], max_retries=0, timeout=120)
    first = ask_openai(chat, stream=stream, messages=TOOL_QUESTION, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls" and not first.choices[0].message.content
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = TOOL_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"},
    ]
    second = ask_openai(chat, stream=stream, messages=history, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    thought = ask_openai(
        chat, stream=stream, messages=THINK_QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert getattr(thought.choices[0].message, "reasoning_content", None)
    assert 0 < thought.usage.completion_tokens_details.reasoning_tokens < thought.usage.completion_tokens

    claude = anthropic.Anthropic(
        base_url=network["buyer_api"].removesuffix("/v1"), api_key=network["buyer_key"], max_retries=0, timeout=120
    )
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city now",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ]
    turn = ask_anthropic(claude, stream=stream, messages=TOOL_QUESTION, tools=tools)
    assert turn.stop_reason == "tool_use" and [block.type for block in turn.content] == ["tool_use"]
    use = turn.content[0]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    history = TOOL_QUESTION + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in turn.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 degrees"}]},
    ]
    done = ask_anthropic(claude, stream=stream, messages=history, tools=tools)
    assert done.stop_reason == "end_turn" and [block.type for block in done.content] == ["text"]
    thinking = ask_anthropic(
        claude, stream=stream, messages=THINK_QUESTION, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert thinking.content[0].type == "thinking" and thinking.content[0].thinking
    return [openai_usage(r.usage) for r in (first, second, thought)] + [
        anthropic_usage(m.usage) for m in (turn, done, thinking)
    ]


def balance(home, account: int) -> str:
    """What `engy-node gateway balance` prints for the account."""
    result = subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(home), "gateway", "balance", str(account)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def charged_micro_usd(home, account: int) -> int:
    dollars = re.search(r"charged\s+\$(\d+)\.(\d{6})", balance(home, account))
    return int(dollars.group(1)) * 1_000_000 + int(dollars.group(2))


def test_gateway_admin_creates_credits_and_reports_a_buyer(tmp_path):
    def admin(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    created = admin("create-buyer", "acme")
    assert "engy-sk-" in created
    # The store and the folder it is in are the operator's only (whatever the shell's umask).
    assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "data" / "gateway.sqlite3").stat().st_mode & 0o777 == 0o600
    spare = re.search(r"engy-sk-\S+", admin("issue-key", "1"))[0]
    assert "revoked" in admin("revoke-key", spare)
    assert "$25.500000" in admin("credit", "1", "25.50")
    assert "$25.500000" in admin("balance", "1")
    assert "requests" in admin("usage", "1").lower()
    assert "engy-mk-" in admin("register-miner", "rig-7")
    assert "rig-7" in admin("miners")
    bad = subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", "credit", "1", "-3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "engy-node:" in bad.stderr
