"""Costs in responses, generation lookup and usage reports through the real gateway, with the
official `openai` and `anthropic` SDKs as clients and a synthetic miner (the real link and
protocol, a scripted answer) serving the embedded model.

The books are the judge: every cost a buyer is shown, summed, must be what the ledger charged
the account, to the µUSD; so must the usage report's total, in JSON, in CSV and over HTTP.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import uuid
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest
import trio

from engy_node.config import load_config
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.store import Store, VerdictRecord
from engy_node.gateway.usage_export import export_usage
from engy_node.hub import Hub
from engy_node.miner.link import Identity, LinkSettings
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link

MODEL = SMOLLM2_135M.id
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
ANSWER = "Hello from the synthetic miner, at a price."
PROMPT = "Say hello, and mind the cost."
MESSAGES = [{"role": "user", "content": PROMPT}]


def micro(cost) -> int:
    """A JSON number of dollars (as the SDKs parse it: a float) back to µUSD, exactly."""
    value = Decimal(repr(cost)) * 1_000_000
    assert value == value.to_integral_value(), f"{cost!r} is not a whole number of µUSD"
    return int(value)


class Network:
    def __init__(self, urls, store: Store) -> None:
        self.urls = urls
        self.store = store

    def buyer(self) -> tuple[int, str]:
        account_id, key = self.store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
        self.store.credit(account_id, micro_usd=5_000_000)
        return account_id, key

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls.buyer_url + "/v1", api_key=key, max_retries=0, timeout=120)

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.urls.buyer_url, api_key=key, max_retries=0, timeout=120)

    def get(self, key: str, path: str, **params) -> httpx.Response:
        return httpx.get(
            self.urls.buyer_url + path, params=params, headers={"authorization": f"Bearer {key}"}, timeout=60
        )


@pytest.fixture
async def network(nursery, tmp_path, checkpoint):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False}},
    )
    urls = await nursery.start(run_gateway, config, Hub())
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    _, miner_key = store.register_miner("miner")
    async with httpx.AsyncClient(timeout=120) as http:
        handler = SyntheticHandler(served, lambda frame: Script(text=ANSWER, cached_tokens=4))
        await nursery.start(
            synthetic_link(
                gateway_url=urls.miner_url,
                model=served,
                identity=Identity(miner_key=miner_key),
                handler=handler,
                http=http,
                settings=FAST,
                worker_name="miner",
            ).run
        )
        network = Network(urls, store)
        await until_served(network)
        yield network
    store.close()


async def until_served(network: Network) -> None:
    """Once the miner's leg is admitted (asynchronously)."""
    with trio.fail_after(30):
        # In a thread: the gateway answers on this test's own event loop.
        while not (await trio.to_thread.run_sync(lambda: network.get("none", "/health"))).json()["miners"]:
            await trio.sleep(0.05)


