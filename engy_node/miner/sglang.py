"""Build the model server's command line, and keep that server running: sglang on a GPU box,
our reference server everywhere else (SPEC §7.3).

Two layers, kept apart on purpose:

* **Pure decisions** (no IO, no clock reads, randomness passed in): `sglang_launch` and
  `reference_launch` build a frozen `LaunchSpec`; `shell_command` renders it for a user to copy;
  `engy_node.retry.backoff_delay` is the backoff; `classify_failure` turns a log tail into a `Failure` that
  names the fix; `detect_stall` says when "requests running, no tokens" has lasted too long;
  `LineBuffer` splits a byte stream into bounded lines.
* **The imperative shell**, `ModelServerSupervisor`: starts the child in its own session,
  copies its output into the `engy.model_server` logger (and so into the hub's ring) and a
  bounded tail, waits for `/health` 200, probes and scrapes it while up, and restarts it with
  backoff when it exits, stops answering or stalls.

What it trusts: the child is a peer we do not control. Its exit code, its log and its HTTP
answers are evidence, never commands: nothing it prints or answers can crash the supervisor
(only repeated failed starts end `run`, see below), and its output is read in bounded lines
into a bounded tail. `/health` answering 200 is the only readiness signal: sglang's "The server
is fired up and ready to roll!" line comes at about the same moment, but log wording changes
between releases and a status code does not. Before each start the port must be free, since a
leftover server answering there would otherwise pass for ours. The log is authoritative for
*why* it failed; the supervisor's own observation (exit, timeout, failed probes, stall) only
for *that* it failed.

Failure posture: a server that dies after it has served is always restarted; the costlier
mistake for a miner is staying down while the gateway routes to it. A server that cannot
*start* is different: retrying a wrong `--mem-fraction-static` forever only hides the message
that says how to fix it, so after `max_startup_failures` consecutive failed starts `run` raises
`ModelServerError` carrying the classified failure and its fix. Every failure is logged with
its fix and recorded in the hub's `model_server` state, so the TUI and `engy-node diagnose`
show the same sentence the log does.

Stopping: the child starts in a new session, so it and everything it forks (sglang's scheduler
and detokenizer processes, one per GPU rank) share one process group. Stopping sends SIGTERM
to the whole group, waits `stop_grace_s` under a shielded scope, then sends SIGKILL to the
group; it also runs after a child exits on its own, because sglang's rank processes can
outlive a crashed main process and would keep holding GPU memory. A grandchild that moves
itself to another session, or a node killed with SIGKILL, leaves processes behind; the next
start then finds the port taken and fails as `port_in_use`, naming how to free it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import random
import re
import shlex
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn

import httpx
import trio

from engy_node.errors import EngyError
from engy_node.hub import Hub
from engy_node.retry import backoff_delay
from engy_node.serve.status import ServerStatus, fetch_status

__all__ = [
    "Failure",
    "FailureKind",
    "LaunchSpec",
    "LineBuffer",
    "ModelServerError",
    "ModelServerSupervisor",
    "SupervisorSettings",
    "classify_failure",
    "detect_stall",
    "reference_launch",
    "sglang_launch",
    "shell_command",
]

log = logging.getLogger("engy.model_server")

HUB_COMPONENT = "model_server"

# ---- launch commands (pure) ----------------------------------------------------------------------

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
    "--enable-metrics", "--host", "--port",
})  # fmt: skip

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
    extra_flags: Sequence[str] = (),
) -> LaunchSpec:
    """The sglang command in the published reference form (SPEC §7.3), flag for flag:

    `python -m sglang.launch_server --model-path … --served-model-name … --tp-size 4
    --trust-remote-code --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.83
    --chunked-prefill-size 8192 --max-running-requests 8 --context-length 262144
    --enable-return-hidden-states --enable-cache-report --enable-metrics --host 127.0.0.1 --port 8000`

    `--dp-size` follows `--tp-size` when dp > 1. A value left as None omits its flag, so sglang
    picks its own default. `extra_flags` (argv tokens from the planner, e.g.
    `--disable-custom-all-reduce`) come last, so the reference form stays an exact prefix.
    The hidden-states, cache-report and metrics flags are always on: every proof needs hidden
    states, the OpenAI usage's cached_tokens needs the cache report, and the supervisor's stall
    detection and latency dashboards need `/metrics`. Raises ValueError naming the argument
    that is wrong.
    """
    _check_port(port)
    _check_positive("tp", tp)
    _check_positive("dp", dp)
    _check_positive("max_running_requests", max_running_requests)
    _check_positive("context_length", context_length)
    # sglang reads -1 as "chunked prefill off", so that is the one non-positive value allowed.
    if chunked_prefill_size != -1:
        _check_positive("chunked_prefill_size", chunked_prefill_size)
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be between 0 and 1 (a share of each GPU's memory), got {mem_fraction_static!r}")
    if not served_model_name:
        raise ValueError("served_model_name must not be empty: the gateway routes by it")
    extra = tuple(extra_flags)
    clashing = sorted({flag.split("=", 1)[0] for flag in extra} & _SGLANG_MANAGED_FLAGS)
    if clashing:
        raise ValueError(f"extra_flags repeat {', '.join(clashing)}, which the plan already sets; change the plan value instead")

    argv = [python, "-m", "sglang.launch_server", "--model-path", os.fspath(checkpoint),
            "--served-model-name", served_model_name, "--tp-size", str(tp)]
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
    argv += ["--enable-return-hidden-states", "--enable-cache-report", "--enable-metrics",
             "--host", host, "--port", str(port), *extra]
    return LaunchSpec(kind="sglang", argv=tuple(argv), env=SGLANG_ENV, base_url=_base_url(host, port))


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
) -> LaunchSpec:
    """`python -m engy_node --home HOME serve …`: our reference server (SPEC §7.4).

    A value left as None omits its flag, so the server's config (that home's node.toml and
    `ENGY_SERVE__*`) decides. Pass `checkpoint` when it is already prepared, so the child does
    not convert the embedded model itself. Raises ValueError naming the argument that is wrong.
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


