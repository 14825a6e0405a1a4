"""Buyer latency beside hostile traffic: the same normal load alone, then with hostile clients.

    .venv/bin/python bench/hostile_load.py [--buyers 4] [--seconds 20] [--huge 2] [--huge-broke 2] [--large 2]
                                           [--large-broke 2] [--deep 4] [--slow-body 8] [--slow-headers 8]
                                           [--body-timeout-s 10]

A synthetic miner (the real link and protocol, an instant scripted answer; `gateway_overhead`'s)
runs in its own process and `engy-node --role gateway` in another; this process is the clients,
on lean keep-alive HTTP/1.1 connections (`gateway_overhead.KeepAliveClient`) so that the load
generator costs little of the machine it shares with the gateway. Two phases of `--seconds` each:

1. **normal alone**: `--buyers` concurrent buyers send short streamed chat completions, each a
   different question, back to back; one more client polls `GET /v1/models`.
2. **normal + hostile**: the same, while hostile clients run beside it, each kind at its own
   fixed concurrency, each client sending its next request as soon as the last one ended:

   * `huge` / `huge-broke`: a prompt just under the 8 MiB body cap, from a funded key / a $0 key
     (the gateway should refuse it from its size alone, without tokenising);
   * `large` / `large-broke`: a ~20,000-character prompt inside the model's input limit, from a
     funded key (tokenised in a worker thread, then served) / a $0 key (refused on the balance
     before tokenising);
   * `deep`: a body of 100,000 nested JSON arrays;
   * `slow-body`: complete headers, then the body a byte a second (cut at `gateway.body_timeout_s`,
     lowered here by `--body-timeout-s` so that the cut happens inside a phase; the number of
     connections held does not depend on it, each client holds one);
   * `slow-headers`: a request line, then a header line a byte a second (hypercorn closes a
     connection whose request head is incomplete after its keep-alive timeout).

For each buyer metric (time to the first content event and to the whole answer p50/p99,
requests/s, errors, `GET /v1/models` p50/p99) the two phases are printed side by side with the
ratio hostile/normal, with the CPU the gateway, this client, the miner and everything else on the
machine used in each (a shared machine's other work shows there) and the gateway's peak RSS.
Then what each hostile kind got back: its statuses (or "closed" / "reset": the server hung up
without answering) and the time to that answer, and the requests still unanswered when the
phase ended. Last, the machine, date, commit, and the gateway log's warnings and errors.
Qualification is off (the one miner is the bench's own), so no probes run beside the load.
Everything binds 127.0.0.1; every process started here is stopped here.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import psutil
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import READY, KeepAliveClient, percentile, run_synthetic_miner  # noqa: E402

MODEL = "smollm2-135m"
MAX_BODY_BYTES = 8 * 1024 * 1024
"""The gateway's default `gateway.max_body_bytes`: the huge prompts stay just under it, so they
are read whole and refused for what they are, not for their size on the wire."""
HUGE_MARGIN_BYTES = 1024
LARGE_PROMPT_CHARS = 20_000
"""About 4,500 tokens of English for SmolLM2's tokenizer: inside its 6,144-token input limit,
and far above the 4,096 characters up to which the gateway tokenises on its event loop."""
DEEP_JSON_LEVELS = 100_000
SLOW_BODY_BYTES = 1024
SLOW_HEADER_BYTES = 4096
"""Far more than `--seconds` bytes at a byte a second: neither slow request completes by itself."""
TRICKLE_INTERVAL_S = 1.0
SENTENCE = "The quick brown fox jumps over the lazy dog. "
REQUEST_TIMEOUT_S = 60.0
"""Longest a buyer's or a fast hostile request may take before it counts as failed ("timeout")."""
READY_WAIT_S = 120.0
MODELS_POLL_INTERVAL_S = 0.05
RSS_SAMPLE_INTERVAL_S = 0.25
WARM_UP_S = 2.0
LOG_TAIL_LINES = 40


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    default: int
    sends: str


