"""The engine without HTTP: what a generation produces, how it finishes, how the thread
schedules, aborts and survives a failing request."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engy_node.serve.engine import Engine, Generation, RequestError, run_to_completion
from engy_node.serve.sampling import (
    REPLACEMENT_CHARACTER,
    choose_token,
    find_stop,
    parse_sampling_params,
    seeded_choice,
)

from .numerics import assert_top_choices

PROMPT = [1, 504, 3575, 282, 4649, 314]


def generation(rid: str = "r", **sampling) -> Generation:
    params = {"temperature": 0, "max_new_tokens": 8, **sampling}
    return Generation(
        rid=rid,
        input_ids=list(PROMPT),
        params=parse_sampling_params(params),
        return_hidden_states=True,
        return_logprob=True,
    )


def test_proof_rows_are_the_recomputed_final_hidden_states_of_each_output_token(runner):
    done = run_to_completion(runner, generation(ignore_eos=True))
    rows = done.proof_rows()
    assert rows.shape == (8, runner.hidden_size)
    hidden, logits = runner.prefill(PROMPT + done.output_ids[:-1])
    assert torch.allclose(rows.float(), hidden[len(PROMPT) - 1 :].float(), atol=0.8)
    assert_top_choices(logits[len(PROMPT) - 1 :], done.output_ids)


def test_a_chunked_prefill_gives_the_same_tokens_as_a_single_pass(runner, monkeypatch):
    import engy_node.serve.engine as engine_module

    long_prompt = (PROMPT * 20)[:100]
    whole = run_to_completion(
        runner,
        Generation(
            rid="a", input_ids=long_prompt, params=parse_sampling_params({"temperature": 0, "max_new_tokens": 6})
        ),
    )
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK_TOKENS", 7)
    chunked = Generation(
        rid="b",
        input_ids=long_prompt,
        params=parse_sampling_params({"temperature": 0, "max_new_tokens": 6}),
        return_hidden_states=True,
    )
    run_to_completion(runner, chunked)
    assert chunked.output_ids == whole.output_ids
    assert chunked.hidden_block.shape[0] == len(long_prompt)


def test_a_prefill_from_a_start_position_returns_only_those_positions(runner):
    # The verifier's recompute reads only the positions that predict output tokens.
    ids = (PROMPT * 5)[:27]
    for chunk_tokens in (2048, 7):
        hidden, logits = runner.prefill(ids, chunk_tokens=chunk_tokens)
        for start in (0, 6, 7, 26):
            tail_hidden, tail_logits = runner.prefill(ids, chunk_tokens=chunk_tokens, start=start)
            assert torch.equal(tail_hidden, hidden[start:])
            assert tail_logits.shape == (len(ids) - start, runner.vocab_size) and tail_logits.dtype == torch.float32
            # One lm_head over fewer rows may round differently (a matmul's blocking follows its size).
            assert torch.allclose(tail_logits, logits[start:], rtol=1e-2, atol=0.05)
    with pytest.raises(RequestError):
        runner.prefill(ids, start=len(ids))


def test_each_token_is_chosen_at_sglangs_position_the_last_token_seen(runner, monkeypatch):
    import engy_node.serve.engine as engine_module

    calls = []

    def recording(logits, params, history, generator, *, position):
        calls.append((len(history), position))
        return choose_token(logits, params, history, generator, position=position)

    monkeypatch.setattr(engine_module, "choose_token", recording)
    done = run_to_completion(runner, generation(temperature=1.0, sampling_seed=7, ignore_eos=True, max_new_tokens=5))
    assert len(done.output_ids) == 5
    assert calls == [(k, len(PROMPT) + k - 1) for k in range(5)]


def test_a_seeded_generation_replays_from_its_seed_and_the_logits(runner):
    done = run_to_completion(
        runner, generation(temperature=1.0, top_p=0.9, sampling_seed=2024, ignore_eos=True, max_new_tokens=6)
    )
    cache = runner.new_cache()
    _, logits = runner.forward(PROMPT, cache)
    for k, token in enumerate(done.output_ids):
        assert seeded_choice(logits, done.params, len(PROMPT) + k - 1) == token
        _, logits = runner.forward([token], cache)


def test_max_new_tokens_ends_with_a_length_finish(runner):
    done = run_to_completion(runner, generation(max_new_tokens=3, ignore_eos=True))
    assert done.finish_reason == {"type": "length", "length": 3} and len(done.output_ids) == 3
    assert len(done.hidden_states_tensors()) == 3


def test_zero_new_tokens_finishes_after_the_prefill(runner):
    done = run_to_completion(runner, generation(max_new_tokens=0))
    assert done.finish_reason == {"type": "length", "length": 0} and done.output_ids == []


def test_a_stop_token_id_ends_the_generation_and_is_kept_in_output_ids(runner):
    probe = run_to_completion(runner, generation(ignore_eos=True))
    stop_at = probe.output_ids[2]
    done = run_to_completion(runner, generation(stop_token_ids=[stop_at], ignore_eos=True))
    assert done.finish_reason == {"type": "stop", "matched": stop_at}
    assert done.output_ids == probe.output_ids[: probe.output_ids.index(stop_at) + 1]


def test_min_new_tokens_suppresses_an_early_stop(runner):
    probe = run_to_completion(runner, generation(ignore_eos=True))
    done = run_to_completion(
        runner, generation(stop_token_ids=[probe.output_ids[0]], min_new_tokens=3, ignore_eos=True)
    )
    assert len(done.output_ids) > 1


class ScriptedRunner:
    """Predicts a fixed script of tokens and decodes with the real tokenizer: the engine's text
    handling (stop strings, what may be streamed) without the model's arithmetic."""

    device = "cpu"

    def __init__(self, runner, script: list[int]) -> None:
        self.script = script
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = runner.eos_token_ids
        self.decode_text = runner.decode_text
        self.forwards = 0

    def new_cache(self) -> None:
        return None

    def forward(self, token_ids, cache, capture=None):
        logits = torch.zeros(self.vocab_size)
        logits[self.script[self.forwards]] = 1.0
        self.forwards += 1
        return torch.zeros(len(token_ids), 1), logits


