"""The traffic control plane's shell over a real store: it probes a new miner, reads outcomes and
verdicts that any worker process wrote, qualifies or pulls, and every worker's view follows."""

from __future__ import annotations

import time

import pytest
import trio

from engy_node.gateway.store import EligibilityRow, RequestLogEntry, Store, VerdictRecord
from engy_node.gateway.trust import control_plane
from engy_node.hub import Hub
from engy_node.models import SMOLLM2_135M
from engy_node.probe_corpus import load_probe_corpus
from engy_node.snapshots import LifetimeCounts, ProofVerdicts, VerdictCounts, decode_states
from tests.waiting import Changes

MODEL = SMOLLM2_135M.id
MINER = "key:1"


class Probed:
    """Stands in for the miner and the verifier: every probe the control plane sends is logged as
    served (by `ok`) and judged (by `verdict`), as the gateway and a verifier would."""

    def __init__(self, store: Store, *, ok: bool = True, verdict: str = "pass") -> None:
        self.store = store
        self.ok = ok
        self.verdict = verdict
        self.sent: list[tuple[str, str, int]] = []

    async def send(self, miner: str, model: str, plan, prompt) -> None:
        request_id = f"probe{len(self.sent)}"
        self.sent.append((miner, model, plan.max_tokens))
        self.store.log_request(
            served(request_id, 200 if self.ok else 502, None, miner=miner, model=model, kind="probe")
        )
        if self.ok:
            self.store.record_verdict(judged(request_id, self.verdict, miner=miner, model=model, kind="probe"))


class Connected:
    """The miners connected, counting how often the control plane asks: once, at the top of each tick."""

    def __init__(self, miners: set) -> None:
        self.miners = miners
        self.asked = 0
        self.changes = Changes()

    def __call__(self) -> set:
        self.asked += 1
        self.changes.notify()
        return set(self.miners)

    async def a_whole_tick(self) -> None:
        """Return once the control plane has made a whole tick after this call: the next tick to
        begin reads everything logged before the call, decides and saves, and the one after it
        begins only once that one is over."""
        target = self.asked + 2
        await self.changes.wait_for(
            lambda: self.asked >= target, timeout_s=30, what="a whole tick of the control plane"
        )


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "gateway.sqlite3") as opened:
        yield opened


def control(store: Store, probed: Probed, connected: set | Connected, **kwargs) -> control_plane.TrafficControl:
    return control_plane.TrafficControl(
        store=store,
        connected=connected if isinstance(connected, Connected) else lambda: set(connected),
        models={MODEL: SMOLLM2_135M},
        send_probe=probed.send,
        corpus=load_probe_corpus(),
        hub=Hub(),
        policy=control_plane.scaled_policy(time_scale=0.01, qualify_probes=3),
        max_probe_tokens=24,
        **kwargs,
    )


async def wait_for(condition, *, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.05)


def table(store: Store) -> dict[tuple[str, str], str]:
    return {(row.miner, row.model): row.state for row in store.eligibility()}


async def test_a_new_miner_is_probed_qualifies_and_every_worker_sees_it(nursery, store):
    probed = Probed(store)
    connected: set = set()
    plane = control(store, probed, connected)
    view = control_plane.EligibilityView(store)
    await nursery.start(plane.run)
    await nursery.start(view.run)
    assert not plane.eligible(MINER, MODEL) and not view.eligible(MINER, MODEL)
    connected.add((MINER, MODEL))
    await wait_for(lambda: table(store).get((MINER, MODEL)) == "active")
    assert len(probed.sent) >= 3 and all(tokens <= 24 for _, _, tokens in probed.sent)
    assert plane.eligible(MINER, MODEL)
    await wait_for(lambda: view.eligible(MINER, MODEL))


async def test_a_cheat_verdict_pulls_at_once_and_the_table_says_why(nursery, store):
    probed = Probed(store, verdict="cheat")
    plane = control(store, probed, {(MINER, MODEL)})
    await nursery.start(plane.run)
    await wait_for(lambda: table(store).get((MINER, MODEL)) == "pulled")
    [row] = store.eligibility()
    assert "cheat" in row.reason
    assert not plane.eligible(MINER, MODEL)


