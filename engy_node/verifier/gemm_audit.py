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

Rows. Freivalds with one secret vector catches any single row off by more than its bound, but
its bound is the whole product's (Hoeffding over every row's rounding), so errors spread thinly
over every row — dense weight noise, 8-bit weights — hide under it. Those move almost every row
past that row's own bound (`gemm_check.row_check`, never exceeded honestly), so the verifier
recomputes `ROWS_CHECKED` rows of each audited projection, drawn from its secret and the root
after the commitment: a cheat that moves a fraction g of rows escapes one projection with
probability (1 − g)^ROWS_CHECKED, and an audit opens 8 (position, layer) pairs of seven. Eight
rows is plenty for every cheat measured (bench/gemm_rows.py): 8-bit weights move at least a third
of every projection's rows, noise of 1e-2 more than half, and even noise of 1e-3, the thinnest, a
median of a sixth, so an audit misses it with probability about 6e-37 (docs/verification.md,
"How many rows"); reading the rows is most of the judging's cost. A cheat moving only a small
fraction of rows by less than Freivalds' bound (1 % of them: missed by an audit with probability
about 0.01) is caught across audits, not in one.

Cost, on SmolLM2 with the default plan (about 24 openings, 8 audited layers): the Merkle paths
(verified together, each node the paths share hashed once), the Freivalds products (two dot
products per token and projection) and 8 rows of each projection recomputed in float64, most of
it reading those rows from memory (7 × 8 rows per audited layer, 0.16 MB of float32). Every
audited (position, layer) is checked in the same few calls, each against its own layer's keys,
rows and norms, rather than one layer and one projection at a time, and Freivalds and the row
check are compiled loops (`gemm_kernels`) that read each value once: per-call overhead and
numpy's temporaries, not arithmetic, were most of the cost (bench/gemm_judge.py times it by step
against an earlier revision; bench/gemm_audit.py per answer beside TOPLOC). Building the
`GemmModel` takes about 2.5 s once per model and little memory beyond a float32 runner.

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
with a float32 runner rather than copied, and read in place by the row check's loop),
every layer's two RMSNorm weights, and the Freivalds keys (σᵀW, from a secret drawn once per
process), stacked by layer and joined across the seven projections (`gemm_check.KeyStack`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from engy_node.gemm.activations import (
    FORMAT,
    GEMMS,
    LAYOUTS_CACHED,
    LLAMA_GROUPS,
    RESIDUAL_OUT,
    ActivationLayout,
    Commitment,
    CommitmentError,
    Opening,
    decode_values,
    llama_layout,
    verify_openings,
)
from engy_node.proof import VerdictKind
from engy_node.protocol.gemm import GemmPick
from engy_node.verifier import gemm_check, gemm_kernels


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


def draw_rows(secret: bytes, root: bytes, label: str, rows: int, k: int) -> list[int]:
    """k distinct row indices below `rows` (all when k ≥ rows), sorted: draws with repeats
    dropped, which for k ≪ rows costs k draws where a shuffle would touch every row."""
    if 4 * k > rows:
        return sorted(_Draws(secret, root, label, k).sample(range(rows), k))
    stream = hashlib.shake_256(secret + b"\0" + root + b"\0" + label.encode())
    chosen: dict[int, None] = {}
    drawn = 0
    while len(chosen) < k:
        # Each batch is a longer prefix of the same stream, so the draw does not depend on how
        # many batches it took.
        values = np.frombuffer(stream.digest(8 * (drawn + 2 * k)), "<u8")[drawn:]
        drawn += 2 * k
        for value in (values % np.uint64(rows)).tolist():
            chosen.setdefault(value)
            if len(chosen) == k:
                break
    return sorted(chosen)


def draw_row_sets(
    secret: bytes, root: bytes, labels: Sequence[str], rows: Sequence[int], k: int
) -> list[npt.NDArray[np.intp]]:
    """`draw_rows` for each label (with its count of rows), the same draws, in one pass over
    all of them: each label's stream is cut to its first 2k draws, and the first k distinct
    values of each are found by one compiled loop (`gemm_kernels.first_distinct`); a label whose
    2k draws hold fewer (or with k > rows / 4) is drawn by `draw_rows` itself."""
    drawn: dict[int, npt.NDArray[np.intp]] = {}
    batched = [i for i, count in enumerate(rows) if 4 * k <= count]
    if batched:
        streams = b"".join(
            hashlib.shake_256(secret + b"\0" + root + b"\0" + labels[i].encode()).digest(16 * k) for i in batched
        )
        values = gemm_kernels.ready(np.frombuffer(streams, "<u8").reshape(len(batched), 2 * k))
        counts = np.array([rows[i] for i in batched], np.uint64)
        for i, chosen in zip(batched, gemm_kernels.first_distinct(values, counts, k), strict=True):
            if chosen[0] >= 0:
                drawn[i] = chosen
    return [
        drawn[i] if i in drawn else np.array(draw_rows(secret, root, labels[i], rows[i], k), np.intp)
        for i in range(len(labels))
    ]


def draw_positions(
    secret: bytes,
    root: bytes,
    positions: int,
    plan: AuditPlan,
    prompt_positions: int | None = None,
    start: int = 0,
) -> list[int]:
    """`plan.positions` distinct committed positions, `start` … `positions` − 1 (all when there
    are fewer), sorted. With `prompt_positions` (the prompt's length) one is drawn among the
    prompt's committed ones and one among the generated ones when both exist, the rest among
    all that are left."""
    draws = _Draws(secret, root, "positions", 2 * plan.positions + 2)
    chosen: list[int] = []
    if prompt_positions is not None and start < prompt_positions < positions and plan.positions >= 2:
        chosen = [
            draws.sample(range(start, prompt_positions), 1)[0],
            draws.sample(range(prompt_positions, positions), 1)[0],
        ]
    rest = [p for p in range(start, positions) if p not in chosen]
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
    leaf holding a group its checks read (`ActivationLayout.canonical`), each once, in leaf order.
    `prompt_positions` (the prompt's length) makes sure a prompt and a generated position are
    among them.
    Raises `CommitmentError` on a malformed commitment."""
    parsed = Commitment.from_wire(commitment)
    layout = parsed.layout
    positions = draw_positions(secret, parsed.root, parsed.positions, plan, prompt_positions, parsed.start)
    leaves = layout.leaves_per_position
    slots: dict[tuple[int, int, str], int] = {}
    for position in positions:
        for layer in _Draws(secret, parsed.root, f"layers/{position}", plan.layers).sample(
            range(layout.layers), plan.layers
        ):
            slots.update(
                ((position, *leaf), position * leaves + offset) for leaf, offset in _layer_leaves(layout)[layer]
            )
    return tuple(GemmPick(*slot) for slot in sorted(slots, key=slots.__getitem__))


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _group_bytes(layout: ActivationLayout) -> tuple[tuple[tuple[tuple[int, str], int, int], ...], ...]:
    """Per layer, per group of `LAYER_GROUPS`: its leaf and its bytes there (`locate`)."""
    return tuple(tuple(layout.locate(layer, group) for group in LAYER_GROUPS) for layer in range(layout.layers))


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _layer_leaves(layout: ActivationLayout) -> tuple[tuple[tuple[tuple[int, str], int], ...], ...]:
    """Per layer, the leaves holding the groups of `LAYER_GROUPS` (`_group_bytes`), each once,
    with its offset within a position: looked up per pick, built once per layout."""
    return tuple(
        tuple((leaf, layout.index(0, *leaf)) for leaf in dict.fromkeys(leaf for leaf, _, _ in located))
        for located in _group_bytes(layout)
    )


def audited_layers(layout: ActivationLayout, picks: Sequence[GemmPick]) -> dict[int, list[int]]:
    """The (position, layer) pairs `picks` open in full, as layer → positions (sorted): those
    with every leaf holding a group of `LAYER_GROUPS` picked."""
    picked = {(pick.position, pick.layer, pick.group) for pick in picks}
    q_leaf = layout.canonical(0, "q")[1]
    candidates = sorted({(pick.position, pick.layer) for pick in picks if pick.group == q_leaf})
    audited: dict[int, list[int]] = {}
    for position, layer in candidates:
        if not 0 <= layer < layout.layers:
            layout.canonical(layer, LAYER_GROUPS[0])  # raises, naming the layers there are
        if all((position, *leaf) in picked for leaf, _ in _layer_leaves(layout)[layer]):
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


# ---- judging ------------------------------------------------------------------------------

FREIVALDS_VECTORS = 1
"""Secret vectors per matrix: one bounds a wrong weight's escape at 2⁻⁴⁰ (`gemm_check`, bound
(b))."""
ROWS_CHECKED = 8
"""Rows of each audited projection recomputed outright (module docstring, "Rows")."""

BLOCKS = {name: "self_attn" if name[0] in "qkvo" else "mlp" for name in GEMMS}
"""The module holding each projection in a transformers Llama decoder layer."""

Weights = npt.NDArray[np.float32]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GemmModel:
    """What judging one model's openings needs, built once per model (`gemm_model_of`)."""

    config: Mapping[str, Any]
    """The checkpoint's config.json fields (its `llama_layout`)."""
    weights: Mapping[tuple[int, str], Weights]
    """(layer, projection) → W, m × n, float32 (exact for a bf16, fp16 or fp32 checkpoint)."""
    eps: float
    keys: gemm_check.KeyStack
    """The Freivalds keys from the verifier's secret: one entry per layer, the seven projections
    side by side in `GEMMS` order, so one check takes each audited token's own layer's keys."""
    secret: bytes
    """The verifier's secret, which also draws the rows the row check recomputes."""
    norms: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]
    """The input and post-attention RMSNorm weights of every layer, layers × hidden, float64."""
    matrices: Mapping[str, gemm_kernels.Matrices]
    """Per projection, `weights` of every layer in order, as the row check's compiled loop reads
    them (the same arrays, not copies)."""

    @classmethod
    def build(
        cls,
        config: Mapping[str, Any],
        weights: Mapping[tuple[int, str], Weights],
        norms: Sequence[tuple[Weights, Weights]],
        eps: float,
        *,
        secret: bytes,
        vectors: int = FREIVALDS_VECTORS,
    ) -> GemmModel:
        layers = sorted({layer for layer, _ in weights})
        if layers != list(range(len(norms))):
            raise ValueError(f"weights for layers {layers} and norms for {len(norms)}: a model's every layer, from 0")
        keys = gemm_check.KeyStack.joined(
            [
                gemm_check.KeyStack.of(
                    [
                        gemm_check.verifier_key(
                            weights[layer, name],
                            gemm_check.draw_signs(secret, f"{layer}.{name}", vectors, weights[layer, name].shape[0]),
                        )
                        for layer in layers
                    ]
                )
                for name in GEMMS
            ]
        )
        stacked = (
            np.stack([np.asarray(first, np.float64) for first, _ in norms]),
            np.stack([np.asarray(second, np.float64) for _, second in norms]),
        )
        matrices = {name: gemm_kernels.matrices([weights[layer, name] for layer in layers]) for name in GEMMS}
        gemm_kernels.warm()
        return cls(dict(config), dict(weights), float(eps), keys, secret, stacked, matrices)

    def layout(self, dtype: str, format: str = FORMAT) -> ActivationLayout:
        return llama_layout(self.config, dtype, format)


