"""`engy-node up` with GEMM audits on (issue 32's "done when"): of the two local miners, one
serves the real weights and one (`--cheat miner-2=noise-1%`) weights with 1e-2 relative noise
added in memory after its load-time weights check — which TOPLOC passes, since its thresholds
leave room for honest cross-precision drift. The GEMM audit must pull the noisy one (its cheat
verdicts are the GEMM audit's, none TOPLOC's) while the honest one stays active, with its own
answers audited by both proofs and passed."""

from __future__ import annotations

import time

import pytest

from engy_node.snapshots import decode_states
from tests.test_up import Up

VERDICT_TIMEOUT_S = 600
"""Start, three qualification probes each, their audits; on two shared cores."""


@pytest.mark.minutes
def test_up_with_gemm_audits_pulls_the_noisy_miner_and_keeps_the_honest_one(checkpoint, tmp_path):
    up = Up(tmp_path, "--traffic", "--cheat", "miner-2=noise-1%")
    try:
        honest, noisy = (up.network["hotkeys"][name] for name in ("miner-1", "miner-2"))
        deadline = time.monotonic() + VERDICT_TIMEOUT_S
        while True:
            states = decode_states(up.status()["states"], strict=True)
            assert states.traffic is not None
            standing = {worker.miner: worker for worker in states.traffic.workers}
            if (
                honest in standing
                and noisy in standing
                and standing[noisy].state == "pulled"
                and standing[honest].state == "active"
                and (standing[honest].lifetime is not None and standing[honest].lifetime.proofs.gemm.passed > 0)
            ):
                break
            assert time.monotonic() < deadline, f"never honest active and noisy pulled: {standing}"
            time.sleep(2)
        honest_counts, noisy_counts = standing[honest].lifetime, standing[noisy].lifetime
        assert noisy_counts is not None and honest_counts is not None
        assert noisy_counts.proofs.gemm.cheat > 0, noisy_counts
        assert noisy_counts.proofs.toploc.cheat == 0, f"TOPLOC passes 1e-2 noise: {noisy_counts}"
        assert honest_counts.cheat == 0 and honest_counts.proofs.gemm.cheat == 0, honest_counts
        legs = {leg.miner: leg for leg in states.gateway.legs} if states.gateway is not None else {}
        assert all(leg.gemm_audit for leg in legs.values()), legs
    finally:
        assert up.stop() == 0
