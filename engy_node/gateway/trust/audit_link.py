"""Audit jobs from every gateway worker process to the first one, which holds the audit queue.

With `gateway.workers` > 1 each worker serves its own buyers and decides which of its responses
to audit (`accountant.Accountant._offer_audit`); the jobs must reach the one queue verifiers lease
from. The proof material is buyer content, so it may not go through the store (docs/reliability.md, "Data"): it
travels over a Unix stream socket in the abstract namespace, named with the gateway's random
per-run token like the workers' inboxes (`workers.Seat`). Only this user's processes can send
on it: the first process checks each connecting peer's credentials (`SO_PEERCRED`).

Frames are a 4-byte big-endian length and the job's JSON (`AuditJob.to_wire`). A worker never
waits on the link while serving: `offer` only queues (bounded; a full queue drops the job and
counts it), and a sender task writes the queue out, reconnecting with backoff when the first
process restarts. A lost job is an unaudited response, which the audit's sampling tolerates.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

import orjson
import trio

from engy_node.gateway.trust.audit_desk import AuditDesk
from engy_node.protocol.audit import AuditJob

log = logging.getLogger("engy.gateway.audit")

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""A job is the prompt and output ids plus the proofs: a few megabytes for the longest context."""
QUEUE_JOBS = 1000
RECONNECT_S = (0.1, 0.5, 1.0, 2.0, 5.0)
_HEADER = struct.Struct(">I")


def link_address(token: str) -> str:
    return f"\0engy-gateway-{token}-audit"


class AuditLinkServer:
    """In the first process: takes jobs from the other workers and offers them to the desk."""

    def __init__(self, token: str, desk: AuditDesk) -> None:
        self.address = link_address(token)
        self.desk = desk
        self.received = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await listener.bind(self.address)
            listener.listen(64)
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    sock, _ = await listener.accept()
                    nursery.start_soon(self._serve, trio.SocketStream(sock))
        finally:
            listener.close()

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            uid = _peer_uid(stream.socket)
            if uid != os.getuid():
                log.warning("refused an audit-link connection from uid %s (not this user's process)", uid)
                return
            buffer = bytearray()
            while True:
                data = await stream.receive_some(1 << 20)
                if not data:
                    return
                buffer += data
                while len(buffer) >= _HEADER.size:
                    (size,) = _HEADER.unpack_from(buffer)
                    if size > MAX_FRAME_BYTES:
                        log.error("audit link: a %d-byte frame is over the limit; dropping the connection", size)
                        return
                    if len(buffer) < _HEADER.size + size:
                        break
                    frame = bytes(buffer[_HEADER.size : _HEADER.size + size])
                    del buffer[: _HEADER.size + size]
                    try:
                        job = AuditJob.from_wire(orjson.loads(frame))
                    except (ValueError, orjson.JSONDecodeError) as error:
                        log.error("audit link: dropped a malformed job (%s)", error)
                        continue
                    self.received += 1
                    self.desk.offer(job)


class AuditLinkClient:
    """In the other workers: `offer` queues a job; `run` sends the queue to the first process."""

    def __init__(self, token: str) -> None:
        self.address = link_address(token)
        self._send, self._receive = trio.open_memory_channel[bytes](QUEUE_JOBS)
        self.dropped = 0

    def offer(self, job: AuditJob) -> None:
        frame = orjson.dumps(job.to_wire())
        try:
            self._send.send_nowait(_HEADER.pack(len(frame)) + frame)
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.warning(
                    "audit link to the first gateway process is backed up; %d audit job(s) dropped so far", self.dropped
                )

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        failures = 0
        pending: bytes | None = None
        while True:
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                await sock.connect(self.address)
            except OSError as error:
                sock.close()
                pause = RECONNECT_S[min(failures, len(RECONNECT_S) - 1)]
                failures += 1
                if failures in (3, 30):
                    log.warning("audit link: cannot reach the first gateway process (%s); retrying", error)
                await trio.sleep(pause)
                continue
            failures = 0
            stream = trio.SocketStream(sock)
            try:
                async with stream:
                    while True:
                        if pending is None:
                            pending = await self._receive.receive()
                        await stream.send_all(pending)
                        pending = None
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                log.info("audit link to the first gateway process lost (%s); reconnecting", type(error).__name__)


def _peer_uid(sock: trio.socket.SocketType) -> int | None:
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid
