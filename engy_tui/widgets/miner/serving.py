"""The model server block: is this miner's model server serving, and if it is not, why and what
fixes it?

Its title (engine, model, tp/dp, state, restarts), the command it runs (compacted; `c` copies
the exact text), the plan's summary, its load (running, queued, throughput, TTFT and ITL), the
last failure's class in words with its fix, and the newest log lines (the last three while it
is down: a traceback's end is usually where the cause is).

Where the facts come from: the model server's hub component ("model_server";
"model_server.miner-1", … on a local network), `ModelServerState`, published by
`engy_node.miner.sglang.supervisor` (state, kind, url, command, pid, restarts, startup_failures,
restart_in_s, last_failure {kind, summary, fix, phase, exit_code}, running, queued,
generation_tokens_total, gen_throughput, ttft/itl p50/p95 in ms, poll_error,
log_lines_truncated), and the miner's own component, `MinerState`
(`engy_node.miner.role.run_miner`: model, cpu_mode, plan, and command, published together; a
model with no command means the operator runs the server with `--serve-url`). None for either
means the component has not reported. Not published, so not shown rather than guessed: the
server's version, how long it has been ready, its KV-cache use and last token time.
"""

from __future__ import annotations

import re
import shlex
import signal
from collections.abc import Sequence

from engy_node.snapshots import MinerState, ModelServerState, ServerFailure
from engy_tui.widgets.cells import NA, Cell
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import BAD, NA_CELL, OK, SEP, WARN, Level, Line, count_text, ms_text, plural

__all__ = [
    "DOWN",
    "FAILED_LOG_LINES",
    "FAILURE_WORDS",
    "LOG_LINES",
    "command_line",
    "compact_command",
    "failure_lines",
    "load_line",
    "log_lines",
    "plan_line",
    "server_level",
    "server_state_cell",
    "server_title",
    "tp_dp",
]

LOG_LINES = 1
FAILED_LOG_LINES = 3
"""Model-server log lines shown: the newest one, or the last three while it is down (the
traceback's end is usually where the cause is)."""
DOWN = frozenset({"restarting", "exited", "timed_out", "stalled", "failed", "unhealthy"})


FAILURE_WORDS: dict[str, str] = {
    "launch_failed": "the command could not run",
    "oom_at_init": "out of memory at start (no room for the KV cache)",
    "cuda_oom": "CUDA out of memory",
    "no_p2p": "no GPU peer access (P2P)",
    "no_kernel_image": "no CUDA kernels for this GPU",
    "fp8_block_divisibility": "FP8 weights do not split at this tp",
    "port_in_use": "port already in use",
    "hidden_states_flag": "hidden states switched off",
    "model_not_found": "model checkpoint not found",
    "startup_timeout": "start timed out",
    "unhealthy": "stopped answering health checks",
    "stalled": "stalled: requests running, no tokens",
    "unknown": "unrecognised failure",
}
"""`engy_node.miner.sglang.failures.FailureKind` in words."""


def _words(command: str | None) -> list[str] | None:
    text = _text(command)
    if text is None:
        return None
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def tp_dp(command: str | None) -> tuple[int | None, int | None]:
    """The tensor- and data-parallel sizes an sglang command line asks for (None: not given)."""
    words = _words(command) or []
    found: dict[str, int | None] = {"tp": None, "dp": None}
    for flag, key in (
        ("--tp-size", "tp"),
        ("--tensor-parallel-size", "tp"),
        ("--tp", "tp"),
        ("--dp-size", "dp"),
        ("--dp", "dp"),
        ("--data-parallel-size", "dp"),
    ):
        for i, word in enumerate(words):
            value = (
                word.split("=", 1)[1]
                if word.startswith(flag + "=")
                else (words[i + 1] if word == flag and i + 1 < len(words) else None)
            )
            if value is not None and value.isascii() and value.isdigit() and len(value) < 6:
                found[key] = int(value)
    return found["tp"], found["dp"]


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def compact_command(command: str | None) -> str | None:
    """The command as one short line: environment assignments left out, the interpreter by its
    name, long paths by their last part ("…/qwen3.6-35b-a3b"), so the flags that matter fit.
    The exact text is what `c` copies; None when there is no command."""
    words = _words(command)
    if not words:
        return None
    while len(words) > 1 and _ASSIGNMENT.match(words[0]):
        words = words[1:]
    short = []
    for index, word in enumerate(words):
        if word.startswith("/") and "/" in word[1:]:
            tail = word.rstrip("/").rsplit("/", 1)[-1]
            word = tail if index == 0 else (word if len(word) <= 24 else f"…/{tail}")
        short.append(word if word and all(ch.isprintable() and not ch.isspace() for ch in word) else shlex.quote(word))
    line = " ".join(short)
    return _text(line) or None


