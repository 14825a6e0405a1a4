"""What the gateway adds to a request, measured side by side in one run.

    .venv/bin/python bench/gateway_overhead.py [--levels 1,16,64,256] [--plain-levels 1,16,64] [--floor-levels 16] [--requests 512]
                                               [--gateway-workers N] [--baseline REV|DIR [--together]] [--rounds N]

A fast synthetic miner (the real link and protocol, an instant scripted 90-character answer,
chunks coalesced as the real miner coalesces them: the first at once, the rest in the next) runs
in its own process. The same requests go two ways, one after the other at each level:

* **direct**: to a synthetic miner dialled into a bare protocol-level gateway inside this process
  (serve frame out, chunks and response back) — the cost of the miner and the websocket alone;
* **gateway**: through `engy-node --role gateway` (a separate process) over its OpenAI API —
  authentication, tokenisation with the chat template, the billing hold, routing, relay, SSE,
  settlement and the request log included — from a lean keep-alive HTTP/1.1 client, one
  connection per concurrent request.

Streamed levels report time to the first content event p50/p99 both ways and the difference,
requests/s, streamed chunks/s; non-streamed levels ("short completions") the same with the time
to the whole answer. Both report the gateway's CPU per request and its RSS (all its worker
processes together, `--gateway-workers`), and the client's CPU per request (this process), which
shares the machine's cores with the gateway. Every request asks a different question. Last, the
same client against the HTTP server alone (hypercorn's trio worker with a 15-line ASGI app: the
floor under any gateway on this stack; `--floor-levels`), both as hypercorn comes and as the
gateway runs it (`hypercorn_edges.EdgeConfig`: fewer writes, no idle-timer task per request),
in alternating order. All these processes share the machine.

With `--baseline REV` (a commit of this repository, exported with `git archive` into a temporary
directory) or `--baseline DIR` (a code tree already on disk), a second gateway runs that code,
from this venv, in its own home with its own synthetic miner, and every level is measured on both
gateways, one after the other, in an order that alternates from level to level and round to
round (`--rounds`), so that the machine's drift falls on both alike. With `--together` both are
loaded at the same time instead, each with its own connections and requests, so that even the
machine's speed from one second to the next falls on both alike (each then shares the cores
with the other, so its figures are not those it shows alone; their ratio is what to read). A
last table puts them side by side: CPU per request, requests/s and TTFT, baseline → ours, with
the ratio. Everything binds
127.0.0.1; every process and directory made here is removed here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engy_node.percentile import nearest_rank  # noqa: E402

ANSWER = "The quick brown fox jumps over the lazy dog. " * 2
CHUNK_CHARS = len(ANSWER) // 8
READY = re.compile(r"gateway ready: buyer API (http://127\.0\.0\.1:\d+), miners dial (ws://127\.0\.0\.1:\d+/gw)")


def run_synthetic_miner(
    gateway_url: str, miner_key: str, home: str, *, script: dict | None = None, max_inflight: int = 1024
) -> None:
    """The synthetic miner dialled into `gateway_url`, answering every frame with `Script(**script)`
    (by default this bench's: `ANSWER` in `CHUNK_CHARS` pieces, coalesced as the real miner's)."""
    from engy_node.config import load_config
    from engy_node.miner.link import Identity
    from engy_node.models import SMOLLM2_135M
    from engy_node.serve.checkpoint import embedded_checkpoint
    from engy_node.served_model import load_served_model
    from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link

    config = load_config(home=home, env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"})
    served = load_served_model(
        SMOLLM2_135M, embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
    )
    answer = Script(**(script if script is not None else {"text": ANSWER, "chunk_chars": CHUNK_CHARS}))
    handler = SyntheticHandler(served, lambda frame: answer)

    async def main() -> None:
        async with httpx.AsyncClient() as http:
            link = synthetic_link(
                gateway_url=gateway_url,
                model=served,
                identity=Identity(miner_key=miner_key),
                handler=handler,
                http=http,
                max_inflight=max_inflight,
            )
            await link.run()

    trio.run(main)


def spawn_miner(gateway_url: str, miner_key: str, home: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--miner", gateway_url, "--key", miner_key, "--home", home],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


FLOOR_SSE = [
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"The quick brown fox jumps over the lazy dog."}}]}\n\n',
    b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
]


FLOOR_SERVERS = ("hypercorn", "edge")
"""The floor's HTTP server: hypercorn as it comes, and with this checkout's `EdgeConfig`."""


async def answer_lifespan(scope, receive, send) -> bool:
    """Answer an ASGI lifespan scope (startup, then shutdown); False for any other scope."""
    if scope["type"] != "lifespan":
        return False
    while (await receive())["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
    return True


def serve_asgi(app, config, name: str) -> None:
    """Serve `app` with hypercorn's trio worker on a free port of 127.0.0.1, no access log, and
    print `{name} ready: URL` once it listens (the parent reads that line)."""
    from hypercorn.trio import serve

    config.bind = ["127.0.0.1:0"]
    config.accesslog = None

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, app, config)
            print(f"{name} ready: {binds[0]}", flush=True)

    trio.run(run)


def run_floor_server(kind: str) -> None:
    """The HTTP server alone: hypercorn's trio worker, as it comes or as the gateway runs it
    (`kind`), with an ASGI app that reads the body and answers a fixed SSE stream in three body
    messages. What any gateway on this stack pays per request before doing anything of its own."""
    from hypercorn.config import Config

    from engy_node.hypercorn_edges import EdgeConfig

    async def app(scope, receive, send) -> None:
        if await answer_lifespan(scope, receive, send):
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for index, event in enumerate(FLOOR_SSE):
            await send({"type": "http.response.body", "body": event, "more_body": index < len(FLOOR_SSE) - 1})

    config = EdgeConfig(protocol_error_body=lambda status, path: ([], b"")) if kind == "edge" else Config()
    serve_asgi(app, config, "floor")


def percentile(values: list[float], q: float) -> float:
    return nearest_rank(sorted(values), q)


async def direct_level(harness, concurrency: int, total: int, *, stream: bool) -> dict:
    from engy_node.protocol.miner import Message, ServeRequest

    ttfts: list[float] = []
    counter = iter(range(total))

    async def worker() -> None:
        for number in counter:
            request = ServeRequest(
                messages=(Message("user", question(number)),), max_tokens=64, engy_request_id=uuid.uuid4().hex
            )
            started = time.perf_counter()
            corr_id = await harness.serve(request, stream=stream)
            record = harness.requests[corr_id]
            await harness.wait_for(lambda: record.chunks or record.response is not None)
            ttfts.append(time.perf_counter() - started)
            await harness.result(corr_id)
            del harness.requests[corr_id]

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    elapsed = time.perf_counter() - started
    return {
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "rps": total / elapsed,
    }


class KeepAliveClient:
    """A lean HTTP/1.1 client on one keep-alive connection: it writes a prepared request and
    reads just enough of the answer (status, Content-Length or chunked framing) to time it.

    The load generator shares the machine's two cores with the gateway and the miner, so it
    must cost little per request; a general-purpose client (httpx) spends more CPU per request
    than the gateway itself and would measure mostly itself."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.closing = False
        """The server said `connection: close` (hypercorn does after 1,000 requests): reconnect."""

    @classmethod
    async def connect(cls, host: str, port: int) -> KeepAliveClient:
        return cls(await trio.open_tcp_stream(host, port))

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data

    async def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            await self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def _exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def request(self, raw: bytes, on_data) -> int:
        """Send `raw`, call `on_data(bytes)` for each piece of the body as it arrives; returns the status."""
        await self.stream.send_all(raw)
        status = int((await self._line()).split(b" ", 2)[1])
        length, chunked = None, False
        while line := await self._line():
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                self.closing = True
        if not chunked:
            on_data(await self._exactly(length or 0))
            return status
        while size := int((await self._line()).split(b";")[0], 16):
            on_data(await self._exactly(size))
            await self._exactly(2)
        await self._exactly(2)
        return status