# ---- failure classification (pure) ---------------------------------------------------------------

FailureKind = Literal[
    "launch_failed", "oom_at_init", "cuda_oom", "no_p2p", "no_kernel_image", "fp8_block_divisibility", "port_in_use",
    "hidden_states_flag", "model_not_found", "startup_timeout", "unhealthy", "stalled", "unknown",
]
Phase = Literal["startup", "runtime"]
Detected = Literal["startup_timeout", "unhealthy", "stalled"]


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """Why the model server stopped, in a user's words: what happened and what to change."""

    kind: FailureKind
    summary: str
    """What happened, ending with the log line that shows it."""
    fix: str
    """What to change, naming the flag or setting."""

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "summary": self.summary, "fix": self.fix}


@dataclasses.dataclass(frozen=True, slots=True)
class _Pattern:
    kind: FailureKind
    regex: re.Pattern[str]
    summary: str
    fix: str | Callable[[Phase], str]


def _cuda_oom_fix(phase: Phase) -> str:
    if phase == "startup":
        return ("lower --mem-fraction-static a little (e.g. 0.83 -> 0.80) so CUDA graphs and activations "
                "have room, or lower --cuda-graph-max-bs; raising it is the fix for the opposite error, "
                "'Not enough memory' at init")
    return ("lower --mem-fraction-static a little (e.g. 0.83 -> 0.80), --max-running-requests, or "
            "--chunked-prefill-size (e.g. 4096) for long prompts; raising it is the fix for the opposite "
            "error, 'Not enough memory' at init")


# The supervisor writes this line into the tail when the command cannot even be executed.
LAUNCH_FAILED_PREFIX = "engy: cannot execute the model server command: "

# Checked in this order; the first kind with a matching line wins, because a root cause
# (a taken port, a missing kernel) often drags later, vaguer errors behind it in the same log.
# Each phrase is quoted from sglang, PyTorch, huggingface_hub or our reference server
# (reference/node-manager-tui-and-gpu-ops.md §6.3 and §6.5, reference/sglang-native-api.md §2.6).
_PATTERNS: tuple[_Pattern, ...] = (
    _Pattern(
        "launch_failed",
        re.compile(re.escape(LAUNCH_FAILED_PREFIX)),
        "the command could not be executed",
        "check that the command's first word exists and is executable: the python of the environment "
        "sglang (or engy-node) is installed in",
    ),
    _Pattern(
        "port_in_use",
        re.compile(r"address already in use", re.IGNORECASE),
        "the port is taken by another process",
        "another process, perhaps a model server left over from a node that was killed, holds the port: "
        "find it with `ss -ltnp` and stop it, or give the model server another port",
    ),
    _Pattern(
        "model_not_found",
        re.compile(r"is not a local folder and is not a valid model identifier|Repo id must be in the form"
                   r"|does not appear to have a file named config\.json|no config\.json there"),
        "the model path does not lead to a checkpoint",
        "point --model-path (--checkpoint for the reference server) at the downloaded checkpoint directory, "
        "the one holding config.json and the *.safetensors shards",
    ),
    _Pattern(
        "no_kernel_image",
        re.compile(r"no kernel image is available for execution on the device"
                   r"|sm_\d+ is not compatible with the current PyTorch installation"),
        "the installed CUDA build has no kernels for this GPU",
        "install a PyTorch/sglang build for CUDA 12.8 or newer (RTX 5090 is sm_120), and pick an attention "
        "backend that supports the GPU (e.g. --attention-backend triton)",
    ),
    _Pattern(
        "no_p2p",
        re.compile(r"peer access is not supported between these two devices"),
        "the GPUs cannot access each other's memory (no P2P, usual for GeForce cards)",
        "add --disable-custom-all-reduce (or --enable-p2p-check) so tensor parallelism uses NCCL all-reduce",
    ),
    _Pattern(
        "fp8_block_divisibility",
        re.compile(r"is not divisible by weight quantization block_n"),
        "the FP8 block-quantized weights cannot be split evenly across the GPUs at this tensor-parallel size",
        "choose another tp (--tp-size) such that moe_intermediate_size / tp is a multiple of 128, "
        "and use the remaining GPUs for data parallelism (--dp-size)",
    ),
    _Pattern(
        "oom_at_init",
        re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static"
                   r"|is larger than the profiled value -\d"),
        "out of memory at start: after loading the weights no room is left for the KV cache",
        "increase --mem-fraction-static (e.g. 0.83 -> 0.85) or lower --context-length; lowering it is "
        "the fix for the opposite error, CUDA out of memory while serving",
    ),
    _Pattern(
        "cuda_oom",
        re.compile(r"CUDA out of memory|CUDA error: out of memory"),
        "CUDA ran out of memory",
        _cuda_oom_fix,
    ),
    _Pattern(
        "hidden_states_flag",
        re.compile(r"not configured to return (the )?hidden states"),
        "the server refuses to return hidden states, which every proof needs",
        "start it with --enable-return-hidden-states",
    ),
)

_EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\b")
_ERRORISH_LINE = re.compile(r"error|exception|fatal|failed|traceback", re.IGNORECASE)

# Log lines quoted into a summary are cut here: a summary is one line on a dashboard.
SUMMARY_LINE_CHARS = 300


def _quote(line: str) -> str:
    line = line.strip()
    return line if len(line) <= SUMMARY_LINE_CHARS else line[: SUMMARY_LINE_CHARS - 1] + "…"


def _exit_text(exit_code: int | None) -> str:
    if exit_code is None:
        return "was stopped by the supervisor"
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def _last_error_line(log_tail: Sequence[str]) -> str | None:
    """The final exception line (`RuntimeError: …`) if any, else the last line that mentions an error."""
    for regex in (_EXCEPTION_LINE, _ERRORISH_LINE):
        for line in reversed(log_tail):
            if regex.search(line):
                return line
    return None


def classify_failure(
    *,
    log_tail: Sequence[str],
    exit_code: int | None,
    phase: Phase,
    detected: Detected | None = None,
) -> Failure:
    """Why the model server failed, from its last log lines.

    `exit_code` is the child's (negative: killed by that signal; None: still running when the
    supervisor stopped it). `phase` says whether it had become ready. `detected` is what the
    supervisor itself saw when it was the one to stop the child. A recognised log line wins
    over `detected`, because it says why; `detected` wins over a generic exit. Otherwise the
    kind is "unknown" and the summary quotes the last error line.
    """
    for pattern in _PATTERNS:
        line = next((line for line in reversed(log_tail) if pattern.regex.search(line)), None)
        if line is not None:
            fix = pattern.fix(phase) if callable(pattern.fix) else pattern.fix
            when = "while starting" if phase == "startup" else "while serving"
            return Failure(pattern.kind, f"{pattern.summary} ({when}): {_quote(line)}", fix)

    last_line = next((line for line in reversed(log_tail) if line.strip()), None)
    evidence = f"; last log line: {_quote(last_line)}" if last_line else "; it printed nothing"
    if detected == "startup_timeout":
        return Failure(
            "startup_timeout", f"not answering /health with 200 before the startup deadline{evidence}",
            "if the log shows it still loading weights or compiling kernels, raise startup_timeout_s; "
            "otherwise the log shows where it hangs",
        )
    if detected == "unhealthy":
        return Failure(
            "unhealthy", f"stopped answering its health check{evidence}",
            "read the log tail for the cause; if it recurs under load, lower --max-running-requests",
        )
    if detected == "stalled":
        return Failure(
            "stalled", f"requests were running but no token was generated for too long{evidence}",
            "it is restarted automatically; if it recurs, lower --max-running-requests or "
            "--chunked-prefill-size, or try --disable-cuda-graph",
        )
    error_line = _last_error_line(log_tail)
    summary = _exit_text(exit_code) + (f": {_quote(error_line)}" if error_line else evidence)
    if exit_code == -signal.SIGKILL:
        fix = ("if nobody killed it, the kernel's OOM killer may have (host RAM, not GPU memory): "
               "check `dmesg`; otherwise read the log tail")
    else:
        fix = "read the log tail for the cause; run the command shown by hand to reproduce it"
    return Failure("unknown", summary, fix)