async def test_every_cost_a_buyer_is_shown_sums_to_the_ledgers_charges(network):
    account, key = network.buyer()
    client, messages = network.openai(key), network.anthropic(key)
    shown: list[int] = []

    def openai_calls() -> None:
        # Asked for in the body, OpenRouter's way: usage.cost, its parts, and the header.
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, extra_body={"usage": {"include": True}}
        )
        completion = raw.parse()
        usage = completion.usage.model_dump()
        cost = micro(usage["cost"])
        assert raw.headers["x-engy-cost-usd"] == f"{cost // 10**6}.{cost % 10**6:06d}"
        assert raw.headers["x-request-id"] == completion.id.removeprefix("chatcmpl-")
        details = usage["cost_details"]
        assert set(details) == {"prompt_cost", "cached_prompt_cost", "completion_cost", "reasoning_cost"}
        parts = sum(Decimal(repr(details[k])) for k in ("prompt_cost", "cached_prompt_cost", "completion_cost"))
        assert cost - 1 < parts * 1_000_000 <= cost  # the parts, rounded up once, are the cost
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4
        shown.append(cost)

        # Not asked: no cost in the body, the header all the same.
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=16)
        assert "cost" not in raw.parse().usage.model_dump()
        shown.append(micro(float(raw.headers["x-engy-cost-usd"])))

        # A stream, asked by header without include_usage: the cost is in the final usage chunk.
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=16,
                stream=True,
                extra_headers={"x-engy-include-cost": "1"},
            )
        )
        assert chunks[-1].choices == [] and "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ANSWER
        shown.append(micro(chunks[-1].usage.model_dump()["cost"]))

        # A stream that asks for usage only: usage without the cost (the cost is in the generation).
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "cost" not in chunks[-1].usage.model_dump()
        generation = network.get(key, "/v1/generation", id=chunks[-1].id).json()["data"]
        shown.append(generation["cost_micro_usd"])

    def anthropic_calls() -> None:
        raw = messages.messages.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=16)
        message = raw.parse()
        assert raw.headers["x-request-id"] == message.id.removeprefix("msg_")
        shown.append(micro(float(raw.headers["x-engy-cost-usd"])))
        with messages.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=16) as stream:
            final = stream.get_final_message()
        generation = network.get(key, "/v1/generation", id=final.id).json()["data"]
        assert generation["api"] == "anthropic"
        shown.append(generation["cost_micro_usd"])

    await trio.to_thread.run_sync(openai_calls)
    await trio.to_thread.run_sync(anthropic_calls)
    balance = network.store.balance(account)
    assert all(cost > 0 for cost in shown)
    assert sum(shown) == balance.charged and balance.held == 0


async def test_a_generation_is_its_numbers_and_verdict_never_its_text_nor_another_accounts(network):
    account, key = network.buyer()
    _, stranger = network.buyer()

    def ask():
        raw = network.openai(key).chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=16
        )
        return raw.headers["x-request-id"], raw.parse()

    request_id, completion = await trio.to_thread.run_sync(ask)
    by_header = await trio.to_thread.run_sync(lambda: network.get(key, "/v1/generation", id=request_id))
    by_body = await trio.to_thread.run_sync(lambda: network.get(key, "/v1/generation", id=completion.id))
    assert by_header.status_code == by_body.status_code == 200
    assert by_header.json() == by_body.json()
    data = by_header.json()["data"]
    assert data["id"] == request_id and data["model"] == MODEL and data["api"] == "openai"
    assert (data["status"], data["finish_reason"], data["attempts"]) == (200, "stop", 1)
    assert data["tokens_prompt"] == completion.usage.prompt_tokens
    assert data["tokens_completion"] == completion.usage.completion_tokens
    assert data["tokens_cached"] == 4 and data["tokens_reasoning"] == 0
    assert data["cost_micro_usd"] == network.store.balance(account).charged == micro(data["total_cost"])
    assert data["cost_usd"] == f"0.{data['cost_micro_usd']:06d}"
    assert 0 <= data["ttft_ms"] <= data["total_ms"]
    assert data["verification"]["status"] in ("pending", "not audited")
    text = by_header.text
    assert ANSWER not in text and PROMPT not in text and "Hello" not in text

    # Once audited, the verdict and its proof's reason.
    network.store.record_verdict(
        VerdictRecord(
            request_id=request_id,
            miner="key:1",
            model=MODEL,
            kind="paid",
            verdict="pass",
            reason="toploc:ok",
            verifier="local",
            request_created_at=data["created_at"],
            judged_at=data["created_at"] + 1,
        )
    )
    judged = (await trio.to_thread.run_sync(lambda: network.get(key, "/v1/generation", id=request_id))).json()
    assert judged["data"]["verification"] == {
        "status": "pass",
        "reason": "toploc:ok",
        "verifier": "local",
        "judged_at": data["created_at"] + 1,
    }

    # Another account's key, an id that never was, and no id at all.
    refused = await trio.to_thread.run_sync(lambda: network.get(stranger, "/v1/generation", id=request_id))
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "id"
    assert request_id not in refused.json()["error"]["message"] or "no generation" in refused.json()["error"]["message"]
    unknown = await trio.to_thread.run_sync(lambda: network.get(key, "/v1/generation", id="0" * 32))
    assert unknown.status_code == 404
    assert (await trio.to_thread.run_sync(lambda: network.get(key, "/v1/generation"))).status_code == 400
    unauthenticated = await trio.to_thread.run_sync(lambda: httpx.get(network.urls.buyer_url + "/v1/generation"))
    assert unauthenticated.status_code == 401


