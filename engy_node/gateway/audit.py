"""Audit jobs (SPEC §8.7): the proof material of sampled responses, in RAM, until a verifier
judges it.

Every response with a readable commitment is offered; `audited` decides which become jobs (all
probes, a configurable share of paid traffic). A verifier leases a batch, recomputes, and posts
a verdict per job; a lease that runs out before its verdict arrives makes the job leasable again,
so a verifier that dies mid-batch loses nothing, and a job leased `max_leases` times without a
verdict is dropped (it stays unjudged: `unproven` by absence, which never gates settlement, and
the same job failing every verifier is more likely a verifier bug than a miner's doing).

Buyer content never touches disk (SPEC §8.3), and token ids are buyer content, so the queue is
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
import re
from collections.abc import Mapping
from typing import Any, Literal

from engy_node.proof import Delivery, SamplingTerms
from engy_node.protocol.miner import Sampling

JobKind = Literal["paid", "probe"]


@dataclasses.dataclass(frozen=True, slots=True)
class AuditJob:
    """One response's proof material: what a verifier needs to judge it, and whose it is."""

    request_id: str
    """Also the job's id."""
    model: str
    miner: str
    """Miner identity at the gateway: its hotkey, or `key:<miner id>`. Never sent to verifiers:
    a verdict must not depend on who served."""
    kind: JobKind
    prompt_ids: tuple[int, ...]
    commitment: dict[str, Any]
    greedy: bool
    sampling: Sampling
    """How the request asked to be sampled, with the seed the gateway drew for it."""
    seeded: bool
    """The miner announced it samples deterministically from that seed: the verifier replays
    its draws (`proof.SamplingTerms.seed`) instead of the statistical test."""
    delivery: Delivery
    """What the buyer received and where the answer ended, which the proof must agree with."""
    created_at: float
    """Wall-clock seconds when the response ended; epochs count its verdict by this time."""
    found: tuple[str, str] | None = None
    """A verdict the gateway established itself, as (verdict, reason): the miner's usage claim
    contradicts its own commitment. Recorded at once, never leased to a verifier."""

    def sampling_terms(self) -> SamplingTerms | None:
        """The terms the token check replays; None for a greedy answer."""
        if self.greedy:
            return None
        temperature = self.sampling.temperature if self.sampling.temperature is not None else 1.0
        return SamplingTerms(
            temperature=temperature,
            top_p=self.sampling.top_p if self.sampling.top_p is not None else 1.0,
            seed=self.sampling.seed if self.seeded else None,
        )

    def to_wire(self, *, for_verifier: bool = False) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "job_id": self.request_id,
            "model": self.model,
            "kind": self.kind,
            "prompt_ids": list(self.prompt_ids),
            "commitment": self.commitment,
            "greedy": self.greedy,
            "sampling": {
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p,
                "seed": self.sampling.seed,
            },
            "seeded": self.seeded,
            "delivery": {
                "relayed_output_ids": list(self.delivery.relayed_output_ids),
                "ended_at_stop": self.delivery.ended_at_stop,
                "max_tokens": self.delivery.max_tokens,
                **({"defect": self.delivery.defect} if self.delivery.defect is not None else {}),
            },
            "created_at": self.created_at,
        }
        if for_verifier:
            del wire["kind"]  # a verifier judges a probe exactly as it judges paid traffic
        else:
            wire["miner"] = self.miner
            if self.found is not None:
                wire["found"] = list(self.found)
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> AuditJob:
        """Read a job back. Raises ValueError naming the field on anything malformed (the wire
        is our own, so that is a bug or a version mismatch, never a buyer's doing)."""
        try:
            sampling, delivery = wire["sampling"], wire["delivery"]
            return cls(
                request_id=_text(wire["job_id"], "job_id"),
                model=_text(wire["model"], "model"),
                miner=_text(wire.get("miner", ""), "miner", allow_empty=True),
                kind=_kind(wire.get("kind", "paid")),
                prompt_ids=_ids(wire["prompt_ids"], "prompt_ids"),
                commitment=_mapping(wire["commitment"], "commitment"),
                greedy=_flag(wire["greedy"], "greedy"),
                sampling=Sampling(
                    temperature=_number(sampling.get("temperature"), "sampling.temperature"),
                    top_p=_number(sampling.get("top_p"), "sampling.top_p"),
                    seed=_seed(sampling.get("seed")),
                ),
                seeded=_flag(wire["seeded"], "seeded"),
                delivery=Delivery(
                    relayed_output_ids=_ids(delivery["relayed_output_ids"], "delivery.relayed_output_ids"),
                    ended_at_stop=_flag(delivery["ended_at_stop"], "delivery.ended_at_stop"),
                    max_tokens=_uint(delivery["max_tokens"], "delivery.max_tokens"),
                    defect=_defect(delivery.get("defect")),
                ),
                created_at=float(_number(wire["created_at"], "created_at") or 0.0),
                found=_found(wire.get("found")),
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed audit job: {error!r}") from None


def _defect(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or DEFECT.fullmatch(value) is None:
        raise ValueError(f"delivery.defect must be a short code, got {value!r}")
    return value


DEFECT = re.compile(r"[a-z-]{1,40}")


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


def _found(value: Any) -> tuple[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or value[0] not in ("pass", "cheat", "unproven")
        or not isinstance(value[1], str)
        or not value[1]
    ):
        raise ValueError("malformed audit job: found must be [verdict, reason]")
    return value[0], value[1]


def _text(value: Any, field: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ValueError(f"malformed audit job: {field} must be a non-empty string")
    return value


def _kind(value: Any) -> JobKind:
    if value not in ("paid", "probe"):
        raise ValueError("malformed audit job: kind must be 'paid' or 'probe'")
    return value


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"malformed audit job: {field} must be true or false")
    return value


def _uint(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"malformed audit job: {field} must be an integer >= 0")
    return value


def _number(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"malformed audit job: {field} must be a number or null")
    return float(value)


def _seed(value: Any) -> int | None:
    return None if value is None else _uint(value, "sampling.seed")


def _ids(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"malformed audit job: {field} must be a list of token ids")
    return tuple(_uint(item, field) for item in value)


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"malformed audit job: {field} must be an object")
    return value
