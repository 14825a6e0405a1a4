"""asgi.watch_disconnect with a server's `ClientGone` in the scope: the server's word cancels the
watched block (also when it came before the watch began), the watch lets go of the notice when
it ends, and `receive` is never read. Against a real server: tests/engy_node/test_hypercorn_http.py.
asgi.receive_queued_first: a queued message without a step, an empty queue waited on, the
channel's own end and errors, any other receive untouched. asgi.read_json_object's deadline: a
body queued whole is read without a step, one that does not come in time is a 408, and the time
counts from the first wait, for the whole body; its nesting limit, measured as the recursive
definition says and refused with a 400 at any depth, down to orjson's own."""

from __future__ import annotations

import orjson
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from engy_node.asgi import (
    CLIENT_GONE,
    MAX_JSON_DEPTH,
    BodyError,
    ClientGone,
    nesting_exceeds,
    read_json_object,
    receive_queued_first,
    take_queued,
    watch_disconnect,
)


async def unread_receive():
    raise AssertionError("a watch with the server's notice does not read receive")


async def test_the_servers_notice_cancels_the_watched_block():
    notice = ClientGone()
    reached_the_end = False
    async with watch_disconnect(unread_receive, {"extensions": {CLIENT_GONE: notice}}) as watch:
        notice.notify()
        await trio.sleep_forever()
        reached_the_end = True
    assert watch.client_gone and not reached_the_end and notice.callback is None


async def test_a_client_gone_before_the_watch_cancels_the_block_at_its_first_checkpoint():
    notice = ClientGone()
    notice.notify()
    async with watch_disconnect(unread_receive, {"extensions": {CLIENT_GONE: notice}}) as watch:
        await trio.lowlevel.checkpoint()
        raise AssertionError("the block should have been cancelled")
    assert watch.client_gone


async def test_a_block_that_ends_first_is_not_cancelled_and_lets_go_of_the_notice():
    notice = ClientGone()
    async with watch_disconnect(unread_receive, {"extensions": {CLIENT_GONE: notice}}) as watch:
        await trio.lowlevel.checkpoint()
    assert not watch.client_gone and notice.callback is None
    notice.notify()  # the client leaving afterwards reaches nobody
    assert notice.gone


async def test_a_queued_message_is_taken_without_a_scheduler_step():
    send, receive = trio.open_memory_channel(10)
    send.send_nowait({"type": "http.request", "body": b"{}"})
    with trio.testing.assert_no_checkpoints():
        assert await receive_queued_first(receive.receive)() == {"type": "http.request", "body": b"{}"}


async def test_an_empty_queue_is_waited_on_until_a_message_comes(nursery):
    send, receive = trio.open_memory_channel(10)

    async def later():
        await trio.sleep(0.01)
        await send.send({"type": "websocket.receive", "text": "x"})

    nursery.start_soon(later)
    with trio.testing.assert_checkpoints():
        assert await receive_queued_first(receive.receive)() == {"type": "websocket.receive", "text": "x"}


async def test_the_channel_ends_and_fails_as_it_does_on_its_own():
    send, receive = trio.open_memory_channel(10)
    queued = receive_queued_first(receive.receive)
    await send.aclose()
    with pytest.raises(trio.EndOfChannel):
        await queued()
    await receive.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await queued()


def test_any_other_receive_is_returned_as_it_is():
    async def receive():
        return {"type": "http.disconnect"}

    assert receive_queued_first(receive) is receive


def test_nothing_is_taken_without_waiting_from_any_other_receive():
    async def receive():
        return {"type": "http.disconnect"}

    assert take_queued(receive) is None


async def test_a_body_queued_whole_is_read_without_a_step_or_a_timer():
    send, receive = trio.open_memory_channel(10)
    send.send_nowait({"type": "http.request", "body": b'{"a": 1}', "more_body": False})
    with trio.testing.assert_no_checkpoints():
        assert await read_json_object(receive_queued_first(receive.receive), max_bytes=100, timeout_s=0) == {"a": 1}


async def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_time_covers_the_whole_body(autojump_clock, nursery):
    send, receive = trio.open_memory_channel(10)
    send.send_nowait({"type": "http.request", "body": b'{"a": ', "more_body": True})

    async def trickle():
        for piece in (b"1", b"2", b"3"):
            await trio.sleep(4)
            await send.send({"type": "http.request", "body": piece, "more_body": True})

    nursery.start_soon(trickle)
    started = trio.current_time()
    with pytest.raises(BodyError) as raised:
        await read_json_object(receive_queued_first(receive.receive), max_bytes=100, timeout_s=10)
    assert raised.value.status == 408 and "10 s" in str(raised.value)
    assert trio.current_time() - started == pytest.approx(10), "each piece came in time; the body as a whole did not"


async def test_a_body_that_comes_in_pieces_within_the_time_is_read_whole(nursery):
    send, receive = trio.open_memory_channel(10)

    async def pieces():
        for piece, more in ((b'{"a"', True), (b": 2}", False)):
            await trio.sleep(0.01)
            await send.send({"type": "http.request", "body": piece, "more_body": more})

    nursery.start_soon(pieces)
    assert await read_json_object(receive_queued_first(receive.receive), max_bytes=100, timeout_s=10) == {"a": 2}


def reference_depth(value) -> int:
    """JSON nesting depth by its recursive definition: a scalar 0, a container 1 + its deepest child."""
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    return 0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=2), children, max_size=3),
    max_leaves=40,
)


@given(value=JSON, limit=st.integers(0, 12))
def test_nesting_is_measured_as_the_recursive_definition_says(value, limit):
    assert nesting_exceeds(value, limit) == (reference_depth(value) > limit)


def nested_body(depth: int) -> bytes:
    """A JSON object `depth` levels deep, the object itself included."""
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


async def read_whole(body: bytes) -> dict:
    send, receive = trio.open_memory_channel(1)
    send.send_nowait({"type": "http.request", "body": body, "more_body": False})
    return await read_json_object(receive.receive, max_bytes=len(body))


async def test_a_body_nested_to_the_limit_is_read_and_any_deeper_is_a_400_naming_the_limit():
    assert reference_depth(await read_whole(nested_body(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    # Deeper than the limit, deeper than Python's recursion limit, deeper than orjson parses.
    for depth in (MAX_JSON_DEPTH + 1, 1_000, 1_024, 100_000):
        with pytest.raises(BodyError) as refused:
            await read_whole(nested_body(depth))
        assert refused.value.status == 400
        assert str(refused.value).startswith(f"request body nests JSON arrays and objects more than {MAX_JSON_DEPTH}")


async def test_brackets_inside_strings_do_not_make_a_shallow_body_deep():
    body = {"text": "{[" * 10_000, "list": [[1], {"b": [2]}]}
    assert await read_whole(orjson.dumps(body)) == body