def gemm_model_of(runner: Any, *, secret: bytes | None = None) -> GemmModel:
    """The `GemmModel` of a loaded `serve.engine.ModelRunner`: its projections and norms as
    float32 on the CPU (a float32 CPU runner's own memory, not a copy), keys from `secret`
    (default: 32 fresh random bytes, so each process has its own)."""
    import torch

    def cpu32(tensor: Any) -> Weights:
        array: Weights = tensor.detach().to("cpu", torch.float32).numpy()
        return array

    model = runner.model
    weights = {}
    norms = []
    for index, layer in enumerate(model.model.layers):
        for name, block in BLOCKS.items():
            weights[index, name] = cpu32(getattr(getattr(layer, block), name).weight)
        norms.append((cpu32(layer.input_layernorm.weight), cpu32(layer.post_attention_layernorm.weight)))
    config = model.config
    return GemmModel.build(
        config.to_dict(), weights, norms, config.rms_norm_eps, secret=os.urandom(32) if secret is None else secret
    )


class LayerCheck(NamedTuple):
    """One check on one audited layer: `worst` is the largest |discrepancy| / tolerance. A
    named tuple: an audit makes one per step and layer (160 on SmolLM2's default plan), and a
    frozen dataclass's constructor cost as much as Freivalds on all of them."""

    layer: int
    step: str
    """Kebab-case: `q-proj` (Freivalds), `rows-q-proj` (every row recomputed), `input-norm` ..."""
    worst: float
    position: int
    """The token position with the worst ratio; -1 when none."""

    @property
    def passed(self) -> bool:
        return self.worst <= 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class GemmJudgement:
    kind: VerdictKind
    reason: str
    checks: tuple[LayerCheck, ...] = ()

    @property
    def failed(self) -> LayerCheck | None:
        """The first check that failed (the one `reason` names)."""
        return next((check for check in self.checks if not check.passed), None)


