"""Gateway worker processes: which worker a miner connection names, the hand-off of a connection
to that worker, and a two-worker gateway end to end.

The hand-off tests run two workers' listeners in one process on one shared socket, with real
TCP connections, so whichever listener accepts a connection, the test knows where it must come
out. The end-to-end tests run `run_gateway` with `gateway.workers = 2` as a user's node does:
this process is worker 0 and starts worker 1 (`python -m engy_node.gateway`).
"""

from __future__ import annotations

import array
import functools
import os
import signal
import socket
import uuid
from collections.abc import Callable

import anthropic
import httpx
import openai
import psutil
import pytest
import trio
import trio_websocket
from hypothesis import given
from hypothesis import strategies as st

from engy_node.config import load_config
from engy_node.gateway import admin
from engy_node.gateway.billing import billing
from engy_node.gateway.fleet.workers import MinerListener, SharedSockets, leg_worker
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.miner.link import Identity, LinkSettings
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import Admit, Capacity, Hello, encode, parse_gateway_frame
from engy_node.served_model import load_served_model
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link
from tests.waiting import Changes, ProcessOutput, logged, wait_until_async

MODEL = "smollm2-135m"
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)


# ---- which worker a request line names ----------------------------------------------------------


@given(
    workers=st.integers(1, 64),
    index=st.integers(0, 200),
    method=st.sampled_from([b"GET", b"POST"]),
    query=st.sampled_from([b"", b"?x=1"]),
)
def test_a_leg_path_names_its_worker_when_that_worker_exists(workers, index, method, query):
    line = method + b" /gw/" + str(index).encode() + query + b" HTTP/1.1"
    assert leg_worker(line, workers=workers) == (index if index < workers else None)


@pytest.mark.parametrize(
    "line",
    [
        b"GET /gw HTTP/1.1",
        b"GET /gw/meta HTTP/1.1",
        b"GET /gw/ HTTP/1.1",
        b"GET /gw/1/ HTTP/1.1",
        b"GET /gw/-1 HTTP/1.1",
        b"GET /gw/+1 HTTP/1.1",
        b"GET /gw/1x HTTP/1.1",
        b"GET /v1/models HTTP/1.1",
        b"GET /gw/1",
        b"",
        b"GET  /gw/1 HTTP/1.1",
        b"GET /gw/99999999999 HTTP/1.1",
        "GET /gw/\u0661 HTTP/1.1".encode(),
    ],
)
def test_anything_but_a_leg_path_names_no_worker(line):
    assert leg_worker(line, workers=4) is None


@given(st.binary(max_size=200))
def test_any_bytes_name_no_worker_or_an_existing_one(line):
    assert leg_worker(line, workers=3) in (None, 0, 1, 2)


@given(data=st.data(), workers=st.integers(1, 16), hosts=st.integers(1, 4))
def test_in_a_fleet_each_host_serves_its_own_legs_and_spreads_the_ones_failed_over_to_it(data, workers, hosts):
    fleet_legs = workers * hosts
    fleet_offset = workers * data.draw(st.integers(0, hosts - 1))
    index = data.draw(st.integers(0, fleet_legs + 5))
    named = leg_worker(
        b"GET /gw/" + str(index).encode() + b" HTTP/1.1",
        workers=workers,
        fleet_offset=fleet_offset,
        fleet_legs=fleet_legs,
    )
    if index >= fleet_legs:
        assert named is None
    elif fleet_offset <= index < fleet_offset + workers:
        assert named == index - fleet_offset
    else:
        assert named is not None and 0 <= named < workers


def test_another_hosts_legs_spread_evenly_over_this_hosts_workers():
    named = [leg_worker(f"GET /gw/{i} HTTP/1.1".encode(), workers=3, fleet_offset=3, fleet_legs=9) for i in range(9)]
    assert named == [0, 1, 2, 0, 1, 2, 0, 1, 2]


# ---- the hand-off between two workers' listeners ------------------------------------------------


@pytest.fixture
def shared():
    settings = load_config(
        home=None,
        env={},
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, "workers": 2}},
    ).gateway
    sockets = SharedSockets.bind(settings)
    yield sockets
    sockets.close()


