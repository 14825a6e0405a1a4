"""The audit queue: which responses become jobs, leases and re-leases, expiry, bounds, the wire."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.request.accounting import usage_padding
from engy_node.gateway.trust.audit import AuditQueue, audited
from engy_node.logit_stats import SamplingTerms
from engy_node.proof import Delivery
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import Sampling


def job(
    request_id: str = "r1",
    *,
    kind: str = "paid",
    greedy: bool = True,
    seeded: bool = False,
    sampling: Sampling = Sampling(),
    created_at: float = 100.0,
) -> AuditJob:
    return AuditJob(
        request_id=request_id,
        model="smollm2-135m",
        miner="key:1",
        kind=kind,
        prompt_ids=(1, 2, 3),
        commitment={"model_root": "ab" * 32, "output_token_ids": [4, 5]},
        greedy=greedy,
        sampling=sampling,
        seeded=seeded,
        delivery=Delivery(relayed_output_ids=(4, 5), ended_at_stop=False, max_tokens=16),
        created_at=created_at,
    )


def test_every_probe_and_a_share_of_paid_traffic_is_audited():
    assert audited("probe", draw=0.999, paid_sample_pct=0.0)
    assert audited("paid", draw=0.049, paid_sample_pct=5.0)
    assert not audited("paid", draw=0.05, paid_sample_pct=5.0)
    assert not audited("paid", draw=0.0, paid_sample_pct=0.0)
    assert audited("paid", draw=0.999, paid_sample_pct=100.0)


@given(
    st.lists(st.floats(min_value=0.0, max_value=0.9999999), min_size=1, max_size=200),
    st.floats(min_value=0, max_value=100),
)
def test_the_paid_share_is_the_fraction_of_draws_below_it(draws, pct):
    chosen = sum(audited("paid", draw=draw, paid_sample_pct=pct) for draw in draws)
    assert chosen == sum(draw * 100.0 < pct for draw in draws)


def test_the_wire_round_trips_and_hides_the_miner_and_kind_from_verifiers():
    original = job(kind="probe", greedy=False, seeded=True, sampling=Sampling(temperature=0.7, top_p=0.9, seed=42))
    assert AuditJob.from_wire(original.to_wire()) == original
    for_verifier = original.to_wire(for_verifier=True)
    assert "miner" not in for_verifier and "kind" not in for_verifier
    back = AuditJob.from_wire(for_verifier)
    assert back.miner == "" and back.kind == "paid" and back.prompt_ids == original.prompt_ids


@pytest.mark.parametrize(
    "field, value",
    [
        ("job_id", ""),
        ("prompt_ids", [1, -2]),
        ("prompt_ids", "1,2"),
        ("greedy", 1),
        ("commitment", []),
        ("kind", "free"),
    ],
)
def test_a_malformed_wire_job_names_the_field(field, value):
    wire = job().to_wire()
    wire[field] = value
    with pytest.raises(ValueError, match="malformed audit job"):
        AuditJob.from_wire(wire)


def test_a_missing_field_is_malformed():
    wire = job().to_wire()
    del wire["delivery"]
    with pytest.raises(ValueError, match="malformed audit job"):
        AuditJob.from_wire(wire)


def test_sampling_terms_follow_the_request_and_whether_the_miner_is_seeded():
    assert job().sampling_terms() is None
    sampled = job(greedy=False, sampling=Sampling(temperature=0.7, top_p=None, seed=9))
    assert sampled.sampling_terms() == SamplingTerms(temperature=0.7, top_p=1.0, seed=None)
    seeded = job(greedy=False, seeded=True, sampling=Sampling(temperature=None, top_p=0.9, seed=9))
    assert seeded.sampling_terms() == SamplingTerms(temperature=1.0, top_p=0.9, seed=9)


def test_a_lease_hands_each_job_to_one_verifier_until_it_runs_out():
    queue = AuditQueue(lease_s=10.0)
    for index in range(3):
        queue.offer(job(f"r{index}"), now=0.0)
    first = queue.lease("alice", limit=2, now=1.0)
    assert [lease.job.request_id for lease in first] == ["r0", "r1"] and first[0].expires_at == 11.0
    assert [lease.job.request_id for lease in queue.lease("bob", limit=5, now=2.0)] == ["r2"]
    assert queue.lease("carol", limit=5, now=10.9) == []
    assert [lease.job.request_id for lease in queue.lease("carol", limit=5, now=11.0)] == ["r0", "r1"]
    assert queue.holder("r0", now=11.5) == (job("r0"), "carol")
    assert queue.was_leased_to("r0", "carol") and not queue.was_leased_to("r0", "alice")


def test_a_job_nobody_judges_after_max_leases_is_dropped():
    queue = AuditQueue(lease_s=1.0, max_leases=2)
    queue.offer(job(), now=0.0)
    assert queue.lease("a", limit=1, now=0.0) and queue.lease("a", limit=1, now=1.0)
    assert queue.lease("a", limit=1, now=2.0) == []
    assert len(queue) == 0 and queue.counts(now=2.0).dropped_unjudged == 1


def test_finishing_a_job_forgets_it_and_offering_it_again_is_a_no_op():
    queue = AuditQueue()
    queue.offer(job(), now=0.0)
    queue.offer(job(), now=0.0)
    assert len(queue) == 1
    assert queue.finish("r1") == job() and queue.finish("r1") is None
    assert queue.holder("r1", now=0.0) is None


def test_the_queue_is_bounded_in_jobs_and_age():
    queue = AuditQueue(max_jobs=2, ttl_s=100.0)
    for index in range(3):
        queue.offer(job(f"r{index}"), now=float(index))
    assert queue.holder("r0", now=3.0) is None and queue.counts(now=3.0).dropped_full == 1
    assert queue.counts(now=101.0).waiting == 1 and queue.counts(now=101.0).dropped_expired == 1
    assert queue.counts(now=102.0).waiting == 0


def test_counts_tell_waiting_from_leased():
    queue = AuditQueue(lease_s=5.0)
    queue.offer(job("a"), now=0.0)
    queue.offer(job("b"), now=0.0)
    queue.lease("v", limit=1, now=0.0)
    counts = queue.counts(now=1.0)
    assert (counts.waiting, counts.leased) == (1, 1)


@pytest.mark.parametrize("kwargs", [{"lease_s": 0}, {"ttl_s": -1}, {"max_jobs": 0}, {"max_leases": 0}])
def test_a_queue_with_no_room_or_time_is_refused(kwargs):
    with pytest.raises(ValueError):
        AuditQueue(**kwargs)


@pytest.mark.parametrize(
    "usage, expected",
    [
        ({"prompt_tokens": 3, "completion_tokens": 2}, None),
        ({"prompt_tokens": 3, "completion_tokens": 1}, None),
        ({"prompt_tokens": 3, "completion_tokens": 6}, "6 completion tokens claimed, 2 committed"),
        ({"prompt_tokens": 9, "completion_tokens": 2}, "9 prompt tokens claimed, 3 sent"),
        ({"prompt_tokens": "9", "completion_tokens": True}, None),
        ({}, None),
    ],
)
def test_a_usage_claim_beyond_the_commitment_is_padding(usage, expected):
    assert usage_padding({"usage": usage}, prompt_tokens=3, committed_tokens=2) == expected
    assert usage_padding({}, prompt_tokens=3, committed_tokens=2) is None


def test_a_job_the_gateway_judged_itself_carries_its_verdict_on_the_wire():
    found = dataclasses.replace(job(), found=("cheat", "usage-padding"))
    assert AuditJob.from_wire(found.to_wire()) == found
    wire = found.to_wire()
    wire["found"] = ["guilty", "x"]
    with pytest.raises(ValueError, match="found"):
        AuditJob.from_wire(wire)


gemm_commitments = st.none() | st.dictionaries(
    st.sampled_from(["format", "activations_root", "positions", "layers", "dtype"]),
    st.text(max_size=8) | st.integers(min_value=0, max_value=10**6),
)


@given(
    asked=st.booleans(),
    commitment=gemm_commitments,
    rid=st.none() | st.text(min_size=1, max_size=20),
    leg_id=st.text(max_size=32),
)
def test_the_gemm_audit_fields_round_trip_and_the_rid_and_leg_stay_with_the_gateway(asked, commitment, rid, leg_id):
    original = dataclasses.replace(job(), gemm_asked=asked, gemm_commitment=commitment, gemm_rid=rid, leg_id=leg_id)
    assert AuditJob.from_wire(original.to_wire()) == original
    for_verifier = original.to_wire(for_verifier=True)
    assert "leg_id" not in for_verifier and "rid" not in for_verifier.get("gemm", {})
    seen = AuditJob.from_wire(for_verifier)
    assert (seen.gemm_asked, seen.gemm_commitment, seen.gemm_rid, seen.leg_id) == (asked, commitment, None, "")


def test_a_job_from_before_gemm_audits_reads_as_never_asked():
    wire = job().to_wire()
    assert "gemm" not in wire, "nothing asked, nothing committed: the wire is as it was"
    del wire["leg_id"]
    old = AuditJob.from_wire(wire)
    assert (old.gemm_asked, old.gemm_commitment, old.gemm_rid, old.leg_id) == (False, None, None, "")
    wire["gemm"] = None
    assert AuditJob.from_wire(wire) == old


@pytest.mark.parametrize(
    "gemm, field",
    [
        ([], "gemm"),
        ({"asked": "yes"}, "gemm.asked"),
        ({"commitment": [1]}, "gemm.commitment"),
        ({"rid": ""}, "gemm.rid"),
    ],
)
def test_a_malformed_gemm_object_names_the_field(gemm, field):
    wire = {**job().to_wire(), "gemm": gemm}
    with pytest.raises(ValueError, match=f"malformed audit job: {field}"):
        AuditJob.from_wire(wire)
