"""Many synthetic miners in one process, for `bench/fleet.py`: each on the real link
(`GatewayLink` through `synthetic_link`: hello, admit, heartbeats, serve, chunks, response), all
on one trio loop, driven by `bench/fleet.py` over this process's stdin and stdout.

    .venv/bin/python bench/fleet_miners.py --gateway ws://127.0.0.1:PORT/gw --keys KEYS.json --checkpoint DIR [--slots 4]

`KEYS.json` is a list of `[index, miner_key]`: miner `index` answers every request with
`[m<index>] ` and a fixed sentence, so a buyer reads who served it from the answer itself.

Why a process of its own. A thousand links are a thousand sets of websocket legs, heartbeats
and handshakes; in the benchmark's process they would take the event loop and the CPU from the
buyers whose latency it measures. A few of these processes, each with its own loop, spread the
links over the machine the way separate rigs would be.

The conversation with `bench/fleet.py`, one JSON object per line:

* out `{"ready": miners}` once the served model is loaded; in `go`: every link starts dialling
  at once (the admission storm), out `{"go_at": t}`;
* out `{"t": t, "legs": up, "drops": n, "ups": n}` whenever the number of admitted legs in this
  process changed (at most every `REPORT_S`): `t` is when it last changed, `drops` and `ups`
  count legs lost and admitted since `go`. Times are `time.monotonic()`, one clock for every
  process on the machine (CLOCK_MONOTONIC);
* in `stop` (or the end of stdin): the links are cancelled, out `{"own_ms": [...]}`: for each
  streamed request, the miner's own time from the serve frame reaching its handler to its first
  chunk handed to the websocket, what the buyer's time to first token includes of the miner.

Each link gets its own random generator (seeded by its index): `synthetic_link` seeds every link
alike, which would make a thousand re-dials back off in lockstep, as no fleet of separate rigs
does.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx
import trio

ANSWER = "The quick brown fox jumps over the lazy dog."
REPORT_S = 0.05
"""How often a changed leg count is reported: often enough to time a storm to a few tens of
milliseconds, rarely enough to cost nothing."""


def answer_text(index: int) -> str:
    return f"[m{index}] {ANSWER}"


class TimedHandler:
    """The synthetic handler, timing the miner's own share of a buyer's time to first token."""

    def __init__(self, inner, own_s: list[float]) -> None:
        self.inner = inner
        self.own_s = own_s

    async def handle(self, frame, send) -> None:
        started = time.perf_counter()
        first = [frame.stream]

        async def timed_send(message) -> None:
            await send(message)
            if first[0]:
                first[0] = False
                self.own_s.append(time.perf_counter() - started)

        await self.inner.handle(frame, timed_send)


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class LegCount:
    """Admitted legs over every link of this process, kept as the links report changes."""

    def __init__(self, links: int) -> None:
        self.per_link = [0] * links
        self.up = 0
        self.drops = 0
        self.ups = 0
        self.changed_at = time.monotonic()
        self.reported: tuple[int, int, int] | None = None

    def update(self, link: int, legs_up: int) -> None:
        before = self.per_link[link]
        if legs_up == before:
            return
        self.per_link[link] = legs_up
        self.up += legs_up - before
        if legs_up > before:
            self.ups += legs_up - before
        else:
            self.drops += before - legs_up
        self.changed_at = time.monotonic()

    def report(self) -> None:
        now = (self.up, self.drops, self.ups)
        if now != self.reported:
            self.reported = now
            emit({"t": self.changed_at, "legs": self.up, "drops": self.drops, "ups": self.ups})


async def run(gateway_url: str, keys: list[tuple[int, str]], checkpoint: Path, slots: int) -> None:
    from engy_node.miner.link import Identity
    from engy_node.models import SMOLLM2_135M
    from engy_node.served_model import load_served_model
    from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link

    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    own_s: list[float] = []
    count = LegCount(len(keys))
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    emit({"ready": len(keys)})
    received = b""
    while b"\n" not in received:
        data = await stdin.receive_some(4096)
        if not data:
            return
        received += data
    if received.split(b"\n", 1)[0].strip() != b"go":
        raise SystemExit(f"expected `go` on stdin, got {received!r}")

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http, trio.open_nursery() as nursery:
        links = []
        for position, (index, key) in enumerate(keys):
            text = answer_text(index)
            handler = TimedHandler(
                SyntheticHandler(served, lambda frame, text=text: Script(text=text, chunk_chars=16)), own_s
            )
            link = synthetic_link(
                gateway_url=gateway_url,
                model=served,
                identity=Identity(miner_key=key),
                handler=handler,
                http=http,
                max_inflight=slots,
                worker_name=f"fleet-m{index}",
            )
            link.rng = random.Random(index)
            link.on_state = lambda position=position, **state: count.update(position, state["legs_up"])
            links.append(link)
        emit({"go_at": time.monotonic()})
        for link in links:
            nursery.start_soon(link.run)

        async def report() -> None:
            while True:
                count.report()
                await trio.sleep(REPORT_S)

        nursery.start_soon(report)
        rest = received.split(b"\n", 1)[1]
        while b"stop" not in rest:
            data = await stdin.receive_some(4096)
            if not data:
                break
            rest += data
        count.report()
        nursery.cancel_scope.cancel()
    emit({"own_ms": [round(seconds * 1000, 4) for seconds in own_s]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", required=True, help="the miners' websocket URL (the balancer's)")
    parser.add_argument("--keys", type=Path, required=True, help="JSON list of [index, miner_key]")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the served model's checkpoint directory")
    parser.add_argument("--slots", type=int, default=4, help="concurrent requests per miner, split over its legs")
    args = parser.parse_args()
    keys = [(int(index), str(key)) for index, key in json.loads(args.keys.read_text())]
    trio.run(run, args.gateway, keys, args.checkpoint, args.slots)


if __name__ == "__main__":
    main()