async def test_usage_per_key_day_and_model_adds_up_to_the_balance_in_json_csv_and_over_http(network, tmp_path):
    account, key = network.buyer()
    second_key = network.store.issue_key(account)

    def traffic() -> None:
        for api_key, count in ((key, 3), (second_key, 2)):
            for _ in range(count):
                network.openai(api_key).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16)
        with network.anthropic(second_key).messages.stream(model=MODEL, messages=MESSAGES, max_tokens=16) as stream:
            stream.get_final_message()

    await trio.to_thread.run_sync(traffic)
    charged = network.store.balance(account).charged
    assert charged > 0

    report = (await trio.to_thread.run_sync(lambda: network.get(key, "/v1/usage", group_by="day"))).json()
    assert report["total"]["cost_micro_usd"] == report["ledger"]["charged_micro_usd"] == charged
    assert report["total"]["requests"] == 6 and report["total"]["errors"] == 0
    lines = report["data"]
    assert len({line["key_id"] for line in lines}) == 2 and {line["model"] for line in lines} == {MODEL}
    assert sorted(line["requests"] for line in lines) == [3, 3]
    for line in lines:
        assert line["cost_usd"] == f"0.{line['cost_micro_usd']:06d}"
        assert line["error_rate"] == 0 and line["ttft_p50_ms"] <= line["ttft_p95_ms"]
        assert line["cached_tokens"] == 4 * line["requests"]

    one_key = lines[0]["key_id"]
    only = (await trio.to_thread.run_sync(lambda: network.get(key, "/v1/usage", key_id=str(one_key)))).json()
    assert [line["key_id"] for line in only["data"]] == [one_key]

    # The operator's export, from the same store.
    since, until = report["since"], report["until"]
    exported = json.loads(export_usage(network.store, account_id=account, since=since, until=until, fmt="json"))
    assert exported["data"] == report["data"] and exported["total"] == report["total"]
    rows = list(
        csv.DictReader(
            io.StringIO(export_usage(network.store, account_id=account, since=since, until=until, fmt="csv"))
        )
    )
    lines_csv = [row for row in rows if row["kind"] == "requests"]
    assert sum(int(row["cost_micro_usd"]) for row in lines_csv) == charged
    assert sum(Decimal(row["cost_usd"]) for row in lines_csv) * 1_000_000 == charged
    # And the money in: the operator's credit, so that credits − charges is the balance, to the µUSD.
    balance = network.store.balance(account)
    (credit,) = [row for row in rows if row["kind"] != "requests"]
    assert (credit["kind"], int(credit["credit_micro_usd"])) == ("credit", balance.credited)
    assert report["ledger"]["credited_micro_usd"] == balance.credited == balance.available + charged
    assert [c["micro_usd"] for c in report["credits"]] == [balance.credited]
    assert report["ledger"]["deposited_micro_usd"] == 0
    table = export_usage(network.store, account_id=account, since=since, until=until)
    assert f"total cost $0.{charged:06d} over 6 requests" in table

    # The same from the command line, against the store the running gateway writes.
    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "gateway", "usage", str(account), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    window = ("--since", str(since), "--until", str(until))
    as_json = await trio.to_thread.run_sync(cli, *window, "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["total"] == report["total"]
    as_csv = await trio.to_thread.run_sync(cli, *window, "--format", "csv", "--key", str(one_key))
    assert [int(row["key_id"]) for row in csv.DictReader(io.StringIO(as_csv.stdout))] == [one_key]
    as_table = await trio.to_thread.run_sync(cli)
    assert f"total cost $0.{charged:06d} over 6 requests" in as_table.stdout and "requests" in as_table.stdout
    wrong = await trio.to_thread.run_sync(cli, "--since", "last week")
    assert wrong.returncode != 0 and "--since must be unix seconds" in wrong.stderr

    # A window that is not one.
    bad = await trio.to_thread.run_sync(lambda: network.get(key, "/v1/usage", since="yesterday"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
