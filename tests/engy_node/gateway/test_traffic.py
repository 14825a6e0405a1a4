"""gateway.traffic: qualification by probes, the circuit breaker, cooldowns, disconnects,
first-party workers, probe pacing and probe shapes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.trust.traffic import step, tick
from engy_node.gateway.trust.traffic_probes import (
    DEFAULT_SAMPLING_MIX,
    PROBE_PLAN_DRAWS,
    BuyerMix,
    SamplingShape,
    next_probe_at,
    probe_plan,
)
from engy_node.gateway.trust.traffic_state import (
    Eligibility,
    PaidFinished,
    PaidVerdict,
    ProbeFinished,
    ProbeOutcome,
    ProbeVerdict,
    TrafficPolicy,
    TrafficState,
    Transition,
    WorkerConnected,
    WorkerDisconnected,
    eligible,
    initial_state,
    resumed_state,
)
from engy_node.models import CATALOG

NEW, PROBING, ACTIVE, PULLED = Eligibility.NEW, Eligibility.PROBING, Eligibility.ACTIVE, Eligibility.PULLED
POLICY = TrafficPolicy()


@dataclasses.dataclass(frozen=True, slots=True)
class Terms:
    qual_ttft_p99_ms: int = 1000
    qual_tpot_p99_ms: int = 100


TERMS = Terms()


class Worker:
    """Drives one worker's state through `step` and `tick`, advancing time, recording transitions."""

    def __init__(self, *, first_party: bool = False, policy: TrafficPolicy = POLICY, terms: Terms = TERMS) -> None:
        self.now = 1000.0
        self.policy = policy
        self.terms = terms
        self.state = initial_state(miner="hk-a", model="m", now=self.now, first_party=first_party)
        self.transitions: list[Transition] = []
        self._ids = 0

    def feed(self, observation, *, after: float = 1.0) -> list[Transition]:
        self.now += after
        self.state, changes = step(self.state, observation, now=self.now, policy=self.policy, model_terms=self.terms)
        self.transitions += changes
        return changes

    def wait(self, seconds: float) -> list[Transition]:
        self.now += seconds
        self.state, changes = tick(self.state, now=self.now, policy=self.policy)
        self.transitions += changes
        return changes

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    def probe(
        self, *, ok: bool = True, ttft: int | None = 200, tpot: int | None = 20, verdict: str | None = "pass"
    ) -> str:
        request_id = self.new_id("p")
        self.feed(ProbeFinished(request_id, ok, ttft, tpot))
        if verdict is not None:
            self.feed(ProbeVerdict(request_id, verdict))
        return request_id

    def paid(self, *, ok: bool = True, ttft: int | None = 200, tpot: int | None = 20, after: float = 1.0) -> str:
        request_id = self.new_id("r")
        self.feed(PaidFinished(request_id, ok, ttft, tpot), after=after)
        return request_id

    def qualify(self) -> None:
        self.feed(WorkerConnected())
        for _ in range(self.policy.min_probes):
            self.probe()
        assert self.state.state is ACTIVE, self.state.reason


def last(worker: Worker) -> Transition:
    return worker.transitions[-1]


# --- qualification ------------------------------------------------------------------------------


def test_a_new_worker_gets_nothing_and_connecting_starts_probing():
    worker = Worker()
    assert worker.state.state is NEW and not eligible(worker.state)
    assert next_probe_at(worker.state, now=worker.now, rng_value=0.5) is None
    (change,) = worker.feed(WorkerConnected())
    assert (change.from_state, change.to_state, change.code) == (NEW, PROBING, "connected")
    assert change.reason == "connected: qualifying with probes"
    assert change.at == worker.now and worker.state.since == worker.now
    assert not eligible(worker.state)
    assert next_probe_at(worker.state, now=worker.now, rng_value=0.5) is not None


def test_twenty_good_probes_with_twenty_pass_verdicts_qualify_with_the_numbers_in_the_reason():
    worker = Worker(terms=Terms(qual_ttft_p99_ms=30000, qual_tpot_p99_ms=2000))
    worker.feed(WorkerConnected())
    for index in range(20):
        worker.probe(ttft=793 + index, tpot=40)
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (PROBING, ACTIVE, "qualified")
    assert change.reason == (
        "qualified: 20/20 probes ok, 20 verdicts pass, ttft p99 812 ms ≤ 30000 ms, tpot p99 40 ms ≤ 2000 ms"
    )
    assert eligible(worker.state) and worker.state.reason == change.reason


def test_nineteen_passes_are_not_enough():
    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(19):
        worker.probe()
    assert worker.state.state is PROBING
    worker.probe()
    assert worker.state.state is ACTIVE


