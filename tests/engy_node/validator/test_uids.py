"""Hotkeys to uids (engy_node.validator.uids): unregistered hotkeys dropped and measured, burns
recognised, and a standby vector chosen when the payload lands nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.validator.uids import Resolution, burn_target, resolve, standby

OWNER = "5DXSBCCKH5ENuyHFNaAvtaMfbhEEWpjSJB4rzc4mJfsc1uvJ"
ALICE = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
BOB = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
CAROL = "5FLSigC9HGRKVhB9FiEo4Y3koPsNmBmLJbpXg2mp1hXcS59Y"
STRANGER = "5DAAnrj7VHTznn2AWBemMuyBwZWs6FNFjdyVXUeYum3PTXFy"

METAGRAPH = (OWNER, ALICE, BOB, CAROL)
"""uid 0 is the owner, then alice, bob and carol."""


# ---- resolve ---------------------------------------------------------------------------------


def test_registered_hotkeys_map_to_their_uids_in_the_vectors_order() -> None:
    resolution = resolve([(CAROL, 300), (ALICE, 100), (BOB, 200)], METAGRAPH)
    assert resolution == Resolution(uids=(3, 1, 2), values=(300, 100, 200), dropped=(), dropped_share=0.0)
    assert resolution.lands


def test_the_values_are_the_vectors_weights_unscaled() -> None:
    # The SDK max-upscales to u16 itself; scaling here too would only add rounding.
    assert resolve([(ALICE, 1), (BOB, 3)], METAGRAPH).values == (1, 3)


def test_unregistered_hotkeys_are_dropped_with_their_share_of_the_weight() -> None:
    resolution = resolve([(ALICE, 100), (STRANGER, 300)], METAGRAPH)
    assert resolution.uids == (1,) and resolution.values == (100,)
    assert resolution.dropped == (STRANGER,)
    assert resolution.dropped_share == 0.75
    assert resolution.lands


def test_zero_weights_are_left_out_but_an_unregistered_zero_is_still_reported() -> None:
    resolution = resolve([(ALICE, 0), (BOB, 5), (STRANGER, 0)], METAGRAPH)
    assert resolution.uids == (2,) and resolution.values == (5,)
    assert resolution.dropped == (STRANGER,)
    assert resolution.dropped_share == 0.0


def test_a_vector_of_only_unregistered_hotkeys_lands_nothing() -> None:
    resolution = resolve([(STRANGER, 65535)], METAGRAPH)
    assert resolution == Resolution(uids=(), values=(), dropped=(STRANGER,), dropped_share=1.0)
    assert not resolution.lands


def test_a_vector_whose_registered_weight_is_all_zero_lands_nothing() -> None:
    resolution = resolve([(ALICE, 0), (STRANGER, 10)], METAGRAPH)
    assert not resolution.lands
    assert resolution.dropped_share == 1.0


def test_an_empty_or_all_zero_vector_drops_no_share() -> None:
    assert resolve([], METAGRAPH) == Resolution((), (), (), 0.0)
    assert resolve([(STRANGER, 0)], METAGRAPH).dropped_share == 0.0
    assert not resolve([], METAGRAPH).lands


def test_an_empty_metagraph_drops_everything() -> None:
    resolution = resolve([(ALICE, 1), (BOB, 1)], ())
    assert resolution.dropped == (ALICE, BOB) and resolution.dropped_share == 1.0


def test_a_repeated_hotkey_is_refused_rather_than_sent_as_a_duplicate_uid() -> None:
    with pytest.raises(ValueError, match=ALICE):
        resolve([(ALICE, 1), (BOB, 2), (ALICE, 3)], METAGRAPH)


def test_a_hotkey_listed_at_two_uids_resolves_to_the_last_as_the_public_validator_does() -> None:
    assert resolve([(ALICE, 9)], (ALICE, BOB, ALICE)).uids == (2,)


def test_lands_reads_the_values_not_the_uids() -> None:
    assert not Resolution(uids=(1,), values=(0,), dropped=(), dropped_share=0.0).lands
    assert Resolution(uids=(1,), values=(1,), dropped=(), dropped_share=0.0).lands


hotkey_pool = st.sampled_from([OWNER, ALICE, BOB, CAROL, STRANGER, "1", "2", "3"])
vectors = st.lists(
    st.tuples(hotkey_pool, st.integers(min_value=0, max_value=65535)), max_size=8, unique_by=lambda p: p[0]
)
metagraphs = st.lists(hotkey_pool, max_size=8)


@given(weights=vectors, metagraph=metagraphs)
def test_resolution_accounts_for_every_entry_of_the_vector(
    weights: list[tuple[str, int]], metagraph: list[str]
) -> None:
    resolution = resolve(weights, metagraph)
    registered = [(hotkey, weight) for hotkey, weight in weights if hotkey in metagraph]
    kept = [(hotkey, weight) for hotkey, weight in registered if weight > 0]
    assert [metagraph[uid] for uid in resolution.uids] == [hotkey for hotkey, _ in kept]
    assert list(resolution.values) == [weight for _, weight in kept]
    assert len(set(resolution.uids)) == len(resolution.uids)
    assert list(resolution.dropped) == [hotkey for hotkey, _ in weights if hotkey not in metagraph]
    assert 0.0 <= resolution.dropped_share <= 1.0
    total = sum(weight for _, weight in weights)
    if total:
        kept_share = sum(weight for _, weight in registered) / total
        assert resolution.dropped_share == pytest.approx(1.0 - kept_share)
    assert resolution.lands == bool(kept)


# ---- burn_target -----------------------------------------------------------------------------


def test_a_single_hotkey_holding_all_the_weight_is_a_burn() -> None:
    assert burn_target([(OWNER, 65535)]) == OWNER


def test_zero_weight_rows_beside_the_burn_do_not_hide_it() -> None:
    assert burn_target([(ALICE, 0), (OWNER, 65535), (BOB, 0)]) == OWNER


@pytest.mark.parametrize(
    "weights", [[], [(OWNER, 0)], [(ALICE, 0), (BOB, 0)], [(ALICE, 1), (BOB, 1)], [(OWNER, 65534), (ALICE, 1)]]
)
def test_anything_else_is_not_a_burn(weights: list[tuple[str, int]]) -> None:
    assert burn_target(weights) is None


# ---- standby ---------------------------------------------------------------------------------

CACHE = ((ALICE, 40000), (BOB, 25535))


def test_a_landable_cache_comes_first() -> None:
    choice = standby(cached=CACHE, hotkeys_by_uid=METAGRAPH, owner_hotkey=OWNER, cache_already_tried=False)
    assert choice == ("standby:cached", CACHE)


def test_the_cache_is_returned_as_tuples_whatever_sequence_came_in() -> None:
    choice = standby(cached=[(ALICE, 1)], hotkeys_by_uid=METAGRAPH, owner_hotkey=OWNER, cache_already_tried=False)
    assert choice == ("standby:cached", ((ALICE, 1),))


def test_a_partly_registered_cache_still_counts_as_landing() -> None:
    choice = standby(
        cached=((STRANGER, 60000), (ALICE, 1)), hotkeys_by_uid=METAGRAPH, owner_hotkey=OWNER, cache_already_tried=False
    )
    assert choice == ("standby:cached", ((STRANGER, 60000), (ALICE, 1)))


def test_the_cache_that_just_failed_to_land_is_not_tried_again() -> None:
    choice = standby(cached=CACHE, hotkeys_by_uid=METAGRAPH, owner_hotkey=OWNER, cache_already_tried=True)
    assert choice == ("standby:burn", ((OWNER, 65535),))


@pytest.mark.parametrize("cached", [None, ((STRANGER, 65535),), ((ALICE, 0), (STRANGER, 5))])
def test_without_a_landable_cache_everything_burns_to_the_registered_owner(cached: tuple | None) -> None:
    choice = standby(cached=cached, hotkeys_by_uid=METAGRAPH, owner_hotkey=OWNER, cache_already_tried=False)
    assert choice == ("standby:burn", ((OWNER, 65535),))


def test_an_unregistered_or_unknown_owner_leaves_nothing_to_submit() -> None:
    metagraph = (ALICE, BOB)
    assert standby(cached=None, hotkeys_by_uid=metagraph, owner_hotkey=OWNER, cache_already_tried=False) is None
    assert standby(cached=CACHE, hotkeys_by_uid=metagraph, owner_hotkey=OWNER, cache_already_tried=True) is None
    assert standby(cached=None, hotkeys_by_uid=METAGRAPH, owner_hotkey=None, cache_already_tried=False) is None


@given(
    cached=st.none() | vectors,
    metagraph=metagraphs,
    owner=st.none() | hotkey_pool,
    cache_already_tried=st.booleans(),
)
def test_a_standby_vector_always_lands(
    cached: list[tuple[str, int]] | None, metagraph: list[str], owner: str | None, cache_already_tried: bool
) -> None:
    choice = standby(
        cached=cached, hotkeys_by_uid=metagraph, owner_hotkey=owner, cache_already_tried=cache_already_tried
    )
    if choice is not None:
        kind, vector = choice
        assert resolve(vector, metagraph).lands
        if kind == "standby:cached":
            assert not cache_already_tried and vector == tuple(cached or ())
        else:
            assert kind == "standby:burn" and vector == ((owner, 65535),)
    else:
        assert owner not in metagraph
