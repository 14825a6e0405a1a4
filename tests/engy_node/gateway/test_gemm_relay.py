"""GEMM challenges from a verifier to the miner that served the answer (issue 32): the pool's
`challenge` over a real websocket leg with a raw peer playing the miner (round trip, the miner's
error, no answer, the leg closing), the commitment asked on every request of a miner that
announced the feature, the audit desk's rules and codes, the provider API's route through the
real HTTP audit source, and the whole path on a running gateway with a synthetic miner."""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from trio_websocket import open_websocket_url

from engy_node.asgi import start_listener
from engy_node.config import load_config
from engy_node.gateway.api.app import build_miner_app, hypercorn_config
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.routing.pool import MAX_CHALLENGES_PER_LEG, MinerPool, PoolSettings
from engy_node.gateway.store import Store
from engy_node.gateway.trust.audit import AuditQueue
from engy_node.gateway.trust.audit_desk import AuditDesk, DeskAuditSource
from engy_node.gateway.trust.provider_api import PREFIX, ProviderApi, build_provider_app
from engy_node.hub import Hub
from engy_node.miner.link import Identity, LinkSettings
from engy_node.models import SMOLLM2_135M
from engy_node.proof import Delivery
from engy_node.protocol.audit import (
    LEG_GONE,
    LOCAL_VERIFIER,
    NO_COMMITMENT,
    NO_OPENING,
    NOT_LEASED,
    TOO_LATE,
    UNREACHABLE,
    AuditJob,
    AuditRefused,
    GemmOpeningFailed,
)
from engy_node.protocol.gemm import FEATURE_GEMM, RECORD_WINDOW_S, GemmChallenge, GemmOpenings, GemmPick
from engy_node.protocol.miner import (
    Admit,
    Capacity,
    Hello,
    Message,
    Sampling,
    Serve,
    ServeRequest,
    encode,
    parse_gateway_frame,
)
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link
from engy_node.verifier.sources import GatheredAuditSource, HttpAuditSource
from tests.waiting import wait_until_async

ROOT = "ab" * 32
KEY = "engy-mk-good"
MODEL = "smollm2-135m"
NETUID = 53
PICKS = (GemmPick(3, 1, "residual_in"), GemmPick(3, 1, "q"))
OPENINGS = ({"position": 3, "layer": 1, "group": "residual_in", "data": "AAAA", "path": []},)
COMMITMENT = {"format": "engy-activations-v1", "activations_root": "cd" * 32, "positions": 5}


async def lookup(key: str) -> str | None:
    return "7" if key == KEY else None


def hello(features: frozenset[str] = frozenset({FEATURE_GEMM})) -> Hello:
    return Hello(
        miner_key=KEY,
        model=MODEL,
        model_root=ROOT,
        hw={},
        versions={},
        capacity=Capacity(2, 2, 6144, 2048, 600),
        worker_name="rig",
        worker_id=uuid.uuid4().hex,
        features=features,
    )


async def start_pool(nursery, **settings) -> tuple[MinerPool, str]:
    pool = MinerPool(
        served_models={MODEL: ROOT},
        authenticate_key=lookup,
        allowed_hotkeys=set,
        settings=PoolSettings(**settings),
    )
    binds = await nursery.start(serve, build_miner_app(pool), hypercorn_config("127.0.0.1:0"))
    return pool, binds[0].replace("http://", "ws://") + "/gw"


async def admitted(stack: contextlib.AsyncExitStack, pool: MinerPool, url: str, frame: Hello):
    """A raw peer admitted on a leg: its connection and the leg's id."""
    known = set(pool.legs)
    connection = await stack.enter_async_context(open_websocket_url(url))
    await connection.send_message(encode(frame))
    assert isinstance(parse_gateway_frame(await connection.get_message()), Admit)
    (leg_id,) = set(pool.legs) - known
    return connection, leg_id


async def challenged(connection) -> GemmChallenge:
    frame = parse_gateway_frame(await connection.get_message())
    assert isinstance(frame, GemmChallenge)
    return frame


def request() -> ServeRequest:
    return ServeRequest(messages=(Message("user", "hi"),), max_tokens=4, engy_request_id="r1")


