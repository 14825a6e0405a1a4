"""The proofs block: is this miner's work proven?

The verdicts judged on this node (the verifier's pass, cheat and unproven since it started, and
the audit queue), and this miner's verdicts in the gateway's breaker window, with ⚠ past the
breaker's unproven limit (`engy_node.protocol.standing.MAX_UNPROVEN_PCT`).

Where the facts come from: "verifier" (`engy_node.verifier`: state, verdicts {pass, cheat,
unproven}) and "audit" (`engy_node.gateway.trust_plane`: waiting, leased, recorded,
dropped_full, dropped_expired, dropped_unjudged) when this node runs them; the traffic worker's
`window` {verdicts, unproven} on a gateway node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engy_node.protocol.standing import MAX_UNPROVEN_PCT, VERDICT_WINDOW_S
from engy_tui.widgets.cells import NA, Cell, format_duration
from engy_tui.widgets.cells import as_int as _int
from engy_tui.widgets.cells import as_map as _map
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import BAD, NA_CELL, OK, WARN, Line, count_text

__all__ = [
    "gateway_proof_line",
    "node_proof_lines",
]


def gateway_proof_line(worker: Any) -> Line | None:
    """This miner's verdicts in the gateway's breaker window: "audited 61 · 2 unproven (3.3%)";
    ⚠ past the breaker's unproven limit. The window counts pass and unproven (a cheat pulls at
    once, so it shows as the pull, not here)."""
    window = _map(_map(worker).get("window"))
    if not window:
        return None
    verdicts, unproven = _int(window.get("verdicts")), _int(window.get("unproven"))
    span = format_duration(VERDICT_WINDOW_S)
    if verdicts is None:
        return (Cell(f"audited at the gateway ({span}) "), NA_CELL)
    if unproven is None:
        return (Cell(f"audited {verdicts:,} · unproven {NA} in {span}"),)
    share = f" ({100 * unproven / verdicts:.1f}%)" if verdicts > 0 and 0 < unproven <= verdicts else ""
    high = verdicts > 0 and unproven * 100 > MAX_UNPROVEN_PCT * verdicts
    mark = f" {WARN} over {MAX_UNPROVEN_PCT}%" if high else (f" {OK}" if verdicts and not unproven else "")
    return (
        Cell(
            f"audited {verdicts:,} · {unproven:,} unproven{share}{mark} in {span}",
            "warning" if high else ("ok" if verdicts and not unproven else ""),
        ),
    )


def node_proof_lines(states: Any) -> list[Line]:
    """The proofs judged on this node: the verifier's verdicts since it started (pass, cheat ✘,
    unproven and its share) and the audit queue; n/a where this node runs neither."""
    states = _map(states)
    verifier, audit = states.get("verifier"), states.get("audit")
    lines: list[Line] = []
    if isinstance(verifier, Mapping):
        verdicts = verifier.get("verdicts")
        if not isinstance(verdicts, Mapping):
            state = _text(verifier.get("state"))
            lines.append((Cell("verifier: ", "header"), Cell(f"{state or 'state n/a'}, no verdict yet", "na")))
        else:
            passed, cheat, unproven = (_int(verdicts.get(k)) for k in ("pass", "cheat", "unproven"))
            known = [n for n in (passed, cheat, unproven) if n is not None and n >= 0]
            total = sum(known)
            share = f" ({100 * unproven / total:.1f}%)" if unproven is not None and total > 0 and unproven > 0 else ""
            high = unproven is not None and total > 0 and unproven * 100 > MAX_UNPROVEN_PCT * total
            lines.append(
                (
                    Cell("verifier: ", "header"),
                    Cell(f"pass {count_text(passed)}", "" if passed is not None else "na"),
                    Cell("  "),
                    (
                        Cell(f"cheat {cheat:,} {BAD}", "error")
                        if cheat
                        else Cell(f"cheat 0 {OK}", "ok")
                        if cheat == 0
                        else Cell(f"cheat {NA}", "na")
                    ),
                    Cell("  "),
                    Cell(
                        f"unproven {count_text(unproven)}{share}{f' {WARN}' if high else ''}",
                        "warning" if high else ("" if unproven is not None else "na"),
                    ),
                )
            )
    if isinstance(audit, Mapping) and audit:
        dropped = [_int(audit.get(key)) for key in ("dropped_full", "dropped_expired", "dropped_unjudged")]
        known_dropped = [n for n in dropped if n is not None]
        if not known_dropped:
            tail = Cell(f" · dropped {NA}", "na")
        elif any(known_dropped):
            tail = Cell(f" · {sum(known_dropped):,} dropped unjudged {WARN}", "warning")
        else:
            tail = Cell(f" · none dropped {OK}", "ok")
        lines.append(
            (
                Cell("audit: ", "header"),
                Cell(
                    f"{count_text(audit.get('waiting'))} waiting · {count_text(audit.get('leased'))} leased · "
                    f"{count_text(audit.get('recorded'))} judged"
                ),
                tail,
            )
        )
    if not lines:
        lines += [
            (Cell("no verifier or audit desk on this node:", "na"),),
            (Cell("the gateway's verifiers judge its proofs", "na"),),
        ]
    return lines
