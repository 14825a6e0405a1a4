"""validation: one rule per field kind, worded as each API words it.

The API modules' tests pin each API's messages end to end; these check the shared pieces
themselves, so that a change to a rule shows up here once rather than as two API failures.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from engy_node.gateway.api.chat import GatewayError
from engy_node.gateway.api.validation import (
    USED,
    FieldChecks,
    Harmless,
    Refused,
    equals,
    error_headers,
    invalid,
    is_int,
    is_zero,
    one_of,
)

SENTENCE = FieldChecks(
    separator=" ",
    item_path="{param}[{index}]",
    unknown_model="The model `{model}` is unknown.",
    unknown_field="Unrecognized request argument supplied: {field}",
)
PATH_FIRST = FieldChecks(
    separator=": ",
    item_path="{param}.{index}",
    unknown_model="model: {model}",
    unknown_field="{field}: Extra inputs are not permitted",
)
RULES = {
    "model": USED,
    "user": Harmless("an id", str),
    "metadata": Harmless("tags", Mapping),
    "logprobs": Refused("is not supported; omit it", allows=equals(False)),
    "penalty": Refused("is not supported; send 0", allows=is_zero),
    "tier": Refused("must be 'auto'", allows=one_of("auto")),
    "audio": Refused("is not supported"),
}


def refusal(check, *args, **kwargs) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        check(*args, **kwargs)
    return caught.value


def test_one_rule_reads_as_a_sentence_or_leads_with_the_path():
    assert refusal(SENTENCE.optional_bool, "yes", param="stream").message == "stream must be a boolean"
    assert refusal(PATH_FIRST.optional_bool, "yes", param="stream").message == "stream: must be a boolean"
    err = invalid(param="body", message="the request body must be a JSON object")
    assert (err.kind, err.status, err.param, err.message) == (
        "invalid_request",
        400,
        "body",
        "the request body must be a JSON object",
    )


def test_list_items_are_named_in_the_apis_path_notation():
    assert [path for path, _ in SENTENCE.items(["a", "b"], param="tools")] == ["tools[0]", "tools[1]"]
    assert [path for path, _ in PATH_FIRST.items(["a"], param="messages.2.content")] == ["messages.2.content.0"]
    assert (
        refusal(PATH_FIRST.items, [], param="messages", non_empty=True).message == "messages: must be a non-empty list"
    )
    assert refusal(SENTENCE.items, 5, param="c", complaint="must be a string or a list").message == (
        "c must be a string or a list"
    )


def test_an_unknown_model_is_a_404_in_the_apis_words_and_a_blank_one_a_400():
    unknown = refusal(SENTENCE.model, "gpt-9", known_models={"m"})
    assert (unknown.status, unknown.param, unknown.message) == (404, "model", "The model `gpt-9` is unknown.")
    assert refusal(PATH_FIRST.model, "", known_models={"m"}).status == 400
    assert PATH_FIRST.model("m", known_models={"m"}) == "m"


def test_only_a_json_integer_is_an_integer():
    assert [is_int(value) for value in (0, -3, True, 1.0, "1", None)] == [True, True, False, False, False, False]


def test_top_p_excludes_zero_and_temperature_includes_it():
    assert SENTENCE.temperature(0, maximum=2.0) == 0.0 and SENTENCE.top_p(1) == 1.0
    assert refusal(SENTENCE.top_p, 0).message == "top_p must be a number greater than 0 and at most 1, got 0"
    assert refusal(PATH_FIRST.temperature, float("nan"), maximum=1.0).param == "temperature"


def test_a_bare_stop_string_is_a_list_of_one_only_where_the_api_accepts_it():
    assert SENTENCE.stop_sequences("END", param="stop", max_count=4, accept_string=True) == ("END",)
    assert refusal(
        PATH_FIRST.stop_sequences, "END", param="stop_sequences", max_count=16, accept_string=False
    ).message == ("stop_sequences: must be a list of non-empty strings")
    assert refusal(SENTENCE.stop_sequences, ["a"] * 5, param="stop", max_count=4, accept_string=True).message == (
        "stop takes at most 4 sequences, got 5"
    )


def test_tools_become_function_tools_and_an_empty_list_is_none():
    def spec(tool, path):
        return {"name": PATH_FIRST.string(tool.get("name"), param=f"{path}.name", non_empty=True)}

    assert PATH_FIRST.tools([{"name": "f"}], function_spec=spec) == ({"type": "function", "function": {"name": "f"}},)
    assert PATH_FIRST.tools([], function_spec=spec) is None and PATH_FIRST.tools(None, function_spec=spec) is None
    assert refusal(PATH_FIRST.tools, [{"name": ""}], function_spec=spec).param == "tools.0.name"


def test_retry_headers_say_when_waiting_helps_and_when_only_a_changed_request_does():
    assert error_headers(GatewayError("overloaded", "busy", retry_after_s=2)) == {"retry-after": "2"}
    assert error_headers(GatewayError("invalid_request", "bad")) == {"x-should-retry": "false"}
    assert error_headers(GatewayError("upstream", "failed")) == {}


def test_a_body_passes_with_used_harmless_and_default_valued_fields_and_null_anywhere():
    PATH_FIRST.known_fields(
        {"model": 5, "user": "u", "metadata": {}, "logprobs": False, "penalty": 0.0, "tier": "auto", "audio": None},
        RULES,
    )


@pytest.mark.parametrize(
    ("body", "param", "sentence", "path_first"),
    [
        (
            {"model": "m", "extra": 1},
            "extra",
            "Unrecognized request argument supplied: extra",
            "extra: Extra inputs are not permitted",
        ),
        ({"user": 5}, "user", "user must be a string", "user: must be a string"),
        ({"metadata": "tags"}, "metadata", "metadata must be an object", "metadata: must be an object"),
        ({"logprobs": True}, "logprobs", "logprobs is not supported; omit it", "logprobs: is not supported; omit it"),
        ({"logprobs": 0}, "logprobs", "logprobs is not supported; omit it", "logprobs: is not supported; omit it"),
        ({"penalty": True}, "penalty", "penalty is not supported; send 0", "penalty: is not supported; send 0"),
        ({"penalty": 0.5}, "penalty", "penalty is not supported; send 0", "penalty: is not supported; send 0"),
        ({"tier": "flex"}, "tier", "tier must be 'auto'", "tier: must be 'auto'"),
        ({"audio": {}}, "audio", "audio is not supported", "audio: is not supported"),
    ],
)
def test_an_unknown_field_or_a_value_that_cannot_be_honoured_is_a_400_naming_it(body, param, sentence, path_first):
    for check, message in ((SENTENCE, sentence), (PATH_FIRST, path_first)):
        err = refusal(check.known_fields, body, RULES)
        assert (err.kind, err.param, err.message) == ("invalid_request", param, message)


def test_the_first_offending_field_in_the_buyers_order_is_named():
    assert refusal(SENTENCE.known_fields, {"audio": {}, "extra": 1}, RULES).param == "audio"
    assert refusal(SENTENCE.known_fields, {"extra": 1, "audio": {}}, RULES).param == "extra"
