"""Frame time and CPU of the node manager (`engy-tui --local`) while its hub takes 1,000 events/s.

    .venv/bin/python bench/tui_frames.py [--seconds 10] [--rate 1000] [--tabs overview,validator,logs]   # ~2 min

Issue 13: a frame must take ≤ 50 ms while the hub receives 1,000 events/s, and the app must
use ≤ 3 % of a core when idle. This runs the real app, `engy_tui.manager.NodeManager`, over the
real `NodeBridge.local` (the node as a trio guest run on Textual's asyncio loop, its hub read
every 0.25 s, a frame every `RENDER_INTERVAL_S`), headless at 160×45 through
`App.run_test` — Textual's headless driver, which lays out and composes every frame exactly as
on a terminal but skips turning the update into escape sequences. That last step is done here
for every update, with a truecolor console into a string, so the figures include what a
terminal would be sent (minus the write itself).

The node is synthetic (`SyntheticNode`, the `start(hub, actions, *, task_status)` coroutine a
local network is): it logs through `install_logging` (`engy.*` loggers → `HubHandler` → the
hub's ring), `--rate` events a second in batches every 10 ms, from ten components at mixed
levels (~45 % debug, which the Logs view hides at its default threshold, ~45 % info, ~8 %
warning, ~2 % error) with the shapes of the node's real messages; and it publishes the states a
busy local network publishes once a second: "chain" (`_chain_snapshot`'s keys, 65 neurons — a
validator and 64 miners — and the validator's weights row), "validator" (the light loop's keys,
weights for the 64 miners, 20 submissions), "epochs", "gpus" (`gpu_monitor.sample` of
`FakeNvml.from_spec("4xRTX4090,1xRTX5090")` with the cards' load changing every second, and
`assess`'s findings), "traffic" (30 miners' eligibility with their transition history),
"verifier", "node" (65 hotkey names), and two local miners' states with their in-flight
requests; and its miners' `MinerMetrics` (the Overview's requests panel) record 30 requests a
second. At 0 events/s nothing changes at all: no log line, no state, no metric (the idle case).

Before the phases the Logs view is filled to its capacity (`--prefill`, 100,000 lines, what 100
s at 1,000 events/s leave), through `LogsView.append` in batches of 1,000, so every phase sees
the steady state of a long session. Then, for each rate (`--rate`, then 0) and each tab
(`--tabs`, Logs with follow on), a warm-up (`--warmup` s) and `--seconds` s of measurement.

Measured, per frame (the frame's `render_frame` call up to the next one):

* `render_frame`: the app's own copy of the snapshot and the drained events into the widgets
  (wrapped on the instance before mount, so the app's interval timer calls the wrapper);
* refresh: every `Screen._on_timer_update` in the frame's interval — the layout reflow, the
  compositor's render of the dirty widgets, and the escape sequences (`App._display` wrapped);
  `Screen._refresh_layout` calls outside that timer are counted too;
* frame work = the two added up (the ≤ 50 ms target applies to its p99); the main thread's CPU
  time for the same spans is kept too, since on a shared machine wall time includes preemption;
* to screen: from `render_frame`'s call to the end of the first refresh after it (includes
  Textual's refresh timer, 1/60 s, and waiting behind the node on the event loop);
* GC: garbage collection (`gc.callbacks`) that ran inside the frame's work, and the frame work
  without it (what the app's own code costs; the target is judged with it, as a user sees it).

CPU: `time.process_time()` (all threads of the process) over each phase's wall time, as % of
one core. The node runs in the app's process, as `engy-tui --local` runs it, so the same node
is also measured without the app in the same run: alone under `trio.run` ("node alone"), and
as a guest run read by the bridge with its events drained every 0.5 s but no app ("node +
bridge"). The app's own share is the difference.

Prints a Markdown table; exits 1 if a target is missed (saying which): frame work p99 ≤ 50 ms
on every tab at `--rate`, and process CPU ≤ 3 % on every tab at 0 events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import functools
import gc
import hashlib
import io
import itertools
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trio  # noqa: E402
from rich.console import Console  # noqa: E402
from textual.screen import Screen  # noqa: E402

from engy_node.hardware import monitor as gpu_monitor  # noqa: E402
from engy_node.hardware.fake_nvml import FakeNvml  # noqa: E402
from engy_node.hub import Hub, install_logging  # noqa: E402
from engy_node.miner.role import MinerMetrics  # noqa: E402
from engy_tui import manager as manager_module  # noqa: E402
from engy_tui.manager import NodeManager  # noqa: E402
from engy_tui.node_bridge import NodeBridge  # noqa: E402
from engy_tui.widgets.logs import LogsView  # noqa: E402
from engy_tui.widgets.logs.buffer import DEFAULT_CAPACITY  # noqa: E402

SIZE = (160, 45)
BATCH_S = 0.01
STATE_S = 1.0
FRAME_TARGET_MS = 50.0
IDLE_CPU_TARGET = 3.0
MINERS = 64
TRAFFIC_WORKERS = 30
SUBMISSIONS = 20
SERVED_PER_S = 30
"""Requests the node's miners serve a second under load (their metrics feed the requests panel)."""
LOCAL_MINERS = ("miner-1", "miner-2")
GPU_SPEC = "4xRTX4090,1xRTX5090"
MODEL = "Qwen/Qwen3-8B"
ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def ss58(seed: str) -> str:
    """A deterministic ss58-shaped address (48 base58 characters starting with 5)."""
    digest = hashlib.sha256(seed.encode()).digest() * 2
    return "5" + "".join(ALPHABET[byte % len(ALPHABET)] for byte in digest[:47])


