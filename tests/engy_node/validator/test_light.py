"""The light loop against the dev chain through the real bittensor SDK, and a provider on loopback.

The provider is a real HTTP server serving payloads signed by a master key the test holds, so
every tick runs the real fetch (size cap included), verification, chain read, uid resolution and
`SetWeights` through `bt.SyncClient`; the dev chain applies or refuses the extrinsic as the
chain does. Clocks are manual: the chain's blocks and the loop's wall clock move only when a test
advances them, together (12 s per block), so nothing sleeps.
"""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
import trio
from bittensor.sp_core import Keypair
from hypercorn.config import Config as HypercornConfig
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engy_node import keys
from engy_node.asgi import start_listener
from engy_node.hub import Hub
from engy_node.local.devchain import DevChain
from engy_node.local.devchain_state import SubnetParams
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.epoch import build_result_json, encode_payload, sign_epoch
from engy_node.snapshots import decode_states
from engy_node.validator.chain import ChainClient
from engy_node.validator.light import EPOCH_PATH, HEARTBEAT_PATH, LightSettings, LightValidator, Watchdog
from engy_node.validator.state import read_state

NETUID = 53
BLOCK_S = 12.0
RATE_LIMIT = 100
INTERVAL = 120
MASTER = Keypair.create_from_uri("//engy-test-master")
FORGER = Keypair.create_from_uri("//engy-test-forger")
MINER_A = Keypair.create_from_uri("//engy-test-miner-a").ss58_address
MINER_B = Keypair.create_from_uri("//engy-test-miner-b").ss58_address
STRANGER = Keypair.create_from_uri("//engy-test-stranger").ss58_address


class Clocks:
    """The chain's monotonic clock and the loop's wall clock, moved together."""

    def __init__(self) -> None:
        self.elapsed = 0.0

    def monotonic(self) -> float:
        return self.elapsed

    def wall(self) -> float:
        return 1_800_000_000.0 + self.elapsed

    def blocks(self, count: int) -> None:
        self.elapsed += count * BLOCK_S


def payload(
    epoch_index: int, weights: list[list], *, signer: Keypair = MASTER, rows: list[dict] | None = None
) -> bytes:
    result = build_result_json(
        netuid=NETUID, epoch_index=epoch_index, settlement_json={"weights": weights, "rows": rows or []}
    )
    return encode_payload(sign_epoch(signer, netuid=NETUID, epoch_index=epoch_index, result_json=result))


class Provider:
    """What the provider answers on the epoch route, settable by the test; heartbeats recorded."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b""
        self.fetches = 0
        self.heartbeats: list[dict] = []

    async def epoch(self, request: Request) -> Response:
        self.fetches += 1
        return Response(self.body, status_code=self.status, media_type="application/json")

    async def heartbeat(self, request: Request) -> Response:
        body = await request.body()
        hotkey = request.headers[keys.HEADER_HOTKEY]
        message = keys.api_message(NETUID, "POST", HEARTBEAT_PATH, int(request.headers[keys.HEADER_TS]), body)
        assert keys.verify_signature(hotkey, message, request.headers[keys.HEADER_SIG])
        self.heartbeats.append(json.loads(body))
        return Response(b"{}", media_type="application/json")

    def app(self) -> Starlette:
        return Starlette(
            routes=[Route(EPOCH_PATH, self.epoch), Route(HEARTBEAT_PATH, self.heartbeat, methods=["POST"])]
        )


@pytest.fixture(autouse=True)
def sdk_files_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))
    monkeypatch.setenv("BITTENSOR_RUNTIME_CACHE_DIR", str(tmp_path / "runtime-cache"))


@pytest.fixture
def clocks():
    return Clocks()


@pytest.fixture
def chain(clocks):
    return DevChain(
        clock=clocks.monotonic,
        start_block=1000,
        block_time_s=BLOCK_S,
        params=SubnetParams(weights_rate_limit=RATE_LIMIT, tempo=360),
    )


@pytest.fixture
def validator_key(tmp_path):
    keys.create_wallet(tmp_path / "wallets", "validator", "default")
    return keys.load_hotkey(tmp_path / "wallets", "validator", "default")


@pytest.fixture
def registered(chain, clocks, validator_key):
    """A staked validator and two miners, past the validator's first rate-limit window."""
    validator_uid = chain.register(validator_key.ss58_address, stake_tao=1000)
    chain.register(MINER_A)
    chain.register(MINER_B)
    clocks.blocks(RATE_LIMIT)
    return validator_uid