def test_qualification_waits_for_the_verdicts():
    worker = Worker()
    worker.feed(WorkerConnected())
    ids = [worker.probe(verdict=None) for _ in range(20)]
    assert worker.state.state is PROBING
    for request_id in ids[:-1]:
        worker.feed(ProbeVerdict(request_id, "pass"))
    assert worker.state.state is PROBING
    worker.feed(ProbeVerdict(ids[-1], "pass"))
    assert worker.state.state is ACTIVE


def test_a_round_with_its_passes_qualifies_while_later_verdicts_are_pending_and_a_late_cheat_pulls():
    worker = Worker()
    worker.feed(WorkerConnected())
    pending = [worker.probe(verdict=None) for _ in range(2)]
    for _ in range(20):
        worker.probe()
    assert worker.state.state is ACTIVE
    assert "20 verdicts pass, 2 pending" in last(worker).reason
    worker.feed(ProbeVerdict(pending[0], "pass"))
    assert worker.state.state is ACTIVE
    worker.feed(ProbeVerdict(pending[1], "cheat"))
    assert worker.state.state is PULLED
    assert (
        last(worker).reason == f"pulled: cheat verdict on probe {pending[1]}; qualifies again after 3600 s (strike 1)"
    )


def test_a_cheat_probe_verdict_pulls_at_once_with_the_cheat_cooldown():
    worker = Worker()
    worker.feed(WorkerConnected())
    worker.probe()
    cheat = worker.probe(verdict="cheat")
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (PROBING, PULLED, "cheat")
    assert change.reason == f"pulled: cheat verdict on probe {cheat}; qualifies again after 3600 s (strike 1)"
    assert worker.state.until == worker.now + POLICY.cheat_cooldown_s
    assert next_probe_at(worker.state, now=worker.now, rng_value=0.5) is None


def test_one_failed_probe_loses_the_round_at_once():
    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(7):
        worker.probe()
    failed = worker.probe(ok=False, ttft=None, tpot=None, verdict=None)
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (PROBING, PULLED, "not-qualified")
    assert change.reason == (
        f"pulled: did not qualify: 1 of 8 probes failed (last {failed}); 99 % success over up "
        "to 40 probes allows 0; qualifies again after 300 s (strike 1)"
    )


def test_with_a_lower_success_bar_failed_probes_keep_the_round_going_until_it_cannot_qualify():
    worker = Worker(policy=TrafficPolicy(min_success_pct=95))  # 5 % of 40 probes: 2 failures allowed
    worker.feed(WorkerConnected())
    worker.probe(ok=False, verdict=None)
    worker.probe(ok=False, verdict=None)
    assert worker.state.state is PROBING
    worker.probe(ok=False, verdict=None)
    assert worker.state.state is PULLED and last(worker).code == "not-qualified"
    assert "3 of 3 probes failed" in last(worker).reason


def test_one_slow_probe_loses_the_round():
    worker = Worker()
    worker.feed(WorkerConnected())
    worker.probe()
    worker.probe(ttft=1001)
    change = last(worker)
    assert change.to_state is PULLED and change.code == "not-qualified"
    assert change.reason == (
        "pulled: did not qualify: 1 of 2 probes over the ttft ceiling of 1000 ms (slowest 1001 ms); "
        "a p99 over up to 40 probes allows 0; qualifies again after 300 s (strike 1)"
    )


def test_a_probe_exactly_at_the_ceiling_is_not_slow():
    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(20):
        worker.probe(ttft=1000, tpot=100)
    assert worker.state.state is ACTIVE


def test_a_slow_tpot_also_loses_the_round():
    worker = Worker()
    worker.feed(WorkerConnected())
    worker.probe(tpot=101)
    assert worker.state.state is PULLED and "tpot ceiling of 100 ms" in last(worker).reason


def test_unproven_probe_verdicts_are_not_passes_and_the_third_loses_the_round():
    worker = Worker()
    worker.feed(WorkerConnected())
    worker.probe(verdict="unproven")
    worker.probe(verdict="unproven")
    for _ in range(18):
        worker.probe()
    assert worker.state.state is PROBING  # 20 finished, 18 pass
    worker.probe()
    worker.probe()
    assert worker.state.state is ACTIVE
    assert last(worker).reason.startswith("qualified: 22/22 probes ok, 20 verdicts pass, 2 unproven, ")

    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(3):
        worker.probe(verdict="unproven")
    assert worker.state.state is PULLED
    assert "did not qualify: 3 unproven probe verdicts (tolerates 2)" in last(worker).reason


