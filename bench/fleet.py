"""A gateway fleet under a thousand miners: the admission storm, buyer load through the balancer
with prefix affinity against an oracle, and one host killed in the middle of it.

    .venv/bin/python bench/fleet.py [--miners 1000] [--seconds 60] [--buyers 32] [--miner-processes 4] [--slots 4]
                                    [--prefixes 500] [--zipf 1.0] [--lru 16] [--kill leader|follower] [--lease-s 6]
                                    [--idle-seconds 5] [--seed 0] [--check-timeout-ms MS] [--json PATH] [--logs DIR]

What runs, all on loopback and all started and stopped here: a throwaway PostgreSQL cluster
(`engy_node.testing.postgres`), two `engy-node --role gateway` hosts sharing it
(`gateway.store_url`, `gateway.fleet_legs = 2`, one leg each by `gateway.fleet_offset`, one
worker each), Debian's HAProxy with the configuration `load_balancer.haproxy_config` writes,
`--miners` synthetic miners on the real websocket link (`bench/fleet_miners.py`, spread over
`--miner-processes` processes with a trio loop each; every miner dials both legs through the
balancer, so each host's pool holds every miner), and `--buyers` closed-loop buyers in this
process on lean keep-alive HTTP/1.1 connections through the balancer (`gateway_overhead`'s
client, so the load generator costs little of the two cores it shares with everything else).

Phases, each measured on its own:

1. **Admission storm.** Every miner process is loaded first; then all links start dialling at
   once. Timed from that moment until every leg is admitted, as the miners see it (each leg's
   `admit`) and as the gateways log it (each host's last "admitted" record), with the CPU each
   process group used meanwhile (psutil: mean and peak over 0.5 s samples), the dials that
   failed (the links' own log lines, by error), the balancer's health checks that took a
   server down and how long a backend had no server at all (HAProxy's output, stamped as it
   is read), and each host's pool afterwards (its control API's `/v1/status`).
2. **Idle.** `--idle-seconds` with every miner connected and no buyer: what a thousand idle
   miners (heartbeats, the pools' bookkeeping) cost each host.
3. **Traffic**, `--seconds`: each buyer sends streamed chat completions back to back. Each
   request continues one of `--prefixes` conversations (drawn per request, Zipf-distributed
   with exponent `--zipf`, seeded: a few conversations are hot, most are not), whose system
   prompt and first user turn are long enough to get a routing key (`router.prefix_key`, over
   `MIN_USEFUL_PREFIX_CHARS`), followed by a turn of its own. Each miner answers with its own
   index, so the buyer knows who served it; the balancer adds which host relayed it (an
   `x-fleet-host` response header, the one line this benchmark adds to the product's HAProxy
   configuration; `--check-timeout-ms` adds a second, as an experiment). Halfway through, one
   host (`--kill`: the lease's leader by default) is killed with SIGKILL.

What is reported: requests/s; time to the first content event (TTFT) p50/p99 through the fleet,
the synthetic miner's own time to its first chunk, and the difference (what the fleet adds:
balancer, gateway, store, relay); requests served per miner (max, mean); the prefix-affinity hit
rate per host, before and after the kill, and overall. A request is a hit when the miner that
served it had served its conversation before and still holds it: each miner is modelled as an
LRU cache of `--lru` conversations. The oracle is the same caches under a router that knows all
of them: the same requests at the same times, each sent to a miner holding its conversation
whenever one has a free slot (`--slots` per miner), else to the next miner with room (a miss).
Every conversation's first request misses under both. The hosts route independently; a
conversation's home miner is the same on both only if their routers agree on it, which the
"same home on both hosts" figure checks. Then the failover: legs lost, time until every leg is
back (re-dialled through the balancer to the survivor), the survivor taking the leader lease,
the buyers' failures (only requests in flight on the killed host may fail; each one's fate in
the ledger, found by the stream's request id) and, after the survivor has been stopped cleanly,
the books of the shared store (`faults.check_books`: every invariant must hold; holds of the
killed host's requests in flight stay open, and are counted).

The tables are Markdown, followed by the command line, the machine and the commit. Everything
binds 127.0.0.1; every process and directory made here is removed here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import psutil
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import READY, KeepAliveClient, describe, percentile  # noqa: E402

MODEL = "smollm2-135m"
HOST_NAMES = ("gw-a", "gw-b")
HAPROXY = "/usr/sbin/haproxy"
HOST_HEADER = b"x-fleet-host"
REPLY = re.compile(rb'"content":"\[m(\d+)\]')
"""The first content event of a fleet miner's answer: `[m<index>] ...` (`fleet_miners.answer_text`)."""
STREAM_ID = re.compile(rb'"id":"chatcmpl-(\w+)"')
FINISHED = b'"finish_reason":"stop"'
"""In the last event of a whole answer: a stream cut short by a dying host lacks it."""
READY_WAIT_S = 180.0
STORM_TIMEOUT_S = 300.0
RECOVERY_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0
"""Longest a buyer's request may take before it counts as failed."""
RECONNECT_PAUSE_S = 0.05
"""After a failed request, before the buyer dials again: a refused connection fails at once."""
STOP_WAIT_S = 60.0
CPU_SAMPLE_S = 0.5
MIN_PEAK_SPAN_S = 0.2
ADMITTED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*engy\.gateway\.pool: admitted key:", re.M)
CONTROL = re.compile(r"control API on (http://127\.0\.0\.1:\d+);")
LEADS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*this host leads the gateway fleet", re.M)
SYSTEM_WORDS = (
    "cache",
    "prefix",
    "miner",
    "gateway",
    "token",
    "stream",
    "ledger",
    "epoch",
    "route",
    "fleet",
    "answer",
    "buyer",
    "lease",
    "proof",
    "verify",
    "shard",
    "queue",
    "slot",
    "latency",
    "budget",
)


