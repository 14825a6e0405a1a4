"""The miner's side of a GEMM audit (issue 32; docs/protocol.md "GEMM audits"): the real miner
link against the protocol-level gateway, with the reference server on SmolLM2 as its model
server. What the miner sends is checked independently: every opening is verified against the
commitment the answer carried (`verify_opening`), nothing the miner says about it is trusted.

A model server that cannot commit (sglang today) is stood in for by a forwarder in front of the
reference server that leaves ``gemm_commitments`` out of `/get_server_info`, as sglang does;
the forwarder also shows which serve a challenge was asked of, for a miner with two.
"""

from __future__ import annotations

import dataclasses
import random
import uuid

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engy_node.gemm.activations import FORMAT, RESIDUAL_OUT, Commitment, Opening, verify_opening
from engy_node.miner.gemm_audit import GemmRecords, commit_decision
from engy_node.miner.link import GatewayLink, Identity, LinkSettings
from engy_node.miner.role import ServeRotation
from engy_node.miner.serving import RequestHandler
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.gemm import FEATURE_GEMM, GemmPick
from engy_node.protocol.miner import OUR_FEATURES, Capacity, Message, ServeRequest
from engy_node.serve.client import GemmSupport, ServeClient, ServeError
from engy_node.served_model import load_served_model
from engy_node.testing.gateway import GatewayHarness

FAST = LinkSettings(heartbeat_s=0.5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
LIMITS = Capacity(
    max_inflight=0, max_inflight_total=2, max_input_tokens=6144, max_output_tokens=2048, max_request_s=600
)
SUPPORT = GemmSupport(FORMAT, 3_000)


def request(text: str, *, max_tokens: int = 6, gemm: bool = True) -> ServeRequest:
    return ServeRequest(
        messages=(Message("user", text),),
        max_tokens=max_tokens,
        engy_request_id=uuid.uuid4().hex,
        gemm_commitment=gemm,
    )


@pytest.fixture(scope="module")
def served_model(checkpoint):
    return load_served_model(SMOLLM2_135M, checkpoint)


@pytest.fixture
async def gateway(nursery):
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    return harness


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=120) as client:
        yield client


class Forwarder:
    """A model server in front of the reference server: forwards `/generate`, `/gemm/openings`
    and `/get_server_info` (without ``gemm_commitments`` unless `commits`), keeping each path
    and body it forwarded."""

    def __init__(self, upstream: str, http: httpx.AsyncClient, *, commits: bool) -> None:
        self.upstream = upstream
        self.http = http
        self.commits = commits
        self.calls: list[tuple[str, dict]] = []
        self.url = ""

    async def forward(self, request: Request) -> Response:
        body = await request.json() if request.method == "POST" else {}
        self.calls.append((request.url.path, body))
        if request.method == "POST":
            answer = await self.http.post(f"{self.upstream}{request.url.path}", json=body)
        else:
            answer = await self.http.get(f"{self.upstream}{request.url.path}")
        if request.url.path.endswith("server_info") and not self.commits:
            info = answer.json()
            del info["gemm_commitments"]
            return JSONResponse(info)
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        paths = ("/generate", "/gemm/openings", "/get_server_info")
        app = Starlette(routes=[Route(path, self.forward, methods=["GET", "POST"]) for path in paths])
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(hypercorn_serve, app, config)
            self.url = binds[0]
            task_status.started(self.url)

    def paths(self, path: str) -> list[dict]:
        return [body for called, body in self.calls if called == path]


async def start_forwarder(nursery, upstream: str, http: httpx.AsyncClient, *, commits: bool) -> Forwarder:
    forwarder = Forwarder(upstream, http, commits=commits)
    await nursery.start(forwarder.run)
    return forwarder