def question(number: int) -> str:
    """Every request's question differs (by its number), as real traffic's do: nothing on either
    path can answer from a cache of whole prompts."""
    return f"Say the sentence. This is request {number}."


def chat_request(host: str, port: int, key: str, *, stream: bool, number: int) -> bytes:
    body = json.dumps(
        {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": question(number)}],
            "max_tokens": 64,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def keep_alive_load(api: str, concurrency: int, total: int, one) -> float:
    """`total` requests over `concurrency` keep-alive connections to `api`: each connection takes
    the next request number and awaits `one(client, url, number)` for it, reconnecting when the
    server closes. Returns the seconds they all took."""
    counter = iter(range(total))
    url = httpx.URL(api)

    async def worker() -> None:
        client = await KeepAliveClient.connect(url.host, url.port)
        try:
            for number in counter:
                await one(client, url, number)
                if client.closing:
                    await client.stream.aclose()
                    client = await KeepAliveClient.connect(url.host, url.port)
        finally:
            await client.stream.aclose()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - started


async def gateway_level(api: str, key: str, concurrency: int, total: int, *, stream: bool) -> dict:
    """TTFT is to the first SSE event carrying content (streamed) or to the whole answer (not)."""
    ttfts: list[float] = []
    chunks_seen = 0
    errors = 0

    async def one(client: KeepAliveClient, url: httpx.URL, number: int) -> None:
        nonlocal errors
        raw = chat_request(url.host, url.port, key, stream=stream, number=number)
        started = time.perf_counter()
        first: list[float] = []

        def on_data(data: bytes) -> None:
            nonlocal chunks_seen
            with_content = data.count(b'"content":"') - data.count(b'"content":""')
            chunks_seen += with_content
            if not first and (with_content or not stream):
                first.append(time.perf_counter() - started)

        if await client.request(raw, on_data) != 200:
            errors += 1
        elif first:
            ttfts.append(first[0])

    elapsed = await keep_alive_load(api, concurrency, total, one)
    return {
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "rps": (total - errors) / elapsed,
        "chunks_per_s": chunks_seen / elapsed,
        "errors": errors,
    }


def process_tree(pid: int) -> list[psutil.Process]:
    """The gateway and its worker processes (`gateway.workers`)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(process.cpu_times()[:2]) for process in processes)


SETUP_HOME = (
    "import json, sys, engy_node; from engy_node.config import load_config; from engy_node.gateway.role import store_path; "
    "from engy_node.gateway.store import Store; config = load_config(home=sys.argv[1], env={}); "
    "config.paths.data_dir.mkdir(parents=True, exist_ok=True); store = Store.open(store_path(config)); "
    "account, buyer_key = store.create_buyer('bench'); store.credit(account, micro_usd=10**12); "
    "_, miner_key = store.register_miner('bench-miner'); store.close(); "
    "print(json.dumps({'package': engy_node.__file__, 'buyer_key': buyer_key, 'miner_key': miner_key}))"
)
"""Run with a code tree's PYTHONPATH in a fresh home: the store as that tree's code makes it (a
gateway refuses a store whose schema it does not know), a funded buyer and a miner key."""


@dataclasses.dataclass
class Gateway:
    """One gateway under test: `label` in the tables, its code tree, its process and endpoints."""

    label: str
    root: Path
    home: str
    process: subprocess.Popen | None = None
    miner: subprocess.Popen | None = None
    api: str = ""
    buyer_key: str = ""

    @property
    def log_path(self) -> Path:
        return Path(self.home) / "gateway.log"

    def env(self) -> dict[str, str]:
        """This venv's Python loading engy_node from `root` (PYTHONPATH comes before the venv's
        editable install of this checkout)."""
        return {**os.environ, "PYTHONPATH": str(self.root), "PYTHONUNBUFFERED": "1"}

    def start(self, workers: int) -> None:
        made = subprocess.run(
            [sys.executable, "-c", SETUP_HOME, self.home],
            cwd=self.root,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if made.returncode != 0:
            raise SystemExit(
                f"setting up the {self.label} gateway's store with the code in {self.root} failed:\n{made.stderr}"
            )
        found = json.loads(made.stdout)
        if not Path(found["package"]).resolve().is_relative_to(self.root.resolve()):
            raise SystemExit(
                f"run from {self.root}, Python loaded engy_node from {found['package']}: the {self.label} gateway "
                "would not be measured; check for a PYTHONPATH or .pth entry that shadows it"
            )
        self.buyer_key = found["buyer_key"]
        self.process = spawn_gateway(self.root, self.home, self.env(), workers, self.log_path)
        match = wait_for_gateway(self.process, self.log_path, f"the {self.label} gateway", 120, 0.1)
        self.api = match.group(1) + "/v1"
        self.miner = spawn_miner(match.group(2), found["miner_key"], self.home)

    def stop(self) -> None:
        for process in (self.miner, self.process):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(30)


BENCH_GATEWAY_ENV = {
    "ENGY_GATEWAY__PORT": "0",
    "ENGY_GATEWAY__MINER_PORT": "0",
    "ENGY_GATEWAY__PROVIDER_PORT": "0",
    # Qualification off: the synthetic miner would otherwise stay on probation (probes only,
    # every paid request refused) for the whole run; what is measured is the relay.
    "ENGY_GATEWAY__QUALIFICATION": "false",
}
"""A bench gateway's settings: every port chosen by the system (read back from its log), no qualification."""


def spawn_gateway(root: Path, home: str, env: dict[str, str], workers: int, log_path: Path) -> subprocess.Popen:
    """`engy-node --role gateway` in `home`, run from `root` with `env` and `workers` worker
    processes, its output to `log_path`."""
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", home, "--role", "gateway"],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, **BENCH_GATEWAY_ENV, "ENGY_GATEWAY__WORKERS": str(workers)},
        )


