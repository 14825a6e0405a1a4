"""The fleet view's link to its nodes: one trio guest run on Textual's loop that watches every node
of a fleet file over its control API, directly or through an SSH tunnel it opens, and keeps the
newest answer of each for the screen to read at its own rate.

Failure posture: a node that does not answer is a row saying why, never an error of the view.
Each node has its own task; a failed attempt (no answer, a refused token, a tunnel that would
not open or closed) is recorded with its reason and the node is dialled again after
`fleet_view.retry_in` (1 s doubling to 30 s, jittered), tunnel and all. A node that answers is
read every `POLL_INTERVAL_S`.

Resource handling: each tunnel is an `ssh -N -L` process run by `trio.run_process` inside the
node task's own nursery, so it lives exactly as long as that attempt: a failed attempt, the
view's quit, and a cancelled drill-in all end it (SIGTERM, then SIGKILL after trio's 5 s). The
wait for its forward to accept is bounded by `TUNNEL_READY_S`; every status read by
`STATUS_TIMEOUT_S`.

Drilling into a node shows the node manager's tabs for it (`NodeManager.show_node`), fed by a
`NodeBridge` attached to the URL this watcher polls. Trio runs one run per thread, and this
watcher's run must keep going (it owns the tunnels), so that bridge is a `HostedBridge`: the
same trio code, run as a task of this guest run instead of a guest run of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import outcome
import trio

from engy_node.control import fetch_status, read_token
from engy_node.errors import EngyError
from engy_node.fleet_view import FleetNode, retry_in, ssh_command
from engy_tui.bridge import GuestRun
from engy_tui.node_bridge import NodeBridge, NodeSnapshot, snapshot_of

POLL_INTERVAL_S = 2.0
"""A fleet row needs no faster refresh; many nodes at 2 s each stay a handful of small GETs a second."""
STATUS_TIMEOUT_S = 5.0
TUNNEL_READY_S = 15.0
"""ssh's own connect and authentication take a few seconds on a slow link; past this the attempt fails."""
TUNNEL_PROBE_S = 0.2
SSH_ERROR_CHARS = 300
"""The end of ssh's stderr a row quotes: its last line is the reason (refused, denied, no route)."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeWatch:
    """What the fleet knows of one node now."""

    node: FleetNode
    snapshot: NodeSnapshot | None = None
    """The newest answer (kept while the node is unreachable, marked not connected)."""
    error: str | None = None
    """Why the last attempt failed; None while the node answers (or before the first attempt)."""
    failures: int = 0
    """Failed attempts in a row."""
    retry_at: float | None = None
    """When the next attempt starts (wall clock), while the node is unreachable."""
    url: str | None = None
    """The URL the watcher reads (the node's own, or the tunnel's local end)."""
    token: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None and self.snapshot is not None and self.snapshot.connected


class FleetBridge(GuestRun):
    """Watches every node of a fleet file; `watches` holds each node's `NodeWatch` by name."""

    def __init__(
        self,
        nodes: Sequence[FleetNode],
        *,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        super().__init__()
        self.nodes = list(nodes)
        self.clock = clock
        self.jitter = jitter
        self.watches: dict[str, NodeWatch] = {node.name: NodeWatch(node) for node in self.nodes}
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        """Where a `HostedBridge` starts its task, and how it gets into this run from the host."""

    def hosted_bridge(self, name: str) -> NodeBridge | None:
        """A node bridge for `name`'s tabs, run inside this guest run; None while it is unreachable."""
        watch = self.watches[name]
        if not watch.up or watch.url is None or watch.token is None:
            return None
        return HostedBridge(self, url=watch.url, token=watch.token)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery, self._token = nursery, trio.lowlevel.current_trio_token()
            for node in self.nodes:
                nursery.start_soon(self._watch, node)

    def _set(self, name: str, **changes: object) -> None:
        self.watches[name] = dataclasses.replace(self.watches[name], **changes)  # type: ignore[arg-type]

    async def _watch(self, node: FleetNode) -> None:
        # A tunnel's local end, kept across attempts so that a node's open tabs keep their URL.
        local_port = _free_port() if node.ssh is not None else 0
        while True:
            try:
                if node.ssh is None:
                    assert node.url is not None
                    await self._poll(node, node.url)
                else:
                    assert node.port is not None
                    async with open_tunnel(node.ssh, local_port=local_port, remote_port=node.port) as url:
                        await self._poll(node, url)
            except EngyError as err:
                failures = self.watches[node.name].failures + 1
                delay = retry_in(failures, jitter=self.jitter())
                previous = self.watches[node.name].snapshot
                self._set(
                    node.name,
                    error=str(err),
                    failures=failures,
                    retry_at=self.clock() + delay,
                    snapshot=dataclasses.replace(previous, connected=False, error=str(err)) if previous else None,
                )
                if isinstance(err, TunnelError) and not err.opened:
                    local_port = _free_port()  # the port may be what failed (taken since it was picked)
                await trio.sleep(delay)

    async def _poll(self, node: FleetNode, url: str) -> None:
        """Read `url` until an attempt fails: raises the `EngyError` that says why."""
        token = node.token if node.token is not None else await trio.to_thread.run_sync(_token_of, node)
        while True:
            body = await trio.to_thread.run_sync(
                functools.partial(fetch_status, url, token, timeout=STATUS_TIMEOUT_S), abandon_on_cancel=True
            )
            snapshot = snapshot_of(body.get("node"), body, taken_at=self.clock(), connected=True)
            self._set(node.name, snapshot=snapshot, error=None, failures=0, retry_at=None, url=url, token=token)
            await trio.sleep(POLL_INTERVAL_S)


def _token_of(node: FleetNode) -> str:
    assert node.token_file is not None
    try:
        return read_token(node.token_file)
    except OSError as err:  # read_token names the missing and unreadable cases; a directory, a bad disk…
        raise EngyError(
            f"cannot read the token file {node.token_file} ({err.strerror or err}); point token_file at a "
            "copy of the node's control.token"
        ) from None


def _free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick), for a tunnel's local end."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class TunnelError(EngyError):
    """The tunnel did not open, or closed; `opened` says whether its forward ever accepted."""

    def __init__(self, message: str, *, opened: bool) -> None:
        super().__init__(message)
        self.opened = opened


