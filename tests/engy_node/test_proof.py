"""proof.py: wire parsing, shape checks, chunk and token rules, and TOPLOC on synthetic rows."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node import logit_stats, proof, token_evidence
from engy_node.models import SMOLLM2_135M, ProofParams, TokenCheckParams
from engy_node.protocol.miner import SEEDED_TOP_K

PARAMS = ProofParams()
ROOT = "ab" * 32


def honest_commitment(n_tokens: int = 70, hidden: int = 64, seed: int = 0) -> tuple[proof.Commitment, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_tokens, hidden, generator=generator).to(torch.bfloat16)
    commitment = proof.build_commitment(
        model_root=ROOT, prompt_ids=[1, 2, 3], output_ids=list(range(10, 10 + n_tokens)), rows=rows, params=PARAMS
    )
    return commitment, rows


def test_a_commitment_has_one_258_byte_proof_per_32_tokens():
    commitment, _ = honest_commitment(70)
    assert len(commitment.proofs) == 3 == proof.expected_proof_count(70, 32)
    import base64

    assert all(len(base64.b64decode(p)) == 258 for p in commitment.proofs)
    assert commitment.n_tokens == 70 and commitment.skip_prefill is True


def test_the_wire_form_matches_spec_section_4_and_round_trips():
    commitment, _ = honest_commitment(5)
    wire = commitment.to_wire()
    assert set(wire) == {"model_root", "output_token_ids", "toploc"}
    assert set(wire["toploc"]) == {"proofs", "topk", "decode_batching_size", "skip_prefill", "n_tokens", "prompt_ids"}
    assert proof.Commitment.from_wire(wire) == commitment


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )
)
@settings(max_examples=200)
def test_parsing_arbitrary_json_either_succeeds_or_raises_a_format_error(value):
    try:
        proof.Commitment.from_wire(value)
    except proof.ProofFormatError:
        pass


@given(
    st.lists(st.integers(-3, 2**31 + 3) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=2), max_size=6)
)
def test_a_token_list_is_accepted_exactly_when_every_item_is_a_plain_integer_id(items):
    wire = honest_commitment(5)[0].to_wire()
    wire["output_token_ids"] = items
    valid = all(type(t) is int and 0 <= t <= proof.MAX_TOKEN_ID for t in items)
    try:
        parsed = proof.Commitment.from_wire(wire)
    except proof.ProofFormatError as error:
        assert not valid and "commitment.output_token_ids" in str(error)
    else:
        assert valid and parsed.output_token_ids == tuple(items)


@pytest.mark.parametrize("field", ["topk", "n_tokens", "decode_batching_size"])
def test_a_boolean_where_an_integer_belongs_is_rejected(field):
    wire = honest_commitment(5)[0].to_wire()
    wire["toploc"][field] = True
    with pytest.raises(proof.ProofFormatError, match=field):
        proof.Commitment.from_wire(wire)


def test_recomputing_the_same_rows_passes_every_chunk():
    commitment, rows = honest_commitment(100)
    chunks = proof.verify_chunks(commitment, rows, PARAMS)
    assert len(chunks) == 4 and all(c.exp_mismatches == 0 and c.passes(PARAMS) for c in chunks)


def test_unrelated_rows_fail_every_chunk():
    commitment, rows = honest_commitment(64)
    other = torch.randn(rows.shape, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    chunks = proof.verify_chunks(commitment, other, PARAMS)
    assert not any(c.passes(PARAMS) for c in chunks)
    assert proof.judge(chunks, None, PARAMS).kind == "cheat"


def test_small_numeric_noise_passes_and_large_noise_fails():
    commitment, rows = honest_commitment(64, hidden=256)
    generator = torch.Generator().manual_seed(5)

    def noisy(scale):
        return (rows.float() * (1 + scale * torch.randn(rows.shape, generator=generator))).to(torch.bfloat16)

    assert all(c.passes(PARAMS) for c in proof.verify_chunks(commitment, noisy(0.005), PARAMS))
    assert not any(c.passes(PARAMS) for c in proof.verify_chunks(commitment, noisy(0.5), PARAMS))


def test_building_proofs_from_an_empty_matrix_is_refused():
    with pytest.raises(ValueError):
        proof.build_proofs(torch.zeros(0, 8), PARAMS)


@pytest.mark.parametrize(
    ("mutate", "kind", "reason"),
    [
        (lambda c: dataclasses.replace(c, model_root="cd" * 32), "unproven", "model-root"),
        (lambda c: dataclasses.replace(c, topk=64), "unproven", "shape:topk"),
        (lambda c: dataclasses.replace(c, decode_batching_size=16), "unproven", "shape:decode_batching_size"),
        (lambda c: dataclasses.replace(c, skip_prefill=False), "unproven", "shape:skip_prefill"),
        (lambda c: dataclasses.replace(c, n_tokens=c.n_tokens + 1), "unproven", "shape:n_tokens"),
        (lambda c: dataclasses.replace(c, proofs=c.proofs[:1]), "unproven", "shape:proofs"),
        (lambda c: dataclasses.replace(c, proofs=("%%%",) + c.proofs[1:]), "unproven", "malformed-proof"),
        (lambda c: dataclasses.replace(c, proofs=("AAAA",) + c.proofs[1:]), "unproven", "malformed-proof"),
        (lambda c: dataclasses.replace(c, prompt_ids=(9, 9, 9)), "cheat", "prompt-mismatch"),
    ],
)
def test_shape_checks_judge_before_any_arithmetic(mutate, kind, reason):
    commitment = mutate(honest_commitment(40)[0])
    verdict = proof.check_shape(commitment, params=PARAMS, canonical_root=ROOT, expected_prompt_ids=[1, 2, 3])
    assert (verdict.kind, verdict.reason) == (kind, reason)


def test_a_well_formed_commitment_passes_the_shape_checks():
    assert (
        proof.check_shape(honest_commitment(40)[0], params=PARAMS, canonical_root=ROOT, expected_prompt_ids=[1, 2, 3])
        is None
    )


def test_output_ids_other_than_those_relayed_are_a_cheat():
    commitment = honest_commitment(40)[0]
    swapped = list(commitment.output_token_ids)
    swapped[7] += 1
    verdict = proof.check_shape(
        commitment,
        params=PARAMS,
        canonical_root=ROOT,
        expected_prompt_ids=[1, 2, 3],
        delivery=proof.Delivery(relayed_output_ids=tuple(swapped), ended_at_stop=False, max_tokens=64),
    )
    assert (verdict.kind, verdict.reason) == ("cheat", "output-mismatch")


END = 2
token_lists = st.lists(st.integers(3, 50), min_size=1, max_size=40)


@given(output=token_lists, cut=st.integers(0, 40), stopped=st.booleans(), max_tokens=st.integers(1, 60))
def test_a_relay_must_be_the_proved_output_or_its_prefix_up_to_a_stop_string(output, cut, stopped, max_tokens):
    relayed = tuple(output[:cut])
    delivery = proof.Delivery(relayed_output_ids=relayed, ended_at_stop=stopped, max_tokens=max_tokens)
    mistake = proof.check_delivery(output, delivery, frozenset({END}))
    if relayed != tuple(output) and not stopped:
        assert mistake == "output-mismatch"
    elif len(output) > max_tokens:
        assert mistake == "past-max-tokens"
    else:
        assert mistake is None


@given(output=token_lists, extra=token_lists, position=st.integers(0, 39))
def test_output_that_goes_on_past_the_end_token_is_a_cheat(output, extra, position):
    padded = output[:position] + [END] + extra
    delivery = proof.Delivery(relayed_output_ids=tuple(padded), ended_at_stop=False, max_tokens=1000)
    assert proof.check_delivery(padded, delivery, frozenset({END})) == "past-eos"
    ended = output + [END]
    assert (
        proof.check_delivery(ended, dataclasses.replace(delivery, relayed_output_ids=tuple(ended)), frozenset({END}))
        is None
    )


def test_a_relay_that_is_not_a_prefix_is_a_cheat_even_at_a_stop():
    delivery = proof.Delivery(relayed_output_ids=(5, 6, 8), ended_at_stop=True, max_tokens=10)
    assert proof.check_delivery([5, 6, 7, 8], delivery, frozenset()) == "output-mismatch"
    assert proof.check_delivery([5, 6, 8, 9], delivery, frozenset()) is None


def test_an_unknown_canonical_root_is_unproven_not_a_cheat():
    verdict = proof.check_shape(honest_commitment(8)[0], params=PARAMS, canonical_root=None, expected_prompt_ids=None)
    assert (verdict.kind, verdict.reason) == ("unproven", "model-root")


def test_a_failing_recompute_is_unproven():
    commitment = honest_commitment(8)[0]

    def broken(_ids, *, start):
        raise RuntimeError("out of memory")

    verdict = proof.verify_commitment(
        commitment,
        model=SMOLLM2_135M,
        canonical_root=ROOT,
        expected_prompt_ids=[1, 2, 3],
        recompute=broken,
        greedy=True,
    )
    assert (verdict.kind, verdict.reason) == ("unproven", "recompute-failed")


chunk = st.builds(proof.ChunkResult, st.integers(0, 128), st.floats(0, 30), st.floats(0, 30))


@given(st.lists(chunk, min_size=1, max_size=40))
def test_judge_passes_exactly_when_the_pass_ratio_is_met(chunks):
    verdict = proof.judge(chunks, None, PARAMS)
    ratio = sum(c.passes(PARAMS) for c in chunks) / len(chunks)
    assert (verdict.kind == "pass") == (ratio >= PARAMS.min_pass_ratio)
    assert verdict.kind in ("pass", "cheat")
    assert verdict.chunks_total == len(chunks)


def test_judge_of_no_chunks_is_unproven():
    assert proof.judge([], None, PARAMS).kind == "unproven"


def test_a_failing_token_check_turns_passing_chunks_into_a_cheat():
    chunks = [proof.ChunkResult(0, 0.0, 0.0)]
    bad = token_evidence.TokenCheck(False, "greedy-gap", 5, 3.0, -1.0, 7)
    verdict = proof.judge(chunks, bad, PARAMS)
    assert (verdict.kind, verdict.reason) == ("cheat", "tokens")


def stats_from(gaps: list[float], ranks: list[int], logprobs: list[float] | None = None) -> logit_stats.TokenStats:
    n = len(gaps)
    return logit_stats.TokenStats(
        tokens=tuple(range(n)),
        argmax=tuple(range(n)),
        gap=tuple(gaps),
        rank=tuple(ranks),
        logprob=tuple(logprobs or [-0.5] * n),
    )


TOKEN_PARAMS = TokenCheckParams()


@given(st.lists(st.floats(0, 5), min_size=1, max_size=200))
def test_greedy_check_fails_whenever_a_gap_exceeds_the_margin(gaps):
    ranks = [0 if gap == 0 else 1 for gap in gaps]
    check = token_evidence.token_check(stats_from(gaps, ranks), greedy=True, params=TOKEN_PARAMS)
    if max(gaps) > TOKEN_PARAMS.greedy_logit_margin:
        assert not check.ok and check.reason == "greedy-gap"


def test_near_ties_inside_the_drift_band_are_noise_however_many():
    # The public miner's 35-token answer, bf16 served and fp32 recomputed: 4 near-ties, the
    # largest 0.163 logits. A count rule (at most max(2, 10 %)) judged it a cheat.
    gaps = [0.163, 0.05, 0.12, 0.02] + [0.0] * 31
    check = token_evidence.token_check(
        stats_from(gaps, [1 if g else 0 for g in gaps]), greedy=True, params=TOKEN_PARAMS
    )
    assert check.ok and check.evidence < 0
    crowded = [TOKEN_PARAMS.greedy_drift_band] * 30 + [0.0] * 70
    assert token_evidence.token_check(stats_from(crowded, [1] * 30 + [0] * 70), greedy=True, params=TOKEN_PARAMS).ok


def test_misses_beyond_the_band_accumulate_into_a_verdict():
    beyond = TOKEN_PARAMS.greedy_drift_band + 0.1
    one = stats_from([beyond] + [0.0] * 99, [1] + [0] * 99)
    assert token_evidence.token_check(one, greedy=True, params=TOKEN_PARAMS).ok, (
        "one token beyond the band is honest often enough"
    )
    many = stats_from([beyond] * 30 + [0.0] * 70, [1] * 30 + [0] * 70)
    check = token_evidence.token_check(many, greedy=True, params=TOKEN_PARAMS)
    assert (check.ok, check.reason) == (False, "greedy-misses")
    assert check.evidence >= math.log(1 / TOKEN_PARAMS.miss_false_positive_rate)


def test_seeded_replay_weighs_its_misses_by_the_same_rule():
    def replayed(gaps):
        n = len(gaps)
        return dataclasses.replace(stats_from([0.0] * n, [0] * n), replay_gap=tuple(gaps))

    assert token_evidence.token_check(replayed([0.2] * 10 + [0.0] * 54), greedy=False, params=TOKEN_PARAMS).ok
    check = token_evidence.token_check(replayed([0.6] * 12 + [0.0] * 52), greedy=False, params=TOKEN_PARAMS)
    assert (check.ok, check.reason) == (False, "seeded-misses")
    assert (
        token_evidence.token_check(
            replayed([TOKEN_PARAMS.seeded_margin + 0.1] + [0.0] * 63), greedy=False, params=TOKEN_PARAMS
        ).reason
        == "seeded-gap"
    )


@given(st.lists(st.floats(0, 1), max_size=300), st.floats(0.01, 0.9), st.floats(1e-4, 0.2))
def test_miss_evidence_grows_with_every_miss_beyond_the_band_and_never_with_one_inside(gaps, band, rate):
    base = token_evidence.miss_evidence(gaps, band=band, rate=rate)
    assert token_evidence.miss_evidence([*gaps, band / 2], band=band, rate=rate) <= base + 1e-9
    assert token_evidence.miss_evidence([*gaps, band + 0.01], band=band, rate=rate) > base
    assert token_evidence.miss_evidence([g for g in gaps if g <= band], band=band, rate=rate) <= 0.0


def test_miss_evidence_is_an_e_value_under_honest_drift():
    # Every token beyond the band with the bounded chance, independently: the e-value's mean
    # stays at most 1, and it reaches 1/α (here α = 1/20) on at most α of the answers.
    rng = random.Random(20261204)
    rate, band = 2e-3, 0.3
    values = []
    for _ in range(4000):
        n = rng.choice((8, 35, 64, 256))
        values.append(
            token_evidence.miss_evidence(
                [band + 0.1 if rng.random() < rate else 0.0 for _ in range(n)], band=band, rate=rate
            )
        )
    assert sum(math.exp(v) for v in values) / len(values) <= 1.1
    assert sum(1 for v in values if v >= math.log(20)) / len(values) <= 1 / 20


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> list[int]:
    """Tokens an honest sampler draws from each row: temperature, then the top_p nucleus."""
    probs = torch.softmax(logits.double() / temperature, dim=1)
    ordered, order = probs.sort(dim=1, descending=True)
    keep = (ordered.cumsum(dim=1) - ordered) < top_p
    nucleus = torch.zeros_like(probs).scatter(1, order, ordered * keep)
    return torch.multinomial(nucleus, 1, generator=generator)[:, 0].tolist()


def sampled_check(logits, tokens, temperature, top_p=1.0) -> token_evidence.TokenCheck:
    stats = logit_stats.token_stats(
        logits,
        tokens,
        sampling=logit_stats.SamplingTerms(temperature, top_p),
        nucleus_margin=TOKEN_PARAMS.nucleus_margin,
    )
    return token_evidence.token_check(stats, greedy=False, params=TOKEN_PARAMS)


def peaked_logits(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Rows like a language model's: a few likely tokens, a long tail of unlikely ones."""
    return torch.randn(n, vocab, generator=generator, dtype=torch.float64) * 3


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.0, 1.0), (1.0, 0.9), (0.7, 0.9)])
def test_honest_sampling_is_never_judged_a_cheat(temperature, top_p):
    generator = torch.Generator().manual_seed(7)
    worst = -math.inf
    for _ in range(1000):
        logits = peaked_logits(64, 200, generator)
        check = sampled_check(logits, sample_rows(logits, temperature, top_p, generator), temperature, top_p)
        assert check.ok, check
        worst = max(worst, check.evidence)
    assert worst < math.log(1 / TOKEN_PARAMS.sampled_false_positive_rate) / 2, "honest evidence stays far below the bar"


