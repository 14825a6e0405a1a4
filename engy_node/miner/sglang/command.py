"""The model server's exact command line, built from a plan: sglang's `launch_server` in the
published reference form, or our reference server (docs/architecture.md).

Pure: no IO, no clock reads. A plan goes in and a frozen `LaunchSpec` comes out, so the miner
can print the exact command without running anything (`--fake-gpus` does only that), the
supervisor can be handed any command (tests give it scripted children), and tests pin the
sglang command flag for flag.

What it trusts: the plan's choices, not their form. A value out of range (a port the supervisor
cannot probe, a tp of 0, a memory share outside 0..1) is refused here with a ValueError that
names the argument, before anything starts; so is a flag in `extra_flags` that repeats one the
builder sets, which would leave two values on the command line for sglang's argparse to
silently keep the last.

`shell_command` renders a spec as text for a user to paste, quoted so that `shlex.split` gives
back the exact words.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = ["LaunchSpec", "reference_launch", "sglang_launch", "shell_command"]

LaunchKind = Literal["sglang", "reference"]

HEALTH_PATH = "/health"

# sglang's /health runs a one-token generation per call unless this is 0. Our liveness probe
# calls it every few seconds, and generation-backed probes at that rate pile up orphan requests
# and have crashed paged prefill (sglang #35884; #22511 and #10856: a long chunked prefill makes
# them report unhealthy). With it off, /health still answers 503 until warm-up has finished, so
# readiness is unchanged; "alive but producing nothing" is caught by stall detection instead.
SGLANG_ENV: tuple[tuple[str, str], ...] = (("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0"),)

# Flags the builder sets from the plan; an extra flag repeating one of them would leave two
# values on the command line and sglang's argparse would silently keep the last.
_SGLANG_MANAGED_FLAGS = frozenset({
    "--model-path", "--model", "--served-model-name", "--tp-size", "--tensor-parallel-size",
    "--dp-size", "--data-parallel-size", "--trust-remote-code", "--kv-cache-dtype",
    "--mem-fraction-static", "--chunked-prefill-size", "--max-running-requests",
    "--context-length", "--enable-return-hidden-states", "--enable-cache-report",
    "--enable-metrics", "--enable-deterministic-inference", "--host", "--port",
})  # fmt: skip

CAPTURE_SITE = Path(__file__).with_name("capture_site")
"""The sitecustomize shim that arms `gemm_capture` in sglang's processes."""
CAPTURE_PORT_ENV = "ENGY_GEMM_CAPTURE_PORT"
"""`gemm_capture.PORT_ENV` (not imported: that module imports numpy, this one stays pure)."""
WEIGHTS_ROOT_ENV = "ENGY_GEMM_WEIGHTS_ROOT"
"""`gemm_capture.WEIGHTS_ROOT_ENV`: the checkpoint's root, which the capture puts in every commitment."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# A server bound to every interface is still probed over loopback.
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One model-server command: what to run, what to add to its environment, where it answers."""

    kind: LaunchKind
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    """Variables added to the inherited environment, in the order they are shown to users."""
    base_url: str
    """Where the supervisor reaches the server (loopback when it binds every interface)."""
    health_path: str = HEALTH_PATH


def _base_url(host: str, port: int) -> str:
    probe_host = _WILDCARD_HOSTS.get(host, host)
    if ":" in probe_host:
        probe_host = f"[{probe_host}]"
    return f"http://{probe_host}:{port}"


