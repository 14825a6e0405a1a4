"""`ServedModel` without transformers gives transformers' results, and loads without torch.

The reference is transformers itself: `AutoTokenizer.from_pretrained` on the embedded SmolLM2
checkpoint, in this test process. Against it: rendered text and ids of generated conversations
(every role, tools, unicode, empty and missing content, special tokens' text, reasoning
fields, both settings of the generation prompt; an error counts as its type and message),
`render_prompt`, `encode`, `decode`, `end_token_ids` and `max_token_bytes`. Then a fresh
interpreter imports the gateway's modules and loads the model, and must hold neither torch nor
transformers; and a real two-worker gateway's worker process must not map torch's library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engy_node.checkpoint_tokenizer import outcome
from engy_node.config import load_config
from engy_node.hub import Hub
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import Message, ServeRequest
from engy_node.served_model import end_token_ids_of, load_served_model, longest_token_bytes
from tests.waiting import wait_until_async

ADDED = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>"]
text = st.lists(
    st.one_of(
        st.text(max_size=30),
        st.sampled_from(ADDED),
        st.sampled_from(["", " ", "\n", "\n\n", "  x", "é", "e\u0301", "東京 ✓", "🙂", "{{ x }}", "{% raw %}"]),
    ),
    max_size=6,
).map("".join)
content = st.one_of(
    text, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
)
extra = st.dictionaries(
    st.sampled_from(["name", "tool_call_id", "reasoning_content", "thinking", "reasoning"]),
    st.one_of(st.none(), text),
    max_size=3,
)
message = st.builds(
    lambda role, body, fields: {**fields, "role": role, "content": body},
    st.sampled_from(["system", "user", "assistant", "tool"]),
    content,
    extra,
)
tool = st.builds(
    lambda name, description: {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
    st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    text,
)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def served(checkpoint):
    return load_served_model(SMOLLM2_135M, checkpoint, with_token_floor=True)


def without_runtime_settings(serialised: str) -> dict:
    tokenizer = json.loads(serialised)
    return {key: value for key, value in tokenizer.items() if key not in ("truncation", "padding")}


def test_the_rust_tokenizer_is_the_one_transformers_built(served, reference):
    assert without_runtime_settings(served.tokenizer.backend_tokenizer.to_str()) == without_runtime_settings(
        reference.backend_tokenizer.to_str()
    )
    assert served.tokenizer.special_tokens_map == reference.special_tokens_map
    assert served.tokenizer.eos_token_id == reference.eos_token_id


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(message, max_size=5),
    tools=st.one_of(st.none(), st.lists(tool, max_size=2)),
    add_generation_prompt=st.booleans(),
    tokenize=st.booleans(),
)
def test_apply_chat_template_is_transformers(served, reference, messages, tools, add_generation_prompt, tokenize):
    ours = outcome(
        lambda: served.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize
        )
    )
    theirs = outcome(
        lambda: reference.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize
        )
    )
    # transformers refuses an empty conversation with a ValueError of its own wording.
    assert ours == theirs or (
        not messages and ours[:2] == ("error", "ChatTemplateError") and theirs[:2] == ("error", "ValueError")
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), text), min_size=1, max_size=5),
    tools=st.lists(tool, max_size=2),
)
def test_render_prompt_is_transformers_ids_with_the_generation_prompt(served, reference, turns, tools):
    request = ServeRequest(
        messages=tuple(Message(role=role, content=body) for role, body in turns),
        max_tokens=8,
        engy_request_id="r",
        tools=tuple(tools) or None,
    )
    expected = reference.apply_chat_template(
        [m.for_template() for m in request.messages], tools=tools or None, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert served.render_prompt(request) == expected
    assert served.render_prompt(request) == expected, "again, from the piece cache"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=text, add_special_tokens=st.booleans())
def test_encode_is_transformers(served, reference, value, add_special_tokens):
    assert served.tokenizer.encode(value, add_special_tokens=add_special_tokens) == reference.encode(
        value, add_special_tokens=add_special_tokens
    )


def test_long_text_is_encoded_as_transformers_does(served, reference):
    value = "a long buyer message, 東京 ✓ <|im_end|> and more. " * 400
    assert served.tokenizer.encode(value, add_special_tokens=False) == reference.encode(value, add_special_tokens=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 16)), max_size=40), skip=st.booleans())
def test_decode_is_transformers(served, reference, ids, skip):
    assert served.tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert served.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_token_lookups_end_tokens_and_the_token_floor_are_transformers(served, reference, checkpoint):
    for token in [*ADDED, "hello", "Ġthe", "not-a-token-at-all"]:
        assert served.tokenizer.convert_tokens_to_ids(token) == reference.convert_tokens_to_ids(token)
    assert served.end_token_ids == end_token_ids_of(checkpoint, reference)
    assert served.max_token_bytes == longest_token_bytes(reference.backend_tokenizer)


IMPORTS_AND_LOAD = """
import json, sys
from pathlib import Path
import engy_node.gateway.__main__, engy_node.gateway.api.app, engy_node.gateway.role, engy_node.gateway.fleet.workers
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import load_served_model
served = load_served_model(SMOLLM2_135M, Path(sys.argv[1]), with_token_floor=True)
print(json.dumps({"loaded": sorted({name.split('.')[0] for name in sys.modules} & {"torch", "transformers"}),
                  "ids": served.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)}))
"""


def test_a_fresh_interpreter_imports_the_gateway_and_loads_the_model_without_torch_or_transformers(served, checkpoint):
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_AND_LOAD, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["loaded"] == []
    assert report["ids"] == served.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )


def maps_torch(process: psutil.Process) -> bool:
    return any(
        "libtorch" in line or f"{os.sep}torch{os.sep}" in line
        for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines()
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gateway worker processes need Linux")
async def test_a_gateway_worker_process_does_not_map_torch(nursery, tmp_path, checkpoint, served):
    from engy_node.gateway.role import run_gateway

    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, "workers": 2}},
    )
    await nursery.start(run_gateway, config, Hub())

    def workers() -> list[psutil.Process]:
        return [child for child in psutil.Process().children() if "engy_node.gateway" in child.cmdline()]

    await wait_until_async(lambda: len(workers()) == 1, timeout_s=60, what="the second worker process")
    (worker,) = workers()
    assert not maps_torch(worker), "the worker process mapped torch's library"
    nursery.cancel_scope.cancel()
