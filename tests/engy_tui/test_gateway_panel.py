"""The gateway panel: every cell as a plain function, the view of whole hub states (ready,
stopped, absent, before the first snapshot), robustness against any JSON, the widget under Pilot
and one SVG snapshot per look.

The workers come from the same code as in the gateway: `traffic_state.initial_state` and `traffic.step`
over observations, published as `TrafficState.to_json()` plus the lifetime totals and the
transitions, as `control_plane.TrafficControl._publish` does; the audit counts are `QueueCounts` as
`trust_plane._publish_audit_counts` publishes them. Legs and epochs are written in the shapes of
`MinerPool.snapshot()` and `EpochPublisher.close`. The states are written as the hub holds them
and decoded strictly into the `NodeStates` the panel reads (`snapshots.decode_states`), so a
fixture cannot use a field the schema lacks; junk goes through the liberal decode, as the bridge
does it. Pilot tests are plain functions driving the app
with `asyncio.run`, as in `test_app.py` (pytest-trio claims `async def` tests).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from textual.app import App, ComposeResult
from textual.widgets import Static

from engy_node.gateway.trust import traffic, traffic_state
from engy_node.gateway.trust.audit import QueueCounts
from engy_node.models import CATALOG
from engy_node.protocol.standing import SERVED_WINDOW_S, VERDICT_WINDOW_S
from engy_node.snapshots import (
    BuyersState,
    EpochsState,
    GatewayLeg,
    GatewayState,
    NodeStates,
    TrafficStanding,
    decode,
    decode_states,
)
from engy_tui.widgets.gateway_panel import (
    BREAKER_HEADER,
    COLUMNS,
    HEARTBEAT_LATE_S,
    MAX_NOTES,
    MAX_WEIGHT_ROWS,
    STYLES,
    Cell,
    GatewayPanel,
    audit_line,
    audited_cell,
    breaker_cell,
    buyers_lines,
    display_names,
    epoch_lines,
    format_age,
    gateway_line,
    link_cell,
    load_cell,
    miner_label,
    miner_rows,
    panel_view,
    round_cell,
    served_cell,
    short_key,
    state_cell,
    weight_bar,
    worker_notes,
)

MODEL = "smollm2-135m"
TERMS = CATALOG[MODEL]
POLICY = traffic_state.TrafficPolicy(min_probes=3, max_probes=6)
T0 = 1_700_000_000.0
NOW = T0 + 3600.0
A = "5F3sa2TJAWMqDhXG6jhV4N8ko9SxwGy8TpaNS1repo5EYjQX"
B = "5Gq8eDC8U3Jd5GRVSGYh1o7XUfhPVDmaqx4fn2yKwGJhuLGD"
C = "5Cz0ZhmrvTMyuHfWxKsuFGmxQrDCnBFN6XyGoAB4yVAdv1wQ"
OWN = "5HGjWAeFDfFCWPsjFQdVV2Msvz2XtMktvgocEGcxsB8A4Sxy"
KEYED = "key:9f8e7d6c5b4a"
NAMES = {"miner1": A, "miner2": B, "owner": OWN, "validator": "5DAAnrj7VHTznn2AWBemMuyBwZWs6FNFjdyVXUeYum3PTXFy"}
SIZE = (160, 32)


def published(state: traffic_state.TrafficState, observations: list[tuple[float, traffic_state.Observation]]) -> dict:
    """The worker as the control plane publishes it after these observations: its state, its
    totals since the gateway started (every request served and verdict, probes included) and its
    transitions."""
    history = []
    lifetime = {"served": 0, "failed": 0, "audited": 0, "pass": 0, "cheat": 0, "unproven": 0}
    for at, observation in observations:
        state, transitions = traffic.step(state, observation, now=at, policy=POLICY, model_terms=TERMS)
        history += transitions
        if isinstance(observation, traffic_state.ProbeFinished | traffic_state.PaidFinished):
            lifetime["served"] += 1
            lifetime["failed"] += not observation.ok
        elif isinstance(observation, traffic_state.ProbeVerdict | traffic_state.PaidVerdict):
            lifetime["audited"] += 1
            lifetime[observation.verdict] += 1
    return {**state.to_json(), "lifetime": lifetime, "history": [transition.to_json() for transition in history]}


def typed(states: dict) -> NodeStates:
    """The hub's states as the panel gets them: decoded (strictly: the fixture must fit the schema)."""
    return decode_states(states, strict=True)


def standing(worker: dict) -> TrafficStanding:
    return decode(TrafficStanding, worker, strict=True)


def legs_of(*wire: dict) -> tuple[GatewayLeg, ...]:
    return tuple(decode(GatewayLeg, leg, strict=True) for leg in wire)


def qualified(miner: str, start: float) -> list[tuple[float, traffic_state.Observation]]:
    observations: list[tuple[float, traffic_state.Observation]] = [(start, traffic_state.WorkerConnected())]
    for i in range(POLICY.min_probes):
        request = f"{miner[:4]}-probe-{i}"
        observations += [
            (start + 10 + i, traffic_state.ProbeFinished(request, True, 400, 30)),
            (start + 20 + i, traffic_state.ProbeVerdict(request, "pass")),
        ]
    return observations


