"""The drift measurement's serving paths serve as the reference server does."""

from __future__ import annotations

from engy_node.calibration import chat_ids
from engy_node.drift import cached_follow_up, drift_conversations, gaps_of
from engy_node.models import SMOLLM2_135M


def test_the_prefix_cache_path_answers_the_next_turn_from_the_first_turns_kv_within_the_drift_band(runner):
    conversation = drift_conversations(1)[0]
    prompt_ids, follow_up = cached_follow_up(runner, conversation, 8)
    assert prompt_ids[: len(chat_ids(runner, conversation))] == chat_ids(runner, conversation)
    assert follow_up.cached_tokens > len(chat_ids(runner, conversation)), "the first answer's decode steps are reused"
    _, logits = runner.prefill(prompt_ids + follow_up.output_ids[:-1], start=len(prompt_ids) - 1)
    assert max(gaps_of(logits, follow_up.output_ids)) <= SMOLLM2_135M.token_check.greedy_drift_band
