"""settlement: exact integer weights, gates that fail alone and in order, probes that never count."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node import durations, percentile
from engy_node.gateway.billing import settlement
from engy_node.gateway.billing.settlement import (
    BUYER_FAULTS,
    WEIGHT_TOTAL,
    EpochSettlement,
    GateMinimums,
    RequestRecord,
    RowAggregate,
    VerdictCounts,
    settle_epoch,
)
from engy_node.models import CATALOG
from engy_node.percentile import nearest_rank
from engy_node.protocol import gates

OWNER = "owner-hotkey"


@dataclasses.dataclass(frozen=True, slots=True)
class Terms:
    score_rate: int = 1000
    qual_ttft_p99_ms: int = 1000
    qual_tpot_p99_ms: int = 100


MODELS = {"m": Terms(), "x": Terms(score_rate=3)}
SMALL = GateMinimums(acceptance_attempts=10, latency_samples=10, cheat_verdicts=10)


def request(hotkey="hk-a", model="m", *, status=200, cost=5, prompt=100, completion=50, ttft=200, tpot=20, probe=False):
    return RequestRecord(
        hotkey=hotkey,
        model=model,
        status=status,
        cost_micro=cost,
        prompt_tokens=prompt,
        completion_tokens=completion,
        ttft_ms=ttft,
        tpot_ms=tpot,
        probe=probe,
    )


def settle(records, *, verdicts=None, uids=None, minimums=SMALL, models=MODELS) -> EpochSettlement:
    return settle_epoch(
        records=records,
        verdicts=verdicts or {},
        models=models,
        owner_hotkey=OWNER,
        uids=uids or {},
        minimums=minimums,
    )


def only_row(result: EpochSettlement) -> RowAggregate:
    (row,) = result.rows
    return row


# -- hand-computed epochs --------------------------------------------------------------------


def test_two_miners_share_65535_by_score_and_the_remainder_goes_to_the_top_scorer():
    records = [request("hk-a"), request("hk-a"), request("hk-b", prompt=300, completion=100)]
    result = settle(records, uids={"hk-a": 2, "hk-b": 1}, minimums=GateMinimums())
    assert [(row.hotkey, row.tokens, row.score) for row in result.rows] == [("hk-b", 400, 400), ("hk-a", 300, 300)]
    # 300·65535 // 700 = 28086 and 400·65535 // 700 = 37448: 1 left over, to hk-b.
    assert result.weights == (("hk-b", 37449), ("hk-a", 28086))


def test_a_miners_rows_are_summed_before_the_one_normalisation():
    records = [
        request("hk-a", prompt=1, completion=0),
        request("hk-a", "x", prompt=334, completion=0),
        request("hk-b", prompt=6, completion=0),
    ]
    result = settle(records, uids={"hk-a": 0, "hk-b": 1})
    assert [(row.hotkey, row.model, row.score) for row in result.rows] == [
        ("hk-a", "m", 1),
        ("hk-a", "x", 1),
        ("hk-b", "m", 6),
    ]
    # Summed first, hk-a gets 2·65535 // 8 = 16383; floored per row it would get 2 × (65535 // 8) = 16382.
    # hk-b gets 6·65535 // 8 = 49151 plus the remainder of 1.
    assert result.weights == (("hk-a", 16383), ("hk-b", 49152))


def test_the_score_is_floored_once_per_row():
    result = settle([request(model="x", prompt=111, completion=222) for _ in range(3)])
    assert only_row(result).tokens == 999 and only_row(result).score == 2  # 999·3 // 1000, not 3 × (333·3 // 1000) = 0
    assert result.weights == (("hk-a", WEIGHT_TOTAL),)


def test_a_tied_remainder_goes_by_uid_then_to_registered_hotkeys_then_by_name():
    # Four equal scores: each share is 65535 // 4 = 16383, leaving 3 for one of them.
    records = [request(hotkey, prompt=1, completion=0) for hotkey in ("hk-d", "hk-c", "hk-b", "hk-a")]
    assert settle(records, uids={"hk-c": 9, "hk-b": 4}).weights == (
        ("hk-b", 16386),
        ("hk-c", 16383),
        ("hk-a", 16383),
        ("hk-d", 16383),
    )
    assert settle(records, uids={"hk-c": 9}).weights == (
        ("hk-c", 16386),
        ("hk-a", 16383),
        ("hk-b", 16383),
        ("hk-d", 16383),
    )
    assert settle(records).weights == (("hk-a", 16386), ("hk-b", 16383), ("hk-c", 16383), ("hk-d", 16383))


def test_nothing_counted_burns_everything_to_the_owner():
    assert settle([]).weights == ((OWNER, WEIGHT_TOTAL),)
    assert settle([request(probe=True, cost=0), request(cost=0)]).weights == ((OWNER, WEIGHT_TOTAL),)


def test_all_scores_gated_to_zero_burn_everything_to_the_owner():
    records = [request(status=502) for _ in range(10)] + [request()]
    result = settle(records)
    assert only_row(result).gate_reason == "acceptance"
    assert result.weights == ((OWNER, WEIGHT_TOTAL),)


def test_a_score_rate_too_small_to_reach_one_point_burns():
    result = settle([request(model="x", prompt=100, completion=0)])
    assert only_row(result).score == 0 and only_row(result).gate_reason is None
    assert result.weights == ((OWNER, WEIGHT_TOTAL),)


# -- gates -----------------------------------------------------------------------------------


def honest(n=100, **overrides):
    return [request(**overrides) for _ in range(n)]


def test_an_honest_row_passes_every_gate():
    row = only_row(settle(honest(), verdicts={"hk-a": VerdictCounts(passed=100)}, minimums=GateMinimums()))
    assert row.gate_reason is None and row.score == 100 * 150


def test_acceptance_at_exactly_99_percent_passes_and_below_fails():
    assert only_row(settle(honest(99) + [request(status=502)])).gate_reason is None
    row = only_row(settle(honest(98) + [request(status=502), request(status=500)]))
    assert (row.gate_reason, row.score) == ("acceptance", 0)
    assert (row.requests, row.ok_2xx, row.status_502, row.other_failures, row.counted) == (100, 98, 1, 1, 98)


def test_502_and_504_count_against_acceptance():
    row = only_row(settle(honest(98) + [request(status=502), request(status=504)]))
    assert (row.gate_reason, row.score, row.status_502, row.status_504) == ("acceptance", 0, 1, 1)


def test_a_499_leaves_the_acceptance_denominator():
    row = only_row(settle(honest(99) + [request(status=502)] + [request(status=499, cost=0) for _ in range(50)]))
    # Counted as failures the 50 hang-ups would make 99 / 150.
    assert (row.gate_reason, row.requests, row.status_499, row.ok_2xx) == (None, 150, 50, 99)
    assert row.score == 99 * 150


@pytest.mark.parametrize("status", sorted(BUYER_FAULTS))
def test_a_buyers_fault_a_miner_passed_on_leaves_the_acceptance_denominator(status):
    row = only_row(settle(honest(99) + [request(status=502)] + [request(status=status, cost=0) for _ in range(20)]))
    assert (row.gate_reason, row.requests, row.buyer_faults, row.other_failures) == (None, 120, 20, 0)
    failing = only_row(settle(honest(99) + [request(status=502), request(status=401, cost=0)]))
    assert (failing.gate_reason, failing.other_failures) == ("acceptance", 1), "other 4xx are the miner's"


def test_free_successes_count_toward_acceptance_but_earn_nothing():
    row = only_row(settle([request(cost=0) for _ in range(99)] + [request(status=504)]))
    assert (row.gate_reason, row.ok_2xx, row.counted, row.tokens, row.score) == (None, 99, 0, 0, 0)


def test_a_slow_ttft_p99_fails_alone():
    records = honest(98) + [request(ttft=1001), request(ttft=5000)]
    row = only_row(settle(records))
    assert (row.gate_reason, row.score, row.ttft_p99_ms, row.tpot_p99_ms) == ("ttft_p99", 0, 1001, 20)
    # One outlier in 100 is the 1 % p99 tolerates.
    assert only_row(settle(honest(99) + [request(ttft=5000)])).gate_reason is None


def test_a_slow_tpot_p99_fails_alone():
    row = only_row(settle(honest(98) + [request(tpot=101), request(tpot=101)]))
    assert (row.gate_reason, row.score, row.tpot_p99_ms, row.ttft_p99_ms) == ("tpot_p99", 0, 101, 200)


def test_a_latency_ceiling_is_inclusive():
    assert only_row(settle(honest(ttft=1000, tpot=100))).gate_reason is None


def test_latency_gates_read_only_counted_requests_that_carry_the_measurement():
    records = (
        honest(100) + [request(ttft=None, tpot=None) for _ in range(5)] + [request(status=502, ttft=9000, tpot=900)]
    )
    records += [request(cost=0, ttft=9000, tpot=900), request(probe=True, cost=0, ttft=9000, tpot=900)]
    row = only_row(settle(records))
    assert (row.gate_reason, row.ttft_p99_ms, row.tpot_p99_ms) == (None, 200, 20)


def test_a_row_with_no_latency_sample_reports_none():
    row = only_row(settle([request(ttft=None, tpot=None)]))
    assert (row.ttft_p99_ms, row.tpot_p99_ms, row.gate_reason) == (None, None, None)


def test_cheat_gate_fails_every_row_of_the_miner_and_only_that_miner():
    records = honest(5) + honest(5, model="x") + honest(5, hotkey="hk-b")
    verdicts = {"hk-a": VerdictCounts(passed=98, cheat=2), "hk-b": VerdictCounts(passed=99, cheat=1)}
    result = settle(records, verdicts=verdicts)
    assert [(row.hotkey, row.model, row.gate_reason, row.verdict_cheat) for row in result.rows] == [
        ("hk-a", "m", "cheat", 2),
        ("hk-a", "x", "cheat", 2),
        ("hk-b", "m", None, 1),
    ]
    assert result.weights == (("hk-b", WEIGHT_TOTAL),)


def test_unproven_verdicts_never_gate():
    row = only_row(settle(honest(5), verdicts={"hk-a": VerdictCounts(passed=10, unproven=10_000)}))
    assert (row.gate_reason, row.verdict_pass, row.verdict_unproven) == (None, 10, 10_000)


def test_gates_report_the_first_failure_in_order():
    slow_and_failing = [request(ttft=9000, tpot=900) for _ in range(10)] + [request(status=502)]
    cheater = {"hk-a": VerdictCounts(cheat=10)}
    assert only_row(settle(slow_and_failing, verdicts=cheater)).gate_reason == "acceptance"
    assert only_row(settle(slow_and_failing[:-1], verdicts=cheater)).gate_reason == "ttft_p99"
    assert only_row(settle(honest(10, tpot=900), verdicts=cheater)).gate_reason == "tpot_p99"
    assert only_row(settle(honest(10), verdicts=cheater)).gate_reason == "cheat"


def test_samples_below_the_minimums_let_a_small_row_pass_every_gate():
    records = [request(ttft=9000, tpot=900) for _ in range(4)] + [request(status=502)]
    row = only_row(settle(records, verdicts={"hk-a": VerdictCounts(passed=3, cheat=2)}, minimums=GateMinimums()))
    assert (row.gate_reason, row.score) == (None, 4 * 150)


def test_each_gate_applies_from_exactly_its_minimum():
    minimums = GateMinimums(acceptance_attempts=5, latency_samples=4, cheat_verdicts=5)
    assert only_row(settle(honest(3) + [request(status=502)], minimums=minimums)).gate_reason is None
    assert only_row(settle(honest(4) + [request(status=502)], minimums=minimums)).gate_reason == "acceptance"
    assert only_row(settle(honest(3, ttft=9000), minimums=minimums)).gate_reason is None
    assert only_row(settle(honest(4, ttft=9000), minimums=minimums)).gate_reason == "ttft_p99"
    assert (
        only_row(settle(honest(1), verdicts={"hk-a": VerdictCounts(passed=3, cheat=1)}, minimums=minimums)).gate_reason
        is None
    )
    assert (
        only_row(settle(honest(1), verdicts={"hk-a": VerdictCounts(passed=4, cheat=1)}, minimums=minimums)).gate_reason
        == "cheat"
    )


def test_each_default_minimum_is_the_smallest_sample_that_tolerates_one_bad_event():
    n = 100
    assert GateMinimums() == GateMinimums(acceptance_attempts=n, latency_samples=n, cheat_verdicts=n)
    everything_at = GateMinimums(acceptance_attempts=n - 1, latency_samples=n - 1, cheat_verdicts=n - 1)
    one_failure, one_slow = [request(status=502)], [request(ttft=9000)]
    assert only_row(settle(honest(n - 1) + one_failure, minimums=GateMinimums())).gate_reason is None
    assert only_row(settle(honest(n - 2) + one_failure, minimums=everything_at)).gate_reason == "acceptance"
    assert only_row(settle(honest(n - 1) + one_slow, minimums=GateMinimums())).gate_reason is None
    assert only_row(settle(honest(n - 2) + one_slow, minimums=everything_at)).gate_reason == "ttft_p99"
    one_cheat_in_n = {"hk-a": VerdictCounts(passed=n - 1, cheat=1)}
    one_cheat_in_fewer = {"hk-a": VerdictCounts(passed=n - 2, cheat=1)}
    assert only_row(settle(honest(1), verdicts=one_cheat_in_n, minimums=GateMinimums())).gate_reason is None
    assert only_row(settle(honest(1), verdicts=one_cheat_in_fewer, minimums=everything_at)).gate_reason == "cheat"


# -- probes and unpaid traffic ---------------------------------------------------------------


def test_probes_never_make_a_row_never_gate_and_never_earn():
    records = honest(10) + [request(status=502, cost=0, probe=True) for _ in range(50)]
    records += [request("hk-p", cost=0, probe=True) for _ in range(20)]
    result = settle(records, uids={"hk-p": 0, "hk-a": 1})
    assert [(row.hotkey, row.requests, row.gate_reason) for row in result.rows] == [("hk-a", 10, None)]
    assert result.weights == (("hk-a", WEIGHT_TOTAL),)


def test_unpaid_traffic_makes_a_row_but_never_earns():
    result = settle(honest(5) + [request("hk-free", cost=0) for _ in range(50)])
    assert [(row.hotkey, row.ok_2xx, row.counted, row.score) for row in result.rows] == [
        ("hk-a", 5, 5, 750),
        ("hk-free", 50, 0, 0),
    ]
    assert result.weights == (("hk-a", WEIGHT_TOTAL),)


# -- percentiles -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "p99"),
    [
        ([7], 7),
        ([3, 1, 2], 3),
        ([5, 5], 5),
        (list(range(1, 100)), 99),
        (list(range(1, 101)), 99),
        (list(range(1, 102)), 100),
        (list(range(200, 0, -1)), 198),
        ([0] * 98 + [10**9], 10**9),
        ([0] * 99 + [10**9], 0),
    ],
)
def test_p99_is_the_nearest_rank_of_the_sorted_values(values, p99):
    assert nearest_rank(sorted(values), 99) == p99


def test_p99_of_nothing_is_refused():
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 99)


# -- inputs and output shape -----------------------------------------------------------------


def test_rows_become_json_with_fixed_keys_and_plain_values():
    result = settle(
        honest(3) + [request(status=499, cost=0), request(ttft=None, tpot=None)],
        verdicts={"hk-a": VerdictCounts(1, 0, 2)},
    )
    payload = result.to_json()
    assert payload["weights"] == [["hk-a", WEIGHT_TOTAL]]
    (row,) = payload["rows"]
    assert row == {
        "hotkey": "hk-a",
        "model": "m",
        "requests": 5,
        "ok_2xx": 4,
        "status_499": 1,
        "buyer_faults": 0,
        "status_502": 0,
        "status_504": 0,
        "other_failures": 0,
        "counted": 4,
        "tokens": 600,
        "ttft_p99_ms": 200,
        "tpot_p99_ms": 20,
        "verdict_pass": 1,
        "verdict_cheat": 0,
        "verdict_unproven": 2,
        "score": 600,
        "gate_reason": None,
    }
    assert json.loads(json.dumps(payload, sort_keys=True, separators=(",", ":"))) == payload


def test_catalog_model_specs_serve_as_scoring_terms():
    spec = CATALOG["smollm2-135m"]
    result = settle([request(model=spec.id, prompt=1000, completion=0)], models=CATALOG)
    assert only_row(result).score == spec.score_rate


def test_a_model_without_terms_is_refused_by_name():
    with pytest.raises(ValueError, match="no scoring terms for model.*nope"):
        settle([request(model="nope")])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("status", 99),
        ("status", 600),
        ("cost_micro", -1),
        ("prompt_tokens", 1.0),
        ("completion_tokens", True),
        ("ttft_ms", 1.5),
        ("tpot_ms", -2),
        ("probe", 0),
        ("hotkey", ""),
        ("model", None),
    ],
)
def test_malformed_records_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(request(), **{field: value})


def test_negative_verdicts_and_minimums_are_refused():
    with pytest.raises(ValueError, match="cheat"):
        VerdictCounts(cheat=-1)
    with pytest.raises(ValueError, match="latency_samples"):
        GateMinimums(latency_samples=-1)


def imports_of(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return imported | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def test_settlement_imports_only_the_standard_library():
    # And the one percentile definition and the gates' names and bars (which word their spans
    # with the one duration wording), themselves standard library only.
    standard = set(sys.stdlib_module_names) | {"__future__"}
    ours = {"engy_node.percentile", "engy_node.protocol.gates"}
    assert {name.split(".")[0] for name in imports_of(settlement) - ours} <= standard
    assert {name.split(".")[0] for name in imports_of(percentile)} <= standard
    assert {name.split(".")[0] for name in imports_of(gates) - {"engy_node.durations"}} <= standard
    assert {name.split(".")[0] for name in imports_of(durations)} <= standard


# -- properties ------------------------------------------------------------------------------

HOTKEYS = ("hk-a", "hk-b", "hk-c", "hk-d")

records_strategy = st.lists(
    st.builds(
        RequestRecord,
        hotkey=st.sampled_from(HOTKEYS),
        model=st.sampled_from(("m", "x")),
        status=st.sampled_from((200, 200, 200, 201, 499, 500, 502, 504)),
        cost_micro=st.integers(0, 3),
        prompt_tokens=st.integers(0, 5000),
        completion_tokens=st.integers(0, 5000),
        ttft_ms=st.none() | st.integers(0, 2000),
        tpot_ms=st.none() | st.integers(0, 200),
        probe=st.booleans(),
    ),
    max_size=60,
)
verdicts_strategy = st.dictionaries(
    st.sampled_from(HOTKEYS),
    st.builds(VerdictCounts, st.integers(0, 50), st.integers(0, 3), st.integers(0, 5)),
)
uids_strategy = st.dictionaries(st.sampled_from(HOTKEYS), st.integers(0, 255))
minimums_strategy = st.builds(GateMinimums, st.integers(0, 8), st.integers(0, 8), st.integers(0, 8))
models_strategy = st.fixed_dictionaries(
    {name: st.builds(Terms, st.integers(0, 5000), st.integers(0, 2000), st.integers(0, 200)) for name in ("m", "x")}
)


def settle_drawn(records, verdicts, uids, minimums, models):
    return settle_epoch(
        records=records, verdicts=verdicts, models=models, owner_hotkey=OWNER, uids=uids, minimums=minimums
    )


epochs = st.tuples(records_strategy, verdicts_strategy, uids_strategy, minimums_strategy, models_strategy)


@given(epochs)
def test_weights_are_u16_and_always_sum_to_65535(epoch):
    weights = settle_drawn(*epoch).weights
    assert sum(weight for _, weight in weights) == WEIGHT_TOTAL
    assert all(type(weight) is int and 0 < weight <= WEIGHT_TOTAL for _, weight in weights)
    assert len({hotkey for hotkey, _ in weights}) == len(weights)


@given(epochs, st.randoms(use_true_random=False))
def test_the_settlement_does_not_depend_on_record_order(epoch, rng):
    records, *rest = epoch
    shuffled = list(records)
    rng.shuffle(shuffled)
    assert settle_drawn(shuffled, *rest) == settle_drawn(records, *rest)


@given(epochs)
def test_a_row_failing_any_gate_scores_zero(epoch):
    for row in settle_drawn(*epoch).rows:
        assert row.gate_reason is None or row.score == 0


@given(epochs)
def test_weights_follow_scores_with_the_remainder_on_the_top_scorer_only(epoch):
    result = settle_drawn(*epoch)
    scores: dict[str, int] = {}
    for row in result.rows:
        scores[row.hotkey] = scores.get(row.hotkey, 0) + row.score
    total = sum(scores.values())
    if total == 0:
        assert result.weights == ((OWNER, WEIGHT_TOTAL),)
        return
    extra = {hotkey: weight - scores.get(hotkey, 0) * WEIGHT_TOTAL // total for hotkey, weight in result.weights}
    assert all(scores[hotkey] > 0 for hotkey in extra)
    boosted = [hotkey for hotkey, amount in extra.items() if amount]
    assert len(boosted) <= 1 and sum(extra.values()) < sum(1 for score in scores.values() if score > 0)
    assert all(scores[hotkey] == max(scores.values()) for hotkey in boosted)


unpaid_or_probe = st.builds(
    request,
    st.just("hk-z"),
    st.sampled_from(("m", "x")),
    status=st.sampled_from((200, 499, 502)),
    cost=st.just(0),
    probe=st.booleans(),
)


@given(epochs, st.lists(unpaid_or_probe, min_size=1), st.integers(0, 255))
def test_a_hotkey_with_only_probe_or_unpaid_traffic_gets_no_weight(epoch, extra, uid):
    records, verdicts, uids, *rest = epoch
    weights = settle_drawn(records + extra, verdicts, {**uids, "hk-z": uid}, *rest).weights
    assert "hk-z" not in {hotkey for hotkey, _ in weights}


@given(
    epochs,
    st.builds(
        request,
        st.sampled_from(HOTKEYS),
        st.sampled_from(("m", "x")),
        status=st.sampled_from((200, 499, 502, 504)),
        cost=st.integers(0, 3),
        ttft=st.none() | st.integers(0, 10**6),
        tpot=st.none() | st.integers(0, 10**6),
        probe=st.just(True),
    ),
)
def test_adding_a_probe_never_changes_the_settlement(epoch, probe):
    records, *rest = epoch
    assert settle_drawn(records + [probe], *rest) == settle_drawn(records, *rest)
