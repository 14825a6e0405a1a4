"""The verifier loop over a real audit desk and store: bounded concurrency, every job answered,
a judge that fails answers `unproven`, never `cheat`; the GEMM openings of a committed job asked
for at the verifier's own picks and handed to the judge; and the judge's refusals before any model."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import trio
import trio.testing

from engy_node import proof
from engy_node.gateway.store import Store
from engy_node.gateway.trust.audit import AuditQueue
from engy_node.gateway.trust.audit_desk import AuditDesk, DeskAuditSource
from engy_node.gemm.activations import Commitment, llama_layout
from engy_node.proof import Delivery
from engy_node.protocol.audit import LOCAL_VERIFIER, NO_OPENING, AuditJob, GemmOpeningFailed
from engy_node.protocol.gemm import RECORD_WINDOW_S, GemmPick
from engy_node.protocol.miner import Sampling
from engy_node.verifier.gemm_audit import GemmEvidence, draw_picks
from engy_node.verifier.judge import Judge
from engy_node.verifier.role import Verifier


def job(request_id: str, *, model: str = "smollm2-135m", commitment: dict | None = None) -> AuditJob:
    return AuditJob(
        request_id=request_id,
        model=model,
        miner="key:1",
        kind="paid",
        prompt_ids=(1, 2),
        commitment={"output_token_ids": [3]} if commitment is None else commitment,
        greedy=True,
        sampling=Sampling(),
        seeded=False,
        delivery=Delivery((3,), False, 8),
        created_at=time.time(),
    )


@pytest.fixture
def desk(tmp_path):
    with Store.open(tmp_path / "gateway.sqlite3") as store:
        yield AuditDesk(queue=AuditQueue(lease_s=30.0), store=store)


async def test_every_job_is_judged_at_most_n_at_a_time_and_filed(nursery, desk):
    for index in range(7):
        desk.offer(job(f"r{index}"))
    running, most = 0, 0
    lock = threading.Lock()

    def judge(audit_job: AuditJob, gemm: GemmEvidence | None) -> proof.Verdict:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return proof.Verdict(
            "cheat" if audit_job.request_id == "r3" else "pass", "chunks" if audit_job.request_id == "r3" else "ok"
        )

    verifier = Verifier(DeskAuditSource(desk), judge, concurrency=2, poll_s=0.05)
    await nursery.start(verifier.run)
    with trio.fail_after(30):
        while verifier.judged < 7:
            await trio.sleep(0.05)
    assert most == 2
    records = {record.request_id: record for _, record in desk.store.verdicts_after(0)}
    assert len(records) == 7 and records["r3"].verdict == "cheat" and records["r0"].verifier == LOCAL_VERIFIER
    assert len(desk.queue) == 0


async def test_a_cheat_verdict_is_logged_with_what_it_rests_on(nursery, desk, caplog):
    desk.offer(job("r0"))

    def judge(audit_job: AuditJob, gemm: GemmEvidence | None) -> proof.Verdict:
        return proof.Verdict(
            "cheat",
            "tokens",
            chunks_total=2,
            chunks_passed=2,
            max_exp_mismatches=7,
            token_misses=3,
            max_logit_gap=1.25,
            token_evidence=13.2,
        )

    verifier = Verifier(DeskAuditSource(desk), judge, poll_s=0.05)
    await nursery.start(verifier.run)
    with trio.fail_after(30):
        while verifier.judged < 1:
            await trio.sleep(0.05)
    line = next(record.getMessage() for record in caplog.records if "output tokens" in record.getMessage())
    assert "(smollm2-135m, 1 output tokens, greedy): cheat (tokens)" in line
    assert "chunks 2/2 passed (worst 7 exponent mismatches" in line
    assert "tokens: 3 not chosen, largest gap 1.250 logits, log e-value 13.2" in line


async def test_a_judge_that_fails_answers_unproven(nursery, desk):
    desk.offer(job("r0"))

    def broken(audit_job: AuditJob, gemm: GemmEvidence | None) -> proof.Verdict:
        raise RuntimeError("out of memory")

    verifier = Verifier(DeskAuditSource(desk), broken, poll_s=0.05)
    await nursery.start(verifier.run)
    with trio.fail_after(30):
        while verifier.judged < 1:
            await trio.sleep(0.05)
    record = desk.store.verdict("r0")
    assert (record.verdict, record.reason) == ("unproven", "verifier-error")


async def test_stopping_waits_for_a_judgement_in_progress_rather_than_leaving_its_thread_running(desk):
    """A process that exits while a thread is inside torch is aborted (SIGABRT), so a verifier
    cancelled mid-judgement lets the judgement finish before it stops."""
    desk.offer(job("r0"))
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def judge(audit_job: AuditJob, gemm: GemmEvidence | None) -> proof.Verdict:
        started.set()
        release.wait(30)
        finished.set()
        return proof.Verdict("pass", "ok")

    async def release_once_stopping_waits(cancelled: trio.Event) -> None:
        # Every task blocked after the cancel: a verifier that waits for its judge is waiting;
        # one that left the thread running has already stopped, and the test has gone on.
        await cancelled.wait()
        await trio.testing.wait_all_tasks_blocked()
        release.set()

    verifier = Verifier(DeskAuditSource(desk), judge, concurrency=1, poll_s=0.05)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as releaser:
                cancelled = trio.Event()
                releaser.start_soon(release_once_stopping_waits, cancelled)
                async with trio.open_nursery() as nursery:
                    await nursery.start(verifier.run)
                    while not started.is_set():
                        await trio.sleep(0.01)
                    nursery.cancel_scope.cancel()
                    cancelled.set()
                assert finished.is_set(), "the verifier stopped while its judge's thread was still running"
    finally:
        release.set()


TINY = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16}
COMMITMENT = Commitment(os.urandom(32), llama_layout({**TINY, "num_hidden_layers": 3}, "bfloat16"), 3).to_wire()
OPENINGS = ({"position": 0, "layer": 0, "group": "residual_in", "data": "AAAA", "path": []},)


class Challenger:
    """The gateway's pool as the desk sees it: the picks it was asked to relay, and an answer."""

    def __init__(self, failure: GemmOpeningFailed | None = None) -> None:
        self.asked: list[tuple[str, tuple[GemmPick, ...]]] = []
        self.failure = failure

    async def __call__(self, leg_id: str, rid: str, picks: tuple[GemmPick, ...], *, timeout_s: float):
        self.asked.append((rid, picks))
        if self.failure is not None:
            raise self.failure
        return OPENINGS