def _check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be 1..65535 (the supervisor probes it, so 0 cannot be used), got {port!r}")


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def sglang_launch(
    *,
    python: str,
    checkpoint: str | os.PathLike[str],
    served_model_name: str,
    port: int,
    host: str = "127.0.0.1",
    tp: int = 1,
    dp: int = 1,
    mem_fraction_static: float | None = None,
    max_running_requests: int | None = None,
    context_length: int | None = None,
    kv_cache_dtype: str | None = None,
    chunked_prefill_size: int | None = None,
    gemm_capture_port: int | None = None,
    extra_flags: Sequence[str] = (),
) -> LaunchSpec:
    """The sglang command in the published reference form (docs/architecture.md), flag for flag:

    `python -m sglang.launch_server --model-path … --served-model-name … --tp-size 4
    --trust-remote-code --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.83
    --chunked-prefill-size 8192 --max-running-requests 8 --context-length 262144
    --enable-return-hidden-states --enable-cache-report --enable-metrics --host 127.0.0.1 --port 8000`

    plus `--enable-deterministic-inference` before `--host` (issue 9: seeded sampled requests are
    replayed by the verifier; what the flag costs sglang's throughput is not yet measured here,
    for want of a GPU). `--dp-size` follows `--tp-size` when dp > 1. A value left as None omits its flag, so sglang
    picks its own default. `extra_flags` (argv tokens from the planner, e.g.
    `--disable-custom-all-reduce`) come last, so the reference form stays an exact prefix.
    The hidden-states, cache-report and metrics flags are always on: every proof needs hidden
    states, the OpenAI usage's cached_tokens needs the cache report, and the supervisor's stall
    detection and latency dashboards need `/metrics`. Raises ValueError naming the argument
    that is wrong.

    `gemm_capture_port` arms the GEMM audit's capture (`gemm_capture`): the `capture_site`
    folder goes on the server's PYTHONPATH (replacing an inherited one) with the port its
    openings are served on, and `--disable-cuda-graph --disable-radix-cache` follow the
    reference form, since the capture refuses rows its hooks did not see.
    """
    _check_port(port)
    if gemm_capture_port is not None:
        _check_port(gemm_capture_port)
    _check_positive("tp", tp)
    _check_positive("dp", dp)
    _check_positive("max_running_requests", max_running_requests)
    _check_positive("context_length", context_length)
    # sglang reads -1 as "chunked prefill off", so that is the one non-positive value allowed.
    if chunked_prefill_size != -1:
        _check_positive("chunked_prefill_size", chunked_prefill_size)
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise ValueError(
            f"mem_fraction_static must be between 0 and 1 (a share of each GPU's memory), got {mem_fraction_static!r}"
        )
    if not served_model_name:
        raise ValueError("served_model_name must not be empty: the gateway routes by it")
    extra = tuple(extra_flags)
    capture_flags = ("--disable-cuda-graph", "--disable-radix-cache") if gemm_capture_port is not None else ()
    clashing = sorted({flag.split("=", 1)[0] for flag in extra} & (_SGLANG_MANAGED_FLAGS | set(capture_flags)))
    if clashing:
        raise ValueError(
            f"extra_flags repeat {', '.join(clashing)}, which the plan already sets; change the plan value instead"
        )

    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        os.fspath(checkpoint),
        "--served-model-name",
        served_model_name,
        "--tp-size",
        str(tp),
    ]
    if dp > 1:
        argv += ["--dp-size", str(dp)]
    argv.append("--trust-remote-code")
    if kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if mem_fraction_static is not None:
        # repr is the shortest text that reads back as the same float: 0.83 stays "0.83".
        argv += ["--mem-fraction-static", repr(float(mem_fraction_static))]
    if chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(chunked_prefill_size)]
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    # Deterministic inference: sampled requests draw from `sampling_seed` reproducibly, so a
    # verifier can replay each draw (the miner announces FEATURE_SEEDED).
    argv += [
        "--enable-return-hidden-states",
        "--enable-cache-report",
        "--enable-metrics",
        "--enable-deterministic-inference",
        "--host",
        host,
        "--port",
        str(port),
        *capture_flags,
        *extra,
    ]
    env = SGLANG_ENV
    if gemm_capture_port is not None:
        env += (("PYTHONPATH", str(CAPTURE_SITE)), (CAPTURE_PORT_ENV, str(gemm_capture_port)))
    return LaunchSpec(kind="sglang", argv=tuple(argv), env=env, base_url=_base_url(host, port))


def reference_launch(
    *,
    python: str,
    home: str | os.PathLike[str],
    model: str,
    port: int,
    host: str = "127.0.0.1",
    checkpoint: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    device: str | None = None,
    max_running_requests: int | None = None,
    simulate_cheat: str | None = None,
) -> LaunchSpec:
    """`python -m engy_node --home HOME serve …`: our reference server (docs/architecture.md).

    A value left as None omits its flag, so the server's config (that home's node.toml and
    `ENGY_SERVE__*`) decides. Pass `checkpoint` when it is already prepared, so the child does
    not convert the embedded model itself; `simulate_cheat` (demos and tests of the audits only)
    makes it serve weights altered by that cheat (`serve.simulate_cheat`). Raises ValueError
    naming the argument that is wrong.
    """
    _check_port(port)
    _check_positive("max_running_requests", max_running_requests)
    argv = [python, "-m", "engy_node", "--home", os.fspath(home), "serve", "--model", model]
    if checkpoint is not None:
        argv += ["--checkpoint", os.fspath(checkpoint)]
    argv += ["--host", host, "--port", str(port)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if device is not None:
        argv += ["--device", device]
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if simulate_cheat is not None:
        if not simulate_cheat:
            raise ValueError("simulate_cheat must name a cheat, or be None for an honest server")
        argv += ["--simulate-cheat", simulate_cheat]
    return LaunchSpec(kind="reference", argv=tuple(argv), env=(), base_url=_base_url(host, port))


def shell_command(spec: LaunchSpec) -> str:
    """The command as a user pastes it into a shell: `NAME=value … argv`, each word quoted.

    `shlex.split` of the result gives back `NAME=value` words followed by `spec.argv`.
    """
    for name, _ in spec.env:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r} cannot be written in a shell command")
    # Only the value is quoted: `'A=b c' cmd` would make the shell look for a command named
    # "A=b c", while `A='b c' cmd` is an assignment.
    assignments = [f"{name}={shlex.quote(value)}" for name, value in spec.env]
    return " ".join([*assignments, shlex.join(spec.argv)])