def _external(miner: MinerState | None, server: ModelServerState | None) -> bool:
    """The operator runs the model server (`--serve-url`): the miner published its model without
    a command (`run_miner` publishes both at once), and no supervisor reports."""
    return server is None and miner is not None and miner.model is not None and miner.command is None


def command_line(miner: MinerState | None, server: ModelServerState | None) -> Line:
    """ "cmd: python -m sglang.launch_server …", the supervisor's command (else the plan's)."""
    text = compact_command(server.command if server else None) or compact_command(miner.command if miner else None)
    if text is None:
        if _external(miner, server):
            return (Cell("cmd: ", "header"), Cell("none: the operator runs the model server (--serve-url)", "na"))
        return (Cell("cmd: ", "header"), NA_CELL)
    return (Cell("cmd: ", "header"), Cell(text))


def plan_line(miner: MinerState | None) -> Line | None:
    """The plan's summary sentence, when the miner published one."""
    plan = _text(miner.plan) if miner else None
    return (Cell("plan: ", "header"), Cell(plan)) if plan else None


_STATE_WORDS: dict[str, tuple[str, Level]] = {
    "ready": (f"ready {OK}", "ok"),
    "starting": ("starting …", ""),
    "restarting": (f"restarting {WARN}", "warning"),
    "unhealthy": (f"unhealthy {WARN}", "warning"),
    "stalled": (f"stalled {BAD}", "error"),
    "timed_out": (f"start timed out {BAD}", "error"),
    "exited": (f"exited {BAD}", "error"),
    "failed": (f"failed {BAD} gave up", "error"),
    "stopped": ("stopped", "na"),
}


def server_state_cell(server: ModelServerState | None) -> Cell:
    """The supervisor's state in words, with ✔/⚠/✘; a restart's backoff when it is waiting."""
    state = _text(server.state) if server else None
    if server is None or state is None:
        return Cell(f"state {NA}", "na")
    text, level = _STATE_WORDS.get(state, (state, ""))
    wait = _num(server.restart_in_s)
    if state == "restarting" and wait is not None:
        text = f"restarting in {wait:g} s {WARN}"
    return Cell(text, level)


def _failed_now(server: ModelServerState) -> bool:
    """Whether the last failure is why the server is down now. An operator's restart publishes
    "restarting" without a backoff and leaves the last failure as it was."""
    state = server.state
    return state in ("exited", "timed_out", "stalled", "failed") or (
        state == "restarting" and _num(server.restart_in_s) is not None
    )


def server_level(miner: MinerState | None, server: ModelServerState | None) -> Level:
    """How the model server box is framed: error while a failure keeps it down (it serves
    nothing), else by its state word; na when nothing is reported."""
    if server is None:
        return "na"
    if _failed_now(server):
        return "error"
    return server_state_cell(server).style or ""  # type: ignore[return-value]


def server_title(miner: MinerState | None, server: ModelServerState | None) -> str:
    """ "sglang · qwen3.6-35b-a3b · tp 2 · ready ✔ · 0 restarts"."""
    parts = [_text(server.kind) if server else None, _text(miner.model) if miner else None]
    server_command = _text(server.command) if server else None
    tp, dp = tp_dp(server_command or (miner.command if miner else None))
    if tp is not None:
        parts.append(f"tp {tp}" + (f" × dp {dp}" if dp is not None and dp > 1 else ""))
    if miner is not None and miner.cpu_mode is True:
        parts.append("CPU")
    if server is None:
        parts.append("external server" if _external(miner, server) else "not reported yet")
        return SEP.join(p for p in parts if p)
    parts.append(server_state_cell(server).text)
    parts.append(plural(server.restarts, "restart"))
    failures = server.startup_failures
    if failures:
        parts.append(plural(failures, "failed start"))
    return SEP.join(p for p in parts if p)