@pytest.mark.parametrize(("tokens", "noise", "at_least"), [(64, 4.0, 1.0), (256, 2.0, 0.75)])
def test_tokens_drawn_from_another_distribution_are_judged_improbable(tokens, noise, at_least):
    # Power grows with the answer's length and with how far the other model is off: a blatantly
    # different model is caught in 64 tokens, a moderately different one in a few hundred. (The
    # subtle cheats — a 4-bit copy — are for TOPLOC's chunk check and seeded replay, not this.)
    generator = torch.Generator().manual_seed(11)
    caught = 0
    for _ in range(40):
        canonical = peaked_logits(tokens, 200, generator)
        other = canonical + torch.randn(tokens, 200, generator=generator, dtype=torch.float64) * noise
        check = sampled_check(canonical, sample_rows(other, 1.0, 1.0, generator), 1.0)
        caught += check.reason == "sampled-improbable"
    assert caught >= at_least * 40


def test_a_greedy_answer_to_a_sampled_request_is_not_a_cheat():
    generator = torch.Generator().manual_seed(3)
    logits = peaked_logits(64, 200, generator)
    check = sampled_check(logits, logits.argmax(dim=1).tolist(), 1.0)
    assert check.ok and check.evidence < 0


def test_a_token_outside_the_nucleus_is_a_cheat_and_one_at_its_edge_is_not():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    assert sampled_check(logits, [1], 1.0, top_p=0.6).ok, "0.5 precedes it, under top_p"
    assert sampled_check(logits, [2], 1.0, top_p=0.81).ok, "0.8 precedes it: inside by the margin"
    check = sampled_check(logits, [3], 1.0, top_p=0.6)
    assert (check.ok, check.reason) == (False, "sampled-outside-nucleus")