def active_worker() -> dict:
    return published(
        traffic_state.initial_state(miner=A, model=MODEL, now=T0),
        qualified(A, T0) + [(NOW - 30 + i, traffic_state.PaidFinished(f"a{i}", True, 380, 25)) for i in range(5)],
    )


def probing_worker() -> dict:
    return published(
        traffic_state.initial_state(miner=B, model=MODEL, now=NOW - 200),
        [
            (NOW - 200, traffic_state.WorkerConnected()),
            (NOW - 150, traffic_state.ProbeFinished("b0", True, 500, 40)),
            (NOW - 140, traffic_state.ProbeVerdict("b0", "pass")),
            (NOW - 100, traffic_state.ProbeFinished("b1", True, 520, 41)),
        ],
    )


def pulled_worker() -> dict:
    return published(
        traffic_state.initial_state(miner=C, model=MODEL, now=T0),
        qualified(C, T0)
        + [
            (NOW - 600, traffic_state.PaidFinished("c1", True, 300, 20)),
            (NOW - 590, traffic_state.PaidVerdict("c1", "cheat")),
        ],
    )


def new_worker() -> dict:
    return published(traffic_state.initial_state(miner=KEYED, model=MODEL, now=NOW - 50), [])


def degraded_own_worker() -> dict:
    """A first-party worker the breaker would have pulled for slow TTFT (45 s > 30 s)."""
    return published(
        traffic_state.initial_state(miner=OWN, model=MODEL, now=T0, first_party=True),
        [(T0, traffic_state.WorkerConnected())]
        + [(NOW - 120 + i, traffic_state.PaidFinished(f"o{i}", True, 45_000, 30)) for i in range(3)],
    )


def leg(
    miner: str,
    worker: str,
    capacity: int,
    inflight: int,
    heartbeat_age_s: float,
    leg_id: str = "a1b2c3d4",
    *,
    gemm_audit: bool | None = None,
) -> dict:
    return {
        "leg": leg_id,
        "miner": miner,
        "worker": worker,
        "model": MODEL,
        "capacity": capacity,
        "inflight": inflight,
        "heartbeat_age_s": heartbeat_age_s,
        "gemm_audit": gemm_audit,
    }


def gateway_states() -> dict:
    return {
        "node": {"version": "0.1"},
        "gateway": {
            "state": "ready",
            "buyer_url": "http://127.0.0.1:8080",
            "miner_url": "ws://127.0.0.1:8081",
            "provider_url": "http://127.0.0.1:8082",
            "models": [MODEL],
            "worker": 0,
            "workers": 1,
            "legs": [
                leg(A, "rig-a", 16, 12, 4.2),
                leg(A, "rig-a", 16, 3, 12.0, "a1b2c3d5"),
                leg(B, "home-5090", 8, 0, 61.0, gemm_audit=False),
                leg(C, "x", 16, 0, 2.0),
                leg(OWN, "own-1", 4, 4, 9.9),
            ],
        },
        "traffic": {
            "workers": [active_worker(), probing_worker(), pulled_worker(), new_worker(), degraded_own_worker()]
        },
        "audit": {
            **dataclasses.asdict(
                QueueCounts(waiting=3, leased=1, dropped_full=0, dropped_expired=2, dropped_unjudged=0)
            ),
            "recorded": 61,
        },
        "epochs": {
            "latest": 211,
            "digest": "9f2c4a1be0d8a7c6b5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3e1",
            "weights": [[A, 21804], [B, 19112], [OWN, 3000], [C, 0]],
        },
    }


def text(line) -> str:
    return "".join(cell.text for cell in line).rstrip()


# ---- formatting ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (0, "0 s"),
        (4.9, "4 s"),
        (119, "119 s"),
        (120, "2 min"),
        (7199, "119 min"),
        (7200, "2 h 0 min"),
        (3 * 3600 + 125, "3 h 2 min"),
        (2 * 86400 + 4 * 3600 + 59, "2 d 4 h"),
        (-1.5, "0 s"),
        (None, None),
        (float("nan"), None),
        (float("inf"), None),
    ],
)
def test_ages_are_words_that_fit_a_column(seconds, words):
    assert format_age(seconds) == words


def test_hotkeys_are_shortened_keys_keep_their_prefix():
    assert short_key(A) == "5F3s…YjQX"
    assert short_key("5F3s") == "5F3s"
    assert short_key(KEYED) == "key:9f8e7d…"
    assert short_key("key:abc") == "key:abc"
    assert short_key(None) == short_key("") == "n/a"
    assert short_key(A, head=8, tail=4) == "5F3sa2TJ…YjQX"


def test_local_names_come_from_the_node_infos_hotkeys():
    names = display_names({"miner1": A, "alias": A, "empty": "", "": B})
    assert names == {A: "alias"}, "sorted order picks the first name of a shared key; empty ones are ignored"
    assert display_names(None) == display_names({}) == {}
    assert miner_label(A, {A: "miner1"}) == "miner1"
    assert miner_label(B, {A: "miner1"}) == "5Gq8…uLGD"
    assert miner_label(None, {}) == "n/a"