KINDS = (
    Kind("huge", 2, f"a {MAX_BODY_BYTES // 2**20} MiB prompt (just under the body cap), funded key"),
    Kind("huge-broke", 2, f"a {MAX_BODY_BYTES // 2**20} MiB prompt, $0 key"),
    Kind("large", 2, f"a {LARGE_PROMPT_CHARS:,}-character prompt inside the model's limit, funded key"),
    Kind("large-broke", 2, f"a {LARGE_PROMPT_CHARS:,}-character prompt, $0 key"),
    Kind("deep", 4, f"{DEEP_JSON_LEVELS:,} nested JSON arrays"),
    Kind("slow-body", 8, "headers, then the body a byte a second"),
    Kind("slow-headers", 8, "a request line, then a header a byte a second"),
)


# ---- requests ---------------------------------------------------------------------------------
def filler(chars: int) -> str:
    return (SENTENCE * (chars // len(SENTENCE) + 1))[:chars]


def chat_body(content: str, *, stream: bool = True) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 64,
                       "stream": stream}).encode()


def head(host: str, port: int, key: str, *, content_length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {content_length}\r\n\r\n").encode()


def post(host: str, port: int, key: str, body: bytes) -> bytes:
    return head(host, port, key, content_length=len(body)) + body


def huge_body() -> bytes:
    envelope = len(chat_body(""))
    return chat_body(filler(MAX_BODY_BYTES - HUGE_MARGIN_BYTES - envelope))


def large_body(number: int) -> bytes:
    """Each differs at its start (its number), so nothing can answer it from a cache of prompts."""
    opening = f"Request {number}. Summarise this text. "
    return chat_body(opening + filler(LARGE_PROMPT_CHARS - len(opening)))


def deep_body() -> bytes:
    return b"[" * DEEP_JSON_LEVELS + b"]" * DEEP_JSON_LEVELS


def question(number: int) -> str:
    return f"Say the sentence. This is buyer request {number}."


# ---- clients ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Endpoint:
    host: str
    port: int
    funded_key: str
    broke_key: str


@dataclasses.dataclass
class BuyerSamples:
    ttfts: list[float] = dataclasses.field(default_factory=list)
    totals: list[float] = dataclasses.field(default_factory=list)
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class KindTally:
    answers: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    """(status, or "closed", "reset", "timeout"; seconds from sending to that answer)."""
    open_at_end: list[float] = dataclasses.field(default_factory=list)
    """Ages of the requests still unanswered when the phase ended."""


class Connection:
    """A `KeepAliveClient` that reconnects when the server closed or is about to close it."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.client: KeepAliveClient | None = None

    async def request(self, raw: bytes, on_data: Callable[[bytes], None]) -> str:
        """The answer's status, or what happened instead ("closed", "reset", "timeout")."""
        if self.client is None:
            self.client = await KeepAliveClient.connect(self.endpoint.host, self.endpoint.port)
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                status = str(await self.client.request(raw, on_data))
        except trio.TooSlowError:
            await self.close()
            return "timeout"
        except (ConnectionError, trio.BrokenResourceError) as error:
            await self.close()
            return "reset" if isinstance(error, (ConnectionResetError, trio.BrokenResourceError)) else "closed"
        if self.client.closing:
            await self.close()
        return status

    async def close(self) -> None:
        if self.client is not None:
            await self.client.stream.aclose()
            self.client = None


async def buyer(endpoint: Endpoint, numbers: Iterator[int], deadline: float, samples: BuyerSamples) -> None:
    """Streamed short completions back to back until `deadline`; each finishes even past it."""
    connection = Connection(endpoint)
    try:
        while trio.current_time() < deadline:
            raw = post(endpoint.host, endpoint.port, endpoint.funded_key, chat_body(question(next(numbers))))
            started = time.perf_counter()
            first: list[float] = []

            def on_data(data: bytes) -> None:
                if not first and data.count(b'"content":"') > data.count(b'"content":""'):
                    first.append(time.perf_counter() - started)

            status = await connection.request(raw, on_data)
            if status != "200" or not first:
                samples.errors[status if status != "200" else "200 without content"] += 1
                continue
            samples.totals.append(time.perf_counter() - started)
            samples.ttfts.append(first[0])
    finally:
        await connection.close()


async def poll_models(endpoint: Endpoint, deadline: float, latencies: list[float], errors: collections.Counter) -> None:
    connection = Connection(endpoint)
    raw = f"GET /v1/models HTTP/1.1\r\nhost: {endpoint.host}:{endpoint.port}\r\n\r\n".encode()
    try:
        while trio.current_time() < deadline:
            started = time.perf_counter()
            status = await connection.request(raw, lambda data: None)
            if status == "200":
                latencies.append(time.perf_counter() - started)
            else:
                errors[status] += 1
            await trio.sleep(MODELS_POLL_INTERVAL_S)
    finally:
        await connection.close()


async def sample_rss(processes: list[psutil.Process], deadline: float, peak: list[float]) -> None:
    while trio.current_time() < deadline:
        peak[0] = max(peak[0], sum(process.memory_info().rss for process in processes) / 2**20)
        await trio.sleep(RSS_SAMPLE_INTERVAL_S)


async def repeat_fast(endpoint: Endpoint, make_raw: Callable[[], bytes], tally: KindTally) -> None:
    """One hostile client sending whole requests back to back (until the phase cancels it)."""
    connection = Connection(endpoint)
    try:
        while True:
            raw = make_raw()
            started = time.perf_counter()
            try:
                status = await connection.request(raw, lambda data: None)
            except trio.Cancelled:
                tally.open_at_end.append(time.perf_counter() - started)
                raise
            tally.answers.append((status, time.perf_counter() - started))
    finally:
        await connection.close()


async def trickle_once(endpoint: Endpoint, opening: bytes, payload: bytes) -> str:
    """Send `opening` at once and `payload` a byte per `TRICKLE_INTERVAL_S`, until the server
    answers (its status) or hangs up ("closed" / "reset")."""
    stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
    answer = bytearray()
    outcome = "closed"
    async with stream:
        async def send_slowly() -> None:
            try:
                await stream.send_all(opening)
                for index in range(len(payload)):
                    await trio.sleep(TRICKLE_INTERVAL_S)
                    await stream.send_all(payload[index:index + 1])
            except trio.BrokenResourceError:
                pass  # the server hung up; the reader sees it too

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_slowly)
            try:
                while b"\r\n" not in answer and len(answer) < 65536:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    answer += data
            except trio.BrokenResourceError:
                outcome = "reset"
            nursery.cancel_scope.cancel()
    if answer.startswith(b"HTTP/1.1 ") and b"\r\n" in answer:
        return answer.split(b" ", 2)[1].decode()
    return outcome