def wait_for_gateway(process: subprocess.Popen, log_path: Path, name: str, timeout_s: float, poll_s: float) -> re.Match:
    """The gateway's `READY` line (group 1: its buyer API, group 2: where miners dial); exits
    with its log if it stops or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not (match := READY.search(log_path.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start; its log:\n{log_path.read_text()}")
        time.sleep(poll_s)
    return match


def baseline_tree(baseline: str, parent: Path) -> Path:
    """The code tree for `--baseline`: a directory as it is, or a commit of this repository
    exported into `parent` (`git archive`: nothing in the repository changes)."""
    if Path(baseline).is_dir():
        return Path(baseline).resolve()
    exported = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", f"{baseline}^{{commit}}"], capture_output=True, timeout=120
    )
    if exported.returncode != 0:
        raise SystemExit(
            f"--baseline {baseline}: neither a directory nor a commit of {ROOT} "
            f"({exported.stderr.decode().strip()}); name one `git log --oneline` lists"
        )
    tree = parent / "baseline"
    with tarfile.open(fileobj=io.BytesIO(exported.stdout)) as archive:
        archive.extractall(tree, filter="data")
    return tree


def describe(root: Path) -> str:
    """The commit a code tree is at, and whether it has changes under engy_node/ (an exported or
    copied tree: its path)."""
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True
    )
    lines = head.stdout.split()
    if head.returncode != 0 or Path(lines[0]).resolve() != root.resolve():
        return str(root)
    changed = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--", "engy_node"], capture_output=True, text=True
    )
    dirty = len(changed.stdout.splitlines())
    return lines[1][:10] + (f" + {dirty} changed files under engy_node/" if dirty else "")


async def measure_gateways(gateways: list[Gateway], concurrency: int, count: int, *, stream: bool) -> dict[str, dict]:
    """The gateways at once (one, or all for `--together`), each with its own `concurrency`
    connections and `count` requests: the machine's speed at each moment falls on all of them
    alike. The client's CPU is shared, so each gateway is given its share per request of all."""
    trees = {gateway.label: process_tree(gateway.process.pid) for gateway in gateways}
    before = {label: cpu_seconds(processes) for label, processes in trees.items()}
    client_before = time.process_time()
    through: dict[str, dict] = {}

    async def one(gateway: Gateway) -> None:
        through[gateway.label] = await gateway_level(gateway.api, gateway.buyer_key, concurrency, count, stream=stream)

    async with trio.open_nursery() as nursery:
        for gateway in gateways:
            nursery.start_soon(one, gateway)
    client_ms = (time.process_time() - client_before) * 1000 / (count * len(gateways))
    return {
        label: {
            **through[label],
            "cpu_ms_per_request": (cpu_seconds(processes) - before[label]) * 1000 / count,
            "client_cpu_ms_per_request": client_ms,
            "rss_mib": sum(process.memory_info().rss for process in processes) / 2**20,
        }
        for label, processes in trees.items()
    }


