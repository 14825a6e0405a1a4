"""No honest sampled answer is judged a cheat (issue 9): over 100 sampled requests on the embedded
model, across temperatures 0.7 and 1.0 and top_p 1.0 and 0.9, the reference server's answers are
verified the two ways a verifier can — replaying the seeded draw, and the statistical test for a
miner that cannot replay — and every one passes both. The e-value test's false-positive rate is
1e-5 by construction (Ville's inequality), so a failure here is a bug, not bad luck.
`engy-node calibrate --sampled-requests 1000` runs the same measurement at the size
docs/verification.md records."""

from __future__ import annotations

import pytest

from engy_node.calibration import SAMPLED_SETTINGS, format_soundness, run_sampled_soundness
from engy_node.models import SMOLLM2_135M

REQUESTS = 100


@pytest.mark.minutes
def test_honest_sampled_answers_are_never_judged_a_cheat(runner, checkpoint):
    results = run_sampled_soundness(checkpoint, model=SMOLLM2_135M, requests=REQUESTS, answer_tokens=24, runner=runner)
    judged = [r for r in results if r.verdict.kind != "pass"]
    assert not judged, format_soundness(results)
    assert {(r.temperature, r.top_p) for r in results} == set(SAMPLED_SETTINGS)
    for check in ("replay", "statistical"):
        assert len({r.request for r in results if r.check == check}) == REQUESTS
    replayed = [r.verdict for r in results if r.check == "replay"]
    assert max(v.max_logit_gap for v in replayed) <= SMOLLM2_135M.token_check.seeded_margin / 2, (
        "a seeded answer is held as strictly as a greedy one: only near-ties may lose the draw"
    )
