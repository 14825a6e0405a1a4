"""Where this validator stands on chain, as the blocks of its tab read it: its own neuron (uid,
permit, last update, registered or not), the chain's head block and block time, and how many
blocks have passed since its last submit, before the next resubmit and since the chain last saw
it. The weights box, the next action and the warnings all ask these, so they are read here once.

When the chain state is at hand (a local network's dev chain) its head block is used, since it is
published every second; otherwise the validator's last chain read is used, moved on by the wall
clock since its last tick and marked as an estimate.

The activity cutoff warns once more than half of it has passed since the chain last saw this
validator (a healthy one resubmits every ~2% of it), and is an error once it has passed.
"""

from __future__ import annotations

import dataclasses
import math

from engy_node.snapshots import ChainState, ValidatorState
from engy_tui.widgets.cells import as_number as _num

__all__ = [
    "OwnNeuron",
    "block_seconds",
    "blocks_since_submit",
    "head_block",
    "idle_blocks",
    "own_neuron",
    "resubmit_left",
]


@dataclasses.dataclass(frozen=True, slots=True)
class OwnNeuron:
    """This validator's own neuron: from the chain state when it lists the hotkey (fresher),
    else from the validator's last chain read."""

    uid: int | None
    permit: bool | None
    last_update: int | None
    registered: bool | None
    """None: not known (no chain read yet)."""


def own_neuron(validator: ValidatorState, chain: ChainState | None) -> OwnNeuron:
    hotkey = validator.hotkey
    neurons = chain.neurons if chain is not None else ()
    if hotkey is not None and neurons:
        mine = next((n for n in neurons if n.hotkey == hotkey), None)
        if mine is None:
            return OwnNeuron(None, None, None, False)
        return OwnNeuron(mine.uid, mine.permit, mine.last_update, True)
    uid = validator.uid
    # The loop publishes uid=None with each chain read's block when the read did not find the
    # hotkey; before any read there is no block.
    registered = True if uid is not None else False if validator.block is not None else None
    return OwnNeuron(uid, validator.permit, validator.last_update, registered)


def head_block(validator: ValidatorState, chain: ChainState | None) -> tuple[int | None, bool]:
    """The chain's head block, and whether it is current (the chain state's, published every
    second) rather than the validator's last read."""
    if chain is not None and chain.block is not None:
        return chain.block, True
    return validator.block, False


def block_seconds(validator: ValidatorState, chain: ChainState | None) -> float | None:
    for seconds in (chain.block_time_s if chain is not None else None, validator.block_time_s):
        seconds = _num(seconds)  # finite
        if seconds is not None and seconds > 0:
            return seconds
    return None


def blocks_since_submit(validator: ValidatorState, chain: ChainState | None) -> int | None:
    head, current = head_block(validator, chain)
    last = validator.last_submit_block
    if current and head is not None and last is not None:
        return head - last
    return validator.blocks_since_submit


def resubmit_left(validator: ValidatorState, chain: ChainState | None, now: float) -> tuple[int | None, bool]:
    """Blocks until the next resubmission is due (negative: overdue), and whether it is an
    estimate (no current head: the validator's count at its last tick, moved on by the clock)."""
    head, current = head_block(validator, chain)
    last = validator.last_submit_block
    interval = validator.resubmit_blocks
    if current and head is not None and last is not None and interval is not None:
        return last + interval - head, False
    left = validator.next_resubmit_in_blocks
    if left is None:
        return None, False
    tick = _num(validator.last_tick)
    block_s = block_seconds(validator, chain)
    if tick is None or block_s is None or not math.isfinite(now) or now < tick:
        return left, False
    try:
        passed = int((now - tick) / block_s)
    except (OverflowError, ValueError):
        return left, False
    return left - passed, passed > 0


def idle_blocks(validator: ValidatorState, chain: ChainState | None) -> int | None:
    """Blocks since the chain last saw this validator (its last_update), else since its last
    submit as the validator counts them."""
    head, _ = head_block(validator, chain)
    last_update = own_neuron(validator, chain).last_update
    if head is not None and last_update is not None:
        return head - last_update
    return blocks_since_submit(validator, chain)