# ---- the pool --------------------------------------------------------------------------------
async def test_a_challenge_goes_to_the_leg_and_its_openings_come_back(nursery):
    pool, url = await start_pool(nursery)
    async with contextlib.AsyncExitStack() as stack:
        connection, leg_id = await admitted(stack, pool, url, hello())
        async with trio.open_nursery() as miner:

            async def answer() -> None:
                challenge = await challenged(connection)
                assert (challenge.rid, challenge.picks) == ("rid-1", PICKS)
                # An answer to a challenge nobody waits for any more is dropped, the leg kept.
                await connection.send_message(encode(GemmOpenings("g-stale", OPENINGS)))
                await connection.send_message(encode(GemmOpenings(challenge.challenge_id, OPENINGS)))

            miner.start_soon(answer)
            with trio.fail_after(30):
                assert await pool.challenge(leg_id, "rid-1", PICKS, timeout_s=30) == OPENINGS
        assert leg_id in pool.legs and not pool.legs[leg_id].challenges


@pytest.mark.parametrize("announced, enabled, asked", [(True, True, True), (False, True, False), (True, False, False)])
async def test_a_miner_that_announced_gemm_audits_is_asked_to_commit_on_every_request(
    nursery, announced, enabled, asked
):
    pool, url = await start_pool(nursery, gemm_audit=enabled)
    async with contextlib.AsyncExitStack() as stack:
        features = frozenset({FEATURE_GEMM}) if announced else frozenset()
        connection, leg_id = await admitted(stack, pool, url, hello(features))
        pending = await pool.dispatch(leg_id, request(), stream=False)
        frame = parse_gateway_frame(await connection.get_message())
        assert isinstance(frame, Serve) and frame.request.gemm_commitment is asked
        assert pending.gemm_asked is asked


async def test_the_miners_error_is_no_opening_with_its_reason(nursery):
    pool, url = await start_pool(nursery)
    async with contextlib.AsyncExitStack() as stack:
        connection, leg_id = await admitted(stack, pool, url, hello())
        async with trio.open_nursery() as miner:

            async def refuse() -> None:
                challenge = await challenged(connection)
                await connection.send_message(encode(GemmOpenings(challenge.challenge_id, error="record expired")))

            miner.start_soon(refuse)
            with pytest.raises(GemmOpeningFailed) as failed, trio.fail_after(30):
                await pool.challenge(leg_id, "rid-1", PICKS, timeout_s=30)
        assert failed.value.code == NO_OPENING and "record expired" in failed.value.message


async def test_a_miner_that_does_not_answer_in_time_is_no_opening(nursery):
    pool, url = await start_pool(nursery)
    async with contextlib.AsyncExitStack() as stack:
        connection, leg_id = await admitted(stack, pool, url, hello())
        with pytest.raises(GemmOpeningFailed) as failed:
            await pool.challenge(leg_id, "rid-1", PICKS, timeout_s=0.2)
        assert failed.value.code == NO_OPENING and "within 0.2 s" in failed.value.message
        assert not pool.legs[leg_id].challenges, "a challenge that gave up is forgotten"
        await challenged(connection)  # it was sent all the same


async def test_a_leg_that_closes_or_is_gone_is_leg_gone(nursery):
    pool, url = await start_pool(nursery)
    with pytest.raises(GemmOpeningFailed) as failed:
        await pool.challenge("no-such-leg", "rid-1", PICKS, timeout_s=30)
    assert failed.value.code == LEG_GONE
    async with contextlib.AsyncExitStack() as stack:
        connection, leg_id = await admitted(stack, pool, url, hello())
        async with trio.open_nursery() as miner:

            async def hang_up() -> None:
                await challenged(connection)
                await connection.aclose()

            miner.start_soon(hang_up)
            with pytest.raises(GemmOpeningFailed) as failed, trio.fail_after(30):
                await pool.challenge(leg_id, "rid-1", PICKS, timeout_s=30)
        assert failed.value.code == LEG_GONE and "closed" in failed.value.message