async def start_miner(
    nursery, gateway, served_model, serve_urls, http, *, chunk_tokens=4096, most_positions=None, capture_urls=()
) -> RequestHandler:
    """The link and handler wired as `engy_node.miner.role` wires them: GEMM audits on when
    every serve says it commits (`most_positions` overrides the store's size; `capture_urls`
    are the GEMM capture's ports beside sglang servers)."""
    serves = ServeRotation(tuple(serve_urls), http, request_timeout_s=600, capture_urls=tuple(capture_urls))
    gemm = await serves.gemm_support()
    if gemm is not None and most_positions is not None:
        gemm = dataclasses.replace(gemm, most_positions=most_positions)
    handler = RequestHandler(model=served_model, serve=serves, chunk_tokens=chunk_tokens, gemm=gemm)
    link = GatewayLink(
        gateway_url=gateway.url,
        identity=Identity(miner_key="mk-gemm"),
        limits=LIMITS,
        handler=handler,
        http=http,
        settings=FAST,
        rng=random.Random(3),
        hello={
            "model": "smollm2-135m",
            "model_root": served_model.model_root,
            "hw": {"host": "test", "gpu_count": 0},
            "versions": {"engy_node": "test"},
            "worker_name": "rig-gemm",
            "worker_id": uuid.uuid4().hex,
        },
        features=OUR_FEATURES | {FEATURE_GEMM} if gemm is not None else OUR_FEATURES,
        open_gemm=handler.open_gemm if gemm is not None else None,
    )
    await nursery.start(link.run)
    await gateway.wait_for(lambda: 0 in gateway.legs)
    return handler


def audit_picks(commitment: Commitment) -> tuple[GemmPick, ...]:
    """The first committed prompt position and the last generated one, in the first and last layers."""
    last = commitment.layout.layers - 1
    slots = [(0, "residual_in"), (0, "q"), (0, "down_out"), (last, "o_in"), (last, RESIDUAL_OUT)]
    # The first committed position: a prefix the server took from its cache is not (its start).
    first = commitment.start
    return tuple(GemmPick(p, layer, group) for p in (first, commitment.positions - 1) for layer, group in slots)


def test_an_answer_commits_only_when_asked_supported_and_within_the_servers_store():
    def decide(asked=True, support=SUPPORT, prompt=100, new=50):
        return commit_decision(asked=asked, support=support, prompt_tokens=prompt, max_new_tokens=new)

    assert decide().commit and decide(prompt=2_950, new=50).commit
    assert decide(asked=False) == decide(asked=False, support=None)
    assert not decide(asked=False).commit
    assert "cannot commit" in decide(support=None).reason
    too_long = decide(prompt=2_951, new=50)
    assert not too_long.commit and "2951 prompt tokens plus max_tokens 50 exceed the 3000" in too_long.reason


def test_the_miner_remembers_the_newest_records_serve():
    records = GemmRecords(limit=2)
    first, second = (ServeClient(f"http://127.0.0.1:{port}", httpx.AsyncClient()) for port in (1, 2))
    records.remember("a", first)
    records.remember("b", second)
    records.remember("a", first)  # seen again: now the newest
    records.remember("c", second)
    assert (records.serve_of("a"), records.serve_of("b"), records.serve_of("c")) == (first, None, second)


async def test_a_miner_on_the_reference_server_commits_and_its_rid_opens_with_openings_that_verify(
    nursery, gateway, served_model, reference_server, http
):
    # Chunks of 4 tokens: the answer takes several calls, and the last call's record covers it all.
    await start_miner(nursery, gateway, served_model, [reference_server.url], http, chunk_tokens=4)
    assert FEATURE_GEMM in gateway.legs[0].hello.features
    corr_id = await gateway.serve(request("What is the capital of France?", max_tokens=9))
    response = (await gateway.result(corr_id)).response
    assert response.error is None, response.error
    wire = response.gemm_commitment
    assert wire is not None and wire["rid"].startswith(f"engy-{corr_id}-"), wire
    commitment = Commitment.from_wire(wire)
    usage = response.output["usage"]
    assert commitment.positions == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert usage["completion_tokens"] > 4, "the answer spans more than one call"

    picks = audit_picks(commitment)
    answer = await gateway.challenge(wire["rid"], picks)
    assert answer.error is None, answer.error
    openings = [Opening.from_wire(o) for o in answer.openings]
    assert [(o.position, o.layer, o.group) for o in openings] == [
        (pick.position, *commitment.layout.canonical(pick.layer, pick.group)) for pick in picks
    ]
    assert all(verify_opening(commitment, opening) for opening in openings)

    unasked = (await gateway.result(await gateway.serve(request("Say hi.", gemm=False)))).response
    assert unasked.error is None and unasked.gemm_commitment is None