def test_token_stats_reads_argmax_gap_rank_and_logprob_from_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0]])
    stats = logit_stats.token_stats(logits, [1, 0])
    assert stats.argmax == (1, 2)
    assert stats.rank == (0, 1)
    assert stats.gap == pytest.approx((0.0, 3.0))
    assert stats.logprob[0] == pytest.approx(float(torch.log_softmax(logits[0], 0)[1]))


@pytest.mark.parametrize("temperature", [1.0, 0.3, 0.1, 0.03])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_seeded_replay_forgives_numeric_drift_at_any_temperature(temperature, top_p):
    # Serving and recompute disagree by ~0.1 logits: in the draw's log-weights (logits / T) that
    # grows as T falls, so the replay judges gaps in logits, as the greedy check does.
    from engy_node.serve.sampling import parse_sampling_params, seeded_choice

    generator = torch.Generator().manual_seed(5)
    params = parse_sampling_params(
        {"temperature": temperature, "top_p": top_p, "top_k": SEEDED_TOP_K, "sampling_seed": 42}
    )
    for trial in range(10):
        recompute = torch.randn(64, 200, generator=generator) * 3
        served = recompute + torch.randn(64, 200, generator=generator) * 0.1
        tokens = [seeded_choice(served[i], params, 100 + i) for i in range(64)]
        stats = logit_stats.token_stats(
            recompute,
            tokens,
            sampling=logit_stats.SamplingTerms(temperature, top_p, seed=42),
            first_position=100,
            edge_band=TOKEN_PARAMS.nucleus_edge_band,
            nucleus_margin=TOKEN_PARAMS.nucleus_margin,
        )
        check = token_evidence.token_check(stats, greedy=False, params=TOKEN_PARAMS)
        assert check.ok, (trial, check)