async def connect_and_send(sockets: SharedSockets, head: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", sockets.miner.getsockname()[1])
    await stream.send_all(head)
    return stream


async def collect(listener: MinerListener, into: list[bytes], seen: trio.Event, done: Callable[[], bool]) -> None:
    """Read each accepted connection's request line (proving nothing was consumed before); set
    `seen` once `done()` holds after one."""
    while True:
        stream = await listener.accept()
        head = b""
        while b"\n" not in head:
            head += await stream.receive_some(1024)
        into.append(head.split(b"\n")[0].rstrip(b"\r"))
        await stream.aclose()
        if done():
            seen.set()


async def test_each_connection_comes_out_of_the_worker_it_names_whichever_worker_accepted_it(shared):
    listeners = [MinerListener(shared.seat(0)), MinerListener(shared.seat(1))]
    lines: list[list[bytes]] = [[], []]
    heads = [f"GET /gw/{i % 2} HTTP/1.1\r\nHost: x\r\nX-N: {i}\r\n\r\n".encode() for i in range(40)]
    heads += [b"GET /gw/meta HTTP/1.1\r\n\r\n", b"GET /gw HTTP/1.1\r\n\r\n", b"GET /gw/9 HTTP/1.1\r\n\r\n"]
    all_seen = trio.Event()
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            await nursery.start(listener.run)
        for index, listener in enumerate(listeners):
            nursery.start_soon(
                collect, listener, lines[index], all_seen, lambda: len(lines[0]) + len(lines[1]) >= len(heads)
            )
        clients = [await connect_and_send(shared, head) for head in heads]
        with trio.fail_after(10):
            await all_seen.wait()
        nursery.cancel_scope.cancel()
    for client in clients:
        await client.aclose()
    assert all(line.startswith(b"GET /gw/0 ") for line in lines[0] if b"/gw/0" in line or b"/gw/1" in line)
    assert all(line.startswith(b"GET /gw/1 ") for line in lines[1] if b"/gw/0" in line or b"/gw/1" in line)
    assert sorted(lines[0] + lines[1]) == sorted(head.split(b"\r\n")[0] for head in heads)
    assert listeners[0].passed + listeners[1].passed == listeners[0].received + listeners[1].received


async def test_a_leg_for_a_worker_that_is_not_listening_is_refused_for_the_miner_to_redial(shared):
    """Served by the wrong worker, a leg would stay there and the named worker's buyers find none.
    The refusal answers the handshake (503), so the miner's websocket client gives up at once
    rather than waiting out its connect timeout."""
    listener = MinerListener(shared.seat(0))
    lines: list[bytes] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        seen = trio.Event()
        nursery.start_soon(collect, listener, lines, seen, lambda: len(lines) >= 1)
        refused = await connect_and_send(shared, b"GET /gw/1 HTTP/1.1\r\n\r\n")
        with trio.fail_after(10):
            answer = await refused.receive_some(4096)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer
            assert await closed_by_peer(refused)
        served = await connect_and_send(shared, b"GET /gw/0 HTTP/1.1\n\n")
        with trio.fail_after(10):
            await seen.wait()
        nursery.cancel_scope.cancel()
    await served.aclose()
    assert lines == [b"GET /gw/0 HTTP/1.1"]
    assert (listener.passed, listener.refused) == (0, 1)


async def test_a_descriptor_that_is_not_a_connection_is_ignored_and_the_listener_keeps_serving(shared):
    listener = MinerListener(shared.seat(0))
    lines: list[bytes] = []
    read_end, write_end = os.pipe()
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        seen = trio.Event()
        nursery.start_soon(collect, listener, lines, seen, lambda: len(lines) >= 1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendmsg(
                [b"c"],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end]))],
                0,
                shared.seat(0).inbox(0),
            )
        client = await connect_and_send(shared, b"GET /gw/0 HTTP/1.1\r\n\r\n")
        with trio.fail_after(10):
            await seen.wait()
        nursery.cancel_scope.cancel()
    await client.aclose()
    os.close(read_end)
    os.close(write_end)
    assert lines == [b"GET /gw/0 HTTP/1.1"]
    assert listener.received == 0


