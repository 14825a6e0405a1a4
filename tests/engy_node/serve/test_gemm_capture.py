"""Committed activations on the real SmolLM2 reference server (issue 32 part 2): a request that
asks for `return_gemm_commitment` gets an activation root that two greedy runs agree on, its
openings verify against it, and the opened rows pass the GEMM audit's checks against the
checkpoint's own weights; a server whose weights carry 1e-2 relative noise fails the row check.

The honest server is the session's `engy-node serve` process; the noisy one runs in this process
(the served weights perturbed in memory: `engy-node serve` refuses a checkpoint whose
weights_root differs from the catalog's pin)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CollectorRegistry

from engy_node.asgi import start_listener
from engy_node.gemm.activations import GEMMS, RESIDUAL_OUT, Commitment, Opening, group_values, verify_opening
from engy_node.models import get_model
from engy_node.serve.app import ReferenceApp, ServerInfo, build_app, decode_array
from engy_node.serve.engine import Engine, ModelRunner
from engy_node.verifier import gemm_check as gc

from .test_server import PROMPT_IDS, sglang_generate, sglang_stream

LAYERS = (0, 14, 29)
PROJECTIONS = {name: ("self_attn" if name[0] in "qkvo" else "mlp") for name in GEMMS}


def committed_answer(client, rid: str, max_new_tokens: int = 6) -> dict:
    return sglang_generate(
        client,
        {
            "input_ids": PROMPT_IDS,
            "rid": rid,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "return_gemm_commitment": True,
        },
    )


def open_picks(client, rid: str, picks: list[tuple[int, int, str]]) -> httpx.Response:
    body = {"rid": rid, "picks": [{"position": p, "layer": layer, "group": g} for p, layer, g in picks]}
    return client.post("/gemm/openings", json=body)


@pytest.fixture(scope="module")
def weights(checkpoint):
    """The checkpoint's projections and norms as stored, in float64."""
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", framework="pt") as handle:
        tensor = {name: handle.get_tensor(name).double().numpy() for name in handle.keys()}
    prefix = "model.layers"
    projections = {
        (layer, name): tensor[f"{prefix}.{layer}.{PROJECTIONS[name]}.{name}.weight"]
        for layer in LAYERS
        for name in GEMMS
    }
    norms = {
        layer: (
            tensor[f"{prefix}.{layer}.input_layernorm.weight"],
            tensor[f"{prefix}.{layer}.post_attention_layernorm.weight"],
        )
        for layer in LAYERS
    }
    return projections, norms


def layer_picks(positions: list[int]) -> list[tuple[int, int, str]]:
    groups = sorted({g for pair in GEMMS.values() for g in pair} | {"residual_in", RESIDUAL_OUT})
    return [(p, layer, group) for p in positions for layer in LAYERS for group in groups]


def traces(commitment: Commitment, payload: dict, positions: list[int]) -> dict[int, gc.LayerTrace]:
    """Per audited layer, the opened rows (one per position) as `gemm_check` reads them; every
    opening verified against the answer's root first."""
    layout = commitment.layout
    opened: dict[tuple[int, int, str], Opening] = {}
    for wire in payload["openings"]:
        opening = Opening.from_wire(wire)
        assert verify_opening(commitment, opening), wire
        opened[opening.position, opening.layer, opening.group] = opening
    # Each pick comes back in order, as the leaf holding it: a residual_out before the last layer
    # as the next residual_in, a projection's group as its layer's gemms.
    for (p, layer, group), wire in zip(layer_picks(positions), payload["openings"], strict=True):
        assert (wire["position"], wire["layer"], wire["group"]) == (p, *layout.canonical(layer, group))

    def stacked(layer: int, group: str) -> np.ndarray:
        leaf = layout.canonical(layer, group)
        return np.stack([group_values(layout, opened[(p, *leaf)], layer, group) for p in positions])

    return {
        layer: gc.LayerTrace(
            {name: (stacked(layer, x), stacked(layer, y)) for name, (x, y) in GEMMS.items()},
            stacked(layer, "residual_in"),
            stacked(layer, RESIDUAL_OUT),
        )
        for layer in LAYERS
    }


