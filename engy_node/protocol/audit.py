"""The audit protocol between a gateway and its verifiers: the job a verifier leases, the
verdict it posts back, and the `AuditSource` a verifier leases through.

A job may carry a GEMM commitment (`protocol.gemm`, issue 32): the verifier then draws rows to
open from a secret of its own and asks the gateway for them (`AuditSource.open_gemm`), which
relays the challenge to the miner over the leg that served the answer. Which leg that was, and
the id the miner filed its record under, stay with the gateway: the verifier sees the commitment
and whether one was asked for, no more.

Both sides of the audit import this and nothing of each other: the gateway's audit desk
(`engy_node.gateway.trust.audit_desk`) serves jobs over the signed provider API or in process
(`DeskAuditSource`), and the verifier role (`engy_node.verifier`) judges whatever an
`AuditSource` leases it. `AuditJob.to_wire` / `from_wire` is the format on every hop (gateway
worker to first process, first process to verifier). Pure data and parsing: no IO.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol

from engy_node.logit_stats import SamplingTerms
from engy_node.proof import Delivery, VerdictKind
from engy_node.protocol.gemm import GemmPick
from engy_node.protocol.miner import Sampling

JobKind = Literal["paid", "probe"]
LOCAL_VERIFIER = "local"
"""The name a verifier running inside the gateway leases and files its verdicts under."""


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
    its draws (`SamplingTerms.seed`) instead of the statistical test."""
    delivery: Delivery
    """What the buyer received and where the answer ended, which the proof must agree with."""
    created_at: float
    """Wall-clock seconds when the response ended; epochs count its verdict by this time."""
    found: tuple[VerdictKind, str] | None = None
    """A verdict the gateway established itself, as (verdict, reason): the miner's usage claim
    contradicts its own commitment. Recorded at once, never leased to a verifier."""
    gemm_asked: bool = False
    """The gateway asked the miner to commit its activations (it announced `FEATURE_GEMM`): a
    verifier that then finds no `gemm_commitment` judges the answer unproven."""
    gemm_commitment: dict[str, Any] | None = None
    """The miner's activation commitment (`gemm.activations.Commitment` wire), without its rid."""
    gemm_rid: str | None = None
    """The id the miner's serve filed the activations under, which a challenge names. Never sent
    to verifiers: it is the miner's business, and the gateway's to relay."""
    leg_id: str = ""
    """The pool leg that served the answer, over which a challenge goes. Never sent to verifiers."""

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
        gemm: dict[str, Any] = {"asked": self.gemm_asked, "commitment": self.gemm_commitment}
        if for_verifier:
            del wire["kind"]  # a verifier judges a probe exactly as it judges paid traffic
        else:
            wire["miner"] = self.miner
            wire["leg_id"] = self.leg_id
            gemm["rid"] = self.gemm_rid
            if self.found is not None:
                wire["found"] = list(self.found)
        if self.gemm_asked or any(value is not None for key, value in gemm.items() if key != "asked"):
            wire["gemm"] = gemm  # a job from a miner never asked reads as it did before GEMM audits
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> AuditJob:
        """Read a job back. Raises ValueError naming the field on anything malformed (the wire
        is our own, so that is a bug or a version mismatch, never a buyer's doing)."""
        try:
            sampling, delivery = wire["sampling"], wire["delivery"]
            gemm = _gemm(wire.get("gemm"))
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
                gemm_asked=_flag(gemm.get("asked", False), "gemm.asked"),
                gemm_commitment=_optional_mapping(gemm.get("commitment"), "gemm.commitment"),
                gemm_rid=_optional_text(gemm.get("rid"), "gemm.rid"),
                leg_id=_text(wire.get("leg_id", ""), "leg_id", allow_empty=True),
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed audit job: {error!r}") from None


def _gemm(value: Any) -> Mapping[str, Any]:
    """The job's ``gemm`` object: ``{"asked", "commitment"}`` (and ``"rid"`` between gateway
    processes). Absent or null in a job from before GEMM audits, which reads as never asked."""
    if value is None:
        return {}
    return _mapping(value, "gemm")


def _optional_mapping(value: Any, field: str) -> dict[str, Any] | None:
    return None if value is None else _mapping(value, field)


def _optional_text(value: Any, field: str) -> str | None:
    return None if value is None else _text(value, field)


def _defect(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or DEFECT.fullmatch(value) is None:
        raise ValueError(f"delivery.defect must be a short code, got {value!r}")
    return value


DEFECT = re.compile(r"[a-z-]{1,40}")


def _found(value: Any) -> tuple[VerdictKind, str] | None:
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


class AuditRefused(Exception):
    """A lease or verdict batch the desk will not take; `status` is the HTTP status to answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class PostedVerdict:
    job_id: str
    verdict: VerdictKind
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class LeasedJob:
    job: AuditJob
    expires_in_s: float


class GemmOpeningFailed(Exception):
    """No openings came back for a job's GEMM challenge. `code` says why, for the verifier's log
    and its tests (`NO_OPENING`, `NOT_LEASED`, `NO_COMMITMENT`, `LEG_GONE`, `TOO_LATE`, or the audit API's
    code for anything else it refused; `UNREACHABLE` when the gateway could not be asked)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


NO_OPENING = "no_opening"
"""The miner answered the challenge with an error, or not within `gateway.gemm_opening_timeout_s`."""
NOT_LEASED = "not_leased"
"""The job is not leased to the verifier asking."""
NO_COMMITMENT = "no_commitment"
"""The job carries no GEMM commitment to open."""
LEG_GONE = "leg_gone"
"""The miner's connection that served the answer is gone from this gateway."""
TOO_LATE = "too_late"
"""The answer is older than the miner must keep its record (`protocol.gemm.RECORD_WINDOW_S`, less
the time a challenge may take): the verifier judges it by TOPLOC alone."""
UNREACHABLE = "unreachable"
"""The verifier could not reach the gateway, or could not read its answer."""


class AuditSource(Protocol):
    """Where jobs come from and verdicts go."""

    name: str

    async def lease(self, limit: int) -> list[LeasedJob]: ...

    async def post(self, verdicts: list[PostedVerdict]) -> None: ...

    async def open_gemm(self, job_id: str, picks: tuple[GemmPick, ...]) -> tuple[dict[str, Any], ...]:
        """The miner's openings (`gemm.activations.Opening` wires, unread) of these rows of a
        leased job's GEMM commitment. Raises `GemmOpeningFailed` saying why there are none."""
        ...


LocalVerifier = Callable[..., Awaitable[None]]
"""`(source: AuditSource, checkpoints: Mapping[str, Path], *, task_status)`: a verifier judging
`source`'s jobs on those checkpoints, started in a nursery. The node hands the gateway one
(`engy_node.verifier.role.run_local_verifier`) for `gateway.local_verifier`, so the gateway
runs a verifier without importing the verifier role."""