async def judged_with(nursery, tmp_path, challenger: Challenger, *jobs: AuditJob) -> tuple[Verifier, dict]:
    """Each job's GEMM evidence as the judge was handed it, once every job is judged."""
    seen: dict[str, GemmEvidence | None] = {}

    def judge(audit_job: AuditJob, gemm: GemmEvidence | None) -> proof.Verdict:
        seen[audit_job.request_id] = gemm
        return proof.Verdict("pass", "ok")

    store = Store.open(tmp_path / "gemm.sqlite3")
    desk = AuditDesk(queue=AuditQueue(lease_s=30.0), store=store, challenge=challenger)
    for audit_job in jobs:
        desk.offer(audit_job)
    verifier = Verifier(DeskAuditSource(desk), judge, concurrency=2, poll_s=0.05)
    await nursery.start(verifier.run)
    with trio.fail_after(30):
        while verifier.judged < len(jobs):
            await trio.sleep(0.05)
    store.close()
    return verifier, seen


def committed(request_id: str, commitment: dict) -> AuditJob:
    return dataclasses.replace(
        job(request_id), gemm_asked=True, gemm_commitment=commitment, gemm_rid=f"rid-{request_id}", leg_id="leg"
    )


async def test_a_committed_job_is_opened_at_the_verifiers_own_picks_and_judged_on_the_openings(nursery, tmp_path):
    challenger = Challenger()
    plain = job("plain")
    verifier, seen = await judged_with(nursery, tmp_path, challenger, committed("gemm", COMMITMENT), plain)
    picks = draw_picks(verifier._gemm_secret, COMMITMENT, prompt_positions=len(plain.prompt_ids))
    assert seen == {"gemm": GemmEvidence(picks, OPENINGS), "plain": None}
    assert challenger.asked == [("rid-gemm", picks)], "only the committed job was opened, once"


async def test_no_openings_and_an_unreadable_commitment_reach_the_judge_as_such(nursery, tmp_path):
    challenger = Challenger(GemmOpeningFailed(NO_OPENING, "the miner sent no openings within 20 s"))
    unreadable = {**COMMITMENT, "format": "engy-activations-v9"}
    verifier, seen = await judged_with(
        nursery, tmp_path, challenger, committed("silent", COMMITMENT), committed("unreadable", unreadable)
    )
    silent = seen["silent"]
    assert silent is not None and silent.openings is None and silent.picks
    assert silent.failure == "no_opening: the miner sent no openings within 20 s"
    assert seen["unreadable"] == GemmEvidence((), None, seen["unreadable"].failure)
    assert "engy-activations-v9" in seen["unreadable"].failure
    assert [rid for rid, _ in challenger.asked] == ["rid-silent"], "nothing to open in an unreadable commitment"


async def test_an_answer_past_the_record_window_is_judged_by_toploc_alone(nursery, tmp_path):
    challenger = Challenger()
    late = dataclasses.replace(committed("late", COMMITMENT), created_at=time.time() - RECORD_WINDOW_S)
    _, seen = await judged_with(nursery, tmp_path, challenger, late)
    assert seen == {"late": None} and challenger.asked == [], "no challenge, no GEMM verdict"


@pytest.mark.parametrize(
    "audit_job, reason",
    [
        (job("a", model="qwen3.6-35b-a3b"), "model-not-verifiable"),
        (job("c", commitment={"model_root": 7}), "malformed-commitment"),
    ],
)
def test_the_judge_answers_unproven_for_what_it_cannot_judge(audit_job, reason, tmp_path):
    judge = Judge({"smollm2-135m": tmp_path / "never-loaded"})
    assert judge.judge(audit_job) == proof.Verdict("unproven", reason)