async def closed_by_peer(stream: trio.SocketStream) -> bool:
    """Closed with unread data in it is a reset rather than an end of stream; either means closed."""
    try:
        return await stream.receive_some(10) == b""
    except trio.BrokenResourceError:
        return True


async def test_a_silent_connection_is_closed_without_holding_up_the_others(shared):
    listener = MinerListener(shared.seat(0), peek_timeout_s=0.5)
    lines: list[bytes] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        seen = trio.Event()
        nursery.start_soon(collect, listener, lines, seen, lambda: len(lines) >= 1)
        silent = await trio.open_tcp_stream("127.0.0.1", shared.miner.getsockname()[1])
        partial = await connect_and_send(shared, b"GET /gw/0 HT")
        talking = await connect_and_send(shared, b"GET /gw/0 HTTP/1.1\r\n\r\n")
        with trio.fail_after(10):
            await seen.wait()
            assert await closed_by_peer(silent)  # once the peek timed out
            assert await closed_by_peer(partial)
        nursery.cancel_scope.cancel()
    for stream in (silent, partial, talking):
        await stream.aclose()
    assert lines == [b"GET /gw/0 HTTP/1.1"]


# ---- holds a dead worker left behind ---------------------------------------------------------------


async def test_the_sweep_releases_a_hold_left_open_and_never_one_that_settled(tmp_path, monkeypatch):
    """The loop around `orphans.sweep` (whose timing rules its own tests cover), on a real
    clock with short intervals: autojumping time would run past thread hand-offs to the store."""
    from engy_node.gateway import role

    monkeypatch.setattr(role, "ORPHAN_SWEEP_S", 0.05)
    with Store(tmp_path / "gateway.sqlite3") as store:
        account, _ = store.create_buyer("buyer")
        store.credit(account, micro_usd=1_000)
        orphan = store.hold(account, amount=100, request_id="died-with-its-worker")
        live = store.hold(account, amount=50, request_id="still-streaming")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(role._release_orphaned_holds, store, 0.25)
            assert store.settle(live, cost=30).applied
            await wait_until_async(lambda: store.balance(account).held == 0, timeout_s=30, what="the orphan released")
            nursery.cancel_scope.cancel()
        balance = store.balance(account)
    assert (balance.charged, balance.available) == (30, 1_000 - 30), f"the orphaned {orphan.amount} µUSD came back"


# ---- a two-worker gateway end to end --------------------------------------------------------------


@pytest.fixture
async def two_workers(nursery, tmp_path, checkpoint):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, "workers": 2}},
    )
    urls = await nursery.start(run_gateway, config, Hub())
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    yield config, urls, store, served
    store.close()


def worker_processes() -> list[psutil.Process]:
    """Live gateway worker processes this process started (a killed one not yet reaped is not)."""
    found = []
    for child in psutil.Process().children():
        try:
            if "engy_node.gateway" in child.cmdline():
                found.append(child)
        except psutil.Error:
            pass
    return found


async def open_leg(miner_url: str, worker: int, miner_key: str, served, name: str) -> bool:
    """Open a leg to `/gw/{worker}` by hand; True once admitted."""
    hello = Hello(
        miner_key=miner_key,
        model=MODEL,
        model_root=served.model_root,
        hw={},
        versions={},
        capacity=Capacity(1, 1, 6144, 2048, 600),
        worker_name=name,
        worker_id=uuid.uuid4().hex,
    )
    async with trio_websocket.open_websocket_url(f"{miner_url}/{worker}") as connection:
        await connection.send_message(encode(hello))
        return isinstance(parse_gateway_frame(await connection.get_message()), Admit)


async def miner_on_both_workers(nursery, http, urls, store, served, text: str):
    """A registered synthetic miner answering `text`, once it holds a leg on each worker."""
    _, miner_key = store.register_miner("synthetic")
    link = synthetic_link(
        gateway_url=urls.miner_url,
        model=served,
        identity=Identity(miner_key=miner_key),
        handler=SyntheticHandler(served, lambda frame: Script(text=text)),
        http=http,
        settings=FAST,
        max_inflight=64,
    )
    legs = Changes()
    link.on_state = legs.notify  # called whenever a leg goes up or down
    await nursery.start(link.run)
    await legs.wait_for(lambda: sum(link.legs_up.values()) >= 2, timeout_s=30, what="a leg up on each worker")
    return link