# Accented letters, CJK and emoji take two to four UTF-8 bytes, which the byte-level BPE splits
# across tokens; any other character can turn up too.
MULTI_BYTE_TEXT = st.text(
    st.one_of(st.sampled_from(" aèé中文😀🎉"), st.characters(codec="utf-8")), min_size=1, max_size=16
)


@given(data=st.data())
@settings(max_examples=100, deadline=None)
def test_streamed_text_never_shows_a_partial_character_and_only_grows_into_the_final_text(runner, data):
    ids = runner.tokenizer.encode(data.draw(MULTI_BYTE_TEXT, label="text"), add_special_tokens=False)
    assume(ids)
    # Dropping tokens leaves bytes that are invalid for good: those U+FFFD must come out.
    dropped = data.draw(st.sets(st.integers(0, len(ids) - 1), max_size=2), label="dropped")
    ids = [token for index, token in enumerate(ids) if index not in dropped]
    assume(ids)
    whole = runner.decode_text(ids)
    stops = []
    if whole:
        for start in data.draw(st.lists(st.integers(0, len(whole) - 1), max_size=2), label="stop starts"):
            stops.append(whole[start : start + data.draw(st.integers(1, 3))])
    sampling = {
        "temperature": 0,
        "max_new_tokens": len(ids),
        "ignore_eos": True,
        "stop": stops,
        "min_new_tokens": data.draw(st.integers(0, 3), label="min_new_tokens"),
    }
    if data.draw(st.booleans(), label="a stop token"):
        sampling["stop_token_ids"] = [data.draw(st.sampled_from(ids))]
    g = Generation(rid="utf8", input_ids=[1], params=parse_sampling_params(sampling))
    scripted = ScriptedRunner(runner, ids)

    shown: list[str] = []
    while not g.finished:
        g.step(scripted)
        if g.finished:
            break
        so_far = runner.decode_text(g.output_ids)
        assert len(g.visible_text) <= len(so_far.rstrip(REPLACEMENT_CHARACTER)), "a partial character was shown"
        if not stops:
            assert g.visible_text == so_far.rstrip(REPLACEMENT_CHARACTER), "nothing but the partial character is held"
        shown.append(g.visible_text)
    final = g.text
    shown.append(final)
    for earlier, later in zip(shown, shown[1:]):
        assert later.startswith(earlier)
    stopped_by_token = isinstance(g.finish_reason.get("matched"), int)
    decoded = runner.decode_text(g.output_ids[:-1] if stopped_by_token else g.output_ids)
    assert decoded.startswith(final)
    for text in shown:
        assert all(decoded[i] == REPLACEMENT_CHARACTER for i, char in enumerate(text) if char == REPLACEMENT_CHARACTER)
    if not stops and "stop_token_ids" not in sampling:
        assert final == whole, "once finished, the text is shown as decoded, invalid bytes and all"
    if sampling["min_new_tokens"] == 0:
        assert find_stop(final, stops) is None, "every stop string was caught as the token completed it"