def replayed_gaps(recompute: torch.Tensor, tokens, terms: logit_stats.SamplingTerms, first_position: int = 100):
    return logit_stats.token_stats(
        recompute,
        tokens,
        sampling=terms,
        first_position=first_position,
        edge_band=TOKEN_PARAMS.nucleus_edge_band,
        nucleus_margin=TOKEN_PARAMS.nucleus_margin,
    ).replay_gap


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    drift=st.floats(0.0, 0.5),
    temperature=st.sampled_from([1.0, 0.7, 0.3, 0.05]),
    row_seed=st.integers(0, 2**31),
)
def test_an_honest_draw_trails_the_replay_by_at_most_twice_the_numeric_drift(seed, drift, temperature, row_seed):
    # The rule's premise, exactly: when every logit of the miner's differs from the verifier's by
    # at most ε, the sorted values differ by at most ε too, whichever token holds which rank, so
    # the served token's gap is at most 2ε, at any temperature.
    from engy_node.serve.sampling import parse_sampling_params, seeded_choice

    generator = torch.Generator().manual_seed(row_seed)
    recompute = torch.randn(12, 120, generator=generator) * 3
    served = recompute + (torch.rand(12, 120, generator=generator) * 2 - 1) * drift
    params = parse_sampling_params({"temperature": temperature, "top_k": SEEDED_TOP_K, "sampling_seed": seed})
    tokens = [seeded_choice(served[i], params, 100 + i) for i in range(12)]
    assert max(replayed_gaps(recompute, tokens, logit_stats.SamplingTerms(temperature, seed=seed))) <= 2 * drift + 1e-4