@functools.cache
def step_code(step: str) -> str:
    """A check's step as a verdict reason: kebab-case ASCII, at most 40 characters."""
    return re.sub(r"[^a-z0-9]+", "-", step.lower().replace("_", "-")).strip("-")[:40]


def judge_openings(
    model: GemmModel,
    commitment: Mapping[str, Any],
    evidence: GemmEvidence,
    *,
    expected_positions: int,
    prompt_positions: int | None = None,
) -> GemmJudgement:
    """The verdict on one answer's openings: the commitment must be this model's layout over
    `expected_positions` (prompt + output − 1), starting inside the prompt (`prompt_positions`,
    its length, when given: a cached prefix never covers the whole prompt), every pick opened
    exactly once on its Merkle path, and each audited layer's projections and steps between them
    must pass their checks. Pure."""
    try:
        parsed = Commitment.from_wire(commitment)
    except CommitmentError:
        return GemmJudgement("unproven", "malformed-commitment")
    layout = parsed.layout
    if layout != model.layout(layout.dtype, layout.format) or parsed.positions != expected_positions:
        return GemmJudgement("cheat", "commitment")
    if prompt_positions is not None and parsed.start >= prompt_positions:
        return GemmJudgement("cheat", "commitment")
    if evidence.openings is None:
        return GemmJudgement("unproven", "no-opening")
    audited = audited_layers(layout, evidence.picks)
    if not audited:
        return GemmJudgement("unproven", "no-picks")
    rows = _verified_rows(parsed, evidence)
    if rows is None:
        return GemmJudgement("cheat", "opening")
    checks = _checks(model, parsed, audited, rows, gemm_check.ARITHMETIC[layout.dtype])
    failed = next((check for check in checks if not check.passed), None)
    if failed is not None:
        return GemmJudgement("cheat", failed.step, checks)
    return GemmJudgement("pass", "ok", checks)


