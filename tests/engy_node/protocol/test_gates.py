"""The gate explanations: every gate explained from the rows the real settlement publishes, the
explanation agreeing with the gate on every epoch hypothesis draws, liberal reading of rows
from the network, and a miner's epoch answer built and read back."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.billing.epochs import EpochClock
from engy_node.gateway.billing.settlement import GateMinimums, settle_epoch
from engy_node.protocol.gates import (
    ACCEPTANCE_PERCENT,
    CHEAT_PERCENT,
    FIXES,
    GATES,
    SUBTENSOR_BLOCK_S,
    GateFinding,
    GateTerms,
    MinerEpoch,
    NextChance,
    block_time_s,
    epoch_answer,
    explain,
    explain_rows,
    finding_text,
    miner_epoch,
    next_chance,
    restore_text,
)
from engy_node.snapshots import ChainState, ValidatorState
from tests.engy_node.gateway.test_settlement import (
    MODELS,
    OWNER,
    Terms,
    epochs,
    honest,
    request,
    settle,
    settle_drawn,
)
from tests.engy_node.gateway.test_settlement import VerdictCounts as Verdicts

TERMS = {name: GateTerms.of(terms) for name, terms in MODELS.items()}


def gated_row(records, verdicts=None) -> dict:
    (row,) = settle(records, verdicts=verdicts).rows
    assert row.gate_reason is not None
    return row.to_json()


def test_an_honest_row_has_nothing_to_explain():
    (row,) = settle(honest(), verdicts={"hk-a": Verdicts(passed=100)}).rows
    assert explain(row.to_json(), TERMS["m"]) is None


def test_acceptance_says_the_share_of_attempts_against_99_percent_and_the_failures():
    records = honest(95) + [request(status=502)] * 3 + [request(status=504)] * 2 + [request(status=499)] * 7
    finding = explain(gated_row(records), TERMS["m"])
    assert finding == GateFinding(
        hotkey="hk-a",
        model="m",
        gate="acceptance",
        measured=95.0,
        limit=99.0,
        unit="%",
        samples=100,
        text="answered 95 of 100 attempts (95.0 %; minimum 99 %): 3 × 502, 2 × 504",
        fix=FIXES["acceptance"],
    )


def test_a_slow_ttft_p99_is_measured_against_the_models_ceiling():
    records = honest(98) + [request(ttft=4500)] * 2
    finding = explain(gated_row(records), TERMS["m"])
    assert (finding.gate, finding.measured, finding.limit, finding.unit, finding.samples) == (
        "ttft_p99",
        4500.0,
        1000.0,
        "ms",
        100,
    )
    assert finding.text == "TTFT p99 4,500 ms over 100 requests (ceiling 1,000 ms)"
    assert "max_inflight" in finding.fix and "cold start" in finding.fix
    assert finding_text(finding) == "ttft_p99 on m: " + finding.text


def test_a_slow_tpot_p99_is_measured_against_the_models_ceiling():
    finding = explain(gated_row(honest(98) + [request(tpot=250)] * 2), TERMS["m"])
    assert (finding.gate, finding.measured, finding.limit) == ("tpot_p99", 250.0, 100.0)
    assert finding.text == "TPOT p99 250 ms over 100 requests (ceiling 100 ms)"


def test_one_sample_reads_in_the_singular():
    # A local network gates from one sample (`gateway.gate_min_samples`): a loaded CPU miner's one slow answer.
    slow = explain({"model": "m", "gate_reason": "ttft_p99", "ttft_p99_ms": 62_850, "counted": 1}, TERMS["m"])
    assert slow is not None and slow.text == "TTFT p99 62,850 ms over 1 request (ceiling 1,000 ms)"
    cheat = explain({"gate_reason": "cheat", "verdict_pass": 0, "verdict_cheat": 1})
    assert cheat is not None and cheat.text == "1 cheat verdict of 1 rendered (100.0 %; maximum 1 %)"
    failed = explain({"gate_reason": "acceptance", "requests": 1, "ok_2xx": 0, "status_502": 1})
    assert failed is not None and failed.text == "answered 0 of 1 attempt (0.0 %; minimum 99 %): 1 × 502"


def test_a_latency_ceiling_unknown_to_this_node_is_said_so():
    finding = explain(gated_row(honest(98) + [request(ttft=4500)] * 2), None)
    assert finding.limit is None and finding.text.endswith("(ceiling unknown to this node)")


def test_cheat_says_the_share_of_rendered_verdicts_against_1_percent():
    finding = explain(gated_row(honest(), verdicts={"hk-a": Verdicts(passed=97, cheat=3, unproven=9)}))
    assert (finding.gate, finding.measured, finding.limit, finding.samples) == ("cheat", 3.0, 1.0, 100)
    assert finding.text == "3 cheat verdicts of 100 rendered (3.0 %; maximum 1 %)"


def test_every_gate_has_a_fix_and_an_unknown_gate_asks_for_an_upgrade():
    assert set(FIXES) == set(GATES)
    finding = explain({"model": "m", "gate_reason": "energy"})
    assert finding.gate == "energy" and "upgrade" in finding.fix and finding.measured is None


@pytest.mark.parametrize(
    "row",
    [
        {"gate_reason": "acceptance"},
        {"gate_reason": "acceptance", "requests": 5, "ok_2xx": 0, "status_499": 5},
        {"gate_reason": "ttft_p99", "ttft_p99_ms": "slow", "counted": -1},
        {"gate_reason": "tpot_p99", "tpot_p99_ms": True},
        {"gate_reason": "cheat", "verdict_pass": 0, "verdict_cheat": 0},
        {"gate_reason": "cheat", "verdict_pass": None},
    ],
)
def test_a_row_missing_its_numbers_is_explained_as_far_as_it_goes(row):
    finding = explain({"model": 7, **row})
    assert finding is not None and finding.measured is None and finding.model == "" and finding.fix


@given(st.dictionaries(st.text(max_size=12), st.none() | st.booleans() | st.integers() | st.text(max_size=8)))
def test_any_row_is_read_without_raising(row):
    explain(row)
    explain({**row, "gate_reason": "acceptance"})


@given(epochs)
def test_the_explanation_agrees_with_the_gate_on_every_drawn_epoch(epoch):
    records, verdicts, uids, minimums, models = epoch
    terms = {name: GateTerms.of(spec) for name, spec in models.items()}
    rows = [row.to_json() for row in settle_drawn(records, verdicts, uids, minimums, models).rows]
    findings = explain_rows(rows, terms)
    assert [f.model for f in findings] == [row["model"] for row in rows if row["gate_reason"]]
    for finding in findings:
        assert finding.gate in GATES and finding.measured is not None and finding.limit is not None
        if finding.gate == "acceptance":
            assert finding.measured < ACCEPTANCE_PERCENT
        elif finding.gate == "cheat":
            assert finding.measured > CHEAT_PERCENT
        else:
            assert finding.measured > finding.limit


def test_a_miners_answer_carries_its_own_rows_its_weight_and_when_the_next_epoch_ends():
    records = [*honest(98), *[request(ttft=4500)] * 2, *[request("hk-b", "x")] * 5]
    outcome = settle_epoch(
        records=records,
        verdicts={},
        models=MODELS,
        owner_hotkey=OWNER,
        uids={},
        minimums=GateMinimums(10, 10, 10),
    )
    result = {"epoch_index": 7, "start": 6000, "end": 7000, **outcome.to_json()}
    answer = json.loads(json.dumps(epoch_answer(result, hotkey="hk-a", terms=TERMS, epoch_s=1000, grace_s=30)))
    assert [row["hotkey"] for row in answer["rows"]] == ["hk-a"]
    assert answer["terms"] == {"m": {"qual_ttft_p99_ms": 1000, "qual_tpot_p99_ms": 100}}
    epoch = miner_epoch(answer, now=7100.0)
    assert epoch == MinerEpoch(
        index=7,
        start=6000,
        end=7000,
        weight=0,
        rows=1,
        score=0,
        gated=(explain(answer["rows"][0], TERMS["m"], epoch=7),),
        next_index=8,
        next_end=8000,
        next_closes_at=8030,
        checked_at=7100.0,
    )
    assert (epoch.gated[0].epoch, epoch.gated[0].hotkey, epoch.gated[0].gate) == (7, "hk-a", "ttft_p99")
    other = miner_epoch(epoch_answer(result, hotkey="hk-b", terms=TERMS, epoch_s=1000, grace_s=30), now=7100.0)
    assert (other.weight, other.rows, other.gated) == (65535, 1, ())
    nobody = miner_epoch(epoch_answer(result, hotkey="hk-z", terms=TERMS, epoch_s=1000, grace_s=30), now=7100.0)
    assert (nobody.weight, nobody.rows, nobody.score) == (0, 0, 0)


@given(st.dictionaries(st.text(max_size=12), st.none() | st.integers() | st.text(max_size=8) | st.lists(st.none())))
def test_any_answer_is_read_without_raising(answer):
    miner_epoch(answer, now=0.0)


def answered(index: int, *, clock: EpochClock, now: float) -> MinerEpoch:
    """A miner's view of gated epoch `index` as its gateway (keeping `clock`) answers it."""
    start, end = clock.window(index)
    result = {"epoch_index": index, "start": start, "end": end, "rows": [], "weights": []}
    answer = epoch_answer(result, hotkey="hk-a", terms={}, epoch_s=clock.epoch_s, grace_s=clock.grace_s)
    return miner_epoch(answer, now=now)