def answers_served_as(cheat: dict, *, trials: int = 20, rows: int = 64):
    """(recompute logits, seed, tokens) per trial: tokens drawn by `cheat`'s sampling knobs from
    the verifier's own logits (a miner computing exactly as the verifier does, so every gap is
    the cheat's), where the request asked for T 1, no top_p, no top-k, and a seed."""
    from engy_node.serve.sampling import parse_sampling_params, seeded_choice

    generator = torch.Generator().manual_seed(17)
    for trial in range(trials):
        logits = peaked_logits(rows, 200, generator).float()
        seed = 1000 + trial
        if cheat.get("temperature") == 0:
            yield logits, seed, logits.argmax(dim=1).tolist()
        elif "unseeded" in cheat:
            yield logits, seed, sample_rows(logits.double(), 1.0, 1.0, generator)
        else:
            params = parse_sampling_params({"temperature": 1.0, "top_k": SEEDED_TOP_K, "sampling_seed": seed, **cheat})
            yield logits, seed, [seeded_choice(logits[i], params, 100 + i) for i in range(rows)]


@pytest.mark.parametrize(
    ("cheat", "caught_at_least"),
    [
        ({}, 0),
        ({"temperature": 0}, 20),
        ({"top_p": 0.5}, 20),
        ({"top_k": 5}, 20),
        ({"temperature": 0.3}, 20),
        ({"temperature": 0.5}, 20),
        ({"unseeded": True}, 20),
    ],
)
def test_seeded_replay_catches_sampling_other_than_what_was_asked(cheat, caught_at_least):
    # The cheats of the adversarial audit that found replay weaker than greedy: cached greedy
    # answers, a narrower nucleus or top-k, a lower temperature (each drawn with the request's own
    # seed, the hardest case), and tokens from the miner's own randomness. The honest draw ({})
    # must never be caught.
    caught = 0
    for logits, seed, tokens in answers_served_as(cheat):
        terms = logit_stats.SamplingTerms(1.0, seed=seed)
        stats = logit_stats.token_stats(
            logits,
            tokens,
            sampling=terms,
            first_position=100,
            nucleus_margin=TOKEN_PARAMS.nucleus_margin,
            edge_band=TOKEN_PARAMS.nucleus_edge_band,
        )
        caught += not token_evidence.token_check(stats, greedy=False, params=TOKEN_PARAMS).ok
    assert caught >= caught_at_least if caught_at_least else caught == 0


