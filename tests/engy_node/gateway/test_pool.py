"""The miner endpoint over real websockets, on real hypercorn with the gateway's listener settings:
who is admitted, what a bad or oversized frame costs, stale legs, superseded legs, the drain
that tells miners to re-dial, and the routing table the pool keeps in step with its legs."""

from __future__ import annotations

import contextlib
import time
import uuid

import orjson
import pytest
import trio
from hypercorn.trio import serve
from hypothesis import given
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, open_websocket_url

from engy_node import keys
from engy_node.config import GatewaySection
from engy_node.gateway.api.app import build_miner_app, hypercorn_config
from engy_node.gateway.fleet.workers import leg_worker, miner_legs_cap
from engy_node.gateway.routing.pool import ADMISSION_REFRESH_S, MinerPool, PoolSettings
from engy_node.gateway.routing.router import Candidate
from engy_node.protocol.miner import (
    MAX_FRAME_BYTES,
    Admit,
    Capacity,
    Deny,
    Heartbeat,
    Hello,
    Message,
    Reconnect,
    Response,
    Serve,
    ServeRequest,
    encode,
    parse_gateway_frame,
)

ROOT = "ab" * 32
KEY = "engy-mk-good"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def lookup(key: str) -> str | None:
    return "7" if key == KEY else None


@pytest.fixture
async def gateway(nursery):
    clock = Clock()
    allowed: set[str] = set()
    pool = MinerPool(
        served_models={"smollm2-135m": ROOT},
        authenticate_key=lookup,
        allowed_hotkeys=lambda: allowed,
        settings=PoolSettings(stale_after_s=90),
        clock=clock,
    )
    binds = await nursery.start(serve, build_miner_app(pool), hypercorn_config("127.0.0.1:0"))
    return pool, binds[0].replace("http://", "ws://") + "/gw", clock, allowed


def hello(**overrides) -> Hello:
    fields = dict(
        miner_key=KEY,
        model="smollm2-135m",
        model_root=ROOT,
        hw={},
        versions={},
        capacity=Capacity(2, 2, 6144, 2048, 600),
        worker_name="rig",
        worker_id=uuid.uuid4().hex,
    )
    fields.update(overrides)
    return Hello(**fields)


async def dial(stack: contextlib.AsyncExitStack, url: str, frame: Hello):
    connection = await stack.enter_async_context(open_websocket_url(url))
    await connection.send_message(encode(frame))
    answer = parse_gateway_frame(await connection.get_message())
    return connection, answer


MODEL = "smollm2-135m"


def route(pool: MinerPool, **arguments) -> str | None:
    choice = pool.route(arguments.pop("model", MODEL), prefix=None, rr_counter=0, **arguments)
    return None if choice is None else choice.worker_id


def assert_table_follows_the_legs(pool: MinerPool) -> None:
    table = pool.tables[MODEL]
    assert {table[leg_id] for leg_id in table} == {
        Candidate(worker_id=leg.leg_id, capacity=leg.capacity, inflight=len(leg.inflight), lacks=leg.lacks)
        for leg in pool.legs.values()
    }


def request(request_id: str) -> ServeRequest:
    return ServeRequest(messages=(Message("user", "hi"),), max_tokens=4, engy_request_id=request_id)


async def test_a_known_miner_key_is_admitted_and_becomes_a_candidate(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, clock, _ = gateway
        connection, answer = await dial(connections, url, hello())
        assert isinstance(answer, Admit)
        leg_id = next(iter(pool.legs))
        assert route(pool) == leg_id
        entry = pool.tables[MODEL][leg_id]
        assert entry.capacity == 2 and entry.inflight == 0 and entry.lacks == pool.legs[leg_id].lacks
        assert route(pool, model="glm-5.2") is None
        await connection.aclose()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"miner_key": "engy-mk-wrong"}, "unknown miner key"),
        ({"model": "glm-5.2"}, "not served here"),
        ({"model_root": "cd" * 32}, "not the canonical"),
    ],
)
async def test_miners_that_cannot_be_trusted_are_denied_with_the_reason(gateway, overrides, reason):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        connection, answer = await dial(connections, url, hello(**overrides))
        assert isinstance(answer, Deny) and reason in answer.reason
        assert pool.legs == {}
        await connection.aclose()


