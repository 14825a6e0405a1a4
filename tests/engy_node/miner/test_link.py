"""The miner end to end against a protocol-level gateway and the reference server on SmolLM2.

Every proof a response carries is verified here independently: the expected prompt ids come from
the test's own rendering of the request, and the recompute is an in-process prefill of the
canonical checkpoint — nothing the miner computed is trusted.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import uuid

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, serve_websocket

from engy_node import keys, proof
from engy_node.miner.drain import REFUSED_ERROR
from engy_node.miner.link import GatewayLink, Identity, Leg, LinkSettings, leg_url, meta_url, plan_legs
from engy_node.miner.role import ServeRotation
from engy_node.miner.serving import RequestHandler
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import (
    OUR_FEATURES,
    Capacity,
    Message,
    ProtocolError,
    Sampling,
    Serve,
    ServeRequest,
    encode,
)
from engy_node.served_model import load_served_model
from engy_node.testing.gateway import GatewayHarness, RequestRecord
from tests.waiting import wait_until_async

FAST = LinkSettings(
    heartbeat_s=0.5,
    backoff_base_s=0.05,
    backoff_cap_s=0.2,
    deny_backoff_s=0.2,
    reconnect_delay_s=0.05,
    serve_check_s=0.1,
)
LIMITS = Capacity(
    max_inflight=0, max_inflight_total=3, max_input_tokens=6144, max_output_tokens=2048, max_request_s=600
)


def request(text: str, *, max_tokens: int = 24, **sampling) -> ServeRequest:
    return ServeRequest(
        messages=(Message("user", text),),
        max_tokens=max_tokens,
        engy_request_id=uuid.uuid4().hex,
        sampling=Sampling(**sampling),
    )


@pytest.fixture(scope="module")
def served_model(checkpoint):
    return load_served_model(SMOLLM2_135M, checkpoint)


def independent_prompt_ids(runner, req: ServeRequest) -> list[int]:
    ids = runner.tokenizer.apply_chat_template(
        [m.for_template() for m in req.messages], add_generation_prompt=True, tokenize=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


async def start_miner(
    nursery,
    harness_url,
    served_model,
    serve_url,
    *,
    identity=Identity(miner_key="mk-test"),
    limits=LIMITS,
    settings=FAST,
    serve_ready=lambda: True,
):
    http = httpx.AsyncClient(timeout=120)
    serves = ServeRotation((serve_url,), http, request_timeout_s=600)
    handler = RequestHandler(model=served_model, serve=serves)
    link = GatewayLink(
        gateway_url=harness_url,
        identity=identity,
        limits=limits,
        handler=handler,
        http=http,
        settings=settings,
        rng=random.Random(7),
        serve_ready=serve_ready,
        serve_load=serves.kv_load,
        hello={
            "model": "smollm2-135m",
            "model_root": served_model.model_root,
            "hw": {"host": "test", "gpu_count": 0},
            "versions": {"engy_node": "test"},
            "worker_name": "rig-1",
            "worker_id": uuid.uuid4().hex,
        },
    )
    await nursery.start(link.run)
    return link


@pytest.fixture
async def gateway(nursery):
    harness = GatewayHarness(workers=2)
    await nursery.start(harness.run)
    return harness


def test_legs_split_the_concurrency_across_gateway_workers():
    rng = random.Random(1)
    assert plan_legs(workers=2, max_inflight=3, rng=rng) == [Leg(0, 2), Leg(1, 1)]
    assert plan_legs(workers=1, max_inflight=8, rng=rng) == [Leg(0, 8)]
    few = plan_legs(workers=8, max_inflight=3, rng=rng)
    assert len(few) == 3 and all(leg.capacity == 1 for leg in few) and len({leg.worker for leg in few}) == 3


def test_gateway_urls_follow_the_public_layout():
    assert meta_url("wss://api.engy.ai/gw") == "https://api.engy.ai/gw/meta"
    assert meta_url("ws://127.0.0.1:9/gw/") == "http://127.0.0.1:9/gw/meta"
    assert leg_url("wss://x/gw", worker=0, workers=1) == "wss://x/gw"
    assert leg_url("wss://x/gw", worker=3, workers=4) == "wss://x/gw/3"


async def test_hello_announces_model_root_capacity_and_worker_identity(
    nursery, gateway, served_model, reference_server
):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    hellos = {leg.worker: leg.hello for leg in gateway.legs.values()}
    assert {w: h.capacity.max_inflight for w, h in hellos.items()} == {0: 2, 1: 1}
    hello = hellos[0]
    assert hello.miner_key == "mk-test" and hello.model == "smollm2-135m"
    assert hello.model_root == served_model.model_root
    assert hello.capacity.max_inflight_total == 3 and hello.worker_name == "rig-1"
    assert hellos[0].worker_id == hellos[1].worker_id


async def test_a_response_carries_a_proof_that_verifies_against_an_independent_recompute(
    nursery, gateway, served_model, reference_server, runner
):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    req = request("What is the capital of France?", max_tokens=40)
    record = await gateway.result(await gateway.serve(req))
    response = record.response
    assert response.error is None and response.request_id == req.engy_request_id
    choice = response.output["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    commitment = proof.Commitment.from_wire(response.commitment)
    usage = response.output["usage"]
    assert usage["completion_tokens"] == len(commitment.output_token_ids)
    assert usage["prompt_tokens"] == len(commitment.prompt_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    expected_prompt = independent_prompt_ids(runner, req)
    verdict = proof.verify_commitment(
        commitment,
        model=SMOLLM2_135M,
        canonical_root=served_model.model_root,
        expected_prompt_ids=expected_prompt,
        recompute=runner.prefill,
        greedy=True,
    )
    assert (verdict.kind, verdict.reason) == ("pass", "ok"), verdict
    relayed = runner.tokenizer.decode(list(commitment.output_token_ids[:-1]), skip_special_tokens=True)
    assert relayed == choice["message"]["content"], "the committed tokens decode to the relayed text"


async def test_streamed_chunks_add_up_to_the_final_text(nursery, gateway, served_model, reference_server):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    record = await gateway.result(
        await gateway.serve(request("Write a haiku about the sea.", max_tokens=48), stream=True)
    )
    assert record.response.error is None
    assert len(record.chunks) >= 2
    assert "".join(record.chunks) == record.response.output["choices"][0]["message"]["content"]


async def test_a_stop_string_is_never_streamed_and_ends_the_answer(nursery, gateway, served_model, reference_server):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    probe = await gateway.result(await gateway.serve(request("Count from one to ten in words.", max_tokens=40)))
    words = probe.response.output["choices"][0]["message"]["content"].split()
    stop = words[min(3, len(words) - 1)]
    record = await gateway.result(
        await gateway.serve(request("Count from one to ten in words.", max_tokens=40, stop=(stop,)), stream=True)
    )
    content = record.response.output["choices"][0]["message"]["content"]
    assert stop not in content and "".join(record.chunks) == content


async def test_cancel_stops_the_request_and_aborts_the_generation_on_the_server(
    nursery, gateway, served_model, reference_server
):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    corr_id = await gateway.serve(request("Tell me a very long story about a dragon.", max_tokens=1500), stream=True)
    await gateway.wait_for(lambda: gateway.requests[corr_id].chunks)
    await gateway.cancel(corr_id)
    async with httpx.AsyncClient() as http:

        async def none_running() -> bool:
            info = (await http.get(f"{reference_server.url}/server_info")).json()
            return info["internal_states"][0]["num_running_reqs"] == 0

        # The server is another process and says nothing when it drops a generation: its request
        # counter is the only view of that, so the wait is a bounded poll.
        await wait_until_async(none_running, timeout_s=20, what="the cancelled generation aborted on the server")
    with trio.move_on_after(1.0):
        await gateway.requests[corr_id].done.wait()
    assert gateway.requests[corr_id].response is None, "nothing is sent for a cancelled request"


async def test_ping_is_answered_with_a_heartbeat_and_heartbeats_keep_coming(
    nursery, gateway, served_model, reference_server
):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    leg = gateway.legs[0]
    await gateway.ping(0)
    await gateway.wait_for(lambda: len(leg.heartbeats) >= 2, timeout=10)
    assert leg.heartbeats[0].inflight == 0


async def test_the_miner_redials_after_reconnect_and_after_a_dropped_connection(
    nursery, gateway, served_model, reference_server
):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    first = gateway.legs[0]
    await gateway.reconnect(0)
    await gateway.wait_for(lambda: 0 in gateway.legs and gateway.legs[0] is not first)
    second = gateway.legs[0]
    await gateway.drop(0)
    await gateway.wait_for(lambda: 0 in gateway.legs and gateway.legs[0] is not second)
    assert len(gateway.hellos) == 4
    record = await gateway.result(await gateway.serve(request("Say hello.", max_tokens=8)))
    assert record.response.error is None


async def test_after_reconnect_the_old_connection_finishes_what_it_has_in_flight_while_its_successor_serves(
    nursery, gateway, served_model, reference_server
):
    # The live protocol's drain: re-dial at once, keep the old leg until its requests end.
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    first = gateway.legs[0]
    running = await gateway.serve(request("Write a long story about a lighthouse keeper.", max_tokens=120), stream=True)
    await gateway.wait_for(lambda: gateway.requests[running].chunks, timeout=120)
    await gateway.reconnect(0)
    await gateway.wait_for(lambda: 0 in gateway.legs and gateway.legs[0] is not first, timeout=60)
    assert not first.closed.is_set() and not gateway.requests[running].done.is_set(), (
        "re-dialled before the request ended"
    )
    late = await gateway.serve(request("Say hi.", max_tokens=4))  # on the new leg
    refused_id = "corr-late-on-old"
    gateway.requests[refused_id] = RequestRecord()
    await first.websocket.send_text(encode(Serve(refused_id, request("Say hi.", max_tokens=4), False)))
    finished = await gateway.result(running)
    assert finished.response.error is None and finished.response.commitment is not None
    assert "".join(finished.chunks) == finished.response.output["choices"][0]["message"]["content"]
    assert (await gateway.result(refused_id, timeout=60)).response.error == REFUSED_ERROR
    assert (await gateway.result(late)).response.error is None
    with trio.fail_after(60):
        await first.closed.wait()


async def test_a_denied_miner_keeps_retrying_without_crashing(nursery, served_model, reference_server):
    harness = GatewayHarness(workers=1, deny_reason="unknown miner key")
    await nursery.start(harness.run)
    async with trio.open_nursery() as miner_nursery:
        miner_nursery.start_soon(lambda: start_miner(miner_nursery, harness.url, served_model, reference_server.url))
        await harness.wait_for(lambda: len(harness.hellos) >= 3, timeout=20)
        miner_nursery.cancel_scope.cancel()


async def test_a_signed_hotkey_hello_verifies(nursery, gateway, served_model, reference_server):
    from bittensor.sp_core import Keypair

    keypair = Keypair.create_from_uri("//Alice")
    await start_miner(
        nursery, gateway.url, served_model, reference_server.url, identity=Identity(keypair=keypair, netuid=53)
    )
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    hello = gateway.legs[0].hello
    check = keys.check_hello(
        hotkey=hello.hotkey,
        ts=hello.ts,
        worker_id=hello.worker_id,
        sig_hex=hello.signature,
        netuid=53,
        now=hello.ts,
        replay=keys.ReplayGuard(),
    )
    assert check.ok and check.hotkey == keypair.ss58_address


async def test_a_model_server_crash_mid_request_fails_that_request_cleanly(
    nursery, gateway, served_model, checkpoint, tmp_path
):
    from tests.conftest import ServerProcess

    server = await trio.to_thread.run_sync(ServerProcess, tmp_path)
    try:
        await start_miner(nursery, gateway.url, served_model, server.url)
        await gateway.wait_for(lambda: len(gateway.legs) == 2)
        corr_id = await gateway.serve(request("Tell me a long story.", max_tokens=1500), stream=True)
        await gateway.wait_for(lambda: gateway.requests[corr_id].chunks)
        server.process.send_signal(signal.SIGKILL)
        record = await gateway.result(corr_id, timeout=30)
        assert record.response.commitment is None
        assert "model server" in record.response.error
        assert not gateway.protocol_errors
    finally:
        server.stop()


async def test_a_gateway_frame_it_cannot_read_closes_the_leg_naming_the_field_and_it_redials(
    nursery, gateway, served_model, reference_server, caplog
):
    await start_miner(nursery, gateway.url, served_model, reference_server.url)
    await gateway.wait_for(lambda: 0 in gateway.legs)
    assert gateway.hellos[0].features == OUR_FEATURES, "our miner says what it honours beyond the public protocol"
    first = gateway.legs[0]
    await first.websocket.send_text('{"type": "serve", "corr_id": "c1", "request": {"messages": []}}')
    with trio.fail_after(10):
        await first.closed.wait()
    assert "serve.request.messages is invalid (must be a non-empty list)" in caplog.text
    await gateway.wait_for(lambda: 0 in gateway.legs and gateway.legs[0] is not first)


async def test_the_close_frame_for_an_unreadable_gateway_frame_carries_the_field(
    nursery, served_model, reference_server
):
    # hypercorn reports every close a client starts as 1006, so the harness cannot see the code
    # and reason: a bare trio-websocket server plays the gateway for one leg here.
    closes = []

    async def gateway_leg(request) -> None:
        connection = await request.accept()
        await connection.get_message()
        await connection.send_message('{"type": "admit"}')
        await connection.send_message(
            '{"type": "serve", "corr_id": "c1", "request": {"messages": [], "max_tokens": 4}}'
        )
        with pytest.raises(ConnectionClosed) as closed:
            await connection.get_message()
        closes.append(closed.value.reason)

    server = await nursery.start(serve_websocket, gateway_leg, "127.0.0.1", 0, None)
    link = GatewayLink(
        gateway_url="ws://unused/gw",
        identity=Identity(miner_key="mk-test"),
        limits=LIMITS,
        settings=FAST,
        rng=random.Random(7),
        handler=RequestHandler(model=served_model, serve=lambda: None),
        http=None,
        hello={
            "model": "smollm2-135m",
            "model_root": served_model.model_root,
            "hw": {},
            "versions": {},
            "worker_name": "rig-1",
            "worker_id": uuid.uuid4().hex,
        },
    )
    with pytest.raises(ProtocolError):
        await link._leg_session(f"ws://127.0.0.1:{server.port}/gw", Leg(0, 1))
    assert [(reason.code, reason.reason) for reason in closes] == [
        (1002, "invalid frame: serve.request.messages: must be a non-empty list")
    ]


async def test_heartbeats_follow_the_load_and_a_serve_that_cannot_take_requests_announces_capacity_0(
    nursery, gateway, served_model, reference_server
):
    # The newest public TEE miner's event heartbeats, and health gating without re-dialling.
    ready = [True]
    # No periodic heartbeat within the test: every one it sees was sent for a change.
    await start_miner(
        nursery,
        gateway.url,
        served_model,
        reference_server.url,
        serve_ready=lambda: ready[0],
        settings=dataclasses.replace(FAST, heartbeat_s=600),
    )
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    leg = gateway.legs[0]
    first = len(leg.heartbeats)
    record = await gateway.result(await gateway.serve(request("Say hello.", max_tokens=8)))
    assert record.response.error is None
    await gateway.wait_for(lambda: any(h.inflight == 1 for h in leg.heartbeats[first:]), timeout=10)
    await gateway.wait_for(lambda: leg.heartbeats[-1].inflight == 0, timeout=10)
    ready[0] = False
    await gateway.wait_for(
        lambda: leg.heartbeats[-1].capacity is not None and leg.heartbeats[-1].capacity.max_inflight == 0, timeout=10
    )
    ready[0] = True
    await gateway.wait_for(
        lambda: leg.heartbeats[-1].capacity is not None and leg.heartbeats[-1].capacity.max_inflight > 0, timeout=10
    )
    assert gateway.legs[0] is leg, "the same connection throughout"


async def test_periodic_heartbeats_carry_the_model_servers_kv_cache_and_queue(
    nursery, gateway, served_model, reference_server
):
    # As the newest public TEE miner does, from sglang's /get_load and /get_server_info.
    await start_miner(
        nursery,
        gateway.url,
        served_model,
        reference_server.url,
        settings=dataclasses.replace(FAST, heartbeat_s=0.2, kv_check_s=0.1),
    )
    await gateway.wait_for(lambda: len(gateway.legs) == 2)
    leg = gateway.legs[0]
    await gateway.wait_for(lambda: any(h.kv is not None for h in leg.heartbeats), timeout=10)
    kv = next(h.kv for h in leg.heartbeats if h.kv is not None)
    async with httpx.AsyncClient() as http:
        size = (await http.get(reference_server.url + "/get_server_info")).json()["max_total_num_tokens"]
    assert kv.limit == size and kv.used == 0 and kv.running == 0 and kv.fraction == 0.0


async def test_a_change_in_the_gateways_workers_replans_the_legs_without_a_restart(nursery, served_model):
    # The live protocol re-reads /gw/meta (the newest public TEE miner every 5 s).
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    link = await start_miner(
        nursery, harness.url, served_model, "http://127.0.0.1:9", settings=dataclasses.replace(FAST, meta_check_s=0.2)
    )
    await harness.wait_for(lambda: len(harness.hellos) == 1 and 0 in harness.legs)
    only = harness.legs[0]
    harness.workers = 2
    await harness.wait_for(lambda: set(harness.legs) == {0, 1} and harness.legs[0] is not only, timeout=20)
    with trio.fail_after(20):
        await only.closed.wait()
    assert link.workers == 2 and len(harness.hellos) == 3
    with trio.move_on_after(1.0):
        await harness.wait_for(lambda: len(harness.hellos) > 3)
    assert len(harness.hellos) == 3, "the retired leg is not re-dialled"


class NothingServed:
    """A handler for a link that never gets a request (it is never admitted)."""

    async def handle(self, frame, send) -> None:
        raise AssertionError("nothing is served by a link that is not admitted")


def unadmitted_link(gateway_url: str, published: dict) -> GatewayLink:
    return GatewayLink(
        gateway_url=gateway_url,
        identity=Identity(miner_key="mk-test"),
        limits=LIMITS,
        handler=NothingServed(),
        http=httpx.AsyncClient(timeout=10),
        settings=FAST,
        rng=random.Random(7),
        on_state=published.update,
        hello={
            "model": "smollm2-135m",
            "model_root": "00" * 32,
            "hw": {"host": "test", "gpu_count": 0},
            "versions": {"engy_node": "test"},
            "worker_name": "rig-1",
            "worker_id": uuid.uuid4().hex,
        },
    )


async def test_a_gateway_that_does_not_resolve_publishes_the_dial_error(nursery):
    """`.invalid` never resolves (RFC 2606): the miner's state says why its link is down (issue 34)."""
    published: dict = {}
    link = unadmitted_link("ws://nonexistent.invalid/gw", published)
    nursery.start_soon(link.run)
    await wait_until_async(lambda: published.get("link_error") is not None, timeout_s=20, what="the dial error")
    assert published["link_error"].startswith("cannot read http://nonexistent.invalid/gw/meta: ConnectError")
    assert published["denied"] is None


async def test_a_denied_leg_publishes_the_gateways_reason(nursery):
    harness = GatewayHarness(workers=1, deny_reason="unknown miner key")
    await nursery.start(harness.run)
    published: dict = {}
    nursery.start_soon(unadmitted_link(harness.url, published).run)
    await wait_until_async(lambda: published.get("denied") is not None, timeout_s=20, what="the deny reason")
    assert published["denied"] == "unknown miner key"
