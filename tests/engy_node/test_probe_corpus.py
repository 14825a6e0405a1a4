"""gateway.probe_corpus: the shipped corpus loads, is large and varied, and bad files are refused
with the line number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engy_node.gateway.trust.traffic_probes import probe_plan
from engy_node.probe_corpus import ProbePrompt, load_probe_corpus

ROLES = {"system", "user", "assistant"}


@pytest.fixture(scope="module")
def corpus() -> tuple[ProbePrompt, ...]:
    return load_probe_corpus()


def _first_user(prompt: ProbePrompt) -> str:
    return next(m["content"] for m in prompt.messages if m["role"] == "user")


def test_the_shipped_corpus_loads_and_is_large(corpus):
    assert len(corpus) >= 300
    assert all(isinstance(p, ProbePrompt) for p in corpus)


def test_the_default_load_is_cached(corpus):
    assert load_probe_corpus() is corpus


def test_every_shipped_entry_is_valid(corpus):
    for prompt in corpus:
        assert isinstance(prompt.messages, tuple) and prompt.messages
        for index, message in enumerate(prompt.messages):
            assert set(message) == {"role", "content"}
            assert message["role"] in ROLES
            assert isinstance(message["content"], str) and message["content"].strip()
            assert message["role"] != "system" or index == 0
        assert prompt.messages[-1]["role"] == "user"


def test_entries_are_distinct(corpus):
    firsts = [_first_user(p) for p in corpus]
    assert len(set(firsts)) == len(firsts)


def test_lengths_are_spread(corpus):
    chars = [p.chars for p in corpus]
    assert sum(c < 100 for c in chars) >= 30
    assert sum(c > 800 for c in chars) >= 10
    assert max(chars) <= 4000


def test_system_prompts_and_multi_turn_have_realistic_shares(corpus):
    n = len(corpus)
    with_system = sum(p.messages[0]["role"] == "system" for p in corpus)
    multi_turn = sum(sum(m["role"] != "system" for m in p.messages) > 1 for p in corpus)
    assert 0.15 * n <= with_system <= 0.35 * n
    assert 0.08 * n <= multi_turn <= 0.25 * n
    # Prior turns alternate user/assistant, as a chat client sends them.
    for prompt in corpus:
        turns = [m["role"] for m in prompt.messages if m["role"] != "system"]
        assert turns == ["user", "assistant"] * (len(turns) // 2) + ["user"]


def test_some_entries_are_not_english(corpus):
    # A crude signal: characters outside ASCII letters common in other languages.
    non_english = [p for p in corpus if any(ch in _first_user(p) for ch in "¿ñçãéèüßäöàò。？")]
    assert len(non_english) >= 5


def test_chars_is_total_content_length():
    prompt = ProbePrompt(messages=({"role": "system", "content": "abc"}, {"role": "user", "content": "de"}))
    assert prompt.chars == 5


def test_a_probe_plan_indexes_the_corpus(corpus):
    plan = probe_plan(corpus=corpus, draws=[0.999, 0.0, 0.0, 0.0], max_output_tokens=1024)
    assert corpus[plan.prompt_index] is corpus[-1]


# --- bad files ------------------------------------------------------------------------------------


def _line(*messages: tuple[str, str]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]})


GOOD = _line(("user", "hello"))


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_good_custom_file_loads(tmp_path):
    path = _write(
        tmp_path, GOOD, "", _line(("system", "be brief"), ("user", "hi"), ("assistant", "hey"), ("user", "bye"))
    )
    loaded = load_probe_corpus(path)
    assert len(loaded) == 2
    assert loaded[1].messages[0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"messages": []}), "non-empty list"),
        (json.dumps({"prompt": "hi"}), "non-empty list"),
        (json.dumps({"messages": ["hi"]}), "must be an object"),
        (_line(("bot", "hi")), "role"),
        (_line(("user", "hi"), ("assistant", "hello")), "last message"),
        (_line(("user", "")), "non-empty string"),
        (_line(("user", "   ")), "non-empty string"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}), "non-empty string"),
        (_line(("user", "hi"), ("system", "be brief"), ("user", "hi again")), "system"),
    ],
    ids=[
        "not-json",
        "not-object",
        "empty-messages",
        "no-messages",
        "message-not-object",
        "wrong-role",
        "assistant-last",
        "empty-content",
        "blank-content",
        "content-not-str",
        "system-not-first",
    ],
)
def test_a_bad_line_is_refused_with_its_number(tmp_path, bad, message):
    path = _write(tmp_path, GOOD, GOOD, bad, GOOD)
    with pytest.raises(ValueError, match="line 3") as excinfo:
        load_probe_corpus(path)
    assert message in str(excinfo.value)


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no entries"):
        load_probe_corpus(_write(tmp_path, ""))