# ---- the workload -------------------------------------------------------------------------------
def conversations(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` conversation heads (system prompt, first user turn), seeded, each rendering well
    over `MIN_USEFUL_PREFIX_CHARS` so that every request gets a routing key, and all distinct."""
    rng = random.Random(seed)
    heads = []
    for number in range(count):
        system = f"You are assistant {number} of the fleet benchmark. " + " ".join(
            rng.choice(SYSTEM_WORDS) for _ in range(48)
        )
        first = f"Conversation {number}: " + " ".join(rng.choice(SYSTEM_WORDS) for _ in range(16)) + "?"
        heads.append((system, first))
    return heads


def messages_of(head: tuple[str, str], *, buyer: int, turn: int) -> list[dict]:
    system, first = head
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": first},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": f"Follow-up {turn} from buyer {buyer}."},
    ]


def check_keys(heads: Sequence[tuple[str, str]]) -> None:
    """Every conversation has a routing key of its own, and its turns keep it."""
    from engy_node.gateway.routing.router import prefix_key

    keys = [prefix_key(messages=messages_of(head, buyer=0, turn=0)) for head in heads]
    if None in keys or len(set(keys)) != len(keys):
        raise SystemExit("the benchmark's conversations must each have a distinct routing key; lengthen their heads")
    if any(prefix_key(messages=messages_of(head, buyer=7, turn=9)) != key for head, key in zip(heads, keys)):
        raise SystemExit("a conversation's routing key changed with its later turns")


def zipf_cum_weights(count: int, exponent: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (rank + 1) ** exponent for rank in range(count)))


def chat_request(host: str, port: int, key: str, messages: list[dict]) -> bytes:
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 64, "stream": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclasses.dataclass(slots=True)
class Sample:
    """One buyer request: which conversation, when, how it ended, who relayed and served it."""

    buyer: int
    prefix: int
    started: float
    ended: float = 0.0
    ttft: float | None = None
    status: int | None = None
    host: str | None = None
    miner: int | None = None
    request_id: str | None = None
    """The gateway's id for it (the stream's `chatcmpl-<id>`), where a response began."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.miner is not None and not self.error


# ---- the analysis (pure) ------------------------------------------------------------------------
def touch(cache: collections.OrderedDict, prefix: int, size: int) -> int | None:
    """Use `prefix` in an LRU cache of `size`; returns the prefix it evicted, if any."""
    cache[prefix] = None
    cache.move_to_end(prefix)
    if len(cache) > size:
        return cache.popitem(last=False)[0]
    return None


def served_hits(samples: Sequence[Sample], *, lru: int) -> list[bool]:
    """For each sample (answered ones, in order of start): did the miner that served it hold
    its conversation in its LRU of `lru` conversations."""
    caches: dict[int, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
    hits = []
    for sample in samples:
        cache = caches[sample.miner]
        hits.append(sample.prefix in cache)
        touch(cache, sample.prefix, lru)
    return hits


def oracle_hits(samples: Sequence[Sample], *, miners: Sequence[int], slots: int, lru: int) -> list[bool]:
    """The same requests, at the same start and end times, under a router that knows every
    miner's LRU: each goes to a miner holding its conversation whenever one has a free slot
    (the least loaded such, then the lowest index), else to the next miner with room in turn.
    Returns a hit per sample, in the samples' order."""
    events = sorted(
        [(s.started, 1, i) for i, s in enumerate(samples)] + [(s.ended, 0, i) for i, s in enumerate(samples)]
    )
    caches: dict[int, collections.OrderedDict] = {miner: collections.OrderedDict() for miner in miners}
    holders: dict[int, set[int]] = collections.defaultdict(set)
    inflight = dict.fromkeys(miners, 0)
    assigned: dict[int, int] = {}
    order = list(miners)
    cursor = 0
    hits = [False] * len(samples)
    for _, starting, index in events:
        if not starting:
            inflight[assigned.pop(index)] -= 1
            continue
        prefix = samples[index].prefix
        room = [miner for miner in holders[prefix] if inflight[miner] < slots]
        if room:
            miner = min(room, key=lambda m: (inflight[m], m))
            hits[index] = True
        else:
            for step in range(len(order)):
                if inflight[order[(cursor + step) % len(order)]] < slots:
                    cursor = (cursor + step) % len(order)
                    break
            else:
                cursor = min(range(len(order)), key=lambda position: (inflight[order[position]], position))
            miner, cursor = order[cursor], (cursor + 1) % len(order)
        evicted = touch(caches[miner], prefix, lru)
        holders[prefix].add(miner)
        if evicted is not None:
            holders[evicted].discard(miner)
        inflight[miner] += 1
        assigned[index] = miner
    return hits


def affinity_rows(
    samples: Sequence[Sample], hits: Sequence[bool], oracle: Sequence[bool], *, kill_at: float
) -> list[dict]:
    """Hit rates per host and phase (before / after the kill), then per phase and overall."""
    groups: dict[tuple[str, str], list[tuple[bool, bool]]] = collections.defaultdict(list)
    for sample, hit, best in zip(samples, hits, oracle):
        phase = "before the kill" if sample.started < kill_at else "after the kill"
        for key in ((sample.host or "?", phase), ("both hosts", phase), ("both hosts", "whole run")):
            groups[key].append((hit, best))
    order = {"before the kill": 0, "after the kill": 1, "whole run": 2}
    rows = []
    for (host, phase), pairs in sorted(
        groups.items(), key=lambda item: (order[item[0][1]], item[0][0] == "both hosts", item[0][0])
    ):
        rows.append(
            {
                "host": host,
                "phase": phase,
                "requests": len(pairs),
                "hit_rate": sum(h for h, _ in pairs) / len(pairs),
                "oracle_hit_rate": sum(b for _, b in pairs) / len(pairs),
            }
        )
    return rows


def home_agreement(samples: Sequence[Sample], *, kill_at: float) -> tuple[int, int]:
    """Of the conversations both hosts served before the kill, how many each host sent mostly
    to the same miner: (agreeing, both served)."""
    per_host: dict[str, dict[int, collections.Counter]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter)
    )
    for sample in samples:
        if sample.started < kill_at and sample.host is not None:
            per_host[sample.host][sample.prefix][sample.miner] += 1
    if len(per_host) < 2:
        return 0, 0
    first, second = (per_host[host] for host in sorted(per_host)[:2])
    shared = set(first) & set(second)
    agreeing = sum(first[p].most_common(1)[0][0] == second[p].most_common(1)[0][0] for p in shared)
    return agreeing, len(shared)


def legs_back_at(events: Sequence[dict], *, expected: int, since: float) -> float | None:
    """When a miner process had every leg admitted again after losing at least one at or after
    `since` (its reports: `{"t", "legs", "drops", "ups"}`, in order); None if it never did."""
    before = [event for event in events if event["t"] < since]
    drops_then = before[-1]["drops"] if before else 0
    for event in events:
        if event["t"] >= since and event["drops"] > drops_then and event["legs"] == expected:
            return event["t"]
    return None


def first_full_at(events: Sequence[dict], *, expected: int) -> float | None:
    return next((event["t"] for event in events if event["legs"] == expected), None)


def quantiles_ms(values: Sequence[float]) -> tuple[float, float] | None:
    ordered = sorted(values)
    return (percentile(ordered, 50) * 1000, percentile(ordered, 99) * 1000) if ordered else None


def log_time(stamp: str) -> float:
    """A log record's time (local wall clock, milliseconds) as unix seconds."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


LEG_LOST = re.compile(r"^leg \S+ lost \((\w+): ?(\(\d{3})?", re.M)
META_FAILED = re.compile(r"^cannot read \S+ \((\w+): (?:Server error '(\d{3}))?", re.M)
BALANCER_STATE = re.compile(
    r"^\[WARNING\] +\(\d+\) : (?:Backup )?Server ([\w.-]+)/([\w.-]+) is (DOWN|UP), reason: ([^,]+).*?"
    r"(\d+) active and (\d+) backup servers (?:left|online)"
)


def dial_failures(scratch: Path) -> dict[str, int]:
    """What the miner processes' links logged so far: legs lost or refused, by error (a status
    the balancer answered the handshake with), and `/gw/meta` reads that failed."""
    counts: collections.Counter[str] = collections.Counter()
    for path in scratch.glob("miners-*.log"):
        text = path.read_text(errors="replace")
        for kind, status in LEG_LOST.findall(text):
            counts[f"leg: {kind}" + (f" {status.lstrip('(')}" if status else "")] += 1
        for kind, status in META_FAILED.findall(text):
            counts[f"/gw/meta: {kind}" + (f" {status}" if status else "")] += 1
    return dict(counts)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckEvent:
    """HAProxy's health checks taking a server of a backend down or bringing it back."""

    at: float
    backend: str
    server: str
    up: bool
    reason: str
    serving: int
    """Servers of the backend serving after it (active and backup)."""


def check_events(lines: Sequence[tuple[float, str]]) -> list[CheckEvent]:
    events = []
    for at, line in lines:
        if (found := BALANCER_STATE.match(line)) is not None:
            backend, server, state, reason, active, backup = found.groups()
            events.append(CheckEvent(at, backend, server, state == "UP", reason.strip(), int(active) + int(backup)))
    return events


def checks_between(events: Sequence[CheckEvent], start: float, end: float) -> dict:
    """Servers taken down in [start, end] (by backend, server and reason), and for each backend
    the seconds within it during which none of its servers was serving (the balancer answered
    503 for it)."""
    downs = collections.Counter(
        f"{e.backend}/{e.server} ({e.reason})" for e in events if start <= e.at <= end and not e.up
    )
    outage: dict[str, float] = collections.defaultdict(float)
    for backend in {e.backend for e in events}:
        since = None
        for event in (e for e in events if e.backend == backend):
            if event.serving == 0 and since is None:
                since = event.at
            elif event.serving > 0 and since is not None:
                outage[backend] += max(0.0, min(event.at, end) - max(since, start))
                since = None
        if since is not None:
            outage[backend] += max(0.0, end - max(since, start))
    return {
        "downs": dict(downs),
        "no_server_s": {backend: seconds for backend, seconds in outage.items() if seconds > 0},
    }


class BalancerLog:
    """HAProxy's output, read by a thread as it comes and stamped with `time.monotonic()` (its
    log lines carry no time of their own), and written to its log file as well."""

    def __init__(self, process: subprocess.Popen, path: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(process, path), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen, path: Path) -> None:
        with path.open("w") as log:
            for line in process.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                log.write(line)
                log.flush()

    def events(self) -> list[CheckEvent]:
        return check_events(list(self.lines))


def request_fates(url: str, request_ids: Sequence[str]) -> dict[str, str]:
    """What the ledger holds for each request id: charged, released (closed at no charge), hold
    open, or no hold."""
    from engy_node.gateway.store.postgres import connect_raw

    kinds: dict[str, set[tuple[str, bool]]] = collections.defaultdict(set)
    conn = connect_raw(url)
    try:
        for request_id, kind, amount in conn.execute(
            "SELECT request_id, kind, amount FROM ledger WHERE request_id = ANY(%s)", (list(request_ids),)
        ):
            kinds[request_id].add((kind, amount > 0))
    finally:
        conn.close()
    fates = {}
    for request_id in request_ids:
        rows = kinds.get(request_id, set())
        if ("settle", True) in rows:
            fates[request_id] = "charged"
        elif any(kind == "settle" for kind, _ in rows):
            fates[request_id] = "closed at no charge"
        elif any(kind == "hold" for kind, _ in rows):
            fates[request_id] = "hold still open"
        else:
            fates[request_id] = "no hold"
    return fates


# ---- processes ----------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_process(process: subprocess.Popen, *, signal_number: int = signal.SIGTERM) -> int | None:
    """Signal, wait up to `STOP_WAIT_S`, then SIGKILL it and the children it leaves."""
    if process.poll() is not None:
        return process.returncode
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    process.send_signal(signal_number)
    try:
        return process.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        print(f"pid {process.pid} did not stop within {STOP_WAIT_S:g} s; killing it", file=sys.stderr)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        process.kill()
        return process.wait(STOP_WAIT_S)


@dataclasses.dataclass
class Host:
    """One gateway host of the fleet: its home, ports, process and log."""

    name: str
    home: Path
    offset: int
    buyer_port: int = dataclasses.field(default_factory=free_port)
    miner_port: int = dataclasses.field(default_factory=free_port)
    provider_port: int = dataclasses.field(default_factory=free_port)
    process: subprocess.Popen | None = None
    killed_at: float | None = None

    @property
    def log_path(self) -> Path:
        return self.home / "gateway.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, store_url: str, *, legs: int, lease_s: float) -> None:
        settings = {
            "port": self.buyer_port,
            "miner_port": self.miner_port,
            "provider_port": self.provider_port,
            "store_url": store_url,
            "fleet_legs": legs,
            "fleet_offset": self.offset,
            "workers": 1,
            "host_name": self.name,
            "leader_lease_s": lease_s,
            "qualification": "false",
            "drain_s": 5,
        }
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **{f"ENGY_GATEWAY__{k.upper()}": str(v) for k, v in settings.items()},
        }
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "engy_node", "--home", str(self.home), "--role", "gateway"],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_WAIT_S
        while not READY.search(self.log()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"gateway host {self.name} did not start; its log:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def fleet_host(self, legs: int):
        from engy_node.gateway.fleet.load_balancer import FleetHost

        return FleetHost(
            name=self.name,
            address="127.0.0.1",
            buyer_port=self.buyer_port,
            miner_port=self.miner_port,
            first_leg=self.offset,
            legs=legs,
        )

    def kill(self) -> float:
        self.killed_at = time.monotonic()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        return self.killed_at

    def pool_legs(self) -> int | None:
        """Legs in this host's pool as its control API last published them (the pool's snapshot,
        refreshed every 10 s by the gateway's stale-leg sweep); None if it cannot be read."""
        found = CONTROL.search(self.log())
        if found is None:
            return None
        token = (self.home / "data" / "control.token").read_text().strip()
        try:
            status = httpx.get(
                f"{found.group(1)}/v1/status", headers={"authorization": f"Bearer {token}"}, timeout=5
            ).json()
        except (httpx.HTTPError, ValueError):
            return None
        legs = status.get("states", {}).get("gateway", {}).get("legs")
        return len(legs) if isinstance(legs, list) else None

    def admissions(self) -> list[float]:
        return [log_time(stamp) for stamp in ADMITTED.findall(self.log())]

    def leadership_claims(self) -> list[float]:
        return [log_time(stamp) for stamp in LEADS.findall(self.log())]


def balancer_config(hosts: Sequence[Host], *, buyer_port: int, miner_port: int, check_timeout_ms: int | None) -> str:
    """The product's HAProxy configuration for these hosts, plus one line: every buyer response
    names the host that relayed it (HAProxy's `%s`, the server), which is how this benchmark
    attributes requests to hosts. With `check_timeout_ms` (an experiment, not the product's
    configuration), health checks wait that long for an answer instead of their interval."""
    from engy_node.gateway.fleet.load_balancer import haproxy_config

    text = haproxy_config(
        [host.fleet_host(1) for host in hosts], bind="127.0.0.1", buyer_port=buyer_port, miner_port=miner_port
    )
    marker = "\nbackend buyers\n"
    if text.count(marker) != 1:
        raise SystemExit(
            "load_balancer.haproxy_config no longer has one `backend buyers` section; update balancer_config"
        )
    text = text.replace(marker, marker + f"    http-response set-header {HOST_HEADER.decode()} %s\n")
    if check_timeout_ms is not None:
        defaults = "    timeout connect 2s\n"
        if text.count(defaults) != 1:
            raise SystemExit(
                "load_balancer.haproxy_config's defaults changed; update balancer_config's --check-timeout-ms"
            )
        text = text.replace(defaults, defaults + f"    timeout check {check_timeout_ms}ms\n")
    return text


class CpuGroup:
    """CPU seconds (user + system) of some processes and, optionally, all their descendants,
    keeping the last reading of each process that has exited (a killed host, a finished child)."""

    def __init__(self, pids: Sequence[int], *, children: bool = True) -> None:
        self.roots = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.roots.append(psutil.Process(pid))
        self.children = children
        self.last: dict[tuple[int, float], float] = {}

    def _read(self, process: psutil.Process) -> None:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            times = process.cpu_times()
            self.last[(process.pid, process.create_time())] = times.user + times.system

    def seconds(self) -> float:
        for root in self.roots:
            self._read(root)
            if self.children:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                    for child in root.children(recursive=True):
                        self._read(child)
        return sum(self.last.values())

    def rss_mib(self) -> float:
        total = 0
        for root in self.roots:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                total += sum(
                    p.memory_info().rss for p in [root, *(root.children(recursive=True) if self.children else [])]
                )
        return total / 2**20


class CpuSampler:
    """Readings of every group every `CPU_SAMPLE_S`, and on demand at a phase's edges."""

    def __init__(self, groups: dict[str, CpuGroup]) -> None:
        self.groups = groups
        self.samples: list[tuple[float, dict[str, float]]] = []

    def mark(self) -> tuple[float, dict[str, float]]:
        reading = (time.monotonic(), {name: group.seconds() for name, group in self.groups.items()})
        machine = psutil.cpu_times()
        reading[1]["whole machine"] = (
            machine.user + machine.nice + machine.system + machine.irq + machine.softirq + machine.steal
        )
        self.samples.append(reading)
        return reading

    async def run(self) -> None:
        while True:
            await trio.to_thread.run_sync(self.mark)
            await trio.sleep(CPU_SAMPLE_S)

    def phase(self, start: tuple[float, dict], end: tuple[float, dict]) -> dict[str, dict[str, float]]:
        """Per group: mean CPU over the phase and the peak over its samples, in % of one core."""
        within = sorted(
            [start, *[s for s in self.samples if start[0] < s[0] < end[0]], end], key=lambda reading: reading[0]
        )
        result = {}
        for name in start[1]:
            mean = (end[1][name] - start[1][name]) / max(end[0] - start[0], 1e-9) * 100
            # Readings closer than that are dominated by the kernel's 10 ms accounting tick.
            peaks = [
                (b[1][name] - a[1][name]) / (b[0] - a[0]) * 100
                for a, b in zip(within, within[1:])
                if b[0] - a[0] >= MIN_PEAK_SPAN_S
            ]
            result[name] = {"mean": mean, "peak": max(peaks, default=mean)}
        return result


class MinerProcess:
    """One `bench/fleet_miners.py` process and what it reported."""

    def __init__(self, number: int, keys: list[tuple[int, str]], keys_path: Path) -> None:
        self.number = number
        self.keys = keys
        self.keys_path = keys_path
        keys_path.write_text(json.dumps(keys))
        self.process: trio.Process | None = None
        self.ready = trio.Event()
        self.done = trio.Event()
        self.go_at: float | None = None
        self.events: list[dict] = []
        self.own_ms: list[float] = []
        self.changed = trio.Event()

    @property
    def expected_legs(self) -> int:
        return 2 * len(self.keys)

    @property
    def legs(self) -> int:
        return self.events[-1]["legs"] if self.events else 0

    async def run(
        self, miner_url: str, checkpoint: Path, slots: int, log_path: Path, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        command = [
            sys.executable,
            str(ROOT / "bench" / "fleet_miners.py"),
            "--gateway",
            miner_url,
            "--keys",
            str(self.keys_path),
            "--checkpoint",
            str(checkpoint),
            "--slots",
            str(slots),
        ]
        with log_path.open("w") as log:
            self.process = await trio.lowlevel.open_process(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )
        task_status.started()
        buffered = b""
        ended = False
        try:
            while data := await self.process.stdout.receive_some(65536):
                buffered += data
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    self._take(json.loads(line))
            ended = True
        finally:
            self.done.set()
            self.changed.set()
            with trio.CancelScope(shield=True):
                # Its output ended: it is exiting. Cancelled: this run failed, and it goes now.
                with trio.move_on_after(10 if ended else 0):
                    await self.process.wait()
                if self.process.returncode is None:
                    self.process.kill()
                    await self.process.wait()

    def _take(self, record: dict) -> None:
        if "ready" in record:
            self.ready.set()
        elif "go_at" in record:
            self.go_at = record["go_at"]
        elif "legs" in record:
            self.events.append(record)
        elif "own_ms" in record:
            self.own_ms = record["own_ms"]
        self.changed.set()
        self.changed = trio.Event()

    async def send(self, line: bytes) -> None:
        await self.process.stdin.send_all(line)

    async def wait_for(self, condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        with trio.move_on_after(timeout_s):
            while not condition():
                if self.done.is_set():
                    raise SystemExit(f"miner process {self.number} exited before {what}; see its log")
                await self.changed.wait()
            return
        raise SystemExit(f"miner process {self.number}: not {what} within {timeout_s:g} s")


# ---- buyers -------------------------------------------------------------------------------------
class FleetClient(KeepAliveClient):
    """`gateway_overhead`'s lean client, also reading the header that names the relaying host."""

    async def exchange(self, raw: bytes, on_head, on_data) -> None:
        """Send `raw`; `on_head(status, host)` once the response's head is in (so a stream cut
        short still says who relayed it), `on_data(bytes)` for each piece of its body."""
        await self.stream.send_all(raw)
        status = int((await self._line()).split(b" ", 2)[1])
        length, chunked, host = None, False, None
        while line := await self._line():
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                self.closing = True
            elif name == HOST_HEADER:
                host = value.decode()
        on_head(status, host)
        if not chunked:
            on_data(await self._exactly(length or 0))
            return
        while size := int((await self._line()).split(b";")[0], 16):
            on_data(await self._exactly(size))
            await self._exactly(2)
        await self._exactly(2)


async def buyer(
    number: int,
    key: str,
    port: int,
    heads: Sequence[tuple[str, str]],
    cum_weights: Sequence[float],
    seed: int,
    deadline: float,
    samples: list[Sample],
) -> None:
    rng = random.Random(seed * 100_003 + number)
    client: FleetClient | None = None
    prefixes = range(len(heads))
    try:
        for turn in itertools.count():
            if time.monotonic() >= deadline:
                return
            prefix = rng.choices(prefixes, cum_weights=cum_weights)[0]
            raw = chat_request("127.0.0.1", port, key, messages_of(heads[prefix], buyer=number, turn=turn))
            sample = Sample(number, prefix, time.monotonic())
            samples.append(sample)
            body = bytearray()

            def on_head(status: int, host: str | None) -> None:
                sample.status, sample.host = status, host

            def on_data(data: bytes) -> None:
                if sample.ttft is None and b'"content":"' in data.replace(b'"content":""', b""):
                    sample.ttft = time.monotonic() - sample.started
                body.extend(data)

            try:
                with trio.fail_after(CALL_TIMEOUT_S):
                    if client is None:
                        client = await FleetClient.connect("127.0.0.1", port)
                    await client.exchange(raw, on_head, on_data)
                if sample.status == 200 and FINISHED not in body:
                    sample.error = "the stream ended without the answer's finish_reason"
                if client.closing:
                    await client.stream.aclose()
                    client = None
            except (
                OSError,
                ConnectionError,
                trio.TooSlowError,
                trio.BrokenResourceError,
                ValueError,
                IndexError,
            ) as error:
                sample.error = f"{type(error).__name__}: {error}"[:200]
                if client is not None:
                    await client.stream.aclose()
                client = None
                await trio.sleep(RECONNECT_PAUSE_S)
            if (found := REPLY.search(body)) is not None:
                sample.miner = int(found.group(1))
            if (found := STREAM_ID.search(body)) is not None:
                sample.request_id = found.group(1).decode()
            sample.ended = time.monotonic()
            if sample.status is not None and sample.status != 200:
                sample.error = sample.error or f"status {sample.status}"
    finally:
        if client is not None:
            await client.stream.aclose()


# ---- the run ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Fleet:
    args: argparse.Namespace
    scratch: Path
    postmaster_pid: int
    checkpoint: Path
    hosts: list[Host]
    balancer: subprocess.Popen
    balancer_log: BalancerLog
    buyer_port: int
    miner_port: int
    buyer_keys: list[str]
    miner_keys: list[tuple[int, str]]


async def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str, every_s: float = 0.1) -> float:
    """Poll `condition` (another process's state, which announces nothing here) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"not {what} within {timeout_s:g} s")
        await trio.sleep(every_s)
    return time.monotonic()


async def health(port: int) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            return (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def measure(fleet: Fleet) -> dict:
    args = fleet.args
    out: dict = {}
    leg_count = len(fleet.hosts)
    chunks = [fleet.miner_keys[i :: args.miner_processes] for i in range(args.miner_processes)]
    miners = [MinerProcess(n, chunk, fleet.scratch / f"miners-{n}.json") for n, chunk in enumerate(chunks) if chunk]
    deadline = time.monotonic() + 30
    while not await health(fleet.buyer_port):
        if time.monotonic() > deadline:
            raise SystemExit("the balancer never found a healthy gateway host")
        await trio.sleep(0.2)
    async with trio.open_nursery() as nursery:
        for miner in miners:
            await nursery.start(
                miner.run,
                f"ws://127.0.0.1:{fleet.miner_port}/gw",
                fleet.checkpoint,
                args.slots,
                fleet.scratch / f"miners-{miner.number}.log",
            )
        for miner in miners:
            await miner.wait_for(miner.ready.is_set, timeout_s=READY_WAIT_S, what="ready")
        groups = {host.name: CpuGroup([host.process.pid]) for host in fleet.hosts}
        groups["HAProxy"] = CpuGroup([fleet.balancer.pid])
        groups["PostgreSQL"] = CpuGroup([fleet.postmaster_pid])
        groups["miner processes"] = CpuGroup([miner.process.pid for miner in miners])
        groups["buyers (this process)"] = CpuGroup([os.getpid()], children=False)
        sampler = CpuSampler(groups)
        nursery.start_soon(sampler.run)

        # 1. The admission storm.
        rss_before = {host.name: groups[host.name].rss_mib() for host in fleet.hosts}
        storm_start = sampler.mark()
        go_at, go_wall = time.monotonic(), time.time()
        for miner in miners:
            await miner.send(b"go\n")
        for miner in miners:
            await miner.wait_for(
                lambda m=miner: m.legs == m.expected_legs,
                timeout_s=STORM_TIMEOUT_S,
                what=f"{miner.expected_legs} legs admitted",
            )
        full_at = max(first_full_at(miner.events, expected=miner.expected_legs) for miner in miners)
        storm_end = sampler.mark()
        # A leg whose host the balancer had marked down lands on its backup, the other host.
        await wait_until(
            lambda: sum(len(host.admissions()) for host in fleet.hosts) >= args.miners * leg_count,
            timeout_s=30,
            what="the hosts logging every leg's admission",
        )
        out["storm"] = {
            "miners": args.miners,
            "legs": args.miners * leg_count,
            "seconds": full_at - go_at,
            "dial_started_s": max(miner.go_at for miner in miners) - go_at,
            "host_last_admission_s": {
                host.name: max(host.admissions(), default=go_wall) - go_wall for host in fleet.hosts
            },
            "host_admissions": {host.name: len(host.admissions()) for host in fleet.hosts},
            "cpu": sampler.phase(storm_start, storm_end),
            "rss_before_mib": rss_before,
            "rss_after_mib": {host.name: groups[host.name].rss_mib() for host in fleet.hosts},
            "refusals": dial_failures(fleet.scratch),
            "checks": checks_between(fleet.balancer_log.events(), go_at, full_at),
        }
        print(
            f"admission storm: {args.miners * leg_count} legs in {full_at - go_at:.1f} s", file=sys.stderr, flush=True
        )

        # 2. Idle, every miner connected.
        idle_start = sampler.mark()
        await trio.sleep(args.idle_seconds)
        out["idle"] = {"seconds": args.idle_seconds, "cpu": sampler.phase(idle_start, sampler.mark())}
        pool_legs: dict[str, int | None] = {}

        def pools_published() -> bool:
            pool_legs.update({host.name: host.pool_legs() for host in fleet.hosts})
            return sum(count or 0 for count in pool_legs.values()) == args.miners * leg_count

        await wait_until(pools_published, timeout_s=30, what="the hosts' pools publishing every leg", every_s=1.0)
        out["storm"]["pool_legs"] = dict(pool_legs)

        # 3. Traffic, one host killed halfway.
        claims = {host.name: host.leadership_claims() for host in fleet.hosts}
        leader = next((host for host in fleet.hosts if claims[host.name]), None)
        if args.kill == "leader":
            victim = leader or fleet.hosts[0]
        else:
            victim = next(host for host in fleet.hosts if host is not leader)
        survivor = next(host for host in fleet.hosts if host is not victim)
        heads = conversations(args.prefixes, args.seed)
        cum_weights = zipf_cum_weights(args.prefixes, args.zipf)
        samples: list[Sample] = []
        traffic_start = sampler.mark()
        deadline = traffic_start[0] + args.seconds
        kill_marks: list = []

        async def kill_halfway() -> None:
            await trio.sleep(args.seconds / 2)
            # In threads: the buyers' loop reads on while the kill lands.
            kill_marks.append(await trio.to_thread.run_sync(sampler.mark))
            kill_marks.append((await trio.to_thread.run_sync(victim.kill), time.time()))
            print(f"killed {victim.name} (SIGKILL)", file=sys.stderr, flush=True)

        async with trio.open_nursery() as traffic:
            traffic.start_soon(kill_halfway)
            for number, key in enumerate(fleet.buyer_keys):
                traffic.start_soon(
                    buyer, number, key, fleet.buyer_port, heads, cum_weights, args.seed, deadline, samples
                )
        traffic_end = sampler.mark()
        kill_mark, (killed_at, killed_wall) = kill_marks
        out["cpu_traffic"] = {
            "before the kill": sampler.phase(traffic_start, kill_mark),
            "after the kill": sampler.phase(kill_mark, traffic_end),
        }

        # 4. The failover's end: every leg back, the lease on the survivor.
        for miner in miners:
            await miner.wait_for(
                lambda m=miner: legs_back_at(m.events, expected=m.expected_legs, since=killed_at) is not None,
                timeout_s=RECOVERY_TIMEOUT_S,
                what="every leg back after the kill",
            )
        back = [legs_back_at(m.events, expected=m.expected_legs, since=killed_at) for m in miners]
        lost = sum(
            m.events[-1]["drops"] - next((e["drops"] for e in reversed(m.events) if e["t"] < killed_at), 0)
            for m in miners
        )
        takeover = None
        if victim is leader:
            await wait_until(
                lambda: any(t > killed_wall for t in survivor.leadership_claims()),
                timeout_s=3 * args.lease_s + 30,
                what="the survivor taking the leader lease",
                every_s=0.5,
            )
            takeover = min(t for t in survivor.leadership_claims() if t > killed_wall) - killed_wall
        out["failover"] = {
            "refusals": dial_failures(fleet.scratch),
            "checks": checks_between(fleet.balancer_log.events(), killed_at, max(back)),
            "victim": victim.name,
            "victim_led": victim is leader,
            "survivor": survivor.name,
            "legs_lost": lost,
            "legs_back_s": max(back) - killed_at,
            "lease_takeover_s": takeover,
            "survivor_admissions_after_kill": sum(t > killed_wall for t in survivor.admissions()),
        }

        for miner in miners:
            await miner.send(b"stop\n")
        for miner in miners:
            await miner.wait_for(miner.done.is_set, timeout_s=60, what="stopped")
            await miner.process.wait()
        nursery.cancel_scope.cancel()

    samples = [s for s in samples if s.ended]
    out.update(
        analyse(
            samples,
            miners,
            args,
            killed_at=killed_at,
            victim=victim.name,
            traffic=(traffic_start[0], killed_at, traffic_end[0]),
        )
    )
    out["survivor"] = survivor.name
    return out


def analyse(
    samples: list[Sample],
    miners: list[MinerProcess],
    args,
    *,
    killed_at: float,
    victim: str,
    traffic: tuple[float, float, float],
) -> dict:
    start, kill, end = traffic
    answered = sorted((s for s in samples if s.ok), key=lambda s: s.started)
    failed = [s for s in samples if not s.ok]
    own_ms = [value for miner in miners for value in miner.own_ms]
    phases = {
        "before the kill": [s for s in answered if s.started < kill],
        "after the kill": [s for s in answered if s.started >= kill],
        "whole run": answered,
    }
    spans = {"before the kill": kill - start, "after the kill": end - kill, "whole run": end - start}
    own = quantiles_ms([ms / 1000 for ms in own_ms])
    latency = {}
    for phase, chosen in phases.items():
        ttft = quantiles_ms([s.ttft for s in chosen if s.ttft is not None])
        whole = quantiles_ms([s.ended - s.started for s in chosen])
        latency[phase] = {
            "requests": len(chosen),
            "rps": len(chosen) / spans[phase],
            "ttft_ms": ttft,
            "whole_ms": whole,
            "per_host": dict(collections.Counter(s.host or "?" for s in chosen)),
            "span_s": spans[phase],
        }
    served = collections.Counter(s.miner for s in answered)
    loads = [served.get(index, 0) for index in range(args.miners)]
    hits = served_hits(answered, lru=args.lru)
    oracle = oracle_hits(answered, miners=range(args.miners), slots=args.slots, lru=args.lru)
    in_flight_on_victim = [s for s in failed if s.started <= killed_at <= s.ended and s.host in (victim, None)]
    other_failures = [s for s in failed if s not in in_flight_on_victim]
    first_after = min((s.ended for s in answered if s.started > killed_at), default=None)
    spanning = collections.Counter(s.host or "no response yet" for s in samples if s.started <= killed_at <= s.ended)
    return {
        "in_flight_at_kill": dict(spanning),
        "samples": [dataclasses.astuple(s) for s in samples],
        "latency": latency,
        "own_ms": own,
        "own_samples": len(own_ms),
        "load": {"max": max(loads), "mean": sum(loads) / len(loads), "min": min(loads), "idle_miners": loads.count(0)},
        "affinity": affinity_rows(answered, hits, oracle, kill_at=kill),
        "distinct_prefixes": len({s.prefix for s in answered}),
        "home_agreement": home_agreement(answered, kill_at=kill),
        "failures": {
            "total": len(failed),
            "in_flight_on_victim": len(in_flight_on_victim),
            "other": len(other_failures),
            "started_after_kill": sum(s.started > killed_at for s in failed),
            "after_kill": [(s.started - killed_at, s.error) for s in failed if s.started > killed_at][:10],
            "errors": dict(collections.Counter(re.sub(r"\d+", "N", s.error) for s in failed).most_common(6)),
            "failed": [dataclasses.asdict(s) for s in failed],
            "other_examples": [dataclasses.asdict(s) for s in other_failures[:5]],
        },
        "first_answer_after_kill_s": None if first_after is None else first_after - killed_at,
        "answered": len(answered),
    }


def setup_store(url: str, *, miners: int, buyers: int) -> tuple[list[str], list[tuple[int, str]]]:
    from engy_node.gateway.store import Store

    with Store.open(url) as store:
        buyer_keys = []
        for number in range(buyers):
            account, key = store.create_buyer(f"fleet-buyer-{number}")
            store.credit(account, micro_usd=10**9)
            buyer_keys.append(key)
        miner_keys = [(index, store.register_miner(f"fleet-m{index}")[1]) for index in range(miners)]
    return buyer_keys, miner_keys


def served_checkpoint(home: Path) -> Path:
    """The embedded model's checkpoint, converted once here before any process needs it."""
    from engy_node.config import load_config
    from engy_node.serve.checkpoint import embedded_checkpoint

    config = load_config(home=home, env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"})
    return embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)


def run(args) -> dict:
    from engy_node.testing.faults import read_books
    from engy_node.testing.postgres import throwaway_cluster

    if not Path(HAPROXY).is_file():
        raise SystemExit(
            f"HAProxy is not installed at {HAPROXY}: apt-get install haproxy (scripts/bootstrap.sh does it as root)"
        )
    check_keys(conversations(args.prefixes, args.seed))
    with tempfile.TemporaryDirectory(prefix="engy-fleet-bench-") as scratch_dir, throwaway_cluster() as cluster:
        scratch = Path(scratch_dir)
        checkpoint = served_checkpoint(scratch / "bench-home")
        url = cluster.create_database()
        started = time.monotonic()
        buyer_keys, miner_keys = setup_store(url, miners=args.miners, buyers=args.buyers)
        print(
            f"store ready ({args.miners} miners, {args.buyers} buyers) in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        hosts = [Host(name, scratch / name, offset) for offset, name in enumerate(HOST_NAMES)]
        buyer_port, miner_port = free_port(), free_port()
        balancer = None
        try:
            for host in hosts:
                host.start(url, legs=len(hosts), lease_s=args.lease_s)
            for host in hosts:
                host.wait_ready()
            config_path = scratch / "haproxy.cfg"
            config_path.write_text(
                balancer_config(
                    hosts, buyer_port=buyer_port, miner_port=miner_port, check_timeout_ms=args.check_timeout_ms
                )
            )
            checked = subprocess.run([HAPROXY, "-c", "-f", str(config_path)], capture_output=True, text=True)
            if checked.returncode != 0:
                raise SystemExit(f"HAProxy refused the configuration:\n{checked.stdout}{checked.stderr}")
            balancer = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(config_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            balancer_log = BalancerLog(balancer, scratch / "haproxy.log")
            postmaster = int((cluster.data_dir / "postmaster.pid").read_text().split()[0])
            fleet = Fleet(
                args,
                scratch,
                postmaster,
                checkpoint,
                hosts,
                balancer,
                balancer_log,
                buyer_port,
                miner_port,
                buyer_keys,
                miner_keys,
            )
            try:
                result = trio.run(measure, fleet)
            except BaseException:
                for host in hosts:
                    print(
                        f"--- {host.name}'s log, last lines ---",
                        *host.log().splitlines()[-30:],
                        sep="\n",
                        file=sys.stderr,
                    )
                for path in sorted(scratch.glob("miners-*.log")):
                    print(
                        f"--- {path.name}, last lines ---",
                        *path.read_text().splitlines()[-15:],
                        sep="\n",
                        file=sys.stderr,
                    )
                raise
            survivor = next(host for host in hosts if host.name == result["survivor"])
            result["survivor_exit"] = stop_process(survivor.process)
        finally:
            for host in hosts:
                if host.process is not None:
                    stop_process(host.process)
            if balancer is not None:
                stop_process(balancer)
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                for path in [
                    scratch / "haproxy.log",
                    *sorted(scratch.glob("miners-*.log")),
                    *(host.log_path for host in hosts),
                ]:
                    if path.exists():
                        shutil.copy(
                            path, args.logs / (f"{path.parent.name}.log" if path.name == "gateway.log" else path.name)
                        )
        failed = result["failures"]["failed"]
        fates = request_fates(url, [s["request_id"] for s in failed if s["request_id"]])
        result["failures"]["fates"] = dict(
            collections.Counter(
                (
                    f"{fates[s['request_id']]}, {'after part of the answer reached the buyer' if s['ttft'] else 'before any content'}"
                    if s["request_id"]
                    else "no response began"
                )
                for s in failed
            )
        )
        books = read_books(url)
        result["books"] = {
            "holds": books.holds,
            "open_holds": len(books.open_holds),
            "charges": books.charges,
            "charged_micro": books.charged_micro,
            "unlogged_charges": len(books.unlogged_charges),
            "problems": list(books.problems),
        }
        result["logs"] = {host.name: notable(host.log()) for host in hosts}
        result["versions"] = {
            "haproxy": subprocess.run([HAPROXY, "-v"], capture_output=True, text=True).stdout.split("\n")[0],
            "postgresql": subprocess.run(
                [str(cluster.bin_dir / "postgres"), "--version"], capture_output=True, text=True
            ).stdout.strip(),
        }
    return result


NOTABLE = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) +([\w.]+): (.*)$", re.M)
VARYING = re.compile(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?")


def notable(log_text: str) -> dict[str, int]:
    """A host log's warnings and errors, counted with numbers and ids masked."""
    masked = (f"{level} {name}: {VARYING.sub('N', message)}" for level, name, message in NOTABLE.findall(log_text))
    return dict(collections.Counter(masked).most_common(12))


# ---- the report ---------------------------------------------------------------------------------
def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def counted(counts: dict[str, int], since: dict[str, int] | None = None) -> str:
    changes = {key: value - (since or {}).get(key, 0) for key, value in counts.items()}
    return "; ".join(f"{count} × {text}" for text, count in sorted(changes.items()) if count) or "none"


def checks_rows(checks: dict, *, during: str = "storm") -> list[tuple[str, str]]:
    outages = (
        "; ".join(f"{backend} {seconds:.1f} s" for backend, seconds in sorted(checks["no_server_s"].items())) or "none"
    )
    return [
        (f"health checks that took a server down, {during} (HAProxy)", counted(checks["downs"])),
        (f"backends with no server up, {during} (503 to every dial or request)", outages),
    ]


def pair(values: tuple[float, float] | None) -> str:
    return "—" if values is None else f"{values[0]:.1f} / {values[1]:.1f} ms"


def machine(load_before: tuple[float, float, float]) -> str:
    cpu = platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    memory = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()}; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load average before the run "
        + ", ".join(f"{value:.2f}" for value in load_before)
        + " (other work on a shared machine shows in `whole machine`)"
    )


def print_report(result: dict, args, command: str) -> None:
    storm, failover = result["storm"], result["failover"]
    hosts = list(storm["host_admissions"])
    print(
        f"\nAdmission storm: {storm['miners']} miners, {storm['legs']} legs ({len(hosts)} hosts × one leg per miner), "
        f"{args.miner_processes} miner processes\n"
    )
    rows = [
        ("every leg admitted (as the miners see it)", f"{storm['seconds']:.1f} s"),
        ("all links dialling (the last process started them)", f"{storm['dial_started_s']:.2f} s"),
    ]
    rows += [
        (
            f"{name}: last admission logged, admissions logged",
            f"{storm['host_last_admission_s'][name]:.1f} s, {storm['host_admissions'][name]}",
        )
        for name in hosts
    ]
    rows += [(f"{name}: legs in its pool afterwards (control API)", str(storm["pool_legs"][name])) for name in hosts]
    rows += [
        (f"{name}: RSS before → after", f"{storm['rss_before_mib'][name]:.0f} → {storm['rss_after_mib'][name]:.0f} MiB")
        for name in hosts
    ]
    rows.append(("dials that failed (miners' logs)", counted(storm["refusals"])))
    rows += checks_rows(storm["checks"])
    print(table(("", "figure"), rows))

    print("\nCPU per process group, % of one core: mean (peak over 0.5 s samples)\n")
    phases = [
        ("storm", storm["cpu"]),
        ("idle, all connected", result["idle"]["cpu"]),
        ("traffic, before the kill", result["cpu_traffic"]["before the kill"]),
        ("traffic, after the kill", result["cpu_traffic"]["after the kill"]),
    ]
    names = list(storm["cpu"])
    print(
        table(
            ("process group", *(name for name, _ in phases)),
            [(name, *(f"{cpu[name]['mean']:.0f} ({cpu[name]['peak']:.0f})" for _, cpu in phases)) for name in names],
        )
    )

    print(
        f"\nBuyers: {args.buyers} closed-loop, streamed, {args.seconds:g} s; {args.prefixes} conversations, Zipf {args.zipf:g}; "
        f"{failover['victim']} killed at half time\n"
    )
    own = result["own_ms"]
    rows = []
    for phase, figures in result["latency"].items():
        ttft = figures["ttft_ms"]
        added = None if ttft is None or own is None else (ttft[0] - own[0], ttft[1] - own[1])
        hosts_text = ", ".join(f"{name} {count}" for name, count in sorted(figures["per_host"].items()))
        rows.append(
            (
                phase,
                str(figures["requests"]),
                f"{figures['rps']:.0f}",
                pair(ttft),
                pair(own),
                pair(added),
                pair(figures["whole_ms"]),
                hosts_text,
            )
        )
    print(
        table(
            (
                "phase",
                "answered",
                "req/s",
                "TTFT p50 / p99",
                "miner's own p50 / p99",
                "added p50 / p99",
                "whole answer p50 / p99",
                "relayed by",
            ),
            rows,
        )
    )
    per_request = []
    for phase in ("before the kill", "after the kill"):
        figures, cpu = result["latency"][phase], result["cpu_traffic"][phase]
        for name, count in sorted(figures["per_host"].items()):
            if name in cpu and count:
                per_request.append(
                    f"{name} {cpu[name]['mean'] / 100 * figures['span_s'] * 1000 / count:.1f} ms {phase}"
                )
    print(
        "\nGateway CPU per request relayed (the host's CPU over the phase / the requests it relayed): "
        + ", ".join(per_request)
    )
    load = result["load"]
    print(
        f"\nRequests served per miner: max {load['max']}, mean {load['mean']:.2f} (max/mean {load['max'] / max(load['mean'], 1e-9):.1f}), "
        f"min {load['min']}; {load['idle_miners']} of {args.miners} miners served none"
    )

    agreeing, shared = result["home_agreement"]
    print(
        f"\nPrefix affinity (each miner an LRU of {args.lru} conversations, {args.slots} slots per miner; "
        f"{result['distinct_prefixes']} conversations seen)\n"
    )
    print(
        table(
            ("host", "phase", "requests", "hit rate", "oracle", "ours / oracle"),
            [
                (
                    row["host"],
                    row["phase"],
                    str(row["requests"]),
                    f"{row['hit_rate']:.1%}",
                    f"{row['oracle_hit_rate']:.1%}",
                    f"{row['hit_rate'] / row['oracle_hit_rate']:.2f}" if row["oracle_hit_rate"] else "—",
                )
                for row in result["affinity"]
            ],
        )
    )
    print(
        f"\nSame home on both hosts: {agreeing} of the {shared} conversations both hosts served before the kill went mostly "
        "to the same miner on each"
    )

    failures, books = result["failures"], result["books"]
    print("\nFailover\n")
    rows = [
        ("killed", f"{failover['victim']} ({'the leader' if failover['victim_led'] else 'a follower'}), SIGKILL"),
        ("legs lost", str(failover["legs_lost"])),
        ("dials that failed, kill → every leg back (miners' logs)", counted(failover["refusals"], storm["refusals"])),
        *checks_rows(failover["checks"], during="kill → every leg back"),
        ("every leg back (kill → last re-admission, as the miners see it)", f"{failover['legs_back_s']:.1f} s"),
        (f"{failover['survivor']}: admissions logged after the kill", str(failover["survivor_admissions_after_kill"])),
        (
            "survivor took the leader lease",
            "—"
            if failover["lease_takeover_s"] is None
            else f"{failover['lease_takeover_s']:.1f} s after the kill (lease {args.lease_s:g} s)",
        ),
        (
            "first answer to a request started after the kill",
            "—"
            if result["first_answer_after_kill_s"] is None
            else f"{result['first_answer_after_kill_s'] * 1000:.0f} ms after the kill",
        ),
        (
            "buyer requests open at the kill (as the buyers saw them), by relaying host",
            counted(result["in_flight_at_kill"]),
        ),
        (
            "buyer requests failed",
            f"{failures['total']}: {failures['in_flight_on_victim']} in flight on "
            f"{failover['victim']} at the kill, {failures['other']} other; {failures['started_after_kill']} started after it",
        ),
        (
            "failed requests started after the kill (start, how)",
            "; ".join(f"+{offset * 1000:.0f} ms, {error}" for offset, error in failures["after_kill"]) or "none",
        ),
        ("failures by error", "; ".join(f"{count} × {text}" for text, count in failures["errors"].items()) or "none"),
        ("the ledger on the failed requests (by the stream's id)", counted(failures["fates"])),
        ("survivor stopped cleanly (exit status)", str(result["survivor_exit"])),
        (
            "books (check_books on PostgreSQL)",
            "sound" if not books["problems"] else "BROKEN: " + "; ".join(books["problems"][:5]),
        ),
        (
            "holds / charges / charged",
            f"{books['holds']} / {books['charges']} / {books['charged_micro'] / 1e6:.4f} USD",
        ),
        ("open holds (the killed host's requests in flight)", str(books["open_holds"])),
        ("charges without a request-log row (queued on the killed host)", str(books["unlogged_charges"])),
    ]
    print(table(("", "figure"), rows))
    for name, records in result["logs"].items():
        if records:
            print(
                f"\n{name}'s log, warnings and errors:"
                + "".join(f"\n    {count} × {text}" for text, count in records.items())
            )
    print(f"\nCommand: {command}")
    print(f"Machine: {machine(result['load_before'])}")
    print(f"Code: {describe(ROOT)}; {result['versions']['haproxy']}; {result['versions']['postgresql']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--miners", type=int, default=1000, help="synthetic miners (each opens one leg per host)")
    parser.add_argument("--seconds", type=float, default=60.0, help="buyer traffic; the host is killed at half time")
    parser.add_argument("--buyers", type=int, default=32, help="closed-loop buyers (concurrent streamed requests)")
    parser.add_argument("--miner-processes", type=int, default=4, help="processes the miners are spread over")
    parser.add_argument("--slots", type=int, default=4, help="concurrent requests per miner (split over its legs)")
    parser.add_argument("--prefixes", type=int, default=500, help="conversations the buyers' requests continue")
    parser.add_argument(
        "--zipf", type=float, default=1.0, help="exponent of the conversations' popularity (0: uniform)"
    )
    parser.add_argument("--lru", type=int, default=16, help="conversations each miner's modelled prefix cache holds")
    parser.add_argument("--kill", choices=("leader", "follower"), default="leader", help="which host is killed")
    parser.add_argument("--lease-s", type=float, default=6.0, help="gateway.leader_lease_s on both hosts")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="all miners connected, no buyers")
    parser.add_argument("--seed", type=int, default=0, help="seeds the conversations and the buyers' draws")
    parser.add_argument(
        "--check-timeout-ms",
        type=int,
        metavar="MS",
        help="experiment: add `timeout check MS` to the balancer's configuration (the product's has none, so "
        "a health check times out after its interval, 1 s)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw results here")
    parser.add_argument("--logs", type=Path, metavar="DIR", help="copy every process's log here before cleaning up")
    args = parser.parse_args()
    for name in ("miners", "buyers", "miner_processes", "slots", "prefixes", "lru"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.seconds <= 0 or args.idle_seconds < 0 or args.zipf < 0:
        raise SystemExit("--seconds must be positive, --idle-seconds and --zipf 0 or more")
    if not 3 <= args.lease_s <= 3600:
        raise SystemExit(f"--lease-s {args.lease_s:g}: gateway.leader_lease_s must be 3..3600")
    command = " ".join([".venv/bin/python", "bench/fleet.py", *sys.argv[1:]])
    load_before = os.getloadavg()
    result = run(args)
    result["load_before"] = load_before
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print_report(result, args, command)


if __name__ == "__main__":
    main()
