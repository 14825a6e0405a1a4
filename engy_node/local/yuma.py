"""One Yuma consensus epoch in pure Python: what the dev chain runs every tempo.

The dev chain (`devchain.py`) must turn the weights validators set into the incentive, dividends
and emission that the metagraph reports, so that a local network shows the same cause and effect
as the real chain: one validator weighting two miners 3:1 gives them incentive 0.75 and 0.25, a
validator that stops setting weights drops out, a validator without a permit counts for nothing.
It lives in the validator process, which must stay small, so this is plain Python over lists and
dicts (no numpy, no torch); at a subnet's 256 uids, with 64 validators weighting every miner, one
epoch takes about 10 ms.

The steps follow the chain's `epoch_mechanism` in `pallets/subtensor/src/epoch/run_epoch.rs`, in
its order:

1. Activity: uid i is inactive when `last_update[i] + activity_cutoff < current_block`.
2. Stake is normalised to sum 1.
3. Active stake = stake × active × permit (the owner always holds a permit), normalised.
4. Weights: rows of uids without a permit are dropped; the diagonal is dropped except the
   owner's self-weight (an owner "burn" counts); entries pointing at a uid registered at or after
   the row's last update are dropped (`last_update[i] <= block_at_registration[j]`); rows are
   normalised to sum 1.
5. Consensus per column: the κ-weighted median over the rows with active stake, i.e. the largest
   value c such that validators weighting the column at least c hold at least κ of active stake.
6. Weights are clipped to consensus; ranks = Wᵀ·S over the clipped weights; incentive = ranks
   normalised; validator trust = row sums of the clipped weights.
7. Dividends: each validator's share of every miner's bond delta (its clipped-or-not weight, per
   `bonds_penalty`, times its active stake, normalised per column) times that miner's incentive,
   normalised.
8. Emission: miners get incentive and validators dividends, both over the sum of incentive and
   dividends (so 50/50 when anything is weighted); when nothing is, validators share by active
   stake (by stake when no stake is active).

What it simplifies versus the chain:

* Floating point instead of I32F32/I64F64 fixed point: results differ from the chain's in about
  the fifth decimal, and a value converted to u16 can differ by one.
* Bonds have no history: dividends use this epoch's bond delta alone, i.e. the chain's classic
  bonds EMA with a moving average of 0 (Yuma3 and liquid alpha are not modelled). When weights
  stay the same epoch after epoch the chain's EMA converges to that delta, so the dividends agree
  in the steady state; what is lost is the reward for weighting a miner before others did.
* No stake threshold (the chain's `StakeThreshold` filter is taken as 0), no commit-reveal
  column mask (the dev chain never reveals commits), and the median is computed by sorting rather
  than the chain's pivot search, which returns the same value for exact inputs.
* Weights naming a uid outside `0..n-1` are ignored, as the chain ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

U16_MAX = 65535

# The chain's default kappa, 32767 as u16: a simple stake majority.
DEFAULT_KAPPA = 32767 / U16_MAX

# The chain's default number of validator permits per subnet.
DEFAULT_MAX_VALIDATORS = 64


@dataclass(frozen=True)
class EpochResult:
    """Everything one epoch computes, one entry per uid.

    Scores are fractions in 0..1. `server_emission` and `validator_emission` are the shares of the
    epoch's emission each uid earns as a miner and as a validator; `emission` is their sum and
    adds up to 1 whenever there is any stake. `trust` is the share of a miner's rank that survived
    clipping (the chain's former Trust column), `validator_trust` a validator's sum of clipped
    weights. `validator_permits` are the permits for the next epoch (top stake holders plus the
    owner).
    """

    active: tuple[bool, ...]
    stake: tuple[float, ...]
    active_stake: tuple[float, ...]
    consensus: tuple[float, ...]
    incentive: tuple[float, ...]
    trust: tuple[float, ...]
    validator_trust: tuple[float, ...]
    dividends: tuple[float, ...]
    server_emission: tuple[float, ...]
    validator_emission: tuple[float, ...]
    validator_permits: tuple[bool, ...]

    @property
    def emission(self) -> tuple[float, ...]:
        return tuple(server + validator for server, validator in zip(self.server_emission, self.validator_emission))


def run_epoch(
    weights: Mapping[int, Mapping[int, float]],
    stake: Sequence[float],
    *,
    validator_permits: Sequence[bool],
    last_update: Sequence[int],
    block_at_registration: Sequence[int],
    current_block: int,
    activity_cutoff: int,
    kappa: float = DEFAULT_KAPPA,
    owner_uid: int | None = None,
    bonds_penalty: float = 1.0,
    max_validators: int = DEFAULT_MAX_VALIDATORS,
) -> EpochResult:
    """Run one epoch over `n = len(stake)` uids.

    `weights` maps a setter's uid to its row `{target_uid: weight}` at any scale (u16 as stored
    on chain, or fractions); uids without a row set no weights. `validator_permits` are the
    permits in force during this epoch; `kappa` and `bonds_penalty` are fractions in 0..1 (the
    chain stores both as u16 over 65535). `owner_uid` is the uid of the subnet owner's hotkey,
    which always holds a permit and whose self-weight is kept.
    """
    n = len(stake)
    for name, column in (
        ("validator_permits", validator_permits),
        ("last_update", last_update),
        ("block_at_registration", block_at_registration),
    ):
        if len(column) != n:
            raise ValueError(f"{name} has {len(column)} entries for {n} uids")
    if not 0.0 <= kappa <= 1.0 or not 0.0 <= bonds_penalty <= 1.0:
        raise ValueError(f"kappa and bonds_penalty must be fractions in 0..1, got {kappa!r}, {bonds_penalty!r}")
    if any(s < 0 for s in stake):
        raise ValueError("stake must be non-negative")
    if owner_uid is not None and not 0 <= owner_uid < n:
        raise ValueError(f"owner_uid {owner_uid} is not one of the {n} uids")

    active = [updated + activity_cutoff >= current_block for updated in last_update]
    permits = [bool(p) or uid == owner_uid for uid, p in enumerate(validator_permits)]
    normalised_stake = _normalised([float(s) for s in stake])
    active_stake = _normalised([s if active[i] and permits[i] else 0.0 for i, s in enumerate(normalised_stake)])

    rows = _masked_rows(
        weights,
        n,
        permits=permits,
        owner_uid=owner_uid,
        last_update=last_update,
        block_at_registration=block_at_registration,
    )

    # Every uid with active stake votes in every column, a missing weight counting as 0.
    voters = [i for i in range(n) if active_stake[i] > 0]
    voter_rows = [rows.get(i, {}) for i in voters]
    voter_stake = [active_stake[i] for i in voters]
    consensus = [_kappa_median(voter_stake, [row.get(j, 0.0) for row in voter_rows], kappa) for j in range(n)]
    clipped = {i: {j: min(w, consensus[j]) for j, w in row.items() if consensus[j] > 0} for i, row in rows.items()}

    ranks = [0.0] * n
    unclipped_ranks = [0.0] * n
    for i, row in rows.items():
        for j, w in row.items():
            unclipped_ranks[j] += active_stake[i] * w
        for j, w in clipped[i].items():
            ranks[j] += active_stake[i] * w
    incentive = _normalised(ranks)
    trust = [ranks[j] / unclipped_ranks[j] if unclipped_ranks[j] > 0 else 0.0 for j in range(n)]
    validator_trust = [sum(clipped[i].values()) if i in clipped else 0.0 for i in range(n)]

    dividends = _normalised(_bond_dividends(rows, clipped, active_stake, incentive, bonds_penalty, n))

    combined_total = sum(incentive) + sum(dividends)
    if combined_total > 0:
        server_emission = [value / combined_total for value in incentive]
        validator_emission = [value / combined_total for value in dividends]
    else:
        # Nothing weighted (no weights, only outdated ones, or only self-weights): the chain pays
        # validators by active stake, or by stake when no stake is active.
        server_emission = [0.0] * n
        validator_emission = active_stake if any(active_stake) else normalised_stake

    return EpochResult(
        active=tuple(active),
        stake=tuple(normalised_stake),
        active_stake=tuple(active_stake),
        consensus=tuple(consensus),
        incentive=tuple(incentive),
        trust=tuple(trust),
        validator_trust=tuple(validator_trust),
        dividends=tuple(dividends),
        server_emission=tuple(server_emission),
        validator_emission=tuple(validator_emission),
        validator_permits=tuple(top_stake_permits(stake, max_validators=max_validators, owner_uid=owner_uid)),
    )


def top_stake_permits(stake: Sequence[float], *, max_validators: int, owner_uid: int | None = None) -> list[bool]:
    """Validator permits as the chain assigns them: the `max_validators` uids with the most stake,
    among those with any stake, plus the owner's uid. Ties go to the lower uid."""
    if max_validators < 0:
        raise ValueError(f"max_validators must be >= 0, got {max_validators!r}")
    ranked = sorted((uid for uid, s in enumerate(stake) if s > 0), key=lambda uid: (-stake[uid], uid))
    chosen = set(ranked[:max_validators])
    return [uid in chosen or uid == owner_uid for uid in range(len(stake))]


