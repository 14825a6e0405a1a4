"""The miner on sglang with the GEMM capture armed (`capture_client`; `miner.gemm_capture`).

Against `llama_like.SglangStandIn` — sglang's native API over sglang-shaped modules with SmolLM2's
weights, the real capture hooked in and its real opening server beside it — the client learns
what the capture commits from its port, asks with ``engy-gemm-`` rids and sends sglang no field
it does not know, and a miner wired as the role wires it answers the gateway's challenge with
openings that the verifier's own judge passes against the checkpoint's weights. A capture that
refuses (sglang launched without the flags) turns audits off saying why, and a record it
refuses leaves the answer uncommitted, never failed.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx
import pytest

from engy_node.gemm.activations import FORMAT, Commitment, Opening, llama_layout, verify_opening
from engy_node.miner.role import ServeRotation
from engy_node.miner.sglang import gemm_capture as gc
from engy_node.miner.sglang.capture_client import CapturingServeClient
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.gemm import FEATURE_GEMM
from engy_node.serve.capture import SharedOpenings
from engy_node.serve.client import GemmSupport, ServeError
from engy_node.served_model import load_served_model
from engy_node.testing.gateway import GatewayHarness
from engy_node.verifier.gemm_audit import GemmEvidence, draw_picks, gemm_model_of, judge_openings
from tests.engy_node.miner.sglang.llama_like import LlamaForCausalLM, SglangStandIn
from tests.engy_node.miner.test_gemm_audit import request, start_miner

PROMPT = [1, 504, 3575, 282, 4649, 314]
WEIGHTS_ROOT = "ab" * 32
SECRET = b"capture-client-test-secret-32-b!"


@pytest.fixture(scope="module")
def layout(runner):
    return llama_layout(runner.model.config.to_dict(), "bfloat16")


@pytest.fixture(scope="module")
def sglang_model(runner):
    return LlamaForCausalLM(runner.model)


@pytest.fixture
async def sglang(nursery, runner, sglang_model, layout):
    """An sglang with the capture armed, as `miner.gemm_capture` launches it."""
    capture = gc.SglangCapture(layout, SharedOpenings(), weights_root=WEIGHTS_ROOT)
    stand_in = SglangStandIn(sglang_model, runner.model, capture=capture)
    await nursery.start(stand_in.run)
    return stand_in


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=120) as client:
        yield client


def opened_ok(wire: dict, openings: list[dict]) -> bool:
    commitment = Commitment.from_wire(wire)
    return bool(openings) and all(verify_opening(commitment, Opening.from_wire(o)) for o in openings)


async def test_the_client_reads_the_captures_support_and_commits_the_answers_that_ask(sglang, http, layout):
    client = CapturingServeClient(sglang.url, http, capture_url=sglang.capture_url)
    assert await client.gemm_support() == GemmSupport(FORMAT, SharedOpenings().max_bytes // layout.bytes_per_position())

    # Chunks of 3 tokens: two calls, and the second's record (prompt + all output) is the one kept.
    result = await client.generate(
        PROMPT,
        {"temperature": 0.0},
        max_new_tokens=5,
        rid_prefix="engy-abc",
        return_gemm_commitment=True,
        chunk_tokens=3,
    )
    assert result.finish_reason["type"] == "length" and result.calls == 2
    assert [body["rid"] for body in sglang.bodies] == ["engy-gemm-abc-0", "engy-gemm-abc-1"]
    assert not any({"return_gemm_commitment", "gemm_commit_from"} & body.keys() for body in sglang.bodies)
    wire = result.gemm_commitment
    assert result.gemm_rid == "engy-gemm-abc-1" and wire is not None
    assert wire["positions"] == len(PROMPT) + len(result.output_ids) - 1
    assert wire["weights_root"] == WEIGHTS_ROOT and wire["arithmetic"] == "bfloat16"

    picks = [{"position": p, "layer": layer, "group": "q"} for p in (0, wire["positions"] - 1) for layer in (0, 29)]
    answer = await client.open_gemm(result.gemm_rid, picks)
    assert answer["activations_root"] == wire["activations_root"] and opened_ok(wire, answer["openings"])

    plain = await client.generate(PROMPT, {"temperature": 0.0}, max_new_tokens=2, rid_prefix="engy-plain")
    assert plain.gemm_commitment is None and sglang.bodies[-1]["rid"] == "engy-plain-0"
    with pytest.raises(ServeError) as gone:
        await client.open_gemm("engy-gemm-never-0", picks)
    assert gone.value.status == 404 and "challenge sooner" in str(gone.value)


@pytest.fixture
def refusing():
    """The capture's port where sglang was launched without one of its flags (`gemm_capture.arm`)."""
    refusal = gc.refusal_of(
        tp_size=1,
        server_args=SimpleNamespace(disable_radix_cache=True, disable_cuda_graph=False),
        architectures=("LlamaForCausalLM",),
    )
    server = gc.serve(gc.RefusingCapture(refusal), 0)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_a_capture_that_refuses_turns_audits_off_saying_why_and_answers_go_out_uncommitted(
    sglang, refusing, http, caplog
):
    client = CapturingServeClient(sglang.url, http, capture_url=refusing)
    with pytest.raises(ServeError, match="relaunch sglang with --disable-cuda-graph") as refused:
        await client.gemm_support()
    assert refused.value.status == 409
    rotation = ServeRotation((sglang.url,), http, request_timeout_s=60, capture_urls=(refusing,))
    with caplog.at_level(logging.WARNING, logger="engy.miner"):
        assert await rotation.gemm_support() is None
    assert "GEMM audits off" in caplog.text and "--disable-cuda-graph" in caplog.text
    assert rotation.proofs == "TOPLOC alone"
    assert rotation.proofs_detail.startswith(f"the GEMM capture at {refusing} refuses: ")
    assert "relaunch sglang with --disable-cuda-graph" in rotation.proofs_detail

    with caplog.at_level(logging.WARNING, logger="engy.miner.capture_client"):
        result = await client.generate(PROMPT, {}, max_new_tokens=3, rid_prefix="engy-r", return_gemm_commitment=True)
    assert len(result.output_ids) == 3 and result.gemm_commitment is None and result.gemm_rid is None
    assert "engy-gemm-r-0: the GEMM capture" in caplog.text and "gave no commitment" in caplog.text