def test_a_round_that_runs_out_of_time_is_lost():
    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(20):
        worker.probe(verdict=None)  # the verifier never answers
    assert worker.wait(worker.state.round_started + POLICY.round_timeout_s - 1 - worker.now) == []
    (change,) = worker.wait(1)
    assert (change.from_state, change.to_state, change.code) == (PROBING, PULLED, "round-timeout")
    assert change.reason.startswith(
        "pulled: did not qualify within 1800 s: 0/20 verdicts pass, 20 pending, 20 probes finished"
    )


def test_probing_stops_at_max_probes_and_waits_for_verdicts():
    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(POLICY.max_probes - 1):
        worker.probe(verdict=None)
    assert next_probe_at(worker.state, now=worker.now, rng_value=0.5) is not None
    worker.probe(verdict=None)
    assert worker.state.state is PROBING
    assert next_probe_at(worker.state, now=worker.now, rng_value=0.5) is None


def test_a_duplicate_probe_outcome_is_ignored():
    worker = Worker()
    worker.feed(WorkerConnected())
    request_id = worker.probe(verdict=None)
    before = worker.state
    worker.feed(ProbeFinished(request_id, False))
    assert worker.state.probes == before.probes and worker.state.state is PROBING


# --- the circuit breaker -----------------------------------------------------------------------


def test_three_failures_in_a_row_pull_an_active_worker():
    worker = Worker()
    worker.qualify()
    worker.paid()
    worker.paid(ok=False)
    worker.paid(ok=False)
    assert worker.state.state is ACTIVE
    failed = worker.paid(ok=False)
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (ACTIVE, PULLED, "failures-in-a-row")
    assert change.reason == (
        f"pulled: 3 failures in a row within 60 s (last {failed}); qualifies again after 300 s (strike 1)"
    )
    assert not eligible(worker.state)
    assert worker.state.served == () and worker.state.verdicts == ()


def test_a_failure_rate_over_ten_percent_pulls_once_the_window_holds_ten_requests():
    worker = Worker()
    worker.qualify()
    for index in range(9):
        worker.paid(ok=index not in (2, 6))
    assert worker.state.state is ACTIVE  # 2 of 9: too small a sample
    worker.paid()
    change = last(worker)
    assert change.code == "failure-rate"
    assert change.reason.startswith("pulled: 2/10 requests failed within 60 s (over 10 %)")


def test_one_failure_in_ten_is_tolerated():
    worker = Worker()
    worker.qualify()
    for index in range(30):
        worker.paid(ok=index != 4)
    assert worker.state.state is ACTIVE


def test_failures_older_than_the_window_are_forgotten():
    worker = Worker()
    worker.qualify()
    worker.paid(ok=False)
    worker.paid(ok=False)
    worker.wait(POLICY.window_s)
    assert worker.state.served == ()
    worker.paid(ok=False)
    assert worker.state.state is ACTIVE


def test_two_slow_requests_pull_but_one_is_tolerated():
    worker = Worker()
    worker.qualify()
    for _ in range(5):
        worker.paid()
    worker.paid(ttft=5000)
    assert worker.state.state is ACTIVE
    worker.paid(ttft=1200)
    change = last(worker)
    assert change.code == "slow-ttft"
    assert change.reason.startswith("pulled: ttft p99 5000 ms > 1000 ms over 7 requests within 60 s (2 slow)")


def test_slow_tokens_pull_too():
    worker = Worker()
    worker.qualify()
    worker.paid(tpot=150)
    worker.paid(tpot=150)
    assert worker.state.state is PULLED and last(worker).code == "slow-tpot"


def test_failed_requests_give_no_latency_sample():
    worker = Worker()
    worker.qualify()
    worker.paid(ok=False, ttft=9000)
    worker.paid()
    worker.paid(ok=False, ttft=9000)
    assert worker.state.state is ACTIVE


def test_a_rising_unproven_rate_pulls_once_there_are_enough_verdicts():
    worker = Worker()
    worker.qualify()
    ids = [worker.paid() for _ in range(10)]
    for request_id in ids[:8]:
        worker.feed(PaidVerdict(request_id, "pass"))
    worker.feed(PaidVerdict(ids[8], "unproven"))
    assert worker.state.state is ACTIVE
    worker.feed(PaidVerdict(ids[9], "unproven"))
    assert worker.state.state is ACTIVE  # 2 of 10 is 20 %, not over it
    worker.feed(PaidVerdict(worker.paid(), "unproven"))
    change = last(worker)
    assert change.code == "unproven-rate"
    assert change.reason.startswith("pulled: 3/11 verdicts unproven within 300 s (over 20 %)")


