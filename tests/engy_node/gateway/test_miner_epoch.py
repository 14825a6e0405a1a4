"""A miner zeroed by a settlement gate is told why by its own gateway: the real gateway closes a
short epoch in which the miner's TTFT p99 is over the model's ceiling, and the miner's epoch
watch, asking the gateway's miner endpoint (`GET /gw/epoch/latest`), publishes the gate, the
measurement against the ceiling, the fix and when the next epoch ends (and the block time of
the gateway's chain, to count the blocks to it) in its hub state.

The request log rows are written into the gateway's store by the test: the embedded model's
TTFT ceiling is 30 s, and a test cannot wait that long per request. Everything after them is
the product's: the gateway's publisher settles and signs the epoch, its miner endpoint answers,
the watch reads and explains it."""

from __future__ import annotations

import functools
import os
import time
import uuid

import httpx
import pytest
import trio
from hypercorn.trio import serve

from engy_node import keys
from engy_node.config import load_config
from engy_node.gateway.api.app import build_miner_app, hypercorn_config
from engy_node.gateway.billing.epochs import EpochClock
from engy_node.gateway.billing.miner_epoch import MinerEpochs
from engy_node.gateway.role import store_path
from engy_node.gateway.routing.pool import MinerPool, PoolSettings
from engy_node.gateway.store import RequestLogEntry, Store
from engy_node.hub import Hub
from engy_node.local.devchain import DevChain
from engy_node.miner.epoch_watch import (
    FIRST_POLL_S,
    MAX_POLL_S,
    MIN_POLL_S,
    NO_ROUTE,
    EpochWatch,
    epoch_url,
    poll_interval,
)
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.gates import FIXES, GateFinding, MinerEpoch
from engy_node.snapshots import decode_states

from .conftest import StoppableGateway

MODEL = SMOLLM2_135M.id
EPOCH_S = 3
GRACE_S = 1
SLOW_TTFT_MS = 45_000
"""Over the embedded model's 30 s ceiling (`qual_ttft_p99_ms`)."""


def log_slow_requests(store: Store, hotkey: str, *, count: int, at: float) -> None:
    account_id, _ = store.create_buyer(f"buyer-{uuid.uuid4().hex[:6]}")
    for _ in range(count):
        store.log_request(
            RequestLogEntry(
                request_id=uuid.uuid4().hex,
                account_id=account_id,
                miner=hotkey,
                model=MODEL,
                api="openai",
                kind="paid",
                status=200,
                prompt_tokens=50,
                completion_tokens=50,
                cached_tokens=0,
                cost_micro=10,
                ttft_ms=float(SLOW_TTFT_MS),
                tpot_ms=20.0,
                created_at=at,
            )
        )