def test_the_next_chance_is_told_in_time_blocks_of_the_chains_block_time_and_publication():
    epoch = MinerEpoch(index=7, next_index=8, next_end=1_800_000_000, next_closes_at=1_800_000_900)
    hour_before = 1_800_000_000 - 3600
    assert restore_text(epoch, now=hour_before, block_s=SUBTENSOR_BLOCK_S) == (
        "epoch 8 ends 2027-01-15 08:00:00 UTC (in 60 min, ~300 blocks), its result published at 2027-01-15 08:15:00 UTC"
    )
    # A local network's dev chain makes a block a second: the same hour is 3,600 of them.
    assert restore_text(epoch, now=hour_before, block_s=1.0) == (
        "epoch 8 ends 2027-01-15 08:00:00 UTC (in 60 min, ~3,600 blocks), its result published at "
        "2027-01-15 08:15:00 UTC"
    )
    assert restore_text(epoch, now=1_800_000_000 - 90.5, block_s=1.0).startswith(
        "epoch 8 ends 2027-01-15 08:00:00 UTC (in 90 s, ~91 blocks)"
    )
    # Ended, in its grace: its traffic is served, its result still to come.
    assert restore_text(epoch, now=1_800_000_100, block_s=1.0) == (
        "epoch 8 ended 2027-01-15 08:00:00 UTC, its result published at 2027-01-15 08:15:00 UTC"
    )
    assert restore_text(MinerEpoch(index=7), now=hour_before, block_s=1.0) is None
    with pytest.raises(ValueError, match="block_s must be a positive number of seconds"):
        restore_text(epoch, now=hour_before, block_s=0.0)


