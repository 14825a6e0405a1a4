"""Fault injection for the node's own tests and benchmarks: the ledger's invariants read straight
from the store file, an account of every process a test started, a synthetic miner held at a
chosen point of its answer, and a real filesystem that fills up or turns read-only.

Why it is shaped so. A fault test kills real processes (`kill -9`), so what it checks afterwards
must not trust the process that died: the books are read from the store (file or database) with a read-only
connection of their own and recomputed from the ledger's rows (`read_books`), not asked of the
gateway or of `Ledger.check_books`, whose SQL would then be checking itself. The checks are pure
functions of the rows (`books_problems`), so each invariant is one sentence in the failure.

Chosen points are events, never guessed sleeps: `GatedHandler` holds a synthetic miner's answer
at a named point (before a chunk, before the final response) and sets a `trio.Event` when the
answer reaches it, so a test kills the gateway exactly while a request is held, mid-stream, or
fully relayed but not yet settled.

A full or read-only disk is a real one (`LoopFilesystem`: an ext4 image on a loop device, filled
with a ballast file, or failed through ext4's own `trigger_fs_error`, after which the kernel
remounts it read-only exactly as it does for a failing disk). Mounting needs root; where the
kernel refuses, `FaultUnavailable` says why, so a test can skip with that reason rather than
pretend.

Nothing in the product imports this module.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import sqlite3
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import trio

from engy_node.gateway.store.connection import is_url
from engy_node.miner.serving import Send
from engy_node.protocol.miner import Chunk, MinerFrame, Response, Serve
from engy_node.testing.synthetic_miner import SyntheticHandler

if TYPE_CHECKING:
    import psycopg

# ---- the books -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class AccountRow:
    account_id: int
    available: int
    held: int
    credited: int
    charged: int


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerRow:
    row_id: int
    account_id: int
    kind: str
    amount: int
    request_id: str | None
    hold_id: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRow:
    request_id: str
    account_id: int | None
    kind: str
    status: int
    cost_micro: int


@dataclasses.dataclass(frozen=True, slots=True)
class Books:
    """The store's money as its rows say it is, with every broken invariant as a sentence."""

    accounts: int
    holds: int
    open_holds: tuple[str, ...]
    """Request ids whose hold has no closure yet."""
    charges: int
    """Settle rows with an amount above zero: requests someone paid for."""
    charged_micro: int
    unlogged_charges: tuple[str, ...]
    """Request ids charged in the ledger with no paid request-log row. Not a broken invariant on
    its own: request-log rows are written after the answer, and a process killed in between loses
    the ones still queued (the charge, fsynced first, stands)."""
    problems: tuple[str, ...]

    def assert_sound(self, *, open_holds_allowed: bool = False) -> None:
        """Fail naming every broken invariant (and every open hold, unless they are allowed:
        requests still in flight)."""
        problems = list(self.problems)
        if self.open_holds and not open_holds_allowed:
            problems.append(f"{len(self.open_holds)} hold(s) still open: {', '.join(self.open_holds[:10])}")
        assert not problems, "the books are broken:\n" + "\n".join(problems)