async def test_a_signed_hello_from_a_registered_hotkey_is_admitted_and_a_replay_is_not(gateway):
    async with contextlib.AsyncExitStack() as connections:
        from bittensor.sp_core import Keypair

        pool, url, _, allowed = gateway
        keypair = Keypair.create_from_uri("//Bob")
        worker_id = uuid.uuid4().hex
        ts = int(time.time())
        signature = keys.sign(keypair, keys.hello_message(53, keypair.ss58_address, ts, worker_id))
        signed = hello(miner_key="", hotkey=keypair.ss58_address, ts=ts, signature=signature, worker_id=worker_id)
        connection, answer = await dial(connections, url, signed)
        assert isinstance(answer, Deny) and "not registered" in answer.reason
        await connection.aclose()
        allowed.add(keypair.ss58_address)
        signed = hello(
            miner_key="",
            hotkey=keypair.ss58_address,
            ts=ts + 1,
            worker_id=worker_id,
            signature=keys.sign(keypair, keys.hello_message(53, keypair.ss58_address, ts + 1, worker_id)),
        )
        connection, answer = await dial(connections, url, signed)
        assert isinstance(answer, Admit)
        assert next(iter(pool.legs.values())).identity.miner == keypair.ss58_address
        replayed, answer = await dial(connections, url, signed)
        assert isinstance(answer, Deny) and "replay" in answer.reason
        await connection.aclose()
        await replayed.aclose()