async def repeat_trickle(endpoint: Endpoint, make: Callable[[], tuple[bytes, bytes]], tally: KindTally) -> None:
    """One hostile client trickling (opening, payload) requests, one after the other (until the
    phase cancels it)."""
    while True:
        opening, payload = make()
        started = time.perf_counter()
        try:
            status = await trickle_once(endpoint, opening, payload)
        except trio.Cancelled:
            tally.open_at_end.append(time.perf_counter() - started)
            raise
        tally.answers.append((status, time.perf_counter() - started))


def hostile_clients(endpoint: Endpoint, counts: dict[str, int], numbers: Iterator[int]) -> list[tuple[str, Callable[[KindTally], Awaitable[None]]]]:
    """(kind, a coroutine function running one client of it) for every client of every kind."""
    host, port = endpoint.host, endpoint.port
    huge = huge_body()
    huge_funded = post(host, port, endpoint.funded_key, huge)
    huge_broke = post(host, port, endpoint.broke_key, huge)
    deep = post(host, port, endpoint.funded_key, deep_body())
    slow_body = chat_body(question(0) + " " * SLOW_BODY_BYTES)
    runners: dict[str, Callable[[KindTally], Awaitable[None]]] = {
        "huge": lambda tally: repeat_fast(endpoint, lambda: huge_funded, tally),
        "huge-broke": lambda tally: repeat_fast(endpoint, lambda: huge_broke, tally),
        "large": lambda tally: repeat_fast(endpoint, lambda: post(host, port, endpoint.funded_key, large_body(next(numbers))), tally),
        "large-broke": lambda tally: repeat_fast(endpoint, lambda: post(host, port, endpoint.broke_key, large_body(next(numbers))), tally),
        "deep": lambda tally: repeat_fast(endpoint, lambda: deep, tally),
        "slow-body": lambda tally: repeat_trickle(
            endpoint, lambda: (head(host, port, endpoint.funded_key, content_length=len(slow_body)), slow_body), tally),
        "slow-headers": lambda tally: repeat_trickle(
            endpoint, lambda: (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n".encode(),
                               b"x-slow: " + b"a" * SLOW_HEADER_BYTES + b"\r\n\r\n"), tally),
    }
    return [(kind.name, runners[kind.name]) for kind in KINDS for _ in range(counts[kind.name])]


# ---- phases -----------------------------------------------------------------------------------
def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(process.cpu_times()[:2]) for process in processes)


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has spent, all cores together."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


async def phase(endpoint: Endpoint, args, pids: dict[str, int], numbers: Iterator[int], *, hostile: dict[str, int] | None) -> dict:
    """One phase: the normal load for `args.seconds`, with the hostile clients beside it when
    `hostile` names their counts. Hostile clients stop at the deadline; buyers finish the request
    they are in."""
    processes = process_tree(pids["gateway"])
    miner = psutil.Process(pids["miner"])
    samples = BuyerSamples()
    models_latencies: list[float] = []
    models_errors: collections.Counter = collections.Counter()
    peak_rss = [0.0]
    tallies = {kind.name: KindTally() for kind in KINDS}
    clients = hostile_clients(endpoint, hostile, numbers) if hostile else []
    cpu_before, client_before = cpu_seconds(processes), time.process_time()
    miner_before, machine_before = cpu_seconds([miner]), machine_busy_seconds()
    started = time.perf_counter()
    deadline = trio.current_time() + args.seconds
    async with trio.open_nursery() as nursery:
        for _ in range(args.buyers):
            nursery.start_soon(buyer, endpoint, numbers, deadline, samples)
        nursery.start_soon(poll_models, endpoint, deadline, models_latencies, models_errors)
        nursery.start_soon(sample_rss, processes, deadline, peak_rss)
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as hostile_nursery:
                for kind, run_client in clients:
                    hostile_nursery.start_soon(run_client, tallies[kind])
                await trio.sleep_forever()
    elapsed = time.perf_counter() - started
    gateway_cpu, client_cpu = cpu_seconds(processes) - cpu_before, time.process_time() - client_before
    miner_cpu, machine_cpu = cpu_seconds([miner]) - miner_before, machine_busy_seconds() - machine_before
    return {"buyers": summarise_buyers(samples, elapsed), "models": summarise_latencies(models_latencies, models_errors),
            "gateway_cpu_pct": gateway_cpu * 100 / elapsed, "client_cpu_pct": client_cpu * 100 / elapsed,
            "miner_cpu_pct": miner_cpu * 100 / elapsed,
            "others_cpu_pct": (machine_cpu - gateway_cpu - client_cpu - miner_cpu) * 100 / elapsed,
            "gateway_peak_rss_mib": peak_rss[0], "seconds": elapsed,
            "hostile": {name: summarise_kind(tally) for name, tally in tallies.items() if hostile and hostile[name]}}