def test_the_engine_rejects_a_request_longer_than_the_context(runner):
    engine = Engine(runner, max_running=1)
    engine.start()
    try:
        with pytest.raises(RequestError, match="maximum context length"):
            engine.submit(generation(max_new_tokens=runner.context_length))
    finally:
        engine.stop()


def _collect(engine: Engine, generations: list[Generation], timeout: float = 60.0) -> None:
    finished = threading.Event()
    remaining = {id(g) for g in generations}
    lock = threading.Lock()

    def on_update(g: Generation) -> None:
        if g.finished:
            with lock:
                remaining.discard(id(g))
                if not remaining:
                    finished.set()

    for g in generations:
        g.on_update = on_update
        engine.submit(g)
    assert finished.wait(timeout), "generations did not finish"


def test_concurrent_requests_interleave_and_match_solo_runs(runner):
    solo = [run_to_completion(runner, generation(rid=f"s{i}", max_new_tokens=5 + i, ignore_eos=True)) for i in range(3)]
    engine = Engine(runner, max_running=3)
    engine.start()
    try:
        batch = [generation(rid=f"c{i}", max_new_tokens=5 + i, ignore_eos=True) for i in range(3)]
        _collect(engine, batch)
        assert [g.output_ids for g in batch] == [g.output_ids for g in solo]
        # Each step is one request's own forward pass (no batched GEMM, no shared padding), so
        # concurrency changes no arithmetic: the verifier judges the numerics of a lone request.
        assert all(torch.equal(g.proof_rows(), s.proof_rows()) for g, s in zip(batch, solo))
        starts = sorted(g.first_token_perf for g in batch)
        ends = sorted(g.finished_perf for g in batch)
        assert starts[-1] < ends[0], "every request got its first token before any finished"
    finally:
        engine.stop()


def test_a_queued_request_aborted_before_it_runs_reports_the_waiting_queue(runner):
    engine = Engine(runner, max_running=1)
    engine.start()
    try:
        blocker = generation(rid="blocker", max_new_tokens=300, ignore_eos=True)
        queued = generation(rid="queued-1")
        blocker_running, blocker_finished = threading.Event(), threading.Event()

        def on_blocker_update(g: Generation) -> None:
            if g.output_ids:
                blocker_running.set()
            if g.finished:
                blocker_finished.set()

        blocker.on_update = on_blocker_update
        engine.submit(blocker)
        assert blocker_running.wait(30), "the blocker produced no token"
        done = threading.Event()
        queued.on_update = lambda g: done.set() if g.finished else None
        engine.submit(queued)
        assert engine.abort("queued") == 1
        assert done.wait(30)
        assert queued.finish_reason == {"type": "abort", "message": "Abort in waiting queue"}
        assert queued.output_ids == []
        engine.abort("blocker")
        assert blocker_finished.wait(30), "the aborted blocker did not finish"
        assert blocker.finish_reason["type"] == "abort"
    finally:
        engine.stop()


class ExplodingGeneration(Generation):
    def step(self, runner) -> None:
        raise RuntimeError("a bug inside one request's step")


