"""asgi.watch_disconnect with a server's `ClientGone` in the scope: the server's word cancels the
watched block (also when it came before the watch began), the watch lets go of the notice when
it ends, and `receive` is never read. Against a real server: tests/engy_node/test_hypercorn_http.py."""

from __future__ import annotations

import trio

from engy_node.asgi import CLIENT_GONE, ClientGone, watch_disconnect


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