async def measure(
    levels: list[tuple[bool, int]],
    total: int,
    rounds: int,
    home: str,
    gateways: list[Gateway],
    *,
    together: bool = False,
) -> list[dict]:
    from engy_node.testing.gateway import GatewayHarness

    rows = []
    async with trio.open_nursery() as nursery:
        harness = GatewayHarness(workers=1)
        await nursery.start(harness.run)
        direct_miner = spawn_miner(harness.url, "harness-needs-no-key", home)
        try:
            await harness.wait_for(lambda: 0 in harness.legs, timeout=120)
            for stream in (True, False):  # warm every path up
                await direct_level(harness, 4, 64, stream=stream)
                for gateway in gateways:
                    await gateway_level(gateway.api, gateway.buyer_key, 4, 64, stream=stream)
            for number in range(rounds):
                for index, (stream, concurrency) in enumerate(levels):
                    count = max(total, concurrency * 2)
                    direct = await direct_level(harness, concurrency, count, stream=stream)
                    if together:
                        measured = await measure_gateways(gateways, concurrency, count, stream=stream)
                    else:
                        # Who goes first alternates from level to level and round to round, so that a
                        # machine slowing down or speeding up during the run favours no gateway.
                        first = (number + index) % len(gateways)
                        measured = {}
                        for gateway in gateways[first:] + gateways[:first]:
                            measured |= await measure_gateways([gateway], concurrency, count, stream=stream)
                    rows.append(
                        {
                            "stream": stream,
                            "concurrency": concurrency,
                            "requests": count,
                            "round": number + 1,
                            "direct": direct,
                            "gateways": measured,
                        }
                    )
        finally:
            direct_miner.send_signal(signal.SIGTERM)
            direct_miner.wait(30)
        nursery.cancel_scope.cancel()
    return rows