async def test_a_malformed_frame_closes_only_that_leg_and_fails_its_requests(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        bad, _ = await dial(connections, url, hello(worker_name="bad"))
        good, _ = await dial(connections, url, hello(worker_name="good"))
        bad_leg = next(leg for leg in pool.legs.values() if leg.hello.worker_name == "bad")
        request = ServeRequest(messages=(Message("user", "hi"),), max_tokens=4, engy_request_id="r1")
        pending = await pool.dispatch(bad_leg.leg_id, request, stream=False)
        assert isinstance(parse_gateway_frame(await bad.get_message()), Serve)
        await bad.send_message('{"type": "response", "corr_id": 5}')
        with trio.fail_after(5):
            while not pending.finished:
                await pending.changed.wait()
        assert pending.lost is not None
        assert [leg.hello.worker_name for leg in pool.legs.values()] == ["good"]
        with pytest.raises(ConnectionClosed) as closed:
            await bad.get_message()
        assert closed.value.reason.code == 1002 and "response.corr_id" in closed.value.reason.reason
        await good.aclose()


async def test_a_frame_over_the_limit_closes_only_that_leg_with_1009_naming_the_limit(gateway, caplog):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        big, _ = await dial(connections, url, hello(worker_name="big"))
        good, _ = await dial(connections, url, hello(worker_name="good"))
        big_leg, good_leg = (
            next(leg for leg in pool.legs.values() if leg.hello.worker_name == name) for name in ("big", "good")
        )
        request = ServeRequest(messages=(Message("user", "hi"),), max_tokens=4, engy_request_id="r1")
        lost = await pool.dispatch(big_leg.leg_id, request, stream=False)
        assert isinstance(parse_gateway_frame(await big.get_message()), Serve)
        oversized = '{"type": "response", "corr_id": "' + "x" * (MAX_FRAME_BYTES + 1_000_000) + '"}'
        with pytest.raises(ConnectionClosed) as closed, trio.fail_after(10):
            await big.send_message(oversized)
            await big.get_message()
        assert closed.value.reason.code == 1009
        assert closed.value.reason.reason == f"frame exceeds {MAX_FRAME_BYTES} bytes"
        with trio.fail_after(5):
            while not lost.finished:
                await lost.changed.wait()
        assert lost.lost is not None and [leg.hello.worker_name for leg in pool.legs.values()] == ["good"]
        assert (
            f"closing leg {big_leg.leg_id[:8]} of key:7: refused a frame, frame exceeds {MAX_FRAME_BYTES} bytes"
            in caplog.text
        )
        served = await pool.dispatch(good_leg.leg_id, request, stream=False)
        serve_frame = parse_gateway_frame(await good.get_message())
        await good.send_message(
            encode(Response(corr_id=serve_frame.corr_id, request_id="r1", commitment=None, output={"choices": []}))
        )
        with trio.fail_after(5):
            while not served.finished:
                await served.changed.wait()
        assert served.response is not None and served.lost is None
        await good.aclose()


async def test_a_frame_just_under_the_limit_is_read(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        connection, _ = await dial(connections, url, hello())
        leg_id = next(iter(pool.legs))
        pending = await pool.dispatch(
            leg_id, ServeRequest(messages=(Message("user", "hi"),), max_tokens=4, engy_request_id="r3"), stream=False
        )
        serve_frame = parse_gateway_frame(await connection.get_message())
        frame = encode(
            Response(
                corr_id=serve_frame.corr_id,
                request_id="r3",
                commitment=None,
                output={
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ""}}]
                },
            )
        )
        padding = MAX_FRAME_BYTES - len(frame.encode())
        await connection.send_message(frame.replace('"content":""', '"content":"' + "é" * (padding // 2) + '"'))
        with trio.fail_after(5):
            while not pending.finished:
                await pending.changed.wait()
        assert pending.lost is None and len(pending.response.output["choices"][0]["message"]["content"]) == padding // 2
        await connection.aclose()


async def test_the_limit_is_counted_in_utf8_bytes_not_characters(gateway, caplog):
    async with contextlib.AsyncExitStack() as connections:
        _, url, _, _ = gateway
        connection = await connections.enter_async_context(open_websocket_url(url))
        with pytest.raises(ConnectionClosed) as closed, trio.fail_after(10):
            await connection.send_message("é" * (MAX_FRAME_BYTES // 2 + 1))
            await connection.get_message()
    assert closed.value.reason.code == 1009
    assert f"refused a miner's hello: frame exceeds {MAX_FRAME_BYTES} bytes" in caplog.text


async def test_a_refused_hello_is_logged_and_closed_naming_the_field(gateway, caplog):
    async with contextlib.AsyncExitStack() as connections:
        _, url, _, _ = gateway
        connection = await connections.enter_async_context(open_websocket_url(url))
        wire = hello().to_wire()
        wire["capacity"]["max_inflight"] = 1.5
        await connection.send_message(orjson.dumps(wire).decode())
        with pytest.raises(ConnectionClosed) as closed:
            await connection.get_message()
    assert closed.value.reason.code == 1002
    assert closed.value.reason.reason == "invalid hello: hello.capacity.max_inflight: must be a whole number, got 1.5"
    assert "hello.capacity.max_inflight is invalid (must be a whole number, got 1.5)" in caplog.text


# --- legs per miner ------------------------------------------------------------------------------


@given(
    layout=st.integers(1, 64).flatmap(
        lambda legs: st.tuples(
            st.just(legs),
            st.integers(1, legs).flatmap(lambda workers: st.tuples(st.just(workers), st.integers(0, legs - workers))),
        )
    ),
    rigs=st.integers(1, 64),
)
def test_the_leg_cap_is_what_a_rigs_legs_can_put_on_one_worker_twice_over_per_rig(layout, rigs):
    fleet_legs, (workers, offset) = layout
    landed = [
        leg_worker(f"GET /gw/{index} HTTP/1.1".encode(), workers=workers, fleet_offset=offset, fleet_legs=fleet_legs)
        for index in range(fleet_legs)
    ]
    most_on_one_worker = max(landed.count(worker) for worker in range(workers))
    assert miner_legs_cap(rigs=rigs, fleet_legs=fleet_legs, workers=workers) == 2 * rigs * most_on_one_worker


def test_the_pools_default_leg_cap_is_the_default_rigs_on_a_one_worker_gateway():
    rigs = GatewaySection().max_rigs_per_miner
    assert PoolSettings().max_legs_per_miner == miner_legs_cap(rigs=rigs, fleet_legs=1, workers=1)


@pytest.mark.parametrize("arguments", [{"rigs": 0}, {"fleet_legs": 0}, {"workers": True}, {"rigs": 1.5}])
def test_nonsense_leg_cap_arguments_are_refused_naming_them(arguments):
    name = next(iter(arguments))
    with pytest.raises(ValueError, match=name):
        miner_legs_cap(**{"rigs": 1, "fleet_legs": 1, "workers": 1, **arguments})


async def test_a_miner_past_its_leg_cap_is_denied_naming_the_setting_and_its_first_legs_keep_serving(nursery, caplog):
    """Was: one miner key could open any number of legs."""
    pool = MinerPool(
        served_models={MODEL: ROOT},
        authenticate_key=lookup,
        allowed_hotkeys=set,
        settings=PoolSettings(max_legs_per_miner=2),
    )
    binds = await nursery.start(serve, build_miner_app(pool), hypercorn_config("127.0.0.1:0"))
    url = binds[0].replace("http://", "ws://") + "/gw"
    async with contextlib.AsyncExitStack() as connections:
        first, admitted_first = await dial(connections, url, hello(worker_name="rig-a"))
        second, admitted_second = await dial(connections, url, hello(worker_name="rig-b"))
        assert isinstance(admitted_first, Admit) and isinstance(admitted_second, Admit)
        extra, denied = await dial(connections, url, hello(worker_name="rig-c"))
        assert isinstance(denied, Deny)
        assert "miner key:7 already holds 2 legs" in denied.reason and "gateway.max_rigs_per_miner" in denied.reason
        with pytest.raises(ConnectionClosed) as closed:
            await extra.get_message()
        assert closed.value.reason.code == 1008
        assert "denied miner rig-c (smollm2-135m): miner key:7 already holds 2 legs" in caplog.text
        assert sorted(leg.hello.worker_name for leg in pool.legs.values()) == ["rig-a", "rig-b"]

        # The first two still serve.
        for index, (connection, name) in enumerate(((first, "rig-a"), (second, "rig-b"))):
            leg = next(leg for leg in pool.legs.values() if leg.hello.worker_name == name)
            pending = await pool.dispatch(leg.leg_id, request(f"r{index}"), stream=False)
            serve_frame = parse_gateway_frame(await connection.get_message())
            assert isinstance(serve_frame, Serve)
            await connection.send_message(
                encode(Response(corr_id=serve_frame.corr_id, request_id=f"r{index}", commitment=None, output={}))
            )
            with trio.fail_after(5):
                while not pending.finished:
                    await pending.changed.wait()
            assert pending.response is not None and pending.lost is None

        # A rig re-dialling from a new process at the cap takes its old leg's place.
        redialled, answer = await dial(connections, url, hello(worker_name="rig-a"))
        assert isinstance(answer, Admit)
        with pytest.raises(ConnectionClosed):
            await first.get_message()
        assert sorted(leg.hello.worker_name for leg in pool.legs.values()) == ["rig-a", "rig-b"]
        for connection in (second, redialled):
            await connection.aclose()


async def test_a_heartbeat_with_capacity_changes_the_legs_capacity(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        connection, _ = await dial(connections, url, hello())
        leg = next(iter(pool.legs.values()))
        assert leg.capacity == 2
        await connection.send_message(
            encode(Heartbeat(inflight=0, idle_seconds=1.0, capacity=Capacity(5, 5, 6144, 2048, 600)))
        )
        # Frames are read in order: once the gateway closes the leg over the next (bad) frame,
        # it has taken the heartbeat.
        await connection.send_message('{"type": "heartbeat", "inflight": -1}')
        with pytest.raises(ConnectionClosed):
            await connection.get_message()
        assert leg.capacity == 5


async def test_a_leg_without_heartbeats_stops_being_a_candidate_and_is_closed(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, clock, _ = gateway
        connection, _ = await dial(connections, url, hello())
        assert route(pool) is not None
        clock.now += 91
        assert route(pool) is None
        await pool.expire_stale()
        assert pool.legs == {}
        with pytest.raises(ConnectionClosed):
            await connection.get_message()


async def test_a_new_process_of_the_same_rig_supersedes_its_old_leg(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        old, _ = await dial(connections, url, hello(worker_id="process-1"))
        new, answer = await dial(connections, url, hello(worker_id="process-2"))
        assert isinstance(answer, Admit)
        assert [leg.hello.worker_id for leg in pool.legs.values()] == ["process-2"]
        with pytest.raises(ConnectionClosed):
            await old.get_message()
        await new.aclose()


async def test_draining_tells_every_miner_to_reconnect_and_refuses_new_ones(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        connection, _ = await dial(connections, url, hello())
        await pool.drain()
        assert isinstance(parse_gateway_frame(await connection.get_message()), Reconnect)
        assert (
            pool.route(
                MODEL,
                prefix=b"",
                rr_counter=0,
                needs=frozenset(),
                prefer=frozenset(),
                exclude=frozenset(),
                target=None,
                eligible=None,
            )
            is None
        ), "a leg told to re-dial is sent nothing new"
        late, answer = await dial(connections, url, hello(worker_name="late"))
        assert isinstance(answer, Deny) and "draining" in answer.reason
        await connection.aclose()
        await late.aclose()


async def test_a_response_completes_the_pending_request(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        connection, _ = await dial(connections, url, hello())
        leg_id = next(iter(pool.legs))
        pending = await pool.dispatch(
            leg_id, ServeRequest(messages=(Message("user", "hi"),), max_tokens=4, engy_request_id="r2"), stream=True
        )
        serve_frame = parse_gateway_frame(await connection.get_message())
        assert pool.tables[MODEL][leg_id].inflight == 1
        await connection.send_message(
            encode(Response(corr_id=serve_frame.corr_id, request_id="r2", commitment=None, output={"choices": []}))
        )
        with trio.fail_after(5):
            while not pending.finished:
                await pending.changed.wait()
        assert pending.response.request_id == "r2" and pool.tables[MODEL][leg_id].inflight == 0
        await connection.aclose()


# --- the routing table -------------------------------------------------------------------------


async def test_the_routing_table_follows_every_change_to_the_legs(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        first, _ = await dial(connections, url, hello(worker_name="first"))
        second, _ = await dial(connections, url, hello(worker_name="second", capacity=Capacity(3, 3, 6144, 2048, 600)))
        assert_table_follows_the_legs(pool)
        first_leg, second_leg = (
            next(leg for leg in pool.legs.values() if leg.hello.worker_name == name) for name in ("first", "second")
        )
        answered = await pool.dispatch(first_leg.leg_id, request("r1"), stream=False)
        cancelled = await pool.dispatch(first_leg.leg_id, request("r2"), stream=False)
        lost = await pool.dispatch(second_leg.leg_id, request("r3"), stream=False)
        assert_table_follows_the_legs(pool)
        assert pool.tables[MODEL][first_leg.leg_id].inflight == 2
        serve_frame = parse_gateway_frame(await first.get_message())
        await first.send_message(
            encode(Response(corr_id=serve_frame.corr_id, request_id="r1", commitment=None, output={"choices": []}))
        )
        with trio.fail_after(5):
            while not answered.finished:
                await answered.changed.wait()
        await pool.cancel(cancelled)
        assert_table_follows_the_legs(pool)
        assert pool.tables[MODEL][first_leg.leg_id].inflight == 0
        await second.send_message(
            encode(Heartbeat(inflight=1, idle_seconds=0.0, capacity=Capacity(7, 7, 6144, 2048, 600)))
        )
        await second.send_message('{"type": "heartbeat", "inflight": -1}')  # closes the leg once the heartbeat is taken
        with trio.fail_after(5):
            while not lost.finished:
                await lost.changed.wait()
        assert list(pool.tables[MODEL]) == [first_leg.leg_id]
        assert_table_follows_the_legs(pool)
        await first.aclose()
        with trio.fail_after(5):
            while pool.legs:
                await trio.sleep(0.01)
        assert len(pool.tables[MODEL]) == 0


async def test_a_heartbeat_with_a_new_capacity_reaches_the_routing_table(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        connection, _ = await dial(connections, url, hello())
        leg_id = next(iter(pool.legs))
        await connection.send_message(
            encode(Heartbeat(inflight=0, idle_seconds=1.0, capacity=Capacity(5, 5, 6144, 2048, 600)))
        )
        with trio.fail_after(5):
            while pool.tables[MODEL][leg_id].capacity != 5:
                await trio.sleep(0.01)
        assert_table_follows_the_legs(pool)
        await connection.aclose()


async def test_a_pulled_miner_gets_no_more_paid_traffic_at_once_and_an_eligible_one_within_the_refresh(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, clock, _ = gateway
        connection, _ = await dial(connections, url, hello())
        leg_id = next(iter(pool.legs))
        eligible = {"key:7"}

        def admit(miner: str) -> bool:
            return miner in eligible

        assert route(pool, eligible=admit) == leg_id
        eligible.clear()
        assert route(pool, eligible=admit) is None, "pulled: refused by the check on the leg about to be returned"
        assert pool.tables[MODEL].admitted(leg_id), "counted until the next refresh"
        clock.now += ADMISSION_REFRESH_S
        assert route(pool, eligible=admit) is None and not pool.tables[MODEL].admitted(leg_id)
        eligible.add("key:7")
        assert route(pool, eligible=admit) is None, "the table counts it out until the next refresh"
        clock.now += ADMISSION_REFRESH_S
        assert route(pool, eligible=admit) == leg_id
        await connection.aclose()


async def test_a_new_leg_is_routable_on_the_first_decision_after_it_joins(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        first, _ = await dial(connections, url, hello(worker_name="first"))
        assert route(pool, eligible=lambda miner: True) is not None
        second, _ = await dial(connections, url, hello(worker_name="second"))
        second_leg = next(leg.leg_id for leg in pool.legs.values() if leg.hello.worker_name == "second")
        first_leg = next(leg_id for leg_id in pool.legs if leg_id != second_leg)
        assert route(pool, eligible=lambda miner: True, exclude=frozenset({first_leg})) == second_leg
        await first.aclose()
        await second.aclose()


async def test_a_probe_goes_to_its_target_miner_whether_or_not_it_is_eligible(gateway):
    async with contextlib.AsyncExitStack() as connections:
        pool, url, clock, _ = gateway
        connection, _ = await dial(connections, url, hello())
        leg_id = next(iter(pool.legs))
        assert route(pool, eligible=lambda miner: False) is None
        assert route(pool, eligible=lambda miner: False, target="key:7") == leg_id
        assert route(pool, target="key:8") is None
        clock.now += 91
        assert route(pool, target="key:7") is None, "a stale leg takes no probe either"
        await connection.aclose()


async def test_two_hosts_holding_legs_of_the_same_miners_send_a_conversation_to_the_same_one(nursery):
    """In a fleet each host's pool ranks the legs it holds; a leg's id comes from its miner, rig and
    process, so two hosts with the same miners agree on every conversation's miner (and so cache it
    once), and a second leg of one process in one pool still gets an id of its own."""
    async with contextlib.AsyncExitStack() as connections:
        pools, urls = [], []
        for _ in range(2):
            pool = MinerPool(
                served_models={MODEL: ROOT},
                authenticate_key=lookup,
                allowed_hotkeys=set,
                settings=PoolSettings(stale_after_s=90),
            )
            binds = await nursery.start(serve, build_miner_app(pool), hypercorn_config("127.0.0.1:0"))
            pools.append(pool)
            urls.append(binds[0].replace("http://", "ws://") + "/gw")
        rigs = [hello(worker_name=f"rig-{index}", worker_id=f"process-{index}") for index in range(12)]
        for url in urls:
            for rig in rigs:
                await dial(connections, url, rig)
        assert set(pools[0].legs) == set(pools[1].legs) and len(pools[0].legs) == len(rigs)
        prefixes = [bytes([index]) * 32 for index in range(64)]
        chosen = [[pool.route(MODEL, prefix=prefix, rr_counter=0).worker_id for prefix in prefixes] for pool in pools]
        assert chosen[0] == chosen[1] and len(set(chosen[0])) > 1
        _, answer = await dial(connections, urls[0], rigs[0])  # the same process's leg a dead host had
        assert isinstance(answer, Admit) and len(pools[0].legs) == len(rigs) + 1


async def test_a_prompt_past_a_serves_context_or_a_full_kv_cache_is_routed_elsewhere(gateway):
    # The TEE miner announces its context window and reports its KV cache in heartbeats.
    async with contextlib.AsyncExitStack() as connections:
        pool, url, _, _ = gateway
        short, _ = await dial(
            connections,
            url,
            hello(
                worker_name="short",
                hw={"region": "eu-west", "tee": {"gpu_cc": "on"}},
                capacity=Capacity(2, 2, 6144, 2048, 600, context_length=1000),
            ),
        )
        roomy, _ = await dial(connections, url, hello(worker_name="roomy"))
        legs = {leg.hello.worker_name: leg.leg_id for leg in pool.legs.values()}
        assert route(pool, prompt_tokens=1500, exclude=frozenset()) == legs["roomy"]
        assert route(pool, prompt_tokens=1500, exclude=frozenset({legs["roomy"]})) is None, "no other serve takes it"
        assert route(pool, prompt_tokens=200, exclude=frozenset({legs["roomy"]})) == legs["short"]
        await short.send_message(
            orjson.dumps(
                {
                    "type": "heartbeat",
                    "inflight": 1,
                    "idle_seconds": 0,
                    "kv": {"used": 99_000, "limit": 100_000, "reqs": 1, "waiting": 3, "frac": 0.99},
                }
            ).decode()
        )
        with trio.fail_after(5):
            while pool.legs[legs["short"]].kv is None:
                await trio.sleep(0.01)
        assert route(pool, prompt_tokens=200, exclude=frozenset({legs["roomy"]})) is None, "a full cache only queues"
        shown = {row["worker"]: row for row in pool.snapshot()}
        assert (shown["short"]["region"], shown["short"]["tee"], shown["short"]["context_length"]) == (
            "eu-west",
            "on",
            1000,
        )
        assert shown["short"]["kv_used"] == 0.99 and "region" not in shown["roomy"]
        await short.aclose()
        await roomy.aclose()