async def test_a_challenge_for_a_record_the_serve_does_not_hold_answers_an_error_naming_why(
    nursery, gateway, served_model, reference_server, http
):
    await start_miner(nursery, gateway, served_model, [reference_server.url], http)
    answer = await gateway.challenge("engy-never-served-0", (GemmPick(0, 0, "q"),))
    assert answer.openings == () and answer.error is not None
    assert "404" in answer.error and "no activation record for request engy-never-served-0" in answer.error
    assert "challenge sooner" in answer.error


async def test_the_serve_clients_refusals_carry_the_servers_status_and_message(reference_server, http):
    client = ServeClient(reference_server.url, http)
    with pytest.raises(ServeError) as gone:
        await client.open_gemm("engy-not-a-record", [{"position": 0, "layer": 0, "group": "q"}])
    assert gone.value.status == 404 and "no activation record" in str(gone.value)
    with pytest.raises(ServeError) as bad:
        await client.open_gemm("engy-not-a-record", [])
    assert bad.value.status == 400
    support = await client.gemm_support()
    assert support is not None and support.format == FORMAT and support.most_positions > 1_000


async def test_an_answer_too_long_for_the_servers_store_is_served_without_a_commitment(
    nursery, gateway, served_model, reference_server, http
):
    await start_miner(nursery, gateway, served_model, [reference_server.url], http, most_positions=8)
    response = (await gateway.result(await gateway.serve(request("What is the capital of France?")))).response
    assert response.error is None and response.output["choices"][0]["message"]["content"]
    assert response.gemm_commitment is None


async def test_a_miner_whose_serve_cannot_commit_announces_nothing_and_ignores_the_flag(
    nursery, gateway, served_model, reference_server, http
):
    sglang_like = await start_forwarder(nursery, reference_server.url, http, commits=False)
    await start_miner(nursery, gateway, served_model, [sglang_like.url], http)
    assert gateway.legs[0].hello.features == OUR_FEATURES
    corr_id = await gateway.serve(request("What is the capital of France?"))
    response = (await gateway.result(corr_id)).response
    assert response.error is None and response.gemm_commitment is None
    (body,) = sglang_like.paths("/generate")
    assert "return_gemm_commitment" not in body and body["rid"] == f"engy-{corr_id}-0", "as before audits existed"
    answer = await gateway.challenge("engy-corr-0-0", (GemmPick(0, 0, "q"),))
    assert answer.error is not None and "does not take GEMM audits" in answer.error
    assert not sglang_like.paths("/gemm/openings")


async def test_with_two_serves_a_challenge_is_asked_of_the_serve_that_committed(
    nursery, gateway, served_model, reference_server, http
):
    forwarded = await start_forwarder(nursery, reference_server.url, http, commits=True)
    await start_miner(nursery, gateway, served_model, [forwarded.url, reference_server.url], http)
    assert FEATURE_GEMM in gateway.legs[0].hello.features
    rids, starts = [], {}
    for _ in range(2):  # the rotation serves the first through the forwarder, the second directly
        response = (await gateway.result(await gateway.serve(request("Name a colour.", max_tokens=3)))).response
        assert response.error is None and response.gemm_commitment is not None
        rids.append(response.gemm_commitment["rid"])
        starts[rids[-1]] = response.gemm_commitment.get("start", 0)  # after a cached prefix
    assert [body["rid"] for body in forwarded.paths("/generate")] == [rids[0]]
    for rid in reversed(rids):
        answer = await gateway.challenge(rid, (GemmPick(starts[rid], 0, "q"),))
        assert answer.error is None and len(answer.openings) == 1
    assert [body["rid"] for body in forwarded.paths("/gemm/openings")] == [rids[0]]
