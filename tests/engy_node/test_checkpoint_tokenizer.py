"""Tokenizer snapshots and the chat template renderer against transformers, on checkpoints made here.

Each checkpoint is the embedded SmolLM2's tokenizer with other settings: a tool-calling
template written to lean on what transformers' jinja environment provides (whitespace control
by `trim_blocks`/`lstrip_blocks`, `tojson` with its arguments, `namespace`, loop controls,
`raise_exception`, `strftime_now`, `dict`, `{% generation %}`, special-token variables,
reasoning aliases, None content), named templates from files and from the config, no template,
a tokenizer class that rebuilds the Rust tokenizer (so tokenizer.json alone would be wrong), and
a word-level tokenizer whose decoding cleans up spaces. For each, transformers loaded here is
the reference. Then the snapshot cache: taken in a child process, read back, retaken when
unreadable, used uncached where the cache cannot be written, keyed by what it depends on.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engy_node.checkpoint_tokenizer import (
    CheckpointTokenizer,
    compare,
    load_tokenizer,
    outcome,
    snapshot_key,
    take_snapshot,
)
from engy_node.errors import ModelError

TOOL_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- if messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}
    {%- if tools %}

Tools:
        {% for tool in tools %}
{{ tool | tojson }}
{{ tool.function.parameters | tojson(indent=2, sort_keys=true) }}
        {% endfor %}
    {%- endif %}
<|im_end|>
{% elif tools %}
<|im_start|>system
{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}
        {% continue %}
    {%- endif %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unexpected role: ' + message.role) }}
    {%- endif %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' and message.reasoning_content is defined and loop.index0 > ns.last_user %}
<think>
{{ message.reasoning_content | trim }}
</think>
    {% endif %}
    {%- if message.content is string %}
{{ message.content }}
    {%- elif message.content is defined %}
        {%- for part in message.content %}
            {%- if loop.index > 2 %}
                {% break %}
            {%- endif %}
{{ part.text if part.type == 'text' else '' }}
        {%- endfor %}
    {%- endif %}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
<tool_call>
{{ dict(name=call.function.name, arguments=call.function.arguments) | tojson }}
</tool_call>
        {%- endfor %}
    {%- endif %}
{% generation %}[{{ loop.index }}]{% endgeneration %}
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{{- mask_token ~ strftime_now('%%') ~ (dict.fromkeys(['k'], 1) | tojson) }}
"""

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find 東京 ✓ facts.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}

text = st.lists(
    st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "\n", "  x\t", "<|im_end|>", "東京 ✓", "e\u0301", "🙂"])),
    max_size=4,
).map("".join)
content = st.one_of(
    text,
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": text}), max_size=4),
)
call = st.builds(
    lambda name, arguments: {"type": "function", "function": {"name": name, "arguments": arguments}},
    st.sampled_from(["lookup", "other"]),
    st.dictionaries(st.sampled_from(["query", "limit"]), st.one_of(text, st.integers())),
)
message = st.builds(
    lambda role, body, reasoning, calls: {
        "role": role,
        "content": body,
        **reasoning,
        **({"tool_calls": calls} if calls else {}),
    },
    st.sampled_from(["system", "user", "assistant", "tool", "bogus"]),
    content,
    st.dictionaries(
        st.sampled_from(["reasoning_content", "thinking", "reasoning"]), st.one_of(st.none(), text), max_size=2
    ),
    st.lists(call, max_size=2),
)


def make_checkpoint(
    directory: Path, source: Path, *, config: dict | None = None, files: dict[str, str] | None = None
) -> Path:
    directory.mkdir(parents=True)
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(source / name, directory / name)
    base = json.loads((source / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    for name, body in (files or {}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(body)
    return directory


def both(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory)), CheckpointTokenizer(take_snapshot(directory))


@pytest.fixture(scope="module")
def tool_checkpoint(checkpoint, tmp_path_factory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("tools") / "checkpoint",
        checkpoint,
        config={"mask_token": "<mask>"},
        files={"chat_template.jinja": TOOL_TEMPLATE},
    )


@pytest.fixture(scope="module")
def tool_pair(tool_checkpoint):
    return both(tool_checkpoint)


def test_a_named_special_token_missing_from_the_vocabulary_is_added_as_transformers_adds_it(tool_pair):
    reference, ours = tool_pair
    assert ours.special_tokens_map == reference.special_tokens_map and ours.special_tokens_map["mask_token"] == "<mask>"
    assert ours.convert_tokens_to_ids("<mask>") == reference.convert_tokens_to_ids("<mask>") == 49152
    assert ours.encode("a<mask>b", add_special_tokens=False) == reference.encode("a<mask>b", add_special_tokens=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(message, min_size=1, max_size=5),
    tools=st.one_of(st.none(), st.lists(st.just(TOOL), max_size=2)),
    add_generation_prompt=st.booleans(),
    tokenize=st.booleans(),
)
def test_a_tool_calling_template_renders_and_tokenises_as_transformers(
    tool_pair, messages, tools, add_generation_prompt, tokenize
):
    reference, ours = tool_pair
    theirs = outcome(
        lambda: reference.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize
        )
    )
    assert (
        outcome(
            lambda: ours.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize
            )
        )
        == theirs
    )


def test_the_probe_conversations_agree_and_a_different_template_is_caught(tool_pair, tool_checkpoint):
    reference, ours = tool_pair
    assert compare(reference, ours) == []
    tampered = {
        **take_snapshot(tool_checkpoint),
        "chat_template": TOOL_TEMPLATE.replace("tojson(separators=(',', ':'))", "tojson"),
    }
    assert any("probe conversation 3" in difference for difference in compare(reference, CheckpointTokenizer(tampered)))