def test_unproven_verdicts_below_the_minimum_sample_do_not_pull():
    worker = Worker()
    worker.qualify()
    for _ in range(9):
        worker.feed(PaidVerdict(worker.paid(), "unproven"))
    assert worker.state.state is ACTIVE


def test_any_cheat_verdict_on_paid_traffic_pulls_an_active_worker():
    worker = Worker()
    worker.qualify()
    worker.feed(PaidVerdict("r-123", "cheat"))
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (ACTIVE, PULLED, "cheat")
    assert change.reason == "pulled: cheat verdict on request r-123; qualifies again after 3600 s (strike 1)"


def test_probes_sent_while_active_feed_the_breaker():
    worker = Worker()
    worker.qualify()
    for _ in range(3):
        worker.probe(ok=False, verdict=None)
    assert worker.state.state is PULLED and last(worker).code == "failures-in-a-row"


# --- cooldown and re-qualification ---------------------------------------------------------------


def test_a_pulled_worker_probes_again_when_its_cooldown_is_over():
    worker = Worker()
    worker.qualify()
    for _ in range(3):
        worker.paid(ok=False)
    assert worker.state.state is PULLED
    assert worker.wait(POLICY.cooldown_s - 1) == []
    (change,) = worker.wait(1)
    assert (change.from_state, change.to_state, change.code) == (PULLED, PROBING, "cooldown-over")
    assert change.reason == "cooldown over after 300 s: qualifying again"
    assert worker.state.probes == () and worker.state.round_started == worker.now
    for _ in range(20):
        worker.probe()
    assert worker.state.state is ACTIVE


def test_each_pull_in_a_row_doubles_the_cooldown_up_to_the_cap():
    worker = Worker()
    cooldowns = []
    for _ in range(6):
        if worker.state.state is NEW:
            worker.qualify()
        else:
            worker.wait(worker.state.until - worker.now)
            for _ in range(20):
                worker.probe()
        for _ in range(3):
            worker.paid(ok=False)
        cooldowns.append(worker.state.until - worker.now)
    assert cooldowns == [300, 600, 1200, 2400, 3600, 3600]


def test_a_worker_that_served_long_enough_starts_its_strikes_afresh():
    worker = Worker()
    worker.qualify()
    for _ in range(3):
        worker.paid(ok=False)
    worker.wait(300)
    for _ in range(20):
        worker.probe()
    worker.wait(POLICY.strike_reset_s)
    for _ in range(3):
        worker.paid(ok=False)
    assert worker.state.strikes == 1 and worker.state.until - worker.now == 300


def test_a_cheat_verdict_on_a_pulled_worker_extends_its_cooldown_without_a_state_change():
    worker = Worker()
    worker.qualify()
    for _ in range(3):
        worker.paid(ok=False)
    worker.feed(PaidVerdict("r-9", "cheat"), after=100)
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (PULLED, PULLED, "cheat")
    assert change.reason == "still pulled: cheat verdict on request r-9; cooldown ends in 3600 s"
    assert worker.state.until == worker.now + POLICY.cheat_cooldown_s


def test_a_cheat_verdict_pulls_even_a_new_worker():
    worker = Worker()
    worker.feed(ProbeVerdict("p-old", "cheat"))
    assert worker.state.state is PULLED
    worker.feed(WorkerConnected())
    assert worker.state.state is PULLED  # the cooldown still runs


# --- disconnects ------------------------------------------------------------------------------


def test_a_disconnect_while_probing_drops_the_round():
    worker = Worker()
    worker.feed(WorkerConnected())
    for _ in range(7):
        worker.probe()
    (change,) = worker.feed(WorkerDisconnected())
    assert (change.from_state, change.to_state, change.code) == (PROBING, NEW, "disconnected")
    assert change.reason == "disconnected during qualification: round dropped after 7 probes"
    assert worker.state.probes == ()
    worker.feed(ProbeFinished("p-late", True, 200, 20))
    assert worker.state.state is NEW and worker.state.probes == ()
    worker.feed(WorkerConnected())
    assert worker.state.state is PROBING and worker.state.probes == ()


def test_an_active_worker_that_reconnects_within_the_grace_stays_active():
    worker = Worker()
    worker.qualify()
    assert worker.feed(WorkerDisconnected()) == []
    assert worker.state.state is ACTIVE and not worker.state.connected
    assert next_probe_at(worker.state, now=worker.now, rng_value=0.5) is None
    worker.wait(POLICY.reconnect_grace_s - 2)
    assert worker.feed(WorkerConnected()) == []
    assert worker.state.state is ACTIVE and worker.state.connected
    worker.wait(POLICY.reconnect_grace_s * 10)
    assert worker.state.state is ACTIVE


