"""leases: one holder at a time, renewable by it, passed on when it expires or is handed back; on both backends."""

from __future__ import annotations

import threading

import pytest

from engy_node.gateway.store import Store


def test_a_lease_is_held_by_one_host_until_it_expires(store, clock):
    assert store.claim_lease("epochs", holder="gw-a", ttl_s=60.0) == ("gw-a", 1_060.0)
    assert store.claim_lease("epochs", holder="gw-b", ttl_s=60.0) == ("gw-a", 1_060.0)
    clock.now = 1_030.0
    assert store.claim_lease("epochs", holder="gw-a", ttl_s=60.0) == ("gw-a", 1_090.0), "its holder renews it"
    clock.now = 1_089.0
    assert store.claim_lease("epochs", holder="gw-b", ttl_s=60.0)[0] == "gw-a"
    clock.now = 1_090.0
    assert store.claim_lease("epochs", holder="gw-b", ttl_s=60.0) == ("gw-b", 1_150.0), "an expired lease passes on"
    assert store.lease_holder("epochs") == ("gw-b", 1_150.0)


def test_a_lease_handed_back_is_free_at_once_and_only_its_holder_can_hand_it_back(store):
    store.claim_lease("epochs", holder="gw-a", ttl_s=60.0)
    assert not store.release_lease("epochs", holder="gw-b")
    assert store.release_lease("epochs", holder="gw-a")
    assert store.lease_holder("epochs") is None
    assert store.claim_lease("epochs", holder="gw-b", ttl_s=60.0)[0] == "gw-b"


def test_leases_are_independent_by_name(store):
    store.claim_lease("epochs", holder="gw-a", ttl_s=60.0)
    assert store.claim_lease("traffic", holder="gw-b", ttl_s=60.0)[0] == "gw-b"


@pytest.mark.parametrize("ttl_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_lease_needs_a_positive_finite_length(store, ttl_s):
    with pytest.raises(ValueError, match="ttl_s"):
        store.claim_lease("epochs", holder="gw-a", ttl_s=ttl_s)


def test_hosts_claiming_together_agree_on_one_holder(location):
    results: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def claim(n: int) -> None:
        try:
            with Store(location) as store:
                start.wait()
                results.append(store.claim_lease("epochs", holder=f"gw-{n}", ttl_s=60.0)[0])
        except BaseException as error:  # broad on purpose: re-raised in the main thread below
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(results)) == 1 and len(results) == 6
