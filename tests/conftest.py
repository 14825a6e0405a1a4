"""Shared fixtures: the embedded model, prepared once per session, and a real reference server.

The converted SmolLM2 checkpoint lives in the per-machine model cache (as in production), so
only the first run on a machine pays the ~20 s conversion; every node in a test still gets its
own temporary home.

`HYPOTHESIS_PROFILE=thorough` runs every property test with 20x the examples, to shake out rare
cases (such as float rounding at bucket edges) before CI's random draw finds them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import settings

from tests.waiting import ProcessOutput

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the machine's cores: one compute thread each (and in every server a test
    # starts, which inherits this), since torch's default of a thread per core would have the
    # workers' model passes spin against each other, several times slower than taking turns.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

READY_PATTERN = re.compile(r"ready to roll! \(\S+ on (http://127\.0\.0\.1:\d+)\)")
SERVER_START_TIMEOUT_S = 180
MINUTES_TIMEOUT_S = 1800
"""A `minutes` test's limit: 250 s alone with the suite's other workers, over 600 s beside three
other model-bound tests on two cores (2026-12-06)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that loads the embedded model (through `checkpoint`, directly or via a
    fixture built on it) `smollm2`, so `-m "not smollm2"` runs the rest in a fraction of the time.
    Then put the modules holding a test marked `minutes` first: `make test`'s workers take whole
    modules in this order (``--dist loadscope``), and one of these started late would run on
    alone after the rest had finished. Started together, they share the cores with each other
    rather than with short tests, so each gets `MINUTES_TIMEOUT_S` rather than the suite's 600 s."""
    long_modules = set()
    for item in items:
        if "checkpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.smollm2)
        if item.get_closest_marker("minutes"):
            long_modules.add(item.path)
            if not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(MINUTES_TIMEOUT_S))
    items.sort(key=lambda item: item.path not in long_modules)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from engy_node.config import load_config
    from engy_node.serve.checkpoint import embedded_checkpoint

    config = load_config(
        home=tmp_path_factory.mktemp("home"), env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    )
    return embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)


@pytest.fixture(scope="session")
def alice():
    """The well-known dev key //Alice, for signing tests."""
    from bittensor.sp_core import Keypair

    return Keypair.create_from_uri("//Alice")


@pytest.fixture(scope="session")
def bob():
    """//Bob: a second key, for "signed by someone else"."""
    from bittensor.sp_core import Keypair

    return Keypair.create_from_uri("//Bob")


@pytest.fixture(scope="session")
def runner(checkpoint):
    from engy_node.serve.engine import ModelRunner

    return ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")


class ServerProcess:
    """`engy-node serve` as a user runs it, in its own temp home, on a free loopback port. Its
    output is read as it comes (`ProcessOutput`), copied to `log_path`; it is ready once it prints
    its ready line."""

    def __init__(self, home: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.log_path = home / "server.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engy_node", "--home", str(home), "serve", "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.output = ProcessOutput(self.process, self.log_path)
        try:
            self.url = self.output.wait_for(
                READY_PATTERN, timeout_s=SERVER_START_TIMEOUT_S, what="the server ready"
            ).group(1)
        except AssertionError:
            self.stop()
            raise

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.output.wait_ended(timeout_s=30, what="the server's output complete")
        return self.process.returncode

    def log_text(self) -> str:
        return self.output.text()


@pytest.fixture(scope="session")
def reference_server(checkpoint, tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("serve-home"), "--max-running-requests", "4")
    yield server
    server.stop()


@pytest.fixture
def client(reference_server):
    with httpx.Client(base_url=reference_server.url, timeout=120) as http:
        yield http


@pytest.fixture
def engy_logger():
    """The `engy` logger, restored to its previous handlers, level and propagation afterwards:
    `install_logging` stops propagation, which would hide every later test's records from caplog."""
    import logging

    from engy_node.hub import LOGGER_ROOT

    logger = logging.getLogger(LOGGER_ROOT)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        if handler not in saved[0]:
            handler.close()
    for handler in saved[0]:
        logger.addHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture(scope="session")
def postgres_cluster():
    """A throwaway PostgreSQL cluster for the session (`engy_node.testing.postgres`). CI installs
    the server (scripts/bootstrap.sh), so there a missing one fails; elsewhere it skips."""
    from engy_node.testing.postgres import PostgresUnavailable, throwaway_cluster

    try:
        with throwaway_cluster() as cluster:
            yield cluster
    except PostgresUnavailable as unavailable:
        if os.environ.get("CI"):
            pytest.fail(f"cannot run PostgreSQL in CI: {unavailable}")
        pytest.skip(str(unavailable))


@pytest.fixture
def postgres_url(postgres_cluster) -> str:
    """An empty database of its own for one test."""
    return postgres_cluster.create_database()


@pytest.fixture(scope="session")
def haproxy_binary() -> str:
    """Debian's HAProxy, for the tests that put a real load balancer in front of gateway hosts.
    CI installs it (scripts/bootstrap.sh), so there a missing one fails; elsewhere it skips."""
    import shutil

    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if found is None:
        message = "HAProxy is not installed: apt-get install haproxy (scripts/bootstrap.sh does it as root)"
        if os.environ.get("CI"):
            pytest.fail(f"cannot run the load-balancer tests in CI: {message}")
        pytest.skip(message)
    return found