# ---- cells --------------------------------------------------------------------------------------


def test_every_style_a_cell_can_have_is_defined():
    view = panel_view(typed(gateway_states()), now=NOW, names=NAMES)
    cells = [
        *view.status,
        *(c for row in view.table for c in row),
        *view.notes,
        *view.audit,
        *(c for row in view.epoch for c in row),
    ]
    assert {cell.style for cell in cells} <= set(STYLES)
    assert {"", "header", "na", "ok", "info", "warning", "error"} <= set(STYLES)


@pytest.mark.parametrize(
    ("worker", "cell"),
    [
        ({"state": "active"}, Cell("active ✔", "ok")),
        ({"state": "probing"}, Cell("probing", "info")),
        ({"state": "new"}, Cell("new", "na")),
        ({"state": "pulled"}, Cell("pulled ✘", "error")),
        ({"state": "active", "first_party": True}, Cell("active ✔ own", "ok")),
        ({"state": "new", "first_party": True}, Cell("new own", "ok")),
        ({"state": "retired"}, Cell("retired")),
        ({}, Cell("n/a", "na")),
        (None, Cell("n/a", "na")),
    ],
)
def test_the_state_is_a_word_with_a_mark_for_the_two_that_decide_traffic(worker, cell):
    assert state_cell(None if worker is None else standing(worker)) == cell


def test_the_link_shows_legs_and_the_oldest_heartbeat_and_flags_a_late_one():
    legs = legs_of(leg(A, "a", 4, 0, 4.2), leg(A, "a", 4, 0, 12.0))
    assert link_cell(None, legs) == Cell("2 legs · hb 12 s")
    assert link_cell(None, legs_of(leg(A, "a", 4, 0, HEARTBEAT_LATE_S + 1))) == Cell("1 leg · hb 46 s ⚠", "warning")
    assert link_cell(None, legs_of({"miner": A})) == Cell("1 leg")
    assert link_cell(standing({"connected": True}), ()) == Cell("connected")
    assert link_cell(standing({"connected": False, "state": "new"}), ()) == Cell("offline", "na")
    assert link_cell(standing({"connected": False, "state": "active"}), ()) == Cell("offline ⚠", "warning")
    assert link_cell(None, ()) == Cell("n/a", "na")


def test_the_link_says_where_the_miner_says_it_is_and_whether_it_says_it_serves_in_a_tee():
    tee = {**leg(A, "a", 4, 0, 2.0), "region": "eu-north", "tee": "on"}
    assert link_cell(None, legs_of(tee, tee)) == Cell("2 legs · TEE · eu-north · hb 2 s")
    assert link_cell(None, legs_of({**tee, "tee": "devtools"})) == Cell("1 leg · TEE devtools · eu-north · hb 2 s")
    odd = decode(GatewayLeg, {**tee, "region": 3, "tee": None})  # liberal, as the bridge reads
    assert link_cell(None, (odd,)) == Cell("1 leg · hb 2 s"), "what is not a string is not shown"


def test_load_is_inflight_over_capacity_summed_over_the_legs():
    assert load_cell(legs_of(leg(A, "a", 16, 12, 1), leg(A, "a", 16, 3, 1))) == Cell("15/32")
    assert load_cell(legs_of(leg(A, "a", 4, 4, 1))) == Cell("4/4 full", "warning")
    assert load_cell(()) == Cell("—", "na"), "no leg: nothing in flight, but no capacity either"


def test_load_shows_the_fullest_kv_cache_a_leg_reports_and_flags_a_full_one():
    assert load_cell(
        legs_of({**leg(A, "a", 8, 3, 1), "kv_used": 0.714}, {**leg(A, "a", 8, 0, 1), "kv_used": 0.2})
    ) == Cell("3/16 · kv 71%")
    assert load_cell(legs_of({**leg(A, "a", 8, 1, 1), "kv_used": 1.0})) == Cell("1/8 · kv 100% full", "warning")
    junk = decode_states({"gateway": {"legs": [{**leg(A, "a", 8, 1, 1), "kv_used": "most"}]}})
    assert junk.gateway is not None and load_cell(junk.gateway.legs) == Cell("1/8"), "junk reads as unreported"


def test_the_round_shows_its_probes_and_verdicts_and_flags_a_cheat_or_a_failed_probe():
    def cell(**round_: int) -> Cell:
        return round_cell(standing({"round": round_}))

    assert cell(probes=3, ok=3, **{"pass": 3}, cheat=0, unproven=0) == Cell("3/3 ok · 3 pass")
    assert cell(probes=1_204, ok=1_204, **{"pass": 1_202}, cheat=0, unproven=2) == Cell(
        "1,204/1,204 ok · 1,202 pass · 2 unproven"
    )
    assert cell(probes=14, ok=14, **{"pass": 12}, cheat=1, unproven=0) == Cell(
        "14/14 ok · 12 pass · 1 cheat ✘", "error"
    )
    assert cell(probes=5, ok=4, **{"pass": 3}, cheat=0, unproven=0) == Cell("4/5 ok · 3 pass ⚠", "warning")
    assert cell(probes=0) == round_cell(standing({})) == Cell("—", "na")
    assert round_cell(None) == Cell("n/a", "na"), "eligibility not published: unknown"


