"""The reference server over real HTTP, as `engy-node serve` runs it.

The client helpers below read responses the way the public SN53 miner (`engy_miner.py`) reads
real sglang's native `/generate`: `out[0] if list`, cumulative SSE `text`, the last event
as the result, ragged hidden states (2-D block: last row; 1-D: as is), `t[1]` of logprob
entries, `finish_reason["type"]`. If these pass, a client written for sglang works unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import httpx
import pytest
import torch

from engy_node.config import load_config
from engy_node.gemm.loaded import WeightsMismatch
from engy_node.hub import Hub
from engy_node.models import CATALOG, SMOLLM2_135M
from engy_node.serve.app import decode_array
from engy_node.serve.server import serve_reference
from engy_node.serve.status import exposition_samples
from tests.waiting import wait_until

from .numerics import assert_top_choices

PROMPT_IDS = [1, 504, 3575, 282, 4649, 314]


def sglang_generate(client: httpx.Client, body: dict) -> dict:
    response = client.post("/generate", json=body)
    response.raise_for_status()
    out = response.json()
    return out[0] if isinstance(out, list) else out


def sglang_stream(client: httpx.Client, body: dict) -> list[dict]:
    events = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        response.raise_for_status()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                events.append("[DONE]")
                break
            events.append(json.loads(data))
    return events


def kept_rows(hidden_states: list) -> list[list[float]]:
    """One row per output token, as the public miner extracts them."""
    rows = []
    for element in hidden_states:
        if element and isinstance(element[0], list):
            rows.append(element[-1])
        elif element:
            rows.append(element)
    return rows


def test_health_model_info_and_server_info_answer_like_sglang(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info == client.get("/model_info").json()
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert len(info["engy"]["model_root"]) == 64
    server = client.get("/server_info").json()
    assert server["status"] == "ready"
    # The checkpoint's weights were checked against the catalog's pin before the model loaded.
    assert server["weights_root"] == SMOLLM2_135M.weights_root
    assert server["simulated_cheat"] is None  # serve.simulate_cheat is for demos and tests
    assert server["max_running_requests"] == 4
    assert client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_pending_tokens": 0}
    ]
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "smollm2-135m"
    assert client.get("/v1/models/no-such-model").status_code == 404


def test_greedy_generation_answers_the_capital_of_france(client, runner):
    # The server is shared by the session: another test may have asked this before.
    assert client.post("/flush_cache").status_code == 200
    ids = runner.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    out = sglang_generate(client, {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 32}})
    assert "Paris" in out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert out["output_ids"][-1] == 2, "the matched EOS is part of output_ids"
    assert "<|im_end|>" not in out["text"]
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["prompt_tokens"] == len(ids)
    assert meta["cached_tokens"] == 0


def test_non_stream_result_has_sglang_meta_info_keys_in_order(client):
    out = sglang_generate(
        client,
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": 5},
            "rid": "engy-order-check",
            "return_logprob": True,
            "return_hidden_states": True,
        },
    )
    assert list(out) == ["text", "output_ids", "meta_info"]
    assert list(out["meta_info"]) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "num_retractions",
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "reasoning_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_versions",
        "cached_tokens_details",
        "hidden_states",
        "dp_rank",
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    meta = out["meta_info"]
    assert meta["id"] == "engy-order-check"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["input_token_logprobs"] == []
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[2] is None and t[0] <= 0 for t in meta["output_token_logprobs"])


def test_hidden_states_are_ragged_prefill_block_then_one_vector_per_decode_step(client, runner):
    out = sglang_generate(
        client,
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True},
            "return_hidden_states": True,
        },
    )
    hidden = out["meta_info"]["hidden_states"]
    assert len(hidden) == len(out["output_ids"]) == 7
    block = hidden[0]
    assert len(block) == len(PROMPT_IDS) and all(len(row) == runner.hidden_size for row in block)
    assert all(len(vector) == runner.hidden_size and not isinstance(vector[0], list) for vector in hidden[1:])
    served = torch.tensor(kept_rows(hidden))
    recomputed, logits = runner.prefill(PROMPT_IDS + out["output_ids"][:-1])
    assert torch.allclose(served, recomputed[len(PROMPT_IDS) - 1 :].float(), atol=0.8), (
        "same tolerance as sglang's own test"
    )
    assert_top_choices(logits[len(PROMPT_IDS) - 1 :], out["output_ids"])
    assert all(torch.tensor(row).to(torch.bfloat16).float().tolist() == row for row in kept_rows(hidden)), (
        "values are bf16"
    )


def test_stream_events_are_cumulative_and_end_with_done(client):
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        "return_logprob": True,
        "return_hidden_states": True,
        "rid": "engy-stream",
    }
    events = sglang_stream(client, body)
    assert events[-1] == "[DONE]"
    results = events[:-1]
    assert len(results) >= 2
    for earlier, later in zip(results, results[1:]):
        assert later["text"].startswith(earlier["text"])
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    for event in results:
        meta = event["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(event["output_ids"]) == meta["completion_tokens"]
        assert len(meta["hidden_states"]) == len(event["output_ids"]), "hidden states repeat cumulatively"
    assert all(e["meta_info"]["finish_reason"] is None for e in results[:-1])
    final = results[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert "e2e_latency" in final["meta_info"] and "e2e_latency" not in results[0]["meta_info"]
    assert "response_sent_to_client_ts" in results[0]["meta_info"]
    direct = sglang_generate(client, {k: v for k, v in body.items() if k != "rid"})
    assert direct["output_ids"] == final["output_ids"] and direct["text"] == final["text"]
    assert direct["meta_info"]["hidden_states"] == final["meta_info"]["hidden_states"]


def test_a_stream_holds_back_a_partial_character_and_ends_with_the_bytes_as_generated(client, runner):
    # " è" is two tokens, " " plus the lead byte 0xC3, then the continuation byte. Forcing the
    # first on every step leaves a partial character at the end of each event, and makes each
    # earlier 0xC3 an invalid byte for good once the next token's space follows it.
    lead, _continuation = runner.tokenizer.encode(" è", add_special_tokens=False)
    events = sglang_stream(
        client,
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 4,
                "ignore_eos": True,
                "logit_bias": {str(lead): 100},
            },
        },
    )
    assert events[-1] == "[DONE]"
    results = events[:-1]
    for earlier, later in zip(results, results[1:]):
        assert later["text"].startswith(earlier["text"])
    for event in results[:-1]:
        assert event["output_ids"] == [lead] * len(event["output_ids"])
        assert event["text"] == " \ufffd" * (len(event["output_ids"]) - 1) + " ", (
            "only the partial character is held back"
        )
    final = results[-1]
    assert final["output_ids"] == [lead] * 4
    assert final["text"] == " \ufffd" * 4 == runner.decode_text(final["output_ids"])


def test_a_stop_string_is_trimmed_from_the_text_and_reported(client):
    probe = sglang_generate(
        client,
        {"input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}},
    )
    stop = probe["text"].split()[2]
    out = sglang_generate(
        client,
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": [stop]},
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and probe["text"].startswith(out["text"])


def test_a_seeded_sampled_request_is_reproducible(client):
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234, "max_new_tokens": 16},
    }
    assert sglang_generate(client, body)["output_ids"] == sglang_generate(client, body)["output_ids"]


def test_text_prompts_and_batches_return_one_result_per_item_in_order(client):
    response = client.post(
        "/generate",
        json={
            "text": ["The capital of France is", "One plus one equals"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 3},
            "rid": "engy-batch",
        },
    )
    results = response.json()
    assert isinstance(results, list) and [r["meta_info"]["id"] for r in results] == ["engy-batch_0", "engy-batch_1"]
    single = sglang_generate(
        client, {"text": "One plus one equals", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    )
    assert results[1]["output_ids"] == single["output_ids"]

    events = sglang_stream(
        client, {"input_ids": [PROMPT_IDS, PROMPT_IDS[:4]], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    )
    assert {e["index"] for e in events[:-1]} == {0, 1}


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"input_ids": PROMPT_IDS, "sampling_params": {"foo": 1}}, 400, "unknown field `foo`"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 3.0}}, 400, "max_new_tokens"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 9000}}, 400, "maximum context length"),
        ({"sampling_params": {}}, 400, "Either text, input_ids"),
        ({"input_ids": [10**9]}, 400, "outside the vocabulary"),
        ({"input_ids": PROMPT_IDS, "return_hidden_states": "last"}, 400, "return_hidden_states"),
    ],
)
def test_invalid_requests_get_sglang_shaped_400s(client, body, status, fragment):
    response = client.post("/generate", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert fragment in message


def test_a_malformed_body_is_a_400_not_a_crash(client):
    response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert client.get("/health").status_code == 200


def _running(client) -> int:
    return client.get("/server_info").json()["internal_states"][0]["num_running_reqs"]


# The server is another process and says nothing when a generation starts, stops or is aborted:
# its counters (`/server_info`, `/metrics`) are the only view of that, so the tests below poll them
# (`wait_until`, bounded).


def test_abort_request_stops_a_running_stream_with_an_abort_finish(client, reference_server):
    body = {
        "input_ids": PROMPT_IDS,
        "rid": "engy-abort-me-1",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True},
    }
    last = None
    with httpx.Client(base_url=reference_server.url, timeout=120) as streamer:
        with streamer.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                last = json.loads(data)
                if len(last["output_ids"]) == 3:
                    # sglang matches rids by prefix
                    assert client.post("/abort_request", json={"rid": "engy-abort-me"}).status_code == 200
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 100
    wait_until(lambda: _running(client) == 0, timeout_s=30, what="the aborted generation gone from the server")


def test_aborting_an_unknown_rid_is_a_no_op_that_returns_200(client):
    response = client.post("/abort_request", json={"rid": "never-seen"})
    assert response.status_code == 200 and response.content == b""


def test_a_client_that_hangs_up_mid_stream_aborts_its_generation(client, reference_server):
    def aborted_total() -> float:
        samples = exposition_samples(client.get("/metrics").text)
        return sum(s.value for s in samples if s.name == "sglang:num_aborted_requests_total")

    before = aborted_total()
    body = {
        "input_ids": PROMPT_IDS,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True},
    }
    with httpx.Client(base_url=reference_server.url, timeout=120) as streamer:
        with streamer.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break
    wait_until(
        lambda: aborted_total() == before + 1, timeout_s=30, what="the disconnect reaching the engine (one more abort)"
    )
    wait_until(lambda: _running(client) == 0, timeout_s=30, what="the abandoned generation gone from the server")


def test_a_non_streaming_client_that_hangs_up_aborts_its_generation(client, reference_server):
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.Client(base_url=reference_server.url, timeout=1.0) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json=body)
    wait_until(lambda: _running(client) == 0, timeout_s=20, what="the abandoned generation gone from the server")


def test_a_long_generation_does_not_block_other_requests_or_their_abort(client, reference_server):
    long_body = {
        "input_ids": PROMPT_IDS,
        "rid": "engy-long",
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }
    outcome = {}
    worker = threading.Thread(
        target=lambda: outcome.update(
            long=sglang_generate(httpx.Client(base_url=reference_server.url, timeout=120), long_body)
        )
    )
    worker.start()
    wait_until(lambda: _running(client) >= 1, timeout_s=30, what="the long generation running")
    short = sglang_generate(
        client, {"input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    )
    assert _running(client) >= 1, "the short request finished while the long one was still generating"
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    assert client.post("/abort_request", json={"rid": "engy-long"}).status_code == 200
    worker.join(60)
    assert outcome["long"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(outcome["long"]["output_ids"]) < 400


def test_metrics_use_sglang_names(client):
    sglang_generate(client, {"input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    response = client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    names = {sample.name for sample in exposition_samples(response.text)}
    for name in (
        "sglang:time_to_first_token_seconds_count",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_sum",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
    ):
        assert name in names


def test_prefill_returns_the_hidden_states_the_generation_served(client, runner):
    out = sglang_generate(
        client,
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            "return_hidden_states": True,
        },
    )
    sequence = PROMPT_IDS + out["output_ids"][:-1]
    response = client.post(
        "/engy/prefill",
        json={
            "input_ids": sequence,
            "start": len(PROMPT_IDS) - 1,
            "logits": "summary",
            "target_ids": out["output_ids"],
        },
    )
    assert response.status_code == 200
    payload = response.json()
    hidden = decode_array(payload["hidden_states"])
    assert hidden.dtype == torch.bfloat16 and tuple(hidden.shape) == (5, runner.hidden_size)
    assert torch.allclose(hidden.float(), torch.tensor(kept_rows(out["meta_info"]["hidden_states"])), atol=0.8)
    assert payload["token_stats"]["rank"] == [0] * 5, "greedy tokens are the recompute's argmax"
    full = client.post(
        "/engy/prefill", json={"input_ids": PROMPT_IDS, "logits": "full", "hidden_dtype": "float32"}
    ).json()
    assert tuple(decode_array(full["logits"]).shape) == (len(PROMPT_IDS), runner.vocab_size)
    assert client.post("/engy/prefill", json={"input_ids": PROMPT_IDS, "logits": "summary"}).status_code == 400


async def test_a_checkpoint_whose_weights_differ_from_the_pin_is_refused_before_it_loads(
    checkpoint, tmp_path, monkeypatch, caplog
):
    other = "cd" * 32
    monkeypatch.setitem(CATALOG, SMOLLM2_135M.id, dataclasses.replace(SMOLLM2_135M, weights_root=other))
    cache = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(home=tmp_path, env=cache, overrides={"serve": {"checkpoint": str(checkpoint)}})
    hub = Hub()
    with pytest.raises(WeightsMismatch) as refused:
        await serve_reference(config, hub)
    message = str(refused.value)
    assert str(checkpoint) in message and other in message and SMOLLM2_135M.weights_root in message
    assert "`engy-node checkpoint`" in message
    assert any(r.levelname == "ERROR" and r.getMessage() == message for r in caplog.records)
    assert hub.states()["serve"]["state"] == "loading"  # never served


def test_the_server_stops_cleanly_on_sigterm(checkpoint, tmp_path):
    from tests.conftest import ServerProcess

    server = ServerProcess(tmp_path)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.stop() == 0
    assert "SIGTERM received; shutting down" in server.log_text()


def test_a_prompt_seen_before_reports_its_cached_tokens_as_sglangs_radix_cache_does(client, runner):
    ids = runner.tokenizer.encode(
        "You are a support assistant for a bicycle shop. Answer briefly and politely, "
        "and never promise a delivery date. Question:"
    )
    sglang_generate(client, {"input_ids": ids + [260], "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    second = sglang_generate(
        client, {"input_ids": ids + [1101], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    )
    assert second["meta_info"]["cached_tokens"] == len(ids), "the shared system text comes from the cache"
