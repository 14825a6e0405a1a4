"""Verdict tallies, split by the proof that judged each verdict: what `engy-node status`, the hub's
states and the TUI count.

A verdict's stored reason code says which proof judged it (`proof.Verdict.code`: `gemm:…`,
`recompute:…`, or a plain TOPLOC code), so any holder of verdict rows — the gateway's control
plane reading its store, a verifier counting its own — tallies by proof with `judged_by`, without
the verdict object. Kept apart from `snapshots` (which re-exports the types, as the hub's schema)
because counting is behaviour, and pure: frozen values, one more verdict at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

VerdictKindName = Literal["pass", "cheat", "unproven"]
Proof = Literal["toploc", "gemm", "recompute"]
PROOFS: tuple[Proof, ...] = ("toploc", "gemm", "recompute")
"""The proofs a verdict can come from (`proof.Verdict.path`), in the order dashboards show them."""


def judged_by(code: str) -> Proof:
    """Which proof judged a verdict, read from its stored reason code (`proof.Verdict.code`):
    `gemm:…` the GEMM audit, `recompute:…` the recompute alone (an answer without a TOPLOC
    commitment); any other code is TOPLOC's, as are the gateway's own checks of a commitment
    against the delivery (`prompt-mismatch`, `usage-padding`). A code like `shape:prompt_ids`
    has a colon but no proof's prefix: TOPLOC's too."""
    prefix = code.partition(":")[0] if ":" in code else ""
    if prefix == "gemm":
        return "gemm"
    if prefix == "recompute":
        return "recompute"
    return "toploc"


@dataclasses.dataclass(frozen=True, slots=True)
class VerdictCounts:
    passed: int = dataclasses.field(default=0, metadata={"key": "pass"})
    cheat: int = 0
    unproven: int = 0

    @property
    def total(self) -> int:
        return self.passed + self.cheat + self.unproven

    def counted(self, verdict: VerdictKindName) -> VerdictCounts:
        """These counts with one more `verdict`."""
        name = "passed" if verdict == "pass" else verdict
        return dataclasses.replace(self, **{name: getattr(self, name) + 1})

    def summary(self) -> str:
        """The kinds there are, like `3 pass, 1 cheat`, or `none`."""
        shown = [
            f"{n} {kind}"
            for kind, n in (("pass", self.passed), ("cheat", self.cheat), ("unproven", self.unproven))
            if n
        ]
        return ", ".join(shown) or "none"


@dataclasses.dataclass(frozen=True, slots=True)
class ProofVerdicts:
    """Verdicts split by the proof that judged them (`judged_by`): a miner whose verdicts are all
    TOPLOC's was never held to a GEMM audit."""

    toploc: VerdictCounts = dataclasses.field(default_factory=VerdictCounts)
    gemm: VerdictCounts = dataclasses.field(default_factory=VerdictCounts)
    recompute: VerdictCounts = dataclasses.field(default_factory=VerdictCounts)

    def counted(self, verdict: VerdictKindName, code: str) -> ProofVerdicts:
        """These counts with one more `verdict`, under the proof its reason `code` names."""
        proof = judged_by(code)
        return dataclasses.replace(self, **{proof: getattr(self, proof).counted(verdict)})

    def summary(self) -> str:
        """Each proof that judged any, like `toploc 3 pass · gemm 1 cheat`, or `none yet`."""
        parts = [f"{proof} {getattr(self, proof).summary()}" for proof in PROOFS if getattr(self, proof).total]
        return " · ".join(parts) or "none yet"


def gemm_audited(announced: Iterable[bool | None]) -> bool | None:
    """Whether a miner is held to GEMM audits, from what each of its legs announced
    (`GatewayLeg.gemm_audit`): True when any leg did, False when every leg said it did not (TOPLOC
    alone judges it), None when none says (no legs, or a gateway too old to tell)."""
    said = [flag for flag in announced if flag is not None]
    return any(said) if said else None
