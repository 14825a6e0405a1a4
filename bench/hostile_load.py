"""Buyer latency beside hostile traffic, on this code and on the code before issue 12's fix.

    .venv/bin/python bench/hostile_load.py [--buyers 4] [--seconds 20] [--baseline 8cb8027 | --no-baseline]
                                           [--huge-per-s 0.5] [--zero-key-huge-per-s 0.5] [--large-per-s 2]
                                           [--zero-key-large-per-s 2] [--deep-json-per-s 5] [--max-in-flight 4]
                                           [--slow-body 16] [--slow-head 16] [--body-timeout-s 10]
                                           [--flood] [--json PATH]

What issue 12 claims: cheap checks first, bounded work, tokenising off the event loop, so that no
request stalls the others and buyer latency stays flat beside hostile requests. What it fixed:
one ~7.5 MB prompt was rendered and tokenised on the event loop, holding the GIL for seconds,
and every other request of that worker waited. So this measures two gateways the same way, one
after the other: the one at `--baseline` (a temporary `git worktree` of that commit, its gateway
run from there with this venv's Python; the commit before issue 12's work by default) and this
checkout's. Each gets two phases of `--seconds`:

1. **normal alone**: `--buyers` concurrent buyers send short streamed chat completions, each a
   different question, back to back; one more client polls `GET /v1/models` every 50 ms.
2. **normal + hostile**: the same, while hostile clients send, each kind at its own fixed rate
   (open loop: a request is sent on every tick, on its own connection and task, whatever the
   earlier ones are doing; a tick that finds `--max-in-flight` of its kind unanswered is skipped
   and counted, so a stalled gateway is not buried under an ever-growing backlog):

   * `huge` / `zero-key-huge`: a prompt just under the 8 MiB body cap, from a funded key / a $0
     key (the gateway should refuse it from its size alone, without tokenising);
   * `large` / `zero-key-large`: a ~20,000-character prompt inside the model's input limit, from
     a funded key (tokenised in a worker thread, then served) / a $0 key (refused on the balance
     before tokenising);
   * `deep-json`: a body of 100,000 nested JSON arrays;
   * `slow-body` / `slow-head`: a fixed number of connections held open, each re-opened when the
     gateway closes it: complete headers, then the body a byte a second (cut at
     `gateway.body_timeout_s`, lowered here by `--body-timeout-s` so the cut lands inside a phase)
     / a request line, then a header line a byte a second (hypercorn closes a connection whose
     head is incomplete after its keep-alive timeout).

The default rates are an abuser's, not a flood: about 10 hostile requests a second and 32 held
connections, beside buyers that take whatever the gateway can serve. `--flood` instead runs the
request kinds closed-loop (each of a fixed number of clients sends its next request as soon as the
last was answered, so the cheaper the refusal the more of them: a CPU flood from loopback, which
no check inside the application absorbs on a small machine) with the held kinds at 8
connections: the configuration of this benchmark's first figures, kept reproducible.

The buyers' metrics (time to the first content event and to the whole answer p50/p99,
requests/s, errors, `GET /v1/models` p50/p99, and the CPU the gateway, this client, the miner and
the rest of the machine used: a shared machine's other work shows there) are printed per gateway
and phase, with the ratio hostile/normal for each gateway. Then, for each gateway, what each
hostile kind got back: the requests/s sent, the ticks skipped at the bound, the statuses (or
"closed" / "reset": the server hung up without answering) and the time to each, and the requests
still unanswered when the phase ended. Last the machine, date, commits, the settings the
baseline's gateway does not know (left out for it), and each gateway log's warnings and errors.

A synthetic miner (this checkout's: the real link and protocol, an instant scripted answer;
`gateway_overhead`'s) serves both gateways, so the answerer is the same and only the gateway
differs. Qualification is off (the one miner is the bench's own), so no probes run beside the
load. This process is every client, on lean HTTP/1.1 connections (`gateway_overhead`'s
`KeepAliveClient`), so the load generator costs little of the machine it shares with the gateway.
Everything binds 127.0.0.1; every process and the worktree made here are removed here.
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
import shutil
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
DEFAULT_BASELINE = "8cb8027"
"""The last commit before issue 12's gateway work (9374a3c, "cheap checks before costly work")."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""The gateway's default `gateway.max_body_bytes` (the same at the baseline): the huge prompts
stay just under it, so they are read whole and refused for what they are, not for their size on
the wire."""
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
"""Longest a buyer's or a hostile request may take before it counts as failed ("timeout")."""
READY_WAIT_S = 120.0
SERVED_RETRY_S = 0.1
"""Between tries while waiting for the first served request: the baseline's gateway answers 503
at once while no miner is admitted, and back-to-back tries would only fill its log."""
STOP_WAIT_S = 30.0
"""How long a stopped process may take to exit before it is killed: the baseline's gateway may be
inside a seconds-long tokenisation that no signal interrupts."""
GIT_TIMEOUT_S = 120.0
MODELS_POLL_INTERVAL_S = 0.05
RSS_SAMPLE_INTERVAL_S = 0.25
WARM_UP_S = 2.0
LOG_TAIL_LINES = 40
FLOOD_HELD_CONNECTIONS = 8
"""Connections per held kind under `--flood`, as in this benchmark's first figures."""
GATEWAY_SETTINGS_CHECK = (
    "import dataclasses, json, engy_node; from engy_node.config import GatewaySection; "
    "print(json.dumps({'package': engy_node.__file__, 'settings': [field.name for field in dataclasses.fields(GatewaySection)]}))"
)
"""Run with a code tree's PYTHONPATH: which engy_node it loads (it must be that tree's) and which
gateway settings that code knows (an unknown one is a configuration error there)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    sends: str
    paced: bool
    """Sent at `--NAME-per-s` requests a second; otherwise `--NAME` connections held open."""
    default: float
    """Requests a second (paced kinds) or connections (held kinds)."""
    flood_clients: int = 0
    """Closed-loop clients of a paced kind under `--flood` (this benchmark's first defaults)."""

    @property
    def option(self) -> str:
        return self.name.replace("-", "_") + ("_per_s" if self.paced else "")


KINDS = (
    Kind("huge", f"a {MAX_BODY_BYTES // 2**20} MiB prompt (just under the body cap), funded key", True, 0.5, 2),
    Kind("zero-key-huge", f"a {MAX_BODY_BYTES // 2**20} MiB prompt, $0 key", True, 0.5, 2),
    Kind("large", f"a {LARGE_PROMPT_CHARS:,}-character prompt inside the model's limit, funded key", True, 2.0, 2),
    Kind("zero-key-large", f"a {LARGE_PROMPT_CHARS:,}-character prompt, $0 key", True, 2.0, 2),
    Kind("deep-json", f"{DEEP_JSON_LEVELS:,} nested JSON arrays", True, 5.0, 4),
    Kind("slow-body", "headers, then the body a byte a second", False, 16),
    Kind("slow-head", "a request line, then a header a byte a second", False, 16),
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How each hostile kind runs in the hostile phase: `rates` (paced kinds, requests/s, at most
    `max_in_flight` unanswered each), `flood_clients` (paced kinds under `--flood`) and `held`
    (connections of each held kind)."""

    rates: dict[str, float]
    max_in_flight: int
    flood_clients: dict[str, int]
    held: dict[str, int]

    def describe(self, kind: Kind) -> str:
        if not kind.paced:
            return f"{self.held[kind.name]} connections"
        if self.flood_clients:
            return f"{self.flood_clients[kind.name]} closed-loop clients"
        return f"{self.rates[kind.name]:g}/s, ≤ {self.max_in_flight} in flight"

    def active(self, kind: Kind) -> bool:
        if not kind.paced:
            return self.held[kind.name] > 0
        return (self.flood_clients[kind.name] if self.flood_clients else self.rates[kind.name]) > 0


# ---- requests ---------------------------------------------------------------------------------
def filler(chars: int) -> str:
    return (SENTENCE * (chars // len(SENTENCE) + 1))[:chars]


def chat_body(content: str, *, stream: bool = True) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 64, "stream": stream}
    ).encode()


def head(host: str, port: int, key: str, *, content_length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {content_length}\r\n\r\n"
    ).encode()


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
    sent: int = 0
    """Requests sent (paced and flood kinds) or connections opened (held kinds)."""
    skipped: int = 0
    """Ticks of a paced kind that found `max_in_flight` of its requests unanswered."""
    in_flight: int = 0


class Connection:
    """A `KeepAliveClient` that connects on first use and reconnects when the server closed or is
    about to close it."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.client: KeepAliveClient | None = None

    async def request(self, raw: bytes, on_data: Callable[[bytes], None]) -> str:
        """The answer's status, or what happened instead ("closed", "reset", "timeout")."""
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                if self.client is None:
                    self.client = await KeepAliveClient.connect(self.endpoint.host, self.endpoint.port)
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
            client, self.client = self.client, None
            await client.stream.aclose()


def ignore(data: bytes) -> None:
    """Hostile clients only time their answers."""


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
            status = await connection.request(raw, ignore)
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


async def timed_request(connection: Connection, raw: bytes, tally: KindTally) -> None:
    """One request on `connection`, its answer (or its being cut off by the phase's end) tallied."""
    tally.sent += 1
    started = time.perf_counter()
    try:
        status = await connection.request(raw, ignore)
    except trio.Cancelled:
        tally.open_at_end.append(time.perf_counter() - started)
        raise
    tally.answers.append((status, time.perf_counter() - started))


async def send_one(endpoint: Endpoint, raw: bytes, tally: KindTally) -> None:
    """One hostile request on a connection of its own (until answered, or the phase cancels it)."""
    connection = Connection(endpoint)
    tally.in_flight += 1
    try:
        await timed_request(connection, raw, tally)
    finally:
        tally.in_flight -= 1
        await connection.close()


def tick_sends(*, in_flight: int, max_in_flight: int) -> bool:
    """Whether a paced kind's tick sends: not while `max_in_flight` of its requests are unanswered
    (a gateway that stalls would otherwise gather an unbounded backlog of hostile requests, and
    the phase would measure the backlog rather than the rate)."""
    return in_flight < max_in_flight


async def send_paced(
    endpoint: Endpoint,
    rate: float,
    max_in_flight: int,
    make_raw: Callable[[], bytes],
    deadline: float,
    tally: KindTally,
) -> None:
    """Open loop: a request every 1/`rate` s until `deadline`, each on its own task, whatever the
    earlier ones are doing. Ticks are scheduled from the start, so a slow tick does not shift
    the later ones."""
    interval = 1.0 / rate
    async with trio.open_nursery() as requests:
        tick = trio.current_time()
        while tick < deadline:
            await trio.sleep_until(tick)
            if tick_sends(in_flight=tally.in_flight, max_in_flight=max_in_flight):
                requests.start_soon(send_one, endpoint, make_raw(), tally)
            else:
                tally.skipped += 1
            tick += interval


async def repeat_fast(endpoint: Endpoint, make_raw: Callable[[], bytes], deadline: float, tally: KindTally) -> None:
    """`--flood`: one client sending whole requests back to back until `deadline` (the phase
    cancels the one in flight then)."""
    connection = Connection(endpoint)
    try:
        while trio.current_time() < deadline:
            await timed_request(connection, make_raw(), tally)
    finally:
        await connection.close()


async def trickle_once(endpoint: Endpoint, opening: bytes, payload: bytes) -> str:
    """Send `opening` at once and `payload` a byte per `TRICKLE_INTERVAL_S`, until the server
    answers (its status) or hangs up ("closed" / "reset")."""
    try:
        stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
    except OSError:
        return "refused"
    answer = bytearray()
    outcome = "closed"
    async with stream:

        async def send_slowly() -> None:
            try:
                await stream.send_all(opening)
                for index in range(len(payload)):
                    await trio.sleep(TRICKLE_INTERVAL_S)
                    await stream.send_all(payload[index : index + 1])
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


async def hold_trickling(
    endpoint: Endpoint, make: Callable[[], tuple[bytes, bytes]], deadline: float, tally: KindTally
) -> None:
    """One held connection trickling (opening, payload), re-opened each time the gateway answers
    or closes it, until `deadline` (the phase cancels the one open then)."""
    while trio.current_time() < deadline:
        opening, payload = make()
        tally.sent += 1
        started = time.perf_counter()
        try:
            status = await trickle_once(endpoint, opening, payload)
        except trio.Cancelled:
            tally.open_at_end.append(time.perf_counter() - started)
            raise
        tally.answers.append((status, time.perf_counter() - started))


def hostile_clients(
    endpoint: Endpoint, plan: Plan, numbers: Iterator[int], deadline: float, tallies: dict[str, KindTally]
) -> list[Callable[[], Awaitable[None]]]:
    """A coroutine function for every hostile task of the phase: one sender per paced kind (or
    its closed-loop clients under `--flood`), one per held connection."""
    host, port = endpoint.host, endpoint.port
    huge = huge_body()
    huge_funded = post(host, port, endpoint.funded_key, huge)
    huge_broke = post(host, port, endpoint.broke_key, huge)
    deep = post(host, port, endpoint.funded_key, deep_body())
    slow_body = chat_body(question(0) + " " * SLOW_BODY_BYTES)
    requests: dict[str, Callable[[], bytes]] = {
        "huge": lambda: huge_funded,
        "zero-key-huge": lambda: huge_broke,
        "large": lambda: post(host, port, endpoint.funded_key, large_body(next(numbers))),
        "zero-key-large": lambda: post(host, port, endpoint.broke_key, large_body(next(numbers))),
        "deep-json": lambda: deep,
    }
    trickles: dict[str, Callable[[], tuple[bytes, bytes]]] = {
        "slow-body": lambda: (head(host, port, endpoint.funded_key, content_length=len(slow_body)), slow_body),
        "slow-head": lambda: (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n".encode(),
            b"x-slow: " + b"a" * SLOW_HEADER_BYTES + b"\r\n\r\n",
        ),
    }
    tasks: list[Callable[[], Awaitable[None]]] = []
    for kind in KINDS:
        tally = tallies[kind.name]
        if not kind.paced:
            make = trickles[kind.name]
            tasks += [lambda make=make, tally=tally: hold_trickling(endpoint, make, deadline, tally)] * plan.held[
                kind.name
            ]
        elif plan.flood_clients:
            make_raw = requests[kind.name]
            tasks += [
                lambda make_raw=make_raw, tally=tally: repeat_fast(endpoint, make_raw, deadline, tally)
            ] * plan.flood_clients[kind.name]
        elif (rate := plan.rates[kind.name]) > 0:
            make_raw = requests[kind.name]
            tasks.append(
                lambda rate=rate, make_raw=make_raw, tally=tally: send_paced(
                    endpoint, rate, plan.max_in_flight, make_raw, deadline, tally
                )
            )
    return tasks


# ---- phases -----------------------------------------------------------------------------------
def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass  # a worker that exited: its time is no longer on the books
    return total


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has spent, all cores together."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


async def phase(
    endpoint: Endpoint, seconds: float, buyers: int, pids: dict[str, int], numbers: Iterator[int], *, plan: Plan | None
) -> dict:
    """One phase: the normal load for `seconds`, with the hostile clients beside it when `plan`
    is given. Hostile requests stop at the deadline; buyers finish the request they are in."""
    processes = process_tree(pids["gateway"])
    miner = psutil.Process(pids["miner"])
    samples = BuyerSamples()
    models_latencies: list[float] = []
    models_errors: collections.Counter = collections.Counter()
    peak_rss = [0.0]
    tallies = {kind.name: KindTally() for kind in KINDS}
    deadline = trio.current_time() + seconds
    clients = hostile_clients(endpoint, plan, numbers, deadline, tallies) if plan else []
    cpu_before, client_before = cpu_seconds(processes), time.process_time()
    miner_before, machine_before = cpu_seconds([miner]), machine_busy_seconds()
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(buyers):
            nursery.start_soon(buyer, endpoint, numbers, deadline, samples)
        nursery.start_soon(poll_models, endpoint, deadline, models_latencies, models_errors)
        nursery.start_soon(sample_rss, processes, deadline, peak_rss)
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as hostile_nursery:
                for run_client in clients:
                    hostile_nursery.start_soon(run_client)
    elapsed = time.perf_counter() - started
    gateway_cpu, client_cpu = cpu_seconds(processes) - cpu_before, time.process_time() - client_before
    miner_cpu, machine_cpu = cpu_seconds([miner]) - miner_before, machine_busy_seconds() - machine_before
    return {
        "buyers": summarise_buyers(samples, elapsed),
        "models": summarise_latencies(models_latencies, models_errors),
        "gateway_cpu_pct": gateway_cpu * 100 / elapsed,
        "client_cpu_pct": client_cpu * 100 / elapsed,
        "miner_cpu_pct": miner_cpu * 100 / elapsed,
        "others_cpu_pct": (machine_cpu - gateway_cpu - client_cpu - miner_cpu) * 100 / elapsed,
        "gateway_peak_rss_mib": peak_rss[0],
        "seconds": elapsed,
        "hostile": {
            kind.name: summarise_kind(tallies[kind.name], seconds) for kind in KINDS if plan and plan.active(kind)
        },
    }


async def wait_until_served(endpoint: Endpoint) -> None:
    """Until the miner has dialled in and a buyer's request is served (the gateway queues a
    request for a while when no miner has room, so each try waits for the miner itself)."""
    connection = Connection(endpoint)
    raw = post(endpoint.host, endpoint.port, endpoint.funded_key, chat_body(question(0)))
    statuses: collections.Counter = collections.Counter()
    try:
        with trio.move_on_after(READY_WAIT_S):
            while (status := await connection.request(raw, ignore)) != "200":
                statuses[status] += 1
                await trio.sleep(SERVED_RETRY_S)
            return
    finally:
        await connection.close()
    raise SystemExit(
        f"no buyer request was served within {READY_WAIT_S:g} s (answers: {errors_text(statuses)}); "
        "see the gateway's and the miner's logs below"
    )


async def measure(endpoint: Endpoint, args, pids: dict[str, int], plan: Plan) -> dict:
    numbers = iter(range(10**9))
    await wait_until_served(endpoint)
    await phase(endpoint, WARM_UP_S, args.buyers, pids, numbers, plan=None)
    normal = await phase(endpoint, args.seconds, args.buyers, pids, numbers, plan=None)
    loaded = await phase(endpoint, args.seconds, args.buyers, pids, numbers, plan=plan)
    return {"normal": normal, "hostile": loaded}


# ---- summaries (pure) -------------------------------------------------------------------------
def summarise_latencies(values: list[float], errors: collections.Counter) -> dict:
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "errors": dict(errors)}
    return {
        "count": len(values),
        "p50_ms": percentile(values, 50) * 1000,
        "p99_ms": percentile(values, 99) * 1000,
        "errors": dict(errors),
    }


def summarise_buyers(samples: BuyerSamples, elapsed: float) -> dict:
    return {
        "ttft": summarise_latencies(samples.ttfts, collections.Counter()),
        "total": summarise_latencies(samples.totals, collections.Counter()),
        "rps": len(samples.totals) / elapsed,
        "errors": dict(samples.errors),
    }


def summarise_kind(tally: KindTally, seconds: float) -> dict:
    """Rates are over the phase's `seconds`, the time the hostile clients ran."""
    by_status: dict[str, list[float]] = collections.defaultdict(list)
    for status, elapsed in tally.answers:
        by_status[status].append(elapsed)
    return {
        "sent_per_s": tally.sent / seconds,
        "answered_per_s": len(tally.answers) / seconds,
        "skipped": tally.skipped,
        "answers": {
            status: {"count": len(times), "p50_s": percentile(times, 50), "max_s": max(times)}
            for status, times in sorted(by_status.items())
        },
        "open_at_end": len(tally.open_at_end),
        "oldest_open_s": max(tally.open_at_end, default=0.0),
    }


def ratio(hostile: float | None, normal: float | None) -> str:
    if hostile is None or not normal:
        return "—"
    return f"{hostile / normal:.2f}×"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} ms"


