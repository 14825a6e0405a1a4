"""asgi.watch_disconnect with a server's `ClientGone` in the scope: the server's word cancels the
watched block (also when it came before the watch began), the watch lets go of the notice when
it ends, and `receive` is never read. Against a real server: tests/engy_node/test_hypercorn_http.py.
asgi.receive_queued_first: a queued message without a step, an empty queue waited on, the
channel's own end and errors, any other receive untouched. asgi.read_json_object's deadline: a
body queued whole is read without a step, one that does not come in time is a 408, and the time
counts from the first wait, for the whole body."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engy_node.asgi import (
    CLIENT_GONE,
    BodyError,
    ClientGone,
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