NAMES = {"validator": ss58("validator"), **{f"miner-{i}": ss58(f"miner-{i}") for i in range(1, MINERS + 1)}}
"""{name: ss58}, as a local network publishes its hotkeys; uid 0 is the validator, uid i miner-i."""
HOTKEYS = list(NAMES.values())


# ---- the synthetic node -------------------------------------------------------------------------


@dataclasses.dataclass
class Load:
    """What the synthetic node does now; the benchmark changes it between phases (same thread)."""

    rate: int = 0
    """Log events per second."""
    emitted: int = 0


def _rid(rng: random.Random) -> str:
    return f"{rng.getrandbits(48):012x}"


def _miner(rng: random.Random) -> str:
    return f"miner-{rng.randint(1, MINERS)}"


# (weight, level, logger, format, arguments): the node's real message shapes, from ten loggers.
Template = tuple[int, int, str, str, Callable[[random.Random], tuple[Any, ...]]]
TEMPLATES: list[Template] = [
    (
        14,
        logging.DEBUG,
        "engy.gateway",
        "request %s: routed to %s (%s), %d candidates, load %.2f",
        lambda r: (_rid(r), _miner(r), MODEL, r.randint(3, 30), r.random()),
    ),
    (
        10,
        logging.DEBUG,
        "engy.gateway.pool",
        "leg %s of %s: capacity %d -> %d, %d in flight",
        lambda r: (_rid(r)[:8], _miner(r), r.randint(4, 16), r.randint(4, 16), r.randint(0, 16)),
    ),
    (
        8,
        logging.DEBUG,
        "engy.miner.link",
        "frame for request %s: %d bytes, %d chunks",
        lambda r: (_rid(r), r.randint(200, 9000), r.randint(1, 3)),
    ),
    (
        7,
        logging.DEBUG,
        "engy.verifier",
        "request %s: recomputed %d rows in %.1f ms",
        lambda r: (_rid(r), r.randint(40, 400), r.uniform(30, 300)),
    ),
    (
        6,
        logging.DEBUG,
        "engy.devchain",
        "block %d sealed with %d extrinsics",
        lambda r: (r.randint(1_000, 9_999), r.randint(0, 4)),
    ),
    (
        16,
        logging.INFO,
        "engy.gateway",
        "request %s: %s served %d tokens in %d ms (ttft %d ms), charged %d",
        lambda r: (_rid(r), _miner(r), r.randint(8, 512), r.randint(80, 4000), r.randint(20, 400), r.randint(10, 9000)),
    ),
    (
        10,
        logging.INFO,
        "engy.miner.serving",
        "request %s: %d prompt + %d output tokens, %.1f tok/s",
        lambda r: (_rid(r), r.randint(20, 3000), r.randint(8, 512), r.uniform(20, 180)),
    ),
    (
        9,
        logging.INFO,
        "engy.verifier",
        "request %s from %s: verdict %s (%d tokens, %.1f ms)",
        lambda r: (
            _rid(r),
            _miner(r),
            r.choice(("pass", "pass", "pass", "unproven")),
            r.randint(8, 512),
            r.uniform(20, 900),
        ),
    ),
    (
        6,
        logging.INFO,
        "engy.gateway.traffic",
        "probe %s to %s (%s): %s",
        lambda r: (_rid(r), _miner(r), MODEL, r.choice(("ok, verdict pass", "ok, verdict pass", "timed out"))),
    ),
    (
        3,
        logging.INFO,
        "engy.gateway.http",
        "%s %s %d %.1f ms",
        lambda r: ("POST", "/v1/chat/completions", r.choice((200, 200, 200, 429)), r.uniform(1, 40)),
    ),
    (
        1,
        logging.INFO,
        "engy.validator",
        "epoch %d: weights for %d uid(s) on chain at block %d",
        lambda r: (r.randint(40, 60), MINERS, r.randint(1_000, 9_999)),
    ),
    (
        4,
        logging.WARNING,
        "engy.gateway",
        "request %s: miner %s was slow to its first token (%d ms); retrying on %s",
        lambda r: (_rid(r), _miner(r), r.randint(2000, 9000), _miner(r)),
    ),
    (
        2,
        logging.WARNING,
        "engy.miner.link",
        "link to the gateway is backed up: %d frames queued",
        lambda r: (r.randint(10, 400),),
    ),
    (
        2,
        logging.WARNING,
        "engy.gpus",
        "GPU %d at %d °C: check the case airflow and the fan curve",
        lambda r: (r.randint(0, 4), r.randint(80, 86)),
    ),
    (
        1,
        logging.ERROR,
        "engy.gateway",
        "request %s: miner %s disconnected mid-stream (ConnectionClosed); %s",
        lambda r: (_rid(r), _miner(r), "the buyer got an error"),
    ),
    (
        1,
        logging.ERROR,
        "engy.verifier",
        "request %s from %s: commitment check failed (%s)",
        lambda r: (_rid(r), _miner(r), "hidden states differ at row 17"),
    ),
]