def _verified_rows(commitment: Commitment, evidence: GemmEvidence) -> dict[tuple[int, int, str], bytes] | None:
    """Each pick's opened row (its raw bytes), or None when an opening is malformed, off its
    path, missing, repeated, or was not asked for."""
    wanted = {(pick.position, pick.layer, pick.group) for pick in evidence.picks}
    rows: dict[tuple[int, int, str], bytes] = {}
    openings = []
    for wire in evidence.openings or ():
        try:
            opening = Opening.from_wire(wire)
        except (CommitmentError, TypeError):
            return None
        slot = (opening.position, opening.layer, opening.group)
        if slot not in wanted or slot in rows:
            return None
        rows[slot] = opening.data
        openings.append(opening)
    if rows.keys() != wanted or not verify_openings(commitment, openings):
        return None
    return rows


def _recomputed_rows(
    model: GemmModel,
    root: bytes,
    audited: Mapping[int, list[int]],
    projections: Mapping[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]],
    arithmetic: gemm_check.Arithmetic,
) -> list[tuple[str, npt.NDArray[np.float64]]]:
    """The row check of every projection: `ROWS_CHECKED` rows of each audited layer's matrix,
    drawn from the secret and the root, recomputed for every audited position of the layer
    straight from the verifier's float32 weights."""
    labels = [(name, layer) for name in projections for layer in audited]
    sizes = [model.weights[layer, name].shape[0] for name, layer in labels]
    drawn = draw_row_sets(model.secret, root, [f"rows/{layer}/{name}" for name, layer in labels], sizes, ROWS_CHECKED)
    chosen = dict(zip(labels, drawn, strict=True))
    layers = np.array([layer for layer, positions in audited.items() for _ in positions], np.intp)
    steps = []
    for name, (x, y) in projections.items():
        picked = np.stack([chosen[name, layer] for layer, positions in audited.items() for _ in positions])
        ratios = gemm_check.drawn_row_ratios(model.matrices[name], layers, picked, x, y, arithmetic)
        steps.append((f"rows {name}", ratios))
    return steps