async def test_a_miner_whose_ttft_p99_gated_its_epoch_sees_the_gate_by_how_much_and_the_next_chance(
    nursery, tmp_path, running: StoppableGateway
):
    wallets = tmp_path / "wallets"
    keys.create_wallet(wallets, "gates", "master")
    owner = keys.create_wallet(wallets, "gates", "owner")
    miner = keys.create_wallet(wallets, "gates", "miner")
    genesis = int(time.time())
    config = load_config(
        home=tmp_path,
        env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"},
        overrides={
            "gateway": {
                "port": 0,
                "miner_port": 0,
                "provider_port": 0,
                "qualification": False,
                "epoch_genesis": genesis,
                "epoch_s": EPOCH_S,
                "epoch_grace_s": GRACE_S,
                "gate_min_samples": 1,
                "wallets_path": str(wallets),
                "master_wallet": "gates/master",
                "owner_hotkey": owner,
            }
        },
    )
    # Its chain makes a block a second (a local network's dev chain): the gateway tells its miners.
    urls = await nursery.start(functools.partial(running.run, config, deposit_chain=DevChain(block_time_s=1.0)))
    clock = EpochClock(genesis, EPOCH_S, GRACE_S)
    served_at = time.time()
    with Store.open(store_path(config)) as store:
        log_slow_requests(store, miner, count=3, at=served_at)
    gated_epoch = clock.index_at(served_at)

    hub = Hub()
    async with httpx.AsyncClient(timeout=30) as http:
        watch = EpochWatch(http=http, gateway_url=urls.miner_url, hotkey=miner, hub=hub, hub_component="miner-1")
        with trio.fail_after(60):
            while (await watch.look()).index != gated_epoch:
                await trio.sleep(0.2)

    epoch = decode_states(hub.states(), strict=True).miners["miner-1"].epoch
    assert epoch is not None and epoch.error is None
    assert (epoch.weight, epoch.rows, epoch.score) == (0, 1, 0)
    assert epoch.gated == (
        GateFinding(
            epoch=gated_epoch,
            hotkey=miner,
            model=MODEL,
            gate="ttft_p99",
            measured=float(SLOW_TTFT_MS),
            limit=float(SMOLLM2_135M.qual_ttft_p99_ms),
            unit="ms",
            samples=3,
            text="TTFT p99 45,000 ms over 3 requests (ceiling 30,000 ms)",
            fix=FIXES["ttft_p99"],
        ),
    )
    next_end = clock.window(gated_epoch + 1)[1]
    assert (epoch.next_index, epoch.next_end, epoch.next_closes_at) == (gated_epoch + 1, next_end, next_end + GRACE_S)
    assert epoch.block_time_s == 1.0


async def no_key(key: str) -> str | None:
    return None


@pytest.fixture
async def endpoint(nursery, tmp_path):
    """A miner endpoint over a store that has published nothing."""
    with Store.open(tmp_path / "gateway.sqlite3") as store:
        pool = MinerPool(
            served_models={MODEL: "ab" * 32},
            authenticate_key=no_key,
            allowed_hotkeys=set,
            settings=PoolSettings(),
        )
        epochs = MinerEpochs(store=store, clock=EpochClock(0, 60, 10), terms={})
        binds = await nursery.start(serve, build_miner_app(pool, epochs=epochs), hypercorn_config("127.0.0.1:0"))
        yield binds[0].replace("http://", "ws://") + "/gw"


async def test_before_the_first_epoch_the_miner_is_told_none_is_published_yet_and_an_older_gateway_says_so(endpoint):
    hub = Hub()
    async with httpx.AsyncClient(timeout=30) as http:
        watch = EpochWatch(http=http, gateway_url=endpoint, hotkey="5Fminer", hub=hub, hub_component="miner")
        epoch = await watch.look()
        assert epoch.index is None and epoch.error == f"{watch.url}: no epoch has been published yet"
        assert decode_states(hub.states(), strict=True).miners["miner"].epoch == epoch
        elsewhere = EpochWatch(http=http, gateway_url=endpoint + "/old", hotkey="5F", hub=hub, hub_component="miner")
        assert (await elsewhere.look()).error == f"{elsewhere.url}: {NO_ROUTE}"
        refused = await http.get(endpoint.replace("ws://", "http://") + "/epoch/latest?hotkey=not%20one")
    assert refused.status_code == 400 and "hotkey" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("start", "end", "poll_s"),
    [(None, None, FIRST_POLL_S), (0, 0, FIRST_POLL_S), (0, 60, 15.0), (0, 8, MIN_POLL_S), (0, 604_800, MAX_POLL_S)],
)
def test_the_watch_looks_a_quarter_of_an_epoch_apart_within_bounds(start, end, poll_s):
    assert poll_interval(MinerEpoch(start=start, end=end)) == poll_s


def test_the_epoch_url_is_the_http_form_of_the_miners_gateway_url():
    assert epoch_url("wss://api.engy.ai/gw/", "5F") == "https://api.engy.ai/gw/epoch/latest?hotkey=5F"
    assert epoch_url("ws://127.0.0.1:8081/gw", "5G") == "http://127.0.0.1:8081/gw/epoch/latest?hotkey=5G"
