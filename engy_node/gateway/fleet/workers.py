"""Gateway worker processes: `gateway.workers` processes share the buyer port and the miner port.

Why processes. A request's way through the gateway (HTTP parsing, JSON, the chat template,
billing, the relay) is Python on one event loop, so one process serves about one core's worth
of requests. What every worker must agree on lives in the store, and SQLite serialises its
writers across processes (a hold cannot overspend whichever worker takes it); the rest is per
worker: miner legs, the authentication cache, the proof tee.

Buyer port. Each worker listens on it with its own socket (`SO_REUSEPORT`), and the kernel
spreads new connections over the sockets by a hash of their addresses. One socket shared by all
(accepted by whoever is quickest) was measured worse: a burst of connections often went mostly,
once all 64 of them, to one worker while the other idled.

Miner port. Shared the same way, but a leg must reach the worker it names: a worker routes its
buyers only to the legs it holds, which is why a miner opens one leg per worker at `/gw/{i}`
(docs/protocol.md). The acceptor peeks at the request line (`MSG_PEEK`: nothing is consumed) and, when
it names another worker, passes the socket itself to that worker (`SCM_RIGHTS` over a Unix
datagram socket in the abstract namespace, named with a random per-gateway token) and forgets
it; the receiving worker's HTTP server reads the untouched request as if it had accepted the
connection. `/gw/meta`, `/gw` and anything else are served where they land. A leg for a worker
that cannot take it right now (starting, restarting) is closed, and the miner re-dials until it
can: served elsewhere it would stay there, and that worker's buyers would find no miner. Only
this user's processes can hand a worker a connection (the kernel stamps each datagram with its
sender's credentials), and only a TCP socket is taken.

Supervision. The first process starts the others (`python -m engy_node.gateway`, the resolved
config on stdin), waits until each serves, restarts one that dies (with backoff), and stops
them with SIGTERM, on which each drains its own legs, when it stops itself.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import random
import secrets
import socket
import struct
import subprocess
import sys

import trio

from engy_node.config import Config, GatewaySection, config_document
from engy_node.errors import ConfigError, RoleError
from engy_node.retry import backoff_delay

log = logging.getLogger("engy.gateway.workers")

REQUEST_LINE_MAX_BYTES = 8192
PEEK_TIMEOUT_S = 10.0
"""A miner connection must send its request line within this long; a real one sends it at once,
so the limit only bounds what a silent connection can hold."""
PEEK_RETRY_S = 0.005
"""Pause between peeks while only part of the request line has arrived."""
PASS_TIMEOUT_S = 5.0
PASS_RETRY_S = 0.01
REFUSAL_SEND_S = 1.0
"""Longest the first process waits to tell a miner its leg was refused (a fresh socket's
buffer takes the few bytes at once; a peer that reads nothing is not waited for)."""
ACCEPTED_QUEUE = 64
LISTEN_BACKLOG = 1024
ACCEPT_PAUSE_S = 0.1
ACCEPT_PAUSE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""Accept failures that mean "out of resources right now": pause instead of spinning or dying."""
ACCEPT_IGNORED_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EPERM",
        "ECONNABORTED",
        "EPROTO",
        "ENETDOWN",
        "ENOPROTOOPT",
        "EHOSTDOWN",
        "ENONET",
        "EHOSTUNREACH",
        "EOPNOTSUPP",
        "ENETUNREACH",
        "ENOSR",
        "ESOCKTNOSUPPORT",
        "EPROTONOSUPPORT",
        "ETIMEDOUT",
        "ECONNRESET",
    )
    if hasattr(errno, name)
)
"""Accept failures that concern only the connection being accepted (as trio's own listener)."""
WORKER_START_TIMEOUT_S = 300.0
"""A worker loads every served model's tokenizer before it serves; a cold disk can be slow."""
RESTART_CAP_S = 30.0
"""The longest pause before restarting a worker that keeps dying (`retry.backoff_delay` from 1 s)."""
WORKER_STOP_MARGIN_S = 15.0
"""Beyond `gateway.drain_s`, how long a stopping worker has to end the requests the drain cut
off, tell its miners to re-dial and close (each step bounded by 5 s) before it is killed."""
STABLE_RUN_S = 60.0
"""A worker that ran this long before dying restarts after the shortest pause again."""