def errors_text(errors: dict) -> str:
    return ", ".join(f"{count} × {status}" for status, count in sorted(errors.items())) or "0"


def buyer_rows(normal: dict, hostile: dict) -> list[tuple[str, str, str, str]]:
    """(metric, normal alone, normal + hostile, ratio) for one gateway."""
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
    rows.append(
        (
            "`GET /v1/models` answered",
            str(normal["models"]["count"]),
            str(hostile["models"]["count"]),
            ratio(hostile["models"]["count"], normal["models"]["count"]),
        )
    )
    rows.append(
        (
            "`GET /v1/models` errors",
            errors_text(normal["models"]["errors"]),
            errors_text(hostile["models"]["errors"]),
            "",
        )
    )
    for label, key, unit in (
        ("gateway CPU (% of one core)", "gateway_cpu_pct", " %"),
        ("client CPU (% of one core)", "client_cpu_pct", " %"),
        ("miner CPU (% of one core)", "miner_cpu_pct", " %"),
        ("everything else on the machine (% of one core)", "others_cpu_pct", " %"),
        ("gateway peak RSS", "gateway_peak_rss_mib", " MiB"),
    ):
        a, b = normal[key], hostile[key]
        rows.append((label, f"{a:.0f}{unit}", f"{b:.0f}{unit}", ratio(b, a)))
    return rows