def _stacked_groups(
    layout: ActivationLayout, pairs: Sequence[tuple[int, int]], rows: Mapping[tuple[int, int, str], bytes]
) -> dict[str, npt.NDArray[np.float64]]:
    """Every group of `LAYER_GROUPS`, its values at each (layer, position) of `pairs` as a row:
    the leaves holding them decoded once for all pairs (a v2 ``gemms`` leaf holds eleven groups,
    which are then column ranges of one array)."""
    located = _group_bytes(layout)
    item = layout.item_size
    decoded: dict[tuple[tuple[int, int, str], ...], npt.NDArray[np.float64]] = {}
    values = {}
    for at, group in enumerate(LAYER_GROUPS):
        leaves = tuple((position, *located[layer][at][0]) for layer, position in pairs)
        block = decoded.get(leaves)
        if block is None:
            data = b"".join(rows[leaf] for leaf in leaves)
            block = decoded[leaves] = decode_values(layout.dtype, data).reshape(len(pairs), -1)
        # Every layer of a layout has the same groups and widths, so a group's bytes sit at the
        # same place in its leaf whichever layer the pair is.
        _, start, end = located[pairs[0][0]][at]
        values[group] = block[:, start // item : end // item]
    return values


def _checks(
    model: GemmModel,
    commitment: Commitment,
    audited: Mapping[int, list[int]],
    rows: Mapping[tuple[int, int, str], bytes],
    arithmetic: gemm_check.Arithmetic,
) -> tuple[LayerCheck, ...]:
    """Every audited (position, layer) checked at once, each against its own layer's keys, rows
    and norms: Freivalds on each projection, `ROWS_CHECKED` rows of each recomputed, then the
    layer's replay. The checks come out per layer, in that order, each the worst over the
    layer's audited positions."""
    layout = commitment.layout
    pairs = [(layer, position) for layer, positions in audited.items() for position in positions]
    layers = np.array([layer for layer, _ in pairs], np.intp)

    values = _stacked_groups(layout, pairs, rows)
    projections = {name: (values[x], values[y]) for name, (x, y) in GEMMS.items()}
    inputs = np.concatenate([x for x, _ in projections.values()], axis=1)
    outputs = np.concatenate([y for _, y in projections.values()], axis=1)
    freivalds = gemm_check.freivalds_ratios(model.keys, inputs, outputs, arithmetic, entries=layers)
    steps = [(name, freivalds[:, index]) for index, name in enumerate(projections)]
    steps += _recomputed_rows(model, commitment.root, audited, projections, arithmetic)
    trace = gemm_check.LayerTrace(projections, values["residual_in"], values[RESIDUAL_OUT])
    input_norm, post_norm = (norms[layers] for norms in model.norms)
    steps += gemm_check.replay_ratios(trace, input_norm, post_norm, model.eps, arithmetic)
    codes = [step_code(step) for step, _ in steps]
    # A NaN ratio fails (as inf): the checks map theirs already, and a NaN would match no worst.
    table = np.nan_to_num(np.stack([per_pair for _, per_pair in steps]), nan=np.inf, posinf=np.inf)
    # Each layer's worst position per step: the audited positions of a layer are adjacent
    # columns, so one reduceat finds every layer's worst ratio, and the first column holding it
    # (the argmax rule) is its position.
    counts = [len(positions) for positions in audited.values()]
    starts = np.cumsum([0, *counts])[:-1]
    worst = np.maximum.reduceat(table, starts, axis=1)
    owner = np.repeat(np.arange(len(counts)), counts)
    column = np.where(table == worst[:, owner], np.arange(len(pairs)), len(pairs))
    first = np.minimum.reduceat(column, starts, axis=1)
    where = [position for _, position in pairs]
    return tuple(
        LayerCheck(layer, code, ratio, where[index])
        for layer, ratios, indexes in zip(audited, worst.T.tolist(), first.T.tolist(), strict=True)
        for code, ratio, index in zip(codes, ratios, indexes, strict=True)
    )
