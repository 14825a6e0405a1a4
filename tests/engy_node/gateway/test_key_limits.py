"""Per-key limits through the real gateway (hypercorn, the SQLite store, a synthetic miner) with the
official SDKs: exactly the limit admitted under 100-way concurrency, a spend cap never passed,
429s with `Retry-After` and the rate-limit headers each API's SDK reads, and keys refused on
every worker once expired."""

from __future__ import annotations

import functools
import os
import sqlite3
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
import trio

from engy_node.config import load_config
from engy_node.control import Actions, serve_control
from engy_node.gateway.key_actions import register_key_actions
from engy_node.gateway.role import run_gateway, store_location, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import Script, SyntheticHandler
from tests.engy_node.gateway.test_gateway import MODEL, Network, http, network  # noqa: F401 (fixtures)
from tests.engy_node.gateway.test_workers import miner_on_both_workers, two_workers  # noqa: F401 (fixtures)
from tests.waiting import wait_until_async

ANSWER = "Limited, but here."
RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request) -> str:
    """`gateway.store_url`: empty for the SQLite file, else a PostgreSQL database of the test's own."""
    return "" if request.param == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture
async def any_network(nursery, tmp_path, checkpoint, store_url):
    """`test_gateway.network`, on the SQLite file or on PostgreSQL."""
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    gateway = {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, "store_url": store_url}
    config = load_config(home=tmp_path, env=env, overrides={"gateway": gateway})
    urls = await nursery.start(run_gateway, config, Hub())
    store = Store.open(store_location(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    yield Network(config, urls, store, served)
    store.close()


class GatedHandler(SyntheticHandler):
    """A synthetic miner that answers nothing until its gate opens: the requests it was given
    stay in flight as long as the test needs."""

    def __init__(self, model, script) -> None:
        super().__init__(model, script)
        self.gate = trio.Event()

    async def handle(self, frame, send) -> None:
        await self.gate.wait()
        await super().handle(frame, send)


async def gated_miner(nursery, network, http) -> GatedHandler:  # noqa: F811
    import uuid

    from engy_node.miner.link import Identity
    from engy_node.testing.synthetic_miner import synthetic_link
    from tests.engy_node.gateway.test_gateway import FAST

    _, miner_key = network.store.register_miner(f"gated-{uuid.uuid4().hex[:6]}")
    handler = GatedHandler(network.served, lambda frame: Script(text=ANSWER))
    link = synthetic_link(
        gateway_url=network.urls.miner_url,
        model=network.served,
        identity=Identity(miner_key=miner_key),
        handler=handler,
        http=http,
        settings=FAST,
        worker_name="gated",
    )
    await nursery.start(link.run)
    return handler


def limited_key(network, **limits: int) -> tuple[int, str]:  # noqa: F811
    account_id, key = network.buyer(10.0)
    account = network.store.authenticate(key)
    network.store.set_key_limits(account.key_id, limits)
    return account_id, key


def chat(index: int = 0, max_tokens: int = 16) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"question {index}"}], "max_tokens": max_tokens}