def test_a_gateway_that_knows_its_chains_block_time_tells_it_and_its_miner_counts_blocks_in_it():
    clock = EpochClock(genesis=1_800_000_000, epoch_s=60, grace_s=10)
    start, end = clock.window(12)
    result = {"epoch_index": 12, "start": start, "end": end, "rows": [], "weights": []}
    now = clock.window(13)[1] - 30.0  # 30 s before the next epoch ends

    def answer(**told: float) -> dict:
        return json.loads(json.dumps(epoch_answer(result, hotkey="hk-a", terms={}, epoch_s=60, grace_s=10, **told)))

    # A gateway on a local network's dev chain (a block a second) says so; one that does not know
    # its chain's (an older one, or one on a public network) answers exactly as before.
    dev, older = answer(block_time_s=1.0), answer()
    assert dev["v"] == older["v"] == 1 and dev["block_time_s"] == 1.0
    assert "block_time_s" not in older and {key: dev[key] for key in older} == older
    told, untold = miner_epoch(dev, now=now), miner_epoch(older, now=now)
    assert (told.block_time_s, untold.block_time_s) == (1.0, None)
    assert "(in 30 s, ~30 blocks)" in str(restore_text(told, now=now, block_s=block_time_s(told)))
    assert "(in 30 s, ~3 blocks)" in str(restore_text(untold, now=now, block_s=block_time_s(untold)))
    assert miner_epoch({"block_time_s": 2}, now=now).block_time_s == 2.0