@pytest.fixture
async def provider(nursery):
    served = Provider()
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    binds = await start_listener(nursery, served.app(), config, what="test provider", flag="-")
    served.url = binds[0]
    return served


@pytest.fixture
async def make_loop(tmp_path, chain, clocks, validator_key, provider):
    clients: list[ChainClient] = []
    async with httpx.AsyncClient() as http:

        def make(hub: Hub | None = None, **overrides) -> LightValidator:
            settings = LightSettings(
                **{
                    "provider_url": provider.url,
                    "master_hotkey": MASTER.ss58_address,
                    "netuid": NETUID,
                    "state_path": tmp_path / "validator" / "state.json",
                    "heartbeat_path": tmp_path / "validator" / "heartbeat.json",
                    "poll_s": 300.0,
                    "resubmit_blocks": INTERVAL,
                    "block_s": BLOCK_S,
                    **overrides,
                }
            )
            client = ChainClient("local", substrate=chain)
            clients.append(client)
            return LightValidator(settings, chain=client, signer=validator_key, http=http, clock=clocks.wall, hub=hub)

        yield make
    for client in clients:
        client.close()


def uid_weights(chain: DevChain, validator_uid: int) -> dict[int, int]:
    return chain.weights().get(validator_uid, {})


def submissions(chain: DevChain) -> int:
    return len(chain.submissions)


async def test_a_new_epoch_goes_on_chain_at_once_and_is_recorded(registered, chain, provider, make_loop, tmp_path):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop()
    result = await loop.tick()
    assert result.outcome == "applied" and result.epoch == 5
    row = uid_weights(chain, registered)
    assert row[chain.neurons()[2].uid] == 65535 and abs(row[3] / 65535 - 1 / 3) < 0.001
    state, problems = read_state(tmp_path / "validator" / "state.json")
    assert problems == ()
    assert state.last_applied == 5 and state.last_submit_block == result.block
    assert state.cached_weights == ((MINER_A, 3000), (MINER_B, 1000))


async def test_the_same_vector_is_resubmitted_every_interval_and_not_before(
    registered, chain, clocks, provider, make_loop
):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop()
    first = await loop.tick()
    assert first.outcome == "applied"
    after_first = submissions(chain)

    clocks.blocks(10)
    assert (await loop.tick()).outcome == "skipped:too-soon"  # the wall-clock pre-gate: no chain read
    clocks.blocks(INTERVAL - 20)
    assert (await loop.tick()).outcome == "skipped:too-soon"  # past the pre-gate, the block says not yet
    assert submissions(chain) == after_first

    clocks.blocks(10)
    again = await loop.tick()
    assert again.outcome == "resubmitted" and again.block - first.block >= INTERVAL
    assert submissions(chain) == after_first + 1
    me = next(neuron for neuron in chain.neurons() if neuron.uid == registered)
    assert me.last_update > first.block


async def test_a_provider_outage_resubmits_the_cached_vector(registered, chain, clocks, provider, make_loop):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop()
    assert (await loop.tick()).outcome == "applied"
    provider.status, provider.body = 503, b'{"error": "down"}'
    clocks.blocks(INTERVAL)
    result = await loop.tick()
    assert result.outcome == "resubmitted:cached" and result.epoch == 5
    assert chain.submissions[-1].ok


