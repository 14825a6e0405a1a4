"""The verifier's GEMM audit (engy_node/verifier/gemm_audit.py): the picks are drawn from the
verifier's secret and the root alone and open whole layers inside the commitment; answers
captured by the reference server's own capture path on SmolLM2 pass when served honestly in
bf16 or fp32, and are caught when an opening is tampered with, missing or extra, when the
commitment is not this model's, or when the served weights carry 1e-2 noise; the `Judge` folds
the GEMM verdict in with TOPLOC's."""

from __future__ import annotations

import base64
import dataclasses
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node import proof
from engy_node.calibration import add_weight_noise
from engy_node.gemm.activations import FORMAT, Commitment, CommitmentError, llama_layout
from engy_node.models import SMOLLM2_135M, model_root
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.gemm import GemmPick
from engy_node.protocol.miner import Sampling
from engy_node.serve.capture import ActivationCapture, SharedOpenings
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
from engy_node.serve.sampling import parse_sampling_params
from engy_node.verifier import gemm_audit as ga
from engy_node.verifier.judge import Judge

SMOLLM2 = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
}
PROMPT = (1, 504, 3158, 282, 4649, 314, 1690, 30)
NEW_TOKENS = 5
SECRET = b"the verifier's secret"


def commitment_wire(positions: int, layers: int = 30, root: bytes = b"\x07" * 32, dtype: str = "bfloat16") -> dict:
    return Commitment(root, llama_layout({**SMOLLM2, "num_hidden_layers": layers}, dtype), positions).to_wire()


commitments = st.builds(
    commitment_wire,
    positions=st.integers(1, 400),
    layers=st.integers(1, 40),
    root=st.binary(min_size=32, max_size=32),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
)
plans = st.builds(ga.AuditPlan, positions=st.integers(1, 8), layers=st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(commitment=commitments, plan=plans, secret=st.binary(min_size=1, max_size=32), data=st.data())
def test_picks_open_whole_layers_inside_the_commitment_deterministically(commitment, plan, secret, data):
    positions = commitment["positions"]
    prompt = data.draw(st.integers(1, positions))
    picks = ga.draw_picks(secret, commitment, plan, prompt_positions=prompt)
    assert picks == ga.draw_picks(secret, commitment, plan, prompt_positions=prompt)
    assert picks == ga.draw_picks(secret, {**commitment, "rid": "other"}, plan, prompt_positions=prompt)
    layout = Commitment.from_wire(commitment).layout
    assert len(set(picks)) == len(picks)
    assert all(layout.canonical(p.layer, p.group) == (p.layer, p.group) and 0 <= p.position < positions for p in picks)
    audited = ga.audited_layers(layout, picks)
    drawn = sorted({position for layer_positions in audited.values() for position in layer_positions})
    assert drawn == sorted({p.position for p in picks})
    assert len(drawn) == min(plan.positions, positions)
    for position in drawn:
        layers = [layer for layer, at in audited.items() if position in at]
        assert len(layers) == min(plan.layers, layout.layers)
    if plan.positions >= 2 and prompt < positions:
        assert min(drawn) < prompt <= max(drawn), "a prompt and a generated position"


@settings(max_examples=30, deadline=None)
@given(
    root=st.binary(min_size=32, max_size=32),
    first=st.binary(min_size=8, max_size=8),
    other=st.binary(min_size=8, max_size=8),
)
def test_another_secret_or_root_draws_other_picks(root, first, other):
    if first == other:
        return
    commitment = commitment_wire(200, root=root)
    picks = ga.draw_picks(first, commitment)
    assert picks != ga.draw_picks(other, commitment)
    assert picks != ga.draw_picks(first, commitment_wire(200, root=bytes([root[0] ^ 1]) + root[1:]))


def test_the_draw_reaches_a_cheat_on_a_few_layers_at_the_plans_exact_rate():
    """What the catch rates of cheats confined to some layers are held to (docs/verification.md,
    bench/gemm_audit.py's reach table): each position's layers are drawn uniformly without
    repeats and independently of the other positions', so the last 4 of 30 layers are reached
    with probability 1 − (C(26, 2) / C(30, 2))⁴ = 68.8 %, and each layer is opened in 8 / 30 of
    the plan's slots. Fixed secrets, so the counts are the same every run; the margins are 4.7
    and 6.5 standard errors (a draw of layers shared by the positions would reach 25.3 %)."""
    commitment = commitment_wire(120)
    layout = Commitment.from_wire(commitment).layout
    audits = 3000
    reached = 0
    opened = [0] * 30
    for index in range(audits):
        audited = ga.audited_layers(layout, ga.draw_picks(index.to_bytes(4, "big"), commitment, prompt_positions=70))
        reached += any(layer >= 26 for layer in audited)
        for layer, positions in audited.items():
            opened[layer] += len(positions)
    expected = 1 - (math.comb(26, 2) / math.comb(30, 2)) ** 4
    assert abs(reached / audits - expected) < 0.04, (reached, audits, expected)
    assert sum(opened) == audits * 8
    assert all(abs(count / (audits * 8) - 1 / 30) < 0.0075 for count in opened), opened


@given(start=st.integers(0, 159), secret=st.binary(min_size=1, max_size=8))
def test_picks_stay_inside_a_commitment_that_starts_after_a_cached_prefix(start, secret):
    commitment = {**commitment_wire(200), "start": start} if start else commitment_wire(200)
    picks = ga.draw_picks(secret, commitment, prompt_positions=160)
    assert picks and min(pick.position for pick in picks) >= start
    assert any(pick.position < 160 for pick in picks) and any(pick.position >= 160 for pick in picks)


@given(
    secret=st.binary(min_size=1, max_size=32),
    rows=st.integers(min_value=1, max_value=5000),
    k=st.integers(min_value=1, max_value=64),
)
def test_rows_drawn_for_the_row_check_are_distinct_sorted_in_range_and_repeatable(secret, rows, k):
    root = b"\x01" * 32
    drawn = ga.draw_rows(secret, root, "rows/0/q_proj", rows, k)
    assert drawn == sorted(set(drawn)) and len(drawn) == min(k, rows)
    assert all(0 <= row < rows for row in drawn)
    assert drawn == ga.draw_rows(secret, root, "rows/0/q_proj", rows, k)


@settings(deadline=None)  # the first example may compile the draw's loop (gemm_kernels), seconds
@given(
    secret=st.binary(min_size=1, max_size=32),
    rows=st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=12),
    k=st.integers(min_value=1, max_value=64),
)
def test_rows_drawn_for_many_labels_at_once_are_each_labels_own_draw(secret, rows, k):
    """The judge draws every (layer, projection)'s rows in one pass: the same rows as one at a
    time, matrices with fewer than 4k rows (drawn by `draw_rows` itself) among them."""
    root = b"\x02" * 32
    labels = [f"rows/{layer}/q_proj" for layer in range(len(rows))]
    together = ga.draw_row_sets(secret, root, labels, rows, k)
    assert [list(chosen) for chosen in together] == [
        ga.draw_rows(secret, root, label, count, k) for label, count in zip(labels, rows, strict=True)
    ]


@pytest.mark.parametrize(
    "broken",
    [
        {},
        {"format": "engy-activations-v3"},
        {"activations_root": "zz"},
        {"layers": 0},
        {"dtype": "int8"},
        # Sizes no model has, which would cost the verifier time and memory to draw over:
        {"layers": 300_000},
        {"positions": 2**40},
        {"groups": [["residual_in", 576], ["q", 2**30]]},
    ],
)
def test_a_malformed_commitment_draws_nothing(broken):
    with pytest.raises(CommitmentError):
        ga.draw_picks(SECRET, {**commitment_wire(10), **broken} if broken else {})


@pytest.mark.parametrize(
    ("step", "code"),
    [
        ("q_proj", "q-proj"),
        ("rows down_proj", "rows-down-proj"),
        ("silu(gate)·up", "silu-gate-up"),
        ("q/k/v input", "q-k-v-input"),
    ],
)
def test_steps_read_as_kebab_case_reasons(step, code):
    assert ga.step_code(step) == code


# ---- real answers -------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    """One answer as the reference server commits it, and the store that opens it."""

    commitment: dict
    output_ids: list[int]
    store: SharedOpenings
    rid: str
    generation: Generation

    @property
    def positions(self) -> int:
        return len(PROMPT) + len(self.output_ids) - 1

    def evidence(self, picks: tuple[GemmPick, ...]) -> ga.GemmEvidence:
        """The openings as `POST /gemm/openings` writes them (`serve.gemm_routes`)."""
        opened = self.store.open(self.rid, [(p.position, p.layer, p.group) for p in picks])
        assert opened is not None
        record, openings = opened
        layout = record.layout
        return ga.GemmEvidence(picks, tuple(o.to_wire(layout.dtype, layout.width(o.group)) for o in openings))


