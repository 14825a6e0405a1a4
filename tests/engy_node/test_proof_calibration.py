"""Calibration on the real embedded model (SPEC §5): honest serving passes with a wide margin,
known cheats are judged `cheat`, malformed proofs `unproven`. docs/verification.md records the
full table from `engy-node calibrate`; this test runs a smaller set and asserts the verdicts."""

from __future__ import annotations

import pytest

from engy_node.calibration import DEFAULT_PROMPTS, format_table, run_calibration
from engy_node.models import SMOLLM2_135M

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def results(checkpoint):
    return run_calibration(checkpoint, model=SMOLLM2_135M, prompts=DEFAULT_PROMPTS[:3], max_new_tokens=64)


def test_every_case_gets_its_expected_verdict(results):
    wrong = [(r.case, r.prompt, r.recompute_dtype, r.verdict) for r in results if r.verdict.kind != r.expected]
    assert not wrong, format_table(results)


def test_honest_serving_stays_far_below_every_threshold(results):
    params, tokens = SMOLLM2_135M.proof, SMOLLM2_135M.token_check
    honest = [r.verdict for r in results if r.case == "honest"]
    assert honest and all(v.chunks_passed == v.chunks_total for v in honest)
    assert max(v.max_exp_mismatches for v in honest) <= params.max_exp_mismatches / 2
    assert max(v.max_mant_err_mean for v in honest) <= params.max_mant_err_mean / 2
    assert max(v.max_logit_gap for v in honest) <= tokens.greedy_logit_margin / 2


def test_each_cheat_is_caught_by_the_check_designed_for_it(results):
    by_case = {}
    for r in results:
        by_case.setdefault(r.case, set()).add(r.verdict.reason)
    assert by_case["quantised-4bit"] <= {"chunks", "tokens"}
    assert by_case["truncated"] == {"chunks"}
    assert by_case["prefill-attack"] == {"tokens"}, "TOPLOC alone passes the prefill attack by construction"
    assert by_case["malformed-proof"] == {"malformed-proof"}
    assert by_case["short-proof-list"] == {"shape:proofs"}
    assert by_case["wrong-prompt"] == {"prompt-mismatch"}
    assert by_case["swapped-after-proving"] == {"output-mismatch"}
    assert by_case["past-eos"] == {"past-eos"}


def test_the_prefill_attack_passes_toploc_but_trails_the_argmax_by_logits(results):
    attacks = [r.verdict for r in results if r.case == "prefill-attack"]
    assert all(v.chunks_passed == v.chunks_total for v in attacks)
    assert min(v.max_logit_gap for v in attacks) > SMOLLM2_135M.token_check.greedy_logit_margin