async def test_failing_probes_lose_the_round(nursery, store):
    probed = Probed(store, ok=False)
    plane = control(store, probed, {(MINER, MODEL)})
    await nursery.start(plane.run)
    await wait_for(lambda: table(store).get((MINER, MODEL)) == "pulled")
    assert plane.states[(MINER, MODEL)].strikes == 1


async def test_paid_requests_the_buyer_was_at_fault_for_never_pull_an_active_miner(nursery, store, monkeypatch):
    monkeypatch.setattr(control_plane, "TICK_S", 0.05)  # the ticks this test waits for, sooner
    probed = Probed(store)
    connected = Connected({(MINER, MODEL)})
    plane = control(store, probed, connected)
    await nursery.start(plane.run)
    await wait_for(lambda: table(store).get((MINER, MODEL)) == "active")
    now = time.time()
    buyer, _ = store.create_buyer("buyer")
    for index in range(20):  # far past the breaker's three failures in a row
        store.log_request(
            RequestLogEntry(
                request_id=f"paid{index}",
                account_id=buyer,
                miner=MINER,
                model=MODEL,
                api="openai",
                kind="paid",
                status=400,
                prompt_tokens=9000,
                completion_tokens=0,
                cached_tokens=0,
                cost_micro=0,
                ttft_ms=None,
                tpot_ms=None,
                created_at=now,
            )
        )
    await connected.a_whole_tick()
    assert table(store)[(MINER, MODEL)] == "active"
    store.log_request(
        RequestLogEntry(
            request_id="paid-502",
            account_id=buyer,
            miner=MINER,
            model=MODEL,
            api="openai",
            kind="paid",
            status=502,
            prompt_tokens=10,
            completion_tokens=0,
            cached_tokens=0,
            cost_micro=0,
            ttft_ms=None,
            tpot_ms=None,
            created_at=now,
        )
    )
    await connected.a_whole_tick()
    # Looked up by id: a probe the plane sent meanwhile may have come after it.
    counted = [entry.ok for entry in plane.states[(MINER, MODEL)].served if entry.request_id == "paid-502"]
    assert counted == [False], "a miner's own failure is still counted"


def served(
    request_id: str, status: int, account_id: int | None, *, miner: str = MINER, model: str = MODEL, kind: str = "paid"
) -> RequestLogEntry:
    """A request-log row, as the gateway writes one when a request to `miner` ends."""
    return RequestLogEntry(
        request_id=request_id,
        account_id=account_id,
        miner=miner,
        model=model,
        api="openai",
        kind=kind,
        status=status,
        prompt_tokens=10,
        completion_tokens=5,
        cached_tokens=0,
        cost_micro=0,
        ttft_ms=50.0,
        tpot_ms=5.0,
        created_at=time.time(),
    )


def judged(
    request_id: str, verdict: str, *, miner: str = MINER, model: str = MODEL, kind: str = "paid"
) -> VerdictRecord:
    """A verdict row, as the gateway records a verifier's."""
    now = time.time()
    return VerdictRecord(
        request_id=request_id,
        miner=miner,
        model=model,
        kind=kind,
        verdict=verdict,
        reason="ok" if verdict == "pass" else "chunks",
        verifier="local",
        request_created_at=now,
        judged_at=now,
    )


async def test_the_hub_shows_lifetime_totals_beside_the_breakers_window_every_tick(nursery, store, monkeypatch):
    """What a dashboard reads: every outcome and verdict since the start, not only the breaker's
    last minutes, and republished each tick even when no miner changed state."""
    monkeypatch.setattr(control_plane, "TICK_S", 0.05)
    connected = Connected({(MINER, MODEL)})
    probes_unanswered = Probed(store)
    probes_unanswered.send = lambda *probe: trio.sleep(0)  # no row: only the paid outcomes below count
    plane = control(store, probes_unanswered, connected, first_party={MINER})
    await nursery.start(plane.run)
    await connected.a_whole_tick()
    buyer, _ = store.create_buyer("buyer")
    for index, (status, verdict) in enumerate([(200, "pass"), (200, "pass"), (502, None), (200, "unproven")]):
        store.log_request(served(f"paid{index}", status, buyer))
        if verdict is not None:
            store.record_verdict(judged(f"paid{index}", verdict))
    await connected.a_whole_tick()
    [worker] = decode_states(plane.hub.states(), strict=True).traffic.workers
    assert worker.state == "active", "no transition happened: the totals were published anyway"
    assert worker.lifetime == LifetimeCounts(
        served=4,
        failed=1,
        audited=3,
        passed=2,
        cheat=0,
        unproven=1,
        proofs=ProofVerdicts(toploc=VerdictCounts(passed=2, unproven=1)),
    )
    assert (worker.window.requests, worker.window.failed, worker.window.verdicts) == (4, 1, 3)