async def test_nothing_is_submitted_without_a_verified_payload_or_a_cache(
    registered, chain, provider, make_loop, caplog
):
    provider.status, provider.body = 503, b"down"
    loop = make_loop()
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        assert (await loop.tick()).outcome == "fetch-failed"
    assert submissions(chain) == 0
    assert "no cached vector yet" in caplog.text


async def test_a_provider_with_no_epoch_yet_is_a_quiet_wait_not_a_failure(
    registered, chain, provider, make_loop, caplog
):
    provider.status, provider.body = (
        404,
        b'{"error": {"code": "no_epoch", "message": "no epoch has been published yet"}}',
    )
    with caplog.at_level(logging.INFO, logger="engy.validator"):
        assert (await make_loop().tick()).outcome == "no-epoch-yet"
    assert submissions(chain) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("engy.validator")]


async def test_a_forged_signature_is_refused(registered, chain, provider, make_loop, caplog):
    provider.body = payload(5, [[MINER_A, 65535]], signer=FORGER)
    loop = make_loop()
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        result = await loop.tick()
    assert result.outcome == "rejected:wrong-signer"
    assert submissions(chain) == 0 and "does not verify for the pinned master" in caplog.text


async def test_a_payload_over_the_size_cap_is_refused_without_reading_it_all(registered, chain, provider, make_loop):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop(max_payload_bytes=len(provider.body) - 1)
    assert (await loop.tick()).outcome == "rejected:too-large"
    assert submissions(chain) == 0


