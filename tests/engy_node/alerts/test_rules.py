"""The alert rules (`engy_node.alerts.rules`): each rule over hand-made states, and dedup and
recovery over every sequence of checks hypothesis draws."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.alerts.rules import RULES, Book, Condition, Limits, conditions, evaluate, step
from engy_node.diagnose import is_secret_field
from engy_node.protocol.gates import FIXES, GateTerms, MinerEpoch, explain
from engy_node.snapshots import (
    BuyerAccount,
    BuyersState,
    ChainState,
    Finding,
    GpusState,
    MinerState,
    ModelServerState,
    NodeInfo,
    NodeStates,
    ServerFailure,
    StandingChange,
    TrafficPolicyState,
    TrafficStanding,
    ValidatorState,
)

LIMITS = Limits(weights_stale_blocks=100, balance_low_usd_micro=500_000, restart_window_s=60.0)


def rules_of(states: NodeStates, *, restarts=None, now: float = 1000.0) -> dict[str, Condition]:
    found = {c.key: c for c in conditions(states, LIMITS, restarts=restarts or {}, now=now)}
    assert {c.rule for c in found.values()} <= set(RULES), "a rule missing from RULES (the gauge's series)"
    return found


def test_a_quiet_node_fires_nothing() -> None:
    assert rules_of(NodeStates()) == {}
    busy = NodeStates(
        traffic=TrafficPolicyState(workers=(TrafficStanding(miner="m1", model="x", state="active"),)),
        miners={"miner": MinerState(legs_up=2, link_error=None)},
        validator=ValidatorState(blocks_since_submit=99),
        buyers=BuyersState(accounts=1, top=(BuyerAccount(account_id=1, name="b", available=500_000),)),
        model_servers={"miner": ModelServerState(state="ready")},
        gpus=GpusState(findings=(Finding(gpu=0, kind="pcie", level="warning", text="x4 link"),)),
    )
    assert rules_of(busy) == {}


def test_a_pull_by_the_breaker_is_breaker_open_and_others_are_pulled() -> None:
    breaker = TrafficStanding(
        miner="m1",
        model="x",
        state="pulled",
        reason="3 failures in a row",
        history=(StandingChange(from_state="active", to_state="pulled", code="failures-in-a-row"),),
    )
    cheat = TrafficStanding(
        miner="m2", model="x", state="pulled", reason="cheat verdict", history=(StandingChange(code="cheat"),)
    )
    found = rules_of(NodeStates(traffic=TrafficPolicyState(workers=(breaker, cheat))))
    assert set(found) == {"breaker_open:m1 x", "miner_pulled:m2 x"}
    assert "3 failures in a row" in found["breaker_open:m1 x"].text
    assert "cheat verdict" in found["miner_pulled:m2 x"].text


def test_a_denied_miner_quotes_the_gateway() -> None:
    found = rules_of(NodeStates(miners={"miner": MinerState(legs_up=0, denied="hotkey not registered on netuid 53")}))
    assert found["miner_link:miner"].text.endswith("hotkey not registered on netuid 53")


def test_stale_weights_from_the_last_landing_or_the_chain() -> None:
    landed = rules_of(NodeStates(validator=ValidatorState(hotkey="5V", blocks_since_submit=100, chain_error="down")))
    assert "100 blocks ago" in landed["weights_stale:5V"].text and "down" in landed["weights_stale:5V"].text
    never = rules_of(NodeStates(validator=ValidatorState(block=5000, last_update=4800)))
    assert "updated on chain 200 blocks ago" in never["weights_stale:validator"].text
    assert rules_of(NodeStates(validator=ValidatorState(block=5000))) == {}


def test_stale_weights_while_the_chain_is_down_count_on_the_clock() -> None:
    down = ValidatorState(chain_error="cannot reach wss://entrypoint-finney: timed out", block_time_s=12.0)
    started = NodeInfo(started_at=1000.0 - 12.0 * 100)
    found = rules_of(NodeStates(node=started, validator=down))
    assert found["weights_stale:validator"].text == (
        "validator weights last landed: none since the node started 100 blocks ago (limit 100): "
        "cannot reach wss://entrypoint-finney: timed out"
    )
    assert rules_of(NodeStates(node=NodeInfo(started_at=1000.0 - 12.0 * 99), validator=down)) == {}
    landed = dataclasses.replace(down, last_submit_ts=1000.0 - 12.0 * 150, last_submit_block=70)
    assert "last landed 150 blocks ago" in rules_of(NodeStates(validator=landed))["weights_stale:validator"].text


def test_gpu_findings_that_alert() -> None:
    findings = (
        Finding(gpu=0, kind="throttling", level="warning", text="hw_thermal: clean the heatsink"),
        Finding(gpu=1, kind="lost", level="error", text="fell off the bus: reseat it"),
        Finding(gpu=2, kind="read_errors", level="error", text="fan speed (Unknown Error)"),
        Finding(gpu=3, kind="fan", level="warning", text="fan at 100 %"),
    )
    found = rules_of(NodeStates(gpus=GpusState(findings=findings)))
    assert set(found) == {"gpu:gpu0 throttling", "gpu:gpu1 lost", "gpu:gpu2 read_errors"}
    assert found["gpu:gpu1 lost"].level == "error"


def test_model_server_down_and_recent_restarts() -> None:
    failure = ServerFailure(kind="oom", summary="CUDA out of memory", fix="lower miner.max_inflight")
    states = NodeStates(model_servers={"miner": ModelServerState(state="restarting", restarts=2, last_failure=failure)})
    found = rules_of(states, restarts={"miner": (2, 990.0)}, now=1000.0)
    assert set(found) == {"server_down:miner", "server_restarts:miner"}
    assert "CUDA out of memory — lower miner.max_inflight" in found["server_down:miner"].text
    later = rules_of(states, restarts={"miner": (2, 900.0)}, now=1000.0)
    assert set(later) == {"server_down:miner"}


def test_low_balance_is_integer_micro_usd() -> None:
    top = (BuyerAccount(account_id=7, available=499_999), BuyerAccount(account_id=8, name="ok", available=500_000))
    found = rules_of(NodeStates(buyers=BuyersState(accounts=2, top=top)))
    assert set(found) == {"balance_low:account 7"}
    assert "$0.499999 available (under $0.500000)" in found["balance_low:account 7"].text


def test_restarts_are_remembered_across_checks() -> None:
    def at(restarts: int, state: str = "ready") -> NodeStates:
        return NodeStates(model_servers={"miner": ModelServerState(state=state, restarts=restarts)})

    book, notes = evaluate(Book(), at(0), LIMITS, 0.0)
    assert notes == ()
    book, notes = evaluate(book, at(1), LIMITS, 10.0)
    assert [(n.kind, n.alert.key) for n in notes] == [("firing", "server_restarts:miner")]
    book, notes = evaluate(book, at(1), LIMITS, 69.0)
    assert notes == ()
    book, notes = evaluate(book, at(1), LIMITS, 70.0)
    assert [(n.kind, n.alert.key) for n in notes] == [("resolved", "server_restarts:miner")]
    assert notes[0].alert.since == 10.0


def test_webhook_urls_are_masked_in_support_bundles() -> None:
    assert is_secret_field("webhooks")


KEYS = st.sampled_from(["a", "b", "c"])
CHECKS = st.lists(st.tuples(st.frozensets(KEYS), st.floats(min_value=0.0, max_value=50.0)), max_size=30)


def condition(key: str, text: str = "") -> Condition:
    return Condition("rule", "warning", key, text or f"{key} holds")


@settings(max_examples=300)
@given(CHECKS, st.sampled_from([0.0, 10.0, 25.0]))
def test_each_alert_is_notified_once_per_episode_and_recovers_once(checks, renotify_s) -> None:
    firing: dict = {}
    now = 0.0
    before: frozenset[str] = frozenset()
    for holding, gap in checks:
        now += gap
        firing, notes = step(firing, [condition(k) for k in sorted(holding)], now=now, renotify_s=renotify_s)
        assert {a.subject for a in firing.values()} == holding
        started = {n.alert.subject for n in notes if n.kind == "firing"}
        resolved = {n.alert.subject for n in notes if n.kind == "resolved"}
        reminded = {n.alert.subject for n in notes if n.kind == "reminder"}
        assert started == holding - before
        assert resolved == before - holding
        assert reminded <= holding & before
        if renotify_s == 0:
            assert not reminded
        for alert in firing.values():
            assert alert.notified_at is not None and alert.since is not None
            assert alert.since <= alert.notified_at <= now
            if renotify_s:
                assert now - alert.notified_at < renotify_s or alert.notified_at == now
        assert len(notes) == len(started) + len(resolved) + len(reminded)
        before = holding


@given(st.lists(st.text(max_size=5), min_size=1, max_size=5))
def test_a_firing_alert_takes_new_text_without_a_new_notification(texts) -> None:
    firing, notes = step({}, [condition("a", "first")], now=0.0)
    for i, text in enumerate(texts, start=1):
        firing, notes = step(firing, [condition("a", text or "x")], now=float(i))
        assert notes == ()
        assert firing["rule:a"].text == (text or "x") and firing["rule:a"].since == 0.0


def test_a_duplicate_key_counts_once() -> None:
    firing, notes = step({}, [condition("a", "one"), condition("a", "two")], now=1.0)
    assert len(notes) == 1 and firing["rule:a"].text == "one"


def gated_epoch(index: int) -> MinerEpoch:
    finding = explain(
        {"model": "smollm2-135m", "gate_reason": "ttft_p99", "ttft_p99_ms": 45_000, "counted": 120},
        GateTerms(qual_ttft_p99_ms=30_000),
    )
    assert finding is not None
    end = 1_800_000_000 + index * 60
    return MinerEpoch(index=index, weight=0, rows=1, gated=(finding,), next_index=index + 1, next_end=end + 60)


def test_a_gated_miner_fires_with_the_gate_the_measure_the_fix_and_the_next_chance_and_then_recovers() -> None:
    key = "miner_gated:miner-1"
    t0 = 1_800_000_750.0  # 30 s before epoch 13 ends
    book, notes = evaluate(Book(), NodeStates(miners={"miner-1": MinerState(epoch=gated_epoch(12))}), LIMITS, t0)
    assert [(n.kind, n.alert.key, n.alert.level) for n in notes] == [("firing", key, "error")]
    assert notes[0].alert.text == (
        "miner-1 gated in epoch 12 (weight 0 of 65,535): ttft_p99 on smollm2-135m: TTFT p99 45,000 ms over 120 "
        "requests (ceiling 30,000 ms) — fix: "
        + FIXES["ttft_p99"]
        + "; next chance: epoch 13 ends 2027-01-15 08:13:00 UTC (in 30 s, ~3 blocks)"
    )
    # The next epoch gated too: the same alert, its text moved on, nobody notified again.
    book, notes = evaluate(book, NodeStates(miners={"miner-1": MinerState(epoch=gated_epoch(13))}), LIMITS, t0 + 60)
    assert notes == () and "in epoch 13" in book.firing[key].text and "epoch 14 ends" in book.firing[key].text
    # A look that failed keeps the last answer (the epoch watch's posture): still firing, still quiet.
    failed = dataclasses.replace(gated_epoch(13), error="gateway unreachable")
    book, notes = evaluate(book, NodeStates(miners={"miner-1": MinerState(epoch=failed)}), LIMITS, t0 + 70)
    assert notes == () and key in book.firing
    passed = MinerEpoch(index=14, weight=65535, rows=1, next_index=15, next_end=1_800_001_000)
    book, notes = evaluate(book, NodeStates(miners={"miner-1": MinerState(epoch=passed)}), LIMITS, t0 + 120)
    assert [(n.kind, n.alert.key) for n in notes] == [("resolved", key)] and book.firing == {}


def test_a_gated_miner_on_a_local_network_counts_the_blocks_to_its_next_chance_at_the_dev_chains_block_time():
    miners = {"miner-1": MinerState(epoch=gated_epoch(12))}
    local = rules_of(NodeStates(miners=miners, chain=ChainState(block_time_s=1.0)), now=1_800_000_750.0)
    assert local["miner_gated:miner-1"].text.endswith("epoch 13 ends 2027-01-15 08:13:00 UTC (in 30 s, ~30 blocks)")


def test_a_standalone_miner_counts_the_blocks_to_its_next_chance_at_the_block_time_its_gateway_told():
    told = {"miner-1": MinerState(epoch=dataclasses.replace(gated_epoch(12), block_time_s=1.0))}
    standalone = rules_of(NodeStates(miners=told), now=1_800_000_750.0)  # no chain or validator state
    assert standalone["miner_gated:miner-1"].text.endswith(
        "epoch 13 ends 2027-01-15 08:13:00 UTC (in 30 s, ~30 blocks)"
    )


def test_a_miner_with_no_epoch_yet_or_an_ungated_one_fires_nothing() -> None:
    quiet = {"a": MinerState(epoch=None), "b": MinerState(epoch=MinerEpoch(error="no epoch has been published yet"))}
    assert rules_of(NodeStates(miners=quiet)) == {}
