"""How much memory the validator process holds while it runs its loop, beside baselines in one run.

    .venv/bin/python bench/validator_rss.py [--seconds 40] [--idle-seconds 6] [--no-torch]

docs/performance.md (issue 11): the validator process stays small — it must not import torch or
transformers, and its resident set must stay ≤ 150 MB. This measures the process an operator
runs, from the outside:

* **validator**: a separate Python process that enters through `engy_node.cli.main(["--home",
  HOME, "--role", "validator"])`, exactly as `engy-node --role validator` does (config from
  `HOME/node.toml`, logging, the control API, `node.run`, the light loop, its watchdog, the
  provider heartbeat). The one change: `run_validator` gets `substrate=` an in-process
  `DevChain`, the only chain reachable offline, so the real `bittensor.SyncClient` reads the
  metagraph and sends `SetWeights` every tick. The chain seals a block every 0.1 s with
  `weights_rate_limit` 2; the loop polls every 0.5 s and resubmits every 5 blocks, so nearly
  every tick does the whole path (fetch, verify, chain read, uid resolution, `SetWeights`,
  state file, heartbeat). The signed epoch payload comes from a loopback provider in another
  process (hypercorn + Starlette), whose memory is not counted.
* **baselines**, measured the same way in the same run: a bare `python -c "import trio, httpx"`
  (the async stack's floor), the bittensor SDK connected to a `DevChain` and reading the block
  (the SDK's own floor, dev chain included, as in the validator row), and, for contrast, a
  process that imports torch and transformers' model and tokenizer classes (what the validator
  must not load; no weights).

Every process is sampled from `/proc/<pid>/status` every `--interval` seconds: VmRSS (resident
now), RssAnon (its private part) and, at the end, VmHWM (the kernel's peak resident size, which
catches spikes between samples). A process's window starts when it is ready (a baseline: after
its imports; the validator: when its first weights are on chain) and lasts `--idle-seconds`
(baselines) or `--seconds` (the validator). "Steady" is the median VmRSS over the window,
"growth" the last window sample minus the first. psutil is not used: it has no peak figure.

The run fails (exit 1, saying why) if the validator's peak exceeds 150 MB (150·10⁶ bytes =
143.1 MiB), if torch or transformers is in its `sys.modules` at exit or any libtorch is mapped
in it, if no weights landed, if a tick fails, or if it exits with an error. Prints a JSON summary and a Markdown
table. Everything binds 127.0.0.1 and lives in a temporary home; every process started here is
stopped here (SIGTERM, then SIGKILL after a timeout).
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NETUID = 53
BLOCK_S = 0.1
RATE_LIMIT = 2
TEMPO = 20
RESUBMIT_BLOCKS = 5  # must exceed RATE_LIMIT
POLL_S = 0.5
EPOCH_INDEX = 1
LIMIT_BYTES = 150 * 10**6
MIB = 2**20
FORBIDDEN = ("torch", "transformers")

LANDED = re.compile(r"weights for \d+ uid\(s\) on chain at block")
READY = "ready"

# Baselines: each prints READY on stderr once its imports are done, then idles until stopped.
BARE = "import sys, time\nimport trio, httpx\nprint('ready', file=sys.stderr, flush=True)\ntime.sleep(3600)\n"
SDK = """import sys, time
import bittensor as bt
from engy_node.local.devchain import DevChain
client = bt.SyncClient("local", substrate=DevChain(), fallback_endpoints=[])
client.connect()
client.block
print("ready", file=sys.stderr, flush=True)
time.sleep(3600)
"""
TORCH = """import sys, time
import torch, transformers
from transformers import PreTrainedModel, PreTrainedTokenizerFast
print("ready", file=sys.stderr, flush=True)
time.sleep(3600)
"""


# ---- the child processes ---------------------------------------------------------------------


def run_provider() -> None:
    """The loopback provider: one signed epoch payload, heartbeats accepted, counters on /bench/counts."""
    import trio
    from bittensor.sp_core import Keypair
    from hypercorn.config import Config
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from engy_node.asgi import start_listener
    from engy_node.protocol.epoch import build_result_json, encode_payload, sign_epoch
    from engy_node.validator.light import EPOCH_PATH, HEARTBEAT_PATH

    master = Keypair.create_from_uri("//bench-master")
    miners = [Keypair.create_from_uri(f"//bench-miner-{name}").ss58_address for name in ("a", "b")]
    result = build_result_json(
        netuid=NETUID,
        epoch_index=EPOCH_INDEX,
        settlement_json={"weights": [[miners[0], 3000], [miners[1], 1000]], "rows": []},
    )
    body = encode_payload(sign_epoch(master, netuid=NETUID, epoch_index=EPOCH_INDEX, result_json=result))
    counts = {"epoch_fetches": 0, "heartbeats": 0}

    async def epoch(request: Request) -> Response:
        counts["epoch_fetches"] += 1
        return Response(body, media_type="application/json")

    async def heartbeat(request: Request) -> Response:
        await request.body()
        counts["heartbeats"] += 1
        return Response(b"{}", media_type="application/json")

    async def show_counts(request: Request) -> Response:
        return JSONResponse(counts)

    app = Starlette(
        routes=[
            Route(EPOCH_PATH, epoch),
            Route(HEARTBEAT_PATH, heartbeat, methods=["POST"]),
            Route("/bench/counts", show_counts),
        ]
    )
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            binds = await start_listener(nursery, app, config, what="bench provider", flag="-")
            print(json.dumps({"url": binds[0], "master": master.ss58_address, "miners": miners}), flush=True)

    trio.run(main)


def run_validator_child(home: str, validator_hotkey: str, miners: list[str], result_path: str) -> int:
    """`engy-node --home HOME --role validator`, with the dev chain as its substrate; on the way out
    (after SIGTERM) writes what landed and which modules were loaded to `result_path`."""
    import functools

    from engy_node import cli
    from engy_node.local.devchain import DevChain
    from engy_node.local.devchain_state import SubnetParams
    from engy_node.validator import role

    chain = DevChain(
        netuid=NETUID, params=SubnetParams(weights_rate_limit=RATE_LIMIT, tempo=TEMPO), block_time_s=BLOCK_S
    )
    validator_uid = chain.register(validator_hotkey, stake_tao=1000.0)
    for miner in miners:
        chain.register(miner)
    role.run_validator = functools.partial(role.run_validator, substrate=chain)
    code = cli.main(["--home", home, "--role", "validator"])
    submissions = chain.submissions
    import logging

    hubs = [handler.hub for handler in logging.getLogger("engy").handlers if hasattr(handler, "hub")]
    report = {
        "exit_code": code,
        "submissions": len(submissions),
        "landed": sum(1 for s in submissions if s.ok),
        "refused": sorted({s.error for s in submissions if not s.ok and s.error}),
        "weights": {str(uid): value for uid, value in chain.weights().get(validator_uid, {}).items()},
        "forbidden_modules": sorted(name for name in sys.modules if name.split(".")[0] in FORBIDDEN),
        "modules": len(sys.modules),
        "bittensor": "bittensor" in sys.modules,
        # The hub's ring of log records (debug included) fills to node.log_ring_size, then stays there.
        "hub_ring": [len(hubs[0]._ring), hubs[0]._ring.maxlen] if hubs else None,
    }
    Path(result_path).write_text(json.dumps(report))
    return code


# ---- measuring ---------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/<pid>/status, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def mapped_torch(pid: int) -> list[str]:
    """Shared objects of torch mapped into the process: evidence from outside its interpreter."""
    with open(f"/proc/{pid}/maps") as maps:
        found = {line.split()[-1] for line in maps if "libtorch" in line or "/torch/" in line}
    return sorted(found)


def stop(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure(
    name: str,
    argv: list[str],
    *,
    ready: re.Pattern | str,
    window_s: float,
    interval_s: float,
    log_path: Path,
    start_timeout_s: float = 180.0,
    env: dict | None = None,
) -> dict:
    """Start `argv`, wait until its stderr shows `ready`, sample it for `window_s`, stop it."""
    pattern = re.compile(re.escape(ready)) if isinstance(ready, str) else ready
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT, env=env)
    started = time.monotonic()
    try:
        while not pattern.search(log_path.read_text()):
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name}: exited with {process.returncode} before it was ready:\n{log_path.read_text()[-3000:]}"
                )
            if time.monotonic() - started > start_timeout_s:
                raise RuntimeError(f"{name}: not ready after {start_timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(interval_s / 5)
        ready_s = time.monotonic() - started
        samples = []
        window_start = time.monotonic()
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name}: exited with {process.returncode} during the window:\n{log_path.read_text()[-3000:]}"
                )
            samples.append(proc_status(process.pid))
            if time.monotonic() - window_start >= window_s:
                break
            time.sleep(interval_s)
        final = proc_status(process.pid)
        torch_maps = mapped_torch(process.pid)
    finally:
        stop(process)
    rss = [s["VmRSS"] for s in samples]
    return {
        "name": name,
        "ready_s": ready_s,
        "samples": len(samples),
        "window_s": window_s,
        "steady_rss": statistics.median(rss),
        "max_sampled_rss": max(rss),
        "peak_hwm": final["VmHWM"],
        "steady_anon": statistics.median(s["RssAnon"] for s in samples),
        "growth": rss[-1] - rss[0],
        "torch_maps": torch_maps,
        "exit_code": process.returncode,
    }


def wait_line(process: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise RuntimeError(f"no answer from {process.args!r} within {timeout_s:.0f} s")
    return process.stdout.readline()


def provider_counts(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/bench/counts", timeout=10).json()


def mib(value: float) -> str:
    return f"{value / MIB:.1f} MiB"


def print_table(rows: list[dict], validator: dict) -> None:
    print(
        "\n| process | ready after | steady RSS (median) | peak (VmHWM) | private (RssAnon) | growth over window "
        "| validator ÷ this, steady | validator ÷ this, peak |"
    )
    print("|---" * 8 + "|")
    for row in rows:
        print(
            f"| {row['name']} | {row['ready_s']:.1f} s | {mib(row['steady_rss'])} | {mib(row['peak_hwm'])} "
            f"| {mib(row['steady_anon'])} | {row['growth'] / MIB:+.1f} MiB ({row['window_s']:.0f} s) "
            f"| {validator['steady_rss'] / row['steady_rss']:.2f}× | {validator['peak_hwm'] / row['peak_hwm']:.2f}× |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="validator window after its first weights land")
    parser.add_argument("--idle-seconds", type=float, default=6.0, help="window of each idle baseline")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch + transformers contrast row")
    parser.add_argument("--child", choices=("provider", "validator"), help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--hotkey", help=argparse.SUPPRESS)
    parser.add_argument("--miners", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "provider":
        run_provider()
        return 0
    if args.child == "validator":
        return run_validator_child(args.home, args.hotkey, args.miners.split(","), args.result)

    if not Path("/proc/self/status").exists():
        raise SystemExit("needs Linux /proc")
    from engy_node import keys

    python = sys.executable
    rows: list[dict] = []
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="engy-validator-rss-") as tmp:
        tmp_path = Path(tmp)
        home = tmp_path / "home"
        home.mkdir()
        env = {
            **os.environ,
            "BTCLI_TOKEN_SYMBOLS_CACHE": str(tmp_path / "token_symbols.json"),
            "BITTENSOR_RUNTIME_CACHE_DIR": str(tmp_path / "runtime-cache"),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("ENGY_HOME", None)
        provider = subprocess.Popen(
            [python, __file__, "--child", "provider"], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
        try:
            served = json.loads(wait_line(provider, 120))
            hotkey = keys.create_wallet(tmp_path / "wallets", "bench", "default")
            (home / "node.toml").write_text(
                "[validator]\n"
                'network = "local"\n'
                f'provider_url = "{served["url"]}"\n'
                f'master_hotkey = "{served["master"]}"\n'
                f'wallets_path = "{tmp_path / "wallets"}"\n'
                'wallet_name = "bench"\n'
                'wallet_hotkey = "default"\n'
                f"poll_s = {POLL_S}\n"
                f"resubmit_blocks = {RESUBMIT_BLOCKS}\n"
                f"block_s = {BLOCK_S}\n"
            )
            common = {"interval_s": args.interval, "env": env}
            rows.append(
                measure(
                    "bare `import trio, httpx`",
                    [python, "-c", BARE],
                    ready=READY,
                    window_s=args.idle_seconds,
                    log_path=tmp_path / "bare.log",
                    **common,
                )
            )
            rows.append(
                measure(
                    "bittensor SDK + dev chain, connected",
                    [python, "-c", SDK],
                    ready=READY,
                    window_s=args.idle_seconds,
                    log_path=tmp_path / "sdk.log",
                    **common,
                )
            )
            result_path = tmp_path / "validator-result.json"
            before = provider_counts(served["url"])
            validator = measure(
                "**validator** (`engy-node --role validator`, dev chain)",
                [
                    python,
                    __file__,
                    "--child",
                    "validator",
                    "--home",
                    str(home),
                    "--hotkey",
                    hotkey,
                    "--miners",
                    ",".join(served["miners"]),
                    "--result",
                    str(result_path),
                ],
                ready=LANDED,
                window_s=args.seconds,
                log_path=tmp_path / "validator.log",
                **common,
            )
            after = provider_counts(served["url"])
            log_text = (tmp_path / "validator.log").read_text()
            validator["log_landed_lines"] = len(LANDED.findall(log_text))
            validator["tick_errors"] = log_text.count("tick failed")
            validator["provider"] = {key: after[key] - before[key] for key in after}
            validator["report"] = json.loads(result_path.read_text()) if result_path.exists() else None
            rows.append(validator)
            if not args.no_torch:
                rows.append(
                    measure(
                        "torch + transformers imported (contrast)",
                        [python, "-c", TORCH],
                        ready=READY,
                        window_s=args.idle_seconds,
                        log_path=tmp_path / "torch.log",
                        **common,
                    )
                )
        finally:
            stop(provider)

    report = validator["report"]
    if report is None:
        problems.append(f"the validator wrote no result (exit code {validator['exit_code']})")
    else:
        if report["exit_code"] != 0 or validator["exit_code"] != 0:
            problems.append(f"the validator exited with {report['exit_code']} (process {validator['exit_code']})")
        if report["forbidden_modules"]:
            problems.append(f"the validator imported {', '.join(report['forbidden_modules'][:5])}")
        if not report["weights"] or report["landed"] == 0:
            problems.append("no weights landed on the dev chain")
    if validator["torch_maps"]:
        problems.append(f"torch libraries are mapped in the validator: {', '.join(validator['torch_maps'][:3])}")
    if validator["peak_hwm"] > LIMIT_BYTES:
        problems.append(
            f"the validator's peak resident size {mib(validator['peak_hwm'])} exceeds 150 MB ({mib(LIMIT_BYTES)})"
        )
    if validator["tick_errors"]:
        problems.append(f"{validator['tick_errors']} tick(s) failed (see the validator log)")

    print(json.dumps(rows, indent=2))
    print_table(rows, validator)
    if report is not None:
        refused = report["submissions"] - report["landed"]
        print(
            f"\nvalidator, start-up and its {validator['window_s']:.0f} s window: {validator['provider']['heartbeats']} ticks, "
            f"{validator['log_landed_lines']} weight submissions landed, {refused} refused by the chain"
            f"{' (' + ', '.join(report['refused']) + ')' if report['refused'] else ''}, "
            f"weights row {report['weights']}, {report['modules']} modules loaded, torch/transformers: "
            f"{'LOADED' if report['forbidden_modules'] else 'not imported'}, libtorch mapped: "
            f"{'yes' if validator['torch_maps'] else 'no'}"
            + (
                f", hub log ring {report['hub_ring'][0]:,} of {report['hub_ring'][1]:,} records"
                if report["hub_ring"]
                else ""
            )
        )
    print(f"limit: peak ≤ 150 MB ({mib(LIMIT_BYTES)}); validator peak {mib(validator['peak_hwm'])}")
    if problems:
        for problem in problems:
            print(f"FAIL: {problem}", file=sys.stderr)
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