def leg_worker(request_line: bytes, *, workers: int, fleet_offset: int = 0, fleet_legs: int = 0) -> int | None:
    """The worker a miner connection's request line names (`GET /gw/3 HTTP/1.1` → 3), or None
    when it names none of `0..workers-1`: such a connection is served where it landed.

    In a fleet (`fleet_legs` legs over several hosts, this one serving from `fleet_offset` on),
    leg i is this host's worker `i - fleet_offset`; a leg of another host, which the load balancer
    sent here because that host is down, goes to worker `(i - fleet_offset) mod workers`, so the
    failed-over legs spread over this host's workers as evenly as they were numbered."""
    parts = request_line.split(b" ")
    if len(parts) != 3:
        return None
    path = parts[1].split(b"?", 1)[0]
    if not path.startswith(b"/gw/"):
        return None
    digits = path[4:]
    if not digits.isdigit() or len(digits) > 6:
        return None
    index = int(digits)
    if fleet_legs:
        return (index - fleet_offset) % workers if index < fleet_legs else None
    return index if index < workers else None


def miner_legs_cap(*, rigs: int, fleet_legs: int, workers: int) -> int:
    """The legs one miner identity may hold on one gateway worker when it runs `rigs` rigs (miner
    processes). A rig opens one leg per leg of the fleet (`/gw/meta`: `fleet_legs`); leg i lands
    on this host's worker (i - offset) mod `workers` (`leg_worker`), so one worker holds at
    most ceil(fleet_legs / workers) legs of a rig: one, unless other hosts' legs failed over to
    this one. Twice that, for a rig that re-plans its legs (the gateway's worker count changed):
    its old legs finish what they serve while the new ones open."""
    for name, value in (("rigs", rigs), ("fleet_legs", fleet_legs), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return 2 * rigs * -(-fleet_legs // workers)


@dataclasses.dataclass(frozen=True, slots=True)
class Seat:
    """One worker's place among `workers`: where it listens for buyers, the shared miner
    socket's descriptor (a child inherits it under the same number) and the token naming the
    workers' inboxes."""

    index: int
    workers: int
    buyer_host: str
    buyer_port: int
    miner_fd: int
    miner_url: str
    token: str

    def inbox(self, index: int) -> str:
        return f"\0engy-gateway-{self.token}-{index}"

    def buyer_socket(self) -> socket.socket:
        """This worker's own listening socket on the buyer port."""
        return _listen(
            self.buyer_host, self.buyer_port, what="buyer API", flag="--port / gateway.port", reuse_port=True
        )


class SharedSockets:
    """The first process's listening sockets: the buyer port's first (the others join it) and the
    miner port's only one, which every worker accepts from."""

    def __init__(self, buyer: socket.socket, miner: socket.socket, *, workers: int) -> None:
        self.buyer: socket.socket | None = buyer
        self.buyer_address: tuple[str, int] = buyer.getsockname()[:2]
        self.miner = miner
        self.workers = workers
        self.token = secrets.token_hex(8)

    @classmethod
    def bind(cls, settings: GatewaySection) -> SharedSockets:
        buyer = _listen(settings.host, settings.port, what="buyer API", flag="--port / gateway.port", reuse_port=True)
        try:
            miner = _listen(
                settings.host, settings.miner_port, what="miner endpoint", flag="--miner-port / gateway.miner_port"
            )
        except BaseException:
            buyer.close()
            raise
        return cls(buyer, miner, workers=settings.workers)

    def take_buyer(self) -> socket.socket:
        """The buyer socket, for the first worker to listen on; closing it is then its business.
        (A socket in the port's group that nobody accepts from would strand connections.)"""
        assert self.buyer is not None, "the buyer socket was taken already"
        buyer, self.buyer = self.buyer, None
        return buyer

    def seat(self, index: int) -> Seat:
        buyer_host, buyer_port = self.buyer_address
        host, port = self.miner.getsockname()[:2]
        return Seat(
            index=index,
            workers=self.workers,
            buyer_host=buyer_host,
            buyer_port=buyer_port,
            miner_fd=self.miner.fileno(),
            miner_url=f"ws://{f'[{host}]' if ':' in host else host}:{port}/gw",
            token=self.token,
        )

    def close(self) -> None:
        if self.buyer is not None:
            self.buyer.close()
        self.miner.close()


def _listen(host: str, port: int, *, what: str, flag: str, reuse_port: bool = False) -> socket.socket:
    try:
        return socket.create_server(
            (host, port),
            family=socket.AF_INET6 if ":" in host else socket.AF_INET,
            backlog=LISTEN_BACKLOG,
            reuse_port=reuse_port,
        )
    except OSError as error:
        raise ConfigError(
            f"cannot listen for the {what} on {host}:{port} ({error.strerror or error}); "
            f"stop whatever uses that port or choose another with {flag}"
        ) from None


def own_copy(fd: int) -> socket.socket:
    """A socket object on a duplicate of `fd`: closing it leaves the shared original open (the
    first process needs the original for workers it starts or restarts later)."""
    return socket.socket(fileno=os.dup(fd))


async def peek_request_line(
    connection: trio.socket.SocketType, *, timeout_s: float, max_bytes: int = REQUEST_LINE_MAX_BYTES
) -> bytes | None:
    """The connection's first line, read without consuming it; None if it closes or stays silent."""
    with trio.move_on_after(timeout_s):
        while True:
            try:
                head = await connection.recv(max_bytes, socket.MSG_PEEK)
            except OSError:
                return None
            if not head:
                return None
            end = head.find(b"\n")
            if end >= 0:
                return head[:end].rstrip(b"\r")
            if len(head) >= max_bytes:
                return head
            await trio.sleep(PEEK_RETRY_S)
    return None


class MinerListener(trio.abc.Listener[trio.SocketStream]):
    """This worker's miner connections: those it accepts that name it (or no worker), and those
    other workers pass to it. `run` must be running for `accept` to yield anything."""

    def __init__(
        self, seat: Seat, *, peek_timeout_s: float = PEEK_TIMEOUT_S, fleet_offset: int = 0, fleet_legs: int = 0
    ) -> None:
        self.seat = seat
        self.peek_timeout_s = peek_timeout_s
        self.fleet_offset = fleet_offset
        self.fleet_legs = fleet_legs
        self._listening = trio.socket.from_stdlib_socket(own_copy(seat.miner_fd))
        self._inbox = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The kernel stamps each datagram with its sender's credentials: only this user's
        # processes (the gateway's own workers) may hand connections in.
        self._inbox.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._outbox.setblocking(False)
        self._accepted_send, self._accepted = trio.open_memory_channel[trio.SocketStream](ACCEPTED_QUEUE)
        self.passed = 0
        """Connections handed to the worker they named."""
        self.received = 0
        """Connections other workers handed to this one."""
        self.refused = 0
        """Connections closed because the worker they named could not take them."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept, route and receive connections until cancelled."""
        try:
            await self._inbox.bind(self.seat.inbox(self.seat.index))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accept_loop, nursery)
                nursery.start_soon(self._inbox_loop)
                task_status.started()
        finally:
            for sock in (self._listening, self._inbox, self._outbox):
                sock.close()
            self._accepted_send.close()
            while True:
                try:
                    stream = self._accepted.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                stream.socket.close()

    async def accept(self) -> trio.SocketStream:
        try:
            return await self._accepted.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("the miner listener stopped") from None

    async def aclose(self) -> None:
        self._accepted.close()
        await trio.lowlevel.checkpoint()

    async def _accept_loop(self, nursery: trio.Nursery) -> None:
        while True:
            try:
                connection, _ = await self._listening.accept()
            except OSError as error:
                if error.errno in ACCEPT_IGNORED_ERRNOS:
                    continue
                if error.errno not in ACCEPT_PAUSE_ERRNOS:
                    raise
                log.error(
                    "cannot accept miner connections (%s); pausing %.0f ms",
                    os.strerror(error.errno),
                    ACCEPT_PAUSE_S * 1000,
                )
                await trio.sleep(ACCEPT_PAUSE_S)
                continue
            nursery.start_soon(self._route, connection)

    async def _route(self, connection: trio.socket.SocketType) -> None:
        try:
            line = await peek_request_line(connection, timeout_s=self.peek_timeout_s)
            if line is None:
                connection.close()
                return
            target = leg_worker(
                line, workers=self.seat.workers, fleet_offset=self.fleet_offset, fleet_legs=self.fleet_legs
            )
            if target is not None and target != self.seat.index:
                # Passed on, or refused: a leg served by the wrong worker would stay there, and
                # the buyers of the worker it names would find no miner. Refused, the miner
                # re-dials (with backoff) until that worker takes it.
                if not await self._pass(connection, target):
                    self.refused += 1
                    await _refuse_leg(connection)
                connection.close()
                return
        except BaseException:
            connection.close()
            raise
        await self._hand_over(connection)

    async def _pass(self, connection: trio.socket.SocketType, target: int) -> bool:
        descriptors = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [connection.fileno()]))]
        # Not trio's sendmsg: an unconnected datagram socket whose receiver's queue is full
        # fails with EAGAIN yet polls writable, so waiting for writability would spin.
        deadline = trio.current_time() + PASS_TIMEOUT_S
        while True:
            try:
                self._outbox.sendmsg([b"c"], descriptors, 0, self.seat.inbox(target))
            except BlockingIOError:
                if trio.current_time() >= deadline:
                    log.warning(
                        "gateway worker %d did not take a miner leg within %.0f s; closed it (the miner re-dials)",
                        target,
                        PASS_TIMEOUT_S,
                    )
                    return False
                await trio.sleep(PASS_RETRY_S)
                continue
            except OSError as error:
                log.info(
                    "gateway worker %d cannot take a miner leg now (%s); closed it (the miner re-dials)",
                    target,
                    error.strerror or error,
                )
                return False
            self.passed += 1
            return True

    async def _inbox_loop(self) -> None:
        item = array.array("i").itemsize
        own_uid = os.getuid()
        while True:
            _, ancillary, _, _ = await self._inbox.recvmsg(
                1, socket.CMSG_SPACE(4 * item) + socket.CMSG_SPACE(struct.calcsize("3i"))
            )
            descriptors, sender_uid = array.array("i"), None
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    descriptors.frombytes(data[: len(data) - len(data) % item])
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    _, sender_uid, _ = struct.unpack("3i", data[: struct.calcsize("3i")])
            for fd in descriptors:
                connection = _stream_socket(fd) if sender_uid == own_uid else None
                if connection is None:
                    if sender_uid != own_uid:
                        os.close(fd)
                    log.warning(
                        "ignored a descriptor handed to gateway worker %d that is not a miner connection "
                        "(sender uid %s)",
                        self.seat.index,
                        sender_uid,
                    )
                    continue
                self.received += 1
                await self._hand_over(connection)

    async def _hand_over(self, connection: trio.socket.SocketType) -> None:
        stream = trio.SocketStream(connection)
        try:
            await self._accepted_send.send(stream)
        except BaseException:
            connection.close()
            raise


