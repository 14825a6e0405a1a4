"""The miner's client for an sglang server whose GEMM audit capture is armed (`gemm_capture`):
sglang's native API for generating, the capture's own loopback port for everything about
activation commitments.

sglang knows nothing of commitments: its ``/get_server_info`` names none, its ``/generate``
takes no ``return_gemm_commitment``, and its ``meta_info`` is built in a process the capture
does not run in. So this client, a `ServeClient` like any other to the rest of the miner:

* answers `gemm_support` from the capture's ``GET /gemm/info`` (a 409 there — a model the
  capture cannot hook, tp or dp above 1, a launch flag missing — or no answer at all raises
  `ServeError` with the fix, and the miner leaves GEMM audits off saying why);
* gives a generation that asks for a commitment rids starting with `gemm_capture.RID_PREFIX`
  (`rid_prefix`), the one thing about a request the capture sees, and sends ``/generate``
  without the fields sglang does not know;
* after each call of such a generation asks ``GET /gemm/commitment/{rid}?positions=N`` (N =
  the call's prompt + output − 1, the positions the reference server commits) and puts the
  answer where the reference server puts its own, ``meta_info.gemm_commitment``, so
  `ServeClient.generate` keeps the last call's exactly as it does for the reference server;
* opens challenges at the capture's ``POST /gemm/openings`` (`ServeClient.gemm_url`).

A commitment the capture refuses (a radix-cache prefix, a CUDA-graph step, a capture failure,
a record evicted before it was asked for) is logged with the capture's reason, and the answer
goes out without one: an audit must never fail an answer the buyer would otherwise get
(`engy_node.miner.gemm_audit`).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import trio

from engy_node.miner.sglang.gemm_capture import RID_PREFIX
from engy_node.serve.client import (
    LOAD_TIMEOUT_S,
    GemmSupport,
    ProgressCallback,
    ServeClient,
    ServeError,
    error_message,
    gemm_support_of,
    raise_for_status,
)

log = logging.getLogger("engy.miner.capture_client")

COMMIT_TIMEOUT_S = 60.0
"""How long a commitment may take: the capture hashes the record when asked (about 0.3 ms a
position for SmolLM2's 61 leaves on one CPU core; a few seconds for the longest record its store
holds), on a thread of sglang's busy process."""


class CapturingServeClient(ServeClient):
    """An sglang server at `base_url` with its capture's opening server at `capture_url`."""

    def __init__(
        self, base_url: str, http: httpx.AsyncClient, *, capture_url: str, request_timeout_s: float = 1800.0
    ) -> None:
        super().__init__(base_url, http, request_timeout_s=request_timeout_s)
        self.gemm_url = capture_url.rstrip("/")

    async def gemm_support(self) -> GemmSupport | None:
        """What the capture commits (``GET /gemm/info``). Raises `ServeError` saying why it
        commits nothing: its own reason and fix (a 409), or that it does not answer, which means
        sglang never armed it, and where sglang said why."""
        try:
            response = await self.http.get(f"{self.gemm_url}/gemm/info", timeout=LOAD_TIMEOUT_S)
        except httpx.HTTPError as error:
            raise ServeError(
                f"the GEMM capture at {self.gemm_url} does not answer ({type(error).__name__}): sglang did not arm "
                "it; its log says why after '[engy] GEMM capture not armed', or nothing if the capture_site folder "
                "was not on its PYTHONPATH with ENGY_GEMM_CAPTURE_PORT set to this port"
            ) from None
        if response.status_code >= 400:
            raise ServeError(
                f"the GEMM capture at {self.gemm_url} refuses: {error_message(response)}", status=response.status_code
            )
        return gemm_support_of(orjson.loads(response.content))

    def rid_prefix(self, rid_prefix: str | None, *, committing: bool) -> str:
        rids = super().rid_prefix(rid_prefix, committing=committing)
        # The capture records only the requests whose rid says so.
        return RID_PREFIX + rids.removeprefix("engy-") if committing else rids

    async def generate_once(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        rid: str,
        return_hidden_states: bool = True,
        return_gemm_commitment: bool = False,
        gemm_commit_from: int | None = None,
        stream: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """sglang's ``/generate``, then the capture's commitment for `rid` when asked.
        `gemm_commit_from` does not apply: with the radix cache off every record starts at 0."""
        if return_gemm_commitment and not rid.startswith(RID_PREFIX):
            raise ValueError(f"rid {rid!r}: the capture records only rids starting {RID_PREFIX!r}")
        result = await super().generate_once(
            input_ids,
            sampling_params,
            rid=rid,
            return_hidden_states=return_hidden_states,
            stream=stream,
            on_progress=on_progress,
        )
        if not return_gemm_commitment:
            return result
        meta = result.get("meta_info")
        if not isinstance(meta, dict):
            meta = result["meta_info"] = {}
        positions = len(input_ids) + len(result.get("output_ids") or ()) - 1
        committed = await self._commitment(rid, positions) if positions >= 1 else None
        if committed is not None:
            meta["gemm_commitment"] = committed
        return result

    async def _commitment(self, rid: str, positions: int) -> dict[str, Any] | None:
        url = f"{self.gemm_url}/gemm/commitment/{urllib.parse.quote(rid, safe='')}"
        try:
            with trio.fail_after(COMMIT_TIMEOUT_S):
                response = await self.http.get(url, params={"positions": positions}, timeout=None)
            raise_for_status(response)
            wire = orjson.loads(response.content)
        except trio.TooSlowError:
            log.warning("%s: the GEMM capture at %s did not commit within %.0f s", rid, self.gemm_url, COMMIT_TIMEOUT_S)
            return None
        except (httpx.HTTPError, ServeError, orjson.JSONDecodeError) as error:
            log.warning("%s: the GEMM capture at %s gave no commitment: %s", rid, self.gemm_url, error)
            return None
        if not isinstance(wire, dict) or not wire:
            log.warning("%s: the GEMM capture at %s answered a commitment that is not an object", rid, self.gemm_url)
            return None
        return wire
