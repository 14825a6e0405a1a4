"""How a miner stops: what happens to each request, and how long each step may take.

A miner told to stop (systemd's SIGTERM, Ctrl-C, the TUI quitting) has requests in flight that
buyers are waiting on, and a model server that has to go last: an abort sent to a server that
is already gone fails (`ConnectError`), and a request cut without a word leaves the gateway to
find out from a dropped connection. So the stop is a sequence, run by the miner role
(`role.run_miner`) and the gateway link (`link.GatewayLink.drain`):

1. announcing: every leg sends a heartbeat whose `capacity.max_inflight` is 0. The gateway
   routes only to legs with fewer requests than their capacity, so nothing new is routed here.
2. finishing: requests in flight may finish for `drain_s`. A `serve` that crossed the
   heartbeat on the wire is refused at once with an error response; nothing was sent for it
   yet, so the gateway retries it on another miner and the buyer never sees it.
3. aborting: what still runs is cancelled. The serve client aborts it on the model server,
   which is still up, and the leg sends the request's terminal `response` with an error.
4. closing: every leg is closed (1001, going away) and none re-dials.
5. the model server stops: SIGTERM to its group, its grace, SIGKILL.

Each step is bounded, and the bounds add up to less than systemd's default stop timeout, after
which it kills the whole service with SIGKILL, requests and all.

Pure: no IO, no clock reads. The bounds of the other modules' steps are restated as constants
in `engy_node.config` (which validates `miner.drain_s` against them when it loads, before any
role's code is imported); the tests assert that each constant still covers the bound it restates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from engy_node.config import (
    ABORT_S,
    ANNOUNCE_S,
    CLOSE_S,
    DEFAULT_DRAIN_S,
    MAX_DRAIN_S,
    SERVER_STOP_S,
)

__all__ = [
    "ABORTED_ERROR",
    "DEFAULT_DRAIN_S",
    "MAX_DRAIN_S",
    "REFUSED_ERROR",
    "DrainPhase",
    "RequestAction",
    "StopBudget",
    "request_action",
    "stop_budget",
]

REFUSED_ERROR = "the miner is shutting down and takes no new requests; retry on another miner"
ABORTED_ERROR = "the miner is shutting down: the request was still running at its drain deadline"

DrainPhase = Literal["serving", "finishing", "aborting", "closing"]
"""Where the link is in its stop: `serving` until the stop begins, then as in the module docstring."""
RequestAction = Literal["serve", "refuse", "continue", "abort"]


@dataclasses.dataclass(frozen=True, slots=True)
class StopBudget:
    """How long each step of the stop may take, in seconds."""

    announce_s: float
    finish_s: float
    abort_s: float
    close_s: float
    server_s: float

    @property
    def link_s(self) -> float:
        """The link's share: every step before the model server's stop."""
        return self.announce_s + self.finish_s + self.abort_s + self.close_s

    @property
    def total_s(self) -> float:
        return self.link_s + self.server_s


def stop_budget(*, drain_s: float, server_stop_s: float = SERVER_STOP_S) -> StopBudget:
    """The bounds of a stop that lets in-flight requests finish for `drain_s`. Raises ValueError
    for a negative or infinite duration; whether the total fits systemd's is the config's check
    (`MAX_DRAIN_S`), since a miner run by hand may take as long as its operator likes."""
    for name, value in (("drain_s", drain_s), ("server_stop_s", server_stop_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    return StopBudget(
        announce_s=ANNOUNCE_S, finish_s=float(drain_s), abort_s=ABORT_S, close_s=CLOSE_S, server_s=float(server_stop_s)
    )


def request_action(phase: DrainPhase, *, new: bool) -> RequestAction:
    """What the link does with a request in `phase`: a `serve` frame that just arrived (`new`),
    or one already in flight.

    New requests are served only while serving; once the stop has begun they are refused, not
    served within the drain, because a refusal before any output is retried elsewhere while a
    started stream that the deadline cuts reaches the buyer as an error. Requests in flight
    continue until the aborting phase."""
    if phase == "serving":
        return "serve" if new else "continue"
    if new:
        return "refuse"
    return "continue" if phase == "finishing" else "abort"
