"""Answers with no commitment (a TEE miner's `commitment: {}`) judged on their delivered tokens
against the canonical model, through the verifier's own `Judge`: honest greedy and sampled
answers pass, a 4-bit model's are caught, and the gateway's tokenisation of an honest answer
that the model wrote in other pieces is not taken for a different answer."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engy_node import proof
from engy_node.calibration import chat_ids, greedy_generation, quantise_linear_weights, seeded_generation
from engy_node.drift import drift_conversations
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import Sampling
from engy_node.serve.engine import ModelRunner
from engy_node.verifier.judge import Judge

MODEL = SMOLLM2_135M.id
PROMPTS = ("Explain why the sky is blue in two sentences.", "Give me a simple recipe for pancakes.")
RESPLIT_SEARCH = 60
"""How many buyer-like conversations to try for an answer the model writes in other pieces than
the tokenizer would: which answer does so moves with the checkpoint's numerics (a pinned prompt
stopped doing it), and about one in twenty does."""
RESPLIT_TRIED_FIRST = 9
"""The conversation (0-based, in `drift_conversations` order) whose answer was split differently
on the machine this was last measured on: searching in order decoded nine whole answers before
it, half of this module's time. It is only tried first; if the numerics move, the search finds
another as before."""


@pytest.fixture(scope="module")
def judge(checkpoint):
    return Judge({MODEL: checkpoint}, dtype="float32")


@pytest.fixture(scope="module")
def quantised(checkpoint):
    return quantise_linear_weights(ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16"))


@pytest.fixture(scope="module")
def greedy_answer(runner, quantised):
    """(prompt ids, 48-token greedy answer) by "honest" or "quantised" and prompt, each decoded once
    for the module: several tests judge the same answer (the honest one as delivered and as the
    gateway repaired it, the 4-bit one under both), and decoding is most of their work."""
    models = {"honest": runner, "quantised": quantised}
    answers: dict[tuple[str, str], tuple[list[int], list[int]]] = {}

    def answer(model: str, prompt: str) -> tuple[list[int], list[int]]:
        if (model, prompt) not in answers:
            prompt_ids = chat_ids(runner, prompt)
            answers[model, prompt] = prompt_ids, greedy_generation(models[model], prompt_ids, 48).output_ids
        return answers[model, prompt]

    return answer


def delivered_job(runner, prompt_ids, output_ids, *, sampling: Sampling = Sampling(), greedy: bool = True) -> AuditJob:
    """The job the gateway files for an answer without a commitment: the relayed text, as the
    gateway tokenises it."""
    text = runner.decode_text([t for t in output_ids if t not in runner.eos_token_ids])
    ids = tuple(runner.tokenizer.encode(text, add_special_tokens=False))
    return AuditJob(
        request_id="r",
        model=MODEL,
        miner="key:tee",
        kind="probe",
        prompt_ids=tuple(prompt_ids),
        commitment={},
        greedy=greedy,
        sampling=sampling,
        seeded=False,
        delivery=proof.Delivery(relayed_output_ids=ids, ended_at_stop=False, max_tokens=64),
        created_at=time.time(),
    )


def test_honest_greedy_answers_pass_by_recompute_and_say_so(judge, runner, greedy_answer):
    for prompt in PROMPTS:
        prompt_ids, served = greedy_answer("honest", prompt)
        verdict = judge.judge(delivered_job(runner, prompt_ids, served))
        assert (verdict.kind, verdict.code) == ("pass", "recompute:ok"), verdict


def test_a_pass_on_a_delivery_the_gateway_repaired_names_the_defect_and_a_cheat_stays_a_cheat(
    judge, runner, greedy_answer
):
    for model, expected in (
        ("honest", ("pass", "recompute:defect:held-back")),
        ("quantised", ("cheat", "recompute:tokens")),
    ):
        job = delivered_job(runner, *greedy_answer(model, PROMPTS[0]))
        job = dataclasses.replace(job, delivery=dataclasses.replace(job.delivery, defect="held-back"))
        verdict = judge.judge(job)
        assert (verdict.kind, verdict.code) == expected, verdict


def resplit_answer(runner) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy answer) of a conversation whose answer the tokenizer would write in
    other pieces: `RESPLIT_TRIED_FIRST`, else the first such in order."""
    conversations = drift_conversations(RESPLIT_SEARCH)
    first = conversations[RESPLIT_TRIED_FIRST : RESPLIT_TRIED_FIRST + 1]
    for conversation in [*first, *(c for c in conversations if c not in first)]:
        prompt_ids = chat_ids(runner, conversation)
        served = greedy_generation(runner, prompt_ids, 40).output_ids
        pieces = [t for t in served if t not in runner.eos_token_ids]
        if runner.tokenizer.encode(runner.decode_text(pieces), add_special_tokens=False) != pieces:
            return prompt_ids, served
    raise AssertionError(f"none of {RESPLIT_SEARCH} conversations' answers is split differently by the tokenizer")


def test_an_honest_answer_in_other_pieces_than_the_tokenizer_would_write_still_passes(judge, runner):
    prompt_ids, served = resplit_answer(runner)
    verdict = judge.judge(delivered_job(runner, prompt_ids, served))
    assert verdict.kind == "pass", verdict


def test_a_four_bit_model_without_a_commitment_is_caught(judge, runner, greedy_answer):
    verdicts = []
    for prompt in PROMPTS:
        verdicts.append(judge.judge(delivered_job(runner, *greedy_answer("quantised", prompt))))
    assert [(v.kind, v.code) for v in verdicts] == [("cheat", "recompute:tokens")] * len(PROMPTS), verdicts


def test_honest_sampled_answers_pass_the_statistical_test_by_recompute(judge, runner):
    for index, (temperature, top_p) in enumerate(((1.0, 1.0), (0.7, 0.9))):
        prompt_ids = chat_ids(runner, PROMPTS[index])
        served = seeded_generation(runner, prompt_ids, 48, temperature=temperature, top_p=top_p, seed=index)
        job = delivered_job(
            runner,
            prompt_ids,
            served.output_ids,
            greedy=False,
            sampling=Sampling(temperature=temperature, top_p=top_p, seed=None),
        )
        verdict = judge.judge(job)
        assert (verdict.kind, verdict.path) == ("pass", "recompute"), verdict


def test_an_answer_with_nothing_delivered_is_unproven(judge, runner):
    job = delivered_job(runner, chat_ids(runner, PROMPTS[0]), [])
    assert (judge.judge(job).kind, judge.judge(job).code) == ("unproven", "recompute:empty-output")