# ---- stall detection (pure) ----------------------------------------------------------------------


def detect_stall(
    *,
    running: int,
    generation_tokens_total: float,
    last_progress_tokens: float,
    seconds_since_progress: float,
    stall_after_s: float,
) -> bool:
    """True when requests are running yet the generated-token counter has not moved for
    `stall_after_s` seconds: the server accepts work and produces nothing (sglang #1270).

    Any change of the counter is progress; a lower value means the server restarted and its
    counter began again. No running request is idleness, never a stall.
    """
    return running > 0 and generation_tokens_total == last_progress_tokens and seconds_since_progress >= stall_after_s


# ---- output lines (pure) -------------------------------------------------------------------------

TRUNCATION_MARK = " …[line truncated]"


class LineBuffer:
    """Splits a child's output bytes into text lines of at most `max_line_bytes` each.

    Lines end at "\\n" or "\\r" (progress bars redraw with "\\r"); empty lines are dropped. A line
    longer than the cap is cut at the cap, marked with `TRUNCATION_MARK` and counted in
    `truncated`; the rest of it, up to its end, is discarded without being buffered, so
    memory stays bounded whatever the child writes. Bytes that are not UTF-8 are replaced.
    """

    def __init__(self, *, max_line_bytes: int) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes!r}")
        self.max_line_bytes = max_line_bytes
        self.truncated = 0
        self._partial = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> list[str]:
        """The lines completed by `data`, in order."""
        *complete, rest = re.split(rb"[\r\n]", data)
        lines: list[str] = []
        for segment in complete:
            if self._discarding:
                self._discarding = False
            else:
                self._partial += segment
                self._emit(bytes(self._partial), lines)
            self._partial.clear()
        if not self._discarding:
            self._partial += rest
            if len(self._partial) > self.max_line_bytes:
                self._emit(bytes(self._partial), lines)
                self._partial.clear()
                self._discarding = True
        return lines

    def flush(self) -> list[str]:
        """The unterminated last line, once the stream has ended."""
        lines: list[str] = []
        if not self._discarding:
            self._emit(bytes(self._partial), lines)
        self._partial.clear()
        self._discarding = False
        return lines

    def _emit(self, raw: bytes, lines: list[str]) -> None:
        if len(raw) > self.max_line_bytes:
            self.truncated += 1
            text = raw[: self.max_line_bytes].decode("utf-8", "replace").rstrip() + TRUNCATION_MARK
        else:
            text = raw.decode("utf-8", "replace").rstrip()
        if text:
            lines.append(text)


# ---- the supervisor (IO) -------------------------------------------------------------------------

# After SIGKILL the kernel tears the processes down at once; this only bounds a process stuck in
# uninterruptible IO (a hung GPU driver call) so shutdown still finishes.
KILL_WAIT_S = 5.0
# Once the process group is gone its output is already in the pipe; this only bounds a process
# outside the group (one that called setsid) that still holds the pipe open.
OUTPUT_DRAIN_S = 2.0
# How often the process group is checked for survivors while waiting for it to go.
GROUP_POLL_S = 0.05
READ_CHUNK_BYTES = 64 * 1024

State = Literal["starting", "ready", "unhealthy", "stalled", "timed_out", "exited", "restarting", "failed", "stopped"]