@pytest.mark.parametrize("told", [0, 0.0, -1.0, math.inf, math.nan, True, "1.0", None, [1.0], {"s": 1.0}])
def test_a_told_block_time_that_is_not_a_positive_finite_number_of_seconds_is_ignored(told):
    epoch = miner_epoch({"epoch_index": 3, "block_time_s": told}, now=0.0)
    assert (epoch.index, epoch.block_time_s, block_time_s(epoch)) == (3, None, SUBTENSOR_BLOCK_S)


@given(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.lists(st.floats()))
def test_the_block_time_read_from_any_answer_is_unknown_or_a_positive_finite_number(told):
    seconds = miner_epoch({"block_time_s": told}, now=0.0).block_time_s
    assert seconds is None or (type(seconds) is float and 0 < seconds < math.inf)


def test_the_block_time_is_the_gateways_then_the_nodes_chains_then_its_validators_then_subtensors():
    chain, validator = ChainState(block_time_s=1.0), ValidatorState(block_time_s=6.0)
    assert block_time_s(MinerEpoch(block_time_s=2.0), chain, validator) == 2.0
    assert block_time_s(MinerEpoch(), chain, validator) == 1.0
    assert block_time_s(chain, validator) == 1.0
    assert block_time_s(None, validator) == 6.0
    assert block_time_s(ChainState(), validator) == 6.0
    assert block_time_s(None, None) == SUBTENSOR_BLOCK_S == 12.0
    for unusable in (0.0, -1.0, math.inf, math.nan, True):
        assert block_time_s(ChainState(block_time_s=unusable)) == SUBTENSOR_BLOCK_S


def test_a_gateway_back_from_downtime_is_not_taken_to_offer_an_epoch_that_has_closed():
    clock = EpochClock(genesis=1_800_000_000, epoch_s=1200, grace_s=300)
    # Epoch 7 is the newest published: the gateway was down from epoch 8 to 11's end and has not
    # caught up yet. Epoch 8 closed long ago, epoch 11 too (its grace is over); epoch 12 serves now.
    now = clock.closes_at(11) + 60.0
    epoch = answered(7, clock=clock, now=now)
    assert epoch.next_index == 8
    assert next_chance(epoch, now=now) == NextChance(12, clock.window(12)[1], clock.closes_at(12))
    assert restore_text(epoch, now=now, block_s=1.0) == (
        "epoch 12 ends 2027-01-15 12:20:00 UTC (in 14 min, ~840 blocks), its result published at "
        "2027-01-15 12:25:00 UTC"
    )
    # Within epoch 11's grace, epoch 11 can still restore the miner.
    in_grace = clock.window(11)[1] + 10.0
    assert next_chance(epoch, now=in_grace) == NextChance(11, clock.window(11)[1], clock.closes_at(11))
    # Without the published epoch's end, the epoch length is unknown: the gateway's word stands.
    blind = MinerEpoch(index=7, next_index=8, next_end=clock.window(8)[1], next_closes_at=clock.closes_at(8))
    assert next_chance(blind, now=now) == NextChance(8, clock.window(8)[1], clock.closes_at(8))


@given(
    published=st.integers(min_value=0, max_value=10_000),
    epoch_s=st.integers(min_value=1, max_value=86_400),
    grace_s=st.integers(min_value=0, max_value=3_600),
    later=st.floats(min_value=0, max_value=1e8, allow_nan=False),
)
def test_the_next_chance_is_the_first_epoch_after_the_published_one_that_closes_after_now(
    published, epoch_s, grace_s, later
):
    clock = EpochClock(genesis=1_700_000_000, epoch_s=epoch_s, grace_s=grace_s)
    now = clock.closes_at(published) + later  # the gateway publishes an epoch at its close
    chance = next_chance(answered(published, clock=clock, now=now), now=now)
    assert chance is not None and chance.index > published
    assert (chance.end, chance.closes_at) == (clock.window(chance.index)[1], clock.closes_at(chance.index))
    assert chance.closes_at > now
    assert chance.index == published + 1 or clock.closes_at(chance.index - 1) <= now


def test_terms_come_from_a_catalog_spec():
    assert GateTerms.of(Terms(qual_ttft_p99_ms=5, qual_tpot_p99_ms=6)) == GateTerms(5, 6)