async def test_a_replayed_older_epoch_is_refused_and_the_cache_kept_on_chain(
    registered, chain, clocks, provider, make_loop, caplog
):
    provider.body = payload(6, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop()
    assert (await loop.tick()).outcome == "applied"
    provider.body = payload(5, [[MINER_B, 65535]])  # genuinely signed, but older
    clocks.blocks(INTERVAL)
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        result = await loop.tick()
    assert result.outcome == "resubmitted:cached" and result.epoch == 6
    assert "replay guard" in caplog.text
    row = uid_weights(chain, registered)
    assert row[2] == 65535 and row[3] < 65535  # still epoch 6's 3:1, never epoch 5's vector


async def test_unregistered_hotkeys_fall_back_to_the_cache_then_to_a_burn(
    registered, chain, clocks, provider, make_loop, tmp_path
):
    loop = make_loop()
    provider.body = payload(7, [[STRANGER, 65535]])
    result = await loop.tick()
    assert result.outcome == "standby:burn"
    assert uid_weights(chain, registered) == {0: 65535}  # uid 0 is the subnet owner
    state, _ = read_state(tmp_path / "validator" / "state.json")
    assert state.last_applied == 7 and state.cached_weights is None  # a standby never becomes the cache

    provider.body = payload(8, [[MINER_A, 1000], [MINER_B, 1000]])
    clocks.blocks(INTERVAL)
    assert (await loop.tick()).outcome == "applied"
    provider.body = payload(9, [[STRANGER, 65535]])
    clocks.blocks(INTERVAL)
    assert (await loop.tick()).outcome == "standby:cached"
    assert set(uid_weights(chain, registered)) == {2, 3}
    state, _ = read_state(tmp_path / "validator" / "state.json")
    assert state.last_applied == 9 and state.cached_weights == ((MINER_A, 1000), (MINER_B, 1000))


async def test_a_partly_registered_vector_drops_and_logs_the_rest(registered, chain, provider, make_loop, caplog):
    provider.body = payload(5, [[MINER_A, 3000], [STRANGER, 1000]])
    loop = make_loop()
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        assert (await loop.tick()).outcome == "applied"
    assert "1 payload hotkey(s) not registered on chain, holding 25.0% of the weight" in caplog.text
    assert uid_weights(chain, registered) == {2: 65535}


async def test_a_validator_without_a_permit_is_refused_by_the_chain_and_nothing_is_recorded(
    chain, clocks, validator_key, provider, make_loop, tmp_path, caplog
):
    chain.register(validator_key.ss58_address)  # no stake: no validator permit
    chain.register(MINER_A)
    clocks.blocks(RATE_LIMIT)
    provider.body = payload(5, [[MINER_A, 65535]])
    loop = make_loop()
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        result = await loop.tick()
    assert result.outcome == "submit-failed"
    assert "NeuronNoValidatorPermit" in caplog.text and "no validator permit" in caplog.text
    assert not (tmp_path / "validator" / "state.json").exists()
    assert chain.submissions[-1].ok is False


async def test_a_pool_rejection_is_not_recorded_and_the_next_tick_retries(
    registered, chain, provider, make_loop, tmp_path, caplog
):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop()
    chain.reject_next(6)
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        assert (await loop.tick()).outcome == "submit-failed"
    assert "RateLimitExceeded" in caplog.text
    assert not (tmp_path / "validator" / "state.json").exists()
    assert (await loop.tick()).outcome == "applied"


async def test_a_preflight_refusal_names_the_sdk_code(registered, chain, clocks, provider, make_loop, caplog):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop(resubmit_blocks=RATE_LIMIT // 2)  # an interval inside the chain's rate limit
    assert (await loop.tick()).outcome == "applied"
    clocks.blocks(RATE_LIMIT // 2)
    with caplog.at_level(logging.WARNING, logger="engy.validator"):
        assert (await loop.tick()).outcome == "submit-failed"
    assert "preflight refusal" in caplog.text and "rate_limited" in caplog.text
    assert "does not clear the chain's weights_rate_limit" in caplog.text


async def test_state_written_against_another_chain_does_not_block_submits(
    registered, chain, provider, make_loop, tmp_path
):
    from engy_node.validator.state import ValidatorState, write_state

    write_state(
        tmp_path / "validator" / "state.json",
        ValidatorState(
            last_applied=5,
            last_submit_block=10_000_000,
            last_submit_ts=0.0,
            cached_weights=((MINER_A, 3000),),
            cached_digest=None,
        ),
    )
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    assert (await make_loop().tick()).outcome == "resubmitted"


async def test_run_stamps_the_heartbeat_and_posts_a_signed_provider_heartbeat(
    registered, chain, provider, make_loop, tmp_path
):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    loop = make_loop(poll_s=3600.0)
    with trio.move_on_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(loop.run)
            while not provider.heartbeats:
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    beat = json.loads((tmp_path / "validator" / "heartbeat.json").read_text())
    assert beat["outcome"] == "applied" and beat["epoch"] == 5
    assert provider.heartbeats[0]["synced_epoch"] == 5
    assert provider.heartbeats[0]["consensus"]["epoch_index"] == 5


async def test_the_hub_shows_weights_and_every_submission_landed_or_refused(
    registered, chain, clocks, provider, make_loop
):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    hub = Hub()
    loop = make_loop(hub=hub)
    chain.reject_next(6)
    assert (await loop.tick()).outcome == "submit-failed"
    assert (await loop.tick()).outcome == "applied"
    state = hub.states()["validator"]
    assert [entry["landed"] for entry in state["submissions"]] == [True, False]  # newest first
    assert "RateLimitExceeded" in state["submissions"][1]["detail"]
    assert {row["hotkey"]: row["weight"] for row in state["weights"]} == {MINER_A: 3000, MINER_B: 1000}
    assert state["submitted_epoch"] == 5 and state["uid"] == registered and state["permit"] is True


async def test_a_miner_a_gate_zeroed_is_published_explained_rather_than_left_merely_unweighted(
    registered, chain, clocks, provider, make_loop
):
    row = {"model": SMOLLM2_135M.id, "requests": 120, "ok_2xx": 120, "counted": 120, "tpot_p99_ms": 20}
    rows = [
        {**row, "hotkey": MINER_A, "ttft_p99_ms": 900, "score": 14, "gate_reason": None},
        {**row, "hotkey": MINER_B, "ttft_p99_ms": 45_000, "score": 0, "gate_reason": "ttft_p99"},
    ]
    provider.body = payload(5, [[MINER_A, 65535]], rows=rows)
    hub = Hub()
    assert (await make_loop(hub=hub).tick()).outcome == "applied"
    validator = decode_states(hub.states(), strict=True).validator
    assert validator is not None
    assert [(f.epoch, f.hotkey, f.gate, f.measured, f.limit, f.samples) for f in validator.gated] == [
        (5, MINER_B, "ttft_p99", 45_000.0, float(SMOLLM2_135M.qual_ttft_p99_ms), 120)
    ]


def test_the_watchdog_exits_when_ticks_stop_completing():
    class Stuck:
        last_tick_monotonic = 0.0  # long ago on the monotonic clock

    exited = threading.Event()
    codes: list[int] = []

    def exit_fn(code: int) -> None:
        codes.append(code)
        exited.set()

    watchdog = Watchdog(Stuck(), limit_s=0.01, check_s=0.01, exit_fn=exit_fn)
    watchdog.start()
    assert exited.wait(5)
    watchdog.stop()
    assert codes == [1]


def test_the_watchdog_stays_quiet_while_ticks_complete():
    import time

    class Ticking:
        """A loop that has always just completed a tick; the watchdog reads it once a check."""

        def __init__(self) -> None:
            self.checks = 0
            self.checked = threading.Condition()

        @property
        def last_tick_monotonic(self) -> float:
            with self.checked:
                self.checks += 1
                self.checked.notify_all()
            return time.monotonic()

    ticking, codes = Ticking(), []
    watchdog = Watchdog(ticking, limit_s=1.0, check_s=0.01, exit_fn=codes.append)
    watchdog.start()
    with ticking.checked:  # nine checks have decided, and `stop` waits for the tenth to
        assert ticking.checked.wait_for(lambda: ticking.checks >= 10, timeout=5), f"checking stopped, exit {codes}"
    watchdog.stop()
    assert codes == []


async def test_a_chain_and_provider_outage_publishes_both_errors_and_that_no_cache_exists(tmp_path, validator_key):
    """Nothing answers: a closed port for the chain and for the provider. The hub says why each
    failed and that no cached vector stands in, so the validator tab can say so (issue 34)."""
    hub = Hub()
    settings = LightSettings(
        provider_url="http://127.0.0.1:9",
        master_hotkey=MASTER.ss58_address,
        netuid=NETUID,
        state_path=tmp_path / "validator" / "state.json",
        heartbeat_path=tmp_path / "validator" / "heartbeat.json",
    )
    client = ChainClient("ws://127.0.0.1:9")
    try:
        async with httpx.AsyncClient() as http:
            loop = LightValidator(settings, chain=client, signer=validator_key, http=http, hub=hub)
            with trio.fail_after(60):
                await loop._check_registration()
                result = await loop.tick()
    finally:
        client.close()
    assert result.outcome == "fetch-failed"
    state = hub.states()["validator"]
    assert state["chain_error"].startswith("RpcConnectionError: could not connect")
    assert state["provider_error"].startswith(f"http://127.0.0.1:9{EPOCH_PATH}: ConnectError")
    assert state["cached_vector"] is False


async def test_a_provider_outage_with_a_cache_says_the_cache_stands_in_and_a_good_read_clears_the_errors(
    registered, chain, clocks, provider, make_loop
):
    provider.body = payload(5, [[MINER_A, 3000], [MINER_B, 1000]])
    hub = Hub()
    loop = make_loop(hub=hub)
    assert (await loop.tick()).outcome == "applied"
    assert hub.states()["validator"]["provider_error"] is None
    provider.status, provider.body = 503, b'{"error": "down"}'
    clocks.blocks(INTERVAL)
    assert (await loop.tick()).outcome == "resubmitted:cached"
    state = hub.states()["validator"]
    assert state["cached_vector"] is True and state["chain_error"] is None
    assert "answered HTTP 503" in state["provider_error"]