def side_by_side(results: list[dict]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """One row per metric: for each gateway, normal alone, normal + hostile and their ratio."""
    header = ["metric"]
    for result in results:
        header += [f"{result['label']} normal", f"{result['label']} hostile", f"{result['label']} ratio"]
    per_gateway = [buyer_rows(result["normal"], result["hostile"]) for result in results]
    rows = [
        tuple([rows_of_all[0][0], *(cell for row in rows_of_all for cell in row[1:])])
        for rows_of_all in zip(*per_gateway)
    ]
    return tuple(header), rows


def seconds_text(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def kind_rows(hostile: dict, plan: Plan) -> list[tuple[str, ...]]:
    rows = []
    for kind in KINDS:
        summary = hostile["hostile"].get(kind.name)
        if summary is None:
            continue
        answers = (
            "; ".join(
                f"{status} × {entry['count']} ({seconds_text(entry['p50_s'])} p50, {seconds_text(entry['max_s'])} max)"
                for status, entry in summary["answers"].items()
            )
            or "none"
        )
        still_open = (
            f"{summary['open_at_end']} (oldest {summary['oldest_open_s']:.1f} s)" if summary["open_at_end"] else "0"
        )
        skipped = str(summary["skipped"]) if kind.paced and not plan.flood_clients else "—"
        rows.append(
            (kind.name, kind.sends, plan.describe(kind), f"{summary['sent_per_s']:.1f}", skipped, answers, still_open)
        )
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---- gateways under test ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """A gateway to measure: `label` in the tables, run from the code tree `root`."""

    label: str
    root: Path
    commit: str
    engy_node_files_changed: int = 0


def git(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def this_checkout() -> Target:
    """This checkout, and how many files under engy_node/ differ from its commit (measured too)."""
    changed = git("--no-optional-locks", "status", "--porcelain", "--untracked-files=all", "--", "engy_node").stdout
    return Target(
        "ours", ROOT, git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown", len(changed.splitlines())
    )


def add_worktree(revision: str, parent: Path) -> Target:
    resolved = git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if resolved.returncode != 0:
        raise SystemExit(
            f"--baseline {revision}: not a commit of this repository; name one `git log --oneline` lists, "
            "or pass --no-baseline to measure this checkout alone"
        )
    commit = resolved.stdout.strip()
    tree = parent / "tree"
    added = git("worktree", "add", "--detach", str(tree), commit)
    if added.returncode != 0:
        raise SystemExit(f"git worktree add {tree} {commit[:12]} failed: {added.stderr.strip()}")
    return Target("baseline", tree, commit[:7])


def remove_worktree(tree: Path) -> None:
    removed = git("worktree", "remove", "--force", str(tree))
    if removed.returncode != 0:
        print(
            f"could not remove the baseline's worktree {tree}: {removed.stderr.strip()}; "
            "remove it with `git worktree remove --force` and `git worktree prune`",
            file=sys.stderr,
        )


def code_env(root: Path) -> dict[str, str]:
    """The environment that makes this venv's Python load engy_node from `root` (PYTHONPATH comes
    before the venv's editable install of this checkout)."""
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}


def known_gateway_settings(target: Target) -> set[str]:
    """The gateway settings `target`'s code knows, after checking that its engy_node is the one
    a process run from `target.root` loads."""
    checked = subprocess.run(
        [sys.executable, "-c", GATEWAY_SETTINGS_CHECK],
        cwd=target.root,
        env=code_env(target.root),
        capture_output=True,
        text=True,
        timeout=READY_WAIT_S,
    )
    if checked.returncode != 0:
        raise SystemExit(f"importing engy_node from {target.root} failed:\n{checked.stderr}")
    found = json.loads(checked.stdout)
    if not Path(found["package"]).resolve().is_relative_to(target.root.resolve()):
        raise SystemExit(
            f"run from {target.root}, Python loaded engy_node from {found['package']}: the {target.label} "
            "would not be measured; check for a PYTHONPATH or .pth entry that shadows it"
        )
    return set(found["settings"])


def gateway_settings(args) -> dict[str, str]:
    # Qualification off: the one miner is the bench's own (a private gateway's first-party rig),
    # so it serves at once and no probes run beside the measured traffic.
    return {
        "port": "0",
        "miner_port": "0",
        "provider_port": "0",
        "qualification": "false",
        "body_timeout_s": f"{args.body_timeout_s:g}",
    }


def start_gateway(target: Target, home: str, log_path: Path, settings: dict[str, str]) -> subprocess.Popen:
    env = {**code_env(target.root), **{f"ENGY_GATEWAY__{name.upper()}": value for name, value in settings.items()}}
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", home, "--role", "gateway"],
            cwd=target.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def wait_for_ready(gateway: subprocess.Popen, log_path: Path) -> re.Match:
    deadline = time.monotonic() + READY_WAIT_S
    while not (match := READY.search(log_path.read_text())):
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not start within {READY_WAIT_S:g} s; its log:\n{log_path.read_text()}")
        time.sleep(0.1)
    return match


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL for it and its children if it has not exited within `STOP_WAIT_S`."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        print(f"pid {process.pid} did not stop within {STOP_WAIT_S:g} s of SIGTERM; killing it", file=sys.stderr)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        process.kill()
        process.wait(STOP_WAIT_S)


LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) +([\w.]+): ")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Group): ")
VARYING = re.compile(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?")
NOTABLE_LEVELS = ("WARNING", "ERROR", "CRITICAL")
REQUEST_FAILED = re.compile(r"^request \w+ \(\w+\) failed: (\w+)")
ERROR_EXAMPLE_LINES = 60


def notable_records(log_text: str) -> tuple[collections.Counter, dict[str, list[str]]]:
    """The log's warnings and errors, counted by what they say with ids and numbers masked; an
    error with a traceback by the exception it ends with (the one a chained traceback was raised
    with), and the first of each such error as logged (its first `ERROR_EXAMPLE_LINES` lines:
    where it was raised is what a fix needs). Two info records are counted too: requests that
    failed, by kind, and the miner's admissions (more than one: its link dropped and it dialled
    in again, cutting its streams)."""
    records: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = {}
    current: str | None = None
    lines: list[str] = []
    for line in [*log_text.splitlines(), "0000-00-00 00:00:00,0 END end: "]:
        if (record := LOG_RECORD.match(line)) is not None:
            if current is not None:
                records[current] += 1
                if current.startswith("ERROR") and current not in examples:
                    examples[current] = lines[:ERROR_EXAMPLE_LINES]
            level, message = record.group(1), line[record.end() :].strip()
            current, lines = None, [line]
            if level in NOTABLE_LEVELS:
                current = f"{level} {record.group(2)}: {VARYING.sub('N', message)}"
            elif record.group(2) == "engy.gateway.pool" and message.startswith("admitted "):
                current = "INFO engy.gateway.pool: admitted the miner"
            elif record.group(2) == "engy.gateway" and (failed := REQUEST_FAILED.match(message)) is not None:
                current = f"INFO engy.gateway: a request failed: {failed.group(1)}"
            continue
        lines.append(line)
        if current is not None and current.startswith("ERROR") and EXCEPTION_LINE.match(line):
            current = f"ERROR {line.strip()}"
    return records, examples


def measure_target(target: Target, args, plan: Plan) -> dict:
    """Start `target`'s gateway and the synthetic miner in a fresh home, run the phases, stop both."""
    from engy_node.config import load_config
    from engy_node.gateway.role import store_path
    from engy_node.gateway.store import Store

    known = known_gateway_settings(target)
    wanted = gateway_settings(args)
    settings = {name: value for name, value in wanted.items() if name in known}
    load_before = os.getloadavg()
    print(
        f"measuring {target.label}: the gateway at {target.commit}, run from {target.root} …",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="engy-hostile-bench-") as home:
        # The store is made with this checkout's code: its schema is the baseline's too (the
        # gateway refuses, naming it, a store whose schema it does not know).
        config = load_config(home=home, env={})
        config.paths.data_dir.mkdir(parents=True, exist_ok=True)
        with Store.open(store_path(config)) as store:
            account, funded_key = store.create_buyer("bench")
            store.credit(account, micro_usd=10**12)
            _, broke_key = store.create_buyer("bench-broke")
            _, miner_key = store.register_miner("bench-miner")
        log_path, miner_log_path = Path(home) / "gateway.log", Path(home) / "miner.log"
        gateway = start_gateway(target, home, log_path, settings)
        miner = None
        try:
            match = wait_for_ready(gateway, log_path)
            api, miner_ws = httpx.URL(match.group(1)), match.group(2)
            with miner_log_path.open("w") as miner_log:
                miner = subprocess.Popen(
                    [sys.executable, __file__, "--miner", miner_ws, "--key", miner_key, "--home", home],
                    stdout=miner_log,
                    stderr=subprocess.STDOUT,
                )
            endpoint = Endpoint(api.host, api.port, funded_key, broke_key)
            result = trio.run(measure, endpoint, args, {"gateway": gateway.pid, "miner": miner.pid}, plan)
        except BaseException:
            for name, path in (("gateway", log_path), ("miner", miner_log_path)):
                if path.exists():
                    print(
                        f"--- the {target.label} {name}'s log, last {LOG_TAIL_LINES} lines ---",
                        *path.read_text().splitlines()[-LOG_TAIL_LINES:],
                        sep="\n",
                        file=sys.stderr,
                    )
            raise
        finally:
            for process in (miner, gateway):
                if process is not None:
                    stop(process)
        records, examples = notable_records(log_path.read_text())
        result["gateway_log"], result["gateway_log_errors"] = dict(records), examples
    return {
        **result,
        "label": target.label,
        "commit": target.commit,
        "root": str(target.root),
        "engy_node_files_changed": target.engy_node_files_changed,
        "load_average_before": load_before,
        "settings_left_out": sorted(set(wanted) - known),
    }


# ---- the run ----------------------------------------------------------------------------------
def machine() -> dict:
    cpu_model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def print_report(results: list[dict], plan: Plan, args, info: dict) -> None:
    mode = "closed-loop clients (--flood)" if plan.flood_clients else "open loop at fixed rates"
    print(
        f"\nBuyers: {args.buyers} concurrent streamed short completions, {args.seconds:g} s per phase; "
        f"hostile clients {mode}\n"
    )
    print(table(*side_by_side(results)))
    for result in results:
        body_timeout = (
            f"gateway.body_timeout_s = {args.body_timeout_s:g} s"
            if "body_timeout_s" not in result["settings_left_out"]
            else "no body timeout at this commit"
        )
        print(f"\nHostile clients against {result['label']} (the gateway at {result['commit']}; {body_timeout})\n")
        print(
            table(
                (
                    "kind",
                    "sends",
                    "runs as",
                    "sent/s (held: opened/s)",
                    "ticks skipped",
                    "answers (time to answer)",
                    "unanswered at the end",
                ),
                kind_rows(result["hostile"], plan),
            )
        )
    print(f"\nMachine: {info['cores']} cores, {info['cpu']}; {info['date']}")
    for result in results:
        load = ", ".join(f"{value:.2f}" for value in result["load_average_before"])
        dirty = (
            f" + {result['engy_node_files_changed']} changed files under engy_node/"
            if result["engy_node_files_changed"]
            else ""
        )
        left_out = (
            f"; settings it does not know, left out: {', '.join(result['settings_left_out'])}"
            if result["settings_left_out"]
            else ""
        )
        print(
            f"{result['label']}: commit {result['commit']}{dirty}, run from {result['root']}; load average before it {load}{left_out}"
        )
        print(
            "  gateway log (warnings, errors, failed requests by kind, miner admissions):"
            + "".join(f"\n    {count} × {text}" for text, count in sorted(result["gateway_log"].items()))
        )
        for text, lines in result["gateway_log_errors"].items():
            print(f"  the first {text!r}, as logged:", *(f"    {line}" for line in lines), sep="\n")


def parse_plan(args) -> Plan:
    for kind in KINDS:
        value = getattr(args, kind.option)
        if value is not None and value < 0:
            raise SystemExit(f"--{kind.option.replace('_', '-')} {value:g}: must be 0 (none) or more")
    if args.max_in_flight < 1:
        raise SystemExit(f"--max-in-flight {args.max_in_flight}: must be at least 1")
    held_default = FLOOD_HELD_CONNECTIONS if args.flood else None
    return Plan(
        rates={kind.name: getattr(args, kind.option) for kind in KINDS if kind.paced},
        max_in_flight=args.max_in_flight,
        flood_clients={kind.name: kind.flood_clients for kind in KINDS if kind.paced} if args.flood else {},
        held={
            kind.name: int(
                getattr(args, kind.option) if getattr(args, kind.option) is not None else held_default or kind.default
            )
            for kind in KINDS
            if not kind.paced
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buyers", type=int, default=4, help="concurrent normal buyers")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument(
        "--baseline",
        default=DEFAULT_BASELINE,
        metavar="REV",
        help=f"the commit whose gateway is measured beside this checkout's (default {DEFAULT_BASELINE}, before issue 12)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="measure this checkout's gateway alone")
    for kind in KINDS:
        if kind.paced:
            parser.add_argument(
                f"--{kind.name}-per-s",
                type=float,
                default=kind.default,
                help=f"requests/s sending {kind.sends} (default {kind.default:g}; 0: none)",
            )
        else:
            parser.add_argument(
                f"--{kind.name}",
                type=int,
                default=None,
                help=f"connections held sending {kind.sends} (default {kind.default:g}, "
                f"{FLOOD_HELD_CONNECTIONS} under --flood; 0: none)",
            )
    parser.add_argument(
        "--max-in-flight", type=int, default=4, help="unanswered requests per paced kind before its ticks are skipped"
    )
    parser.add_argument(
        "--flood",
        action="store_true",
        help="closed-loop hostile clients instead (a CPU flood; this benchmark's first configuration)",
    )
    parser.add_argument(
        "--body-timeout-s", type=float, default=10.0, help="our gateway's gateway.body_timeout_s (default 60)"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw results here")
    parser.add_argument("--miner", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.miner:
        run_synthetic_miner(args.miner, args.key, args.home)
        return

    plan = parse_plan(args)
    info = machine()
    results = []
    worktree_parent = None if args.no_baseline else Path(tempfile.mkdtemp(prefix="engy-hostile-baseline-"))
    try:
        if worktree_parent is not None:
            baseline = add_worktree(args.baseline, worktree_parent)
            try:
                results.append(measure_target(baseline, args, plan))
            finally:
                remove_worktree(baseline.root)
        results.append(measure_target(this_checkout(), args, plan))
    finally:
        if worktree_parent is not None:
            shutil.rmtree(worktree_parent, ignore_errors=True)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": info, "plan": dataclasses.asdict(plan), "results": results}, indent=2)
        )
    print_report(results, plan, args, info)


if __name__ == "__main__":
    main()