async def test_two_workers_serve_buyers_with_legs_on_each_and_exact_books(nursery, two_workers):
    config, urls, store, served = two_workers
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.get(urls.miner_url.replace("ws://", "http://") + "/meta")).json() == {"workers": 2}
        await miner_on_both_workers(nursery, http, urls, store, served, "Two workers, one answer.")
        account, key = store.create_buyer("buyer")
        store.credit(account, micro_usd=1_000_000)
        client = openai.AsyncOpenAI(base_url=urls.buyer_url + "/v1", api_key=key, max_retries=0, timeout=60)
        answers = []

        async def ask(index: int) -> None:
            # A fresh connection per request: the kernel hands them to both workers.
            async with httpx.AsyncClient(timeout=60) as own:
                fresh = openai.AsyncOpenAI(base_url=urls.buyer_url + "/v1", api_key=key, max_retries=0, http_client=own)
                answers.append(
                    await fresh.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"question {index}"}], max_tokens=20
                    )
                )

        async with trio.open_nursery() as buyers:
            for index in range(24):
                buyers.start_soon(ask, index)
        await client.close()
    assert [answer.choices[0].message.content for answer in answers] == ["Two workers, one answer."] * 24
    expected = sum(
        billing.charge(
            price=SMOLLM2_135M.price,
            usage=billing.Usage(
                prompt_tokens=answer.usage.prompt_tokens,
                completion_tokens=answer.usage.completion_tokens,
                cached_tokens=0,
            ),
        )
        for answer in answers
    )
    # Either worker settles a non-streamed answer before it sends it, so every hold is closed by now.
    assert store.balance(account).held == 0
    assert store.balance(account).charged == expected
    assert store.check_books() == []


async def test_a_revoked_key_is_refused_from_the_next_request_on_by_every_worker(nursery, two_workers):
    """Issue 33, item 8: a revoked key kept working for 30 s in each worker's key cache. The key is
    revoked as the operator does it (`admin.revoke_key`, a store of its own as the CLI opens), and
    every request after that, on whichever worker, is refused."""
    config, urls, store, served = two_workers
    async with httpx.AsyncClient(timeout=60) as http:
        await miner_on_both_workers(nursery, http, urls, store, served, "Still here.")
        account, key = store.create_buyer("buyer")
        store.credit(account, micro_usd=1_000_000)

        async def ask(index: int) -> str | int | None:
            # A fresh connection per request: the kernel hands them to both workers.
            async with httpx.AsyncClient(timeout=60) as own:
                fresh = openai.AsyncOpenAI(base_url=urls.buyer_url + "/v1", api_key=key, max_retries=0, http_client=own)
                try:
                    answer = await fresh.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"question {index}"}], max_tokens=20
                    )
                except openai.AuthenticationError as refused:
                    return refused.status_code
                return answer.choices[0].message.content

        async def count(index: int) -> int:
            async with anthropic.AsyncAnthropic(base_url=urls.buyer_url, api_key=key, max_retries=0) as fresh:
                try:
                    await fresh.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": f"q {index}"}])
                except anthropic.AuthenticationError as refused:
                    return refused.status_code
                return 200

        before = [await ask(index) for index in range(8)] + [await count(index) for index in range(8)]
        assert before == ["Still here."] * 8 + [200] * 8
        with Store.open(store_path(config)) as operators:
            assert "revoked" in admin.revoke_key(operators, api_key=key)
        assert [await ask(index) for index in range(8)] == [401] * 8
        assert [await count(index) for index in range(8)] == [401] * 8
    assert store.balance(account).held == 0 and store.check_books() == []