def test_the_audited_column_counts_gemm_verdicts_and_flags_a_miner_judged_by_toploc_alone():
    lifetime = {
        "audited": 14,
        "pass": 13,
        "unproven": 1,
        "proofs": {"toploc": {"pass": 2}, "gemm": {"pass": 11, "unproven": 1}},
    }
    worker = standing({"lifetime": lifetime})
    gemm, toploc = legs_of({"miner": A, "gemm_audit": True}), legs_of({"miner": A, "gemm_audit": False})
    assert audited_cell(worker, gemm) == Cell("14 · 1 unproven · 12 GEMM")
    assert audited_cell(worker, (*gemm, *toploc)) == Cell("14 · 1 unproven · 12 GEMM"), "one leg that audits is enough"
    alone = standing({"lifetime": {"audited": 3, "pass": 3, "proofs": {"toploc": {"pass": 3}}}})
    assert audited_cell(alone, toploc) == Cell("3 · TOPLOC alone ⚠", "warning")
    caught = standing({"lifetime": {"audited": 3, "pass": 2, "cheat": 1, "proofs": {"gemm": {"pass": 2, "cheat": 1}}}})
    assert audited_cell(caught, gemm) == Cell("3 · 1 cheat · 3 GEMM ✘", "error")
    assert audited_cell(None, toploc) == Cell("n/a · TOPLOC alone ⚠", "warning"), "flagged before any verdict"


def test_served_and_audited_are_totals_since_the_gateway_started_not_the_breakers_window():
    """Issue 31 (8): a local network's verifier had judged 44 answers while the table said
    "audited 0", because the cells showed the breaker's last minutes as if they were totals."""
    worker = standing(
        {
            "state": "active",
            "window": {"requests": 0, "failed": 0, "verdicts": 0, "unproven": 0},
            "lifetime": {"served": 1_204, "failed": 2, "audited": 44, "pass": 42, "cheat": 0, "unproven": 2},
        }
    )
    assert served_cell(worker) == Cell("1,204 · 2 failed")
    assert audited_cell(worker) == Cell("44 · 2 unproven")
    assert breaker_cell(worker, now=NOW) == Cell("closed ✔ · 0/0 failed · 0/0 unproven", "ok"), (
        "the window is the breaker's, and says so"
    )
    clean = standing({"lifetime": {"served": 5, "audited": 3, "pass": 3}})
    assert audited_cell(clean, legs_of({"miner": A, "gemm_audit": None})) == Cell("3"), "a gateway that does not say"
    assert served_cell(clean) == Cell("5") and audited_cell(clean) == Cell("3"), "zero goes without saying"
    cheat = standing({"lifetime": {"served": 9, "audited": 4, "pass": 3, "cheat": 1}})
    assert audited_cell(cheat) == Cell("4 · 1 cheat ✘", "error")
    assert served_cell(None) == audited_cell(None) == Cell("n/a", "na"), "eligibility not published"


def test_the_breaker_column_names_its_windows_from_the_protocol():
    assert BREAKER_HEADER == f"breaker (last {format_age(SERVED_WINDOW_S)} / {format_age(VERDICT_WINDOW_S)})"
    assert BREAKER_HEADER == "breaker (last 60 s / 5 min)"
    assert BREAKER_HEADER in COLUMNS and "served" in COLUMNS and "audited" in COLUMNS
    busy = standing({"state": "active", "window": {"requests": 120, "failed": 2, "verdicts": 61, "unproven": 1}})
    assert breaker_cell(busy, now=NOW) == Cell("closed ✔ · 2/120 failed · 1/61 unproven", "warning")


def test_the_breaker_is_closed_while_active_and_open_with_why_and_how_long_while_pulled():
    assert breaker_cell(standing(active_worker()), now=NOW) == Cell("closed ✔ · 0/5 failed · 0/0 unproven", "ok")
    assert breaker_cell(standing(pulled_worker()), now=NOW) == Cell("open ✘ cheat · 50 min left", "error")
    assert breaker_cell(standing(pulled_worker()), now=NOW + 7200) == Cell("open ✘ cheat · cooldown over", "error")
    striking = {
        "state": "pulled",
        "until": NOW + 30,
        "strikes": 3,
        "history": [{"from": "active", "to": "pulled", "code": "failure-rate", "at": NOW, "reason": "x"}],
    }
    assert breaker_cell(standing(striking), now=NOW) == Cell("open ✘ failure-rate · 30 s left · strike 3", "error")
    assert breaker_cell(standing({"state": "pulled"}), now=NOW) == Cell("open ✘", "error")
    assert breaker_cell(standing(probing_worker()), now=NOW) == Cell("—", "na")
    assert breaker_cell(standing(new_worker()), now=NOW) == Cell("—", "na")
    assert breaker_cell(standing({}), now=NOW) == breaker_cell(None, now=NOW) == Cell("n/a", "na")