def test_an_active_worker_away_past_the_grace_must_qualify_again():
    worker = Worker()
    worker.qualify()
    worker.feed(WorkerDisconnected())
    (change,) = worker.wait(POLICY.reconnect_grace_s)
    assert (change.from_state, change.to_state, change.code) == (ACTIVE, NEW, "disconnected")
    assert change.reason == "disconnected for 30 s (grace 30 s): must qualify again"
    worker.feed(WorkerConnected())
    assert worker.state.state is PROBING


def test_a_pulled_worker_cannot_skip_its_cooldown_by_reconnecting():
    worker = Worker()
    worker.qualify()
    for _ in range(3):
        worker.paid(ok=False)
    worker.feed(WorkerDisconnected())
    worker.feed(WorkerConnected())
    assert worker.state.state is PULLED
    worker.feed(WorkerDisconnected())
    assert worker.wait(POLICY.cooldown_s) == []  # cooldown over, but nobody to probe
    assert worker.state.state is PULLED
    (change,) = worker.feed(WorkerConnected())
    assert (change.from_state, change.to_state, change.code) == (PULLED, PROBING, "cooldown-over")


def test_observations_that_arrive_out_of_place_are_ignored():
    worker = Worker()
    worker.qualify()
    for _ in range(3):
        worker.paid(ok=False)
    pulled = worker.state
    for observation in (
        PaidFinished("r-late", False),
        ProbeFinished("p-late", True, 1, 1),
        PaidVerdict("r-late", "pass"),
        ProbeVerdict("p-late", "unproven"),
    ):
        assert step(pulled, observation, now=worker.now, policy=POLICY, model_terms=TERMS) == (pulled, [])


# --- first-party workers ----------------------------------------------------------------------


def test_a_first_party_worker_is_eligible_at_once_and_never_pulled():
    worker = Worker(first_party=True)
    assert eligible(worker.state)
    (change,) = worker.feed(WorkerConnected())
    assert (change.from_state, change.to_state) == (NEW, ACTIVE)
    assert change.reason == "connected: first-party, eligible without qualification"
    for _ in range(2):
        worker.paid(ok=False)
    failed = worker.paid(ok=False)
    change = last(worker)
    assert (change.from_state, change.to_state, change.code) == (ACTIVE, ACTIVE, "failures-in-a-row")
    assert change.reason == f"degraded (first-party, stays eligible): 3 failures in a row within 60 s (last {failed})"
    assert worker.state.reason == change.reason and eligible(worker.state)
    assert worker.state.served == ()  # a fresh window: the report repeats only on new evidence
    count = len(worker.transitions)
    worker.paid()
    assert len(worker.transitions) == count
    worker.feed(PaidVerdict("r-99", "cheat"))
    assert last(worker).to_state is ACTIVE and last(worker).reason == (
        "degraded (first-party, stays eligible): cheat verdict on request r-99"
    )
    worker.feed(WorkerDisconnected())
    worker.wait(POLICY.reconnect_grace_s * 10)
    assert worker.state.state is ACTIVE and eligible(worker.state)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"min_probes": 0}, "min_probes"),
        ({"max_probes": 5}, "max_probes"),
        ({"min_success_pct": 101}, "min_success_pct"),
        ({"window_s": 0}, "window_s"),
        ({"cooldown_s": float("nan")}, "cooldown_s"),
        ({"max_cooldown_s": 10.0}, "max_cooldown_s"),
        ({"qualifying_gap_max_s": 0.5}, "qualifying_gap_max_s"),
        ({"failures_in_a_row": True}, "failures_in_a_row"),
    ],
)
def test_a_nonsense_policy_is_refused_naming_the_field(changes, names):
    with pytest.raises(ValueError, match=names):
        TrafficPolicy(**changes)


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: ProbeFinished("", True), "request_id"),
        (lambda: ProbeFinished("p", 1), "ok"),
        (lambda: PaidFinished("r", True, ttft_ms=-1), "ttft_ms"),
        (lambda: PaidFinished("r", True, tpot_ms=1.5), "tpot_ms"),
        (lambda: PaidVerdict("r", "fail"), "verdict"),
        (lambda: ProbeVerdict("p", None), "verdict"),
    ],
)
def test_a_malformed_observation_is_refused_naming_the_field(make, names):
    with pytest.raises(ValueError, match=names):
        make()


def test_the_hub_summary_is_plain_data():
    worker = Worker()
    worker.feed(WorkerConnected())
    worker.probe()
    worker.probe(verdict=None)
    summary = worker.state.to_json()
    assert summary["state"] == "probing" and summary["eligible"] is False
    assert summary["round"] == {"probes": 2, "ok": 2, "pass": 1, "unproven": 0, "cheat": 0}
    assert last(worker).to_json()["to"] == "probing"


