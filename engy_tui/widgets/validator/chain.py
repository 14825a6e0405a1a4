"""The chain tab's lines (who is on the subnet, and whose weights does the chain hold?) and a
miner's own standing on chain (`miner_lines`, shown by the miner tab's chain box).

Every neuron of the subnet (stake, permit, last update, incentive, dividends, emission), the
weights each validator has on chain with each target's share, and the summary line (head block,
block time, tempo, epochs run). All of it comes from the hub's "chain" state
(`engy_node.local.up._chain_snapshot`), which carries blocks, not times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rich.cells import cell_len

from engy_node.snapshots import ChainState
from engy_tui.widgets.cells import DASH, NA, Cell, short_hotkey
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

__all__ = [
    "ChainPanelView",
    "MAX_TARGETS",
    "NEURON_COLUMNS",
    "chain_summary_line",
    "chain_view",
    "chain_weight_lines",
    "miner_lines",
    "neuron_rows",
]

MAX_TARGETS = 8
"""Targets shown per validator before the rest is summed up in one line."""


NEURON_COLUMNS = ("uid", "name", "stake τ", "permit", "last update", "incentive", "dividends", "emission α")
NEURON_ALIGN = "llrllrrr"


def chain_summary_line(chain: ChainState | None) -> Line:
    chain = chain if chain is not None else ChainState()
    block_s = _num(chain.block_time_s)  # finite
    return (
        Cell(
            f"block {count_or_na(chain.block)} · {f'{block_s:g} s' if block_s is not None else NA} blocks · "
            f"tempo {count_or_na(chain.tempo)} · epochs run {count_or_na(chain.epochs_run)}"
        ),
    )


def _fraction(value: float | None) -> Cell:
    number = _num(value)
    return NA_CELL if number is None else Cell(f"{number:.4f}")


def neuron_rows(chain: ChainState | None, names: Mapping[str, str] | None = None) -> list[Line]:
    """One row per neuron, in `NEURON_COLUMNS` order: uid, local name or short ss58, stake,
    permit (✔/—), last update (and blocks ago, "⚠ inactive" when the chain says so), incentive,
    dividends, emission at the last epoch."""
    if chain is None:
        return []
    head = chain.block
    by_ss58 = names_by_ss58(names)
    rows: list[Line] = []
    for neuron in chain.neurons:
        uid = neuron.uid
        hotkey = neuron.hotkey
        stake = _num(neuron.stake)  # finite
        last_update = neuron.last_update
        emission = _num(neuron.emission)
        if last_update is None:
            update = NA_CELL
        else:
            ago = f" ({head - last_update:,} ago)" if head is not None else ""
            inactive = not neuron.active
            update = Cell(
                f"{last_update:,}{ago}" + (f" {WARN} inactive" if inactive else ""), "warning" if inactive else ""
            )
        rows.append(
            (
                Cell(str(uid)) if uid is not None else NA_CELL,
                Cell(short_hotkey(hotkey, by_ss58), "" if _text(hotkey) else "na"),
                Cell(f"{stake:,.2f}") if stake is not None else NA_CELL,
                Cell(OK, "ok") if neuron.permit else Cell(DASH),
                update,
                _fraction(neuron.incentive),
                _fraction(neuron.dividends),
                Cell(f"{emission:,.4f}") if emission is not None else NA_CELL,
            )
        )
    return rows


def chain_weight_lines(
    chain: ChainState | None, names: Mapping[str, str] | None = None, *, max_targets: int = MAX_TARGETS
) -> list[Line]:
    """The weights each validator has on chain: per validator uid, its targets heaviest first
    with their share of the row and a bar; past `max_targets`, one line sums up the rest."""
    if chain is None or not chain.weights:
        # The chain state always carries its weights: none at all is a chain nobody set any on.
        return [(Cell("no weights on chain yet" if chain is not None else f"weights {NA}", "na"),)]
    by_ss58 = names_by_ss58(names)
    hotkeys = {n.uid: n.hotkey for n in chain.neurons if n.uid is not None and n.hotkey is not None}
    rows: list[Line] = []
    extra: dict[int, Line] = {}
    for validator_uid, row in sorted(chain.weights.items()):
        targets = sorted(row.items(), key=lambda item: (-item[1], item[0]))
        total = sum(value for _, value in targets if value > 0)
        source = f"uid {validator_uid}"
        if validator_uid in hotkeys:
            source += f" {short_hotkey(hotkeys[validator_uid], by_ss58)}"
        if not targets:
            rows.append((Cell(source), Cell("→"), Cell("none", "na"), Cell(""), Cell(""), Cell("")))
            continue
        for index, (target, value) in enumerate(targets[: max(1, max_targets)]):
            share = share_of(value, total)
            name = short_hotkey(hotkeys[target], by_ss58) if target in hotkeys else ""
            rows.append(
                (
                    Cell(source if index == 0 else ""),
                    Cell("→" if index == 0 else ""),
                    Cell(f"uid {target} {name}".rstrip()),
                    Cell(f"{value:,}"),
                    Cell(percent_text(share), "" if share is not None else "na"),
                    Cell(share_bar(share), "bar"),
                )
            )
        rest = targets[max(1, max_targets) :]
        if rest:
            kept = sum(value for _, value in rest if value > 0)
            extra[len(rows) - 1] = (
                Cell(
                    f"… {len(rest)} more uid{'s' if len(rest) != 1 else ''} ({percent_text(share_of(kept, total))})",
                    "na",
                ),
            )
    table = pad_columns([header_line("set by", "", "on", "weight", "share", ""), *rows], "lllrrl")
    indent = Cell(" " * sum(cell_len(cell.text) for cell in table[0][:2]))
    lines: list[Line] = [table[0]]
    for index, line in enumerate(table[1:]):
        lines.append(line)
        if index in extra:
            lines.append((indent, *extra[index]))
    return lines


def miner_lines(chain: ChainState | None, hotkey: str | None) -> list[Line]:
    """A miner's own standing for its dashboard: uid, incentive, emission, and how many permit
    holders weight it, with the newest such update's age in blocks."""
    if chain is None or not chain.neurons:
        return [(Cell("chain state n/a", "na"),)]
    mine = next((n for n in chain.neurons if hotkey is not None and n.hotkey == hotkey), None)
    if mine is None:
        return [(Cell(f"not registered on netuid {count_or_na(chain.netuid)} {ERROR}", "error"),)]
    validators = [n for n in chain.neurons if n.permit and n.uid is not None]
    weighting = [
        n
        for n in validators
        if n.uid is not None and mine.uid is not None and chain.weights.get(n.uid, {}).get(mine.uid, 0) > 0
    ]
    newest = max((n.last_update for n in weighting if n.last_update is not None), default=None)
    age = f", newest {chain.block - newest:,} blocks ago" if newest is not None and chain.block is not None else ""
    style = "ok" if weighting else "warning"
    emission = _num(mine.emission)
    return [
        (
            Cell(f"uid {count_or_na(mine.uid)} · incentive "),
            _fraction(mine.incentive),
            Cell(" · emission "),
            Cell(f"{emission:,.4f} α/epoch") if emission is not None else NA_CELL,
        ),
        (Cell(f"weights from {len(weighting)}/{len(validators)} validators{age} {OK if weighting else WARN}", style),),
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class ChainPanelView:
    title: str
    summary: Line
    neurons: tuple[Line, ...]
    weights: tuple[Line, ...]


def chain_view(
    chain: ChainState | None, *, now: float | None = None, names: Mapping[str, str] | None = None
) -> ChainPanelView:
    """What the chain panel shows for the hub's "chain" state (None, or nothing in it: not
    reported yet). `now` is accepted for symmetry; the chain state carries blocks, not times."""
    if chain is None or chain == ChainState():
        return ChainPanelView("Chain", (Cell("waiting for the chain's first report", "na"),), (), ())
    network = _text(chain.network) or NA
    title = f"Chain · {network} · netuid {count_or_na(chain.netuid)}"
    rows = neuron_rows(chain, names)
    # The chain state always carries its neurons: none at all is a subnet nobody registered on.
    neurons = (
        pad_columns([header_line(*NEURON_COLUMNS), *rows], NEURON_ALIGN) if rows else ((Cell("no neurons", "na"),),)
    )
    return ChainPanelView(title, chain_summary_line(chain), tuple(neurons), tuple(chain_weight_lines(chain, names)))