async def test_100_concurrent_requests_against_a_concurrency_limit_of_10_admit_exactly_10(
    nursery,
    any_network,
    http,  # noqa: F811
):
    miner = await gated_miner(nursery, any_network, http)
    account_id, key = limited_key(any_network, concurrent=10, tpm=100_000)
    responses: list[httpx.Response] = []

    async def ask(index: int) -> None:
        responses.append(
            await http.post(
                any_network.api + "/chat/completions", json=chat(index), headers={"authorization": f"Bearer {key}"}
            )
        )

    async with trio.open_nursery() as buyers:
        for index in range(100):
            buyers.start_soon(ask, index)
        # The refused answer at once; the admitted wait at the closed gate until all 90 are in.
        await wait_until_async(lambda: len(responses) >= 90, timeout_s=120, what="90 answers")
        assert len(responses) == 90
        miner.gate.set()
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [200] * 10 + [429] * 90
    refused = next(response for response in responses if response.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-ratelimit-limit-requests"] == "10"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "10 requests in flight" in error["message"] and "set-limits" in error["message"]
    served = next(response for response in responses if response.status_code == 200)
    assert all(name in served.headers for name in RATE_HEADERS)
    assert served.headers["x-ratelimit-limit-tokens"] == "100000"
    assert any_network.store.balance(account_id).held == 0 and any_network.store.check_books() == []


async def test_a_daily_spend_cap_is_never_exceeded_by_a_micro_dollar_under_100_way_concurrency(
    nursery,
    any_network,
    http,  # noqa: F811
):
    await any_network.add_synthetic_miner(nursery, lambda frame: Script(text=ANSWER), http)
    probe_account, probe_key = any_network.buyer(1.0)
    probe = await http.post(
        any_network.api + "/chat/completions", json=chat(), headers={"authorization": f"Bearer {probe_key}"}
    )
    one_charge = any_network.store.balance(probe_account).charged
    assert probe.status_code == 200 and one_charge > 0
    cap = one_charge * 30  # room for fewer than 30 worst-case holds: each holds more than it is charged
    account_id, key = limited_key(any_network, daily_micro=cap)
    statuses: list[int] = []

    async def ask(index: int) -> None:
        response = await http.post(
            any_network.api + "/chat/completions", json=chat(index % 10), headers={"authorization": f"Bearer {key}"}
        )
        statuses.append(response.status_code)

    async with trio.open_nursery() as buyers:
        for index in range(100):
            buyers.start_soon(ask, index)
    charged = any_network.store.balance(account_id).charged
    assert charged <= cap
    assert set(statuses) == {200, 429} and statuses.count(200) >= 1
    assert any_network.store.balance(account_id).held == 0 and any_network.store.check_books() == []


async def test_the_openai_sdk_sees_the_429_and_its_retry_honours_retry_after(
    nursery,
    network,  # noqa: F811
    http,  # noqa: F811
):
    miner = await gated_miner(nursery, network, http)
    account_id, key = limited_key(network, concurrent=1)
    seen: list[httpx.Response] = []
    first_done = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def record(response: httpx.Response) -> None:
        seen.append(response)
        if response.status_code == 429:
            # The retry comes after Retry-After (1 s); the request in flight finishes meanwhile.
            trio.from_thread.run_sync(miner.gate.set, trio_token=token)

    async def first() -> None:
        response = await http.post(
            network.api + "/chat/completions", json=chat(), headers={"authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200
        first_done.set()

    nursery.start_soon(first)
    await wait_until_async(
        lambda: network.store.balance(account_id).held > 0, timeout_s=60, what="the first request held"
    )
    with httpx.Client(event_hooks={"response": [record]}, timeout=60) as hooked:
        client = openai.OpenAI(base_url=network.api, api_key=key, max_retries=1, http_client=hooked)
        raw = await trio.to_thread.run_sync(
            lambda: client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        )
    assert [response.status_code for response in seen] == [429, 200]
    assert seen[0].headers["retry-after"] == "1" and seen[0].headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.parse().choices[0].message.content == ANSWER
    assert raw.headers["x-ratelimit-limit-requests"] == "1"
    with trio.fail_after(60):
        await first_done.wait()

    # With no retries the SDK raises its RateLimitError, carrying the message and headers.
    miner.gate = trio.Event()
    nursery.start_soon(first)
    refused_client = openai.OpenAI(base_url=network.api, api_key=key, max_retries=0, timeout=60)
    await wait_until_async(lambda: network.store.balance(account_id).held > 0, timeout_s=60, what="a request held")
    with pytest.raises(openai.RateLimitError) as raised:
        await trio.to_thread.run_sync(
            lambda: refused_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        )
    assert raised.value.status_code == 429 and "in flight at once" in raised.value.message
    miner.gate.set()


async def test_the_anthropic_sdk_sees_a_rate_limit_error_with_anthropics_headers(
    nursery,
    network,  # noqa: F811
    http,  # noqa: F811
):
    await network.add_synthetic_miner(nursery, lambda frame: Script(text=ANSWER), http)
    _, key = limited_key(network, rpm=2, tpm=100_000)
    client = anthropic.Anthropic(base_url=network.urls.buyer_url, api_key=key, max_retries=0, timeout=60)

    def create():
        return client.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )

    first = await trio.to_thread.run_sync(create)
    assert first.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert first.headers["anthropic-ratelimit-tokens-limit"] == "100000"
    assert first.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    await trio.to_thread.run_sync(create)
    with pytest.raises(anthropic.RateLimitError) as raised:
        await trio.to_thread.run_sync(create)
    error = raised.value
    assert error.status_code == 429 and error.body["error"]["type"] == "rate_limit_error"
    assert "2 requests per minute" in error.body["error"]["message"]
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.response.headers["anthropic-ratelimit-requests-remaining"] == "0"


async def test_a_key_on_a_model_it_may_not_use_is_refused_with_403(
    nursery,
    network,  # noqa: F811
    http,  # noqa: F811
):
    await network.add_synthetic_miner(nursery, lambda frame: Script(text=ANSWER), http)
    account_id, _ = network.buyer(1.0)
    _, key = network.store.create_key(account_id, name="other-models", models=("some-other-model",))
    client = openai.OpenAI(base_url=network.api, api_key=key, max_retries=0, timeout=60)
    with pytest.raises(openai.PermissionDeniedError) as raised:
        await trio.to_thread.run_sync(
            lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        )
    assert f"may not use {MODEL}" in raised.value.message and "--models" in raised.value.message
    assert network.store.balance(account_id).held == 0


async def test_an_expired_key_is_refused_from_the_next_request_on_by_every_worker(nursery, two_workers):  # noqa: F811
    config, urls, store, served = two_workers
    async with httpx.AsyncClient(timeout=60) as http:  # noqa: F811
        await miner_on_both_workers(nursery, http, urls, store, served, ANSWER)
        account, _ = store.create_buyer("team")
        store.credit(account, micro_usd=1_000_000)
        key_id, key = store.create_key(account, name="temporary", expires_at=time.time() + 3600)

        async def ask(index: int) -> int:
            # A fresh connection per request: the kernel hands them to both workers.
            async with httpx.AsyncClient(timeout=60) as own:
                response = await own.post(
                    urls.buyer_url + "/v1/chat/completions",
                    json=chat(index),
                    headers={"authorization": f"Bearer {key}"},
                )
                if response.status_code == 401:
                    assert "expired" in response.json()["error"]["message"]
                return response.status_code

        assert [await ask(index) for index in range(8)] == [200] * 8  # cached in both workers now
        with sqlite3.connect(store_path(config)) as raw:  # its expiry comes
            raw.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?", (time.time() - 1, key_id))
        assert [await ask(index) for index in range(8)] == [401] * 8
    assert store.balance(account).held == 0 and store.check_books() == []


async def test_a_key_update_takes_effect_from_the_next_request_on_by_every_worker(nursery, two_workers, tmp_path):  # noqa: F811
    """`engy-node gateway key update` (a real subprocess) and the control API's
    `gateway-key-update`, against a running two-worker gateway whose workers have the key cached."""
    config, urls, store, served = two_workers
    actions = Actions()
    register_key_actions(actions, store_path(config))
    endpoint = await nursery.start(
        functools.partial(serve_control, Hub(), data_dir=tmp_path / "control", actions=actions, node_info={})
    )
    token = endpoint.token_file.read_text().strip()
    async with httpx.AsyncClient(timeout=60) as http:  # noqa: F811
        await miner_on_both_workers(nursery, http, urls, store, served, ANSWER)
        account, _ = store.create_buyer("team")
        store.credit(account, micro_usd=1_000_000)
        key_id, key = store.create_key(account, name="agent", expires_at=time.time() + 3600, models=(MODEL,))

        async def ask(index: int) -> int:
            # A fresh connection per request: the kernel hands them to both workers.
            async with httpx.AsyncClient(timeout=60) as own:
                response = await own.post(
                    urls.buyer_url + "/v1/chat/completions",
                    json=chat(index),
                    headers={"authorization": f"Bearer {key}"},
                )
                return response.status_code

        async def statuses() -> list[int]:
            return [await ask(index) for index in range(8)]

        def cli(*args: str) -> str:
            command = [
                sys.executable,
                "-m",
                "engy_node",
                "--home",
                str(config.paths.data_dir.parent),
                "gateway",
                "key",
                *args,
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert await statuses() == [200] * 8  # cached in both workers now
        out = await trio.to_thread.run_sync(cli, "update", str(key_id), "--models", "some-other-model")
        assert "models: some-other-model" in out
        assert await statuses() == [403] * 8
        with sqlite3.connect(store_path(config)) as raw:  # its expiry comes
            raw.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?", (time.time() - 1, key_id))
        assert await statuses() == [401] * 8
        updated = await http.post(
            endpoint.url + "/v1/actions/gateway-key-update",
            json={"key_id": key_id, "expires": "never", "models": "all"},
            headers={"authorization": f"Bearer {token}"},
        )
        assert updated.status_code == 200, updated.text
        assert (updated.json()["result"]["expires_at"], updated.json()["result"]["models"]) == (None, None)
        assert await statuses() == [200] * 8
    assert store.balance(account).held == 0 and store.check_books() == []


async def test_tokens_per_minute_are_given_back_by_a_failed_request_and_corrected_by_a_served_one(
    nursery,
    network,  # noqa: F811
    http,  # noqa: F811
):
    """A hold counts prompt + max_tokens against the key's tokens per minute: 600 + the prompt
    here, so two such holds never fit in 1,000. One refused by the miner gives its tokens back
    (else the next would be 429), and one served keeps only what it used (else the third would)."""
    scripts = iter([Script(refuse=("the request was at fault", 400)), Script(text="Short."), Script(text="Short.")])
    await network.add_synthetic_miner(nursery, lambda frame: next(scripts), http)
    _, key = limited_key(network, tpm=1000)

    async def ask(index: int) -> httpx.Response:
        return await http.post(
            network.api + "/chat/completions",
            json=chat(index, max_tokens=600),
            headers={"authorization": f"Bearer {key}"},
        )

    failed = await ask(0)
    assert failed.status_code == 400, failed.text
    served = await ask(1)
    assert served.status_code == 200, served.text
    used = served.json()["usage"]["total_tokens"]
    held = 1000 - int(served.headers["x-ratelimit-remaining-tokens"])  # this one's prompt + 600, nothing else
    assert 600 < held < 1000 and used < held
    third = await ask(2)
    assert third.status_code == 200, third.text
    # A new minute may have begun meanwhile, which only leaves more.
    assert int(third.headers["x-ratelimit-remaining-tokens"]) >= 1000 - used - held


async def test_a_stream_to_a_limited_key_carries_the_rate_limit_headers(
    nursery,
    network,  # noqa: F811
    http,  # noqa: F811
):
    await network.add_synthetic_miner(nursery, lambda frame: Script(text=ANSWER), http)
    _, key = limited_key(network, rpm=5, tpm=50_000)
    client = openai.OpenAI(base_url=network.api, api_key=key, max_retries=0, timeout=60)

    def stream():
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
        return raw.headers, text

    headers, text = await trio.to_thread.run_sync(stream)
    assert text == ANSWER
    assert headers["x-ratelimit-limit-requests"] == "5" and headers["x-ratelimit-remaining-requests"] == "4"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 50_000
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
