"""Seeded sampling verified by replay, on the embedded model: the reference server draws a seeded
request's tokens as sglang's deterministic sampler does on its rank path (the miner's explicit
`SEEDED_TOP_K`), and the verifier replays that draw on its own prefill's logits
(`logit_stats.token_stats` with a seed). Honest seeded serving passes as a greedy answer does; the
same tokens claimed under another seed, a 4-bit model's seeded tokens under the canonical
model's proofs (the prefill attack), and the canonical model sampled other than as asked do not."""

from __future__ import annotations

import pytest

from engy_node import logit_stats, proof
from engy_node.calibration import chat_ids, quantise_linear_weights
from engy_node.models import SMOLLM2_135M, model_root
from engy_node.protocol.miner import SEEDED_TOP_K
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
from engy_node.serve.sampling import parse_sampling_params

PROMPT = "Write a short poem about the sea."


def seeded_answer(runner: ModelRunner, prompt_ids, *, seed: int, temperature: float, top_p: float, **more) -> list[int]:
    generation = Generation(
        rid="seeded",
        input_ids=list(prompt_ids),
        return_hidden_states=True,
        params=parse_sampling_params(
            {
                "temperature": temperature,
                "top_p": top_p,
                "top_k": SEEDED_TOP_K,
                "sampling_seed": seed,
                "max_new_tokens": 48,
                **more,
            }
        ),
    )
    return run_to_completion(runner, generation).output_ids


def judge(runner: ModelRunner, checkpoint, prompt_ids, output_ids, terms: logit_stats.SamplingTerms) -> proof.Verdict:
    hidden, _ = runner.prefill(list(prompt_ids) + list(output_ids[:-1]))
    commitment = proof.build_commitment(
        model_root=model_root(checkpoint),
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        rows=hidden[len(prompt_ids) - 1 :],
        params=SMOLLM2_135M.proof,
    )
    return proof.verify_commitment(
        commitment,
        model=SMOLLM2_135M,
        canonical_root=model_root(checkpoint),
        expected_prompt_ids=prompt_ids,
        recompute=runner.prefill,
        greedy=False,
        sampling=terms,
    )


@pytest.fixture(scope="module")
def quantised(checkpoint):
    return quantise_linear_weights(ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16"))


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.0, 0.9)])
def test_honest_seeded_serving_passes_and_another_seed_does_not(runner, checkpoint, temperature, top_p):
    prompt_ids = chat_ids(runner, PROMPT)
    output = seeded_answer(runner, prompt_ids, seed=20261201, temperature=temperature, top_p=top_p)
    honest = judge(runner, checkpoint, prompt_ids, output, logit_stats.SamplingTerms(temperature, top_p, seed=20261201))
    assert (honest.kind, honest.reason) == ("pass", "ok")
    assert honest.max_logit_gap <= SMOLLM2_135M.token_check.seeded_margin / 2, "near-ties only, far inside the margin"
    wrong_seed = judge(runner, checkpoint, prompt_ids, output, logit_stats.SamplingTerms(temperature, top_p, seed=7))
    assert (wrong_seed.kind, wrong_seed.reason) == ("cheat", "tokens")


@pytest.mark.parametrize(
    ("case", "served_as"),
    [
        ("greedy answer", {"temperature": 0}),
        ("lower temperature", {"temperature": 0.5}),
        ("top-k", {"top_k": 5}),
        ("own randomness", {"sampling_seed": None}),
    ],
)
def test_the_canonical_model_sampled_other_than_as_asked_is_caught(runner, checkpoint, case, served_as):
    # The audit that found replay weaker than greedy: a miner with the real model and real proofs
    # that caches greedy answers or draws more cheaply than the request asked.
    prompt_ids = chat_ids(runner, PROMPT)
    output = seeded_answer(runner, prompt_ids, seed=20261205, **{"temperature": 1.0, "top_p": 1.0, **served_as})
    verdict = judge(runner, checkpoint, prompt_ids, output, logit_stats.SamplingTerms(1.0, 1.0, seed=20261205))
    assert (verdict.kind, verdict.reason) == ("cheat", "tokens"), case


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_cheap_models_seeded_tokens_under_canonical_proofs_are_caught(runner, checkpoint, quantised, top_p):
    prompt_ids = chat_ids(runner, PROMPT)
    caught = []
    for seed in (1, 2, 3):
        output = seeded_answer(quantised, prompt_ids, seed=seed, temperature=1.0, top_p=top_p)
        verdict = judge(runner, checkpoint, prompt_ids, output, logit_stats.SamplingTerms(1.0, top_p, seed=seed))
        caught.append((verdict.kind, verdict.reason))
    assert caught == [("cheat", "tokens")] * 3
