"""Verdicts on honest miners under load: `engy-node up` (two reference miners, the gateway, the
verifier and the trust pipeline on loopback) driven by N concurrent buyers through the official
`openai` SDK until the verifier has judged enough of their answers; then every verdict, by miner,
kind and reason, and the verifier's log line for each one that was not `pass` (what it rests on).

    .venv/bin/python bench/verdicts_under_load.py --concurrency 50 --verdicts 300 [--max-minutes 90]

Every miner here is honest (the project's own reference server behind the project's miner), so
every `cheat` is a false positive of the verdict rules under load. Buyers send probe-corpus
conversations with a buyer-like mix of sampling (the gateway's `DEFAULT_SAMPLING_MIX`) and
max_tokens, half of them streamed; a request that fails is counted, not retried. Nothing is
downloaded; the run's home is a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engy_node.gateway.trust.traffic_probes import DEFAULT_SAMPLING_MIX  # noqa: E402
from engy_node.probe_corpus import load_probe_corpus  # noqa: E402

READY_LINE = "engy local network is up."
VERDICT_LINE = re.compile(r"engy\.verifier: job (\S+) \(.*\): (cheat|unproven) ")
MAX_TOKENS = (32, 64, 128, 256)
MAX_PROMPT_CHARS = 1_500


class Network:
    """`engy-node up` in a home of its own, its output kept (lines) as it comes."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", str(home), "up", "--port-base", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=ROOT,
        )
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(timeout=300):
            self.stop()
            raise SystemExit("engy-node up did not come up within 5 minutes:\n" + "".join(self.lines[-40:]))
        self.network = json.loads((home / "data" / "local" / "network.json").read_text())

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if READY_LINE in line:
                self.ready.set()

    def verdicts(self) -> list[tuple[str, str, str, str, str]]:
        """(request id, miner, kind, verdict, reason) of every verdict stored so far."""
        path = self.home / "data" / "gateway.sqlite3"
        if not path.exists():
            return []
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
            return db.execute("SELECT request_id, miner, kind, verdict, reason FROM verdicts ORDER BY id").fetchall()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def buyers(network: dict, *, concurrency: int, until, counts: collections.Counter) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=network["buyer_api"], api_key=network["buyer_key"], max_retries=0, timeout=600)
    model = network["models"][0]
    prompts = [p for p in load_probe_corpus() if p.chars <= MAX_PROMPT_CHARS]
    weights = [shape.weight for shape in DEFAULT_SAMPLING_MIX]

    async def buyer(index: int) -> None:
        rng = random.Random(index)
        while not until():
            shape = rng.choices(DEFAULT_SAMPLING_MIX, weights)[0]
            body = {
                "model": model,
                "messages": [dict(m) for m in rng.choice(prompts).messages],
                "max_tokens": rng.choice(MAX_TOKENS),
            }
            if shape.temperature is not None:
                body["temperature"] = shape.temperature
            if shape.top_p is not None:
                body["top_p"] = shape.top_p
            try:
                if rng.random() < 0.5:
                    stream = await client.chat.completions.create(**body, stream=True)
                    async for _ in stream:
                        pass
                else:
                    await client.chat.completions.create(**body)
                counts["answered"] += 1
            except openai.OpenAIError as error:
                status = getattr(error, "status_code", None)
                counts[f"failed: {type(error).__name__}" + (f" {status}" if status else "")] += 1
                await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for index in range(concurrency):
            nursery.start_soon(buyer, index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--verdicts", type=int, default=300, help="stop once the verifier has judged this many answers")
    parser.add_argument("--max-minutes", type=float, default=90)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="engy-verdicts-") as tmp:
        network = Network(Path(tmp))
        started = time.monotonic()
        counts: collections.Counter = collections.Counter()
        try:
            deadline = started + args.max_minutes * 60
            last_check = [0.0, 0]

            def until() -> bool:
                now = time.monotonic()
                if now - last_check[0] > 10:
                    last_check[0], last_check[1] = now, len(network.verdicts())
                    print(
                        f"{(now - started) / 60:5.1f} min: {counts['answered']} answered, {last_check[1]} verdicts",
                        file=sys.stderr,
                        flush=True,
                    )
                return last_check[1] >= args.verdicts or now > deadline

            trio.run(lambda: buyers(network.network, concurrency=args.concurrency, until=until, counts=counts))
            time.sleep(20)  # verdicts on the last answers
            verdicts = network.verdicts()
        finally:
            network.stop()
        minutes = (time.monotonic() - started) / 60
        print(f"{args.concurrency} concurrent buyers for {minutes:.1f} min: {dict(counts)}; {len(verdicts)} verdicts\n")
        print("| miner | kind | verdict | reason | count |\n|---|---|---|---|---|")
        tally = collections.Counter((miner, kind, verdict, reason) for _, miner, kind, verdict, reason in verdicts)
        for (miner, kind, verdict, reason), count in sorted(tally.items()):
            print(f"| {miner[:12]}… | {kind} | {verdict} | {reason} | {count} |")
        flagged = {request_id for request_id, _, _, verdict, _ in verdicts if verdict != "pass"}
        lines = [line.strip() for line in network.lines if (m := VERDICT_LINE.search(line)) and m.group(1) in flagged]
        if lines:
            print("\nThe verifier's line for each verdict that was not pass:\n")
            print("\n".join(f"    {line}" for line in lines))


if __name__ == "__main__":
    main()
