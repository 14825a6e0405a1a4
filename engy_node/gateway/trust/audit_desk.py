"""The audit desk: where verifiers lease jobs and hand in verdicts, whoever they are.

One desk per gateway, in its first process, over the one `AuditQueue`. The signed audit API
(`provider_api.py`) and a verifier running inside the gateway (`DeskAuditSource`, local networks)
both come through here, so the rules are the same for both:

* a verdict is taken only for a job the verifier leased (its lease may have run out, as long as
  nobody else has leased the job since: the work is done, and throwing it away helps nobody);
* a batch of verdicts is all or nothing: every verdict is checked first, and one that cannot be
  taken (unknown job, judged already with another verdict, leased to someone else, a job named
  twice) refuses the whole batch, so a verifier never has to work out which half landed;
* the same verdict posted again for a job already judged is acknowledged as a duplicate and
  changes nothing (a verifier retrying after a lost response is normal), while a different
  verdict for it is refused: a verdict is final;
* a recorded verdict is durable (the store's `verdicts` table, per request and per miner) before
  the job's proof material is dropped, and the traffic control plane hears of it at once.

A job the gateway judged itself (`AuditJob.found`: a usage claim that contradicts the miner's own
commitment) is recorded by the desk's `run` task under the name `gateway`, never leased.

A verifier may also ask for the GEMM openings of a job it holds (`open_gemm`, issue 32): the
desk relays its picks to the miner over the leg that served the answer (`MinerPool.challenge`)
and hands back what the miner sent, unread, or why nothing came (`protocol.audit`'s codes). With
`gateway.workers` > 1 the answer may have been served by another process, but a miner opens one
leg to every process under the same leg id, so this process's own pool has it.

Who served a job never reaches a verifier (`AuditJob.to_wire(for_verifier=True)`), and the
verdict is filed under the miner the gateway recorded, never one a verifier names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import trio

from engy_node.gateway.store import Store, StoreError, VerdictRecord
from engy_node.gateway.store.checks import CODE
from engy_node.gateway.trust.audit import AuditQueue, Lease
from engy_node.protocol.audit import (
    LEG_GONE,
    LOCAL_VERIFIER,
    NO_COMMITMENT,
    NO_OPENING,
    NOT_LEASED,
    TOO_LATE,
    AuditJob,
    AuditRefused,
    GemmOpeningFailed,
    LeasedJob,
    PostedVerdict,
    VerdictKind,
)
from engy_node.protocol.gemm import RECORD_WINDOW_S, GemmPick

log = logging.getLogger("engy.gateway.audit")

MAX_BATCH = 64
"""Most jobs leased, or verdicts posted, in one call."""
GATEWAY_VERIFIER = "gateway"
"""The name verdicts the gateway established itself are filed under."""
FOUND_QUEUE = 10_000
OPENING_STATUS = {LEG_GONE: 410, NO_OPENING: 502, TOO_LATE: 410}
"""The audit API's status for a challenge that got no openings: the miner's connection is gone
(410), or the miner failed to answer it (502, as a gateway whose upstream failed); an answer
past the miner's record window is gone too (410)."""


class Challenger(Protocol):
    """`MinerPool.challenge`: relay picks to the miner on a leg, raising `GemmOpeningFailed`
    when no openings come back."""

    def __call__(
        self, leg_id: str, rid: str, picks: tuple[GemmPick, ...], *, timeout_s: float
    ) -> Awaitable[tuple[dict[str, Any], ...]]: ...