async def wait_until_served(endpoint: Endpoint) -> None:
    """Until the miner has dialled in and a buyer's request is served (the gateway queues a
    request for a while when no miner has room, so each try waits for the miner itself)."""
    connection = Connection(endpoint)
    raw = post(endpoint.host, endpoint.port, endpoint.funded_key, chat_body(question(0)))
    statuses: collections.Counter = collections.Counter()
    try:
        with trio.move_on_after(READY_WAIT_S):
            while (status := await connection.request(raw, lambda data: None)) != "200":
                statuses[status] += 1
            return
    finally:
        await connection.close()
    raise SystemExit(f"no buyer request was served within {READY_WAIT_S:g} s (answers: {errors_text(statuses)}); "
                     "see the gateway's and the miner's logs below")


async def measure(endpoint: Endpoint, args, pids: dict[str, int], hostile: dict[str, int]) -> dict:
    numbers = iter(range(10**9))
    await wait_until_served(endpoint)
    warm = argparse.Namespace(**{**vars(args), "seconds": WARM_UP_S})
    await phase(endpoint, warm, pids, numbers, hostile=None)
    normal = await phase(endpoint, args, pids, numbers, hostile=None)
    loaded = await phase(endpoint, args, pids, numbers, hostile=hostile)
    return {"normal": normal, "hostile": loaded}


# ---- summaries (pure) -------------------------------------------------------------------------
def summarise_latencies(values: list[float], errors: collections.Counter) -> dict:
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "errors": dict(errors)}
    return {"count": len(values), "p50_ms": percentile(values, 50) * 1000, "p99_ms": percentile(values, 99) * 1000,
            "errors": dict(errors)}


def summarise_buyers(samples: BuyerSamples, elapsed: float) -> dict:
    return {"ttft": summarise_latencies(samples.ttfts, collections.Counter()),
            "total": summarise_latencies(samples.totals, collections.Counter()),
            "rps": len(samples.totals) / elapsed, "errors": dict(samples.errors)}


def summarise_kind(tally: KindTally) -> dict:
    by_status: dict[str, list[float]] = collections.defaultdict(list)
    for status, seconds in tally.answers:
        by_status[status].append(seconds)
    return {"answers": {status: {"count": len(times), "p50_s": percentile(times, 50), "max_s": max(times)}
                        for status, times in sorted(by_status.items())},
            "open_at_end": len(tally.open_at_end), "oldest_open_s": max(tally.open_at_end, default=0.0)}


def ratio(hostile: float | None, normal: float | None) -> str:
    if hostile is None or not normal:
        return "—"
    return f"{hostile / normal:.2f}×"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} ms"


def errors_text(errors: dict) -> str:
    return ", ".join(f"{count} × {status}" for status, count in sorted(errors.items())) or "0"


