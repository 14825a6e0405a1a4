"""Named keys and per-key limits in the store, on SQLite and PostgreSQL: counted in the hold's own
transaction, so concurrent holds from several stores (workers, hosts) never pass a limit."""

from __future__ import annotations

import concurrent.futures
import itertools

import pytest

from engy_node.gateway.limits import DAY_S
from engy_node.gateway.store import KeyRefused, KeyRevoked, Store, StoreError
from engy_node.gateway.store.key_limits import expiry_from
from tests.engy_node.gateway.store.support import FakeClock, entry

START = 1_800_000_000.0 + 10
"""A moment 10 s into a UTC minute (and day)."""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


def buyer(store: Store, micro_usd: int = 10_000_000) -> tuple[int, int]:
    account_id, key = store.create_buyer("team")
    store.credit(account_id, micro_usd=micro_usd)
    account = store.authenticate(key)
    assert account is not None
    return account_id, account.key_id


def concurrently(location, clock, calls: int, work) -> list:
    """Run `work(store, i)` `calls` times at once over 4 stores on one database (as 4 workers)."""
    stores = [Store(location, clock=clock) for _ in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
            return list(pool.map(lambda i: work(stores[i % 4], i), range(calls)))
    finally:
        for store in stores:
            store.close()


def hold_or_refusal(store: Store, account_id: int, key_id: int, i: int, amount: int = 100):
    try:
        return store.hold(account_id, amount=amount, request_id=f"r{i}", key_id=key_id, tokens=10)
    except KeyRefused as refused:
        return refused


def test_100_concurrent_holds_against_a_concurrency_limit_of_10_admit_exactly_10(store, location, clock):
    account_id, key_id = buyer(store)
    store.set_key_limits(key_id, {"concurrent": 10})
    results = concurrently(location, clock, 100, lambda s, i: hold_or_refusal(s, account_id, key_id, i))
    held = [r for r in results if not isinstance(r, KeyRefused)]
    assert len(held) == 10
    assert {r.refusal.limit for r in results if isinstance(r, KeyRefused)} == {"concurrent"}
    assert store.balance(account_id).held == 10 * 100
    # Closing one frees one place, on any store.
    store.settle(held[0], cost=40)
    assert store.hold(account_id, amount=100, request_id="again", key_id=key_id) is not None
    with pytest.raises(KeyRefused):
        store.hold(account_id, amount=100, request_id="over", key_id=key_id)


def test_100_concurrent_holds_against_10_requests_per_minute_admit_exactly_10(store, location, clock):
    account_id, key_id = buyer(store)
    store.set_account_limits(account_id, {"rpm": 10})  # an account default applies to its keys
    results = concurrently(location, clock, 100, lambda s, i: hold_or_refusal(s, account_id, key_id, i))
    held = [r for r in results if not isinstance(r, KeyRefused)]
    assert len(held) == 10
    refusal = next(r for r in results if isinstance(r, KeyRefused)).refusal
    assert refusal.limit == "rpm" and refusal.retry_after_s == 50
    assert refusal.view.limit_requests == 10 and refusal.view.remaining_requests == 0
    for hold in held:
        store.settle(hold, cost=1)
    with pytest.raises(KeyRefused):
        store.hold(account_id, amount=100, request_id="same-minute", key_id=key_id)
    clock.now += 50  # the next minute
    assert store.hold(account_id, amount=100, request_id="next-minute", key_id=key_id) is not None


def test_a_daily_spend_cap_is_never_exceeded_by_a_micro_dollar_under_100_way_concurrency(store, location, clock):
    account_id, key_id = buyer(store)
    cap = 1_000
    store.set_key_limits(key_id, {"daily_micro": cap})

    def spend(s: Store, i: int):
        hold = hold_or_refusal(s, account_id, key_id, i, amount=37)
        if isinstance(hold, KeyRefused):
            return hold
        return s.settle(hold, cost=37 if i % 3 else 20)  # some cost less than their hold

    results = concurrently(location, clock, 100, spend)
    charged = store.balance(account_id).charged
    assert charged <= cap
    refused = [r for r in results if isinstance(r, KeyRefused)]
    assert refused and {r.refusal.limit for r in refused} == {"daily_usd"}
    # What was held and not charged was given back: the cap is filled by charges alone.
    while True:
        hold = hold_or_refusal(store, account_id, key_id, next(counter), amount=1)
        if isinstance(hold, KeyRefused):
            break
        store.settle(hold, cost=1)
    assert store.balance(account_id).charged == cap
    clock.now += DAY_S
    assert store.hold(account_id, amount=37, request_id="tomorrow", key_id=key_id) is not None


counter = itertools.count(1000)


def test_tokens_per_minute_count_the_worst_case_and_are_corrected_at_release(store, clock):
    account_id, key_id = buyer(store)
    store.set_key_limits(key_id, {"tpm": 100})
    first = store.hold(account_id, amount=10, request_id="a", key_id=key_id, tokens=80)
    assert first.rate.limit_tokens == 100 and first.rate.remaining_tokens == 20
    with pytest.raises(KeyRefused) as refused:
        store.hold(account_id, amount=10, request_id="b", key_id=key_id, tokens=30)
    assert refused.value.refusal.limit == "tpm"
    store.release(first)  # nothing served: its tokens count nothing
    assert store.hold(account_id, amount=10, request_id="c", key_id=key_id, tokens=30) is not None


CLOSURES = {
    # How each way a request ends closes its hold, and the tokens it then counts per minute.
    "served (settle_and_log)": (lambda store, hold: store.settle_and_log(hold, cost=5, entry=used_entry(hold)), 30),
    "cut after output began (settle_and_log)": (
        lambda store, hold: store.settle_and_log(hold, cost=2, entry=used_entry(hold, completion_tokens=4)),
        24,
    ),
    "failed or cancelled (release)": (lambda store, hold: store.release(hold), 0),
    "orphaned (release_holds)": (lambda store, hold: store.release_holds([hold.hold_id]), 0),
    "open at start-up (recover_open_holds)": (lambda store, hold: store.recover_open_holds(), 0),
    "settled without its usage (settle)": (lambda store, hold: store.settle(hold, cost=5), 80),
}


def used_entry(hold, completion_tokens: int = 10):
    return entry(
        request_id=hold.request_id,
        account_id=hold.account_id,
        prompt_tokens=20,
        completion_tokens=completion_tokens,
        created_at=START,
    )


@pytest.mark.parametrize("closure", CLOSURES)
def test_every_closure_corrects_tokens_per_minute_to_what_its_request_used(store, clock, closure):
    """A hold counts prompt + max_tokens (80 here); its closure leaves only what the request
    used: the billed prompt and completion tokens, nothing for one that was not served, and the
    worst case when the usage is unknown (a bare `settle`, which no request path calls)."""
    close, used = CLOSURES[closure]
    account_id, key_id = buyer(store)
    store.set_key_limits(key_id, {"tpm": 100})
    hold = store.hold(account_id, amount=10, request_id="a", key_id=key_id, tokens=80)
    assert hold.rate.remaining_tokens == 20
    close(store, hold)
    after = store.hold(account_id, amount=10, request_id="b", key_id=key_id, tokens=1)
    assert after.rate.remaining_tokens == 100 - used - 1
    assert store.check_books() == []


def test_a_refused_hold_holds_no_money(store):
    account_id, key_id = buyer(store, micro_usd=1_000)
    store.set_key_limits(key_id, {"concurrent": 1})
    store.hold(account_id, amount=100, request_id="a", key_id=key_id)
    with pytest.raises(KeyRefused):
        store.hold(account_id, amount=100, request_id="b", key_id=key_id)
    assert store.balance(account_id).held == 100 and store.check_books() == []


def test_a_key_without_limits_has_no_rate_view(store):
    account_id, key_id = buyer(store)
    assert store.hold(account_id, amount=10, request_id="a", key_id=key_id).rate is None


def test_recovery_of_an_open_hold_frees_its_place(store):
    account_id, key_id = buyer(store)
    store.set_key_limits(key_id, {"concurrent": 1})
    store.hold(account_id, amount=10, request_id="a", key_id=key_id)
    assert len(store.recover_open_holds()) == 1
    assert store.hold(account_id, amount=10, request_id="b", key_id=key_id) is not None


def test_rotating_a_key_does_not_reset_its_spend_or_rate(store):
    account_id, key_id = buyer(store)
    store.set_key_limits(key_id, {"daily_micro": 150, "rpm": 2})
    store.settle(store.hold(account_id, amount=100, request_id="a", key_id=key_id), cost=100)
    new_id, _ = store.rotate_key(key_id)
    with pytest.raises(KeyRefused) as refused:
        store.hold(account_id, amount=100, request_id="b", key_id=new_id)
    assert refused.value.refusal.limit == "daily_usd"
    assert store.hold(account_id, amount=50, request_id="c", key_id=new_id) is not None
    with pytest.raises(KeyRefused, match="2 requests per minute"):
        store.hold(account_id, amount=1, request_id="d", key_id=new_id)


def test_named_keys_are_listed_masked_rotated_and_revoked(store, clock):
    account_id, first_key_id = buyer(store)
    key_id, key = store.create_key(account_id, name="ci", expires_at=START + 3600, models=("m1",))
    store.set_key_limits(key_id, {"rpm": 5, "daily_micro": 2_000_000})
    listed = {info.key_id: info for info in store.list_keys(account_id)}
    info = listed[key_id]
    assert info.name == "ci" and info.models == ("m1",) and info.expires_at == START + 3600
    assert info.hint == f"{key[:12]}…{key[-4:]}" and key not in repr(listed)
    assert info.limits.rpm == 5 and info.limits.daily_micro == 2_000_000
    assert store.authenticate(key).models == ("m1",), "the fallbacks skip models the key may not use"
    new_id, new_key = store.rotate_key(key_id)
    assert store.authenticate(key) is None
    assert store.authenticate(new_key).key_id == new_id
    rotated = {info.key_id: info for info in store.list_keys(account_id)}[new_id]
    assert (rotated.name, rotated.models, rotated.expires_at, rotated.limits) == (
        "ci",
        ("m1",),
        START + 3600,
        info.limits,
    )
    assert store.revoke_key_id(new_id) and not store.revoke_key_id(new_id)
    with pytest.raises(KeyRevoked):
        store.hold(account_id, amount=10, request_id="r", key_id=new_id)
    with pytest.raises(StoreError, match="key list"):
        store.rotate_key(new_id)


def test_an_expired_key_and_a_model_it_may_not_use_are_refused_naming_the_fix(store, clock):
    account_id, _ = buyer(store)
    key_id, key = store.create_key(account_id, name="short", expires_at=START + 60, models=("m1",))
    with pytest.raises(KeyRefused, match="may not use m2") as refused:
        store.hold(account_id, amount=10, request_id="a", key_id=key_id, model="m2")
    assert refused.value.kind == "permission"
    assert store.hold(account_id, amount=10, request_id="b", key_id=key_id, model="m1") is not None
    clock.now += 60
    with pytest.raises(KeyRefused, match="expired.*key create") as refused:
        store.hold(account_id, amount=10, request_id="c", key_id=key_id, model="m1")
    assert refused.value.kind == "authentication"
    with pytest.raises(KeyRefused, match="expired"):
        store.authenticate(key)


def test_a_keys_expiry_and_models_change_from_its_next_hold_on(store, clock):
    account_id, _ = buyer(store)
    key_id, key = store.create_key(account_id, name="team", expires_at=START + 60, models=("m1",))
    updated = store.update_key(key_id, models=("m1", "m2"))
    assert (updated.models, updated.expires_at, updated.name) == (("m1", "m2"), START + 60, "team")
    assert store.hold(account_id, amount=10, request_id="a", key_id=key_id, model="m2") is not None
    assert store.update_key(key_id, models=("m1",)).models == ("m1",)
    with pytest.raises(KeyRefused, match="may not use m2"):
        store.hold(account_id, amount=10, request_id="b", key_id=key_id, model="m2")
    clock.now += 60
    with pytest.raises(KeyRefused, match="expired"):
        store.hold(account_id, amount=10, request_id="c", key_id=key_id, model="m1")
    assert store.update_key(key_id, expires_at=None, models=None).expires_at is None
    assert store.authenticate(key).models is None
    assert store.hold(account_id, amount=10, request_id="d", key_id=key_id, model="m2") is not None
    assert store.list_keys(account_id)[-1].expires_at is None


def test_updating_a_revoked_or_unknown_key_or_nothing_is_refused(store):
    account_id, key_id = buyer(store)
    with pytest.raises(ValueError, match="nothing to change"):
        store.update_key(key_id)
    with pytest.raises(ValueError, match="model ids"):
        store.update_key(key_id, models=())
    store.revoke_key_id(key_id)
    for unknown in (key_id, 999):
        with pytest.raises(StoreError, match=f"no unrevoked API key {unknown}"):
            store.update_key(unknown, expires_at=None)


def test_unknown_limits_and_negative_values_are_refused(store):
    account_id, key_id = buyer(store)
    with pytest.raises(ValueError, match="unknown limit"):
        store.set_key_limits(key_id, {"burst": 3})
    with pytest.raises(ValueError):
        store.set_account_limits(account_id, {"rpm": -1})
    assert store.set_key_limits(key_id, {"rpm": 3}).rpm == 3
    assert store.set_key_limits(key_id, {"rpm": None}).rpm is None


def test_an_expiry_is_days_or_an_iso_time():
    assert expiry_from("2", 1000.0) == 1000.0 + 2 * DAY_S
    assert expiry_from("2027-01-01", 0.0) == 1798761600.0
    assert expiry_from("2027-01-01T01:00:00+01:00", 0.0) == 1798761600.0
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ValueError, match="--expires"):
            expiry_from(bad, 0.0)
