"""A paid request's store work on each backend, side by side in one run: SQLite (one host's
file) and PostgreSQL (a fleet's shared database, here a throwaway cluster on loopback).

    .venv/bin/python bench/store_backends.py [--requests 2000] [--concurrency 1,16,64] [--rounds 3]

Each request does what the gateway does on the request path: authenticate its key, hold the
worst case, then settle and log in one write (`settle_and_log`), all awaited from trio through
`Store.run` as the gateway awaits them. `--concurrency` requests run at once (buyers in
flight). Per level and backend: requests/s and the latency of one request's store work (p50,
p99), and CPU seconds per request of this process (the gateway's side; PostgreSQL's own CPU is
the server's and is printed apart). Backends alternate within a round so drift hits both alike;
each cell is the median over rounds. Prints a Markdown table with the ratio PostgreSQL/SQLite.
Side by side, also the process's read calls and bytes written (an SQLite file's page reads and
its log; PostgreSQL's happen in the server) per request.

The cluster runs with fsync on, as production does; on this VM's disk a commit's flush is the
floor of a durable write on either backend. Request ids are the gateway's own
(`flight.new_request_id`). `--prefill N` first serves N requests, unmeasured, into each store:
a store that has been serving a while, whose indexes no longer fit in memory as a new one's do.

With `--baseline REV` (a commit of this repository, or a directory holding another code tree) the
same work runs on this tree's store and on the baseline's, side by side: each run in a process of
its own that imports that tree's `engy_node`, each tree on a database and a file of its own (so
two schema versions never meet), the trees alternating within a round. `--backends` picks which.

    .venv/bin/python bench/store_backends.py --baseline 267dab4 --backends postgresql --concurrency 1,16
    .venv/bin/python bench/store_backends.py --baseline 85d563a --backends sqlite --concurrency 16 --prefill 100000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

ROOT = Path(__file__).resolve().parents[1]
TREE_ENV = "ENGY_BENCH_TREE"
"""Set for a side-by-side run's process: the code tree whose `engy_node` it measures."""
sys.path.insert(0, os.environ.get(TREE_ENV, str(ROOT)))

import engy_node  # noqa: E402
from engy_node.gateway.store import RequestLogEntry, Store  # noqa: E402

try:
    from engy_node.gateway.request.flight import new_request_id  # noqa: E402
except ImportError:  # a tree from before the gateway's ids had a function of their own: they were uuid4s
    import uuid

    def new_request_id() -> str:
        return uuid.uuid4().hex


def entry(request_id: str, account_id: int) -> RequestLogEntry:
    return RequestLogEntry(
        request_id=request_id,
        account_id=account_id,
        miner="key:1",
        model="smollm2-135m",
        api="openai",
        kind="paid",
        status=200,
        prompt_tokens=30,
        completion_tokens=12,
        cached_tokens=0,
        cost_micro=0,
        ttft_ms=40.0,
        tpot_ms=8.0,
        created_at=time.time(),
    )


async def drive(
    store: Store, *, keys: list[tuple[int, str]], requests: int, concurrency: int
) -> tuple[float, list[float], float]:
    """(wall seconds, per-request latencies, this process's CPU seconds) for `requests` requests."""
    latencies: list[float] = []
    counter = iter(range(requests))

    async def buyer(index: int) -> None:
        account_id, key = keys[index % len(keys)]
        for _ in counter:
            started = time.perf_counter()
            request_id = new_request_id()
            account = await store.run(store.authenticate, key)
            hold = await store.run(store.hold, account.account_id, amount=500, request_id=request_id)
            await store.run(store.settle_and_log, hold, cost=120, entry=entry(request_id, account_id))
            latencies.append(time.perf_counter() - started)

    process = psutil.Process()
    cpu_before = sum(process.cpu_times()[:2])
    wall_started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(concurrency):
            nursery.start_soon(buyer, index)
    wall = time.perf_counter() - wall_started
    return wall, latencies, sum(process.cpu_times()[:2]) - cpu_before


