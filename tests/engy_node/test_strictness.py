"""The sampling-cheat measurement's bookkeeping: an answer's verdict within its first n tokens is
the token check's verdict on that shorter answer, and the catch rates count exactly those."""

from __future__ import annotations

from engy_node import logit_stats, token_evidence
from engy_node.models import SMOLLM2_135M
from engy_node.strictness import JudgedAnswer, catch_rates, format_catch_rates

PARAMS = SMOLLM2_135M.token_check


def answer(case: str, index: int, gaps: list[float]) -> JudgedAnswer:
    n = len(gaps)
    stats = logit_stats.TokenStats(
        tokens=(1,) * n,
        argmax=(1,) * n,
        gap=(0.0,) * n,
        rank=(0,) * n,
        logprob=(-1.0,) * n,
        surprisal=(1.0,) * n,
        tilts=((0.0,) * 5,) * n,
        in_nucleus=(True,) * n,
        replay_gap=tuple(gaps),
    )
    return JudgedAnswer(case, index, stats)


def test_a_gap_past_the_margin_is_caught_only_once_the_prefix_reaches_it():
    late = answer("T 0.8 for 1", 0, [0.0] * 40 + [PARAMS.seeded_margin + 0.5] + [0.0] * 23)
    assert late.verdict_within(32, PARAMS).ok
    assert (late.verdict_within(64, PARAMS).ok, late.verdict_within(64, PARAMS).reason) == (False, "seeded-gap")


def test_the_verdict_on_a_prefix_is_the_verdict_on_the_answer_cut_there():
    gaps = [0.0, PARAMS.seeded_drift_band + 0.1] * 16
    whole = answer("x", 0, gaps)
    for tokens in (1, 7, 16, 32):
        cut = answer("x", 0, gaps[:tokens])
        assert whole.verdict_within(tokens, PARAMS) == token_evidence.token_check(
            cut.stats, greedy=False, params=PARAMS
        )


def test_catch_rates_count_each_case_at_every_length_its_answers_reach():
    caught_late = [PARAMS.seeded_margin + 1 if i == 20 else 0.0 for i in range(64)]
    judged = [
        answer("honest", 0, [0.0] * 64),
        answer("honest", 1, [0.1] * 64),
        answer("cheat", 0, caught_late),
        answer("cheat", 1, [PARAMS.seeded_margin + 1] + [0.0] * 63),
    ]
    assert catch_rates(judged, params=PARAMS) == [
        ("cheat", 16, 2, 1),
        ("cheat", 32, 2, 2),
        ("cheat", 64, 2, 2),
        ("honest", 16, 2, 0),
        ("honest", 32, 2, 0),
        ("honest", 64, 2, 0),
    ]
    table = format_catch_rates(judged, params=PARAMS)
    assert "| cheat | 2 | 1/2 (1.3–98.7 %) | 2/2 (15.8–100.0 %) | 2/2 (15.8–100.0 %) |" in table
    assert "Honest answers: 128 tokens, largest replay gap 0.100 logits, 0 beyond" in table
