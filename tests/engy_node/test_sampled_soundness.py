"""No honest sampled answer is judged a cheat (issue 9): over 100 sampled requests on the embedded
model, across temperatures 0.7 and 1.0 and top_p 1.0 and 0.9, the reference server's answers are
verified the two ways a verifier can — replaying the seeded draw, and the statistical test for a
miner that cannot replay — and every one passes both. The e-value test's false-positive rate is
1e-5 by construction (Ville's inequality), so a failure here is a bug, not bad luck."""

from __future__ import annotations

import itertools

import pytest

from engy_node import proof
from engy_node.calibration import DEFAULT_PROMPTS, chat_ids
from engy_node.models import SMOLLM2_135M, model_root
from engy_node.serve.engine import Generation, run_to_completion
from engy_node.serve.sampling import parse_sampling_params

pytestmark = pytest.mark.model

REQUESTS = 100
SETTINGS = [(0.7, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 0.9)]
ANSWER_TOKENS = 24


def test_honest_sampled_answers_are_never_judged_a_cheat(runner, checkpoint):
    root = model_root(checkpoint)
    prompts = [chat_ids(runner, prompt) for prompt in DEFAULT_PROMPTS]
    outcomes = {"replayed": [], "statistical": []}
    cases = itertools.islice(itertools.cycle(itertools.product(prompts, SETTINGS)), REQUESTS)
    for seed, (prompt_ids, (temperature, top_p)) in enumerate(cases):
        generation = Generation(rid=f"s{seed}", input_ids=list(prompt_ids), return_hidden_states=True, params=parse_sampling_params(
            {"temperature": temperature, "top_p": top_p, "sampling_seed": seed, "max_new_tokens": ANSWER_TOKENS}))
        done = run_to_completion(runner, generation)
        commitment = proof.build_commitment(model_root=root, prompt_ids=prompt_ids, output_ids=done.output_ids,
                                            rows=done.proof_rows(), params=SMOLLM2_135M.proof)
        for way, terms in (("replayed", proof.SamplingTerms(temperature, top_p, seed=seed)),
                           ("statistical", proof.SamplingTerms(temperature, top_p))):
            verdict = proof.verify_commitment(commitment, model=SMOLLM2_135M, canonical_root=root, expected_prompt_ids=prompt_ids,
                                              recompute=runner.prefill, greedy=False, sampling=terms)
            outcomes[way].append((seed, temperature, top_p, verdict.kind, verdict.reason))
    for way, results in outcomes.items():
        judged = [result for result in results if result[3] != "pass"]
        assert len(results) == REQUESTS and not judged, f"{way}: {judged}"