def test_a_first_party_worker_the_breaker_would_have_pulled_says_tripped():
    assert breaker_cell(standing(degraded_own_worker()), now=NOW) == Cell("tripped ⚠ slow-ttft 119 s ago", "warning")
    healthy_own = published(
        traffic_state.initial_state(miner=OWN, model=MODEL, now=T0, first_party=True),
        [(T0, traffic_state.WorkerConnected())],
    )
    assert breaker_cell(standing(healthy_own), now=NOW) == Cell("closed ✔ · 0/0 failed · 0/0 unproven", "ok")


def test_the_gateway_line_says_where_it_listens():
    gateway = typed(gateway_states()).gateway
    assert gateway is not None
    assert text(gateway_line(gateway)) == (
        "buyers http://127.0.0.1:8080 · miners ws://127.0.0.1:8081 · provider http://127.0.0.1:8082 · model smollm2-135m"
    )
    assert (
        text(gateway_line(GatewayState(buyer_url="http://x", models=("a", "b"), workers=4)))
        == "buyers http://x · models a, b · 4 processes"
    )
    assert gateway_line(GatewayState()) == ()


def test_the_audit_line_flags_requests_dropped_unaudited():
    assert (
        text(audit_line(typed(gateway_states()).audit))
        == "audit  3 waiting · 1 leased to verifiers · 61 verdicts recorded · ⚠ dropped 2 unaudited (2 expired)"
    )
    clean = {**dataclasses.asdict(QueueCounts(0, 0, 0, 0, 0)), "recorded": 0}
    assert audit_line(typed({"audit": clean}).audit)[-1] == Cell(" · none dropped ✔", "ok")
    assert audit_line(None)[0].style == "na"


def test_weight_bars_are_drawn_in_eighths():
    assert weight_bar(1.0) == "█" * 20
    assert weight_bar(0.5, width=4) == "██"
    assert weight_bar(0.3, width=4) == "█▎", "9.6 eighths round to 10: one full cell and two eighths"
    assert weight_bar(0.0) == weight_bar(-1) == weight_bar(None) == weight_bar(float("nan")) == ""
    assert weight_bar(7.0, width=2) == "██"


def epochs(wire: dict) -> EpochsState | None:
    return decode_states({"epochs": wire}).epochs


def test_the_epoch_shows_each_hotkeys_share_largest_first_by_name():
    lines = [text(line) for line in epoch_lines(typed(gateway_states()).epochs, names=display_names(NAMES))]
    assert lines[0] == "epochs  epoch 211 published · digest 9f2c4a1b…b3e1 · 4 hotkeys weighted"
    assert lines[1].split() == ["name", "hotkey", "weight", "share"]
    assert lines[2].split()[:4] == ["miner1", "5F3s…YjQX", "21,804", "49.6%"]
    assert lines[3].split()[:4] == ["miner2", "5Gq8…uLGD", "19,112", "43.5%"]
    assert lines[5].split() == ["5Cz0…v1wQ", "0", "0.0%"], "an unnamed hotkey with no weight still shows"
    assert lines[2].index("21,804") + 6 == lines[4].index("3,000") + 5, "weights are right-aligned"


def test_the_epoch_lists_at_most_a_few_hotkeys_and_says_how_many_more():
    weights = [[f"5Key{i:02d}aaaaaaaaaaaaaaaaaaaaaaa", 100 - i] for i in range(MAX_WEIGHT_ROWS + 3)]
    lines = [text(line) for line in epoch_lines(epochs({"latest": 3, "digest": "ab", "weights": weights}), names={})]
    assert len(lines) == 2 + MAX_WEIGHT_ROWS + 1
    rest = sum(100 - i for i in range(MAX_WEIGHT_ROWS, MAX_WEIGHT_ROWS + 3))
    assert lines[-1] == f"  … and 3 more ({100 * rest / sum(w for _, w in weights):.1f}%)"


def test_an_epoch_without_weights_or_digest_is_still_shown():
    assert (
        text(epoch_lines(epochs({"latest": 0, "weights": []}), names={})[0])
        == "epochs  epoch 0 published · digest n/a · 0 hotkeys weighted"
    )
    zero = [text(line) for line in epoch_lines(epochs({"latest": 1, "digest": "d", "weights": [[A, 0]]}), names={})]
    assert zero[2].split() == ["5F3s…YjQX", "0", "n/a"], "a share of nothing is n/a, not 0%"
    junk = {"latest": 2, "weights": [[A], [B, -1], [3, 4], "x", ["", 2], [OWN, 7]]}
    assert [text(line).split()[0] for line in epoch_lines(epochs(junk), names={})[2:]] == ["5HGj…4Sxy"]
    assert (
        epoch_lines(None, names={})
        == epoch_lines(epochs({"latest": "seven"}), names={})
        == ((Cell("epochs  ", "header"), Cell("none published yet", "na")),)
    )


# ---- the view of whole states -------------------------------------------------------------------


