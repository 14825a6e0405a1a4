"""Calibration on the real embedded model (docs/verification.md, issue 9): honest serving, greedy and sampled,
passes with a wide margin; known cheats are judged `cheat` by the check designed for each,
malformed proofs `unproven`; the detection-power cases land where docs/verification.md says.
docs/verification.md records the full table from `engy-node calibrate`; this test runs a smaller
set and asserts the verdicts."""

from __future__ import annotations

import pytest

from engy_node.calibration import DEFAULT_PROMPTS, POWER_CASES, format_table, run_calibration, unexpected
from engy_node.models import SMOLLM2_135M

PARAMS, TOKENS = SMOLLM2_135M.proof, SMOLLM2_135M.token_check
CAUGHT_DEVIATIONS = ("noise-3%", "neighbour-layer", "final-norm-x1.05")
"""The detection-power cases whose verdicts this test asserts. The milder ones (noise up to 1 %,
8-bit weights) are published, not asserted: `engy-node calibrate` measures them for
docs/verification.md, and their alterations are functions run here anyway with other arguments
(`add_weight_noise` for noise-3 %, `quantise_linear_weights` for the 4-bit cheat), so measuring
them here cost four of the seven cases' model passes (a sixth of this module's time) and checked
nothing."""
POWER = tuple((case, dict(POWER_CASES)[case]) for case in CAUGHT_DEVIATIONS)

pytestmark = pytest.mark.minutes  # the module's `results`


@pytest.fixture(scope="module")
def results(checkpoint):
    # Both temperatures and both top_p values, on three prompts each.
    return run_calibration(
        checkpoint,
        model=SMOLLM2_135M,
        prompts=DEFAULT_PROMPTS[:3],
        max_new_tokens=64,
        sampled_settings=((0.7, 1.0), (1.0, 0.9)),
        power_cases=POWER,
        power_prompts=2,
    )


def of(results, case, *, check=None):
    return [r for r in results if r.case == case and (check is None or r.check == check)]


def test_every_case_gets_its_expected_verdict(results):
    assert not unexpected(results), format_table(results)


def test_honest_serving_stays_far_below_every_threshold(results):
    honest = [r.verdict for r in of(results, "honest")]
    assert len(honest) == 2 * (3 + 3 * 2 * 2), "3 greedy and 6 sampled answers (judged two ways), two recomputes each"
    assert all(v.chunks_passed == v.chunks_total for v in honest)
    assert max(v.max_exp_mismatches for v in honest) <= PARAMS.max_exp_mismatches / 2
    assert max(v.max_mant_err_mean for v in honest) <= PARAMS.max_mant_err_mean / 2
    assert max(v.max_mant_err_median for v in honest) <= PARAMS.max_mant_err_median / 2
    assert max(r.verdict.max_logit_gap for r in of(results, "honest", check="greedy")) <= TOKENS.greedy_logit_margin / 2


def test_a_seeded_sampled_answer_is_checked_as_strictly_as_a_greedy_one(results):
    # Misses beyond the same measured drift band carry the evidence, and honest near-ties stay
    # well inside the margin that is enough on its own (wider than greedy's: a draw reaches the
    # tail, whose logits drift further between numeric paths).
    replayed = [r.verdict for r in of(results, "honest", check="replay")]
    assert replayed and max(v.max_logit_gap for v in replayed) <= TOKENS.seeded_margin / 2
    assert TOKENS.seeded_drift_band == TOKENS.greedy_drift_band
    attacks = [r.verdict for r in of(results, "prefill-attack", check="replay")]
    assert attacks and min(v.max_logit_gap for v in attacks) > TOKENS.seeded_margin


def test_each_cheat_is_caught_by_the_check_designed_for_it(results):
    reasons = {}
    for r in results:
        reasons.setdefault((r.case, r.check), set()).add(r.verdict.reason)
    for check in ("greedy", "replay", "statistical"):
        assert reasons["quantised-4bit", check] <= {"chunks", "tokens"}
    assert reasons["truncated", "greedy"] == {"chunks"}
    assert reasons["prefill-attack", "greedy"] == {"tokens"}, "TOPLOC alone passes the prefill attack by construction"
    assert reasons["prefill-attack", "replay"] == {"tokens"}
    assert reasons["malformed-proof", "greedy"] == {"malformed-proof"}
    assert reasons["short-proof-list", "greedy"] == {"shape:proofs"}
    assert reasons["wrong-prompt", "greedy"] == {"prompt-mismatch"}
    assert reasons["swapped-after-proving", "greedy"] == {"output-mismatch"}
    assert reasons["past-eos", "greedy"] == {"past-eos"}


def test_the_prefill_attack_passes_toploc_but_trails_the_argmax_by_logits(results):
    attacks = [r.verdict for r in of(results, "prefill-attack", check="greedy")]
    assert all(v.chunks_passed == v.chunks_total for v in attacks)
    assert min(v.max_logit_gap for v in attacks) > TOKENS.greedy_logit_margin


def test_every_detection_power_case_was_measured_on_both_recomputes(results):
    for case, _ in POWER:
        measured = of(results, case)
        assert {r.recompute_dtype for r in measured} == {"float32", "bfloat16"} and len(measured) == 4, case


@pytest.mark.parametrize("case", CAUGHT_DEVIATIONS)
def test_detection_power_every_request_of_these_deviations_is_caught_on_both_recomputes(results, case):
    # docs/verification.md publishes the rest (8-bit weights and noise up to 1 % pass: they sit
    # within 2.5x of honest numeric drift on this model).
    verdicts = [r.verdict for r in of(results, case)]
    assert verdicts and all(v.kind == "cheat" for v in verdicts), format_table(results)


def test_the_final_norm_scaled_by_5_percent_no_longer_sits_on_a_threshold(results):
    # It used to land at the paper's median limit of 8 and flip between fp32 and bf16 recomputes.
    scaled = [r.verdict for r in of(results, "final-norm-x1.05")]
    assert min(v.max_mant_err_median for v in scaled) >= PARAMS.max_mant_err_median * 1.5
    assert min(v.max_mant_err_mean for v in scaled) >= PARAMS.max_mant_err_mean * 1.3
