"""The GEMM audit's frames on the miner ↔ gateway websocket (docs/protocol.md, "GEMM audits";
issue 32): a serve request that asks for an activation commitment, the answer that carries it,
and the challenge that opens part of it afterwards.

The flow. A miner whose serve can commit its activations (the reference server; sglang with the
capture module) announces `FEATURE_GEMM` in its hello. The gateway then sets
``return_gemm_commitment`` on the serve requests it may audit so (`ServeRequest.gemm_commitment`),
and the miner's `response` carries ``gemm_commitment``: an `engy-activations-v2` (or v1) commitment
(`engy_node.gemm.activations.Commitment.to_wire`) plus the ``rid`` its serve filed the record
under. Later — after the commitment is fixed, from randomness only the verifier holds — the
gateway sends `GemmChallenge` naming that rid and the picks; the miner answers `GemmOpenings`
with the rows and their Merkle paths as its serve's ``POST /gemm/openings`` returned them, or an
error saying why it cannot (record expired, serve gone). The gateway relays the openings to the
verifier unread: only the verifier, holding the commitment, judges them.

Public miners do not announce the feature and never see these frames; a miner that announced it
and then sends a frame the gateway did not expect is refused like any other unexpected frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engy_node.protocol.fields import ProtocolError, as_count, as_object, describe, text_field

FEATURE_GEMM = "gemm-audit"
"""A miner that announces this commits its activations when a serve request asks
(``return_gemm_commitment``) and answers `GemmChallenge`."""

RECORD_WINDOW_S = 300.0
"""How long a miner that announced `FEATURE_GEMM` keeps an answer's record open to challenges
(the reference server's store; a larger answer than its memory bound may leave sooner). A job
audited later than this is judged by TOPLOC alone, never `unproven` for a record the miner was
entitled to drop."""

MAX_CHALLENGE_PICKS = 4096
"""Picks in one challenge (the reference server's `/gemm/openings` limit)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GemmPick:
    position: int
    layer: int
    group: str

    def to_wire(self) -> dict[str, Any]:
        return {"position": self.position, "layer": self.layer, "group": self.group}


def parse_picks(raw: Any, where: str) -> tuple[GemmPick, ...]:
    if not isinstance(raw, list) or not raw:
        raise ProtocolError(where, f"must be a non-empty list of picks, got {describe(raw)}")
    if len(raw) > MAX_CHALLENGE_PICKS:
        raise ProtocolError(where, f"at most {MAX_CHALLENGE_PICKS} picks, got {len(raw)}")
    picks = []
    for index, item in enumerate(raw):
        at = f"{where}[{index}]"
        item = as_object(item, at)
        position = as_count(item.get("position"), f"{at}.position")
        layer = as_count(item.get("layer"), f"{at}.layer")
        picks.append(GemmPick(position, layer, text_field(item, "group", at)))
    return tuple(picks)


@dataclasses.dataclass(frozen=True, slots=True)
class GemmChallenge:
    """Gateway → miner: open these rows of the answer whose serve record is `rid`."""

    challenge_id: str
    rid: str
    picks: tuple[GemmPick, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "gemm_challenge",
            "challenge_id": self.challenge_id,
            "rid": self.rid,
            "picks": [pick.to_wire() for pick in self.picks],
        }

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> GemmChallenge:
        return cls(
            challenge_id=text_field(obj, "challenge_id", "gemm_challenge"),
            rid=text_field(obj, "rid", "gemm_challenge"),
            picks=parse_picks(obj.get("picks"), "gemm_challenge.picks"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class GemmOpenings:
    """Miner → gateway: the openings for `challenge_id` (each as the serve's `/gemm/openings`
    wrote it: position, layer, group, values, path), or `error` saying why there are none."""

    challenge_id: str
    openings: tuple[dict[str, Any], ...] = ()
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": "gemm_openings", "challenge_id": self.challenge_id}
        if self.error is not None:
            wire["error"] = self.error
        else:
            wire["openings"] = list(self.openings)
        return wire

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> GemmOpenings:
        challenge_id = text_field(obj, "challenge_id", "gemm_openings")
        error = obj.get("error")
        if error is not None:
            if not isinstance(error, str):
                raise ProtocolError("gemm_openings.error", f"must be a string, got {describe(error)}")
            return cls(challenge_id, error=error or "no reason given")
        raw = obj.get("openings")
        if not isinstance(raw, list):
            raise ProtocolError("gemm_openings.openings", f"must be a list, got {describe(raw)}")
        return cls(
            challenge_id,
            tuple(dict(as_object(item, f"gemm_openings.openings[{i}]")) for i, item in enumerate(raw)),
        )


def parse_gemm_commitment(raw: Any) -> dict[str, Any] | None:
    """A response's ``gemm_commitment``: kept as the object it is (the verifier reads it), or
    None when absent or empty. It must name the ``rid`` a challenge will give back."""
    if raw is None or raw == {}:
        return None
    commitment = dict(as_object(raw, "response.gemm_commitment"))
    text_field(commitment, "rid", "response.gemm_commitment")
    return commitment