def test_the_gateway_is_a_table_of_its_miners_needing_attention_first():
    view = panel_view(typed(gateway_states()), now=NOW, names=NAMES)

    assert view.title == "Gateway ✔ ready · 5 miners, 2 eligible"
    assert view.state == "ready"
    lines = [text(line) for line in view.table]
    assert [cell.text.strip() for cell in view.table[0]] == [
        "miner/worker",
        "state",
        "in state",
        "breaker (last 60 s / 5 min)",
        "link",
        "load",
        "qualifying round",
        "served",
        "audited",
    ], "one model: the gateway line names it, the table does not"
    assert [line.split()[0] for line in lines[1:]] == [
        "5Cz0…v1wQ/x",
        "miner2/home-5090",
        "key:9f8e7d…",
        "miner1/rig-a",
        "owner/own-1",
    ]
    pulled, probing, new, active, own = lines[1:]
    assert "pulled ✘" in pulled and "open ✘ cheat · 50 min left" in pulled
    assert "probing" in probing and "1 leg · hb 61 s ⚠" in probing and "2/2 ok · 1 pass" in probing
    assert "new" in new and "offline" in new
    assert "active ✔" in active and "closed ✔" in active and "2 legs · hb 12 s" in active and "15/32" in active
    assert "closed ✔ · 0/5 failed · 0/0 unproven" in active, "the breaker's window: 5 paid requests a minute ago"
    totals = [[cell.text.strip() for cell in row[-2:]] for row in view.table[1:]]
    assert totals == [["4", "4 · 1 cheat ✘"], ["2", "1 · TOPLOC alone ⚠"], ["0", "0"], ["8", "3"], ["3", "0"]], (
        "served and audited count every request and verdict since the gateway started, probes included; "
        "miner2's legs announce no GEMM audits"
    )
    assert "active ✔ own" in own and "4/4 full" in own and "tripped ⚠ slow-ttft 119 s ago" in own
    for column in ("state", "breaker", "load", "audited"):
        at = lines[0].index(column)
        assert all(line[at - 1] == " " and line[at] != " " for line in lines[1:]), f"{column} lines up"
    assert len(view.table[0]) == len(COLUMNS) - 1


def test_with_several_models_the_table_and_notes_name_them():
    states = gateway_states()
    other = {**pulled_worker(), "model": "qwen3.6-35b-a3b"}
    states["traffic"]["workers"] = [active_worker(), other]
    states["gateway"]["legs"] = []
    view = panel_view(typed(states), now=NOW, names=NAMES)
    lines = [text(line) for line in view.table]
    assert lines[0].split()[:2] == ["miner/worker", "model"] and len(view.table[0]) == len(COLUMNS)
    assert lines[1].split()[:2] == ["5Cz0…v1wQ", "qwen3.6-35b-a3b"] and lines[2].split()[:2] == [
        "miner1",
        "smollm2-135m",
    ]
    assert view.notes[0].text.startswith("✘ 5Cz0…v1wQ (qwen3.6-35b-a3b): pulled: cheat verdict")


def test_the_notes_give_the_control_planes_reasons():
    notes = panel_view(typed(gateway_states()), now=NOW, names=NAMES).notes
    assert [note.text for note in notes] == [
        "✘ 5Cz0…v1wQ/x: pulled: cheat verdict on request c1; qualifies again after 3600 s (strike 1)",
        "⚠ miner2/home-5090: no heartbeat for 61 s (a miner beats every 30 s; the gateway drops a leg "
        "after 90 s): check the miner's network",
        "⚠ owner/own-1: degraded (first-party, stays eligible): ttft p99 45000 ms > 30000 ms over 2 "
        "requests within 60 s (2 slow)",
    ]
    assert [note.style for note in notes] == ["error", "warning", "warning"]


def test_an_active_worker_without_a_leg_is_noted():
    states = gateway_states()
    states["gateway"]["legs"] = []
    gone = published(
        traffic_state.initial_state(miner=A, model=MODEL, now=T0),
        qualified(A, T0) + [(NOW - 5, traffic_state.WorkerDisconnected())],
    )
    states["traffic"]["workers"] = [gone]
    notes = worker_notes(typed(states), now=NOW, names=display_names(NAMES))
    assert [note.text for note in notes] == [f"⚠ miner1 has no live leg: {gone['reason']}"]


def test_notes_are_capped_and_say_how_many_more():
    pulled = [
        {"miner": f"5Pulled{i:02d}xxxxxxxxxxxxxxxxxxxxxxxxxx", "model": MODEL, "state": "pulled", "reason": f"r{i}"}
        for i in range(MAX_NOTES + 4)
    ]
    notes = worker_notes(typed({"gateway": {}, "traffic": {"workers": pulled}}), now=NOW, names={})
    assert len(notes) == MAX_NOTES
    assert notes[-1] == Cell("… and 5 more", "na")


def test_rows_come_from_legs_too_when_eligibility_is_not_published():
    states = {"gateway": {"state": "ready", "legs": [leg(A, "rig-a", 8, 2, 3.0)]}}
    view = panel_view(typed(states), now=NOW, names=NAMES)
    assert view.title == "Gateway ✔ ready · 1 miner"
    row = text(view.table[1])
    assert row.split()[:4] == ["miner1/rig-a", "n/a", "n/a", "n/a"], "state, time in it and breaker unknown"
    assert "2/8" in row
    assert view.status[-1] == Cell("eligibility not published (qualification off, or no change yet): states n/a", "na")