def _stream_socket(fd: int) -> trio.socket.SocketType | None:
    """`fd` as a trio socket if it is a connected TCP socket; otherwise None, with `fd` closed."""
    try:
        plain = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None
    if plain.type != socket.SOCK_STREAM or plain.family not in (socket.AF_INET, socket.AF_INET6):
        plain.close()
        return None
    return trio.socket.from_stdlib_socket(plain)


LEG_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-type: application/json\r\n"
    b"content-length: 62\r\nconnection: close\r\n\r\n"
    b'{"error":"this gateway worker is restarting; re-dial shortly"}'
)
"""What a miner hears when the worker its leg names cannot take it: an answer to its handshake,
which its websocket client reports at once. A connection closed mid-handshake without one makes
trio-websocket wait out its whole connect timeout (15 s) before it re-dials."""


async def _refuse_leg(connection: trio.socket.SocketType) -> None:
    with contextlib.suppress(OSError), trio.move_on_after(REFUSAL_SEND_S):
        await connection.send(LEG_REFUSAL)


async def run_worker_process(config: Config, seat: Seat, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run gateway worker `seat.index` as a child process until cancelled, restarting it when it
    dies. Started once the child serves; one that fails before it ever served fails this."""
    document = json.dumps({"config": config_document(config), "seat": dataclasses.asdict(seat)}).encode()
    command = [sys.executable, "-m", "engy_node.gateway"]
    stop = functools.partial(_stop_worker, grace_s=config.gateway.drain_s + WORKER_STOP_MARGIN_S)
    served_before, failures = False, 0
    while True:
        began = trio.current_time()
        async with trio.open_nursery() as nursery:
            # Its own session: a Ctrl-C in the terminal reaches the first process only, which
            # then stops this one (SIGTERM; SIGKILL once its drain and WORKER_STOP_MARGIN_S are past).
            process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    command,
                    stdin=document,
                    stdout=subprocess.PIPE,
                    check=False,
                    pass_fds=(seat.miner_fd,),
                    start_new_session=True,
                    deliver_cancel=stop,
                )
            )
            ready = await _read_ready(process.stdout)
            if not ready:
                if ready is None:
                    log.error(
                        "gateway worker %d did not serve within %.0f s; stopping it", seat.index, WORKER_START_TIMEOUT_S
                    )
                    await stop(process)
                await process.wait()
                if not served_before:
                    raise RoleError(
                        f"gateway worker {seat.index} exited before it served (exit status {process.returncode}); "
                        "its error is logged above"
                    )
            elif not served_before:
                served_before = True
                task_status.started()
            else:
                log.info("gateway worker %d serves again (pid %d)", seat.index, process.pid)
        failures = 1 if trio.current_time() - began >= STABLE_RUN_S else failures + 1
        pause = backoff_delay(consecutive_failures=failures, jitter=random.random(), cap_s=RESTART_CAP_S)
        log.error(
            "gateway worker %d exited (status %s); restarting it in %.1f s", seat.index, process.returncode, pause
        )
        await trio.sleep(pause)


async def _stop_worker(process: trio.Process, *, grace_s: float) -> None:
    process.terminate()
    with trio.move_on_after(grace_s):
        await process.wait()
        return
    log.warning("gateway worker (pid %d) did not stop within %.0f s of SIGTERM; killing it", process.pid, grace_s)
    process.kill()


async def _read_ready(stdout: trio.abc.ReceiveStream) -> bool | None:
    """Whether the child said `ready` (its only output) before closing stdout; None if it said
    nothing for `WORKER_START_TIMEOUT_S`."""
    received = b""
    with trio.move_on_after(WORKER_START_TIMEOUT_S):
        async with stdout:
            while b"\n" not in received:
                chunk = await stdout.receive_some(64)
                if not chunk:
                    return False
                received += chunk
            return received.startswith(b"ready")
    return None