def test_the_catalog_models_carry_the_ceilings():
    for spec in CATALOG.values():
        worker = Worker(terms=spec)
        worker.qualify()


# --- probe pacing ---------------------------------------------------------------------------


def probing_state(policy: TrafficPolicy = POLICY) -> TrafficState:
    return dataclasses.replace(initial_state(miner="hk", model="m", now=0.0), state=PROBING, connected=True)


def test_probe_gaps_run_from_the_minimum_toward_the_maximum():
    state = probing_state()
    assert next_probe_at(state, now=100.0, rng_value=0.0) == 100.0 + POLICY.qualifying_gap_min_s
    assert next_probe_at(state, now=100.0, rng_value=0.999999999) == pytest.approx(
        100.0 + POLICY.qualifying_gap_max_s, abs=1e-3
    )
    median = next_probe_at(state, now=0.0, rng_value=0.5)
    assert POLICY.qualifying_gap_min_s + 3 < median < POLICY.qualifying_gap_min_s + 5  # about scale · ln 2
    active = dataclasses.replace(state, state=ACTIVE)
    assert next_probe_at(active, now=0.0, rng_value=0.0) == POLICY.active_gap_min_s


@pytest.mark.parametrize("rng_value", [-0.1, 1.0, float("nan"), True])
def test_a_random_value_outside_the_unit_interval_is_refused(rng_value):
    with pytest.raises(ValueError, match="rng_value"):
        next_probe_at(probing_state(), now=0.0, rng_value=rng_value)


gaps = st.floats(min_value=0.01, max_value=1000.0)


@st.composite
def gap_policies(draw) -> TrafficPolicy:
    q_low, q_high = sorted((draw(gaps), draw(gaps)))
    a_low, a_high = sorted((draw(gaps), draw(gaps)))
    return TrafficPolicy(
        qualifying_gap_min_s=q_low,
        qualifying_gap_max_s=q_high,
        qualifying_gap_scale_s=draw(gaps),
        active_gap_min_s=a_low,
        active_gap_max_s=a_high,
        active_gap_scale_s=draw(gaps),
    )


@given(
    policy=gap_policies(),
    phase=st.sampled_from(list(Eligibility)),
    connected=st.booleans(),
    probes=st.integers(0, 45),
    now=st.floats(min_value=0.0, max_value=1e9),
    rng_value=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_the_next_probe_is_always_in_the_future_and_within_the_policys_bounds(
    policy, phase, connected, probes, now, rng_value
):
    outcome = ProbeOutcome("p", True, 1, 1)
    state = dataclasses.replace(
        initial_state(miner="hk", model="m", now=0.0), state=phase, connected=connected, probes=(outcome,) * probes
    )
    at = next_probe_at(state, now=now, policy=policy, rng_value=rng_value)
    if phase is PROBING and probes < policy.max_probes:
        low, high = policy.qualifying_gap_min_s, policy.qualifying_gap_max_s
    elif phase is ACTIVE and connected:
        low, high = policy.active_gap_min_s, policy.active_gap_max_s
    else:
        assert at is None
        return
    assert at > now
    assert now + low <= at <= now + high


# --- probe shapes -----------------------------------------------------------------------------

CORPUS = ["Summarise this contract.", "Write a haiku about rust.", "Explain TCP slow start."]


def test_a_probe_plan_picks_by_each_draw():
    plan = probe_plan(corpus=CORPUS, draws=[0.0, 0.0, 0.0, 0.0], max_output_tokens=2048)
    assert (plan.prompt_index, plan.max_tokens, plan.temperature, plan.top_p, plan.stream) == (
        0,
        2048,
        None,
        None,
        True,
    )
    plan = probe_plan(corpus=CORPUS, draws=[0.99, 0.35, 0.46, 0.85], max_output_tokens=2048)
    # max_tokens draw 0.35 of 100: past None (30) into 256 (10); sampling 0.46: past 35 + 10 into 0.7.
    assert (plan.prompt_index, plan.max_tokens, plan.temperature, plan.top_p, plan.stream) == (2, 256, 0.7, None, False)


def test_a_probe_never_asks_for_more_tokens_than_the_model_allows():
    plan = probe_plan(corpus=CORPUS, draws=[0.0, 0.99, 0.0, 0.0], max_output_tokens=2048)
    assert plan.max_tokens == 2048  # 8192 asked for, clamped as the buyer APIs would refuse more


def test_a_probe_plan_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="corpus"):
        probe_plan(corpus=[], draws=[0.0] * 4, max_output_tokens=10)
    with pytest.raises(ValueError, match="draws"):
        probe_plan(corpus=CORPUS, draws=[0.0] * 3, max_output_tokens=10)
    with pytest.raises(ValueError, match=r"draws\[1\]"):
        probe_plan(corpus=CORPUS, draws=[0.0, 1.0, 0.0, 0.0], max_output_tokens=10)
    with pytest.raises(ValueError, match="weights"):
        BuyerMix(sampling=(SamplingShape(0, None, None),))


