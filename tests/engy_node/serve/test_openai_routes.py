"""The reference server's OpenAI routes with the official `openai` SDK as the client: chat and
completions, streamed and not, usage with cached prompt tokens, seeded sampling, `echo` with the
prompt's own log probabilities, and the refusals sglang's OpenAI server gives."""

from __future__ import annotations

import math

import openai
import pytest
import torch

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture
def sdk(reference_server):
    with openai.OpenAI(base_url=f"{reference_server.url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        yield client


def test_a_chat_completion_answers_as_the_native_route_does_and_counts_its_tokens(sdk, client, runner):
    completion = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and choice.finish_reason in ("stop", "length")
    prompt = runner.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    native = client.post(
        "/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    ).json()
    assert choice.message.content == native["text"]
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(native["output_ids"])
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0


def test_a_streamed_chat_completion_adds_up_to_the_answer_and_ends_with_its_usage(sdk):
    whole = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "the same prompt twice: its prefix is cached"


def test_a_seed_makes_a_sampled_answer_reproducible(sdk):
    answers = {
        sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, seed=20261205)
        .choices[0]
        .message.content
        for _ in range(2)
    }
    assert len(answers) == 1


def test_a_completion_echoes_its_prompt_with_the_prompts_own_log_probabilities(sdk, runner):
    prompt = "The capital of France is"
    completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=0)
    choice = completion.choices[0]
    assert choice.text.startswith(prompt)
    ids = runner.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + completion.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and all(v <= 0 for v in logprobs.token_logprobs[1:])
    _, logits = runner.prefill(ids)
    expected = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert all(math.isclose(a, b, abs_tol=0.05) for a, b in zip(logprobs.token_logprobs[1 : len(ids)], expected))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_a_streamed_completion_adds_up_to_the_answer(sdk):
    whole = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in sdk.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text


@pytest.mark.parametrize(
    ("request_kwargs", "param"),
    [
        ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"messages": []}, "messages"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_the_field(sdk, request_kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "max_tokens": 4, **request_kwargs})
    assert refused.value.body["param"] == param