def test_without_the_field_the_answer_keeps_sglangs_shape(client):
    out = sglang_generate(client, {"input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    assert "gemm_commitment" not in out["meta_info"]
    info = client.get("/server_info").json()["gemm_commitments"]
    assert info["format"] == "engy-activations-v2" and info["bytes_per_position"] == 546_496
    assert info["window_s"] > 0 and info["max_bytes"] > 0


def test_two_greedy_runs_commit_the_same_root_and_their_openings_pass_the_audit(client, weights):
    first = committed_answer(client, "gemm-honest-1")
    second = committed_answer(client, "gemm-honest-2")
    wire = first["meta_info"]["gemm_commitment"]
    assert wire == second["meta_info"]["gemm_commitment"]
    assert wire["weights_root"] == get_model("smollm2-135m").weights_root
    assert wire["arithmetic"] == "bfloat16" and gc.ARITHMETIC[wire["arithmetic"]] is gc.BF16_SERVE
    commitment = Commitment.from_wire(wire)
    assert commitment.positions == len(PROMPT_IDS) + len(first["output_ids"]) - 1 == 11
    assert commitment.layout.layers == 30

    positions = [0, 5, 10]
    response = open_picks(client, "gemm-honest-1", layer_picks(positions))
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["activations_root"] == wire["activations_root"]
    sample = payload["openings"][0]["values"]
    assert decode_array(sample).dtype == torch.bfloat16
    projections, norms = weights
    for layer, trace in traces(commitment, payload, positions).items():
        checks = gc.replay_layer(trace, *norms[layer], 1e-5, gc.BF16_SERVE)
        assert len(checks) == 6 and all(check.passed for check in checks), (layer, checks)
        for name, (x, y) in trace.projections.items():
            weight = projections[layer, name]
            key = gc.verifier_key(weight, gc.draw_signs(b"secret", f"{layer}.{name}", 1, weight.shape[0]))
            assert gc.freivalds(key, x, y, gc.BF16_SERVE).passed, (layer, name)
            assert gc.row_check(weight, x, y, gc.BF16_SERVE).passed, (layer, name)


def test_a_streamed_answer_carries_its_commitment_on_the_final_event_only(client):
    events = sglang_stream(
        client,
        {
            "input_ids": PROMPT_IDS,
            "rid": "gemm-stream",
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            "return_gemm_commitment": True,
        },
    )
    results = [event for event in events if event != "[DONE]"]
    assert all("gemm_commitment" not in event["meta_info"] for event in results[:-1])
    honest = committed_answer(client, "gemm-honest-3")["meta_info"]["gemm_commitment"]
    assert results[-1]["meta_info"]["gemm_commitment"] == honest


def test_openings_name_what_is_wrong(client):
    committed_answer(client, "gemm-errors", max_new_tokens=2)
    gone = open_picks(client, "gemm-never-asked", [(0, 0, "q")])
    assert gone.status_code == 404
    assert "kept for 300 s" in gone.json()["error"]["message"]
    outside = open_picks(client, "gemm-errors", [(99, 0, "q")])
    assert outside.status_code == 400 and "outside the answer" in outside.json()["error"]["message"]
    unknown = open_picks(client, "gemm-errors", [(0, 0, "lm_head")])
    assert unknown.status_code == 400 and "no group 'lm_head'" in unknown.json()["error"]["message"]
    too_long = client.post(
        "/generate",
        json={"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 8000}, "return_gemm_commitment": True},
    )
    assert too_long.status_code == 400 and "lower max_new_tokens" in too_long.json()["error"]["message"]


async def test_a_server_with_noisy_weights_fails_the_row_check(checkpoint, weights, nursery):
    runner = ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in runner.model.model.layers:
            for name, block in PROJECTIONS.items():
                module = getattr(getattr(layer, block), name)
                noise = torch.randn(module.weight.shape, generator=generator) * 1e-2
                module.weight.copy_((module.weight.float() * (1 + noise)).to(torch.bfloat16))
    engine = Engine(runner, max_running=2)
    engine.start()
    try:
        info = ServerInfo(
            model_id="smollm2-135m",
            served_model_name="noisy",
            model_path=str(checkpoint),
            model_root="",
            weights_root="",
            dtype="bfloat16",
            device="cpu",
            host="127.0.0.1",
            port=0,
            max_running_requests=2,
            enable_return_hidden_states=False,
            stream_hidden_states="final",
            architectures=("LlamaForCausalLM",),
            model_type="llama",
        )
        reference = ReferenceApp(engine, info, CollectorRegistry())
        reference.ready = True
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        (url, *_) = await start_listener(nursery, build_app(reference), config, what="noisy server", flag="test")
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {
                "input_ids": PROMPT_IDS,
                "rid": "gemm-noisy",
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                "return_gemm_commitment": True,
            }
            answer = (await client.post("/generate", json=body)).json()
            wire = answer["meta_info"]["gemm_commitment"]
            assert "weights_root" not in wire, "an unknown weights_root is left out"
            positions = [0, 10]
            picks = [{"position": p, "layer": layer, "group": g} for p, layer, g in layer_picks(positions)]
            payload = (await client.post("/gemm/openings", json={"rid": "gemm-noisy", "picks": picks})).json()
    finally:
        engine.stop()
    projections, _ = weights
    caught = []
    for layer, trace in traces(Commitment.from_wire(wire), payload, positions).items():
        for name, (x, y) in trace.projections.items():
            caught.append(not gc.row_check(projections[layer, name], x, y, gc.BF16_SERVE).passed)
    assert all(caught), f"{caught.count(False)} of {len(caught)} projections passed with noisy weights"


def test_a_committed_request_keeps_its_cached_prefix_and_commits_from_the_first_computed_position(client):
    """Prompt caching stays for buyers: the positions taken from the prefix cache are left out of
    the commitment (`start`), which the answer that computed them committed."""
    prompt = PROMPT_IDS * 4  # 24 tokens: past the prefix cache's 16-token floor
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}}
    first = sglang_generate(client, {**body, "rid": "first-committed", "return_gemm_commitment": True})
    assert first["meta_info"]["cached_tokens"] == 0 and "start" not in first["meta_info"]["gemm_commitment"]
    committed = sglang_generate(client, {**body, "rid": "cached-committed", "return_gemm_commitment": True})
    cached = committed["meta_info"]["cached_tokens"]
    commitment = Commitment.from_wire(committed["meta_info"]["gemm_commitment"])
    assert 0 < cached < len(prompt) and commitment.start == cached
    assert commitment.positions == len(prompt) + 1
    picks = [(p, 3, "q") for p in (cached, len(prompt) - 1, len(prompt))]
    payload = open_picks(client, "cached-committed", picks).json()
    assert all(verify_opening(commitment, Opening.from_wire(o)) for o in payload["openings"])
    earlier = open_picks(client, "cached-committed", [(cached - 1, 3, "q")])
    assert earlier.status_code == 400 and "outside" in earlier.json()["error"]["message"]


def test_a_later_chunk_commits_from_inside_the_buyers_prompt_though_more_is_cached(client):
    """A long answer's later chunk re-sends prompt and output (serve.client): `gemm_commit_from`
    keeps the cached prefix inside the buyer's prompt, so the commitment covers some of it."""
    prompt = PROMPT_IDS * 4
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    sglang_generate(client, {**body, "rid": "chunk-1", "return_gemm_commitment": True})
    resent = prompt + [PROMPT_IDS[0]] * 4  # the prompt and what a first chunk produced
    later = {**body, "input_ids": resent, "rid": "chunk-2", "return_gemm_commitment": True}
    sglang_generate(client, later)
    limited = sglang_generate(client, {**later, "rid": "chunk-3", "gemm_commit_from": len(prompt) - 1})
    start = limited["meta_info"]["gemm_commitment"].get("start", 0)
    assert 0 < start <= len(prompt) - 1, start
    refused = client.post("/generate", json={**later, "rid": "chunk-4", "gemm_commit_from": -1})
    assert refused.status_code == 400 and "gemm_commit_from" in refused.text