NAMED = {
    "chat_template.jinja": "default {{ messages[0].content }}{{ tools | length if tools is not none else '-' }}",
    "additional_chat_templates/tool_use.jinja": "tool_use {{ tools | tojson }}",
}


@pytest.mark.parametrize(
    "files, config",
    [
        (NAMED, {}),
        (
            {},
            {
                "chat_template": [
                    {"name": "default", "template": NAMED["chat_template.jinja"]},
                    {"name": "rag", "template": "rag {{ documents }}"},
                ]
            },
        ),
        ({}, {"chat_template": [{"name": "one", "template": "1"}, {"name": "two", "template": "2"}]}),
        ({}, {}),
    ],
    ids=["files with tool_use", "config list without tool_use", "no default", "no template"],
)
def test_the_template_chosen_is_transformers_choice(checkpoint, tmp_path, files, config):
    reference, ours = both(make_checkpoint(tmp_path / "checkpoint", checkpoint, config=config, files=files))
    for tools in (None, [], [TOOL]):
        theirs = outcome(
            lambda: reference.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
        )
        mine = outcome(
            lambda: ours.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
        )
        if theirs[0] == "error":  # transformers words its own refusals; both must refuse
            assert (mine[0], mine[1], theirs[1]) == ("error", "ChatTemplateError", "ValueError")
        else:
            assert mine == theirs


def test_a_class_that_rebuilds_the_tokenizer_is_snapshotted_as_rebuilt(checkpoint, tmp_path):
    """Qwen2Tokenizer builds its own normaliser and pre-tokenizer over tokenizer.json's vocabulary."""
    from tokenizers import Tokenizer

    directory = make_checkpoint(tmp_path / "checkpoint", checkpoint, config={"tokenizer_class": "Qwen2Tokenizer"})
    reference, ours = both(directory)
    assert type(reference).__name__ == "Qwen2Tokenizer"
    composed_by_nfc = "e\u0301 café 12345"
    assert ours.encode(composed_by_nfc, add_special_tokens=False) == reference.encode(
        composed_by_nfc, add_special_tokens=False
    )
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert raw.encode(composed_by_nfc, add_special_tokens=False).ids != reference.encode(
        composed_by_nfc, add_special_tokens=False
    )
    assert compare(reference, ours) == []


def test_a_word_level_tokenizer_decodes_with_transformers_clean_up(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[EOS]", "Hello", ",", "world", ".", "is", "n't", "it", "?", "I", "'m", "sure", "!"]
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "TokenizersBackend",
                "clean_up_tokenization_spaces": True,
                "unk_token": "[UNK]",
                "eos_token": "[EOS]",
                "chat_template": "{% for m in messages %}{{ m.content }} {{ eos_token }} {% endfor %}",
            }
        )
    )
    reference, ours = both(directory)
    ids = reference.encode("Hello , world . is n't it ? I 'm sure !", add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == "Hello, world. isn't it? I'm sure!"
    conversation = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "sure !"}]
    assert ours.apply_chat_template(conversation) == reference.apply_chat_template(conversation)["input_ids"]
    assert ours.eos_token_id == reference.eos_token_id == 1


def test_a_snapshot_is_taken_in_a_child_cached_read_back_and_retaken_when_unreadable(
    tool_checkpoint, tool_pair, tmp_path
):
    reference, _ = tool_pair
    cache = tmp_path / "cache"
    first = load_tokenizer(tool_checkpoint, cache_dir=cache)
    (path,) = cache.glob("*.json")
    assert path.name == f"{snapshot_key(tool_checkpoint)}.json"
    assert compare(reference, first) == []
    marked = {**json.loads(path.read_text()), "special_tokens": {**first.special_tokens_map, "bos_token": "<marked>"}}
    path.write_text(json.dumps(marked))
    assert load_tokenizer(tool_checkpoint, cache_dir=cache).special_tokens_map["bos_token"] == "<marked>", (
        "read from the cache"
    )
    path.write_text('{"format": 1, "backend": "trunc')
    retaken = load_tokenizer(tool_checkpoint, cache_dir=cache)
    assert retaken.special_tokens_map == reference.special_tokens_map
    assert json.loads(path.read_text())["special_tokens"] == reference.special_tokens_map


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(tool_checkpoint, tool_pair, tmp_path, caplog):
    reference, _ = tool_pair
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="engy.tokenizer"):
        tokenizer = load_tokenizer(tool_checkpoint, cache_dir=blocked / "cache")
    assert compare(reference, tokenizer) == []
    assert "could not cache the tokenizer snapshot" in caplog.text


def test_a_directory_without_a_tokenizer_is_refused_with_the_fix(tmp_path):
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    with pytest.raises(
        ModelError, match="could not read the tokenizer of .*point --checkpoint at a directory with tokenizer.json"
    ):
        load_tokenizer(directory, cache_dir=tmp_path / "cache")


def test_the_key_follows_tokenizer_files_and_not_weights(tool_checkpoint, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(tool_checkpoint, directory)
    key = snapshot_key(directory)
    assert key == snapshot_key(tool_checkpoint), "content, not the directory's path"
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    assert snapshot_key(directory) == key
    (directory / "chat_template.jinja").write_text(TOOL_TEMPLATE + "{{ eos_token }}")
    changed = snapshot_key(directory)
    assert changed != key
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    assert snapshot_key(directory) not in (key, changed)
