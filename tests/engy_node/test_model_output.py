"""model_output: Qwen3 reasoning and Hermes or Qwen3-Coder tool calls out of raw text, whatever the chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engy_node.model_output import OutputEvent, OutputParser, ReasoningDelta, TextDelta, ToolCall, parse_output


def joined(events: list[OutputEvent]) -> list[OutputEvent]:
    """Adjacent text (or reasoning) deltas joined: the form in which chunkings must agree."""
    out: list[OutputEvent] = []
    for event in events:
        if out and not isinstance(event, ToolCall) and type(out[-1]) is type(event):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def parse_chunked(text: str, cuts: list[int], *, starts_in_reasoning: bool = False) -> list[OutputEvent]:
    parser = OutputParser(call_id_prefix="req", starts_in_reasoning=starts_in_reasoning)
    events: list[OutputEvent] = []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        events += parser.feed(text[start:end])
    return events + parser.finish()


def tool_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def test_a_qwen3_response_splits_into_reasoning_text_and_tool_calls():
    raw = (
        "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n"
        + tool_block("get_weather", {"city": "Paris"})
        + "\n"
        + tool_block("get_time", {"tz": "CET"})
    )
    assert joined(parse_output(raw, call_id_prefix="abc")) == [
        ReasoningDelta("The user wants the weather."),
        TextDelta("Let me check."),
        ToolCall(index=0, id="call_abc_0", name="get_weather", arguments='{"city": "Paris"}'),
        ToolCall(index=1, id="call_abc_1", name="get_time", arguments='{"tz": "CET"}'),
    ]


def test_output_that_starts_inside_reasoning_needs_no_opening_tag():
    raw = "Thinking it over.\n</think>\n\nThe answer is 4."
    assert joined(parse_output(raw, call_id_prefix="x", starts_in_reasoning=True)) == [
        ReasoningDelta("Thinking it over."),
        TextDelta("The answer is 4."),
    ]
    # A redundant opening tag, and the template's newline after it, are consumed too.
    assert joined(parse_output("<think>\nhm\n</think>\n\nok", call_id_prefix="x", starts_in_reasoning=True)) == [
        ReasoningDelta("hm"),
        TextDelta("ok"),
    ]


def test_reasoning_cut_off_before_it_closes_is_all_reasoning():
    assert joined(parse_output("<think>\nstill going", call_id_prefix="x")) == [ReasoningDelta("still going")]


def test_think_after_the_start_of_the_answer_is_plain_text():
    raw = "Qwen writes <think>…</think> before answering."
    assert joined(parse_output(raw, call_id_prefix="x")) == [TextDelta(raw)]


def test_a_tool_call_mentioned_inside_reasoning_stays_reasoning():
    raw = "<think>\nI could emit " + tool_block("f", {}) + " here.\n</think>\n\nDone."
    assert joined(parse_output(raw, call_id_prefix="x")) == [
        ReasoningDelta("I could emit " + tool_block("f", {}) + " here."),
        TextDelta("Done."),
    ]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {',
        "[1, 2]",
        '{"arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "", "arguments": {}}',
    ],
)
def test_a_tool_call_block_that_is_not_a_call_passes_through_verbatim_as_text(body):
    raw = f"Before\n<tool_call>\n{body}\n</tool_call>\nAfter"
    assert joined(parse_output(raw, call_id_prefix="x")) == [TextDelta(raw)]


def test_arguments_double_encoded_as_a_string_and_missing_arguments_are_accepted():
    events = parse_output(
        '<tool_call>\n{"name": "f", "arguments": "{\\"q\\": 1}"}\n</tool_call><tool_call>\n{"name": "g"}\n</tool_call>',
        call_id_prefix="x",
    )
    assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)] == [("f", '{"q": 1}'), ("g", "{}")]


def test_a_tool_call_still_open_at_the_end_is_a_call_if_its_json_is_complete():
    assert parse_output('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', call_id_prefix="x") == [
        ToolCall(index=0, id="call_x_0", name="f", arguments='{"a": 1}'),
    ]
    for truncated in ('Sure.\n<tool_call>\n{"name": "f", "argu', "Sure.\n<tool_call>"):
        assert joined(parse_output(truncated, call_id_prefix="x")) == [TextDelta(truncated)]


def test_only_a_tail_that_could_start_a_tag_is_held_back():
    parser = OutputParser(call_id_prefix="x")
    assert parser.feed("Hello world") == [TextDelta("Hello world")]
    assert parser.feed(", a <b> tag <tool") == [TextDelta(", a <b> tag ")]
    assert parser.feed("s are fun\n") == [TextDelta("<tools are fun")]
    assert parser.feed("ok") == [TextDelta("\nok")]
    assert parser.finish() == []
    reasoning = OutputParser(call_id_prefix="x", starts_in_reasoning=True)
    assert reasoning.feed("step one </th") == [ReasoningDelta("step one ")]
    assert reasoning.feed("ink>") == []
    assert reasoning.finish() == []


def test_a_spent_parser_refuses_more_input():
    parser = OutputParser(call_id_prefix="x")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("late")
    with pytest.raises(RuntimeError):
        parser.finish()


# ---- properties ---------------------------------------------------------------------------

# Pieces that collide with the tags and the newline conventions as often as possible.
tag_rich_text = st.lists(
    st.sampled_from(
        [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "\n",
            "\n\n",
            "<",
            "/",
            "think>",
            "_call>",
            "<tool",
            "</th",
            "a",
            " ",
            "é",
            '{"name": "f", "arguments": {"k": "v"}}',
            '{"name": ',
            "}",
        ]
    ),
    max_size=24,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), text=tag_rich_text, starts_in_reasoning=st.booleans())
def test_any_chunking_of_the_same_text_yields_the_same_events(data, text, starts_in_reasoning):
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=8))
    whole = joined(parse_chunked(text, [], starts_in_reasoning=starts_in_reasoning))
    assert joined(parse_chunked(text, cuts, starts_in_reasoning=starts_in_reasoning)) == whole
    one_char_at_a_time = list(range(1, len(text)))
    assert joined(parse_chunked(text, one_char_at_a_time, starts_in_reasoning=starts_in_reasoning)) == whole


@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=st.text().filter(lambda t: "<tool_call>" not in t and not t.startswith("<think>")))
def test_text_with_no_tags_passes_through_unchanged(data, text):
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=8))
    events = parse_chunked(text, cuts)
    assert all(isinstance(event, TextDelta) and event.text for event in events)
    assert "".join(event.text for event in events) == text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
plain = st.text(min_size=1, max_size=20).filter(lambda t: "<tool_call>" not in t and not t.startswith("\n"))
segments = st.tuples(
    st.none() | st.text(max_size=20).filter(lambda t: "</think>" not in t),
    st.lists(
        st.one_of(
            plain.map(lambda t: ("text", t)),
            st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=5), json_values, max_size=3))
            .filter(lambda call: "</tool_call>" not in json.dumps(call, ensure_ascii=False))
            .map(lambda call: ("call", call)),
        ),
        max_size=5,
    ),
)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), parts=segments)
def test_events_reconstruct_the_output_modulo_the_tags_and_their_newlines(data, parts):
    reasoning, pieces = parts
    body: list[tuple[str, object]] = []
    for kind, value in pieces:  # adjacent text pieces are one text, as the model would write it
        if kind == "text" and body and body[-1][0] == "text":
            body[-1] = ("text", body[-1][1] + value)
        else:
            body.append((kind, value))
    assume(all("<tool_call>" not in value for kind, value in body if kind == "text"))
    assume(reasoning is not None or not body or body[0][0] != "text" or not body[0][1].startswith("<think>"))
    # Render as Qwen3's template does: "<think>\nR\n</think>\n\n", one "\n" before each tool call.
    rendered = "" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n"
    expected: list[OutputEvent] = [ReasoningDelta(reasoning)] if reasoning else []
    calls = 0
    for i, (kind, value) in enumerate(body):
        if kind == "text":
            rendered += value
            expected.append(TextDelta(value))
        else:
            name, arguments = value
            rendered += ("\n" if i else "") + tool_block(name, arguments)
            expected.append(
                ToolCall(
                    index=calls, id=f"call_req_{calls}", name=name, arguments=json.dumps(arguments, ensure_ascii=False)
                )
            )
            calls += 1
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(rendered)), max_size=8))
    assert joined(parse_chunked(rendered, cuts)) == expected


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "scale": {"type": "number"},
                "hours": {"type": "array"},
                "where": {"type": "object"},
            },
        },
    },
}


def xml_block(name: str, parameters: dict[str, str]) -> str:
    """A tool call as Qwen3-Coder / Qwen3.5+ chat templates write one (sglang's `qwen3_coder`)."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_a_qwen3_coder_xml_call_is_a_tool_call_with_arguments_typed_by_the_schema():
    raw = "<think>\nWeather, then.\n</think>\n\nChecking.\n" + xml_block(
        "get_weather",
        {"city": "New York", "days": "3", "metric": "True", "scale": "1.5", "hours": "[1, 2]", "where": '{"lat": 1}'},
    )
    assert joined(parse_output(raw, call_id_prefix="q", tools=[WEATHER_TOOL])) == [
        ReasoningDelta("Weather, then."),
        TextDelta("Checking."),
        ToolCall(
            index=0,
            id="call_q_0",
            name="get_weather",
            arguments=json.dumps(
                {"city": "New York", "days": 3, "metric": True, "scale": 1.5, "hours": [1, 2], "where": {"lat": 1}}
            ),
        ),
    ]


def test_xml_values_that_do_not_convert_or_are_undeclared_stay_text():
    raw = xml_block("get_weather", {"days": "three", "note": "line one\nline two", "city": "  Oslo "})
    (call,) = parse_output(raw, call_id_prefix="q", tools=[WEATHER_TOOL])
    assert json.loads(call.arguments) == {"days": "three", "note": "line one\nline two", "city": "  Oslo "}
    (untyped,) = parse_output(xml_block("get_weather", {"days": "3"}), call_id_prefix="q")
    assert json.loads(untyped.arguments) == {"days": "3"}, "without the request's tools nothing says it is a number"


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=8))
def test_an_xml_call_parses_the_same_however_the_text_is_chunked(cuts):
    raw = (
        "Sure.\n"
        + xml_block("get_weather", {"city": "Lyon", "days": "2"})
        + "\n"
        + xml_block("get_weather", {"city": "Nice"})
    )
    cuts = [cut for cut in cuts if cut <= len(raw)]
    assert joined(parse_chunked(raw, cuts)) == joined(parse_output(raw, call_id_prefix="req"))