def test_a_rank_any_token_could_hold_is_the_rank_the_draw_is_judged_by():
    # Two tokens of equal probability swap ranks between numeric paths, and with them their noise:
    # the served token is credited whichever of the two ranks won, and nothing further away.
    from engy_node.serve.sampling import parse_sampling_params, seeded_draw

    logits = torch.tensor([2.0, 1.0, 1.0, -1.0, -3.0])
    params = parse_sampling_params({"temperature": 1.0, "top_k": SEEDED_TOP_K, "sampling_seed": 5})
    position = next(p for p in range(10_000) if int(torch.argmax(sum(seeded_draw(logits, params, p)[::2]))) == 1)
    terms = logit_stats.SamplingTerms(1.0, seed=5)
    assert replayed_gaps(logits[None, :], [1], terms, position) == (0.0,)
    assert replayed_gaps(logits[None, :], [2], terms, position) == (0.0,), "its twin could have held rank 1"
    assert replayed_gaps(logits[None, :], [3], terms, position)[0] > TOKEN_PARAMS.seeded_margin, (
        "2 logits below the winner's"
    )


@pytest.mark.parametrize(
    "sampling", [None, logit_stats.SamplingTerms(0.8, 0.9), logit_stats.SamplingTerms(1.0, 1.0, seed=7)]
)
def test_token_stats_in_blocks_equal_token_stats_at_once(monkeypatch, sampling):
    # Long answers are judged a block of rows at a time; the seeded draw's positions must carry
    # across block edges.
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(23, 50, generator=generator) * 3
    tokens = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=generator)[:, 0].tolist()
    options = dict(
        sampling=sampling,
        first_position=40,
        edge_band=TOKEN_PARAMS.nucleus_edge_band,
        nucleus_margin=TOKEN_PARAMS.nucleus_margin,
    )
    whole = logit_stats.token_stats(logits, tokens, **options)
    monkeypatch.setattr(logit_stats, "TOKEN_STATS_BLOCK_ELEMENTS", 5 * 50)
    monkeypatch.setattr(logit_stats, "REPLAY_BLOCK_ELEMENTS", 2 * 50)
    assert logit_stats.token_stats(logits, tokens, **options) == whole