class Messages:
    """Draws log calls from `TEMPLATES` by weight; the same seed gives the same stream."""

    def __init__(self, seed: int = 13) -> None:
        self.rng = random.Random(seed)
        self.cum = list(itertools.accumulate(t[0] for t in TEMPLATES))
        self.loggers = {t[2]: logging.getLogger(t[2]) for t in TEMPLATES}

    def draw(self) -> tuple[int, str, str, tuple[Any, ...]]:
        _, level, name, fmt, args = TEMPLATES[self._index()]
        return level, name, fmt, args(self.rng)

    def _index(self) -> int:
        return bisect.bisect_right(self.cum, self.rng.random() * self.cum[-1])

    def log(self, count: int) -> None:
        for _ in range(count):
            level, name, fmt, args = self.draw()
            self.loggers[name].log(level, fmt, *args)

    def events(self, count: int, *, start_ts: float, span_s: float) -> list[dict[str, Any]]:
        """`count` hub-shaped event dicts spread over `span_s` s (to fill the Logs view)."""
        names = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error"}
        out = []
        for i in range(count):
            level, name, fmt, args = self.draw()
            out.append(
                {
                    "seq": i,
                    "ts": start_ts + span_s * i / count,
                    "level": names[level],
                    "component": name.removeprefix("engy."),
                    "message": fmt % args,
                }
            )
        return out


