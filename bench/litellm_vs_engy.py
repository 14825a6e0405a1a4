"""Our gateway and a LiteLLM proxy, side by side in one run, with limits and usage accounting on.

    bench/setup_litellm.sh                      # once: LiteLLM in .litellm-venv (from PyPI)
    .venv/bin/python bench/litellm_vs_engy.py [--levels 1,16] [--saturation 64] [--requests 256]
                                              [--tokens 16] [--token-delay-ms 2] [--rounds 1]

Both proxies get an upstream that is equally fast: it streams `--tokens` chunks with
`--token-delay-ms` before each, every chunk its own event.

* **LiteLLM** (`litellm --config … --num_workers 1`, its own venv) forwards to a stub
  OpenAI-compatible server (a separate process: hypercorn's trio worker, the answer streamed as
  SSE, usage in the last chunk). Its configuration prices the model (so every request has a
  cost) and gives the deployment rpm, tpm and `max_parallel_requests` limits (its router keeps
  those in memory). Budgets and spend are LiteLLM's virtual keys, which live in PostgreSQL
  through Prisma: with `--litellm-db postgres` a throwaway cluster (`engy_node.testing.postgres`)
  runs beside it and the client uses a key from `/key/generate` with `max_budget`, `rpm_limit`,
  `tpm_limit` and `max_parallel_requests`. Prisma fetches its query and schema engines from its
  own download host on first use, which a machine that reaches only the package registries
  cannot (LiteLLM then stops at start: "Database migration cannot proceed … getaddrinfo
  ENOTFOUND binaries.prisma.sh"); so the default, `--litellm-db off`, runs it with its master
  key: the deployment's limits and the cost computed per request, but no key budget and no
  spend stored. The summary names which was on.
* **ours** (`engy-node --role gateway`, one worker, SQLite store) forwards to a synthetic miner
  (`engy_node.testing.synthetic_miner`: the real link and protocol) with the same script: the
  same chunks, the same delay before each, no coalescing. The buyer's account has every limit
  set (`gateway account set-limits`: rpm, tpm, concurrency, daily and monthly caps), and every
  request is held, settled and logged as always.

The same lean keep-alive client (`gateway_overhead.KeepAliveClient`, one connection per stream)
drives each in turn with the same requests: the stub alone first (the upstream's own TTFT), then
each proxy at every `--levels` (added TTFT p50/p99 over the stub's own at that level, CPU per
request of the proxy's processes, psutil's user + system time over the level, and their RSS at
the end of it), then at `--saturation` streams (requests/s: with enough streams the upstream's
delay no longer bounds it, the proxy's CPU does). Who goes first alternates from round to round.
Everything binds 127.0.0.1, and every process and directory made here is removed here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from gateway_overhead import (  # noqa: E402
    answer_lifespan,
    chat_request,
    cpu_seconds,
    keep_alive_load,
    percentile,
    process_tree,
    run_synthetic_miner,
    serve_asgi,
    spawn_gateway,
    wait_for_gateway,
)

LITELLM_VENV = ROOT / ".litellm-venv"
"""Not under bench/: tests/test_docs.py reads every file under bench/."""
MODEL = "smollm2-135m"
TOKEN = "fox "
"""Every streamed chunk's text."""
PRICE_IN_USD, PRICE_OUT_USD = 0.0000001, 0.0000002
"""LiteLLM's per-token prices for the stub's model (it needs one to record spend)."""
CONTENT = re.compile(rb'"content":\s*"[^"]')
STARTUP_S = 180


