"""Tests for the pure-Python Yuma epoch the dev chain runs (engy_node.local.yuma.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.local.yuma import DEFAULT_KAPPA, U16_MAX, _kappa_median, run_epoch, to_u16, top_stake_permits

BLOCK = 10_000
CUTOFF = 5_000


def epoch(weights, stake, *, permits=None, last_update=None, registered=None, owner_uid=None, **kwargs):
    """run_epoch with everyone permitted, active (updated at BLOCK - 1) and registered long ago unless told."""
    n = len(stake)
    return run_epoch(
        weights,
        stake,
        validator_permits=permits if permits is not None else [True] * n,
        last_update=last_update if last_update is not None else [BLOCK - 1] * n,
        block_at_registration=registered if registered is not None else [0] * n,
        current_block=BLOCK,
        activity_cutoff=CUTOFF,
        owner_uid=owner_uid,
        **kwargs,
    )


def close(values, expected, tolerance=1e-9):
    return len(values) == len(expected) and all(math.isclose(v, e, abs_tol=tolerance) for v, e in zip(values, expected))


# --- the cases local networks show ----------------------------------------------------------------


def test_a_single_validators_weights_become_the_incentive_proportions_exactly():
    # uid 0 validator, uids 1 and 2 miners weighted 3:1 (as the SDK sends them: max-upscaled u16).
    result = epoch({0: {1: 65535, 2: 21845}}, [1000, 0, 0], permits=[True, False, False])
    assert close(result.incentive, [0.0, 0.75, 0.25])
    assert close(result.consensus, [0.0, 0.75, 0.25])
    assert close(result.dividends, [1.0, 0.0, 0.0])
    # Half the emission to the miners by incentive, half to the validator by dividends.
    assert close(result.server_emission, [0.0, 0.375, 0.125])
    assert close(result.validator_emission, [0.5, 0.0, 0.0])
    assert close(result.emission, [0.5, 0.375, 0.125])


def test_the_reference_projection_example_is_reproduced_without_numpy():
    # The toy example of bittensor-sdk-11-examples/yuma_project.py: validators 70/30, the second tilts to uid 4.
    weights = {0: {2: 0.6, 3: 0.3, 4: 0.1}, 1: {2: 0.2, 3: 0.2, 4: 0.6}}
    result = epoch(weights, [700, 300, 1, 1, 1], permits=[True, True, False, False, False])
    assert close(result.consensus, [0, 0, 0.6, 0.3, 0.1])
    assert close(result.incentive, [0, 0, 0.5647, 0.3176, 0.1176], tolerance=1e-4)
    assert close(result.dividends, [0.8235, 0.1765, 0, 0, 0], tolerance=1e-4)


def test_an_inactive_validator_drops_out_of_consensus():
    weights = {0: {2: 0.6, 3: 0.3, 4: 0.1}, 1: {2: 0.2, 3: 0.2, 4: 0.6}}
    stale = BLOCK - CUTOFF - 1
    result = epoch(
        weights, [700, 300, 1, 1, 1], permits=[True, True, False, False, False], last_update=[BLOCK - 1, stale, 0, 0, 0]
    )
    assert result.active[:2] == (True, False)
    assert close(result.incentive, [0, 0, 0.6, 0.3, 0.1])
    assert close(result.dividends, [1.0, 0, 0, 0, 0])


def test_a_validator_updated_exactly_at_the_cutoff_is_still_active():
    result = epoch({0: {1: 1.0}}, [1, 0], permits=[True, False], last_update=[BLOCK - CUTOFF, 0])
    assert result.active[0] is True
    assert close(result.incentive, [0.0, 1.0])


def test_rows_of_uids_without_a_permit_are_ignored():
    # uid 1 has stake and weights but no permit: only uid 0's view counts.
    weights = {0: {2: 1.0}, 1: {3: 1.0}}
    result = epoch(weights, [100, 900, 0, 0], permits=[True, False, False, False])
    assert close(result.incentive, [0, 0, 1.0, 0])
    assert close(result.active_stake, [1.0, 0, 0, 0])


def test_the_owner_self_weight_counts_as_a_burn():
    # The owner (uid 0) weights only itself; the chain keeps that diagonal entry.
    result = epoch({0: {0: 65535}}, [500, 0, 0], permits=[True, False, False], owner_uid=0)
    assert close(result.incentive, [1.0, 0, 0])
    assert close(result.emission, [1.0, 0, 0])


def test_a_non_owner_self_weight_is_masked_and_emission_falls_back_to_stake():
    result = epoch({1: {1: 65535}}, [0, 300, 100], permits=[True, True, True], owner_uid=0)
    assert close(result.incentive, [0, 0, 0])
    assert close(result.validator_emission, [0, 0.75, 0.25])
    assert close(result.server_emission, [0, 0, 0])


def test_the_owner_always_holds_a_permit():
    result = epoch({0: {1: 1.0}}, [10, 0], permits=[False, False], owner_uid=0)
    assert close(result.incentive, [0, 1.0])
    assert result.validator_permits == (True, False)


def test_two_disagreeing_validators_are_clipped_to_the_stake_majority():
    # 60% of stake says uid 2, 40% says uid 3: the minority's weight is above consensus and clipped away.
    result = epoch({0: {2: 1.0}, 1: {3: 1.0}}, [600, 400, 0, 0], permits=[True, True, False, False])
    assert close(result.consensus, [0, 0, 1.0, 0])
    assert close(result.incentive, [0, 0, 1.0, 0])
    assert close(result.validator_trust, [1.0, 0, 0, 0])
    assert close(result.dividends, [1.0, 0, 0, 0])


def test_partial_disagreement_clips_each_column_to_its_kappa_median():
    result = epoch({0: {2: 0.5, 3: 0.5}, 1: {2: 1.0}}, [600, 400, 0, 0], permits=[True, True, False, False])
    assert close(result.consensus, [0, 0, 0.5, 0.5])
    # ranks: uid 2 = 0.6 * 0.5 + 0.4 * 0.5, uid 3 = 0.6 * 0.5.
    assert close(result.incentive, [0, 0, 0.625, 0.375])
    assert close(result.validator_trust, [1.0, 0.5, 0, 0])
    # Server trust: the share of a miner's rank that survived clipping.
    assert close(result.trust, [0, 0, 0.5 / 0.7, 1.0])


def test_without_the_bonds_penalty_out_of_consensus_weight_still_earns_dividends():
    weights = {0: {2: 1.0}, 1: {3: 1.0}}
    penalised = epoch(weights, [600, 400, 0, 0], permits=[True, True, False, False], bonds_penalty=1.0)
    lenient = epoch(weights, [600, 400, 0, 0], permits=[True, True, False, False], bonds_penalty=0.0)
    assert penalised.dividends[1] == 0
    # With no penalty the bonds use unclipped weights, but uid 3 has no incentive to pay dividends from.
    assert lenient.dividends[1] == 0
    assert close(lenient.incentive, penalised.incentive)


def test_weights_set_before_a_uid_registered_are_masked_as_outdated():
    # Validator 0 last set weights at block 9000; uid 2 registered at 9500 (someone new took the slot).
    result = epoch(
        {0: {1: 1.0, 2: 1.0}},
        [1, 0, 0],
        permits=[True, False, False],
        last_update=[9000, 0, 0],
        registered=[0, 0, 9500],
    )
    assert close(result.incentive, [0, 1.0, 0])


def test_with_nothing_weighted_validators_share_by_active_stake_then_by_stake():
    by_active = epoch({}, [300, 100, 600], permits=[True, True, False])
    assert close(by_active.validator_emission, [0.75, 0.25, 0])
    nobody_active = epoch({}, [300, 100, 600], permits=[True, True, False], last_update=[0, 0, 0])
    assert close(nobody_active.validator_emission, [0.3, 0.1, 0.6])
    no_stake = epoch({}, [0, 0, 0])
    assert close(no_stake.emission, [0, 0, 0])


def test_weights_naming_unknown_uids_are_ignored_like_the_chain_ignores_them():
    result = epoch({0: {1: 1.0, 7: 1.0}, 9: {1: 1.0}}, [1, 0], permits=[True, False])
    assert close(result.incentive, [0, 1.0])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="last_update"):
        run_epoch(
            {},
            [1, 2],
            validator_permits=[True, True],
            last_update=[0],
            block_at_registration=[0, 0],
            current_block=1,
            activity_cutoff=1,
        )
    with pytest.raises(ValueError, match="kappa"):
        epoch({}, [1], kappa=1.5)
    with pytest.raises(ValueError, match="non-negative"):
        epoch({}, [-1])
    with pytest.raises(ValueError, match="negative weight"):
        epoch({0: {0: -1.0}}, [1])
    with pytest.raises(ValueError, match="owner_uid"):
        epoch({}, [1], owner_uid=3)


# --- permits, the median and u16 conversion -------------------------------------------------------------


def test_permits_go_to_the_top_stakes_with_stake_plus_the_owner():
    stake = [0, 50, 10, 50, 0, 30]
    assert top_stake_permits(stake, max_validators=2) == [False, True, False, True, False, False]
    # Ties go to the lower uid; uids without stake never get a permit by stake.
    assert top_stake_permits(stake, max_validators=1) == [False, True, False, False, False, False]
    assert top_stake_permits(stake, max_validators=10) == [False, True, True, True, False, True]
    assert top_stake_permits(stake, max_validators=0, owner_uid=4) == [False, False, False, False, True, False]
    with pytest.raises(ValueError):
        top_stake_permits(stake, max_validators=-1)


def test_the_kappa_median_picks_the_value_a_stake_majority_supports():
    assert _kappa_median([0.5, 0.5], [0.2, 0.8], DEFAULT_KAPPA) == 0.8  # κ just under half: the upper of a tie
    assert _kappa_median([0.5, 0.5], [0.2, 0.8], 0.51) == 0.2
    assert _kappa_median([0.3, 0.3, 0.4], [0.9, 0.1, 0.5], 0.5) == 0.5
    assert _kappa_median([], [], 0.5) == 0.0
    assert _kappa_median([0.0, 0.0], [1.0, 1.0], 0.5) == 0.0


def test_to_u16_rounds_and_clamps():
    assert to_u16(0.75) == 49151
    assert to_u16(1.0) == U16_MAX
    assert to_u16(1.2) == U16_MAX
    assert to_u16(-0.1) == 0


# --- properties ----------------------------------------------------------------------------------------------


@st.composite
def subnets(draw):
    n = draw(st.integers(1, 8))
    stake = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.001, 1e6)), min_size=n, max_size=n))
    permits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    last_update = draw(st.lists(st.integers(0, BLOCK), min_size=n, max_size=n))
    registered = draw(st.lists(st.integers(0, BLOCK), min_size=n, max_size=n))
    weights = draw(
        st.dictionaries(
            st.integers(0, n - 1),
            st.dictionaries(st.integers(0, n - 1), st.integers(0, U16_MAX), max_size=n),
            max_size=n,
        )
    )
    owner_uid = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    kappa = draw(st.floats(0.0, 1.0))
    return weights, stake, permits, last_update, registered, owner_uid, kappa


@settings(max_examples=300, deadline=None)
@given(subnets())
def test_every_epoch_keeps_its_invariants(case):
    weights, stake, permits, last_update, registered, owner_uid, kappa = case
    result = epoch(
        weights,
        stake,
        permits=permits,
        last_update=last_update,
        registered=registered,
        owner_uid=owner_uid,
        kappa=kappa,
    )
    n = len(stake)
    fractions = (
        "stake",
        "active_stake",
        "consensus",
        "incentive",
        "trust",
        "dividends",
        "server_emission",
        "validator_emission",
    )
    for name in fractions:
        values = getattr(result, name)
        assert len(values) == n
        assert all(-1e-12 <= v <= 1 + 1e-9 for v in values), name
    for name in ("incentive", "dividends", "active_stake", "stake"):
        assert math.isclose(sum(getattr(result, name)), 1.0, abs_tol=1e-9) or sum(getattr(result, name)) == 0, name
    # Emission is fully paid out whenever anyone holds stake.
    assert math.isclose(sum(result.emission), 1.0 if any(stake) else 0.0, abs_tol=1e-9)
    # Weights are clipped to consensus, so a miner earns incentive only where consensus is positive.
    for uid, (c, i) in enumerate(zip(result.consensus, result.incentive)):
        if i > 0:
            assert c > 0, uid
    # Only active, permitted uids (or the owner) carry active stake and dividends.
    for uid in range(n):
        permitted = permits[uid] or uid == owner_uid
        if result.active_stake[uid] > 0:
            assert permitted and result.active[uid]
        if result.dividends[uid] > 0:
            assert result.active_stake[uid] > 0
    assert sum(result.validator_permits) <= min(n, sum(1 for s in stake if s > 0) + (owner_uid is not None))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.001, 1.0), st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0])), min_size=1, max_size=8
    ),
    st.floats(0.05, 0.95),
)
def test_the_kappa_median_is_the_largest_score_backed_by_kappa_of_the_stake(pairs, kappa):
    stakes = [s for s, _ in pairs]
    scores = [c for _, c in pairs]
    total = sum(stakes)
    median = _kappa_median(stakes, scores, kappa)
    assert median in scores
    backing = sum(s for s, c in pairs if c >= median) / total
    assert backing >= kappa - 1e-9
    higher = [c for c in scores if c > median]
    if higher:
        next_up = min(higher)
        assert sum(s for s, c in pairs if c >= next_up) / total < kappa + 1e-9


def chain_pivot_median(stake, score, minority):
    """The chain's `weighted_median` (epoch/math.rs), transcribed to floats as an oracle: a
    binary search with the middle element as pivot over the partition [lo, hi] of the stake integral."""
    partition = list(range(len(stake)))
    lo, hi = 0.0, sum(stake)
    for _ in range(len(stake) + 1):
        if not partition:
            return 0.0
        if len(partition) == 1:
            return score[partition[0]]
        pivot = score[partition[len(partition) // 2]]
        lower = [i for i in partition if score[i] < pivot]
        upper = [i for i in partition if score[i] > pivot]
        lo_stake = sum(stake[i] for i in lower)
        hi_stake = sum(stake[i] for i in upper)
        if minority < lo + lo_stake and lower:
            partition, hi = lower, lo + lo_stake
        elif hi - hi_stake <= minority and upper:
            partition, lo = upper, hi - hi_stake
        else:
            return pivot
    return 0.0


@st.composite
def sixty_fourths(draw):
    """Stakes that are multiples of 1/64 summing to exactly 1, so float sums are exact as I32F32 sums are."""
    cuts = sorted(draw(st.sets(st.integers(1, 63), max_size=8)))
    edges = [0, *cuts, 64]
    return [(b - a) / 64 for a, b in zip(edges, edges[1:])]


@settings(max_examples=300, deadline=None)
@given(sixty_fourths(), st.data(), st.sampled_from([DEFAULT_KAPPA, 16 / 64, 32 / 64, 33 / 64, 48 / 64]))
def test_the_kappa_median_agrees_with_the_chains_pivot_search(stakes, data, kappa):
    scores = data.draw(
        st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0]), min_size=len(stakes), max_size=len(stakes))
    )
    assert _kappa_median(stakes, scores, kappa) == chain_pivot_median(stakes, scores, sum(stakes) - kappa)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, U16_MAX), min_size=1, max_size=8), st.floats(1.0, 1e6))
def test_one_validator_alone_decides_incentive_in_proportion_to_its_weights(values, validator_stake):
    n = len(values) + 1
    row = {uid + 1: value for uid, value in enumerate(values)}
    result = epoch({0: row}, [validator_stake] + [0.0] * len(values), permits=[True] + [False] * len(values))
    total = sum(values)
    assert close(result.incentive, [0.0] + [v / total for v in values])
    assert result.dividends[0] == pytest.approx(1.0)
    assert len(result.incentive) == n