async def test_a_capture_that_does_not_answer_names_where_to_look(sglang, http):
    """sglang never armed the capture (a failure before its port opened): the error says where
    sglang said why, and what the capture needs."""
    client = CapturingServeClient(sglang.url, http, capture_url="http://127.0.0.1:9")
    with pytest.raises(ServeError, match="GEMM capture not armed") as silent:
        await client.gemm_support()
    assert "http://127.0.0.1:9" in str(silent.value) and "ENGY_GEMM_CAPTURE_PORT" in str(silent.value)


def test_a_server_the_capture_cannot_serve_is_refused_with_the_fix():
    flags = SimpleNamespace(disable_radix_cache=True, disable_cuda_graph=True)
    llama = ("LlamaForCausalLM",)
    assert gc.refusal_of(tp_size=1, server_args=flags, architectures=llama) == ""
    moe = gc.refusal_of(tp_size=1, server_args=flags, architectures=("Qwen3_5MoeForConditionalGeneration",))
    assert "Qwen3_5MoeForConditionalGeneration" in moe and "unset miner.gemm_capture" in moe
    assert "relaunch sglang with --tp-size 1" in gc.refusal_of(tp_size=2, server_args=flags, architectures=llama)
    two_replicas = SimpleNamespace(disable_radix_cache=True, disable_cuda_graph=True, dp_size=2)
    assert "--dp-size 1" in gc.refusal_of(tp_size=1, server_args=two_replicas, architectures=llama)
    bare = gc.refusal_of(tp_size=1, server_args=SimpleNamespace(), architectures=llama)
    assert "relaunch sglang with --disable-radix-cache --disable-cuda-graph" in bare


async def test_a_miner_on_sglang_with_the_capture_is_challenged_and_judged_honest(
    nursery, sglang, http, checkpoint, runner
):
    gateway = GatewayHarness(workers=1)
    await nursery.start(gateway.run)
    served = load_served_model(SMOLLM2_135M, checkpoint)
    await start_miner(nursery, gateway, served, [sglang.url], http, capture_urls=[sglang.capture_url])
    assert FEATURE_GEMM in gateway.legs[0].hello.features

    response = (await gateway.result(await gateway.serve(request("What is the capital of France?")))).response
    assert response.error is None, response.error
    wire = response.gemm_commitment
    assert wire is not None and wire["rid"].startswith("engy-gemm-"), wire
    usage = response.output["usage"]
    positions = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    picks = draw_picks(SECRET, wire, prompt_positions=usage["prompt_tokens"])
    answer = await gateway.challenge(wire["rid"], picks)
    assert answer.error is None, answer.error
    judgement = judge_openings(
        gemm_model_of(runner, secret=SECRET),
        wire,
        GemmEvidence(picks, answer.openings),
        expected_positions=positions,
        prompt_positions=usage["prompt_tokens"],
    )
    assert (judgement.kind, judgement.reason) == ("pass", "ok"), judgement.failed
