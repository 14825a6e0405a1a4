"""Audit jobs (docs/trust.md, "Audit"): the proof material of sampled responses, in RAM, until a verifier
judges it.

Every response with a readable commitment is offered; `audited` decides which become jobs (all
probes, a configurable share of paid traffic). A verifier leases a batch, recomputes, and posts
a verdict per job; a lease that runs out before its verdict arrives makes the job leasable again,
so a verifier that dies mid-batch loses nothing, and a job leased `max_leases` times without a
verdict is dropped (it stays unjudged: `unproven` by absence, which never gates settlement, and
the same job failing every verifier is more likely a verifier bug than a miner's doing).

Buyer content never touches disk (docs/reliability.md, "Data"), and token ids are buyer content, so the queue is
memory only: bounded in jobs and in age, oldest dropped first. Losing jobs on restart is the
accepted cost. A recorded verdict removes its job at once: the material is needed for nothing
else.

With several gateway worker processes, each decides locally which of its responses to audit and
ships those jobs to the first process (`audit_link.py`), which holds the one queue the audit API
leases from. `AuditJob.to_wire` / `from_wire` are the format on both hops (worker to first
process, first process to verifier).

No clock reads and no randomness: `now` and the sampling draw come in with every call.
"""

from __future__ import annotations

import collections
import dataclasses

from engy_node.protocol.audit import AuditJob, JobKind


def audited(kind: JobKind, *, draw: float, paid_sample_pct: float) -> bool:
    """Whether a response becomes an audit job: every probe (qualification needs its verdict),
    and paid responses with probability `paid_sample_pct` / 100 (`draw` uniform in [0, 1))."""
    return kind == "probe" or draw * 100.0 < paid_sample_pct


@dataclasses.dataclass(slots=True)
class _Slot:
    job: AuditJob
    offered_at: float
    leases: int = 0
    leased_to: str | None = None
    lease_expires_at: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    job: AuditJob
    expires_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class QueueCounts:
    waiting: int
    leased: int
    dropped_full: int
    dropped_expired: int
    dropped_unjudged: int
    """Jobs leased `max_leases` times without a verdict."""


class AuditQueue:
    """The jobs waiting for a verifier, and those leased to one."""

    def __init__(
        self, *, lease_s: float = 120.0, ttl_s: float = 3600.0, max_jobs: int = 20_000, max_leases: int = 3
    ) -> None:
        if lease_s <= 0 or ttl_s <= 0 or max_jobs < 1 or max_leases < 1:
            raise ValueError(
                "the audit queue needs a positive lease time and TTL, room for a job, and at least one lease"
            )
        self.lease_s = lease_s
        self.ttl_s = ttl_s
        self.max_jobs = max_jobs
        self.max_leases = max_leases
        self._slots: collections.OrderedDict[str, _Slot] = collections.OrderedDict()
        self.dropped_full = 0
        self.dropped_expired = 0
        self.dropped_unjudged = 0

    def offer(self, job: AuditJob, *, now: float) -> None:
        self._expire(now)
        if job.request_id in self._slots:
            return
        self._slots[job.request_id] = _Slot(job, offered_at=now)
        while len(self._slots) > self.max_jobs:
            self._slots.popitem(last=False)
            self.dropped_full += 1

    def lease(self, verifier: str, *, limit: int, now: float) -> list[Lease]:
        """Up to `limit` jobs, oldest first, that nobody holds a live lease on."""
        self._expire(now)
        leases: list[Lease] = []
        for request_id in list(self._slots):
            if len(leases) >= limit:
                break
            slot = self._slots[request_id]
            if slot.leased_to is not None and slot.lease_expires_at > now:
                continue
            if slot.leases >= self.max_leases:
                del self._slots[request_id]
                self.dropped_unjudged += 1
                continue
            slot.leases += 1
            slot.leased_to = verifier
            slot.lease_expires_at = now + self.lease_s
            leases.append(Lease(slot.job, slot.lease_expires_at))
        return leases

    def holder(self, request_id: str, *, now: float) -> tuple[AuditJob, str | None] | None:
        """The job and who holds its lease (None: nobody, or the lease ran out), or None for a
        job the queue does not have."""
        self._expire(now)
        slot = self._slots.get(request_id)
        if slot is None:
            return None
        live = slot.leased_to is not None and slot.lease_expires_at > now
        return slot.job, slot.leased_to if live else None

    def was_leased_to(self, request_id: str, verifier: str) -> bool:
        """`verifier` leased this job last, even if the lease has since run out: its verdict is
        still welcome while nobody else holds the job."""
        slot = self._slots.get(request_id)
        return slot is not None and slot.leased_to == verifier

    def finish(self, request_id: str) -> AuditJob | None:
        """Its verdict is recorded: forget the job and its material."""
        slot = self._slots.pop(request_id, None)
        return None if slot is None else slot.job

    def counts(self, *, now: float) -> QueueCounts:
        self._expire(now)
        leased = sum(1 for slot in self._slots.values() if slot.leased_to is not None and slot.lease_expires_at > now)
        return QueueCounts(
            waiting=len(self._slots) - leased,
            leased=leased,
            dropped_full=self.dropped_full,
            dropped_expired=self.dropped_expired,
            dropped_unjudged=self.dropped_unjudged,
        )

    def __len__(self) -> int:
        return len(self._slots)

    def _expire(self, now: float) -> None:
        while self._slots:
            oldest = next(iter(self._slots.values()))
            if now - oldest.offered_at < self.ttl_s:
                break
            self._slots.popitem(last=False)
            self.dropped_expired += 1