class SyntheticNode:
    """A busy local network's hub traffic, as `NodeBridge.local`'s `start` coroutine."""

    def __init__(self, load: Load, *, seed: int = 13) -> None:
        self.load = load
        self.messages = Messages(seed)
        self.rng = random.Random(seed + 1)
        self.nvml = FakeNvml.from_spec(GPU_SPEC)
        self.idle_gpus = self.nvml.gpus
        self.block = 4_000
        self.epoch = 120
        self.started = time.time()

    async def run(self, hub: Hub, actions: Any, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.nvml.init()
        self.metrics = MinerMetrics(hub)
        for name in LOCAL_MINERS:  # the keys `run_miner` and its link publish
            hub.set_state(name, model=MODEL, max_inflight=8, cpu_mode=False, inflight=0)
        hub.set_state(
            "node",
            roles=["chain", "gateway", "miner", "validator", "verifier"],
            network="local",
            started_at=self.started,
            pid=os.getpid(),
            hotkeys=NAMES,
        )
        hub.set_state("verifier", state="running", gateway="http://127.0.0.1:8091", hotkey=ss58("verifier"))
        await self._publish(hub)  # the whole shape once, even when idle from the start
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._log_forever)
            nursery.start_soon(self._states_forever, hub)

    async def _log_forever(self) -> None:
        last = next_at = trio.current_time()
        owed = served = 0.0
        while True:
            if not self.load.rate:
                await trio.sleep(0.5)  # idle: no 10 ms wake-ups
                last = next_at = trio.current_time()
                owed = 0.0
                continue
            next_at += BATCH_S
            await trio.sleep_until(next_at)
            now = trio.current_time()
            if now - next_at > 0.1:
                next_at = now  # fell behind (a long frame): do not burst to catch up on the schedule
            owed += self.load.rate * (now - last)  # by elapsed time, so the rate is exact on average
            last = now
            count = int(owed)
            owed -= count
            if count:
                self.messages.log(count)
                self.load.emitted += count
            served += SERVED_PER_S * self.load.rate / 1000 * BATCH_S
            while served >= 1:
                served -= 1
                self._serve_one()

    def _serve_one(self) -> None:
        """One request's metrics, as `MinerMetrics.record` leaves them."""
        rng, metrics = self.messages.rng, self.metrics
        ok = rng.random() > 0.02
        metrics.requests.labels(outcome="ok" if ok else "timeout").inc()
        if ok:
            metrics.tokens.labels(kind="prompt").inc(rng.randint(20, 3000))
            metrics.tokens.labels(kind="completion").inc(rng.randint(8, 512))
            metrics.proof.observe(rng.uniform(0.002, 0.03))
            metrics.ttft.observe(rng.lognormvariate(-1.6, 0.5))
            metrics.tpot.observe(rng.lognormvariate(-4.0, 0.3))

    async def _states_forever(self, hub: Hub) -> None:
        while True:
            await trio.sleep(STATE_S)
            if self.load.rate:
                await self._publish(hub)

    async def _publish(self, hub: Hub) -> None:
        rng, now = self.rng, time.time()
        self.block += 1
        if self.block % 30 == 0:
            self.epoch += 1
        neurons = [
            {
                "uid": uid,
                "hotkey": hotkey,
                "stake": 1000.0 if uid == 0 else rng.uniform(0, 5),
                "permit": uid == 0,
                "active": uid != 37,
                "last_update": self.block - (3 if uid == 0 else rng.randint(1, 300)),
                "incentive": 0.0 if uid == 0 else rng.random() / MINERS,
                "dividends": 1.0 if uid == 0 else 0.0,
                "emission": rng.uniform(0, 2),
            }
            for uid, hotkey in enumerate(HOTKEYS)
        ]
        weights = {uid: rng.randint(200, 65_535) for uid in range(1, MINERS + 1)}
        hub.set_state(
            "chain",
            network="dev chain",
            netuid=53,
            block=self.block,
            block_time_s=1.0,
            tempo=30,
            epochs_run=self.epoch,
            neurons=neurons,
            weights={"0": {str(uid): value for uid, value in weights.items()}},
        )
        submissions = [
            {
                "ts": now - 12 * i,
                "block": self.block - 12 * i,
                "epoch": self.epoch - i // 3,
                "kind": "applied" if i % 3 == 2 else "resubmitted",
                "landed": i != 7,
                "detail": "chain refusal: SettingWeightsTooFast [rate_limited]"
                if i == 7
                else f"included as {self.block - 12 * i + 1}-{i % 4}",
            }
            for i in range(SUBMISSIONS)
        ]
        hub.set_state(
            "validator",
            hotkey=NAMES["validator"],
            network="dev chain",
            provider="http://127.0.0.1:8090",
            netuid=53,
            resubmit_blocks=12,
            poll_s=1.0,
            block=self.block,
            block_time_s=1.0,
            uid=0,
            permit=True,
            last_update=self.block - 3,
            weights_rate_limit=10,
            activity_cutoff=416,
            tempo=30,
            commit_reveal=False,
            submitted_epoch=self.epoch,
            submitted_block=self.block - 3,
            digest=hashlib.sha256(str(self.epoch).encode()).hexdigest(),
            dropped=[],
            dropped_share=0.0,
            weights=[{"uid": uid, "hotkey": HOTKEYS[uid], "weight": value} for uid, value in weights.items()],
            submissions=submissions,
            last_tick=now,
            last_outcome="skipped:too-soon",
            last_applied=self.epoch,
            last_submit_block=self.block - 3,
            last_submit_ts=now - 3,
            blocks_since_submit=3,
            next_resubmit_in_blocks=9,
        )
        hub.set_state(
            "epochs",
            latest=self.epoch,
            digest=hashlib.sha256(str(self.epoch).encode()).hexdigest(),
            weights=[[HOTKEYS[uid], value] for uid, value in weights.items()],
        )
        # The GPUs under load: utilisation, power, temperature and memory move every second.
        self.nvml.gpus = tuple(
            dataclasses.replace(
                gpu,
                gpu_util_percent=rng.randint(70, 100),
                memory_util_percent=rng.randint(30, 80),
                power_draw_w=int(gpu.power_limit_w * rng.uniform(0.6, 0.98)),
                temperature_c=rng.randint(60, 84),
                fan_percent=rng.randint(50, 90),
                memory_used_mib=int(gpu.memory_total_mib * 0.9),
                sm_clock_mhz=rng.randint(2500, 2800),
                mem_clock_mhz=gpu.mem_clock_max_mhz,
                clock_event_reasons=0,
            )
            for gpu in self.idle_gpus
        )
        samples = await trio.to_thread.run_sync(gpu_monitor.sample, self.nvml)
        hub.set_state(
            "gpus",
            samples=[s.as_dict() for s in samples],
            findings=[f.as_dict() for f in gpu_monitor.assess(samples)],
            reason=None,
            error=None,
            sampled_at=now,
        )
        states = ("active",) * 6 + ("probing", "pulled")
        workers = []
        for i in range(1, TRAFFIC_WORKERS + 1):
            state = states[i % len(states)]
            workers.append(
                {
                    "miner": HOTKEYS[i],
                    "model": MODEL,
                    "state": state,
                    "since": now - 60 * i,
                    "reason": {
                        "active": "qualified: 5/5 probes passed",
                        "probing": "connected; probing",
                        "pulled": "3 unproven verdicts in the window",
                    }[state],
                    "eligible": state == "active",
                    "first_party": i <= 2,
                    "connected": state != "pulled",
                    "until": now + 300 if state == "pulled" else None,
                    "strikes": int(state == "pulled"),
                    "round": {"probes": 5, "ok": 5, "pass": 5, "unproven": 0, "cheat": 0},
                    "window": {
                        "requests": rng.randint(50, 400),
                        "failed": rng.randint(0, 3),
                        "verdicts": 40,
                        "unproven": 0,
                    },
                    "history": [
                        {"from": "new", "to": "probing", "reason": "connected", "at": now - 900, "code": "connected"},
                        {
                            "from": "probing",
                            "to": "active",
                            "reason": "5/5 probes passed",
                            "at": now - 800,
                            "code": "qualified",
                        },
                    ],
                }
            )
        hub.set_state("traffic", workers=workers)
        for name in LOCAL_MINERS:
            hub.set_state(name, inflight=rng.randint(2, 8))
        hub.set_state("verifier", verdicts={"pass": 1000 + self.block, "unproven": 3, "cheat": 0})