def buyer_rows(normal: dict, hostile: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for label, key in (("TTFT (first content event)", "ttft"), ("whole answer", "total")):
        for q in ("p50", "p99"):
            a, b = normal["buyers"][key][f"{q}_ms"], hostile["buyers"][key][f"{q}_ms"]
            rows.append((f"{label} {q}", ms(a), ms(b), ratio(b, a)))
    a, b = normal["buyers"]["rps"], hostile["buyers"]["rps"]
    rows.append(("buyer requests/s", f"{a:.0f}", f"{b:.0f}", ratio(b, a)))
    rows.append(("buyer errors", errors_text(normal["buyers"]["errors"]), errors_text(hostile["buyers"]["errors"]), ""))
    for q in ("p50", "p99"):
        a, b = normal["models"][f"{q}_ms"], hostile["models"][f"{q}_ms"]
        rows.append((f"`GET /v1/models` {q}", ms(a), ms(b), ratio(b, a)))
    rows.append(("`GET /v1/models` errors", errors_text(normal["models"]["errors"]), errors_text(hostile["models"]["errors"]), ""))
    for label, key, unit in (("gateway CPU (% of one core)", "gateway_cpu_pct", " %"), ("client CPU (% of one core)", "client_cpu_pct", " %"),
                             ("miner CPU (% of one core)", "miner_cpu_pct", " %"),
                             ("everything else on the machine (% of one core)", "others_cpu_pct", " %"),
                             ("gateway peak RSS", "gateway_peak_rss_mib", " MiB")):
        a, b = normal[key], hostile[key]
        rows.append((label, f"{a:.0f}{unit}", f"{b:.0f}{unit}", ratio(b, a)))
    return rows


def kind_rows(hostile: dict, counts: dict[str, int], seconds: float) -> list[tuple[str, ...]]:
    rows = []
    for kind in KINDS:
        summary = hostile["hostile"].get(kind.name)
        if summary is None:
            continue
        answers = "; ".join(f"{status} × {entry['count']} ({entry['p50_s'] * 1000:.0f} ms p50, {entry['max_s'] * 1000:.0f} ms max)"
                            if entry["max_s"] < 1 else
                            f"{status} × {entry['count']} ({entry['p50_s']:.1f} s p50, {entry['max_s']:.1f} s max)"
                            for status, entry in summary["answers"].items()) or "none"
        total = sum(entry["count"] for entry in summary["answers"].values())
        still_open = (f"{summary['open_at_end']} (oldest {summary['oldest_open_s']:.1f} s)" if summary["open_at_end"] else "0")
        rows.append((kind.name, str(counts[kind.name]), kind.sends, f"{total / seconds:.1f}", answers, still_open))
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the run ----------------------------------------------------------------------------------
def machine() -> dict:
    cpu_model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {"cores": os.cpu_count(), "cpu": cpu_model, "load_average_before": os.getloadavg(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), **revision()}


def revision() -> dict:
    """The commit measured, and how many files under engy_node/ differ from it (they are measured too)."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *arguments], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=all", "--", "engy_node")
    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "engy_node_files_changed": len(changed.splitlines())}


def start_gateway(home: str, log_path: Path, body_timeout_s: float) -> subprocess.Popen:
    # Qualification off: the one miner is the bench's own (a private gateway's first-party rig),
    # so it serves at once and no probes run beside the measured traffic.
    env = {**os.environ, "ENGY_GATEWAY__PORT": "0", "ENGY_GATEWAY__MINER_PORT": "0", "ENGY_GATEWAY__PROVIDER_PORT": "0",
           "ENGY_GATEWAY__QUALIFICATION": "false", "ENGY_GATEWAY__BODY_TIMEOUT_S": str(body_timeout_s), "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "engy_node", "--home", home, "--role", "gateway"], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for_ready(gateway: subprocess.Popen, log_path: Path) -> re.Match:
    deadline = time.monotonic() + READY_WAIT_S
    while not (match := READY.search(log_path.read_text())):
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not start within {READY_WAIT_S:g} s; its log:\n{log_path.read_text()}")
        time.sleep(0.1)
    return match


LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) +([\w.]+): ")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Group): ")
VARYING = re.compile(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?")
NOTABLE_LEVELS = ("WARNING", "ERROR", "CRITICAL")
REQUEST_FAILED = re.compile(r"^request \w+ \(\w+\) failed: (\w+)")


def notable_records(log_text: str) -> collections.Counter:
    """The log's warnings and errors, counted by what they say with ids and numbers masked; an
    error with a traceback by the exception it ends with (the one a chained traceback was raised
    with). Two info records are counted too: requests that failed, by kind, and the miner's
    admissions (more than one: its link dropped and it dialled in again, cutting its streams)."""
    records: collections.Counter = collections.Counter()
    current: str | None = None
    for line in [*log_text.splitlines(), "0000-00-00 00:00:00,0 END end: "]:
        if (record := LOG_RECORD.match(line)) is not None:
            if current is not None:
                records[current] += 1
            level, message = record.group(1), line[record.end():].strip()
            current = None
            if level in NOTABLE_LEVELS:
                current = f"{level} {record.group(2)}: {VARYING.sub('N', message)}"
            elif record.group(2) == "engy.gateway.pool" and message.startswith("admitted "):
                current = "INFO engy.gateway.pool: admitted the miner"
            elif record.group(2) == "engy.gateway" and (failed := REQUEST_FAILED.match(message)) is not None:
                current = f"INFO engy.gateway: a request failed: {failed.group(1)}"
        elif current is not None and current.startswith("ERROR") and EXCEPTION_LINE.match(line):
            current = f"ERROR {line.strip()}"
    return records


def print_report(result: dict, counts: dict[str, int], args) -> None:
    normal, hostile = result["normal"], result["hostile"]
    print(f"\nBuyers: {args.buyers} concurrent streamed short completions, {args.seconds:g} s per phase\n")
    print(table(("metric", "normal alone", "normal + hostile", "ratio"), buyer_rows(normal, hostile)))
    print(f"\nHostile clients in the second phase (gateway.body_timeout_s = {args.body_timeout_s:g} s)\n")
    print(table(("kind", "clients", "sends", "requests/s", "answers (time to answer)", "unanswered at the end"),
                kind_rows(hostile, counts, hostile["seconds"])))
    info = result["machine"]
    load = ", ".join(f"{value:.2f}" for value in info["load_average_before"])
    dirty = f" + {info['engy_node_files_changed']} changed files under engy_node/" if info["engy_node_files_changed"] else ""
    print(f"\nMachine: {info['cores']} cores, {info['cpu']}; load average before the run {load}; "
          f"{info['date']}; commit {info['commit']}{dirty}")
    print("Gateway log (warnings, errors, failed requests by kind, miner admissions):" + "".join(
        f"\n  {count} × {text}" for text, count in sorted(result["gateway_log"].items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buyers", type=int, default=4, help="concurrent normal buyers")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    for kind in KINDS:
        parser.add_argument(f"--{kind.name}", type=int, default=kind.default, help=f"concurrent clients sending {kind.sends}")
    parser.add_argument("--body-timeout-s", type=float, default=10.0, help="the gateway's gateway.body_timeout_s (default 60)")
    parser.add_argument("--miner", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.miner:
        run_synthetic_miner(args.miner, args.key, args.home)
        return

    from engy_node.config import load_config
    from engy_node.gateway.role import store_path
    from engy_node.gateway.store import Store

    counts = {kind.name: getattr(args, kind.name.replace("-", "_")) for kind in KINDS}
    info = machine()
    with tempfile.TemporaryDirectory(prefix="engy-hostile-bench-") as home:
        config = load_config(home=home, env={})
        config.paths.data_dir.mkdir(parents=True, exist_ok=True)
        with Store.open(store_path(config)) as store:
            account, funded_key = store.create_buyer("bench")
            store.credit(account, micro_usd=10**12)
            _, broke_key = store.create_buyer("bench-broke")
            _, miner_key = store.register_miner("bench-miner")
        log_path, miner_log_path = Path(home) / "gateway.log", Path(home) / "miner.log"
        gateway = start_gateway(home, log_path, args.body_timeout_s)
        miner = None
        try:
            match = wait_for_ready(gateway, log_path)
            api, miner_ws = httpx.URL(match.group(1)), match.group(2)
            with miner_log_path.open("w") as miner_log:
                miner = subprocess.Popen([sys.executable, __file__, "--miner", miner_ws, "--key", miner_key, "--home", home],
                                         stdout=miner_log, stderr=subprocess.STDOUT)
            endpoint = Endpoint(api.host, api.port, funded_key, broke_key)
            result = trio.run(measure, endpoint, args, {"gateway": gateway.pid, "miner": miner.pid}, counts)
        except BaseException:
            for name, path in (("gateway", log_path), ("miner", miner_log_path)):
                if path.exists():
                    print(f"--- the {name}'s log, last {LOG_TAIL_LINES} lines ---", *path.read_text().splitlines()[-LOG_TAIL_LINES:],
                          sep="\n", file=sys.stderr)
            raise
        finally:
            for process in (miner, gateway):
                if process is not None:
                    process.send_signal(signal.SIGTERM)
                    process.wait(30)
        result["gateway_log"] = dict(notable_records(log_path.read_text()))
    result["machine"] = info
    print(json.dumps(result, indent=2))
    print_report(result, counts, args)


if __name__ == "__main__":
    main()