unit = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)


@given(
    corpus_size=st.integers(1, 500),
    draws=st.lists(unit, min_size=PROBE_PLAN_DRAWS, max_size=PROBE_PLAN_DRAWS),
    max_output_tokens=st.integers(1, 40000),
)
def test_a_probe_plan_is_always_a_buyer_shape_and_depends_only_on_its_draws(corpus_size, draws, max_output_tokens):
    corpus = ["prompt"] * corpus_size
    plan = probe_plan(corpus=corpus, draws=draws, max_output_tokens=max_output_tokens)
    assert 0 <= plan.prompt_index < corpus_size
    assert 1 <= plan.max_tokens <= max_output_tokens
    assert (plan.temperature, plan.top_p) in {(shape.temperature, shape.top_p) for shape in DEFAULT_SAMPLING_MIX}
    assert plan == probe_plan(corpus=corpus, draws=list(draws), max_output_tokens=max_output_tokens)


# --- properties over any sequence of observations ---------------------------------------------

# A small policy, so short sequences reach every state; the invariants do not depend on the size.
SMALL = TrafficPolicy(
    min_probes=3,
    max_probes=5,
    max_unproven_probes=1,
    failures_in_a_row=2,
    min_requests=4,
    min_verdicts=3,
    cooldown_s=50.0,
    max_cooldown_s=200.0,
    cheat_cooldown_s=100.0,
    round_timeout_s=300.0,
    reconnect_grace_s=20.0,
    strike_reset_s=400.0,
)

request_ids = st.integers(0, 40).map(lambda index: f"x-{index}")
latencies = st.one_of(st.none(), st.integers(0, 1500))
verdicts = st.sampled_from(["pass", "pass", "pass", "pass", "unproven", "unproven", "cheat"])
observations = st.one_of(
    st.just(WorkerConnected()),
    st.just(WorkerDisconnected()),
    st.builds(ProbeFinished, request_ids, st.booleans(), latencies, latencies),
    st.builds(PaidFinished, request_ids, st.booleans(), latencies, latencies),
    st.builds(PaidFinished, request_ids, st.just(True), st.integers(0, 900), st.integers(0, 90)),
    st.builds(ProbeVerdict, request_ids, verdicts),
    st.builds(PaidVerdict, request_ids, verdicts),
    st.none(),  # a bare tick
)
# A good probe and its pass verdict, so that random sequences qualify workers often enough to
# exercise everything after qualification.
good_probes = st.builds(
    lambda request_id, ttft, tpot: [ProbeFinished(request_id, True, ttft, tpot), ProbeVerdict(request_id, "pass")],
    request_ids,
    st.integers(0, 900),
    st.integers(0, 90),
)
singles = observations.map(lambda observation: [observation])
actions = st.integers(0, 3).flatmap(
    lambda pick: singles if pick == 0 else good_probes
)  # three good probes to one other
gaps_s = st.one_of(st.floats(min_value=0.0, max_value=5.0), st.floats(min_value=0.0, max_value=120.0))
# Every sequence starts connected: a worker that never connects only ever meets verdicts.
events = st.lists(st.tuples(gaps_s, actions), min_size=6, max_size=60).map(
    lambda drawn: (
        [(0.0, WorkerConnected())]
        + [(gap if index == 0 else 0.0, observation) for gap, group in drawn for index, observation in enumerate(group)]
    )
)


def replay(events_, *, first_party: bool, policy: TrafficPolicy = SMALL):
    now = 0.0
    state = initial_state(miner="hk", model="m", now=now, first_party=first_party)
    for dt, observation in events_:
        now += dt
        if observation is None:
            new, transitions = tick(state, now=now, policy=policy)
        else:
            new, transitions = step(state, observation, now=now, policy=policy, model_terms=TERMS)
        yield state, observation, now, new, transitions
        state = new