@pytest.mark.parametrize("top_p", [0.9, 0.5, 0.995])
def test_a_nucleus_is_the_same_however_many_candidates_are_sorted_first(monkeypatch, top_p):
    # Only the likeliest tokens are sorted to cut a nucleus; rows whose nucleus reaches past
    # them are cut again from more, up to the whole vocabulary (a top_p near 1 always gets there).
    generator = torch.Generator().manual_seed(13)
    logits = torch.randn(40, 300, generator=generator) * torch.linspace(0.3, 4, 40)[:, None]
    tokens = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=generator)[:, 0].tolist()
    options = dict(sampling=logit_stats.SamplingTerms(1.0, top_p), nucleus_margin=TOKEN_PARAMS.nucleus_margin)
    whole = logit_stats.token_stats(logits, tokens, **options)
    monkeypatch.setattr(logit_stats, "NUCLEUS_CANDIDATES", 2)
    assert logit_stats.token_stats(logits, tokens, **options) == whole
    assert all(whole.in_nucleus) == (top_p + TOKEN_PARAMS.nucleus_margin >= 1), "below 1 the cut leaves some out"


def test_seeded_replay_forgives_a_rival_the_miner_had_just_outside_its_nucleus():
    # Found in the 1,000-request calibration: at top_p 0.9 the third token's preceding mass sat at
    # 0.8979 in the recompute and just over 0.9 when the miner drew, so the miner never had it;
    # its large seeded noise must not make the served token look like a loser.
    from engy_node.serve.sampling import parse_sampling_params, seeded_choice, seeded_draw

    served_logits = torch.tensor([0.7803, 0.12, 0.05] + [0.0497 / 47] * 47).log()  # mass before rank 2: 0.9003
    recompute = served_logits.clone()
    recompute[1] -= 0.05  # now 0.8997: rank 2 is inside the recompute's nucleus
    params = parse_sampling_params({"temperature": 1.0, "top_p": 0.9, "top_k": SEEDED_TOP_K, "sampling_seed": 3})
    position = next(
        p
        for p in range(10_000)
        if int(torch.argmax(seeded_draw(recompute, params, p)[0] + seeded_draw(recompute, params, p)[2])) == 2
    )
    served = seeded_choice(served_logits, params, position)
    assert served in (0, 1), "the miner's nucleus held ranks 0 and 1 only"
    stats = logit_stats.token_stats(
        recompute[None, :],
        [served],
        sampling=logit_stats.SamplingTerms(1.0, 0.9, seed=3),
        first_position=position,
        edge_band=TOKEN_PARAMS.nucleus_edge_band,
        nucleus_margin=TOKEN_PARAMS.nucleus_margin,
    )
    assert stats.replay_gap == (0.0,)


def test_a_dominant_tokens_drift_moving_the_nucleus_edge_is_forgiven_both_ways():
    # Found by the seeded drift measurement (T 0.7 top_p 0.9, recomputed in bf16): the top
    # token's logit 0.25 apart moved the second's preceding mass from 0.897 (inside the 0.9
    # nucleus when the miner drew) to 0.921, past a fixed 0.02 margin; the edge moves by up to
    # S (1 - S) band / T, 0.039 here.
    from engy_node.serve.sampling import parse_sampling_params, seeded_choice

    served = torch.tensor([16.125, 14.25, 13.3125, 12.875, 12.375] + [9.5] * 200)  # the second at 0.8956
    recompute = served.clone()
    recompute[0] = 16.375
    params = parse_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": SEEDED_TOP_K, "sampling_seed": 66})
    position = next(p for p in range(10_000) if seeded_choice(served, params, p) == 1)
    terms = logit_stats.SamplingTerms(0.7, 0.9, seed=66)
    stats = logit_stats.token_stats(
        recompute[None, :],
        [1],
        sampling=terms,
        first_position=position,
        nucleus_margin=TOKEN_PARAMS.nucleus_margin,
        edge_band=TOKEN_PARAMS.nucleus_edge_band,
    )
    assert stats.replay_gap[0] <= TOKEN_PARAMS.seeded_drift_band
    assert stats.in_nucleus == (True,), "and the statistical check takes it as inside the nucleus"


