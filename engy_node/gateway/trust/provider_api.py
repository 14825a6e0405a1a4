"""The provider API (docs/trust.md, "Provider API"): published epochs for validators, the signed audit API for
verifiers, and the validators' signed heartbeats.

It has a port of its own (`gateway.provider_port`), served by the gateway's first process only:
that process holds the audit queue and closes the epochs, and the buyer port's connections are
spread over every worker process by the kernel, so a request there could land anywhere.

Routes (under `/api/subnet/v1`):

* `GET epoch/latest`, `GET epoch/{index}`: the signed payload exactly as published (the same bytes
  on every request and after a restart: they are stored, never rebuilt); 404 before the first.
* `GET epoch/current`: the epoch in progress, settled so far, unsigned (`"final": false`).
* `POST audit/lease` `{"max_jobs": n}` → `{"jobs": [...], "lease_s": s}`; `POST audit/verdicts`
  `{"verdicts": [{"job_id", "verdict", "reason"}]}` → `{"results": [{"job_id", "status"}]}`.
  Signed (`keys.api_message`) by a hotkey on the verifier allow-list; the rules are `audit_desk.py`'s.
* `POST audit/jobs/{job_id}/gemm-openings` `{"picks": [{"position", "layer", "group"}]}` →
  `{"openings": [...]}`: the miner's openings for a job the caller holds, relayed over its leg
  (`AuditDesk.open_gemm`), or an error whose code says why there are none (`no_opening`,
  `leg_gone`, `no_commitment`, `not_leased`). Signed like the calls above.
* `POST validator/heartbeat` `{"v": 1, "version", "synced_epoch", "consensus": {"epoch_index",
  "digest"}}`, signed by any hotkey; the latest per hotkey is kept, for at most
  `MAX_HEARTBEAT_VALIDATORS` hotkeys (a signature proves a key, not a registration, and keys
  are free to make).

Errors are `{"error": {"code", "message"}}` with the HTTP status that fits: 400 malformed, 401 a
missing, stale, replayed or wrong signature (the check's reason is the code), 403 a hotkey not on
the allow-list, 404 unknown, 409 a conflicting verdict or lease (or a job with nothing to open),
410 the miner's connection gone, 413 a body over `MAX_BODY_BYTES`, 502 a miner that did not
open its activations in time. A refused request changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engy_node import keys
from engy_node.gateway.store import Store, ValidatorHeartbeat
from engy_node.gateway.store.checks import DIGEST, VERSION
from engy_node.gateway.trust.audit_desk import AuditDesk, parse_verdicts
from engy_node.protocol.audit import AuditRefused
from engy_node.protocol.fields import ProtocolError
from engy_node.protocol.gemm import parse_picks

log = logging.getLogger("engy.gateway.provider")

PREFIX = "/api/subnet/v1"
MAX_BODY_BYTES = 64 * 1024
"""A verdict batch of the largest size is a few kilobytes, a GEMM challenge's picks (about 100
for the default audit plan) as much; nothing legitimate comes near this."""
MAX_HEARTBEAT_VALIDATORS = 256
"""Distinct validator hotkeys whose heartbeats are kept; a subnet has at most 64 validators."""


class ProviderApi:
    def __init__(
        self,
        *,
        desk: AuditDesk | None,
        store: Store,
        netuid: int,
        verifiers: frozenset[str],
        current_epoch: Callable[[], Awaitable[dict]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.desk = desk
        """None: this gateway keeps no audit queue (its audit API then answers 404)."""
        self.store = store
        self.netuid = netuid
        self.verifiers = verifiers
        self.current_epoch = current_epoch
        self.clock = clock
        self.replay = keys.ReplayGuard()

    # ---- epochs ----------------------------------------------------------------------------
    async def latest(self, request: Request) -> Response:
        found = await self.store.run(self.store.latest_epoch)
        if found is None:
            return _error(404, "no_epoch", "no epoch has been published yet")
        return Response(found[1], media_type="application/json")

    async def by_index(self, request: Request) -> Response:
        text = request.path_params["index"]
        if not text.isdigit() or len(text) > 12:
            return _error(400, "invalid_request", "the epoch index must be a whole number")
        payload = await self.store.run(self.store.epoch_payload, int(text))
        if payload is None:
            return _error(404, "no_epoch", f"epoch {int(text)} has not been published")
        return Response(payload, media_type="application/json")

    async def current(self, request: Request) -> Response:
        return JSONResponse(await self.current_epoch())

    # ---- the audit API ---------------------------------------------------------------------
    async def lease(self, request: Request) -> Response:
        try:
            desk, verifier, body = await self._verifier_call(request)
            leases = desk.lease(verifier, limit=body.get("max_jobs", 1))
        except AuditRefused as refused:
            return _refused(refused)
        now = self.clock()
        if leases:
            log.debug("leased %d audit job(s) to %s", len(leases), verifier)
        return JSONResponse(
            {
                "jobs": [
                    {**lease.job.to_wire(for_verifier=True), "lease_expires_in_s": round(lease.expires_at - now, 3)}
                    for lease in leases
                ],
                "lease_s": desk.queue.lease_s,
            }
        )

    async def verdicts(self, request: Request) -> Response:
        try:
            desk, verifier, body = await self._verifier_call(request)
            results = await desk.submit(verifier, parse_verdicts(body))
        except AuditRefused as refused:
            return _refused(refused)
        return JSONResponse({"results": [{"job_id": job_id, "status": status} for job_id, status in results]})

    async def gemm_openings(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        try:
            desk, verifier, body = await self._verifier_call(request)
            try:
                picks = parse_picks(body.get("picks"), "picks")
            except ProtocolError as error:
                raise AuditRefused(400, "invalid_request", str(error)) from None
            openings = await desk.open_gemm(verifier, job_id, picks)
        except AuditRefused as refused:
            return _refused(refused)
        return JSONResponse({"openings": list(openings)})

    async def _verifier_call(self, request: Request) -> tuple[AuditDesk, str, dict]:
        """The desk, the verifier and the body of a signed call to the audit API."""
        if self.desk is None:
            raise AuditRefused(404, "no_audit", "this gateway runs no audit queue")
        hotkey, body = await self._signed(request)
        if hotkey not in self.verifiers:
            raise AuditRefused(
                403,
                "not_a_verifier",
                f"hotkey {hotkey} is not on this gateway's verifier allow-list (gateway.verifiers)",
            )
        return self.desk, hotkey, body

    # ---- validator heartbeats --------------------------------------------------------------
    async def heartbeat(self, request: Request) -> Response:
        try:
            hotkey, body = await self._signed(request)
            beat = _heartbeat(hotkey, body, received_at=self.clock())
            known = {existing.hotkey for existing in await self.store.run(self.store.validator_heartbeats)}
            if hotkey not in known and len(known) >= MAX_HEARTBEAT_VALIDATORS:
                raise AuditRefused(
                    429, "too_many_validators", f"heartbeats are kept for {MAX_HEARTBEAT_VALIDATORS} validators at most"
                )
            await self.store.run(self.store.record_heartbeat, beat)
        except AuditRefused as refused:
            return _refused(refused)
        return JSONResponse({"ok": True})

    async def _signed(self, request: Request) -> tuple[str, dict]:
        """The proven signer and the JSON body of a signed request (`keys.check_signed_request`)."""
        raw = await _read_capped(request)
        check = keys.check_signed_request(
            headers=request.headers,
            netuid=self.netuid,
            method=request.method,
            path=request.url.path,
            body=raw,
            now=int(self.clock()),
            replay=self.replay,
        )
        if not check.ok:
            raise AuditRefused(
                401,
                check.reason,
                f"signature check failed ({check.reason}); sign "
                f"engy-sn53:api:v1:{self.netuid}:METHOD:PATH:TS:SHA256(BODY) with the hotkey in "
                f"{keys.HEADER_HOTKEY}, within {keys.SIGNATURE_WINDOW_S} s of now, once",
            )
        try:
            body = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError as error:
            raise AuditRefused(400, "invalid_request", f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise AuditRefused(400, "invalid_request", "the body must be a JSON object")
        assert check.hotkey is not None, "a check that is ok names the proven signer (`SignatureCheck`)"
        return check.hotkey, body

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


def build_provider_app(api: ProviderApi) -> Starlette:
    return Starlette(
        routes=[
            Route(f"{PREFIX}/epoch/latest", api.latest, methods=["GET"]),
            Route(f"{PREFIX}/epoch/current", api.current, methods=["GET"]),
            Route(f"{PREFIX}/epoch/{{index}}", api.by_index, methods=["GET"]),
            Route(f"{PREFIX}/audit/lease", api.lease, methods=["POST"]),
            Route(f"{PREFIX}/audit/verdicts", api.verdicts, methods=["POST"]),
            Route(f"{PREFIX}/audit/jobs/{{job_id}}/gemm-openings", api.gemm_openings, methods=["POST"]),
            Route(f"{PREFIX}/validator/heartbeat", api.heartbeat, methods=["POST"]),
            Route("/health", api.health, methods=["GET"]),
        ],
        exception_handlers={404: _not_found, 405: _not_allowed},
    )


async def _read_capped(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise AuditRefused(413, "request_too_large", f"the body exceeds {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise AuditRefused(413, "request_too_large", f"the body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _heartbeat(hotkey: str, body: dict, *, received_at: float) -> ValidatorHeartbeat:
    version = body.get("version") or "unknown"
    synced = body.get("synced_epoch")
    consensus = body.get("consensus") or {}
    if not isinstance(version, str) or VERSION.fullmatch(version) is None:
        raise AuditRefused(
            400, "invalid_request", "version must be a version such as 0.4.1 or engy-lv 0.4.4 (at most one space)"
        )
    if synced is not None and not _uint(synced):
        raise AuditRefused(400, "invalid_request", "synced_epoch must be an epoch index or null")
    if not isinstance(consensus, dict):
        raise AuditRefused(400, "invalid_request", 'consensus must be {"epoch_index", "digest"} or null')
    epoch_index, digest = consensus.get("epoch_index"), consensus.get("digest")
    if epoch_index is not None and not _uint(epoch_index):
        raise AuditRefused(400, "invalid_request", "consensus.epoch_index must be an epoch index")
    if digest is not None and (not isinstance(digest, str) or DIGEST.fullmatch(digest) is None):
        raise AuditRefused(400, "invalid_request", "consensus.digest must be 64 lowercase hex digits")
    return ValidatorHeartbeat(
        hotkey=hotkey,
        version=version,
        synced_epoch=synced,
        consensus_epoch=epoch_index,
        consensus_digest=digest,
        received_at=received_at,
    )


def _uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _refused(refused: AuditRefused) -> JSONResponse:
    return _error(refused.status, refused.code, refused.message)


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(404, "not_found", f"no route {request.url.path}; the provider API lives under {PREFIX}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")
