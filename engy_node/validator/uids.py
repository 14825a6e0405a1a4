"""From a verified hotkey vector to what `SetWeights` takes, and what to submit when that lands
nothing (docs/validator.md). Pure: the metagraph's hotkeys come in as a sequence indexed by uid, read fresh
by the caller on the same connection it submits on.

What it trusts. The vector (already verified or read back from validated state) for its hotkeys
and weights; the metagraph for which hotkeys are registered and at which uid. Hotkeys the chain
does not know are dropped, never guessed at, and `Resolution` reports their share of the weight
so the caller can log how much of the distribution went missing: ten zero-weight strangers are
nothing, one hotkey holding 40% reshapes it.

No renormalisation here. The values stay the payload's u16 weights; the SDK max-upscales every
row to u16 before it submits (bittensor 11's weight conforming before `set_weights`), and the chain uses only
the proportions within a row, so scaling here as well would add a second rounding and nothing
else.

Failure posture. A vector that lands nothing would make the loop go silent, which is exactly what
the resubmit schedule exists to prevent: past the activity cutoff the chain drops this validator
from consensus. `standby` picks the fallback: the last vector this validator landed (miners keep
the weights they already had), else a burn to the subnet owner (which changes the distribution,
so it comes last), else nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from engy_node.protocol.epoch import WEIGHT_MAX

Weights = Sequence[tuple[str, int]]
StandbyKind = Literal["standby:cached", "standby:burn"]


@dataclasses.dataclass(frozen=True, slots=True)
class Resolution:
    """A vector mapped onto the metagraph: parallel `uids` and `values`, in the vector's order."""

    uids: tuple[int, ...]
    values: tuple[int, ...]
    """The vector's weights for `uids`, unscaled; zero weights are left out."""
    dropped: tuple[str, ...]
    """Hotkeys of the vector not registered on chain, in the vector's order."""
    dropped_share: float
    """The dropped hotkeys' share of the vector's total weight, 0..1 (0 for an all-zero vector)."""

    @property
    def lands(self) -> bool:
        """Whether submitting would put any weight on chain."""
        return any(value > 0 for value in self.values)


def resolve(weights: Weights, hotkeys_by_uid: Sequence[str]) -> Resolution:
    """Map `weights` onto uids by `hotkeys_by_uid` (the metagraph's hotkeys, index = uid).

    Raises ValueError if a hotkey appears twice in `weights`: both would map to one uid, which the
    chain refuses. Verified payloads and validated state never repeat one.
    """
    # The chain never registers one hotkey at two uids of a subnet; were a metagraph read to show
    # it, the last uid wins, as in the public validator.
    uid_by_hotkey = {hotkey: uid for uid, hotkey in enumerate(hotkeys_by_uid)}
    seen: set[str] = set()
    uids: list[int] = []
    values: list[int] = []
    dropped: list[str] = []
    dropped_weight = 0
    for hotkey, weight in weights:
        if hotkey in seen:
            raise ValueError(f"hotkey {hotkey} appears more than once in the weight vector")
        seen.add(hotkey)
        uid = uid_by_hotkey.get(hotkey)
        if uid is None:
            dropped.append(hotkey)
            dropped_weight += weight
        elif weight > 0:
            uids.append(uid)
            values.append(weight)
    total = sum(weight for _, weight in weights)
    return Resolution(
        uids=tuple(uids),
        values=tuple(values),
        dropped=tuple(dropped),
        dropped_share=dropped_weight / total if total > 0 else 0.0,
    )


def burn_target(weights: Weights) -> str | None:
    """The hotkey that receives everything when `weights` is a burn, else None.

    A burn is one hotkey holding all the weight: the provider publishes `[[owner, 65535]]` for an
    epoch with no billed traffic. Zero-weight rows do not count, as in the public validator, since
    a vector may list scored-but-zero miners beside it. The caller warns when the target is not
    the subnet owner the chain names: a burn to an unregistered hotkey lands nothing, and one to
    a registered but wrong hotkey pays that hotkey with nothing else to show for it.
    """
    holders = [hotkey for hotkey, weight in weights if weight > 0]
    return holders[0] if len(holders) == 1 else None


def standby(
    *,
    cached: Weights | None,
    hotkeys_by_uid: Sequence[str],
    owner_hotkey: str | None,
    cache_already_tried: bool,
) -> tuple[StandbyKind, tuple[tuple[str, int], ...]] | None:
    """What to submit instead of a vector that lands nothing, with its kind, or None when nothing
    would land either.

    `cache_already_tried` is true when the vector that failed to land was the cache itself (the
    provider was unreachable): trying it again cannot help. `owner_hotkey` is the subnet owner as
    the chain names it; None when it could not be read, which rules out the burn.
    """
    if not cache_already_tried and cached is not None and resolve(cached, hotkeys_by_uid).lands:
        return "standby:cached", tuple((hotkey, weight) for hotkey, weight in cached)
    if owner_hotkey is not None and owner_hotkey in hotkeys_by_uid:
        return "standby:burn", ((owner_hotkey, WEIGHT_MAX),)
    return None