def measure_floors(levels: list[int], total: int, rounds: int) -> list[dict]:
    rows = []
    for number in range(rounds):
        for index, concurrency in enumerate(levels):
            first = (number + index) % len(FLOOR_SERVERS)
            for kind in FLOOR_SERVERS[first:] + FLOOR_SERVERS[:first]:
                rows.append({"server": kind, "round": number + 1, **measure_floor(kind, concurrency, total)})
    return rows


def measure_floor(kind: str, concurrency: int, total: int) -> dict:
    server = subprocess.Popen([sys.executable, __file__, "--floor-server", kind], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split("floor ready: ", 1)[1].strip()
        trio.run(lambda: gateway_level(url, "unused", 4, 64, stream=True))
        process = psutil.Process(server.pid)
        cpu_before = sum(process.cpu_times()[:2])
        count = max(total, concurrency * 2)
        result = trio.run(lambda: gateway_level(url, "unused", concurrency, count, stream=True))
        cpu_ms = (sum(process.cpu_times()[:2]) - cpu_before) * 1000 / count
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    return {
        "concurrency": concurrency,
        "rps": result["rps"],
        "cpu_ms_per_request": cpu_ms,
        "ttft_p50_ms": result["ttft_p50_ms"],
        "ttft_p99_ms": result["ttft_p99_ms"],
    }


def print_tables(rows: list[dict], label: str, titled: bool) -> None:
    for stream, title, unit, latency in (
        (True, "Streamed (TTFT: to the first content event)", "streams", "TTFT"),
        (False, "Not streamed (latency: to the whole answer)", "concurrent requests", "latency"),
    ):
        chosen = [row for row in rows if row["stream"] == stream]
        if not chosen:
            continue
        chunks_column = " streamed chunks/s |" if stream else ""
        print(f"\n{title}" + (f", the {label} gateway" if titled else "") + "\n")
        print(
            f"| {unit} | {latency} p50 direct → gateway (added) | {latency} p99 direct → gateway (added) | req/s direct "
            f"| req/s gateway | ratio |{chunks_column} gateway CPU per request | client CPU per request | gateway RSS |"
        )
        print("|---" * (10 if stream else 9) + "|")
        for row in chosen:
            d, g = row["direct"], row["gateways"][label]
            chunks = f" {g['chunks_per_s']:.0f} |" if stream else ""
            print(
                f"| {row['concurrency']} | {d['ttft_p50_ms']:.1f} → {g['ttft_p50_ms']:.1f} ms (+{g['ttft_p50_ms'] - d['ttft_p50_ms']:.1f}) "
                f"| {d['ttft_p99_ms']:.1f} → {g['ttft_p99_ms']:.1f} ms (+{g['ttft_p99_ms'] - d['ttft_p99_ms']:.1f}) "
                f"| {d['rps']:.0f} | {g['rps']:.0f} | {g['rps'] / d['rps']:.2f}× |{chunks} "
                f"{g['cpu_ms_per_request']:.2f} ms | {g['client_cpu_ms_per_request']:.2f} ms "
                f"| {g['rss_mib']:.0f} MiB |" + (f" ({g['errors']} errors)" if g["errors"] else "")
            )


def print_comparison(rows: list[dict]) -> None:
    """Baseline → ours per level and round, then the median ratio per level."""
    print("\nBaseline → ours, side by side (ratio: ours / baseline)\n")
    print("| mode | level | round | gateway CPU per request | req/s | TTFT or latency p50 | TTFT or latency p99 |")
    print("|---|---|---|---|---|---|---|")
    ratios: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    for row in rows:
        b, o = row["gateways"]["baseline"], row["gateways"]["ours"]
        cpu, rps = o["cpu_ms_per_request"] / b["cpu_ms_per_request"], o["rps"] / b["rps"]
        ratios.setdefault((row["stream"], row["concurrency"]), []).append((cpu, rps))
        print(
            f"| {'streamed' if row['stream'] else 'not streamed'} | {row['concurrency']} | {row['round']} "
            f"| {b['cpu_ms_per_request']:.3f} → {o['cpu_ms_per_request']:.3f} ms ({cpu:.3f}×) "
            f"| {b['rps']:.0f} → {o['rps']:.0f} ({rps:.2f}×) "
            f"| {b['ttft_p50_ms']:.1f} → {o['ttft_p50_ms']:.1f} ms | {b['ttft_p99_ms']:.1f} → {o['ttft_p99_ms']:.1f} ms |"
        )
    print()
    for (stream, concurrency), pairs in ratios.items():
        print(
            f"{'streamed' if stream else 'not streamed'}, {concurrency} concurrent, {len(pairs)} round(s): CPU per request "
            f"{statistics.median(cpu for cpu, _ in pairs):.3f}× the baseline's, requests/s "
            f"{statistics.median(rps for _, rps in pairs):.2f}× (medians)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16,64,256", help="concurrent streams, streamed requests")
    parser.add_argument("--plain-levels", default="1,16,64", help="concurrent requests, non-streamed short completions")
    parser.add_argument("--requests", type=int, default=256, help="requests per level (at least 2 per stream)")
    parser.add_argument(
        "--floor-levels", default="16", help="concurrent streams against the bare HTTP server (empty: skip)"
    )
    parser.add_argument("--gateway-workers", type=int, default=1, help="gateway worker processes (gateway.workers)")
    parser.add_argument(
        "--baseline",
        metavar="REV|DIR",
        help="also measure the gateway of this commit (or code tree), side by side with this checkout's",
    )
    parser.add_argument("--rounds", type=int, default=1, help="measure every level this many times")
    parser.add_argument(
        "--together",
        action="store_true",
        help="with --baseline: load both gateways at the same time rather than one after the other",
    )
    parser.add_argument("--floor-server", choices=FLOOR_SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--miner", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.miner:
        run_synthetic_miner(args.miner, args.key, args.home)
        return
    if args.floor_server:
        run_floor_server(args.floor_server)
        return
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be at least 1")

    levels = [(True, int(level)) for level in args.levels.split(",") if level]
    levels += [(False, int(level)) for level in args.plain_levels.split(",") if level]
    with tempfile.TemporaryDirectory(prefix="engy-gw-bench-") as scratch:
        trees = [("ours", ROOT)]
        if args.baseline:
            trees.append(("baseline", baseline_tree(args.baseline, Path(scratch))))
        gateways = []
        for label, root in trees:
            home = Path(scratch) / f"home-{label}"
            home.mkdir()
            gateways.append(Gateway(label, root, str(home)))
        try:
            for gateway in gateways:
                gateway.start(args.gateway_workers)
            time.sleep(3)
            rows = trio.run(
                functools.partial(
                    measure, levels, args.requests, args.rounds, gateways[0].home, gateways, together=args.together
                )
            )
        finally:
            for gateway in gateways:
                gateway.stop()
    floor = measure_floors([int(level) for level in args.floor_levels.split(",") if level], args.requests, args.rounds)
    print(json.dumps({"levels": rows, "http_server_floor": floor}, indent=2))
    for gateway in gateways:
        print_tables(rows, gateway.label, titled=len(gateways) > 1)
    if floor:
        print(
            "\nThe HTTP server alone (trio worker, an SSE answer in three body messages; same client): hypercorn as it "
            "comes, and with hypercorn_edges' EdgeConfig as the gateway runs it\n"
        )
        print("| server | streams | round | TTFT p50 | TTFT p99 | req/s | server CPU per request |")
        print("|---|---|---|---|---|---|---|")
        for row in floor:
            print(
                f"| {row['server']} | {row['concurrency']} | {row['round']} | {row['ttft_p50_ms']:.1f} ms | {row['ttft_p99_ms']:.1f} ms "
                f"| {row['rps']:.0f} | {row['cpu_ms_per_request']:.2f} ms |"
            )
    if args.baseline:
        print_comparison(rows)
    print(
        f"\nours: {describe(ROOT)}"
        + "".join(f"; baseline: {args.baseline} ({describe(g.root)})" for g in gateways if g.label == "baseline")
    )


if __name__ == "__main__":
    main()