@asynccontextmanager
async def open_tunnel(host: str, *, local_port: int, remote_port: int) -> AsyncIterator[str]:
    """Run `ssh -N -L` to `host` for the body's duration and yield the local URL once its forward
    accepts. Raises `TunnelError` quoting ssh when it exits (before or during the body), or when
    the forward does not accept within `TUNNEL_READY_S`. The process ends with the block."""
    command = ssh_command(host, local_port=local_port, remote_port=remote_port)
    exited: list[subprocess.CompletedProcess[bytes]] = []
    opened = False

    async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
        exited.append(
            await trio.run_process(
                command, stdin=subprocess.DEVNULL, capture_stderr=True, check=False, task_status=task_status
            )
        )

    def why() -> str:
        result = exited[0]
        tail = result.stderr.decode(errors="replace").strip()[-SSH_ERROR_CHARS:] or "no message"
        return f"ssh to {host} exited with status {result.returncode}: {tail}"

    failure: EngyError | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        with trio.move_on_after(TUNNEL_READY_S):
            while not exited and not await _accepts(local_port):
                await trio.sleep(TUNNEL_PROBE_S)
            opened = not exited
        if exited:
            failure = TunnelError(why(), opened=False)
        elif not opened:
            failure = TunnelError(
                f"ssh to {host} did not open its forward to port {remote_port} within {TUNNEL_READY_S:g} s; "
                f"check that `ssh {host}` logs in without a prompt",
                opened=False,
            )
        else:
            try:
                yield f"http://127.0.0.1:{local_port}"
            except EngyError as failed:
                # Raised after the nursery: trio would wrap it in an ExceptionGroup here. When ssh
                # has exited, its closing is why the node stopped answering: quote ssh.
                failure = TunnelError(why(), opened=True) if exited else failed
            finally:
                nursery.cancel_scope.cancel("the tunnel's attempt is over")
        nursery.cancel_scope.cancel("the tunnel's attempt is over")
    if failure is not None:
        raise failure


async def _accepts(port: int) -> bool:
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return False
    await stream.aclose()
    return True


class HostedBridge(NodeBridge):
    """A `NodeBridge` attached to a fleet node, whose trio side runs as a task of the fleet's guest
    run. `start` and `stop` keep `GuestRun`'s contract: `stop` cancels and waits for the end."""

    def __init__(self, fleet: FleetBridge, *, url: str, token: str) -> None:
        super().__init__(url=url, token=token)
        self.fleet = fleet

    def start(self, *, on_crash: Callable[[BaseException], None]) -> None:
        if self._done is not None:
            raise RuntimeError("HostedBridge.start() called twice; one bridge runs once")
        done = self._done = asyncio.get_running_loop().create_future()

        def settle(result: outcome.Outcome[None]) -> None:
            if not done.done():
                done.set_result(result)

        async def run() -> None:
            try:
                await self._run()
            except Exception as crashed:  # a bug in the node bridge: report it, keep the fleet watching
                settle(outcome.Error(crashed))
                on_crash(crashed)
            finally:
                settle(outcome.Value(None))  # ended, or the fleet itself is stopping

        def spawn() -> None:  # runs inside the fleet's guest run, where a closed nursery raises
            try:
                assert self.fleet._nursery is not None
                self.fleet._nursery.start_soon(run)
            except RuntimeError:
                settle(outcome.Value(None))

        if self.fleet._token is None or not self.fleet.running:
            settle(outcome.Value(None))
            return
        try:
            self.fleet._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            settle(outcome.Value(None))