def serve(runner: ModelRunner, rid: str, format: str = FORMAT) -> Answer:
    """A greedy answer through the engine's own step and the server's capture, committed in
    `format` (a miner on an earlier release commits v1)."""
    store = SharedOpenings()
    layout = llama_layout(runner.model.config.to_dict(), runner.dtype, format)
    generation = Generation(
        rid=rid,
        input_ids=list(PROMPT),
        params=parse_sampling_params({"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}),
        return_hidden_states=True,
    )
    generation.capture = ActivationCapture(layout, store, weights_root="", arithmetic=runner.dtype)
    run_to_completion(runner, generation)
    assert generation.gemm_commitment is not None
    return Answer(generation.gemm_commitment, list(generation.output_ids), store, rid, generation)


@pytest.fixture(scope="module")
def verifier_runner(checkpoint):
    """The verifier's runner, float32 as `Judge` loads it by default; it also serves fp32."""
    return ModelRunner.load(checkpoint, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def model(verifier_runner):
    return ga.gemm_model_of(verifier_runner, secret=SECRET)


@pytest.fixture(scope="module")
def answers(runner, verifier_runner, checkpoint):
    noisy = add_weight_noise(ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16"), 1e-2)
    return {
        "bfloat16": serve(runner, "bf16"),
        "float32": serve(verifier_runner, "fp32"),
        "noisy": serve(noisy, "noisy"),
        "bfloat16 v1": serve(runner, "bf16-v1", "engy-activations-v1"),
        "noisy v1": serve(noisy, "noisy-v1", "engy-activations-v1"),
    }


def audit(model, answer: Answer, plan: ga.AuditPlan = ga.DEFAULT_PLAN, **changes) -> ga.GemmJudgement:
    picks = ga.draw_picks(SECRET, answer.commitment, plan, prompt_positions=len(PROMPT))
    evidence = dataclasses.replace(answer.evidence(picks), **changes)
    return ga.judge_openings(model, answer.commitment, evidence, expected_positions=answer.positions)


@pytest.mark.parametrize("served", ["bfloat16", "float32", "bfloat16 v1"])
def test_honest_answers_pass_on_every_position_and_layer(model, answers, served):
    answer = answers[served]
    assert answer.commitment["dtype"] == served.split()[0] and answer.positions == 12
    everything = ga.AuditPlan(positions=answer.positions, layers=30)
    judgement = audit(model, answer, everything)
    assert (judgement.kind, judgement.reason) == ("pass", "ok"), judgement.failed
    assert len(judgement.checks) == 30 * (7 + 7 + 6)
    assert audit(model, answer).kind == "pass"


def test_a_tampered_missing_or_extra_opening_is_a_cheat(model, answers):
    answer = answers["bfloat16"]
    picks = ga.draw_picks(SECRET, answer.commitment, prompt_positions=len(PROMPT))
    openings = answer.evidence(picks).openings
    assert openings is not None
    tampered = dict(openings[5])
    data = bytearray(base64.b64decode(tampered["values"]["data"]))
    data[0] ^= 1
    tampered["values"] = {**tampered["values"], "data": base64.b64encode(bytes(data)).decode()}
    other = answer.evidence((GemmPick(0, 0, "q"),)).openings
    assert other is not None
    for evidence in (
        ga.GemmEvidence(picks, (*openings[:5], tampered, *openings[6:])),
        ga.GemmEvidence(picks, openings[1:]),
        ga.GemmEvidence(picks, (*openings, openings[0])),
        ga.GemmEvidence(picks, (*openings, *other) if GemmPick(0, 0, "q") not in picks else openings[:-1]),
        ga.GemmEvidence(picks, (*openings[:-1], {"position": "nine"})),
    ):
        judgement = ga.judge_openings(model, answer.commitment, evidence, expected_positions=answer.positions)
        assert (judgement.kind, judgement.reason) == ("cheat", "opening")


def test_no_openings_are_unproven(model, answers):
    judgement = audit(model, answers["bfloat16"], openings=None, failure="the miner did not answer in time")
    assert (judgement.kind, judgement.reason) == ("unproven", "no-opening")


def test_a_commitment_that_is_not_this_answers_on_this_model_is_a_cheat(model, answers):
    answer = answers["bfloat16"]
    evidence = answer.evidence(ga.draw_picks(SECRET, answer.commitment))
    for wire, positions in (
        ({**answer.commitment, "layers": 29}, answer.positions),
        ({**answer.commitment, "groups": [[name, width * 2] for name, width in answer.commitment["groups"]]}, 12),
        (answer.commitment, answer.positions + 1),
    ):
        judgement = ga.judge_openings(model, wire, evidence, expected_positions=positions)
        assert (judgement.kind, judgement.reason) == ("cheat", "commitment")
    unreadable = ga.judge_openings(model, {**answer.commitment, "format": "v9"}, evidence, expected_positions=12)
    assert (unreadable.kind, unreadable.reason) == ("unproven", "malformed-commitment")


@pytest.mark.parametrize("served", ["noisy", "noisy v1"])
def test_weights_with_one_percent_noise_are_caught_by_the_row_check(model, answers, served):
    judgement = audit(model, answers[served])
    assert judgement.kind == "cheat"
    # Each row moves by about as much as bf16's own rounding: Freivalds' statistic, summed over
    # the rows, stays inside its tolerance; recomputing the rows does not.
    assert judgement.reason.startswith("rows-"), judgement.failed
    layers = {check.layer for check in judgement.checks}
    assert all(any(not c.passed for c in judgement.checks if c.layer == layer) for layer in layers)


# ---- the Judge ----------------------------------------------------------------------------


def job_for(answer: Answer, checkpoint, **gemm) -> AuditJob:
    commitment = proof.build_commitment(
        model_root=model_root(checkpoint),
        prompt_ids=PROMPT,
        output_ids=answer.output_ids,
        rows=answer.generation.proof_rows(),
        params=SMOLLM2_135M.proof,
    )
    return AuditJob(
        request_id=answer.rid,
        model=SMOLLM2_135M.id,
        miner="key:m",
        kind="probe",
        prompt_ids=PROMPT,
        commitment=commitment.to_wire(),
        greedy=True,
        sampling=Sampling(),
        seeded=False,
        delivery=proof.Delivery(tuple(answer.output_ids), ended_at_stop=False, max_tokens=NEW_TOKENS),
        created_at=time.time(),
        **gemm,
    )


def test_the_judge_adds_the_gemm_verdict_to_toplocs(checkpoint, answers):
    judge = Judge({SMOLLM2_135M.id: checkpoint}, dtype="float32", gemm_secret=SECRET)
    honest, noisy = answers["bfloat16"], answers["noisy"]

    def judged(answer: Answer, evidence: ga.GemmEvidence | None, **gemm) -> str:
        return judge.judge(job_for(answer, checkpoint, **gemm), evidence).code

    def evidence(answer: Answer) -> ga.GemmEvidence:
        return answer.evidence(ga.draw_picks(b"role secret", answer.commitment, prompt_positions=len(PROMPT)))

    asked = {"gemm_asked": True, "gemm_commitment": honest.commitment}
    assert judged(honest, None) == "ok"
    assert judged(honest, evidence(honest), **asked) == "gemm:ok", "both proofs passed it: counted as GEMM-audited"
    assert judged(honest, None, **asked) == "ok", "no evidence gathered: TOPLOC alone"
    assert judged(honest, ga.GemmEvidence(evidence(honest).picks, None), **asked) == "gemm:no-opening"
    assert judged(honest, None, gemm_asked=True) == "gemm:no-commitment"
    # The noisy miner's TOPLOC proofs are of its own hidden states, and its greedy tokens may
    # well be the canonical model's (on this prompt they are: TOPLOC alone passes it); the GEMM
    # audit catches it either way, and a TOPLOC cheat keeps its own reason.
    job = job_for(noisy, checkpoint, gemm_asked=True, gemm_commitment=noisy.commitment)
    alone, audited = judge.judge(job), judge.judge(job, evidence(noisy))
    assert audited.kind == "cheat"
    assert audited.code == alone.code if alone.kind == "cheat" else audited.code.startswith("gemm:rows-"), audited
    relayed = (*noisy.output_ids[:-1], noisy.output_ids[-1] + 1)
    mismatch = dataclasses.replace(job, delivery=dataclasses.replace(job.delivery, relayed_output_ids=relayed))
    verdict = judge.judge(mismatch, evidence(noisy))
    assert (verdict.kind, verdict.path) == ("cheat", "toploc"), verdict