def test_a_miner_with_several_workers_names_the_first_and_counts_the_others():
    states = {
        "gateway": {
            "state": "ready",
            "legs": [leg(A, "rig-b", 8, 0, 1), leg(A, "rig-a", 8, 0, 1), leg(A, "rig-c", 8, 0, 1)],
        },
        "traffic": {"workers": [active_worker()]},
    }
    rows = miner_rows(typed(states), now=NOW, names={})
    assert len(rows) == 1 and rows[0][0] == Cell("5F3s…YjQX/rig-a +2")
    assert rows[0][COLUMNS.index("load")] == Cell("0/24")


def test_before_the_first_snapshot_and_without_a_gateway_the_panel_says_so():
    assert panel_view(None, now=0.0).status == (Cell("waiting for the node's first snapshot", "na"),)
    absent = panel_view(typed({"miner-1": {"model": MODEL}}), now=0.0)
    assert absent.status == (Cell("no gateway on this node", "na"),) and absent.state == "absent"
    assert absent.table == absent.notes == absent.audit == absent.epoch == ()


def test_a_stopped_gateway_says_so_in_words_and_keeps_what_it_knew():
    states = gateway_states()
    states["gateway"]["state"] = "stopped"
    view = panel_view(typed(states), now=NOW, names=NAMES)
    assert view.title.startswith("Gateway ✘ stopped") and view.state == "stopped"
    assert view.status[0] == Cell("✘ the gateway has stopped: buyers and miners cannot reach it", "error")
    assert len(view.table) == 6


def test_a_gateway_without_miners_says_none_has_connected():
    view = panel_view(typed({"gateway": {"state": "ready", "legs": []}, "traffic": {"workers": []}}), now=NOW)
    assert view.table == () and view.status[-1] == Cell("no miner has connected yet", "na")
    assert view.title == "Gateway ✔ ready · 0 miners, 0 eligible"
    assert panel_view(typed({"gateway": {"state": "starting"}}), now=NOW).title == "Gateway starting · 0 miners"
    assert panel_view(typed({"gateway": {}}), now=NOW).title == "Gateway state n/a · 0 miners"


# ---- any JSON -----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def field_values(keys: list[str]) -> st.SearchStrategy[dict]:
    """Dicts with the producers' keys (any subset) holding any JSON, and the odd stranger."""
    return (
        st.dictionaries(
            st.sampled_from(keys),
            JSON | st.sampled_from(["active", "pulled", "probing", "new", "ok", A]),
            max_size=len(keys),
        )
        | JSON
    )


WORKER = field_values(
    [
        "miner",
        "model",
        "state",
        "since",
        "reason",
        "eligible",
        "first_party",
        "connected",
        "until",
        "strikes",
        "round",
        "window",
        "lifetime",
        "history",
    ]
)
LEG = field_values(["leg", "miner", "worker", "model", "capacity", "inflight", "heartbeat_age_s", "kv_used"])
STATES = (
    st.fixed_dictionaries(
        {},
        optional={
            "gateway": st.fixed_dictionaries(
                {},
                optional={
                    "state": JSON | st.just("ready"),
                    "buyer_url": JSON,
                    "models": JSON,
                    "workers": JSON,
                    "legs": st.lists(LEG, max_size=4) | JSON,
                },
            )
            | JSON,
            "traffic": st.fixed_dictionaries({}, optional={"workers": st.lists(WORKER, max_size=4) | JSON}) | JSON,
            "audit": field_values(
                ["waiting", "leased", "dropped_full", "dropped_expired", "dropped_unjudged", "recorded"]
            ),
            "epochs": field_values(["latest", "digest", "weights"]),
            "buyers": field_values(["accounts", "top"]),
        },
    )
    | JSON
)


@settings(max_examples=300, deadline=None)
@given(states=STATES, now=st.floats(), names=JSON | st.dictionaries(st.text(max_size=6), st.text(max_size=6) | JSON))
def test_no_json_makes_the_panel_raise(states, now, names):
    """Whatever a node sends, decoded liberally as the bridge does, the panel never raises."""
    decoded = decode_states(states) if isinstance(states, dict) else None
    hotkeys = decode_states({"node": {"hotkeys": names}}).node.hotkeys
    view = panel_view(decoded, now=now, names=hotkeys)
    cells = [
        *view.status,
        *(c for row in view.table for c in row),
        *view.notes,
        *view.audit,
        *(c for row in view.epoch for c in row),
    ]
    assert all(isinstance(cell.text, str) and cell.style in STYLES for cell in cells)


@settings(max_examples=200, deadline=None)
@given(worker=WORKER, legs=st.lists(LEG, max_size=3), now=st.floats())
def test_no_worker_or_leg_makes_a_cell_raise(worker, legs, now):
    states = decode_states({"traffic": {"workers": [worker]}, "gateway": {"legs": legs}})
    assert states.traffic is not None and states.gateway is not None
    worker = states.traffic.workers[0] if states.traffic.workers else None
    legs = states.gateway.legs
    for cell in (
        state_cell(worker),
        link_cell(worker, legs),
        load_cell(legs),
        round_cell(worker),
        served_cell(worker),
        audited_cell(worker),
        breaker_cell(worker, now=now),
    ):
        assert isinstance(cell.text, str) and cell.text and cell.style in STYLES