# ---- instruments ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Frame:
    t0: float
    render_ms: float = 0.0
    render_cpu_ms: float = 0.0
    refresh_ms: float = 0.0
    refresh_cpu_ms: float = 0.0
    output_ms: float = 0.0
    output_bytes: int = 0
    refreshes: int = 0
    to_screen_ms: float | None = None
    events: int = 0
    gc_ms: float = 0.0
    """Garbage collection inside this frame's work (render_frame or a refresh)."""

    @property
    def work_ms(self) -> float:
        return self.render_ms + self.refresh_ms

    @property
    def work_cpu_ms(self) -> float:
        return self.render_cpu_ms + self.refresh_cpu_ms


class Probe:
    """Times `render_frame`, the screen refreshes and the escape sequences, frame by frame."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.current: Frame | None = None
        self.recording = False
        self._depth = 0
        self.console = Console(
            color_system="truecolor",
            file=io.StringIO(),
            force_terminal=True,
            width=SIZE[0],
            height=SIZE[1],
            legacy_windows=False,
            markup=False,
            highlight=False,
            emoji=False,
        )
        self._saved: dict[str, Any] = {}
        self.in_work = False
        self._gc_t0 = 0.0

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self.in_work and self.current is not None:
            self.current.gc_ms += (time.perf_counter() - self._gc_t0) * 1e3

    def install(self, app: NodeManager, bridge: NodeBridge) -> None:
        probe = self
        render_frame = app.render_frame  # bound; the app's on_mount schedules the instance attribute

        def timed_render_frame() -> None:
            if probe.current is not None and probe.recording:
                probe.frames.append(probe.current)
            t0, c0 = time.perf_counter(), time.thread_time()
            probe.current = Frame(t0)
            probe.in_work = True
            try:
                render_frame()
            finally:
                probe.in_work = False
            probe.current.render_ms = (time.perf_counter() - t0) * 1e3
            probe.current.render_cpu_ms = (time.thread_time() - c0) * 1e3

        app.render_frame = timed_render_frame  # type: ignore[method-assign]

        drain = bridge.drain_events

        def counted_drain() -> list[dict[str, Any]]:
            events = drain()
            if probe.current is not None:
                probe.current.events += len(events)
            return events

        bridge.drain_events = counted_drain  # type: ignore[method-assign]

        display = app._display

        def encoded_display(screen: Screen, renderable: Any) -> None:
            # Headless, Textual skips this step; a terminal needs it, so do it here and discard.
            render = getattr(renderable, "render_segments", None)
            if render is not None and app.is_headless:
                t0 = time.perf_counter()
                sequence = render(probe.console)
                if probe.current is not None:
                    probe.current.output_ms += (time.perf_counter() - t0) * 1e3
                    probe.current.output_bytes += len(sequence.encode())
            display(screen, renderable)

        app._display = encoded_display  # type: ignore[method-assign]

        gc.callbacks.append(self._gc)
        for name in ("_on_timer_update", "_refresh_layout"):
            original = getattr(Screen, name)
            self._saved[name] = original
            setattr(Screen, name, self._timed(original))

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        @functools.wraps(original)
        def timed(screen: Screen, *args: Any, **kwargs: Any) -> Any:
            if probe._depth:  # a layout refresh inside the timer's refresh: counted there
                return original(screen, *args, **kwargs)
            probe._depth += 1
            probe.in_work = True
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(screen, *args, **kwargs)
            finally:
                probe._depth -= 1
                probe.in_work = False
                frame = probe.current
                if frame is not None:
                    end = time.perf_counter()
                    frame.refresh_ms += (end - t0) * 1e3
                    frame.refresh_cpu_ms += (time.thread_time() - c0) * 1e3
                    frame.refreshes += 1
                    if frame.to_screen_ms is None:
                        frame.to_screen_ms = (end - frame.t0) * 1e3

        return timed

    def uninstall(self) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        for name, original in self._saved.items():
            setattr(Screen, name, original)

    def start(self) -> None:
        self.frames = []
        self.recording = True

    def stop(self) -> list[Frame]:
        self.recording = False
        return self.frames


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclasses.dataclass
class Phase:
    name: str
    rate: int
    tab: str | None
    seconds: float
    cpu_pct: float
    emitted_per_s: float
    frames: list[Frame] = dataclasses.field(default_factory=list)
    note: str = ""


class CpuWindow:
    def __enter__(self) -> CpuWindow:
        self.c0, self.w0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cpu_s = time.process_time() - self.c0
        self.wall_s = time.perf_counter() - self.w0

    @property
    def pct(self) -> float:
        return 100 * self.cpu_s / self.wall_s


# ---- runs -----------------------------------------------------------------------------------------


def fresh_hub() -> Hub:
    hub = Hub(ring_size=10_000)  # node.log_ring_size's default
    install_logging(hub, level="info", stderr=False)
    return hub


def node_alone(rate: int, seconds: float, warmup: float) -> Phase:
    """The synthetic node under `trio.run`, nobody reading its hub."""
    load = Load(rate)
    node = SyntheticNode(load)
    result: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run, fresh_hub(), None)
            await trio.sleep(warmup)
            before = load.emitted
            with CpuWindow() as window:
                await trio.sleep(seconds)
            result.update(window=window, emitted=load.emitted - before)
            nursery.cancel_scope.cancel()

    trio.run(main)
    window = result["window"]
    return Phase(
        f"node alone, {rate:,} events/s", rate, None, window.wall_s, window.pct, result["emitted"] / window.wall_s
    )


def node_and_bridge(rate: int, seconds: float, warmup: float) -> Phase:
    """The node as a trio guest run on an asyncio loop, read by `NodeBridge.local` (hub every
    0.25 s), its events and snapshot taken every `RENDER_INTERVAL_S` — everything but the app."""
    load = Load(rate)
    node = SyntheticNode(load)
    result: dict[str, Any] = {}

    async def main() -> None:
        bridge = NodeBridge.local(node.run, node_info={"version": "bench"}, hub=fresh_hub())
        crashed: list[BaseException] = []
        bridge.start(on_crash=crashed.append)
        taken = 0

        async def frames(until: float) -> None:
            nonlocal taken
            while time.perf_counter() < until:
                await asyncio.sleep(manager_module.RENDER_INTERVAL_S)
                taken += len(bridge.drain_events())
                _ = bridge.latest, bridge.missed_events

        await frames(time.perf_counter() + warmup)
        before, taken = load.emitted, 0
        with CpuWindow() as window:
            await frames(time.perf_counter() + seconds)
        result.update(window=window, emitted=load.emitted - before, taken=taken, missed=bridge.missed_events)
        await bridge.stop()
        if crashed:
            raise crashed[0]

    asyncio.run(main())
    window = result["window"]
    return Phase(
        f"node + bridge, {rate:,} events/s",
        rate,
        None,
        window.wall_s,
        window.pct,
        result["emitted"] / window.wall_s,
        note=f"{result['taken']:,} events drained, {result['missed']} missed",
    )


def app_run(
    rates: list[int], tabs: list[str], seconds: float, warmup: float, prefill: int
) -> tuple[list[Phase], dict[str, Any]]:
    """The real app, headless, with the synthetic node as its local network."""
    load = Load(0)
    node = SyntheticNode(load)
    bridge = NodeBridge.local(
        node.run,
        node_info={
            "version": "bench",
            "pid": os.getpid(),
            "roles": ["local network"],
            "network": "local",
            "started_at": time.time(),
        },
        hub=fresh_hub(),
    )
    app = NodeManager(bridge)
    probe = Probe()
    probe.install(app, bridge)
    phases: list[Phase] = []
    info: dict[str, Any] = {}

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            deadline = time.monotonic() + 30
            while not (bridge.ready and bridge.latest is not None):
                if time.monotonic() > deadline:
                    raise RuntimeError("the synthetic node did not start within 30 s")
                await pilot.pause(0.05)
            logs = app.query_one(LogsView)
            if prefill:
                started = time.perf_counter()
                first_ts = time.time() - prefill / 1000
                for i in range(0, prefill, 1000):  # batch by batch: the harness keeps none of it
                    count = min(1000, prefill - i)
                    logs.append(node.messages.events(count, start_ts=first_ts + i / 1000, span_s=count / 1000))
                await pilot.pause()
                info["prefill_s"] = time.perf_counter() - started
            info["buffered"] = len(logs.buffer)
            for rate in rates:
                load.rate = rate
                for tab in tabs:
                    app.action_show_tab(tab)
                    if tab == "logs":
                        logs.follow = True
                    await asyncio.sleep(warmup)
                    before = load.emitted
                    probe.start()
                    with CpuWindow() as window:
                        await asyncio.sleep(seconds)
                    frames = probe.stop()
                    note = ""
                    if tab == "logs":
                        note = f"follow {'on' if logs.follow else 'OFF'}, {len(logs.buffer):,} lines buffered"
                    phases.append(
                        Phase(
                            f"app, {tab}, {rate:,} events/s",
                            rate,
                            tab,
                            window.wall_s,
                            window.pct,
                            (load.emitted - before) / window.wall_s,
                            frames,
                            note,
                        )
                    )
            info["missed"] = bridge.missed_events
            info["tracked"] = len(gc.get_objects())
            started = time.perf_counter()
            gc.collect()
            info["full_gc_ms"] = (time.perf_counter() - started) * 1e3
            info["collections"] = [generation["collections"] for generation in gc.get_stats()]

    try:
        asyncio.run(main())
    finally:
        probe.uninstall()
    return phases, info


# ---- report ---------------------------------------------------------------------------------------


def frame_row(phase: Phase) -> str:
    frames = phase.frames
    if not frames:
        return f"| {phase.tab} | {phase.rate:,} | 0 | | | | | | | | | {phase.cpu_pct:.1f} % |"
    work = [f.work_ms for f in frames]
    cpu = [f.work_cpu_ms for f in frames]
    render = [f.render_ms for f in frames]
    refresh = [f.refresh_ms for f in frames]
    output = [f.output_ms for f in frames]
    screen = [f.to_screen_ms for f in frames if f.to_screen_ms is not None]
    collected = max(f.gc_ms for f in frames)
    without_gc = [f.work_ms - f.gc_ms for f in frames]
    events = statistics.mean(f.events for f in frames)
    kib = statistics.mean(f.output_bytes for f in frames) / 1024
    return (
        f"| {phase.tab} | {phase.rate:,} ({events:,.0f}/frame) | {len(frames)} "
        f"| {pct(work, 50):.1f} / {pct(work, 95):.1f} / **{pct(work, 99):.1f}** / {max(work):.1f} "
        f"| {pct(cpu, 99):.1f} "
        f"| {pct(render, 50):.1f} / {pct(render, 99):.1f} | {pct(refresh, 50):.1f} / {pct(refresh, 99):.1f} "
        f"| {pct(output, 50):.1f} ({kib:.1f} KiB) "
        f"| {(f'{pct(screen, 50):.1f} / {pct(screen, 99):.1f}' if screen else 'no refresh')} "
        f"| {collected:.1f} | {pct(without_gc, 99):.1f} | {phase.cpu_pct:.1f} % |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per phase (default 10)")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds before each phase is measured")
    parser.add_argument("--rate", type=int, default=1000, help="log events per second under load (default 1000)")
    parser.add_argument(
        "--tabs",
        default="overview,validator,logs",
        help="tabs to measure, each visible in turn (overview, validator, chain, gpus, logs)",
    )
    parser.add_argument("--prefill", type=int, default=DEFAULT_CAPACITY, help="lines put in the Logs view first")
    parser.add_argument(
        "--baseline-seconds", type=float, default=None, help="seconds per baseline (default: --seconds)"
    )
    args = parser.parse_args(argv)
    tabs = [tab.strip() for tab in args.tabs.split(",") if tab.strip()]
    base_s = args.seconds if args.baseline_seconds is None else args.baseline_seconds
    rates = [args.rate, 0]

    started = time.perf_counter()
    baselines = [
        node_alone(args.rate, base_s, args.warmup),
        node_and_bridge(args.rate, base_s, args.warmup),
        node_alone(0, base_s / 2, args.warmup),
        node_and_bridge(0, base_s / 2, args.warmup),
    ]
    phases, info = app_run(rates, tabs, args.seconds, args.warmup, args.prefill)
    total_s = time.perf_counter() - started

    print(
        f"\n## Node manager frames at {SIZE[0]}×{SIZE[1]}, {args.seconds:g} s per phase "
        f"({os.cpu_count()} CPUs, pid {os.getpid()}, {total_s:.0f} s in all)\n"
    )
    print(
        f"Logs view: {info['buffered']:,} lines buffered before the phases"
        + (f" (prefill {info['prefill_s']:.1f} s)" if "prefill_s" in info else "")
        + f"; events missed by the bridge over the run: {info['missed']}. At the end: "
        f"{info['tracked']:,} objects tracked by the garbage collector, a full collection "
        f"{info['full_gc_ms']:.0f} ms; collections by generation over the process's life: {info['collections']}\n"
    )
    print(
        "| tab | events/s (drained per frame) | frames | frame work p50 / p95 / p99 / max, ms | work CPU p99, ms "
        "| `render_frame` p50 / p99 | refresh p50 / p99 | of which escape sequences p50 (per frame) "
        "| to screen p50 / p99 | GC inside work, max | work less GC, p99 | process CPU |"
    )
    print("|---|---|---:|---|---:|---|---|---|---|---:|---:|---:|")
    for phase in phases:
        print(frame_row(phase))

    by_rate = {rate: [p for p in phases if p.rate == rate] for rate in rates}
    print("\n| CPU, % of one core | events/s emitted | CPU | note |")
    print("|---|---:|---:|---|")
    for phase in baselines + phases:
        print(f"| {phase.name} | {phase.emitted_per_s:,.0f} | {phase.cpu_pct:.1f} % | {phase.note} |")
    alone = {p.rate: p.cpu_pct for p in baselines if p.name.startswith("node alone")}
    bridged = {p.rate: p.cpu_pct for p in baselines if p.name.startswith("node + bridge")}
    print(
        "\n| at | app, mean over tabs | node alone | app − node alone | app ÷ node alone | bridge's share "
        "(node + bridge − node alone) | the UI's share (app − (node + bridge)) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rate in rates:
        app_pct = statistics.mean(p.cpu_pct for p in by_rate[rate])
        ratio = f"{app_pct / alone[rate]:.1f}×" if alone[rate] >= 0.05 else "—"
        print(
            f"| {rate:,} events/s | {app_pct:.1f} % | {alone[rate]:.1f} % | {app_pct - alone[rate]:.1f} % | {ratio} "
            f"| {bridged[rate] - alone[rate]:.1f} % | {app_pct - bridged[rate]:.1f} % |"
        )

    failures = []
    for phase in by_rate[args.rate]:
        work = [f.work_ms for f in phase.frames]
        if not work:
            failures.append(f"{phase.tab} at {args.rate:,} events/s: no frame was rendered")
        elif pct(work, 99) > FRAME_TARGET_MS:
            failures.append(
                f"{phase.tab} at {args.rate:,} events/s: frame work p99 {pct(work, 99):.1f} ms > {FRAME_TARGET_MS:g} ms"
            )
        if phase.note.startswith("follow OFF"):
            failures.append(f"{phase.tab}: follow turned off during the phase")
    for phase in by_rate[0]:
        if phase.cpu_pct > IDLE_CPU_TARGET:
            failures.append(f"idle CPU on {phase.tab}: {phase.cpu_pct:.1f} % > {IDLE_CPU_TARGET:g} % of a core")
    if info["missed"]:
        failures.append(f"the bridge missed {info['missed']} events")
    print()
    if failures:
        print("TARGETS MISSED:\n" + "\n".join(f"* {failure}" for failure in failures))
        return 1
    print(
        f"Targets met: frame work p99 ≤ {FRAME_TARGET_MS:g} ms on every tab at {args.rate:,} events/s; "
        f"process CPU ≤ {IDLE_CPU_TARGET:g} % of a core on every tab at 0 events/s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
