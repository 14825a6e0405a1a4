"""The shared /generate client: linear-time SSE parsing, chunked generation with overlap,
one hidden row per token, and cancellation that reaches the server."""

from __future__ import annotations

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.serve.client import ServeClient, ServeError, SseParser, rows_per_token
from tests.waiting import wait_until_async

PROMPT = [1, 504, 3575, 282, 4649, 314]


def stream_bytes(payloads: list[bytes], separator: bytes = b"\n\n") -> bytes:
    return b"".join(b"data: " + p + separator for p in payloads)


@given(
    st.lists(
        st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b), min_size=1, max_size=8
    ),
    st.lists(st.integers(1, 50), min_size=1, max_size=30),
    st.sampled_from([b"\n\n", b"\r\n\r\n"]),
)
@settings(max_examples=200)
def test_events_come_out_whole_and_in_order_however_the_stream_is_split(payloads, cuts, separator):
    data = stream_bytes(payloads, separator)
    parser = SseParser()
    received, position = [], 0
    for cut in cuts:
        received += parser.feed(data[position : position + cut])
        position += cut
    received += parser.feed(data[position:])
    assert received == [p.lstrip(b" ") for p in payloads if p.lstrip(b" ")]
    assert parser.pending() == 0


def test_a_huge_event_fed_in_small_pieces_is_scanned_once():
    payload = b'{"x":"' + b"a" * 5_000_000 + b'"}'
    data = stream_bytes([payload])
    parser = SseParser()
    events = []
    for start in range(0, len(data), 65536):
        events += parser.feed(data[start : start + 65536])
        assert parser._scanned >= len(parser._buffer) - 3, "already-scanned bytes are not rescanned"
    assert events == [payload]


def test_rows_per_token_keeps_the_last_prefill_row_then_each_decode_vector():
    block = [[1.0, 1.0], [2.0, 2.0]]
    assert rows_per_token([block, [3.0, 3.0], [4.0, 4.0]]) == ([[2.0, 2.0], [3.0, 3.0], [4.0, 4.0]], 0)
    assert rows_per_token([[], [3.0, 3.0]]) == ([[3.0, 3.0]], 1)


@pytest.fixture
async def serve(reference_server):
    async with httpx.AsyncClient(timeout=120) as http:
        yield ServeClient(reference_server.url, http)


GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True])
async def test_chunked_generation_equals_a_single_call(serve, stream):
    single = await serve.generate(PROMPT, GREEDY, max_new_tokens=12, stream=stream)
    chunked = await serve.generate(PROMPT, GREEDY, max_new_tokens=12, chunk_tokens=5, stream=stream)
    assert chunked.calls == 3
    assert chunked.output_ids == single.output_ids and len(chunked.output_ids) == 12
    assert len(chunked.hidden_rows) == len(single.hidden_rows) == 12
    import torch

    assert torch.allclose(torch.tensor(chunked.hidden_rows), torch.tensor(single.hidden_rows), atol=0.8)
    assert chunked.finish_reason == {"type": "length", "length": 12}


async def test_streamed_progress_grows_monotonically_across_chunks(serve):
    seen: list[list[int]] = []
    result = await serve.generate(
        PROMPT, GREEDY, max_new_tokens=9, chunk_tokens=4, stream=True, on_progress=lambda ids, text: seen.append(ids)
    )
    assert seen and seen[-1] == result.output_ids
    for earlier, later in zip(seen, seen[1:]):
        assert len(later) >= len(earlier) - 1
    assert result.first_token_s is not None


async def test_an_eos_finish_stops_before_the_budget(serve):
    result = await serve.generate(PROMPT, {"temperature": 0}, max_new_tokens=200, chunk_tokens=64)
    assert result.finish_reason["type"] in ("stop", "length")
    if result.finish_reason["type"] == "stop":
        assert len(result.output_ids) < 200


async def test_cancelling_a_generation_aborts_it_on_the_server(serve, reference_server):
    async def none_running() -> bool:
        info = (await serve.http.get(f"{reference_server.url}/server_info")).json()
        return info["internal_states"][0]["num_running_reqs"] == 0

    with trio.CancelScope() as generating:
        # Cancelled once the first tokens arrive: the generation is then running on the server.
        await serve.generate(
            PROMPT, GREEDY, max_new_tokens=2000, stream=True, on_progress=lambda ids, text: generating.cancel()
        )
    assert generating.cancelled_caught, "the generation finished before it was cancelled"
    # The server is another process and says nothing when it drops a generation: its request
    # counter is the only view of that, so the wait is a bounded poll.
    await wait_until_async(none_running, timeout_s=20, what="the cancelled generation aborted on the server")


async def test_a_server_error_becomes_a_serve_error_with_its_status(serve):
    with pytest.raises(ServeError) as caught:
        await serve.generate(PROMPT, {"temperature": 0, "bogus": 1}, max_new_tokens=4)
    assert caught.value.status == 400 and "unknown field" in str(caught.value)


async def test_an_unreachable_server_is_a_serve_error():
    async with httpx.AsyncClient(timeout=5) as http:
        client = ServeClient("http://127.0.0.1:9", http)
        with pytest.raises(ServeError, match="unreachable"):
            await client.generate(PROMPT, GREEDY, max_new_tokens=2)


async def test_abort_after_the_shared_client_closed_is_a_logged_false_not_an_error():
    import httpx

    from engy_node.serve.client import ServeClient

    http = httpx.AsyncClient()
    await http.aclose()
    assert await ServeClient("http://127.0.0.1:9", http).abort("engy-r1") is False
