"""The chain block: what is this miner earning on chain?

Its uid, incentive and emission, and how many validators weight it
(`engy_tui.widgets.validator.chain.miner_lines`, which reads the `ChainState`, from
`engy_node.local.up._chain_snapshot`), or why that cannot be read: the hotkey not published by
this node (a standalone miner's is not in node info), no chain state (only a local network's
dev chain is published), or the hotkey not registered, with the command that registers it.
"""

from __future__ import annotations

from engy_node.snapshots import ChainState
from engy_tui.widgets.cells import NA, Cell
from engy_tui.widgets.miner.common import Line, count_text
from engy_tui.widgets.validator.chain import miner_lines

__all__ = [
    "chain_lines",
]


def chain_lines(chain: ChainState | None, hotkey: str | None) -> list[Line]:
    """`validator.chain.miner_lines` (uid, incentive, emission, validators weighting it), or
    why it cannot be read: the hotkey or the chain state unknown to this node."""
    if hotkey is None:
        return [(Cell(f"hotkey {NA}: this node does not publish the miner's hotkey", "na"),)]
    if chain is None:
        return [(Cell(f"chain state {NA}: only a local network's dev chain is published", "na"),)]
    lines = [tuple(line) for line in miner_lines(chain, hotkey)]
    if len(lines) == 1 and lines[0] and lines[0][0].style == "error":
        lines.append(
            (
                Cell("  → fix: ", "error"),
                Cell(f"register the hotkey on netuid {count_text(chain.netuid)} (btcli subnet register)"),
            )
        )
    return lines
