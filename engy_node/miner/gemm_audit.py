"""The miner's side of a GEMM audit (docs/protocol.md, "GEMM audits"): which answers commit
their activations, which serve holds each record, and the answer to a challenge.

A miner takes part only when every model server it serves through can commit (`ServeClient.
gemm_support`: the reference server can, sglang with the capture armed can through
`sglang.capture_client`, plain sglang cannot); the role decides that once, and a
miner that cannot announces nothing and ignores ``return_gemm_commitment``, as before audits
existed. One that can commits an answer when the gateway asks and the answer fits the server's
record store: the server refuses to capture a request whose record could not fit (a 400), and
an audit must never fail an answer the buyer would otherwise get, so a longer one is served
without a commitment (the gateway then has nothing to challenge, and says so).

Failure posture: a challenge is always answered — with the openings, or with an error naming
why there are none (the server no longer holds the record and its message, the server did not
answer in time, the miner cannot commit at all). The gateway relays either to the verifier,
which judges a missing opening `unproven`; nothing here decides anything about the audit.
"""

from __future__ import annotations

import dataclasses
import logging

from engy_node.protocol.gemm import GemmChallenge, GemmOpenings
from engy_node.serve.client import GemmSupport, ServeClient, ServeError

log = logging.getLogger("engy.miner.gemm")

MAX_REMEMBERED = 65_536
"""Records whose serve the miner remembers: the reference server keeps a record 300 s, and this
many is ~220 committed answers a second over that window, more than a CPU or 4-GPU miner serves.
An older rid is asked of the next serve in turn, which says itself whether it holds it."""


@dataclasses.dataclass(frozen=True, slots=True)
class CommitDecision:
    commit: bool
    reason: str
    """Why not, for the log (empty when it commits)."""


def commit_decision(
    *, asked: bool, support: GemmSupport | None, prompt_tokens: int, max_new_tokens: int
) -> CommitDecision:
    """Whether to ask the serve for an activation commitment for one answer (pure)."""
    if not asked:
        return CommitDecision(False, "the gateway did not ask")
    if support is None:
        return CommitDecision(False, "the model server cannot commit its activations")
    if prompt_tokens + max_new_tokens > support.most_positions:
        return CommitDecision(
            False,
            f"{prompt_tokens} prompt tokens plus max_tokens {max_new_tokens} exceed the {support.most_positions} "
            "positions the model server's record store holds for one answer",
        )
    return CommitDecision(True, "")


class GemmRecords:
    """rid → the serve that filed it, the newest `limit` of them (a miner with several serves
    must ask the one that committed)."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._serves: dict[str, ServeClient] = {}

    def remember(self, rid: str, serve: ServeClient) -> None:
        self._serves.pop(rid, None)
        self._serves[rid] = serve
        while len(self._serves) > self.limit:
            del self._serves[next(iter(self._serves))]

    def serve_of(self, rid: str) -> ServeClient | None:
        return self._serves.get(rid)


async def open_challenge(serve: ServeClient, challenge: GemmChallenge, *, timeout_s: float) -> GemmOpenings:
    """The answer to `challenge` from `serve`: its openings as the server wrote them, or an
    error naming why there are none. Bounded by `timeout_s`; never raises for the server."""
    try:
        payload = await serve.open_gemm(
            challenge.rid, [pick.to_wire() for pick in challenge.picks], timeout_s=timeout_s
        )
    except ServeError as error:
        return GemmOpenings(challenge.challenge_id, error=str(error))
    return GemmOpenings(challenge.challenge_id, tuple(payload["openings"]))