def funded_keys(store: Store, count: int) -> list[tuple[int, str]]:
    keys = []
    for index in range(count):
        account_id, key = store.create_buyer(f"bench-{index}")
        store.credit(account_id, micro_usd=10**12)
        keys.append((account_id, key))
    return keys


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a commit or a code tree to measure side by side with this one")
    parser.add_argument("--backends", default="sqlite,postgresql", help="with --baseline: which backends")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="requests served into each store, unmeasured, before the first round",
    )
    parser.add_argument("--one-run", metavar="LOCATION", help=argparse.SUPPRESS)
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    if args.one_run:
        await one_run(args.one_run, requests=args.requests, concurrency=levels[0])
    elif args.baseline:
        side_by_side(args, levels, [backend for backend in args.backends.split(",") if backend])
    else:
        await both_backends(args, levels)


async def both_backends(args: argparse.Namespace, levels: list[int]) -> None:
    from engy_node.testing.postgres import throwaway_cluster

    with tempfile.TemporaryDirectory(prefix="engy-store-bench-") as tmp, throwaway_cluster() as cluster:
        stores = {"sqlite": Store(Path(tmp) / "gateway.sqlite3"), "postgresql": Store(cluster.create_database())}
        keys = {name: funded_keys(store, 64) for name, store in stores.items()}
        if args.prefill:
            for name, store in stores.items():
                await drive(store, keys=keys[name], requests=args.prefill, concurrency=64)
        server = _postmaster(cluster)
        cells: dict[tuple[int, str], list[tuple[float, float, float, float, float]]] = {}
        for round_index in range(args.rounds):
            for level in levels:
                for name in ("sqlite", "postgresql") if round_index % 2 == 0 else ("postgresql", "sqlite"):
                    server_cpu_before = _tree_cpu(server) if name == "postgresql" else 0.0
                    wall, latencies, cpu = await drive(
                        stores[name], keys=keys[name], requests=args.requests, concurrency=level
                    )
                    server_cpu = (_tree_cpu(server) - server_cpu_before) if name == "postgresql" else 0.0
                    cells.setdefault((level, name), []).append(
                        (
                            args.requests / wall,
                            percentile(latencies, 50) * 1e3,
                            percentile(latencies, 99) * 1e3,
                            cpu / args.requests * 1e3,
                            server_cpu / args.requests * 1e3,
                        )
                    )
        for store in stores.values():
            store.close()
    print(
        f"store work of one paid request (authenticate, hold, settle_and_log), {args.requests} requests per cell, "
        f"median of {args.rounds} rounds, {args.prefill} requests served before; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n"
    )
    print(
        "| in flight | backend | requests/s | latency p50 ms | latency p99 ms | client CPU ms/req | server CPU ms/req | req/s vs SQLite |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for level in levels:
        medians = {
            name: [statistics.median(column) for column in zip(*cells[(level, name)])]
            for name in ("sqlite", "postgresql")
        }
        for name in ("sqlite", "postgresql"):
            rps, p50, p99, cpu, server_cpu = medians[name]
            ratio = rps / medians["sqlite"][0]
            server = f"{server_cpu:.3f}" if name == "postgresql" else "—"
            print(f"| {level} | {name} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {cpu:.3f} | {server} | {ratio:.2f}× |")


async def one_run(location: str, *, requests: int, concurrency: int) -> None:
    """One tree's run of a side-by-side cell, in a process of its own: prints its figures as JSON."""
    with Store(location) as store:
        keys = funded_keys(store, 64)
        io_before = psutil.Process().io_counters()
        wall, latencies, cpu = await drive(store, keys=keys, requests=requests, concurrency=concurrency)
        io_after = psutil.Process().io_counters()
    print(
        json.dumps(
            {
                "engy_node": engy_node.__file__,
                "rps": requests / wall,
                "p50_ms": percentile(latencies, 50) * 1e3,
                "p99_ms": percentile(latencies, 99) * 1e3,
                "cpu_ms": cpu / requests * 1e3,
                "reads": (io_after.read_count - io_before.read_count) / requests,
                "written_kb": (io_after.write_chars - io_before.write_chars) / requests / 1024,
            }
        )
    )


def side_by_side(args: argparse.Namespace, levels: list[int], backends: list[str]) -> None:
    from bench.gateway_overhead import baseline_tree, describe
    from engy_node.testing.postgres import throwaway_cluster

    unknown = set(backends) - {"sqlite", "postgresql"}
    if unknown or not backends:
        raise SystemExit(f"--backends takes sqlite and/or postgresql, comma-separated; got {args.backends!r}")
    with tempfile.TemporaryDirectory(prefix="engy-store-bench-") as tmp, throwaway_cluster() as cluster:
        trees = {"ours": ROOT, "baseline": baseline_tree(args.baseline, Path(tmp))}
        locations = {
            (name, backend): cluster.create_database()
            if backend == "postgresql"
            else str(Path(tmp) / f"{name}.sqlite3")
            for name in trees
            for backend in backends
        }
        if args.prefill:
            for (name, _), location in locations.items():
                run_in_tree(name, trees[name], location, requests=args.prefill, concurrency=64)
        server = _postmaster(cluster)
        cells: dict[tuple[int, str, str], list[dict]] = {}
        for round_index in range(args.rounds):
            for level in levels:
                for backend in backends:
                    for name in ("ours", "baseline") if round_index % 2 == 0 else ("baseline", "ours"):
                        server_cpu_before = _tree_cpu(server)
                        figures = run_in_tree(
                            name, trees[name], locations[(name, backend)], requests=args.requests, concurrency=level
                        )
                        figures["server_cpu_ms"] = (_tree_cpu(server) - server_cpu_before) / args.requests * 1e3
                        cells.setdefault((level, backend, name), []).append(figures)
    print(
        f"store work of one paid request (authenticate, hold, settle_and_log), {args.requests} requests per cell, "
        f"median of {args.rounds} rounds, {args.prefill} requests served before; ours: {describe(ROOT)}, "
        f"baseline: {args.baseline}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n"
    )
    print(
        "| in flight | backend | requests/s, baseline → ours | latency p50 ms | latency p99 ms "
        "| client CPU ms/req | server CPU ms/req | client reads/req | client KB written/req |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        for backend in backends:

            def median(name: str, key: str) -> float:
                return statistics.median(run[key] for run in cells[(level, backend, name)])

            def pair(key: str, digits: int) -> str:
                before, after = median("baseline", key), median("ours", key)
                ratio = f" ({after / before:.2f}×)" if before else ""
                return f"{before:,.{digits}f} → {after:,.{digits}f}{ratio}"

            server = pair("server_cpu_ms", 3) if backend == "postgresql" else "—"
            print(
                f"| {level} | {backend} | {pair('rps', 0)} | {pair('p50_ms', 2)} | {pair('p99_ms', 2)} "
                f"| {pair('cpu_ms', 3)} | {server} | {pair('reads', 2)} | {pair('written_kb', 1)} |"
            )


def run_in_tree(name: str, tree: Path, location: str, *, requests: int, concurrency: int) -> dict:
    """`one_run` in a process that imports `tree`'s engy_node; its figures."""
    run = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one-run",
            location,
            "--requests",
            str(requests),
            "--concurrency",
            str(concurrency),
        ],
        env={**os.environ, TREE_ENV: str(tree), "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if run.returncode != 0:
        raise SystemExit(f"the {name} tree's run failed:\n{run.stderr}")
    figures = json.loads(run.stdout.splitlines()[-1])
    if not Path(figures["engy_node"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the {name} run imported {figures['engy_node']}, not its tree's engy_node")
    return figures


def _postmaster(cluster) -> psutil.Process | None:
    """The throwaway cluster's server process, whose tree `_tree_cpu` reads."""
    return next(
        (p for p in psutil.process_iter(["cmdline"]) if str(cluster.data_dir) in " ".join(p.info["cmdline"] or [])),
        None,
    )


def _tree_cpu(process: psutil.Process | None) -> float:
    """CPU seconds of a process and its children (the PostgreSQL postmaster and its backends),
    those that have exited included: a side-by-side run's backends end with its process."""
    if process is None:
        return 0.0
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for member in process.children(recursive=True):
        try:
            times = member.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


if __name__ == "__main__":
    trio.run(main)