def to_u16(fraction: float) -> int:
    """A 0..1 fraction as the chain's u16 (65535 = 1.0), rounded to nearest and clamped."""
    return max(0, min(U16_MAX, round(fraction * U16_MAX)))


def _normalised(values: list[float]) -> list[float]:
    total = sum(values)
    return [value / total for value in values] if total > 0 else [0.0] * len(values)


def _masked_rows(
    weights: Mapping[int, Mapping[int, float]],
    n: int,
    *,
    permits: list[bool],
    owner_uid: int | None,
    last_update: Sequence[int],
    block_at_registration: Sequence[int],
) -> dict[int, dict[int, float]]:
    """Step 4: the weight rows that count, each normalised to sum 1 (empty rows are omitted)."""
    rows: dict[int, dict[int, float]] = {}
    for i, row in weights.items():
        if not 0 <= i < n or not permits[i]:
            continue
        if any(w < 0 for w in row.values()):
            raise ValueError(f"uid {i} has a negative weight")
        kept = {
            j: float(w)
            for j, w in row.items()
            if 0 <= j < n and w > 0 and (j != i or i == owner_uid) and last_update[i] > block_at_registration[j]
        }
        total = sum(kept.values())
        if total > 0:
            rows[i] = {j: w / total for j, w in kept.items()}
    return rows