def test_a_request_that_fails_in_the_engine_does_not_stop_the_others(runner):
    engine = Engine(runner, max_running=2)
    engine.start()
    try:
        bad = ExplodingGeneration(rid="bad", input_ids=list(PROMPT), params=parse_sampling_params({}))
        good = generation(rid="good", max_new_tokens=4, ignore_eos=True)
        _collect(engine, [bad, good])
        assert bad.finish_reason["type"] == "abort" and bad.finish_reason["status_code"] == 500
        assert good.finish_reason == {"type": "length", "length": 4}
        assert engine.alive
    finally:
        engine.stop()


def test_a_request_past_its_deadline_is_aborted(runner):
    engine = Engine(runner, max_running=1, request_timeout_s=0.5)
    engine.start()
    try:
        slow = generation(rid="slow", max_new_tokens=2000, ignore_eos=True)
        _collect(engine, [slow])
        assert slow.finish_reason["type"] == "abort" and slow.finish_reason["message"] == "Request timed out"
    finally:
        engine.stop()


def test_a_prompt_that_starts_like_a_finished_conversation_reuses_its_cache_and_answers_the_same(runner):
    # A second turn resends the first turn's prompt and answer: those tokens come from the cache.
    from engy_node.serve.engine import PREFIX_CACHE_MIN_TOKENS

    first_prompt = runner.tokenizer.encode("The history of the lighthouse on the rocky coast begins with a storm.")
    engine = Engine(runner, max_running=1, prefix_cache_tokens=4096)
    engine.start()
    try:
        first = Generation(
            rid="t1",
            input_ids=list(first_prompt),
            params=parse_sampling_params({"temperature": 0, "max_new_tokens": 12}),
        )
        _collect(engine, [first])
        assert first.cached_tokens == 0
        follow_up = first_prompt + first.output_ids + runner.tokenizer.encode(" And then?")
        second = Generation(
            rid="t2",
            input_ids=list(follow_up),
            params=parse_sampling_params({"temperature": 0, "max_new_tokens": 12}),
            return_hidden_states=True,
        )
        _collect(engine, [second])
        assert second.cached_tokens == len(first_prompt) + len(first.output_ids) - 1 >= PREFIX_CACHE_MIN_TOKENS
        cold = run_to_completion(
            runner,
            Generation(
                rid="cold",
                input_ids=list(follow_up),
                return_hidden_states=True,
                params=parse_sampling_params({"temperature": 0, "max_new_tokens": 12}),
            ),
        )
        assert second.output_ids == cold.output_ids, "the cached prefix answers as a cold prefill does"
        assert len(second.proof_rows()) == len(second.output_ids), "a proof row per output token all the same"
        assert engine.prefix_cache.hit_tokens == second.cached_tokens
    finally:
        engine.stop()


def test_without_a_shared_prefix_or_with_the_cache_off_every_prompt_is_prefilled_whole(runner):
    prompt = runner.tokenizer.encode(
        "A completely different question about gardening, the seasons of the year, and which vegetables "
        "grow best in a small garden on a windy hill."
    )
    for tokens in (4096, 0):
        engine = Engine(runner, max_running=1, prefix_cache_tokens=tokens)
        engine.start()
        try:
            once = Generation(
                rid="a", input_ids=list(prompt), params=parse_sampling_params({"temperature": 0, "max_new_tokens": 4})
            )
            _collect(engine, [once])
            other = Generation(
                rid="b",
                input_ids=runner.tokenizer.encode("Unrelated: what is the boiling point of water?"),
                params=parse_sampling_params({"temperature": 0, "max_new_tokens": 4}),
            )
            again = Generation(
                rid="c",
                input_ids=list(prompt) + [prompt[-1]],
                params=parse_sampling_params({"temperature": 0, "max_new_tokens": 4}),
            )
            _collect(engine, [other])
            _collect(engine, [again])
            assert other.cached_tokens == 0
            assert again.cached_tokens == (len(prompt) if tokens else 0)
        finally:
            engine.stop()