def tied_edge_logits(head, rest_mass, rest_count=45):
    return torch.tensor(list(head) + [rest_mass / rest_count] * rest_count, dtype=torch.float64).log().float()


def test_a_token_tied_with_the_nucleus_edge_is_inside_it_for_the_statistical_check():
    # Found in the 1,000-request calibration: the served token had an exact bf16 twin at the edge
    # of the 0.9 nucleus; the recompute counted the twin's mass before it, the miner after.
    twin_first = tied_edge_logits([0.6, 0.22, 0.078, 0.0314, 0.03139], 1 - 0.96079)
    terms = logit_stats.SamplingTerms(1.0, 0.9)
    options = dict(sampling=terms, nucleus_margin=TOKEN_PARAMS.nucleus_margin, edge_band=TOKEN_PARAMS.nucleus_edge_band)
    assert logit_stats.token_stats(twin_first[None, :], [4], **options).in_nucleus == (True,)
    far_outside = logit_stats.token_stats(twin_first[None, :], [10], **options)
    assert far_outside.in_nucleus == (False,)
    assert (
        token_evidence.token_check(far_outside, greedy=False, params=TOKEN_PARAMS).reason == "sampled-outside-nucleus"
    )


def test_seeded_replay_credits_a_token_tied_with_the_widened_nucleus_edge():
    # The same found case under replay: the miner had the served token (B) ahead of its twin (A)
    # and inside the nucleus; the recompute puts A first, just past top_p, and B behind it.
    from engy_node.serve.sampling import parse_sampling_params, seeded_choice

    served_logits = tied_edge_logits([0.6, 0.22, 0.07, 0.0314, 0.0316], 1 - 0.953)  # B (id 4) at 0.89
    recompute = tied_edge_logits([0.6, 0.22, 0.0805, 0.0314, 0.0313], 1 - 0.9632)  # A at 0.9005, B at 0.9319
    params = parse_sampling_params({"temperature": 1.0, "top_p": 0.9, "top_k": SEEDED_TOP_K, "sampling_seed": 11})
    position = next(p for p in range(20_000) if seeded_choice(served_logits, params, p) == 4)
    stats = logit_stats.token_stats(
        recompute[None, :],
        [4],
        sampling=logit_stats.SamplingTerms(1.0, 0.9, seed=11),
        first_position=position,
        edge_band=TOKEN_PARAMS.nucleus_edge_band,
        nucleus_margin=TOKEN_PARAMS.nucleus_margin,
    )
    assert stats.replay_gap[0] <= TOKEN_PARAMS.seeded_margin / 2


def test_a_statistical_check_at_a_low_temperature_forgives_a_near_tie_flip():
    logits = torch.tensor([[5.0, 4.8, 0.0, -1.0]] * 8, dtype=torch.float64)
    tokens = [0] * 7 + [1]  # one flip between tokens 0.2 logits apart, as numerics may cause
    stats = logit_stats.token_stats(
        logits, tokens, sampling=logit_stats.SamplingTerms(0.01), nucleus_margin=TOKEN_PARAMS.nucleus_margin
    )
    assert token_evidence.token_check(stats, greedy=False, params=TOKEN_PARAMS).ok


def test_output_ids_outside_the_vocabulary_are_refused_or_judged():
    commitment, rows = honest_commitment(8)
    wire = commitment.to_wire()
    wire["output_token_ids"] = [2**40] * 8
    with pytest.raises(proof.ProofFormatError):
        proof.Commitment.from_wire(wire)
    outside = dataclasses.replace(commitment, output_token_ids=tuple(range(8))[:-1] + (10_000,))

    def hundred_token_vocabulary(ids, *, start):
        return torch.zeros(len(ids) - start, rows.shape[1]), torch.zeros(len(ids) - start, 100)

    verdict = proof.verify_commitment(
        outside,
        model=SMOLLM2_135M,
        canonical_root=ROOT,
        expected_prompt_ids=[1, 2, 3],
        recompute=hundred_token_vocabulary,
        greedy=True,
    )
    assert (verdict.kind, verdict.reason) == ("cheat", "output-outside-vocabulary")