def _kappa_median(stakes: list[float], scores: list[float], kappa: float) -> float:
    """The largest score c such that the rows scoring at least c hold at least `kappa` of the stake.

    Equivalently, with `minority = 1 - kappa`: the smallest score v whose rows together with all
    lower-scoring rows hold more than `minority`, which is the value the chain's pivot search
    returns. Falls back to the top score when rounding leaves the cumulative stake just short.
    """
    total = sum(stakes)
    if total <= 0:
        return 0.0
    minority = 1.0 - kappa
    cumulative = 0.0
    ordered = sorted(zip(scores, stakes))
    for index, (score, s) in enumerate(ordered):
        cumulative += s / total
        last_of_its_value = index + 1 == len(ordered) or ordered[index + 1][0] != score
        if last_of_its_value and cumulative > minority:
            return score
    return ordered[-1][0]


def _bond_dividends(
    rows: dict[int, dict[int, float]],
    clipped: dict[int, dict[int, float]],
    active_stake: list[float],
    incentive: list[float],
    bonds_penalty: float,
    n: int,
) -> list[float]:
    """Step 7, before normalisation: d_i = Σ_j ΔB_ij · incentive_j, with ΔB the column-normalised
    bond delta W_b ◦ S and W_b = W + bonds_penalty · (clip(W) − W)."""
    delta: dict[int, dict[int, float]] = {}
    column_totals = [0.0] * n
    for i, row in rows.items():
        for j, w in row.items():
            bond_weight = w + bonds_penalty * (clipped[i].get(j, 0.0) - w)
            value = bond_weight * active_stake[i]
            if value > 0:
                delta.setdefault(i, {})[j] = value
                column_totals[j] += value
    dividends = [0.0] * n
    for i, row in delta.items():
        dividends[i] = sum(value / column_totals[j] * incentive[j] for j, value in row.items())
    return dividends