async def test_a_leg_reaches_the_worker_it_names_and_a_dead_worker_is_restarted(nursery, two_workers):
    config, urls, store, served = two_workers
    _, miner_key = store.register_miner("by-hand")
    child_log = config.paths.log_dir / "engy-node-gateway-1.log"
    for attempt in range(6):
        for worker in (0, 1):
            assert await open_leg(urls.miner_url, worker, miner_key, served, f"to-{worker}-{attempt}")
    # Worker 1 is another process, which sends a leg its admit before it logs the admission, and
    # its log file is the only place it says which legs it admitted: bounded polls of that file.
    await wait_until_async(
        lambda: child_log.read_text().count("admitted") >= 6, timeout_s=10, what="worker 1 logging its six admissions"
    )
    admitted = child_log.read_text()
    assert all(f"to-1-{attempt}" in admitted for attempt in range(6))
    assert "to-0-" not in admitted

    [child] = worker_processes()
    with logged("engy.gateway.workers", "gateway worker 1 serves again") as restarted:
        child.send_signal(signal.SIGKILL)
        await restarted.wait(timeout_s=60, what="worker 1 restarted")
    replacements = [p for p in worker_processes() if p.pid != child.pid]
    assert replacements, "a new worker 1 process"
    # The replacement logs that it serves before it tells this process it is ready.
    assert child_log.read_text().count("gateway worker 1 serving") >= 2
    assert await open_leg(urls.miner_url, 1, miner_key, served, "after-restart")
    await wait_until_async(
        lambda: "after-restart" in child_log.read_text(),
        timeout_s=10,
        what="the new worker 1 logging the leg's admission",
    )
    assert replacements[0].is_running()


async def test_stopping_the_gateway_stops_its_worker_processes(tmp_path, checkpoint):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, "workers": 2}},
    )
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(run_gateway, config, Hub())
        [child] = worker_processes()
        nursery.cancel_scope.cancel()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(urls.buyer_url.rsplit(":", 1)[1])), timeout=2).close()


async def test_workers_stop_when_the_first_process_is_killed_outright(tmp_path, checkpoint):
    """Killed (or out of memory), the first process cannot stop its workers; they notice."""
    import subprocess
    import sys

    env = {**os.environ, "ENGY_GATEWAY__PORT": "0", "ENGY_GATEWAY__MINER_PORT": "0", "ENGY_GATEWAY__WORKERS": "2"}
    # The worker inherits the first process's stderr, this pipe: the output ends once both are gone.
    first = subprocess.Popen(
        [sys.executable, "-m", "engy_node", "--home", str(tmp_path), "--role", "gateway"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
    )
    output = ProcessOutput(first, tmp_path / "gateway.log")
    worker = None
    try:
        await trio.to_thread.run_sync(
            functools.partial(output.wait_for, "gateway ready", timeout_s=120, what="the gateway ready")
        )
        [worker] = psutil.Process(first.pid).children()
        first.kill()
        first.wait(10)
        await trio.to_thread.run_sync(
            functools.partial(output.wait_ended, timeout_s=30, what="the orphaned worker gone")
        )
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert "is gone; stopping" in output.text()
    finally:
        if first.poll() is None:
            first.kill()
        if worker is not None and worker.is_running():
            worker.kill()


@pytest.mark.parametrize("workers", [1, 2])
async def test_stopping_the_gateway_tells_its_miners_to_redial_before_closing(tmp_path, checkpoint, workers):
    from engy_node.protocol.miner import Reconnect

    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path, env=env, overrides={"gateway": {"port": 0, "miner_port": 0, "workers": workers}}
    )
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    with Store.open(store_path(config)) as store:
        _, miner_key = store.register_miner("told")
    frames = []
    async with trio.open_nursery() as nursery:
        gateway = trio.CancelScope()

        async def run_until_stopped(*, task_status=trio.TASK_STATUS_IGNORED):
            with gateway:
                await run_gateway(config, Hub(), task_status=task_status)

        urls = await nursery.start(run_until_stopped)
        hello = Hello(
            miner_key=miner_key,
            model=MODEL,
            model_root=served.model_root,
            hw={},
            versions={},
            capacity=Capacity(1, 1, 6144, 2048, 600),
            worker_name="told",
            worker_id=uuid.uuid4().hex,
        )
        async with trio_websocket.open_websocket_url(f"{urls.miner_url}/0" if workers > 1 else urls.miner_url) as leg:
            await leg.send_message(encode(hello))
            frames.append(parse_gateway_frame(await leg.get_message()))
            gateway.cancel()
            with trio.fail_after(10):
                frames.append(parse_gateway_frame(await leg.get_message()))
    assert [type(frame) for frame in frames] == [Admit, Reconnect]