def books_problems(
    accounts: Sequence[AccountRow], ledger: Sequence[LedgerRow], requests: Sequence[RequestRow]
) -> list[str]:
    """Every broken money invariant, one sentence each:

    - per account, credited − charged − held = available, each recomputed from its ledger rows
      and equal to the cached balance the account row keeps;
    - every hold closed at most once, by one settle and one release of its account and request
      whose amounts sum to the hold;
    - one hold per request, and no request charged twice;
    - every paid request-log row with a cost matches its request's charge in the ledger, and no
      request is logged as charged twice.
    """
    problems: list[str] = []
    sums: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for row in ledger:
        sums[row.account_id][row.kind] += row.amount
    for account in accounts:
        total = sums.get(account.account_id, collections.Counter())
        credited, charged = total["credit"] + total["deposit"], total["settle"]
        held = total["hold"] - total["settle"] - total["release"]
        if (account.credited, account.charged, account.held) != (credited, charged, held):
            problems.append(
                f"account {account.account_id}: cached credited/charged/held {account.credited}/{account.charged}/"
                f"{account.held}, the ledger's rows say {credited}/{charged}/{held}"
            )
        if credited - charged - held != account.available:
            problems.append(
                f"account {account.account_id}: credited {credited} − charged {charged} − held {held} is "
                f"{credited - charged - held}, but {account.available} is available"
            )
    known_accounts = {account.account_id for account in accounts}
    for account_id in sorted(set(sums) - known_accounts):
        problems.append(f"ledger rows name account {account_id}, which does not exist")

    holds = {row.row_id: row for row in ledger if row.kind == "hold"}
    closures: dict[int, list[LedgerRow]] = collections.defaultdict(list)
    for row in ledger:
        if row.kind in ("settle", "release"):
            if row.hold_id not in holds:
                problems.append(f"ledger row {row.row_id} ({row.kind}) closes {row.hold_id}, which is not a hold")
                continue
            closures[row.hold_id].append(row)
    holds_per_request = collections.Counter(row.request_id for row in holds.values())
    for request_id, count in holds_per_request.items():
        if count > 1:
            problems.append(f"request {request_id} has {count} holds")
    for hold_id, hold in holds.items():
        rows = closures.get(hold_id, [])
        if not rows:
            continue
        kinds = sorted(row.kind for row in rows)
        if kinds != ["release", "settle"]:
            problems.append(
                f"hold {hold_id} (request {hold.request_id}) is closed by {kinds}, not one settle and one release"
            )
        if sum(row.amount for row in rows) != hold.amount:
            problems.append(
                f"hold {hold_id} (request {hold.request_id}) of {hold.amount} is closed by "
                f"{sum(row.amount for row in rows)}"
            )
        for row in rows:
            if (row.account_id, row.request_id) != (hold.account_id, hold.request_id):
                problems.append(f"ledger row {row.row_id} closes hold {hold_id} for another account or request")
    charges_per_request: collections.Counter[str | None] = collections.Counter()
    charge_of: dict[str | None, int] = {}
    for row in ledger:
        # Counted per settle row, not per hold: a hold settled twice is a request charged twice.
        if row.kind == "settle" and row.amount > 0:
            charges_per_request[row.request_id] += 1
            charge_of[row.request_id] = charge_of.get(row.request_id, 0) + row.amount
    for request_id, count in charges_per_request.items():
        if count > 1:
            problems.append(f"request {request_id} was charged {count} times")

    logged_costs: dict[str, list[RequestRow]] = collections.defaultdict(list)
    for request in requests:
        if request.kind == "paid" and request.cost_micro > 0:
            logged_costs[request.request_id].append(request)
    for request_id, paid in logged_costs.items():
        if len(paid) > 1:
            problems.append(f"request {request_id} is logged as charged {len(paid)} times")
        charged = charge_of.get(request_id, 0)
        if paid[0].cost_micro != charged:
            problems.append(
                f"request {request_id} is logged as costing {paid[0].cost_micro} µUSD, the ledger charged {charged}"
            )
    return problems


def read_books(path: str | os.PathLike[str]) -> Books:
    """The books of the store at `path` (an SQLite file, or a PostgreSQL URL), read through a
    read-only connection of its own (which cannot checkpoint or change the file a restarted
    gateway will recover from), in one snapshot."""
    conn: sqlite3.Connection | psycopg.Connection
    if is_url(path):
        from engy_node.gateway.store.postgres import connect_raw

        conn = connect_raw(str(path))
        begin = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
    else:
        conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=10.0)
        begin = "BEGIN"
    try:
        conn.execute(begin)
        accounts = [
            AccountRow(*row) for row in conn.execute("SELECT id, available, held, credited, charged FROM accounts")
        ]
        ledger = [
            LedgerRow(*row)
            for row in conn.execute("SELECT id, account_id, kind, amount, request_id, hold_id FROM ledger ORDER BY id")
        ]
        requests = [
            RequestRow(*row)
            for row in conn.execute(
                "SELECT request_id, account_id, kind, status, cost_micro FROM request_log ORDER BY id"
            )
        ]
        conn.execute("COMMIT")
    finally:
        conn.close()
    closed = {row.hold_id for row in ledger if row.hold_id is not None}
    open_holds = tuple(row.request_id or "" for row in ledger if row.kind == "hold" and row.row_id not in closed)
    settles = [row for row in ledger if row.kind == "settle" and row.amount > 0]
    logged = {row.request_id for row in requests if row.kind == "paid" and row.cost_micro > 0}
    return Books(
        accounts=len(accounts),
        holds=sum(row.kind == "hold" for row in ledger),
        open_holds=open_holds,
        charges=len(settles),
        charged_micro=sum(row.amount for row in settles),
        unlogged_charges=tuple(row.request_id or "" for row in settles if row.request_id not in logged),
        problems=tuple(books_problems(accounts, ledger, requests)),
    )


