"""The proofs block: is this miner's work proven?

Which proofs judge this miner, as it decided once its model server answered: GEMM audits with
TOPLOC, or TOPLOC alone ⚠ (why is in `engy-node status` and the miner's log: the line is too long
for this box). Then this miner's verdicts at the gateway since it started (audited: pass, cheat,
unproven), then the breaker's view of them, labelled so: the verdicts of the last minutes that
the breaker weighs, with ⚠ past its unproven bar (`engy_node.protocol.standing.
MAX_UNPROVEN_PCT`). Then the verdicts judged on this node: the verifier's pass, cheat and
unproven since it started, node-wide, and the audit queue.

The lifetime totals lead because they are what the verifier's tally is made of; the breaker's
window is minutes long, so on its own it read as the counters disagreeing ("audited 0" beside
"pass 44").

Where the facts come from: `MinerState.proofs` (`engy_node.miner.role.ServeRotation`); the
traffic worker's `lifetime` (`LifetimeCounts`: audited, pass, cheat, unproven) and `window`
(`BreakerWindow`: verdicts, unproven) on a gateway node; `VerifierState` (`engy_node.verifier`:
state, verdicts {pass, cheat, unproven}) and `AuditState` (`engy_node.gateway.trust.
trust_plane`: waiting, leased, recorded, dropped_full, dropped_expired, dropped_unjudged) when
this node runs them.
"""

from __future__ import annotations

from engy_node.protocol.standing import MAX_UNPROVEN_PCT, VERDICT_WINDOW_S
from engy_node.snapshots import (
    GEMM_AND_TOPLOC,
    AuditState,
    MinerState,
    NodeStates,
    TrafficStanding,
    VerdictCounts,
    VerifierState,
)
from engy_tui.widgets.cells import NA, Cell, format_duration
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import BAD, OK, WARN, Line, count_text, plural

__all__ = [
    "audited_cells",
    "gateway_proof_lines",
    "node_proof_lines",
    "proved_by_line",
    "verdict_breaker_cell",
]


def proved_by_line(miner: MinerState | None) -> Line | None:
    """ "proved by GEMM audits + TOPLOC ✔", or "proved by TOPLOC alone ⚠"; None before the miner
    asked its model server."""
    if miner is None or not miner.proofs:
        return None
    if miner.proofs == GEMM_AND_TOPLOC:
        return (Cell("proved by ", "header"), Cell(f"{miner.proofs} {OK}", "ok"))
    return (Cell("proved by ", "header"), Cell(f"{miner.proofs} {WARN}", "warning"))


def audited_cells(worker: TrafficStanding) -> list[Cell]:
    """This miner's verdicts at the gateway since it started: "audited 61: 59 pass, 0 cheat, 2
    unproven" (probes included); a cheat is ✘."""
    life = worker.lifetime
    if life is None:
        return [Cell(f"audited {NA}", "na")]
    cheat = Cell(f"{life.cheat:,} cheat {BAD}", "error") if life.cheat else Cell(f"{life.cheat:,} cheat")
    return [
        Cell(f"audited {life.audited:,}: {life.passed:,} pass, "),
        cheat,
        Cell(f", {life.unproven:,} unproven"),
    ]


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %"


def verdict_breaker_cell(worker: TrafficStanding) -> Cell:
    """The verdicts the breaker weighs now, labelled as its view: "breaker, last 5 min: 61
    verdicts, 2 unproven (3.3 %)"; ⚠ past its unproven bar, ✔ with verdicts and none unproven.
    The window counts pass and unproven (a cheat pulls at once, so it shows as the pull)."""
    window = worker.window
    verdicts, unproven = window.verdicts, window.unproven
    label = f"breaker, last {format_duration(VERDICT_WINDOW_S)}: "
    high = verdicts > 0 and unproven * 100 > MAX_UNPROVEN_PCT * verdicts
    share = ""
    if verdicts > 0 and 0 < unproven <= verdicts:
        share = f" ({_pct(unproven, verdicts)} > {MAX_UNPROVEN_PCT} %)" if high else f" ({_pct(unproven, verdicts)})"
    mark = f" {WARN}" if high else (f" {OK}" if verdicts > 0 and not unproven else "")
    return Cell(
        f"{label}{plural(verdicts, 'verdict')}, {count_text(unproven)} unproven{share}{mark}",
        "warning" if high else ("ok" if verdicts > 0 and not unproven else ""),
    )


def gateway_proof_lines(worker: TrafficStanding | None) -> list[Line]:
    """This miner's verdicts at a gateway on this node: since it started, then the breaker's
    window (indented under them); none without a traffic worker."""
    if worker is None:
        return []
    return [tuple(audited_cells(worker)), (Cell("  "), verdict_breaker_cell(worker))]


def _verifier_line(verifier: VerifierState) -> Line:
    verdicts = verifier.verdicts
    passed, cheat, unproven = verdicts.passed, verdicts.cheat, verdicts.unproven
    total = sum(n for n in (passed, cheat, unproven) if n >= 0)
    share = f" ({100 * unproven / total:.1f}%)" if total > 0 and unproven > 0 else ""
    high = total > 0 and unproven * 100 > MAX_UNPROVEN_PCT * total
    return (
        Cell("verifier: ", "header"),
        Cell(f"pass {count_text(passed)}"),
        Cell("  "),
        Cell(f"cheat {cheat:,} {BAD}", "error") if cheat else Cell(f"cheat 0 {OK}", "ok"),
        Cell("  "),
        Cell(f"unproven {count_text(unproven)}{share}{f' {WARN}' if high else ''}", "warning" if high else ""),
    )


def _audit_line(audit: AuditState) -> Line:
    dropped = audit.dropped_full + audit.dropped_expired + audit.dropped_unjudged
    tail = (
        Cell(f" · {dropped:,} dropped unjudged {WARN}", "warning") if dropped else Cell(f" · none dropped {OK}", "ok")
    )
    return (
        Cell("audit: ", "header"),
        Cell(
            f"{count_text(audit.waiting)} waiting · {count_text(audit.leased)} leased · "
            f"{count_text(audit.recorded)} judged"
        ),
        tail,
    )


def node_proof_lines(states: NodeStates) -> list[Line]:
    """The proofs judged on this node: the verifier's verdicts since it started (pass, cheat ✘,
    unproven and its share) and the audit queue; n/a where this node runs neither."""
    lines: list[Line] = []
    verifier = states.verifier
    if verifier is not None:
        if verifier.verdicts == VerdictCounts():
            state = _text(verifier.state) or f"state {NA}"
            lines.append((Cell("verifier: ", "header"), Cell(f"{state}, no verdict yet", "na")))
        else:
            lines.append(_verifier_line(verifier))
    if states.audit is not None:
        lines.append(_audit_line(states.audit))
    if not lines:
        lines += [
            (Cell("no verifier or audit desk on this node:", "na"),),
            (Cell("the gateway's verifiers judge its proofs", "na"),),
        ]
    return lines