@given(events=events, first_party=st.booleans())
def test_invariants_hold_after_every_observation(events, first_party):
    for before, observation, now, after, transitions in replay(events, first_party=first_party):
        passed = sum(1 for probe in after.probes if probe.verdict == "pass")
        if after.state is ACTIVE and not first_party:
            assert passed >= SMALL.min_probes, "active without the minimum of passed probes"
        if after.state is ACTIVE:
            assert all(probe.verdict != "cheat" for probe in after.probes), "active with a cheat in its round"
        if isinstance(observation, (ProbeVerdict, PaidVerdict)) and observation.verdict == "cheat" and not first_party:
            assert after.state is PULLED, "a cheat verdict did not pull"
        if first_party:
            assert after.state is not PULLED and eligible(after)
        else:
            assert eligible(after) == (after.state is ACTIVE)
        state = before.state
        for transition in transitions:
            assert transition.from_state is state and transition.at == now and transition.reason
            if transition.from_state is not transition.to_state:
                state = transition.to_state
        assert state is after.state
        if transitions and after.state is not before.state:
            assert after.since == now
        if after.state is PULLED:
            assert after.until is not None and after.until > after.since


@given(events=events, first_party=st.booleans())
def test_decisions_are_deterministic(events, first_party):
    first = [(after, transitions) for _, _, _, after, transitions in replay(events, first_party=first_party)]
    second = [(after, transitions) for _, _, _, after, transitions in replay(events, first_party=first_party)]
    assert first == second


@given(events=events)
def test_the_default_policy_never_activates_a_worker_short_of_twenty_passes(events):
    for _, _, _, after, _ in replay(events, first_party=False, policy=POLICY):
        if after.state is ACTIVE:
            assert sum(1 for probe in after.probes if probe.verdict == "pass") >= 20


def test_the_first_verdict_on_a_request_stands_unless_a_later_one_says_cheat():
    worker = Worker()
    worker.feed(WorkerConnected())
    first = worker.probe()
    worker.feed(ProbeVerdict(first, "unproven"))
    assert worker.state.probes[0].verdict == "pass"
    for _ in range(19):
        worker.probe()
    assert worker.state.state is ACTIVE
    paid = worker.paid()
    worker.feed(PaidVerdict(paid, "unproven"))
    worker.feed(PaidVerdict(paid, "unproven"))
    assert len(worker.state.verdicts) == 1
    worker.feed(ProbeVerdict(first, "cheat"))
    assert worker.state.state is PULLED and worker.state.probes[0].verdict == "cheat"


# --- resuming from the store ----------------------------------------------------------------------


def resumed(stored: Eligibility, *, since: float = 900.0, now: float = 1000.0, first_party: bool = False) -> Worker:
    worker = Worker(first_party=first_party)
    worker.now = now
    worker.state = resumed_state(
        miner="hk-a",
        model="m",
        stored=stored,
        since=since,
        reason="as stored",
        now=now,
        policy=POLICY,
        first_party=first_party,
    )
    return worker


def test_a_resumed_active_worker_stays_active_when_it_reconnects_within_the_grace():
    worker = resumed(ACTIVE)
    assert eligible(worker.state) and worker.state.since == 900.0
    worker.feed(WorkerConnected(), after=POLICY.reconnect_grace_s / 2)
    worker.wait(POLICY.reconnect_grace_s * 2)
    assert worker.state.state is ACTIVE and worker.transitions == []


def test_a_resumed_active_worker_that_never_reconnects_must_qualify_again():
    worker = resumed(ACTIVE)
    worker.wait(POLICY.reconnect_grace_s + 1)
    assert worker.state.state is NEW and last(worker).code == "disconnected"


def test_a_resumed_pull_lasts_the_longest_cooldown_from_when_it_began():
    worker = resumed(PULLED, since=900.0, now=1000.0)
    worker.feed(WorkerConnected())
    longest = max(POLICY.max_cooldown_s, POLICY.cheat_cooldown_s)
    worker.wait(900.0 + longest - worker.now - 1)
    assert worker.state.state is PULLED
    worker.wait(2)
    assert worker.state.state is PROBING and last(worker).code == "cooldown-over"


@pytest.mark.parametrize("stored", [NEW, PROBING])
def test_new_and_probing_workers_start_afresh(stored):
    assert resumed(stored).state == initial_state(miner="hk-a", model="m", now=1000.0)


def test_a_first_party_worker_resumes_as_it_would_start():
    assert resumed(PULLED, first_party=True).state == initial_state(
        miner="hk-a", model="m", now=1000.0, first_party=True
    )


def test_resuming_twice_does_not_stack_the_note():
    once = resumed(ACTIVE).state
    twice = resumed_state(miner="hk-a", model="m", stored=ACTIVE, since=900.0, reason=once.reason, now=1000.0)
    assert twice.reason == once.reason == "resumed from the store: as stored"