def load_line(server: ModelServerState | None) -> Line:
    """Requests running and queued, generation throughput, TTFT and ITL (p50/p95) from the
    supervisor's last poll; why there are none while the server is not ready."""
    if server is None:
        return (Cell("load: ", "header"), Cell("no model server reported", "na"))
    latencies = (
        ("TTFT", server.ttft_p50_ms, server.ttft_p95_ms),
        ("ITL", server.itl_p50_ms, server.itl_p95_ms),
    )
    polled = (server.running, server.queued, server.gen_throughput, *(ms for _, *pair in latencies for ms in pair))
    state = _text(server.state)
    if all(value is None for value in polled) and state != "ready":
        return (Cell("load: ", "header"), Cell(f"none while {state or 'state is n/a'}", "na"))
    throughput = _num(server.gen_throughput)
    cells: list[Cell] = [
        Cell("load: ", "header"),
        Cell("running "),
        Cell(count_text(server.running), "" if server.running is not None else "na"),
        Cell(" · queue "),
        Cell(count_text(server.queued), "" if server.queued is not None else "na"),
        Cell(SEP),
        Cell(f"{throughput:,.1f} tok/s") if throughput is not None else Cell(f"tok/s {NA}", "na"),
    ]
    for label, p50, p95 in latencies:
        a, b = ms_text(p50), ms_text(p95)
        text = f"{label} p50/p95 {a}/{b} ms" if (a, b) != (NA, NA) else f"{label} {NA}"
        cells += [Cell(SEP), Cell(text, "" if (a, b) != (NA, NA) else "na")]
    error = _text(server.poll_error)
    if error:
        cells += [Cell(SEP), Cell(f"{WARN} poll: {error}", "warning")]
    return tuple(cells)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except (ValueError, OverflowError):
        return f"signal {number}"


def _failure_what(failure: ServerFailure) -> str:
    kind = _text(failure.kind)
    words = FAILURE_WORDS.get(kind or "", kind or f"failure {NA}")
    label = f"{words} ({kind})" if kind in FAILURE_WORDS and kind != "unknown" else words
    phase = failure.phase
    details = []
    if phase in ("startup", "runtime"):
        details.append("while starting" if phase == "startup" else "while serving")
    exit_code = failure.exit_code
    if exit_code is not None:
        details.append(f"killed by {_signal_name(-exit_code)}" if exit_code < 0 else f"exit code {exit_code}")
    return label + (f", {', '.join(details)}" if details else "")


def failure_lines(server: ModelServerState | None) -> list[Line]:
    """The last failure's class in words, what happened and its fix: "✘" while the server is
    down, "⚠ recovered from" once it is ready again; a start given up on says to restart it."""
    if server is None:
        return []
    failure = server.last_failure
    state = server.state
    lines: list[Line] = []
    if failure is not None:
        current = _failed_now(server)
        level = "error" if current else "warning"
        head = f"{BAD} " if current else f"{WARN} recovered from: " if state == "ready" else f"{WARN} last failure: "
        lines.append((Cell(head + _failure_what(failure), level),))
        summary = _text(failure.summary)
        if summary:
            lines.append((Cell("  "), Cell(summary, "na")))
        fix = _text(failure.fix)
        lines.append((Cell("  → fix: ", level), Cell(fix or NA, "" if fix else "na")))
    if state == "failed":
        failures = server.startup_failures
        times = f"{failures:,} times in a row" if failures > 0 else "repeatedly"
        lines.append(
            (
                Cell(
                    f"{BAD} it failed to start {times} and is not restarted: apply the fix, then restart it "
                    "(r, or restart the node)",
                    "error",
                ),
            )
        )
    elif state == "unhealthy":
        lines.append((Cell(f"{WARN} health checks failing: it is restarted after 3 misses in a row", "warning"),))
    truncated = server.log_lines_truncated
    if truncated:
        lines.append((Cell(f"{plural(truncated, 'overlong log line')} cut at 16 KB", "na"),))
    return lines


def log_lines(lines: Sequence[str], *, shared: bool = False, limit: int = LOG_LINES) -> list[Line]:
    """The newest `limit` model-server log lines ("log: …"); `shared`: the lines are every model
    server's of this node, not told apart by the log (said so)."""
    kept = [text for text in (_text(line) for line in lines) if text is not None][-max(1, limit) :]
    label = "log (all servers): " if shared else "log: "
    if not kept:
        return [(Cell(label, "header"), Cell("no lines yet", "na"))]
    return [(Cell(label if i == 0 else " " * len(label), "header"), Cell(text)) for i, text in enumerate(kept)]