async def test_a_leg_without_the_feature_is_not_challenged(nursery):
    pool, url = await start_pool(nursery)
    async with contextlib.AsyncExitStack() as stack:
        _, leg_id = await admitted(stack, pool, url, hello(frozenset()))
        with pytest.raises(GemmOpeningFailed) as failed:
            await pool.challenge(leg_id, "rid-1", PICKS, timeout_s=30)
        assert failed.value.code == NO_OPENING and FEATURE_GEMM in failed.value.message


async def test_a_leg_holds_a_bounded_number_of_challenges(nursery):
    pool, url = await start_pool(nursery)
    async with contextlib.AsyncExitStack() as stack:
        _, leg_id = await admitted(stack, pool, url, hello())
        async with trio.open_nursery() as waiting:
            for _ in range(MAX_CHALLENGES_PER_LEG):
                waiting.start_soon(lambda: pool.challenge(leg_id, "rid", PICKS, timeout_s=60))
            with trio.fail_after(30):
                while len(pool.legs[leg_id].challenges) < MAX_CHALLENGES_PER_LEG:
                    await trio.sleep(0.01)
            with pytest.raises(GemmOpeningFailed) as failed:
                await pool.challenge(leg_id, "rid", PICKS, timeout_s=60)
            assert failed.value.code == NO_OPENING and "already wait" in failed.value.message
            waiting.cancel_scope.cancel()


# ---- the desk --------------------------------------------------------------------------------
def job(request_id: str, *, commitment: bool = True, age_s: float = 0.0) -> AuditJob:
    return AuditJob(
        request_id=request_id,
        model=MODEL,
        miner="5MinerHotkey",
        kind="paid",
        prompt_ids=(1, 2, 3),
        commitment={"output_token_ids": [4, 5, 6]},
        greedy=True,
        sampling=Sampling(),
        seeded=False,
        delivery=Delivery(relayed_output_ids=(4, 5, 6), ended_at_stop=False, max_tokens=8),
        created_at=time.time() - age_s,
        gemm_asked=True,
        gemm_commitment=COMMITMENT if commitment else None,
        gemm_rid=f"rid-{request_id}" if commitment else None,
        leg_id="leg-1",
    )


