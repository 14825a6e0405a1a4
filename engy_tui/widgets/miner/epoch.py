"""The miner's newest published epoch: did a settlement gate zero it, by how much, and when can the
next epoch restore it?

From `MinerState.epoch` (`engy_node.miner.epoch_watch`, which asks the miner's gateway and
explains each gated row with `engy_node.protocol.gates`). A gated row is an error: the miner
served all epoch and earns nothing for it, which the chain block alone shows only as an
incentive of 0 and no validator weighting it. So the chain box gets a one-line summary (the
epoch's weight, or the gate), and the link box's notes the explanation: the gate and model,
the measurement against its bar, the fix, and when the next epoch ends (how far off in time and
blocks) and its result is published.
"""

from __future__ import annotations

from engy_node.protocol.epoch import WEIGHT_MAX
from engy_node.protocol.gates import MinerEpoch, restore_text
from engy_tui.widgets.cells import NA, Cell
from engy_tui.widgets.miner.common import BAD, OK, WARN, Line

__all__ = [
    "epoch_notes",
    "epoch_summary",
]


def epoch_summary(epoch: MinerEpoch | None) -> Line | None:
    """`epoch 12: weight 0 of 65,535 ✘ gated: ttft_p99`; None before the first look."""
    if epoch is None:
        return None
    if epoch.index is None:
        return (Cell(f"epoch {NA}: {epoch.error or 'not published yet'}", "na"),)
    head = Cell(f"epoch {epoch.index}: ", "header")
    weight = NA if epoch.weight is None else f"{epoch.weight:,}"
    if epoch.gated:
        gates = ", ".join(sorted({finding.gate for finding in epoch.gated}))
        return (head, Cell(f"weight {weight} of {WEIGHT_MAX:,} {BAD} gated: {gates}", "error"))
    if epoch.rows == 0:
        return (head, Cell("no paid traffic, weight 0", "na"))
    return (head, Cell(f"weight {weight} of {WEIGHT_MAX:,} {OK}", "ok"))


def epoch_notes(epoch: MinerEpoch | None, *, now: float, block_s: float) -> list[Line]:
    """Each gated row with its measurement and fix, then the next chance (how far off in blocks
    of the chain's `block_s` seconds); a failed look (kept beside the last answer) as a warning."""
    if epoch is None:
        return []
    notes: list[Line] = []
    for finding in epoch.gated:
        notes += [
            (
                Cell(
                    f"{BAD} epoch {epoch.index}: the {finding.gate} gate zeroed {finding.model or NA}: {finding.text}",
                    "error",
                ),
            ),
            (Cell("  → fix: ", "error"), Cell(finding.fix)),
        ]
    if epoch.gated:
        restore = restore_text(epoch, now=now, block_s=block_s)
        notes.append((Cell("  → next chance: ", "error"), Cell(restore or "the next epoch (its end not told)")))
    if epoch.error and epoch.index is not None:
        notes.append((Cell(f"{WARN} the last look at the epoch failed: {epoch.error}", "warning"),))
    return notes
