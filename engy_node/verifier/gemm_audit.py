"""The verifier's GEMM audit (issue 32; docs/verification.md): which committed activations to
open (`draw_picks`) and the verdict on what came back (`judge_openings`).

The order matters. The miner commits first (the answer's ``gemm_commitment`` root); only then
does the verifier draw the picks, from a secret the miner never sees and the root itself, so the
miner cannot know ahead which positions and layers it must have computed honestly. The picks
for one (position, layer) open every group its checks read — each projection's input and output,
the residual stream into and out of the layer — so the layer is checked end to end, not one
matrix in isolation: `gemm_check.freivalds` and `row_check` on each of the seven projections
against the verifier's own weights, then `replay_layer` on the steps between them.

What it costs to fool. A miner that ran a fraction f of (position, layer) slots some other way
than the committed weights passes a plan of P positions × L layers with probability about
(1 − f)^(P·L); the default plan (4 × 2) opens 8 of SmolLM2's 30 × positions slots, so a miner
cheating on every slot of half the layers is caught at 1 − 2⁻⁸ per audited answer, and one
cheating on every slot (other weights, a quantised model) at once. The checks themselves miss a
slot they open with probability ≤ 2⁻⁴⁰ (`gemm_check`).

Verdicts, and whose fault each is: a commitment that is not this answer's (another model's
layout, a count of positions other than prompt + output − 1), an opening missing, extra, or off
its Merkle path, or a check that fails is the miner's doing — `cheat`, reason the step (kebab
case: ``commitment``, ``opening``, ``q-proj`` for Freivalds on q, ``rows-q-proj`` for the row
check, ``input-norm`` ...). No openings at all (a miner that went away, a record that expired)
has honest causes — `unproven`, ``no-opening``, watched as a rate like any unproven. A
commitment this node cannot read (another format version) is `unproven` too.

Shape. `draw_picks` and `judge_openings` are pure functions of their arguments; the randomness
is the caller's secret expanded by SHAKE-256, so the same secret and root always give the same
picks. `GemmModel` holds what judging needs per model — the projections' weights (float32, shared
with a float32 runner rather than copied; widened to float64 one matrix at a time by the checks),
the two RMSNorm weights, and the Freivalds keys (σᵀW, from a secret drawn once per process).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from engy_node.gemm.activations import GEMMS, LLAMA_GROUPS, RESIDUAL_OUT, ActivationLayout, Commitment
from engy_node.protocol.gemm import GemmPick


@dataclasses.dataclass(frozen=True, slots=True)
class AuditPlan:
    """How much one audit opens."""

    positions: int = 4
    """Token positions drawn (at least one in the prompt, one generated, when both exist and
    the caller says where the prompt ends)."""
    layers: int = 2
    """Layers drawn per position."""

    def __post_init__(self) -> None:
        if self.positions < 1 or self.layers < 1:
            raise ValueError(f"an audit plan opens at least one position and one layer, got {self}")


DEFAULT_PLAN = AuditPlan()

LAYER_GROUPS = (*LLAMA_GROUPS, RESIDUAL_OUT)
"""What one (position, layer) opens: every group of the layer and its output (the next layer's
``residual_in``, or the last layer's ``residual_out``)."""


class _Draws:
    """Uniform integers from SHAKE-256 of (secret, root, label): 8 bytes a draw, so the modulo
    bias is below n / 2⁶⁴ (nothing for positions and layers)."""

    def __init__(self, secret: bytes, root: bytes, label: str, count: int) -> None:
        self._stream = hashlib.shake_256(secret + b"\0" + root + b"\0" + label.encode()).digest(8 * count)
        self._next = 0

    def below(self, bound: int) -> int:
        value = int.from_bytes(self._stream[self._next : self._next + 8], "big")
        self._next += 8
        return value % bound

    def sample(self, population: Sequence[int], k: int) -> list[int]:
        """k distinct items (all when k ≥ len): a partial Fisher–Yates shuffle."""
        items = list(population)
        k = min(k, len(items))
        for i in range(k):
            j = i + self.below(len(items) - i)
            items[i], items[j] = items[j], items[i]
        return items[:k]


def draw_positions(
    secret: bytes, root: bytes, positions: int, plan: AuditPlan, prompt_positions: int | None = None
) -> list[int]:
    """`plan.positions` distinct positions of `positions` (all when there are fewer), sorted. With
    `prompt_positions` (the prompt's length) one is drawn among the prompt's and one among the
    generated ones when both exist, the rest among all that are left."""
    draws = _Draws(secret, root, "positions", 2 * plan.positions + 2)
    chosen: list[int] = []
    if prompt_positions is not None and 0 < prompt_positions < positions and plan.positions >= 2:
        chosen = [draws.sample(range(prompt_positions), 1)[0], draws.sample(range(prompt_positions, positions), 1)[0]]
    rest = [p for p in range(positions) if p not in chosen]
    return sorted(chosen + draws.sample(rest, plan.positions - len(chosen)))


def draw_picks(
    secret: bytes,
    commitment: Mapping[str, Any],
    plan: AuditPlan = DEFAULT_PLAN,
    *,
    prompt_positions: int | None = None,
) -> tuple[GemmPick, ...]:
    """The picks of one audit: deterministic from (`secret`, the commitment's activations_root).
    For each drawn position, `plan.layers` distinct layers, and for each (position, layer) every
    group its checks read, at its canonical slot, each once, in leaf order. `prompt_positions`
    (the prompt's length) makes sure a prompt and a generated position are among them.
    Raises `CommitmentError` on a malformed commitment."""
    parsed = Commitment.from_wire(commitment)
    layout = parsed.layout
    positions = draw_positions(secret, parsed.root, parsed.positions, plan, prompt_positions)
    slots: set[tuple[int, int, str]] = set()
    for position in positions:
        for layer in _Draws(secret, parsed.root, f"layers/{position}", plan.layers).sample(
            range(layout.layers), plan.layers
        ):
            slots.update((position, *layout.canonical(layer, group)) for group in LAYER_GROUPS)
    ordered = sorted(slots, key=lambda slot: layout.index(*slot))
    return tuple(GemmPick(*slot) for slot in ordered)


def audited_layers(layout: ActivationLayout, picks: Sequence[GemmPick]) -> dict[int, list[int]]:
    """The (position, layer) pairs `picks` open in full, as layer → positions (sorted): those
    with every group of `LAYER_GROUPS` picked at its canonical slot."""
    picked = {(pick.position, pick.layer, pick.group) for pick in picks}
    candidates = sorted({(pick.position, pick.layer) for pick in picks if pick.group in GEMMS["q_proj"]})
    audited: dict[int, list[int]] = {}
    for position, layer in candidates:
        if all((position, *layout.canonical(layer, group)) in picked for group in LAYER_GROUPS):
            audited.setdefault(layer, []).append(position)
    return dict(sorted(audited.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class GemmEvidence:
    """What the verifier role gathered for one job: the picks it drew and the openings the
    miner sent back for them."""

    picks: tuple[GemmPick, ...]
    openings: tuple[dict[str, Any], ...] | None
    """None: none came back."""
    failure: str | None = None
    """Why none came back (timeout, the miner's error, ...), for the log."""
