"""The sglang sampling parameters the miner sends for a routed request: every knob explicit (sglang
fills omitted ones from the model's generation_config), and a seeded request always on sglang's
rank path, the one draw a verifier replays (`protocol.miner.SEEDED_TOP_K`)."""

from __future__ import annotations

from engy_node.miner.serving import sampling_params
from engy_node.protocol.miner import SEEDED_TOP_K, Message, Sampling, ServeRequest


def request(sampling: Sampling) -> ServeRequest:
    return ServeRequest(
        messages=(Message(role="user", content="hi"),), max_tokens=8, engy_request_id="r", sampling=sampling
    )


def test_a_seeded_sampled_request_goes_by_rank_whatever_its_batch():
    assert sampling_params(request(Sampling(temperature=0.7, seed=42))) == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": SEEDED_TOP_K,
        "min_p": 0.0,
        "sampling_seed": 42,
    }
    assert sampling_params(request(Sampling(temperature=1.0, top_p=0.9, seed=-5)))["top_k"] == SEEDED_TOP_K


def test_unseeded_and_greedy_requests_keep_the_whole_vocabulary_without_a_top_k():
    assert sampling_params(request(Sampling(temperature=0.7))) == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
    }
    assert sampling_params(request(Sampling(seed=3, stop=("\n\n",)))) == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "sampling_seed": 3,
        "stop": ["\n\n"],
    }


def test_the_rank_path_top_k_masks_nothing():
    # The reference server draws as sglang does: the explicit top-k takes the rank path (an order
    # comes back) and keeps exactly what a top-k of the whole vocabulary keeps.
    import torch

    from engy_node.serve.sampling import parse_sampling_params, seeded_draw

    scores = torch.randn(49_152, generator=torch.Generator().manual_seed(1)) * 4
    sent = sampling_params(request(Sampling(temperature=1.0, seed=7)))
    weights, order, _ = seeded_draw(scores, parse_sampling_params(sent), 12)
    whole, _, _ = seeded_draw(scores, parse_sampling_params({**sent, "top_k": 49_152}), 12)
    assert order is not None
    assert torch.equal(weights, whole)