class AuditDesk:
    def __init__(
        self,
        *,
        queue: AuditQueue,
        store: Store,
        clock: Callable[[], float] = time.time,
        on_verdict: Callable[[AuditJob, VerdictKind], None] = lambda job, verdict: None,
        challenge: Challenger | None = None,
        opening_timeout_s: float = 20.0,
    ) -> None:
        self.queue = queue
        self.store = store
        self.clock = clock
        self.on_verdict = on_verdict
        self.challenge = challenge
        """How GEMM challenges reach miners (this process's pool); None: none are relayed."""
        self.opening_timeout_s = opening_timeout_s
        """How long a miner has to answer one (`gateway.gemm_opening_timeout_s`)."""
        self.recorded = 0
        self._found_in, self._found_out = trio.open_memory_channel[AuditJob](FOUND_QUEUE)

    def offer(self, job: AuditJob) -> None:
        if job.found is None:
            self.queue.offer(job, now=self.clock())
            return
        try:
            self._found_in.send_nowait(job)
        except trio.WouldBlock:
            log.error(
                "job %s: the gateway's own verdict (%s) was dropped: the store is not keeping up",
                job.request_id,
                job.found[1],
            )

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Record the verdicts the gateway established itself."""
        task_status.started()
        async for job in self._found_out:
            assert job.found is not None, "`offer` sends only the jobs the gateway judged itself here"
            verdict, reason = job.found
            try:
                outcome = await self.store.run(
                    self.store.record_verdict,
                    VerdictRecord(
                        request_id=job.request_id,
                        miner=job.miner,
                        model=job.model,
                        kind=job.kind,
                        verdict=verdict,
                        reason=reason,
                        verifier=GATEWAY_VERIFIER,
                        request_created_at=job.created_at,
                        judged_at=self.clock(),
                    ),
                )
            except StoreError as error:
                log.error("job %s: could not record the gateway's verdict %s (%s)", job.request_id, verdict, error)
                continue
            if outcome == "recorded":
                self.recorded += 1
                log.warning(
                    "job %s (%s by %s): %s (%s), established by the gateway",
                    job.request_id,
                    job.model,
                    job.miner,
                    verdict,
                    reason,
                )
                self.on_verdict(job, verdict)

    def lease(self, verifier: str, *, limit: int) -> list[Lease]:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_BATCH:
            raise AuditRefused(400, "invalid_request", f"max_jobs must be an integer from 1 to {MAX_BATCH}")
        return self.queue.lease(verifier, limit=limit, now=self.clock())

    async def open_gemm(self, verifier: str, job_id: str, picks: tuple[GemmPick, ...]) -> tuple[dict[str, Any], ...]:
        """The miner's openings of `picks` for a job `verifier` holds, relayed over the leg that
        served it within `opening_timeout_s`. `AuditRefused` when the desk will not ask (the job
        is not this verifier's, or has no commitment) or no openings came back (`LEG_GONE`,
        `NO_OPENING`), its code saying which."""
        held = self.queue.holder(job_id, now=self.clock())
        if held is None:
            raise AuditRefused(404, "unknown_job", f"job {job_id} is not waiting for a verdict here")
        job, holder = held
        if holder != verifier and not (holder is None and self.queue.was_leased_to(job_id, verifier)):
            raise AuditRefused(409, NOT_LEASED, f"job {job_id} is not leased to you: lease it first")
        if job.gemm_commitment is None or job.gemm_rid is None:
            raise AuditRefused(409, NO_COMMITMENT, f"job {job_id} carries no GEMM commitment to open")
        if self.challenge is None:
            raise AuditRefused(410, LEG_GONE, "this gateway relays no GEMM challenges")
        age = self.clock() - job.created_at
        if age > RECORD_WINDOW_S - self.opening_timeout_s:
            raise AuditRefused(
                410,
                TOO_LATE,
                f"job {job_id} answered {age:.0f} s ago: a miner keeps its record {RECORD_WINDOW_S:.0f} s, so "
                "judge it by TOPLOC alone (a verifier that keeps up leases sooner)",
            )
        try:
            openings = await self.challenge(job.leg_id, job.gemm_rid, picks, timeout_s=self.opening_timeout_s)
        except GemmOpeningFailed as failed:
            log.info("job %s (%s): no GEMM openings for %s (%s)", job_id, job.miner, verifier, failed.message)
            raise AuditRefused(OPENING_STATUS.get(failed.code, 502), failed.code, failed.message) from None
        log.debug("job %s (%s): relayed %d GEMM openings to %s", job_id, job.miner, len(openings), verifier)
        return openings

    async def submit(self, verifier: str, verdicts: Sequence[PostedVerdict]) -> list[tuple[str, str]]:
        """Take a batch of verdicts: `(job_id, "recorded" | "duplicate")` for each, or
        `AuditRefused` with nothing changed."""
        if not 1 <= len(verdicts) <= MAX_BATCH:
            raise AuditRefused(400, "invalid_request", f"post 1 to {MAX_BATCH} verdicts at a time")
        now = self.clock()
        seen: set[str] = set()
        plan: list[tuple[PostedVerdict, AuditJob | None]] = []
        for posted in verdicts:
            if posted.job_id in seen:
                raise AuditRefused(400, "invalid_request", f"job {posted.job_id} appears twice in the batch")
            seen.add(posted.job_id)
            held = self.queue.holder(posted.job_id, now=now)
            if held is None:
                earlier = await self.store.run(self.store.verdict, posted.job_id)
                if earlier is None:
                    raise AuditRefused(
                        404,
                        "unknown_job",
                        f"job {posted.job_id} is not waiting for a verdict here "
                        "(never offered, or expired); nothing was recorded",
                    )
                if (earlier.verdict, earlier.reason) != (posted.verdict, posted.reason):
                    raise AuditRefused(
                        409,
                        "already_judged",
                        f"job {posted.job_id} was already judged "
                        f"{earlier.verdict} ({earlier.reason}); a verdict is final, nothing was recorded",
                    )
                plan.append((posted, None))
                continue
            waiting, holder = held
            if holder is not None and holder != verifier:
                raise AuditRefused(
                    409, "leased_elsewhere", f"job {posted.job_id} is leased to another verifier; nothing was recorded"
                )
            if holder is None and not self.queue.was_leased_to(posted.job_id, verifier):
                raise AuditRefused(
                    409, "not_leased", f"job {posted.job_id} is not leased to you: lease it first; nothing was recorded"
                )
            plan.append((posted, waiting))
        results = []
        for posted, job in plan:
            if job is None:
                results.append((posted.job_id, "duplicate"))
                continue
            outcome = await self.store.run(
                self.store.record_verdict,
                VerdictRecord(
                    request_id=job.request_id,
                    miner=job.miner,
                    model=job.model,
                    kind=job.kind,
                    verdict=posted.verdict,
                    reason=posted.reason,
                    verifier=verifier,
                    request_created_at=job.created_at,
                    judged_at=now,
                ),
            )
            self.queue.finish(job.request_id)
            if outcome == "conflict":
                # Only this process writes verdicts, so this is another gateway on the same file.
                log.error("job %s: a different verdict was already stored; kept that one", job.request_id)
                results.append((posted.job_id, "duplicate"))
                continue
            self.recorded += 1
            log.log(
                logging.WARNING if posted.verdict == "cheat" else logging.DEBUG,
                "job %s (%s, %s by %s): %s (%s) from %s",
                job.request_id,
                job.kind,
                job.model,
                job.miner,
                posted.verdict,
                posted.reason,
                verifier,
            )
            self.on_verdict(job, posted.verdict)
            results.append((posted.job_id, "recorded"))
        return results


def parse_verdicts(body: object) -> list[PostedVerdict]:
    """`{"verdicts": [{"job_id", "verdict", "reason"}, …]}` from a verifier; AuditRefused(400)
    naming the field on anything else."""
    if not isinstance(body, dict) or not isinstance(body.get("verdicts"), list):
        raise AuditRefused(
            400, "invalid_request", 'the body must be {"verdicts": [{"job_id", "verdict", "reason"}, …]}'
        )
    parsed = []
    for index, item in enumerate(body["verdicts"]):
        where = f"verdicts[{index}]"
        if not isinstance(item, dict):
            raise AuditRefused(400, "invalid_request", f"{where} must be an object")
        job_id, verdict, reason = item.get("job_id"), item.get("verdict"), item.get("reason")
        if not isinstance(job_id, str) or not 1 <= len(job_id) <= 128:
            raise AuditRefused(400, "invalid_request", f"{where}.job_id must be the job's id")
        if verdict not in ("pass", "cheat", "unproven"):
            raise AuditRefused(400, "invalid_request", f"{where}.verdict must be pass, cheat or unproven")
        # A verdict's reason is a short code (`proof.Verdict.reason`), never free text: the store's own rule.
        if not isinstance(reason, str) or CODE.fullmatch(reason) is None:
            raise AuditRefused(
                400, "invalid_request", f"{where}.reason must be a short code ([A-Za-z0-9_.:+-], at most 128)"
            )
        parsed.append(PostedVerdict(job_id, verdict, reason))
    return parsed


class DeskAuditSource:
    """The desk as a verifier's `AuditSource`, in process: what a gateway hands the verifier it
    runs inside itself (`gateway.local_verifier`)."""

    name = LOCAL_VERIFIER

    def __init__(self, desk: AuditDesk) -> None:
        self.desk = desk

    async def lease(self, limit: int) -> list[LeasedJob]:
        now = self.desk.clock()
        return [LeasedJob(lease.job, lease.expires_at - now) for lease in self.desk.lease(LOCAL_VERIFIER, limit=limit)]

    async def post(self, verdicts: list[PostedVerdict]) -> None:
        await self.desk.submit(LOCAL_VERIFIER, verdicts)

    async def open_gemm(self, job_id: str, picks: tuple[GemmPick, ...]) -> tuple[dict[str, Any], ...]:
        try:
            return await self.desk.open_gemm(LOCAL_VERIFIER, job_id, picks)
        except AuditRefused as refused:
            raise GemmOpeningFailed(refused.code, refused.message) from None