def check_books(path: str | os.PathLike[str], *, open_holds_allowed: bool = False) -> Books:
    """`read_books`, failing on any broken invariant: the one check every fault test runs."""
    books = read_books(path)
    books.assert_sound(open_holds_allowed=open_holds_allowed)
    return books


@dataclasses.dataclass(frozen=True, slots=True)
class HoldRow:
    request_id: str
    amount: int
    charged: int | None
    """None while the hold is open."""
    released: int | None


def holds_of(path: str | os.PathLike[str], account_id: int) -> list[HoldRow]:
    """Every hold of one account, oldest first, with how each was closed."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=10.0)
    try:
        rows = conn.execute(
            "SELECT h.request_id, h.amount, "
            "(SELECT amount FROM ledger s WHERE s.hold_id = h.id AND s.kind = 'settle'), "
            "(SELECT amount FROM ledger r WHERE r.hold_id = h.id AND r.kind = 'release') "
            "FROM ledger h WHERE h.kind = 'hold' AND h.account_id = ? ORDER BY h.id",
            (account_id,),
        ).fetchall()
    finally:
        conn.close()
    return [HoldRow(*row) for row in rows]


def account_row(path: str | os.PathLike[str], account_id: int) -> AccountRow:
    """One account's cached balance, read without writing (a `Store` cannot even open a store
    on a full or read-only disk: opening checks the schema in a write transaction)."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=10.0)
    try:
        row = conn.execute(
            "SELECT id, available, held, credited, charged FROM accounts WHERE id = ?", (account_id,)
        ).fetchone()
    finally:
        conn.close()
    assert row is not None, f"no account {account_id} in {path}"
    return AccountRow(*row)


# ---- processes -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Seen:
    pid: int
    created: float
    command: str