def test_lifetime_counts_add_one_outcome_or_verdict_at_a_time():
    counts = control_plane.served(LifetimeCounts(), ok=True)
    counts = control_plane.served(counts, ok=False)
    for verdict, reason in (("pass", "ok"), ("cheat", "gemm:o_proj"), ("unproven", "gemm:no-opening"), ("pass", "ok")):
        counts = control_plane.audited(counts, verdict, reason)
    assert counts == LifetimeCounts(
        served=2,
        failed=1,
        audited=4,
        passed=2,
        cheat=1,
        unproven=1,
        proofs=ProofVerdicts(toploc=VerdictCounts(passed=2), gemm=VerdictCounts(cheat=1, unproven=1)),
    )


async def test_first_party_miners_are_eligible_before_any_probe(nursery, store):
    probed = Probed(store)
    plane = control(store, probed, set(), first_party={MINER})
    view = control_plane.EligibilityView(store, first_party={MINER})
    assert plane.eligible(MINER, MODEL) and view.eligible(MINER, MODEL)


async def test_outcomes_logged_before_the_control_plane_started_are_not_replayed(nursery, store):
    now = time.time()
    store.record_verdict(
        VerdictRecord(
            request_id="old",
            miner=MINER,
            model=MODEL,
            kind="paid",
            verdict="cheat",
            reason="chunks",
            verifier="local",
            request_created_at=now,
            judged_at=now,
        )
    )
    probed = Probed(store)
    plane = control(store, probed, {(MINER, MODEL)})
    await nursery.start(plane.run)
    await wait_for(lambda: table(store).get((MINER, MODEL)) == "active")


async def test_a_control_plane_that_takes_over_keeps_active_miners_active_and_pulled_ones_out(nursery, store):
    """A restarted gateway, or another host of a fleet becoming leader: the table it finds is
    where it starts, not a fleet of miners to qualify all over again."""
    now = time.time()
    store.save_eligibility(
        [
            EligibilityRow(
                miner="key:1", model=MODEL, state="active", reason="qualified", since=now - 60, updated_at=now - 1
            ),
            EligibilityRow(
                miner="key:2", model=MODEL, state="pulled", reason="pulled: cheat", since=now - 1, updated_at=now - 1
            ),
            EligibilityRow(
                miner="key:3", model=MODEL, state="probing", reason="qualifying", since=now - 60, updated_at=now - 1
            ),
        ]
    )
    probed = Probed(store, ok=False)  # any probe now would fail: what stays active was resumed, not requalified
    connected = {("key:1", MODEL), ("key:2", MODEL), ("key:3", MODEL)}
    plane = control(store, probed, connected)
    await nursery.start(plane.run)
    assert plane.eligible("key:1", MODEL), "active at once, before any probe"
    assert not plane.eligible("key:2", MODEL) and not plane.eligible("key:3", MODEL)
    await wait_for(lambda: table(store).get(("key:3", MODEL)) == "pulled")  # requalified afresh, and failed
    assert (
        table(store)[("key:2", MODEL)] == "pulled" and plane.states[("key:2", MODEL)].until >= now + 30
    )  # 3,600 s scaled by 0.01, from 1 s ago


def test_the_scaled_policy_scales_every_duration_and_sets_the_round_size():
    policy = control_plane.scaled_policy(time_scale=0.5, qualify_probes=4)
    base = control_plane.traffic_state.TrafficPolicy()
    assert (policy.min_probes, policy.max_probes) == (4, 8)
    assert policy.cooldown_s == base.cooldown_s / 2 and policy.window_s == base.window_s / 2
    assert policy.failures_in_a_row == base.failures_in_a_row