class Challenger:
    """The pool's `challenge` as the desk sees it: what was asked, and a scripted answer."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, tuple[GemmPick, ...], float]] = []
        self.failure: GemmOpeningFailed | None = None

    async def __call__(self, leg_id: str, rid: str, picks: tuple[GemmPick, ...], *, timeout_s: float):
        self.asked.append((leg_id, rid, picks, timeout_s))
        if self.failure is not None:
            raise self.failure
        return OPENINGS


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "gateway.sqlite3") as store:
        yield store


def desk_with(store: Store, challenger: Challenger | None) -> AuditDesk:
    return AuditDesk(queue=AuditQueue(lease_s=60.0), store=store, challenge=challenger, opening_timeout_s=7.0)


async def test_the_desk_relays_a_leased_jobs_challenge_over_its_leg(store):
    challenger = Challenger()
    desk = desk_with(store, challenger)
    desk.offer(job("r1"))
    desk.lease("alice", limit=1)
    assert await desk.open_gemm("alice", "r1", PICKS) == OPENINGS
    assert challenger.asked == [("leg-1", "rid-r1", PICKS, 7.0)]


async def test_the_desk_refuses_what_it_may_not_open_with_a_code(store):
    challenger = Challenger()
    desk = desk_with(store, challenger)
    desk.offer(job("r1"))
    desk.offer(job("bare", commitment=False))
    with pytest.raises(AuditRefused) as refused:
        await desk.open_gemm("alice", "r1", PICKS)
    assert (refused.value.status, refused.value.code) == (409, NOT_LEASED), "leased to nobody yet"
    desk.lease("bob", limit=2)
    with pytest.raises(AuditRefused) as refused:
        await desk.open_gemm("alice", "r1", PICKS)
    assert refused.value.code == NOT_LEASED, "leased to someone else"
    with pytest.raises(AuditRefused) as refused:
        await desk.open_gemm("bob", "bare", PICKS)
    assert (refused.value.status, refused.value.code) == (409, NO_COMMITMENT)
    with pytest.raises(AuditRefused) as refused:
        await desk.open_gemm("bob", "never-offered", PICKS)
    assert refused.value.status == 404
    assert challenger.asked == [], "nothing reached a miner"


@pytest.mark.parametrize("code, status", [(NO_OPENING, 502), (LEG_GONE, 410)])
async def test_no_openings_from_the_miner_is_refused_with_its_code(store, code, status):
    challenger = Challenger()
    challenger.failure = GemmOpeningFailed(code, "why")
    desk = desk_with(store, challenger)
    desk.offer(job("r1"))
    desk.lease(LOCAL_VERIFIER, limit=1)
    with pytest.raises(AuditRefused) as refused:
        await desk.open_gemm(LOCAL_VERIFIER, "r1", PICKS)
    assert (refused.value.status, refused.value.code, refused.value.message) == (status, code, "why")
    with pytest.raises(GemmOpeningFailed) as failed:
        await DeskAuditSource(desk).open_gemm("r1", PICKS)
    assert (failed.value.code, failed.value.message) == (code, "why")


async def test_an_answer_past_the_miners_record_window_is_too_late_and_never_reaches_it(store):
    challenger = Challenger()
    desk = desk_with(store, challenger)
    desk.offer(job("fresh", age_s=RECORD_WINDOW_S - 7.0 - 5))
    desk.offer(job("old", age_s=RECORD_WINDOW_S - 7.0 + 5))
    desk.lease(LOCAL_VERIFIER, limit=2)
    assert await desk.open_gemm(LOCAL_VERIFIER, "fresh", PICKS) == OPENINGS
    with pytest.raises(GemmOpeningFailed) as failed:
        await DeskAuditSource(desk).open_gemm("old", PICKS)
    assert failed.value.code == TOO_LATE and "TOPLOC alone" in failed.value.message
    assert [asked[1] for asked in challenger.asked] == ["rid-fresh"]


async def test_a_desk_without_a_pool_relays_nothing(store):
    desk = desk_with(store, None)
    desk.offer(job("r1"))
    desk.lease(LOCAL_VERIFIER, limit=1)
    with pytest.raises(GemmOpeningFailed) as failed:
        await DeskAuditSource(desk).open_gemm("r1", PICKS)
    assert failed.value.code == LEG_GONE


# ---- the provider API and the verifier's HTTP source -----------------------------------------
async def provider(nursery, store: Store, desk: AuditDesk, alice) -> str:
    async def current() -> dict:
        return {"v": 1, "epoch_index": 0, "final": False}

    api = ProviderApi(
        desk=desk, store=store, netuid=NETUID, verifiers=frozenset({alice.ss58_address}), current_epoch=current
    )
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    binds = await start_listener(nursery, build_provider_app(api), config, what="provider API", flag="test")
    return binds[0]


async def test_a_remote_verifier_opens_a_leased_job_through_the_provider_api(nursery, store, alice, bob):
    challenger = Challenger()
    desk = desk_with(store, challenger)
    desk.offer(job("r1"))
    desk.offer(job("r2"))
    url = await provider(nursery, store, desk, alice)
    source = HttpAuditSource(url, keypair=alice, netuid=NETUID)
    gathered = GatheredAuditSource([source])
    try:
        (leased,) = await gathered.lease(1)
        wire = leased.job.to_wire(for_verifier=True)
        assert wire["gemm"] == {"asked": True, "commitment": COMMITMENT} and "leg_id" not in wire
        assert leased.job.gemm_rid is None, "the miner's rid stays with the gateway"
        assert await gathered.open_gemm("r1", PICKS) == OPENINGS
        assert challenger.asked == [("leg-1", "rid-r1", PICKS, 7.0)]
        with pytest.raises(GemmOpeningFailed) as failed:
            await gathered.open_gemm("r2", PICKS)
        assert failed.value.code == NOT_LEASED, "never leased through this source"
        with pytest.raises(GemmOpeningFailed) as failed:
            await source.open_gemm("r2", PICKS)
        assert failed.value.code == NOT_LEASED, "the gateway's own word: leased to nobody"
        challenger.failure = GemmOpeningFailed(NO_OPENING, "the miner sent no openings within 7 s")
        with pytest.raises(GemmOpeningFailed) as failed:
            await source.open_gemm("r1", PICKS)
        assert failed.value.code == NO_OPENING and "within 7 s" in failed.value.message
        stranger = HttpAuditSource(url, keypair=bob, netuid=NETUID)
        with pytest.raises(GemmOpeningFailed) as failed:
            await stranger.open_gemm("r1", PICKS)
        assert failed.value.code == "not_a_verifier"
        await stranger.aclose()
    finally:
        await gathered.aclose()


async def test_malformed_picks_are_refused_and_a_gateway_out_of_reach_is_unreachable(nursery, store, alice):
    desk = desk_with(store, Challenger())
    desk.offer(job("r1"))
    desk.lease(alice.ss58_address, limit=1)
    url = await provider(nursery, store, desk, alice)
    source = HttpAuditSource(url, keypair=alice, netuid=NETUID)
    try:
        with pytest.raises(GemmOpeningFailed) as failed:
            await source.open_gemm("r1", ())
        assert failed.value.code == "invalid_request" and "picks" in failed.value.message
        response = await source.client.post(f"{url}{PREFIX}/audit/jobs/r1/gemm-openings", content=b"{}")
        assert response.status_code == 401, "unsigned"
    finally:
        await source.aclose()
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    nowhere = HttpAuditSource(closed, keypair=alice, netuid=NETUID)
    with pytest.raises(GemmOpeningFailed) as failed:
        await nowhere.open_gemm("r1", PICKS)
    assert failed.value.code == UNREACHABLE
    await nowhere.aclose()


# ---- the whole path --------------------------------------------------------------------------
async def gemm_gateway(nursery, tmp_path, checkpoint, verifier, **gateway):
    """A real gateway auditing every paid answer, `verifier` its one verifier, with `gateway`
    settings over that: its urls, the served model, a registered miner's key and a credited
    buyer's key."""
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    settings = {
        "port": 0,
        "miner_port": 0,
        "provider_port": 0,
        "qualification": False,
        "audit_paid_pct": 100.0,
        "verifiers": verifier.ss58_address,
        **gateway,
    }
    config = load_config(home=tmp_path, env=env, overrides={"gateway": settings})
    urls = await nursery.start(run_gateway, config, Hub())
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    with Store.open(store_path(config)) as store:
        _, miner_key = store.register_miner("gemm-miner")
        account_id, buyer_key = store.create_buyer("buyer")
        store.credit(account_id, micro_usd=1_000_000)
    return urls, served, miner_key, buyer_key


