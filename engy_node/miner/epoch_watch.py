"""The miner's own newest epoch, read from its gateway, so a zeroed miner is told why.

Settlement zeroes a (miner, model) row for the whole epoch when a gate fails (docs/trust.md,
"Settlement"): its TTFT p99 over the model's ceiling after a cold restart, say. The miner's
incentive then drops to 0 and nothing on the miner's machine said why. This task asks the
gateway it already dials (`GET /gw/epoch/latest?hotkey=`, beside `/gw/meta`: no other URL to
configure, so a remote miner behind NAT sees it too) and publishes the answer, explained by
`engy_node.protocol.gates`, as the miner state's `epoch`: which gate, the measurement against
its bar, and when the next epoch ends and is published.

Failure posture: this is a display. A failed look is published as the epoch's `error` (keeping
the last good answer's fields) and retried at the next poll; it never touches serving. A result
changes once per epoch, so polling is slow: a quarter of the epoch's length, between
`MIN_POLL_S` and `MAX_POLL_S`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx
import trio

from engy_node.hub import Hub
from engy_node.protocol.gates import MinerEpoch, miner_epoch

log = logging.getLogger("engy.miner.epoch")

MIN_POLL_S = 5.0
MAX_POLL_S = 300.0
FIRST_POLL_S = 30.0
"""Between looks until an answer tells the epoch's length."""
TIMEOUT_S = 20.0
"""One look, connect to body."""
NO_ROUTE = "this gateway does not tell miners their epochs (an engy-node gateway older than this miner?)"


def epoch_url(gateway_url: str, hotkey: str) -> str:
    """`wss://host/gw` → `https://host/gw/epoch/latest?hotkey=…`."""
    parts = urlsplit(gateway_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/") + "/epoch/latest"
    return urlunsplit((scheme, parts.netloc, path, urlencode({"hotkey": hotkey}), ""))


def poll_interval(epoch: MinerEpoch) -> float:
    """A quarter of the epoch's length, within the bounds; `FIRST_POLL_S` while it is unknown."""
    if epoch.start is None or epoch.end is None or epoch.end <= epoch.start:
        return FIRST_POLL_S
    return min(MAX_POLL_S, max(MIN_POLL_S, (epoch.end - epoch.start) / 4))


class EpochWatch:
    def __init__(
        self,
        *,
        http: httpx.AsyncClient,
        gateway_url: str,
        hotkey: str,
        hub: Hub,
        hub_component: str,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.http = http
        self.url = epoch_url(gateway_url, hotkey)
        self.hub = hub
        self.hub_component = hub_component
        self.wall = wall
        self.epoch = MinerEpoch()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.look()
            await trio.sleep(poll_interval(self.epoch))

    async def look(self) -> MinerEpoch:
        """Ask once and publish what was learned (or why nothing was)."""
        before = self.epoch
        try:
            with trio.fail_after(TIMEOUT_S):
                response = await self.http.get(self.url)
            if response.status_code == 404:
                raise _Unavailable(_message(response, code="no_epoch") or NO_ROUTE)
            if response.status_code != 200:
                raise _Unavailable(f"HTTP {response.status_code}: {_message(response) or response.text[:200]}")
            answer = response.json()
            if not isinstance(answer, dict):
                raise _Unavailable("the answer is not a JSON object")
            self.epoch = miner_epoch(answer, now=self.wall())
        except (httpx.HTTPError, trio.TooSlowError, ValueError, _Unavailable) as error:
            why = str(error) if isinstance(error, _Unavailable) else f"{type(error).__name__}: {error}"
            self.epoch = dataclasses.replace(before, error=f"{self.url}: {why}", checked_at=self.wall())
        if self.epoch.gated and (before.index != self.epoch.index or not before.gated):
            for finding in self.epoch.gated:
                log.warning(
                    "epoch %s zeroed %s by the %s gate: %s; fix: %s",
                    self.epoch.index,
                    finding.model,
                    finding.gate,
                    finding.text,
                    finding.fix,
                )
        self.hub.set_state(self.hub_component, epoch=dataclasses.asdict(self.epoch))
        return self.epoch


class _Unavailable(Exception):
    """The gateway answered, but with no epoch for us."""


def _message(response: httpx.Response, *, code: str | None = None) -> str | None:
    """The gateway's `{"error": {"code", "message"}}` message (with `code`: only for that code)."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or (code is not None and error.get("code") != code):
        return None
    message = error.get("message")
    return message if isinstance(message, str) else None