# ---- the widget ---------------------------------------------------------------------------------


class PanelApp(App[None]):
    """Just the panel, showing one set of states at one time."""

    def __init__(self, states: dict | None, now: float, names: dict | None = None) -> None:
        super().__init__()
        self.states, self.now, self.names = None if states is None else typed(states), now, names

    def compose(self) -> ComposeResult:
        yield GatewayPanel()

    def on_mount(self) -> None:
        self.query_one(GatewayPanel).update_state(self.states, now=self.now, names=self.names)


def shown(app: App, widget_id: str) -> str:
    return str(app.query_one(f"#{widget_id}", Static).content)


def test_the_widget_renders_the_states_and_follows_new_ones():
    async def scenario() -> None:
        app = PanelApp(None, 0.0)
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(GatewayPanel)
            assert shown(app, "status") == "waiting for the node's first snapshot"
            assert panel.has_class("-absent")
            assert not any(app.query_one(f"#{part}").display for part in ("table", "notes", "audit", "epoch"))

            panel.update_state(typed(gateway_states()), now=NOW, names=NAMES)
            await pilot.pause()
            assert panel.border_title == "Gateway ✔ ready · 5 miners, 2 eligible"
            assert not panel.has_class("-absent") and not panel.has_class("-stopped")
            table = shown(app, "table").splitlines()
            assert len(table) == 6 and table[0].startswith("miner/worker") and table[4].startswith("miner1/rig-a")
            assert shown(app, "notes").splitlines()[0].startswith("✘ 5Cz0…v1wQ/x: pulled: cheat verdict")
            assert shown(app, "audit").startswith("audit  3 waiting")
            assert shown(app, "epoch").splitlines()[0].startswith("epochs  epoch 211 published")

            stopped = gateway_states()
            stopped["gateway"]["state"] = "stopped"
            panel.update_state(typed(stopped), now=NOW)
            await pilot.pause()
            assert panel.has_class("-stopped")
            assert shown(app, "table").splitlines()[4].startswith("5F3s…YjQX/rig-a"), "without names, shortened keys"

            panel.update_state(typed({"node": {}}), now=NOW)
            await pilot.pause()
            assert shown(app, "status") == "no gateway on this node" and panel.has_class("-absent")
            assert not app.query_one("#table").display

    asyncio.run(scenario())


def test_text_from_the_network_is_never_read_as_markup():
    async def scenario() -> None:
        states = {
            "gateway": {"state": "ready", "buyer_url": "http://[bold]x[/bold]"},
            "traffic": {
                "workers": [{"miner": "[red]m", "model": MODEL, "state": "pulled", "reason": "[Errno 111] refused"}]
            },
        }
        app = PanelApp(states, NOW)
        async with app.run_test(size=SIZE):
            assert "http://[bold]x[/bold]" in shown(app, "status")
            assert "[Errno 111] refused" in shown(app, "notes")

    asyncio.run(scenario())


def test_gateway_snapshot(snap_compare):
    assert snap_compare(PanelApp(gateway_states(), NOW, NAMES), terminal_size=SIZE)


def test_stopped_gateway_snapshot(snap_compare):
    states = gateway_states()
    states["gateway"]["state"] = "stopped"
    states["gateway"]["legs"] = []
    states["traffic"]["workers"] = [active_worker()]
    assert snap_compare(PanelApp(states, NOW, NAMES), terminal_size=(160, 16))


def test_no_gateway_snapshot(snap_compare):
    assert snap_compare(PanelApp({"node": {}}, NOW), terminal_size=(80, 5))


def test_a_sub_cent_charge_shows_as_such_never_as_zero():
    buyers = {
        "accounts": 1,
        "top": [{"account_id": 1, "name": "demo", "available": 9_999_850, "held": 0, "charged": 150}],
    }
    line = text(buyers_lines(typed({"buyers": buyers}).buyers)[2])
    assert "$0.000150" in line and "$9.999850" in line and "$0.0000 " not in line + " "


def test_buyers_show_accounts_by_spend_with_their_balances_and_never_a_key():
    buyers = {
        "accounts": 3,
        "top": [
            {"account_id": 1, "name": "local-buyer", "available": 9_876_543, "held": 12_000, "charged": 123_457},
            {"account_id": 2, "name": "acme", "available": 0, "held": 0, "charged": 0},
        ],
    }
    lines = [text(line) for line in buyers_lines(typed({"buyers": buyers}).buyers)]
    assert lines[0] == "buyers  3 accounts · top by spend (the ledger's, all time)"
    assert "#1 local-buyer" in lines[2]
    assert "$0.123457" in lines[2] and "$9.876543" in lines[2] and "$0.012000" in lines[2]
    assert "#2 acme" in lines[3]
    assert buyers_lines(None) == ()
    assert text(buyers_lines(BuyersState())[0]) == "buyers  0 accounts · top by spend (the ledger's, all time)"