async def test_a_served_answers_commitment_reaches_the_verifier_and_its_openings_come_from_the_miner(
    nursery, tmp_path, checkpoint, alice
):
    urls, served, miner_key, buyer_key = await gemm_gateway(nursery, tmp_path, checkpoint, alice)
    handler = SyntheticHandler(served, lambda frame: Script(gemm_commitment=COMMITMENT))
    async with httpx.AsyncClient(timeout=60) as http:
        link = synthetic_link(
            gateway_url=urls.miner_url,
            model=served,
            identity=Identity(miner_key=miner_key),
            handler=handler,
            http=http,
            settings=LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05),
            gemm_audits=True,
        )
        await nursery.start(link.run)
        answer = await http.post(
            urls.buyer_url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {buyer_key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
        )
        assert answer.status_code == 200, answer.text
        assert handler.served[-1].request.gemm_commitment, "asked, though nothing said it would be audited"
        source = HttpAuditSource(urls.provider_url, keypair=alice, netuid=NETUID)
        try:
            leased = []

            async def leased_one() -> bool:
                leased.extend(await source.lease(1))
                return bool(leased)

            await wait_until_async(leased_one, timeout_s=30, what="the answer leased as an audit job")
            audit_job = leased[0].job
            assert (audit_job.gemm_asked, audit_job.gemm_commitment) == (True, COMMITMENT)
            assert audit_job.gemm_rid is None and audit_job.leg_id == "", "the rid and the leg stay at the gateway"
            openings = await source.open_gemm(audit_job.request_id, PICKS)
            assert [(o["position"], o["layer"], o["group"]) for o in openings] == [
                (p.position, p.layer, p.group) for p in PICKS
            ]
            (challenge,) = handler.challenges
            assert challenge.rid.startswith(handler.served[-1].corr_id) and challenge.picks == PICKS
        finally:
            await source.aclose()
