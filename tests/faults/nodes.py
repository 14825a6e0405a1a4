"""Real `engy-node` processes for the fault suite: a gateway (and a miner) in a temporary home, on
fixed loopback ports so that a restart comes back where its miners and buyers already dial, with
its output read as it comes (`ProcessOutput`) and every process it starts accounted for
(`ProcessAccount`).

Ports are fixed per home, not 0, because a restart in the same home must come back on the same
ports: that is what a real operator's gateway does, and the miners' links re-dial the same URL.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio

from engy_node.testing.faults import ProcessAccount
from tests.waiting import ProcessOutput

START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 90
"""SIGTERM drains the gateway's requests in flight for gateway.drain_s; the suite sets that short."""
READY = re.compile(r"gateway ready: buyer API (http://127\.0\.0\.1:\d+), miners dial (ws://127\.0\.0\.1:\d+/gw)")


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick, released at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NodeProcess:
    """One `engy-node --home HOME ...` process at a time in `home`: started, killed outright or
    stopped, and started again in the same home. Each start's output goes to `HOME/<name>-<n>.log`."""

    def __init__(self, home: Path, args: list[str], env: dict[str, str], account: ProcessAccount, *, name: str) -> None:
        self.home = home
        self.args = args
        self.env = env
        self.account = account
        self.name = name
        self.starts = 0
        self.process: subprocess.Popen | None = None
        self.output: ProcessOutput | None = None

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} is already running"
        self.starts += 1
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", str(self.home), *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        )
        self.output = ProcessOutput(self.process, self.home / f"{self.name}-{self.starts}.log")
        self.account.note(self.process.pid)

    def wait_for(
        self, pattern: str | re.Pattern[str], *, timeout_s: float = START_TIMEOUT_S, what: str
    ) -> re.Match[str]:
        assert self.output is not None
        return self.output.wait_for(pattern, timeout_s=timeout_s, what=what)

    async def start_from_trio(self) -> None:
        """`start` in a worker thread: a trio test must not stall its own event loop (its miners'
        heartbeats, its buyers) for the seconds a node takes to start."""
        await trio.to_thread.run_sync(self.start)

    async def wait_for_from_trio(
        self, pattern: str | re.Pattern[str], *, timeout_s: float = START_TIMEOUT_S, what: str
    ) -> re.Match[str]:
        """`wait_for` in a worker thread, for the same reason."""
        return await trio.to_thread.run_sync(functools.partial(self.wait_for, pattern, timeout_s=timeout_s, what=what))

    def text(self) -> str:
        return self.output.text() if self.output is not None else ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> float:
        """SIGKILL, as the OOM killer or a power cut would end it; returns when it is reaped
        (the monotonic time of the kill, for time-to-serve-again)."""
        assert self.process is not None and self.process.poll() is None, f"{self.name} is not running"
        self.account.note(self.process.pid)
        killed_at = time.monotonic()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        return killed_at

    def stop(self) -> int | None:
        """SIGTERM and wait for a clean exit; SIGKILL only if it outstays `STOP_TIMEOUT_S`. Returns
        the exit status (None when it was not running)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.account.note(self.process.pid)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode


class GatewayProcess(NodeProcess):
    """`engy-node --role gateway` on fixed ports with qualification off (every admitted miner is
    eligible at once) and a short drain; `settings` adds or overrides `gateway.*` values."""

    def __init__(self, home: Path, account: ProcessAccount, **settings: object) -> None:
        self.buyer_port, self.miner_port, self.provider_port = free_port(), free_port(), free_port()
        values = {
            "port": self.buyer_port,
            "miner_port": self.miner_port,
            "provider_port": self.provider_port,
            "qualification": "false",
            "drain_s": 5,
            "keepalive_s": 1,
            **settings,
        }
        env = {f"ENGY_GATEWAY__{key.upper()}": str(value) for key, value in values.items()}
        super().__init__(home, ["--role", "gateway"], env, account, name="gateway")
        self.buyer_url = f"http://127.0.0.1:{self.buyer_port}"
        self.miner_url = f"ws://127.0.0.1:{self.miner_port}/gw"
        self.provider_url = f"http://127.0.0.1:{self.provider_port}"

    @property
    def store_path(self) -> Path:
        return self.home / "data" / "gateway.sqlite3"

    def start(self) -> None:
        super().start()
        ready = self.wait_for(READY, what="the gateway ready")
        assert (ready.group(1), ready.group(2)) == (self.buyer_url, self.miner_url), ready.group(0)
        self.account.note(self.pid)


MODEL_SERVER_READY = re.compile(r"model server ready on (http://\S+) \(pid (\d+)\)")


class MinerProcess(NodeProcess):
    """`engy-node --role miner` in CPU mode: it launches and supervises the reference model server
    (a child of its own, on a lifeline) and dials the gateway with `miner_key`."""

    def __init__(self, home: Path, account: ProcessAccount, *, gateway_url: str, miner_key: str) -> None:
        super().__init__(
            home, ["--role", "miner", "--gateway", gateway_url], {"MINER_KEY": miner_key}, account, name="miner"
        )

    def start(self) -> None:
        super().start()
        self.wait_for(r"leg \S+ admitted", what="the miner admitted by the gateway")
        self.account.note(self.pid)

    def model_server_pid(self) -> int:
        """The pid of the model server the miner reported ready last."""
        matches = MODEL_SERVER_READY.findall(self.text())
        assert matches, "the miner has not reported its model server ready"
        return int(matches[-1][1])