def run_stub(tokens: int, delay_s: float) -> None:
    """The stub upstream: `/v1/chat/completions` answers `tokens` SSE chunks, `delay_s` before
    each, then a finish chunk with usage (or the whole answer at once, not streamed)."""
    from hypercorn.config import Config

    async def app(scope, receive, send) -> None:
        if await answer_lifespan(scope, receive, send):
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body or b"{}")
        base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
        usage = {"prompt_tokens": 16, "completion_tokens": tokens, "total_tokens": 16 + tokens}
        if not request.get("stream"):
            for _ in range(tokens):
                await trio.sleep(delay_s)
            answer = {
                **base,
                "object": "chat.completion",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": TOKEN * tokens}, "finish_reason": "stop"}
                ],
                "usage": usage,
            }
            payload = json.dumps(answer).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for index in range(tokens):
            await trio.sleep(delay_s)
            delta = {"role": "assistant", "content": TOKEN} if index == 0 else {"content": TOKEN}
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True,
                }
            )
        last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
        await send(
            {"type": "http.response.body", "body": b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"}
        )

    config = Config()
    config.keep_alive_timeout = 600
    serve_asgi(app, config, "stub")


def run_miner(gateway_url: str, miner_key: str, home: str, tokens: int, delay_s: float) -> None:
    """The synthetic miner with the stub's script: `tokens` chunks, `delay_s` before each, each its own frame."""
    script = {"text": TOKEN * tokens, "chunk_chars": len(TOKEN), "delay_s": delay_s, "coalesce_s": 0.0}
    run_synthetic_miner(gateway_url, miner_key, home, script=script, max_inflight=4096)


SETUP_ENGY = (
    "import json, sys; from engy_node.config import load_config; from engy_node.gateway.role import store_path; "
    "from engy_node.gateway.store import Store; from engy_node.gateway import key_admin; "
    "config = load_config(home=sys.argv[1], env={}); config.paths.data_dir.mkdir(parents=True, exist_ok=True); "
    "store = Store.open(store_path(config)); account, buyer_key = store.create_buyer('bench'); "
    "store.credit(account, micro_usd=10**12); _, miner_key = store.register_miner('bench-miner'); "
    "print(key_admin.set_account_limits(store, account_id=account, values=json.loads(sys.argv[2])), file=sys.stderr); "
    "store.close(); print(json.dumps({'buyer_key': buyer_key, 'miner_key': miner_key}))"
)
"""A fresh home's store: a funded buyer whose account has every limit set (what `engy-node
gateway account set-limits` sets), and a miner key."""

ENGY_LIMITS = {
    "rpm": "1000000",
    "tpm": "1000000000",
    "concurrent": "4096",
    "daily_usd": "100000",
    "monthly_usd": "1000000",
}
"""Far above what the run uses: every check runs and none refuses."""


class Engy:
    label = "ours"

    def __init__(self, home: Path, tokens: int, delay_s: float) -> None:
        self.home, self.tokens, self.delay_s = home, tokens, delay_s
        self.processes: list[subprocess.Popen] = []
        self.api = self.key = ""
        self.pid = 0
        self.accounting = (
            "buyer key; account limits rpm, tpm, concurrency 4,096, daily and monthly caps; "
            "hold, settlement and request log per request (SQLite)"
        )

    def start(self) -> None:
        made = subprocess.run(
            [sys.executable, "-c", SETUP_ENGY, str(self.home), json.dumps(ENGY_LIMITS)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if made.returncode != 0:
            raise SystemExit(f"setting up our gateway's store failed:\n{made.stderr}")
        found = json.loads(made.stdout)
        self.key = found["buyer_key"]
        log_path = self.home / "gateway.log"
        # Qualification off (gateway_overhead.BENCH_GATEWAY_ENV): a synthetic miner would otherwise stay on probation.
        gateway = spawn_gateway(ROOT, str(self.home), {**os.environ, "PYTHONUNBUFFERED": "1"}, 1, log_path)
        self.processes.append(gateway)
        self.pid = gateway.pid
        match = wait_for_gateway(gateway, log_path, "our gateway", STARTUP_S, 0.2)
        self.api = match.group(1)
        miner_args = ["--miner", match.group(2), "--key", found["miner_key"], "--home", str(self.home)]
        self.processes.append(subprocess.Popen([sys.executable, __file__, *miner_args, *self.script_args()]))
        wait_ready(self.api, self.key)

    def script_args(self) -> list[str]:
        return ["--tokens", str(self.tokens), "--token-delay-ms", str(self.delay_s * 1000)]

    def stop(self) -> None:
        stop_all(self.processes)


DEPLOYMENT_LIMITS = {"rpm": 1000000, "tpm": 1000000000, "max_parallel_requests": 4096}
"""LiteLLM's per-deployment limits, as far above the run as `ENGY_LIMITS`."""


class LiteLLM:
    label = "LiteLLM"
    master_key = "sk-bench-master"

    def __init__(self, home: Path, upstream: str, database_url: str | None) -> None:
        self.home, self.upstream, self.database_url = home, upstream, database_url
        self.processes: list[subprocess.Popen] = []
        self.api = self.key = ""
        self.pid = 0
        self.accounting = ""

    def start(self) -> None:
        binary = LITELLM_VENV / "bin" / "litellm"
        if not binary.exists():
            raise SystemExit(f"{binary} is missing: run bench/setup_litellm.sh first")
        settings = {"master_key": self.master_key}
        if self.database_url:
            settings["database_url"] = self.database_url
        config = {
            "model_list": [
                {
                    "model_name": MODEL,
                    "litellm_params": {
                        "model": f"openai/{MODEL}",
                        "api_base": self.upstream + "/v1",
                        "api_key": "stub",
                        # The deployment's own limits, which its router enforces in memory, database or not.
                        **DEPLOYMENT_LIMITS,
                    },
                    "model_info": {"input_cost_per_token": PRICE_IN_USD, "output_cost_per_token": PRICE_OUT_USD},
                }
            ],
            "general_settings": settings,
            "litellm_settings": {"telemetry": False, "drop_params": True},
        }
        (self.home / "config.json").write_text(json.dumps(config))
        port = free_port()
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            # No network here: LiteLLM's model price map from its package, no telemetry.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "DISABLE_SCHEMA_UPDATE": "False",
            "HOME": str(self.home),
        }
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = f"{LITELLM_VENV / 'bin'}:{env.get('PATH', '')}"
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        log_path = self.home / "litellm.log"
        with log_path.open("w") as log:
            proxy = subprocess.Popen(
                [
                    str(binary),
                    "--config",
                    str(self.home / "config.json"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--num_workers",
                    "1",
                ],
                cwd=self.home,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.processes.append(proxy)
        self.pid = proxy.pid
        self.api = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"LiteLLM did not start; its log ({log_path}):\n{log_path.read_text()[-6000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.api + "/health/liveliness", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        if self.database_url:
            made = httpx.post(
                self.api + "/key/generate",
                headers={"authorization": f"Bearer {self.master_key}"},
                json={
                    "max_budget": 100000.0,
                    "rpm_limit": 1000000,
                    "tpm_limit": 1000000000,
                    "max_parallel_requests": 4096,
                    "models": [MODEL],
                },
                timeout=60,
            )
            if made.status_code != 200:
                raise SystemExit(f"LiteLLM's /key/generate answered {made.status_code}: {made.text}")
            self.key = made.json()["key"]
            self.accounting = (
                "virtual key (PostgreSQL via Prisma): max_budget, rpm, tpm, max_parallel_requests 4,096; "
                "priced model, spend tracked per key and in spend logs"
            )
        else:
            self.key = self.master_key
            self.accounting = (
                "master key, no database: deployment limits rpm, tpm, max_parallel_requests 4,096 (router, in memory); "
                "priced model, cost computed per request; no virtual key, no budget, spend stored nowhere"
            )
        wait_ready(self.api, self.key)

    def spend(self) -> str:
        """The key's recorded spend, as LiteLLM reports it (proof that accounting ran); without a
        database, the cost it computed for one more request (its `x-litellm-response-cost`)."""
        if not self.database_url:
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.post(
                    self.api + "/v1/chat/completions",
                    headers={"authorization": f"Bearer {self.key}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "cost?"}], "max_tokens": 64},
                    timeout=30,
                )
                return f"no spend stored; one request's x-litellm-response-cost: {answer.headers.get('x-litellm-response-cost')}"
            return "unknown"
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            info = httpx.get(
                self.api + "/key/info",
                params={"key": self.key},
                headers={"authorization": f"Bearer {self.master_key}"},
                timeout=30,
            ).json()
            return f"${info['info']['spend']:.6f}"
        return "unknown"

    def stop(self) -> None:
        stop_all(self.processes)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def wait_ready(api: str, key: str) -> None:
    """One streamed request answered: the upstream is connected and the path is warm."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            result = trio.run(lambda: drive(api, key, 1, 4))
            if not result["errors"]:
                return
        except (OSError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{api} never answered a streamed request")
        time.sleep(1)


async def drive(api: str, key: str, streams: int, total: int) -> dict:
    """`total` streamed requests over `streams` keep-alive connections; TTFT to the first event with content."""
    ttfts: list[float] = []
    errors = 0

    async def one(client, url: httpx.URL, number: int) -> None:
        nonlocal errors
        started = time.perf_counter()
        first: list[float] = []
        seen = bytearray()

        def on_data(data: bytes) -> None:
            if not first:
                seen.extend(data)
                if CONTENT.search(seen):
                    first.append(time.perf_counter() - started)

        with trio.fail_after(120):
            status = await client.request(chat_request(url.host, url.port, key, stream=True, number=number), on_data)
        if status != 200 or not first:
            errors += 1
        else:
            ttfts.append(first[0])

    elapsed = await keep_alive_load(api, streams, total, one)
    return {
        "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else float("nan"),
        "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else float("nan"),
        "rps": (total - errors) / elapsed,
        "errors": errors,
    }


def measure(proxy, streams: int, total: int) -> dict:
    processes = process_tree(proxy.pid)
    before = cpu_seconds(processes)
    result = trio.run(lambda: drive(proxy.api, proxy.key, streams, total))
    result["cpu_ms_per_request"] = (cpu_seconds(processes) - before) * 1000 / total
    result["rss_mib"] = sum(process.memory_info().rss for process in processes) / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16", help="concurrent streams for TTFT and CPU per request")
    parser.add_argument("--saturation", type=int, default=128, help="concurrent streams for requests/s at saturation")
    parser.add_argument("--requests", type=int, default=256, help="requests per level (at least 2 per stream)")
    parser.add_argument("--tokens", type=int, default=16, help="chunks each upstream streams")
    parser.add_argument("--token-delay-ms", type=float, default=2.0, help="the upstream's pause before each chunk")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--litellm-db",
        choices=("postgres", "off"),
        default="off",
        help="postgres: virtual key with a budget (needs Prisma's engines, which Prisma downloads on first use)",
    )
    parser.add_argument("--stub", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--miner", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    delay_s = args.token_delay_ms / 1000
    if args.stub:
        run_stub(args.tokens, delay_s)
        return
    if args.miner:
        run_miner(args.miner, args.key, args.home, args.tokens, delay_s)
        return

    levels = [int(level) for level in args.levels.split(",") if level]
    load_at_start = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engy-vs-litellm-")))
        database_url = None
        if args.litellm_db == "postgres":
            from engy_node.testing.postgres import throwaway_cluster

            cluster = stack.enter_context(throwaway_cluster())
            database_url = cluster.create_database("litellm")
        stub = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--stub",
                "--tokens",
                str(args.tokens),
                "--token-delay-ms",
                str(args.token_delay_ms),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        stack.callback(stop_all, [stub])
        stub_url = stub.stdout.readline().split("stub ready: ", 1)[1].strip()
        for name in ("ours", "litellm"):
            (scratch / name).mkdir()
        proxies = [Engy(scratch / "ours", args.tokens, delay_s), LiteLLM(scratch / "litellm", stub_url, database_url)]
        for proxy in proxies:
            stack.callback(proxy.stop)
            proxy.start()
        stub_proxy = type("Stub", (), {"api": stub_url, "key": "stub", "pid": stub.pid, "label": "stub"})()
        wait_ready(stub_url, "stub")
        rows = []
        for number in range(args.rounds):
            order = proxies if number % 2 == 0 else proxies[::-1]
            for streams in [*levels, args.saturation]:
                count = max(args.requests, streams * 2)
                row = {"round": number + 1, "streams": streams, "requests": count}
                row["stub"] = measure(stub_proxy, streams, count)
                for proxy in order:
                    row[proxy.label] = measure(proxy, streams, count)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        spend = proxies[1].spend()
        accounting = {proxy.label: proxy.accounting for proxy in proxies}
    print(json.dumps({"rows": rows, "accounting": accounting, "litellm_key_spend": spend}, indent=2))
    report(rows, levels, args, accounting, spend, load_at_start)


def report(
    rows: list[dict], levels: list[int], args: argparse.Namespace, accounting: dict, spend: str, load_at_start: float
) -> None:
    def median(streams: int, label: str, field: str) -> float:
        return statistics.median(row[label][field] for row in rows if row["streams"] == streams)

    def added(streams: int, label: str, q: str) -> float:
        field = f"ttft_{q}_ms"
        return statistics.median(row[label][field] - row["stub"][field] for row in rows if row["streams"] == streams)

    print(
        f"\nUpstream: {args.tokens} chunks, {args.token_delay_ms:g} ms before each; {args.requests} requests per level, "
        f"{args.rounds} round(s), medians over rounds; the machine's load average (1 min) at the start "
        f"{load_at_start:.2f}, at the end {os.getloadavg()[0]:.2f}\n"
    )
    print("| measure | ours | LiteLLM | LiteLLM ÷ ours |")
    print("|---|---|---|---|")
    for streams in levels:
        cpu_o, cpu_l = median(streams, "ours", "cpu_ms_per_request"), median(streams, "LiteLLM", "cpu_ms_per_request")
        print(f"| CPU per request, {streams} stream(s) | {cpu_o:.2f} ms | {cpu_l:.2f} ms | {cpu_l / cpu_o:.1f}× |")
        for q in ("p50", "p99"):
            # Added over the stub's own TTFT in the same round (the machine's moment falls on both), then the median.
            stub = median(streams, "stub", f"ttft_{q}_ms")
            add_o, add_l = (added(streams, label, q) for label in ("ours", "LiteLLM"))
            ratio = f"{add_l / add_o:.1f}×" if add_o > 0 else "—"
            print(
                f"| added TTFT {q}, {streams} stream(s) (stub alone {stub:.1f} ms) | {add_o:+.1f} ms | {add_l:+.1f} ms "
                f"| {ratio} |"
            )
    s = args.saturation
    rps_o, rps_l, rps_s = median(s, "ours", "rps"), median(s, "LiteLLM", "rps"), median(s, "stub", "rps")
    print(f"| requests/s, {s} streams (stub alone {rps_s:.0f}) | {rps_o:.0f} | {rps_l:.0f} | {rps_l / rps_o:.2f}× |")
    cpu_o, cpu_l = median(s, "ours", "cpu_ms_per_request"), median(s, "LiteLLM", "cpu_ms_per_request")
    print(f"| CPU per request, {s} streams | {cpu_o:.2f} ms | {cpu_l:.2f} ms | {cpu_l / cpu_o:.1f}× |")
    rss_o = max(row["ours"]["rss_mib"] for row in rows)
    rss_l = max(row["LiteLLM"]["rss_mib"] for row in rows)
    print(f"| RSS, largest seen | {rss_o:.0f} MiB | {rss_l:.0f} MiB | {rss_l / rss_o:.1f}× |")
    errors = {label: sum(row[label]["errors"] for row in rows) for label in ("ours", "LiteLLM", "stub")}
    print(f"\nerrors: {errors}; LiteLLM key spend after the run: {spend}")
    for label, text in accounting.items():
        print(f"{label}: {text}")


if __name__ == "__main__":
    main()
