"""asgi.watch_disconnect with a server's `ClientGone` in the scope: the server's word cancels the
watched block (also when it came before the watch began), the watch lets go of the notice when
it ends, and `receive` is never read. Against a real server: tests/engy_node/test_hypercorn_http.py.
asgi.receive_queued_first: a queued message without a step, an empty queue waited on, the
channel's own end and errors, any other receive untouched."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engy_node.asgi import CLIENT_GONE, ClientGone, receive_queued_first, watch_disconnect


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
