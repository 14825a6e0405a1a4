"""The "Weights on chain" block: which weights does the chain hold from this validator, and how did
that vector come (signed by the master, a cached vector, a burn)?

Who the validator is (uid, permit, netuid), the epoch and digest on chain, its last submit, then
the weights table heaviest first with each row's share and a bar, the hotkeys the payload
named that the chain does not have (dropped), and the miners a settlement gate zeroed (gated: the
weights omit them, so without this they would look merely unweighted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from engy_node.protocol.gates import measure_text
from engy_node.snapshots import ChainState, ValidatorState
from engy_tui.widgets.cells import NA, Cell, short_hotkey
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.validator.common import (
    ERROR,
    NA_CELL,
    OK,
    WARN,
    Line,
    count_or_na,
    header_line,
    names_by_ss58,
    pad_columns,
    percent_text,
    share_bar,
    share_of,
)
from engy_tui.widgets.validator.standing import blocks_since_submit, own_neuron

__all__ = [
    "MAX_WEIGHT_ROWS",
    "weights_lines",
    "weights_rows",
]

MAX_WEIGHT_ROWS = 12
"""Rows shown before the rest is summed up in one line."""


def _short_digest(digest: str | None) -> str:
    text = _text(digest)
    if text is None:
        return NA
    return text if len(text) <= 12 else f"{text[:6]}…{text[-4:]}"


def _landed_kind(validator: ValidatorState) -> str | None:
    for submission in validator.submissions:
        if submission.landed:
            return _text(submission.kind)
    return None


class _Weight(NamedTuple):
    uid: int | None
    hotkey: str | None
    weight: int
    share: float | None


def _weights(validator: ValidatorState) -> list[_Weight]:
    """The published weights, heaviest first, each with its share of the positive total."""
    total = sum(entry.weight for entry in validator.weights if entry.weight > 0)
    rows = [
        _Weight(entry.uid, entry.hotkey, entry.weight, share_of(entry.weight, total)) for entry in validator.weights
    ]
    rows.sort(key=lambda row: -row.weight)
    return rows


def weights_rows(validator: ValidatorState | None, names: Mapping[str, str] | None = None) -> list[Line]:
    """One row per uid this validator last put on chain, heaviest first: uid, hotkey (local
    name when `names` {name: ss58} has it), weight (u16), share of the row, share bar."""
    by_ss58 = names_by_ss58(names)
    lines: list[Line] = []
    for uid, hotkey, weight, share in _weights(validator) if validator is not None else ():
        lines.append(
            (
                Cell(str(uid)) if uid is not None else NA_CELL,
                Cell(short_hotkey(hotkey, by_ss58), "" if _text(hotkey) else "na"),
                Cell(f"{weight:,}"),
                Cell(percent_text(share), "" if share is not None else "na"),
                Cell(share_bar(share), "bar"),
            )
        )
    return lines


def weights_lines(
    validator: ValidatorState | None,
    names: Mapping[str, str] | None = None,
    *,
    chain: ChainState | None = None,
    max_rows: int = MAX_WEIGHT_ROWS,
) -> list[Line]:
    """The "Weights on chain" box: who this validator is, which epoch it has on chain and how
    that vector came (master-signed, cached, burn), its last submit, then the weights table."""
    validator = validator if validator is not None else ValidatorState()
    by_ss58 = names_by_ss58(names)
    me = own_neuron(validator, chain)
    hotkey = validator.hotkey
    who = short_hotkey(hotkey)
    if hotkey is not None and hotkey in by_ss58:
        who = f"{by_ss58[hotkey]} ({who})"
    permit = (
        Cell(f"permit {OK}", "ok")
        if me.permit is True
        else Cell(f"no permit {ERROR}", "error")
        if me.permit is False
        else Cell(f"permit {NA}", "na")
    )
    uid = (
        Cell(f"uid {me.uid}")
        if me.uid is not None
        else Cell(f"not registered {ERROR}", "error")
        if me.registered is False
        else Cell(f"uid {NA}", "na")
    )
    netuid = validator.netuid
    network = _text(validator.network)
    lines: list[Line] = [
        (
            Cell(who, "" if who != NA else "na"),
            Cell(" · "),
            uid,
            Cell(" · "),
            permit,
            Cell(f" · netuid {count_or_na(netuid)} on {network or NA}"),
        )
    ]

    epoch = validator.submitted_epoch if validator.submitted_epoch is not None else validator.last_applied
    last = validator.last_submit_block
    if epoch is None and last is None:
        lines.append((Cell("nothing on chain from this validator yet", "na"),))
        return lines
    kind = _landed_kind(validator)
    if kind == "standby:burn":
        source = Cell(f"burn to the subnet owner {WARN} (standby)", "warning")
    elif kind in ("standby:cached", "resubmitted:cached"):
        source = Cell(f"cached vector {WARN} (provider unavailable)", "warning")
    elif _text(validator.digest):
        source = Cell(f"signed by master {OK}", "ok")
    else:
        source = NA_CELL
    lines.append(
        (
            Cell(f"epoch {count_or_na(epoch)} · digest "),
            Cell(_short_digest(validator.digest), "" if _text(validator.digest) else "na"),
            Cell(" · "),
            source,
        )
    )
    since = blocks_since_submit(validator, chain)
    ago = f" ({since:,} ago)" if since is not None else ""
    if last is not None:
        lines.append((Cell(f"last submit block {last:,}{ago} "), Cell(f"{OK} landed", "ok")))
    else:
        lines.append((Cell("last submit block "), NA_CELL))

    rows = weights_rows(validator, names)
    if not validator.weights:
        lines.append((Cell("the weights table appears after this process's first submit", "na"),))
    else:
        shown = rows[: max(0, max_rows)]
        lines += pad_columns([header_line("uid", "hotkey", "weight", "share", ""), *shown], "llrrl")
        rest = _weights(validator)[len(shown) :]
        if rest:
            shares = [row.share for row in rest if row.share is not None and row.share > 0]
            share = sum(shares) if shares else (0.0 if any(row.share is not None for row in rest) else None)
            lines.append(
                (Cell(f"… {len(rest)} more uid{'s' if len(rest) != 1 else ''} ({percent_text(share)})", "na"),)
            )
    dropped = validator.dropped
    dropped_share = _num(validator.dropped_share)  # finite
    gated = _gated_lines(validator, by_ss58)
    if dropped or (dropped_share is not None and dropped_share > 0):
        count = f"{len(dropped)} unregistered hotkey{'s' if len(dropped) != 1 else ''}"
        lines.append((Cell(f"dropped: {count} ({percent_text(dropped_share)} of the weight) {WARN}", "warning"),))
    elif validator.submitted_epoch is not None:
        # The loop publishes what it dropped with every epoch it submits.
        first = gated[0] if gated else ()
        lines.append((Cell("dropped: none" + (" · " if first else "")), *first))
        gated = gated[1:]
    return lines + gated


def _gated_lines(validator: ValidatorState, by_ss58: Mapping[str, str]) -> list[Line]:
    """The miners a settlement gate zeroed in the newest verified epoch, a line each: absent from
    the weights, but neither dropped nor merely unweighted."""
    lines: list[Line] = []
    for finding in validator.gated:
        who = by_ss58.get(finding.hotkey) or short_hotkey(_text(finding.hotkey))
        what = f"{who} {finding.model}: {finding.gate} {measure_text(finding)} {WARN}"
        lead = f"gated to 0 in epoch {count_or_na(finding.epoch)}: " if not lines else "  "
        lines.append((Cell(lead + what, "warning"),))
    return lines
