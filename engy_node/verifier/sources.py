"""Where a verifier leases jobs and posts verdicts: a gateway's signed audit API
(`HttpAuditSource`, signed with the verifier's hotkey, which the gateway allow-lists), or every
host of a gateway fleet at once (`GatheredAuditSource`). Both are `protocol.audit.AuditSource`s;
a gateway running a verifier inside itself hands it its desk as one instead.

`open_gemm` asks for a GEMM challenge's openings through the same API; every way it can fail is
a `GemmOpeningFailed` carrying the gateway's code (or `UNREACHABLE`), because to the verifier
they all mean one thing: no openings, so the answer's GEMM audit is unproven.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import httpx

from engy_node import keys
from engy_node.protocol.audit import NOT_LEASED, UNREACHABLE, AuditJob, GemmOpeningFailed, LeasedJob, PostedVerdict
from engy_node.protocol.gemm import GemmPick

log = logging.getLogger("engy.verifier")

HTTP_TIMEOUT_S = 30.0


class AuditCallFailed(Exception):
    """The gateway did not take a call; the message says why (and the fix, where it is ours), and
    `code` is the gateway's error code when it answered one."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class HttpAuditSource:
    """A gateway's signed audit API (`provider_api.py`)."""

    def __init__(
        self, provider_url: str, *, keypair: Any, netuid: int, client: httpx.AsyncClient | None = None
    ) -> None:
        self.base = provider_url.rstrip("/")
        self.keypair = keypair
        self.netuid = netuid
        self.name = keypair.ss58_address
        self.client = client or httpx.AsyncClient(timeout=HTTP_TIMEOUT_S)

    async def lease(self, limit: int) -> list[LeasedJob]:
        body = await self._call("/api/subnet/v1/audit/lease", {"max_jobs": limit})
        jobs = []
        for wire in body.get("jobs") or []:
            try:
                jobs.append(LeasedJob(AuditJob.from_wire(wire), float(wire.get("lease_expires_in_s") or 0.0)))
            except ValueError as error:
                log.warning(
                    "skipped a leased job the gateway sent malformed (%s); it returns to the queue when its "
                    "lease runs out",
                    error,
                )
        return jobs

    async def post(self, verdicts: list[PostedVerdict]) -> None:
        await self._call("/api/subnet/v1/audit/verdicts", {"verdicts": [dataclasses.asdict(v) for v in verdicts]})

    async def open_gemm(self, job_id: str, picks: tuple[GemmPick, ...]) -> tuple[dict[str, Any], ...]:
        path = f"/api/subnet/v1/audit/jobs/{job_id}/gemm-openings"
        try:
            body = await self._call(path, {"picks": [pick.to_wire() for pick in picks]})
        except AuditCallFailed as failed:
            raise GemmOpeningFailed(failed.code or UNREACHABLE, str(failed)) from None
        openings = body.get("openings")
        if not isinstance(openings, list) or not all(isinstance(item, dict) for item in openings):
            raise GemmOpeningFailed(UNREACHABLE, f"{path} answered without a list of openings")
        return tuple(openings)

    async def _call(self, path: str, payload: dict) -> dict:
        import orjson

        raw = orjson.dumps(payload)
        headers = keys.signed_headers(self.keypair, self.netuid, "POST", path, raw, int(time.time()))
        try:
            response = await self.client.post(
                self.base + path, content=raw, headers={**headers, "content-type": "application/json"}
            )
        except httpx.HTTPError as error:
            raise AuditCallFailed(f"cannot reach {self.base} ({type(error).__name__}: {error})") from None
        if response.status_code != 200:
            code = None
            try:
                answered = response.json()["error"]
                message, code = answered["message"], answered.get("code")
            except (ValueError, KeyError, TypeError, AttributeError):
                message = response.text[:200]
            if response.status_code == 403:
                message += f"; ask the gateway operator to add {self.name} to gateway.verifiers"
            raise AuditCallFailed(
                f"{path} answered {response.status_code}: {message}", code=code if isinstance(code, str) else None
            )
        try:
            body = response.json()
        except ValueError:
            raise AuditCallFailed(f"{path} answered 200 with a body that is not JSON") from None
        if not isinstance(body, dict):
            raise AuditCallFailed(f"{path} answered 200 with a body that is not a JSON object")
        return body

    async def aclose(self) -> None:
        await self.client.aclose()


class GatheredAuditSource:
    """Every host of a gateway fleet: each host keeps the audit jobs of the responses it served
    (their proof material is buyer content and stays in that host's memory, docs/reliability.md), so a
    verifier gathers from all of them, and each verdict goes back to the host it leased from.

    A host that cannot be reached costs only its own jobs: the others are leased from as usual,
    and the call fails only when every host failed."""

    def __init__(self, sources: list[HttpAuditSource]) -> None:
        if not sources:
            raise ValueError("a gathered source needs at least one gateway")
        self.sources = sources
        self.name = sources[0].name
        self._from: dict[str, HttpAuditSource] = {}
        self._turn = 0

    async def lease(self, limit: int) -> list[LeasedJob]:
        jobs: list[LeasedJob] = []
        failures: list[str] = []
        # Start at a different host each call, so a small `limit` does not always go to the first.
        order = self.sources[self._turn :] + self.sources[: self._turn]
        self._turn = (self._turn + 1) % len(self.sources)
        for source in order:
            if len(jobs) >= limit:
                break
            try:
                leased = await source.lease(limit - len(jobs))
            except AuditCallFailed as error:
                failures.append(str(error))
                continue
            for job in leased:
                self._from[job.job.request_id] = source
            jobs += leased
        if len(failures) == len(self.sources):
            raise AuditCallFailed("; ".join(failures))
        for failure in failures:
            log.warning("leasing from one gateway host failed (%s); leasing from the others", failure)
        return jobs

    async def post(self, verdicts: list[PostedVerdict]) -> None:
        by_source: dict[int, tuple[HttpAuditSource, list[PostedVerdict]]] = {}
        for verdict in verdicts:
            source = self._from.pop(verdict.job_id, None)
            if source is None:
                log.warning("verdict on job %s, which no gateway host leased to this verifier; dropped", verdict.job_id)
                continue
            by_source.setdefault(id(source), (source, []))[1].append(verdict)
        for source, posted in by_source.values():
            await source.post(posted)

    async def open_gemm(self, job_id: str, picks: tuple[GemmPick, ...]) -> tuple[dict[str, Any], ...]:
        """Asked of the host the job was leased from (before its verdict is posted, which forgets it)."""
        source = self._from.get(job_id)
        if source is None:
            raise GemmOpeningFailed(NOT_LEASED, f"job {job_id} was leased from no gateway host of this verifier")
        return await source.open_gemm(job_id, picks)

    async def aclose(self) -> None:
        for source in self.sources:
            await source.aclose()