class ProcessAccount:
    """Every process a test started and everything they started, so that at its end the test can
    show that none is left and no port they listened on still listens.

    A process killed outright cannot stop its children, and they are then re-parented away from
    its tree, so the tree is walked whenever the test says (`note`), before each fault; anything
    whose command line names the test's `marker` (its temporary home) is counted as well. A
    process is recognised by pid and start time together, so a reused pid is never taken for it.
    """

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = str(marker)
        self._seen: dict[tuple[int, float], _Seen] = {}
        self.ports: set[int] = set()

    def note(self, *pids: int) -> None:
        """Remember these processes, their descendants and the ports they all listen on now."""
        for pid in pids:
            try:
                root = psutil.Process(pid)
                family = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in family:
                self._remember(process)

    def note_marked(self) -> None:
        """Remember every live process whose command line names the marker."""
        for process in self._marked():
            self._remember(process)

    def _remember(self, process: psutil.Process) -> None:
        try:
            with process.oneshot():
                seen = _Seen(process.pid, process.create_time(), " ".join(process.cmdline())[:300])
                ports = {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            return
        self._seen[(seen.pid, seen.created)] = seen
        self.ports |= ports

    def _marked(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            try:
                if process.pid != os.getpid() and self.marker in " ".join(process.info["cmdline"] or ()):
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def alive(self) -> list[str]:
        """Each remembered or marked process still running (zombies are dead), described."""
        left = []
        candidates = {(seen.pid, seen.created): seen for seen in self._seen.values()}
        for process in self._marked():
            try:
                candidates.setdefault(
                    (process.pid, process.create_time()),
                    _Seen(process.pid, process.create_time(), " ".join(process.cmdline())[:300]),
                )
            except psutil.Error:
                continue
        for seen in candidates.values():
            try:
                process = psutil.Process(seen.pid)
                if process.create_time() != seen.created or process.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            left.append(f"pid {seen.pid}: {seen.command}")
        return left

    def listening(self) -> list[int]:
        """The remembered ports something listens on still."""
        listening = {c.laddr.port for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        return sorted(self.ports & listening)


# ---- a synthetic miner held at a chosen point ------------------------------------------------------


@dataclasses.dataclass
class Gate:
    """Where one answer stops until released: before chunk frame `before_chunk` (0: before the
    first), or before the final response (`before_response`). `reached` is set when the answer
    gets there; `release` lets it go on. An answer never released stalls there, which is also
    how a miner that stalls after its first chunk looks from the gateway (its leg stays alive)."""

    before_chunk: int | None = None
    before_response: bool = False
    reached: trio.Event = dataclasses.field(default_factory=trio.Event)
    released: trio.Event = dataclasses.field(default_factory=trio.Event)
    chunks_sent: int = 0
    cancelled: trio.Event = dataclasses.field(default_factory=trio.Event)
    """Set when the gateway cancelled the answer while it was held (the buyer hung up)."""

    def release(self) -> None:
        self.released.set()

    async def wait_here(self) -> None:
        self.reached.set()
        try:
            await self.released.wait()
        except trio.Cancelled:
            self.cancelled.set()
            raise


class GatedHandler:
    """A `SyntheticHandler` whose answers pass through the `Gate` that `gate_for` gives each
    request (None: not held). Chunk frames are counted as sent, so a script for a gated answer
    should not coalesce (`Script.coalesce_s = 0`), or the count would depend on timing."""

    def __init__(self, inner: SyntheticHandler, gate_for: Callable[[Serve], Gate | None]) -> None:
        self.inner = inner
        self.gate_for = gate_for
        self.gates: dict[str, Gate] = {}
        """Each gated request's gate, by the gateway's request id."""
        self.served: list[Serve] = []
        """Every request routed here, in arrival order."""
        self._arrived = trio.Event()

    async def wait_served(self, count: int, *, timeout_s: float) -> None:
        """Until `count` requests have reached this miner."""
        with trio.fail_after(timeout_s):
            while len(self.served) < count:
                await self._arrived.wait()

    async def handle(self, frame: Serve, send: Send) -> None:
        self.served.append(frame)
        self._arrived.set()
        self._arrived = trio.Event()
        gate = self.gate_for(frame)
        if gate is None:
            await self.inner.handle(frame, send)
            return
        self.gates[frame.request.engy_request_id] = gate

        async def gated_send(message: MinerFrame) -> None:
            if isinstance(message, Chunk):
                if gate.before_chunk is not None and gate.chunks_sent == gate.before_chunk:
                    await gate.wait_here()
                gate.chunks_sent += 1
            elif isinstance(message, Response) and gate.before_response:
                await gate.wait_here()
            await send(message)

        try:
            await self.inner.handle(frame, gated_send)
        except trio.Cancelled:
            gate.cancelled.set()
            raise


# ---- a real filesystem that fills up or fails --------------------------------------------------------


class FaultUnavailable(Exception):
    """This machine cannot inject the fault (no root, no loop devices); the message says why."""


BALLAST_NAME = "ballast.fill"


class LoopFilesystem:
    """A small ext4 filesystem on a loop device, mounted at `mount_point`: a disk the test can
    fill (`fill`, `drain`) or fail (`fail_read_only`: ext4 records an error and, mounted with
    `errors=remount-ro`, the kernel turns it read-only under every open file, as a failing disk
    does), then check and remount (`repair`). Use it as a context manager; leaving unmounts it.
    Root only: `FaultUnavailable` otherwise."""

    def __init__(self, image: Path, mount_point: Path, *, size_mib: int = 64) -> None:
        self.image = image
        self.mount_point = mount_point
        self.size_mib = size_mib
        self.device: str | None = None

    def __enter__(self) -> LoopFilesystem:
        if os.geteuid() != 0:
            raise FaultUnavailable("mounting a test filesystem needs root (CI runs as root)")
        self.image.parent.mkdir(parents=True, exist_ok=True)
        with self.image.open("wb") as image:
            image.truncate(self.size_mib * 1024 * 1024)
        # -m 0: no blocks reserved for root, or a gateway running as root would write on past "full".
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)], what="make the test filesystem")
        self.mount_point.mkdir(parents=True, exist_ok=True)
        self._mount()
        return self

    def _mount(self) -> None:
        _run(
            ["mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.mount_point)],
            what="mount the test filesystem",
        )
        self.device = _loop_device(self.mount_point)

    def __exit__(self, *exc_info: object) -> None:
        if self.device is not None:
            # Lazily: a test that failed may leave a process holding a file open; the kernel
            # then detaches the mount once it is gone. The loop device goes with the mount.
            subprocess.run(["umount", "-l", str(self.mount_point)], capture_output=True, timeout=30)
            self.device = None
        self.image.unlink(missing_ok=True)

    def fill(self) -> int:
        """Write a ballast file until the disk refuses (ENOSPC); returns its size in bytes."""
        written = 0
        fd = os.open(self.mount_point / BALLAST_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # Large blocks first, then ever smaller ones: a disk with any room left is not full.
            for size in (1024 * 1024, 65536, 4096, 512, 1):
                block = b"\0" * size
                for _ in range(self.size_mib * 1024 * 1024 // size + 1):
                    try:
                        written += os.write(fd, block)
                        os.fsync(fd)
                    except OSError:
                        break
        finally:
            os.close(fd)
        return written

    def drain(self) -> None:
        """Delete the ballast: the disk has room again."""
        (self.mount_point / BALLAST_NAME).unlink(missing_ok=True)

    def fail_read_only(self, reason: str = "fault injected by a test") -> None:
        """Record a filesystem error; the kernel remounts the disk read-only at once."""
        if self.device is None:
            raise RuntimeError("the test filesystem is not mounted")
        trigger = Path("/sys/fs/ext4") / Path(self.device).name / "trigger_fs_error"
        if not trigger.exists():
            raise FaultUnavailable(f"this kernel's ext4 has no {trigger}; it cannot fail a disk on purpose")
        trigger.write_text(reason + "\n")

    def read_only(self) -> bool:
        """Whether the disk refuses writes as read-only (EROFS). Asked by writing, not by
        `statvfs`: ext4's emergency read-only state is not a mount flag on every kernel."""
        probe = self.mount_point / ".write-probe"
        try:
            probe.write_bytes(b"probe")
        except OSError as error:
            return error.errno == errno.EROFS
        probe.unlink()
        return False

    def repair(self) -> None:
        """Unmount, check and fix the filesystem (e2fsck, as an operator would) and mount it again.
        Every process with a file open on it must have exited."""
        _run(["umount", str(self.mount_point)], what="unmount the test filesystem")
        self.device = None
        # e2fsck exits 1 when it fixed something, which after an injected error it must.
        result = subprocess.run(["e2fsck", "-f", "-y", str(self.image)], capture_output=True, text=True, timeout=60)
        if result.returncode not in (0, 1):
            raise RuntimeError(
                f"e2fsck could not repair the test filesystem (exit {result.returncode}): {result.stdout}{result.stderr}"
            )
        self._mount()


def _run(argv: list[str], *, what: str) -> None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as error:
        raise FaultUnavailable(f"cannot {what}: {argv[0]} is not installed ({error})") from None
    if result.returncode != 0:
        raise FaultUnavailable(f"cannot {what}: {' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")


def _loop_device(mount_point: Path) -> str:
    target = os.path.realpath(mount_point)
    for partition in psutil.disk_partitions(all=True):
        if os.path.realpath(partition.mountpoint) == target:
            return partition.device
    raise FaultUnavailable(f"mounted {mount_point} but cannot find its device")