# The state published right after a failure, by what the supervisor saw (None: the child exited).
_STATE_AFTER: dict[Detected | None, State] = {
    None: "exited", "startup_timeout": "timed_out", "unhealthy": "unhealthy", "stalled": "stalled",
}


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorSettings:
    """How patiently the supervisor waits, probes and restarts. Durations are in seconds."""

    startup_timeout_s: float = 900.0
    """Longest a start may take before `/health` answers 200. sglang loads tens of GB of weights,
    JIT-compiles kernels on a machine's first launch and captures CUDA graphs: several minutes
    is normal, so 15 minutes; a start that hangs is still noticed the same hour."""
    startup_poll_interval_s: float = 1.0
    """Pause between readiness probes while starting."""
    probe_interval_s: float = 5.0
    """Pause between liveness-and-metrics polls once ready (sglang ops: every 5-10 s). Polls never
    overlap: the next starts only after the previous has finished or timed out."""
    probe_timeout_s: float = 10.0
    """Longest one probe may take. `/health` without generation answers in milliseconds; this
    covers an event loop busy tokenising a 262k-token prompt."""
    unhealthy_after_probes: int = 3
    """Consecutive failed liveness probes after which a ready server is restarted. One miss can be
    a hiccup; three in a row (15 to 45 s at the defaults, refused or timing out) is a server that
    stopped answering."""
    stall_after_s: float = 180.0
    """Requests running with no generated token for this long is a stall. It must exceed the
    longest legitimate silence: a full 262k-token prompt prefilled on consumer GPUs takes a minute
    or two, and sglang's running-request gauge updates only on batches (every 40 decode steps),
    so it can lag behind a server that has just gone idle."""
    max_startup_failures: int = 5
    """Consecutive failed starts (never ready) after which `run` gives up and raises. Five starts
    with the default backoff span about 15 s of waiting: enough for a transient cause (GPU memory
    still being released by the previous run, a slow network disk) to clear, few enough that a
    wrong flag is reported soon."""
    restart_base_s: float = 1.0
    """Backoff after the first failure; it doubles with each further failure in a row."""
    restart_cap_s: float = 60.0
    """Longest backoff between restarts."""
    stop_grace_s: float = 15.0
    """Time between SIGTERM and SIGKILL when stopping. sglang tears its rank processes and NCCL down
    in seconds; the reference server drains for 2 s. 15 s also fits systemd's default 90 s stop."""
    log_tail_lines: int = 200
    """Child output lines kept in memory for failure classification and the TUI."""
    max_line_bytes: int = 16 * 1024
    """Longest output line kept whole. sglang prints its resolved server args as one line of
    several KB at start; a runaway line (a tensor dump) is cut here and counted."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # A count's default is an int, a duration's a float; a duration may be given as an int.
            counts = type(field.default) is int
            if isinstance(value, bool) or not isinstance(value, int if counts else int | float) or not 0 < value < math.inf:
                kind = "a positive integer" if counts else "a positive number"
                raise ValueError(f"SupervisorSettings.{field.name} must be {kind}, got {value!r}")
        if self.restart_base_s > self.restart_cap_s:
            raise ValueError("SupervisorSettings.restart_base_s must not exceed restart_cap_s")


class ModelServerError(EngyError):
    """The model server could not be started; `failure` says why and what to change."""

    title = "model server"

    def __init__(self, failure: Failure, *, attempts: int, command: str) -> None:
        super().__init__(
            f"the model server failed to start {attempts} times in a row. {failure.summary.rstrip('.')}. "
            f"Fix: {failure.fix}. Command: {command}"
        )
        self.failure = failure
        self.attempts = attempts


@dataclasses.dataclass(frozen=True, slots=True)
class _Ended:
    """How one run of the child ended."""

    phase: Phase
    exit_code: int | None
    detected: Detected | None = None
    operator_restart: bool = False
    log_tail: tuple[str, ...] = ()
    """This run's own last output lines (the supervisor's tail spans restarts)."""


@dataclasses.dataclass(slots=True)
class _Attempt:
    """One child process, its output state, and the events its tasks signal."""

    process: trio.Process
    lines: LineBuffer
    tail: collections.deque[str]
    exited: trio.Event = dataclasses.field(default_factory=trio.Event)
    output_done: trio.Event = dataclasses.field(default_factory=trio.Event)
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _metric_fields(status: ServerStatus | None) -> dict[str, Any]:
    """The hub fields filled from one poll (all None when there is no poll to show)."""
    ttft = status.ttft if status else None
    itl = status.itl if status else None
    return {
        "running": status.running if status else None,
        "queued": status.queued if status else None,
        "generation_tokens_total": status.generation_tokens_total if status else None,
        "gen_throughput": status.gen_throughput if status else None,
        "ttft_p50_ms": _ms(ttft.p50_s) if ttft else None,
        "ttft_p95_ms": _ms(ttft.p95_s) if ttft else None,
        "itl_p50_ms": _ms(itl.p50_s) if itl else None,
        "itl_p95_ms": _ms(itl.p95_s) if itl else None,
        "poll_error": status.error if status else None,
    }


def _signal_group(pgid: int, signum: int) -> bool:
    """Send `signum` to the process group (0: only check that it exists); False when no process
    of it is left to receive it."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:
        # The group id now belongs to another user's processes: ours are gone.
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies waiting to be reaped do not count:
    they hold no memory, and where nothing reaps them, in a container without an init, they
    would otherwise keep every stop waiting out its full deadline)."""
    if not _signal_group(pgid, 0):
        return False
    import psutil  # only needed when the group outlives its leader, which is rare

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue  # gone while we looked
    return False


async def _wait_group_gone(pgid: int) -> None:
    """Return once no process of the group is running (the caller bounds the wait)."""
    while _group_alive(pgid):
        await trio.sleep(GROUP_POLL_S)


class ModelServerSupervisor:
    """Runs one model server (sglang or the reference server) and keeps it up.

    States, as published in the hub's `model_server` state: starting -> ready ->
    (unhealthy | stalled | exited) -> restarting -> starting ...; `failed` after giving up,
    `stopped` after cancellation. Hub fields: state, kind, url, command (shell text), pid,
    restarts, startup_failures, last_failure ({kind, summary, fix, phase, exit_code} or None),
    running, queued, generation_tokens_total, gen_throughput, ttft/itl p50/p95 in ms,
    poll_error, log_lines_truncated.

    `jitter` draws the backoff's random share in [0, 1); tests pass a constant.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        hub: Hub,
        *,
        settings: SupervisorSettings = SupervisorSettings(),
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.command = shell_command(spec)
        self._hub = hub
        self._jitter = jitter
        self._tail: collections.deque[str] = collections.deque(maxlen=settings.log_tail_lines)
        self._running = False
        self._restart_pending = False
        self._wake = trio.Event()
        self._attempt: _Attempt | None = None
        self.last_failure: Failure | None = None
        self.truncated_lines = 0
        """Output lines cut at `max_line_bytes`, across restarts."""

    @property
    def log_tail(self) -> tuple[str, ...]:
        """The child's most recent output lines, across restarts, oldest first."""
        return tuple(self._tail)

    def _publish(self, **values: Any) -> None:
        self._hub.set_state(HUB_COMPONENT, **values)

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Start the model server and keep it running until cancelled.

        Readiness: `task_status.started(base_url)` is called once, the first time `/health`
        answers 200. Restarts after that are reported through the hub and the log only.

        Resources: one child process tree at a time (its own session and process group) and
        one HTTP client; both are gone when this returns or raises.

        Errors: raises `ModelServerError` (carrying `.failure`) after `max_startup_failures`
        consecutive failed starts; if that happens before the first readiness, it comes out
        of `nursery.start`. Failures after a successful start are restarted forever.

        Cancellation: the child's process group gets SIGTERM, then SIGKILL after
        `stop_grace_s`, under a shielded scope; when this returns no child process is left
        (see the module docstring for what can escape). The hub state becomes `stopped`.
        """
        if self._running:
            raise RuntimeError("this ModelServerSupervisor is already running")
        self._running = True
        final_state: State = "stopped"
        restarts = startup_failures = consecutive_failures = 0
        announced = False
        self._publish(state="starting", kind=self.spec.kind, url=self.spec.base_url, command=self.command, pid=None,
                      restarts=0, startup_failures=0, last_failure=None, restart_in_s=None, log_lines_truncated=0,
                      **_metric_fields(None))
        # trust_env=False: an HTTP(S)_PROXY meant for the internet must never carry loopback probes.
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                while True:
                    ended = await self._run_child(client, first_ready=not announced, task_status=task_status)
                    announced = announced or ended.phase == "runtime"
                    if ended.phase == "runtime":
                        startup_failures = consecutive_failures = 0
                    if ended.operator_restart:
                        restarts += 1
                        log.info("model server restarted by the operator")
                        self._publish(state="restarting", restarts=restarts, pid=None)
                        continue

                    failure = classify_failure(log_tail=ended.log_tail, exit_code=ended.exit_code,
                                               phase=ended.phase, detected=ended.detected)
                    consecutive_failures += 1
                    if ended.phase == "startup":
                        startup_failures += 1
                    self.last_failure = failure
                    log.error("model server %s: %s. Fix: %s", failure.kind, failure.summary.rstrip("."), failure.fix)
                    self._publish(
                        state=_STATE_AFTER[ended.detected], pid=None, startup_failures=startup_failures,
                        last_failure={**failure.as_dict(), "phase": ended.phase, "exit_code": ended.exit_code},
                        **_metric_fields(None),
                    )
                    if startup_failures >= self.settings.max_startup_failures:
                        final_state = "failed"
                        raise ModelServerError(failure, attempts=startup_failures, command=self.command)

                    delay = backoff_delay(consecutive_failures=consecutive_failures, jitter=self._jitter(),
                                          base_s=self.settings.restart_base_s, cap_s=self.settings.restart_cap_s)
                    log.info("restarting the model server in %.1f s (failure %d in a row)", delay, consecutive_failures)
                    self._publish(state="restarting", restart_in_s=round(delay, 1))
                    self._wake = trio.Event()
                    with trio.move_on_after(delay):
                        # An operator's restart cuts the backoff short.
                        while not self._restart_pending:
                            await self._wake.wait()
                    self._restart_pending = False
                    restarts += 1
                    self._publish(restarts=restarts, restart_in_s=None)
        finally:
            self._running = False
            self._publish(state=final_state, pid=None)

    async def restart(self) -> None:
        """Stop the current child and start a fresh one at once (an operator's action).

        It counts as a restart but not as a failure, and skips any backoff in progress.
        Returns once the old child is gone. Raises RuntimeError when `run` is not running.
        Cancellation: the restart still happens; only the wait for it is abandoned.
        """
        if not self._running:
            raise RuntimeError("the model server supervisor is not running; nothing to restart")
        self._restart_pending = True
        self._wake.set()
        attempt = self._attempt
        if attempt is not None:
            # The watcher notices between probes; stopping is bounded by the grace period.
            bound = self.settings.probe_timeout_s + self.settings.stop_grace_s + KILL_WAIT_S + OUTPUT_DRAIN_S + 1.0
            with trio.fail_after(bound):
                await attempt.done.wait()

    # -- one child ---------------------------------------------------------------------------------

    async def _run_child(self, client: httpx.AsyncClient, *, first_ready: bool, task_status: trio.TaskStatus[str]) -> _Ended:
        """Start the child, watch it until it ends or must be stopped, stop its process tree."""
        self._wake = trio.Event()
        self._restart_pending = False
        log.info("starting the model server: %s", self.command)
        self._publish(state="starting", pid=None, **_metric_fields(None))
        if await self._port_answers():
            # Without this check a leftover server (from a node that was SIGKILLed) would answer
            # our readiness probe while our own child fails to bind, and be taken for it.
            line = f"{self.spec.base_url} answers before the model server has started: address already in use"
            log.error("%s", line)
            return _Ended(phase="startup", exit_code=None, log_tail=(line,))
        try:
            process = await trio.lowlevel.open_process(
                list(self.spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # A new session makes the child lead its own process group, so one killpg reaches
                # every process it forks; it also keeps a terminal's Ctrl-C away from the child,
                # so the node stops it in order instead.
                start_new_session=True,
                # Python children block-buffer a pipe; unbuffered, each line arrives as printed.
                env={**os.environ, **dict(self.spec.env), "PYTHONUNBUFFERED": "1"},
            )
        except OSError as err:
            # Nothing started (a wrong python path, say): a failed start like any other.
            line = f"{LAUNCH_FAILED_PREFIX}{type(err).__name__}: {err}"
            log.error("%s", line)
            return _Ended(phase="startup", exit_code=None, log_tail=(line,))

        attempt = _Attempt(process=process, lines=LineBuffer(max_line_bytes=self.settings.max_line_bytes),
                           tail=collections.deque(maxlen=self.settings.log_tail_lines))
        self._attempt = attempt
        self._publish(pid=process.pid)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_output, attempt)
                nursery.start_soon(self._wait_exit, attempt)
                ended = await self._await_ready(client, attempt)
                if ended is None:
                    log.info("model server ready on %s (pid %d)", self.spec.base_url, process.pid)
                    self._publish(state="ready")
                    if first_ready:
                        task_status.started(self.spec.base_url)
                    ended = await self._monitor(client, attempt)
                await self._stop_tree(process)
                # The last lines (the traceback) must be in the tail before it is classified.
                with trio.move_on_after(OUTPUT_DRAIN_S):
                    await attempt.output_done.wait()
                nursery.cancel_scope.cancel(reason="the model server has stopped")
        finally:
            await self._stop_tree(process)
            with trio.CancelScope(shield=True), trio.move_on_after(OUTPUT_DRAIN_S):
                await process.stdout.aclose()
            attempt.done.set()
        return dataclasses.replace(ended, log_tail=tuple(attempt.tail))

    async def _await_ready(self, client: httpx.AsyncClient, attempt: _Attempt) -> _Ended | None:
        """None once `/health` answers 200; otherwise how the start ended."""
        with trio.move_on_after(self.settings.startup_timeout_s):
            while True:
                if attempt.exited.is_set():
                    return _Ended(phase="startup", exit_code=attempt.process.returncode)
                if self._restart_pending:
                    return _Ended(phase="startup", exit_code=None, operator_restart=True)
                if await self._probe_health(client):
                    return None
                with trio.move_on_after(self.settings.startup_poll_interval_s):
                    await self._wake.wait()
        log.warning("model server not ready after %g s; stopping it", self.settings.startup_timeout_s)
        return _Ended(phase="startup", exit_code=None, detected="startup_timeout")

    async def _port_answers(self) -> bool:
        """Whether something already accepts connections where the child is to listen."""
        url = httpx.URL(self.spec.base_url)
        with trio.move_on_after(self.settings.probe_timeout_s):
            try:
                stream = await trio.open_tcp_stream(url.host, url.port)
            except OSError:
                return False  # refused: the port is free
            await stream.aclose()
            return True
        return False  # no answer at all: nothing accepts connections there

    async def _probe_health(self, client: httpx.AsyncClient) -> bool:
        url = self.spec.base_url + self.spec.health_path
        with trio.move_on_after(self.settings.probe_timeout_s):
            try:
                response = await client.get(url, timeout=self.settings.probe_timeout_s)
            except httpx.HTTPError:
                return False  # refused while it starts: the normal answer, not an error
            return response.status_code == 200
        return False

    async def _monitor(self, client: httpx.AsyncClient, attempt: _Attempt) -> _Ended:
        """Poll `/health` and the metrics until the server exits, must be restarted, or stalls.

        One poll at a time (sequential, each bounded by `probe_timeout_s`), so probes never pile
        up on a slow server.
        """
        settings = self.settings
        failed_probes = 0
        last_tokens: float | None = None
        last_progress_at = trio.current_time()
        stall_check_skipped = False
        while True:
            with trio.move_on_after(settings.probe_interval_s):
                await self._wake.wait()
            if attempt.exited.is_set():
                return _Ended(phase="runtime", exit_code=attempt.process.returncode)
            if self._restart_pending:
                return _Ended(phase="runtime", exit_code=None, operator_restart=True)

            status = await fetch_status(client, self.spec.base_url, timeout_s=settings.probe_timeout_s)
            if attempt.exited.is_set():
                # The poll failed because the process died: that is an exit, not unhealthiness.
                return _Ended(phase="runtime", exit_code=attempt.process.returncode)
            now = trio.current_time()
            if status.healthy:
                failed_probes = 0
                self._publish(state="ready", **_metric_fields(status))
            else:
                failed_probes += 1
                log.warning("model server health probe failed (%d of %d): %s", failed_probes,
                            settings.unhealthy_after_probes, status.error)
                self._publish(state="unhealthy", poll_error=status.error)
                if failed_probes >= settings.unhealthy_after_probes:
                    return _Ended(phase="runtime", exit_code=None, detected="unhealthy")
                continue

            if status.running is None or status.generation_tokens_total is None:
                if not stall_check_skipped:
                    log.info("stall detection off: the server reports no running-request or token counts "
                             "(sglang needs --enable-metrics)")
                    stall_check_skipped = True
                continue
            tokens = float(status.generation_tokens_total)
            if last_tokens is None or tokens != last_tokens or status.running == 0:
                last_tokens, last_progress_at = tokens, now
            if detect_stall(running=status.running, generation_tokens_total=tokens, last_progress_tokens=last_tokens,
                            seconds_since_progress=now - last_progress_at, stall_after_s=settings.stall_after_s):
                log.warning("model server stalled: %d requests running, no token generated for %.0f s",
                            status.running, now - last_progress_at)
                return _Ended(phase="runtime", exit_code=None, detected="stalled")

    async def _read_output(self, attempt: _Attempt) -> None:
        """Copy the child's output into the log and the tails until the pipe closes."""
        stream = attempt.process.stdout
        buffer = attempt.lines
        try:
            while True:
                try:
                    data = await stream.receive_some(READ_CHUNK_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                truncated_before = buffer.truncated
                lines = buffer.feed(data) if data else buffer.flush()
                for line in lines:
                    log.info("%s", line)
                    self._tail.append(line)
                    attempt.tail.append(line)
                if buffer.truncated != truncated_before:
                    self.truncated_lines += buffer.truncated - truncated_before
                    self._publish(log_lines_truncated=self.truncated_lines)
                if not data:
                    return
        finally:
            attempt.output_done.set()

    async def _wait_exit(self, attempt: _Attempt) -> None:
        await attempt.process.wait()
        attempt.exited.set()
        self._wake.set()

    async def _stop_tree(self, process: trio.Process) -> None:
        """SIGTERM the child's process group, wait `stop_grace_s`, then SIGKILL it. Idempotent.

        Runs shielded: it is the cleanup of a cancelled supervisor, and an orphaned sglang keeps
        its GPUs' memory until someone finds and kills it.
        """
        pgid = process.pid  # the session leader's pid is its group id (start_new_session)
        with trio.CancelScope(shield=True):
            if process.returncode is None or _group_alive(pgid):
                _signal_group(pgid, signal.SIGTERM)
                with trio.move_on_after(self.settings.stop_grace_s) as grace:
                    await process.wait()
                    await _wait_group_gone(pgid)
                if grace.cancelled_caught:
                    log.warning("model server (process group %d) still running %g s after SIGTERM; sending SIGKILL",
                                pgid, self.settings.stop_grace_s)
                    _signal_group(pgid, signal.SIGKILL)
                    with trio.move_on_after(KILL_WAIT_S) as kill_wait:
                        await process.wait()
                        await _wait_group_gone(pgid)
                    if kill_wait.cancelled_caught:
                        log.error("model server process group %d survived SIGKILL for %g s; check `ps -g %d`",
                                  pgid, KILL_WAIT_S, pgid)
