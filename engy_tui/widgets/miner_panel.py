"""The miner's dashboard: per miner of this node, its model server (state, restarts, command,
load, log tail, the last failure's class and its fix), its link to the gateway (legs,
eligibility, the breaker's windows), the proofs judged on this node, and its standing on chain.

The widget is handed the hub's states (plain dicts, component -> state) with the render time
through `update_state` by the app's fixed-rate render timer, with the node's `hotkeys` and the
last few model-server log lines the app kept from the events it drains; it never polls, reads
the clock or reads events itself. What every line says and how it is styled is decided by the
plain functions below, tested without a terminal; the widget only turns their `Cell`s into
Textual content, and skips the repaint when nothing changed.

Where each fact comes from (read the producers before changing a key):

* the miner, under its hub component ("miner"; "miner-1", "miner-2" on a local network):
  `engy_node.miner.role.run_miner` publishes model, max_inflight, cpu_mode, plan (the plan's
  summary sentence) and command (shell text, None when the operator runs the server:
  `--serve-url`); `engy_node.miner.link.GatewayLink.publish` adds legs_up, legs, inflight.
* its model server under "model_server" ("model_server.miner-1", …):
  `engy_node.miner.sglang.supervisor` publishes state, kind, url, command, pid, restarts,
  startup_failures, restart_in_s, last_failure {kind, summary, fix, phase, exit_code},
  running, queued, generation_tokens_total, gen_throughput, ttft/itl p50/p95 in ms,
  poll_error, log_lines_truncated.
* proofs: "verifier" (`engy_node.verifier`: state, verdicts {pass, cheat, unproven}, counted
  since it started) and "audit" (`engy_node.gateway.trust_plane`: waiting, leased,
  dropped_full, dropped_expired, dropped_unjudged, recorded) when this node runs them; on a
  gateway node, the "traffic" worker whose `miner` is this miner's hotkey
  (`engy_node.gateway.traffic.TrafficState.to_json`: state, since, reason, eligible,
  first_party, until, strikes, round, window{requests, failed, verdicts, unproven}, history).
* chain: "chain" (`engy_node.local.up._chain_snapshot`), read by
  `validator.chain.miner_lines`; the miner's hotkey is node info's `hotkeys`[component name].
* heartbeats: the "gateway" state's `legs` (`MinerPool.snapshot`) of this miner's hotkey.

Not published anywhere, so not shown rather than guessed: the server's version, how long it has
been ready, its KV-cache use and last token time, the gateway URL of a remote gateway, when the
gateway admitted the miner and requests served per day. A standalone miner's hotkey is not in
node info either, so its eligibility and chain standing read n/a.

Honesty rules: a fact the hub did not give is "n/a", dimmed, never 0; every input is treated as
untrusted JSON (a wrong type reads as missing, nothing raises); colour is never the only signal
(✔ ✘ ⚠ and state words carry it), and every failure shown names its fix.

One node may run several miners (a local network runs miner-1 and miner-2 in one process): one
miner gets the full layout (model server and proofs side by side, gateway link and chain under
them); several get one compact box each, and the node's proofs once under them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import signal
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_node.protocol.standing import MAX_UNPROVEN_PCT, SERVED_WINDOW_S, VERDICT_WINDOW_S
from engy_tui.widgets.cells import (
    NA,
    Cell,
    cells_content,
    format_age,
    format_duration,
    short_hotkey,
)
from engy_tui.widgets.cells import (
    as_int as _int,
)
from engy_tui.widgets.cells import (
    as_list as _list,
)
from engy_tui.widgets.cells import (
    as_map as _map,
)
from engy_tui.widgets.cells import (
    as_number as _num,
)
from engy_tui.widgets.cells import (
    as_text as _text,
)
from engy_tui.widgets.validator.chain import miner_lines

__all__ = [
    "FAILURE_WORDS",
    "HEARTBEAT_LATE_S",
    "STYLES",
    "Cell",
    "MinerPanel",
    "MinerView",
    "PanelView",
    "chain_lines",
    "command_line",
    "compact_command",
    "eligibility_cell",
    "failure_lines",
    "gateway_proof_line",
    "heartbeat_cell",
    "legs_cell",
    "lines_content",
    "link_lines",
    "link_notes",
    "link_summary",
    "link_title",
    "load_line",
    "log_lines",
    "miner_hotkey",
    "miner_names",
    "miner_view",
    "node_proof_lines",
    "panel_view",
    "plan_line",
    "served_line",
    "server_component",
    "server_level",
    "server_state_cell",
    "server_title",
    "tp_dp",
]

OK = "✔"
WARN = "⚠"
BAD = "✘"
SEP = " · "

HEARTBEAT_LATE_S = 45.0
"""A miner beats every 30 s and the gateway republishes its legs every 10 s, so up to about 40 s
is normal; past 45 s one beat is late (the gateway drops a leg after 90 s)."""


LOG_LINES = 1
FAILED_LOG_LINES = 3
"""Model-server log lines shown: the newest one, or the last three while it is down (the
traceback's end is usually where the cause is)."""
_DOWN = frozenset({"restarting", "exited", "timed_out", "stalled", "failed", "unhealthy"})

STYLES: dict[str, str] = {
    "": "",
    "header": "bold $foreground-muted",
    "na": "$foreground-muted",
    "ok": "$text-success",
    "info": "$text-primary",
    "warning": "$text-warning",
    "error": "bold $text-error",
    "bar": "$text-accent",
}
"""Cell style names -> Textual styles (theme variables, so every theme works). `$foreground-muted`
rather than `$text-muted`, which renders white inside Content styles in this Textual version."""

Line = tuple[Cell, ...]
Level = Literal["", "ok", "warning", "error", "na"]
NA_CELL = Cell(NA, "na")

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

_BREAKER_CODES = frozenset({"failures-in-a-row", "failure-rate", "slow-ttft", "slow-tpot", "unproven-rate", "cheat"})

_PULL_FIXES: dict[str, str] = {
    "cheat": "serve the catalog checkpoint unmodified, with the command the plan gives; it qualifies again after "
    "the cooldown",
    "failures-in-a-row": "requests failed: see the model server box and its log; it qualifies again after the cooldown",
    "failure-rate": "requests failed: see the model server box and its log; it qualifies again after the cooldown",
    "slow-ttft": "too slow for the model's latency ceiling: lower --max-running-requests (fewer requests at once)",
    "slow-tpot": "too slow for the model's latency ceiling: lower --max-running-requests (fewer requests at once)",
    "unproven-rate": "too many proofs could not be checked: keep the planned flags (--enable-return-hidden-states, "
    "--enable-deterministic-inference) and the catalog checkpoint",
    "not-qualified": "the qualification round was lost (the reason names the bar missed); it retries after the cooldown",
    "round-timeout": "the qualification round ran out of time (a verifier may be behind); it retries after the cooldown",
}
_PULL_FIX = "it qualifies again after the cooldown; the reason names what the gateway saw"


# ---- reading untrusted JSON -----------------------------------------------------------------


def _count(value: Any) -> str:
    number = _int(value)
    return NA if number is None else f"{number:,}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _ms(value: Any) -> str:
    ms = _num(value)
    if ms is None:
        return NA
    return f"{ms:.1f}" if abs(ms) < 10 else f"{ms:,.0f}"


# ---- which miners, and their components -----------------------------------------------------


def _natural(name: str) -> tuple[tuple[int, int, str], ...]:
    # miner-2 before miner-10; digits compare by length then text, so no int() of huge numbers.
    return tuple(
        (0, 0, part) if i % 2 == 0 else (1, len(part), part) for i, part in enumerate(re.split(r"(\d+)", name))
    )


def miner_names(states: Any) -> list[str]:
    """The miners of this node, in natural order: every "miner"/"miner-…" component, and the
    miner of every "model_server"/"model_server.…" one (its server may report first)."""
    found = set()
    for key, value in _map(states).items():
        if not isinstance(key, str) or not isinstance(value, Mapping):
            continue
        if not key.isprintable():
            continue
        if key == "miner" or (key.startswith("miner-") and len(key) > 6):
            found.add(key)
        elif key == "model_server":
            found.add("miner")
        elif key.startswith("model_server.") and len(key) > 13:
            found.add(key.removeprefix("model_server."))
    return sorted(found, key=_natural)


def server_component(miner: str) -> str:
    """The hub component of `miner`'s model server (`role.run_miner`, `local.up._miner_service`)."""
    return "model_server" if miner == "miner" else f"model_server.{miner}"


def miner_hotkey(miner: str, names: Any, state: Any = None) -> str | None:
    """`miner`'s ss58 hotkey: node info's `hotkeys`[name] (a local network names its miners'
    hotkeys after their components), else a `hotkey` the miner state carries."""
    return _text(_map(names).get(miner)) or _text(_map(state).get("hotkey"))


# ---- the model server -----------------------------------------------------------------------


def _words(command: Any) -> list[str] | None:
    text = _text(command)
    if text is None:
        return None
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def tp_dp(command: Any) -> tuple[int | None, int | None]:
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


def compact_command(command: Any) -> str | None:
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


def command_line(miner: Any, server: Any) -> Line:
    """ "cmd: python -m sglang.launch_server …", the supervisor's command (else the plan's)."""
    text = compact_command(_map(server).get("command")) or compact_command(_map(miner).get("command"))
    if text is None:
        if "command" in _map(miner) and _map(miner).get("command") is None and not _map(server):
            return (Cell("cmd: ", "header"), Cell("none: the operator runs the model server (--serve-url)", "na"))
        return (Cell("cmd: ", "header"), NA_CELL)
    return (Cell("cmd: ", "header"), Cell(text))


def plan_line(miner: Any) -> Line | None:
    """The plan's summary sentence, when the miner published one."""
    plan = _text(_map(miner).get("plan"))
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


def server_state_cell(server: Any) -> Cell:
    """The supervisor's state in words, with ✔/⚠/✘; a restart's backoff when it is waiting."""
    server = _map(server)
    state = _text(server.get("state"))
    if state is None:
        return Cell(f"state {NA}", "na")
    text, level = _STATE_WORDS.get(state, (state, ""))
    wait = _num(server.get("restart_in_s"))
    if state == "restarting" and wait is not None:
        text = f"restarting in {wait:g} s {WARN}"
    return Cell(text, level)


def _failed_now(server: Mapping[Any, Any]) -> bool:
    """Whether the last failure is why the server is down now. An operator's restart publishes
    "restarting" without a backoff and leaves the last failure as it was."""
    state = _text(server.get("state"))
    return state in ("exited", "timed_out", "stalled", "failed") or (
        state == "restarting" and _num(server.get("restart_in_s")) is not None
    )


def server_level(miner: Any, server: Any) -> Level:
    """How the model server box is framed: error while a failure keeps it down (it serves
    nothing), else by its state word; na when nothing is reported."""
    server = _map(server)
    if not server:
        return "na"
    if _failed_now(server):
        return "error"
    return server_state_cell(server).style or ""  # type: ignore[return-value]


def server_title(miner: Any, server: Any) -> str:
    """ "sglang · qwen3.6-35b-a3b · tp 2 · ready ✔ · 0 restarts"."""
    miner, server = _map(miner), _map(server)
    parts = [_text(server.get("kind")), _text(miner.get("model"))]
    tp, dp = tp_dp(server.get("command") if _text(server.get("command")) else miner.get("command"))
    if tp is not None:
        parts.append(f"tp {tp}" + (f" × dp {dp}" if dp is not None and dp > 1 else ""))
    if miner.get("cpu_mode") is True:
        parts.append("CPU")
    if not server:
        if "command" in miner and miner.get("command") is None:
            parts.append("external server")
        else:
            parts.append("not reported yet")
        return SEP.join(p for p in parts if p)
    parts.append(server_state_cell(server).text)
    restarts = _int(server.get("restarts"))
    parts.append(f"restarts {NA}" if restarts is None else _plural(restarts, "restart"))
    failures = _int(server.get("startup_failures"))
    if failures:
        parts.append(_plural(failures, "failed start"))
    return SEP.join(p for p in parts if p)


def load_line(server: Any) -> Line:
    """Requests running and queued, generation throughput, TTFT and ITL (p50/p95) from the
    supervisor's last poll; why there are none while the server is not ready."""
    server = _map(server)
    if not server:
        return (Cell("load: ", "header"), Cell("no model server reported", "na"))
    keys = ("running", "queued", "gen_throughput", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")
    state = _text(server.get("state"))
    if all(server.get(key) is None for key in keys) and state != "ready":
        return (Cell("load: ", "header"), Cell(f"none while {state or 'state is n/a'}", "na"))
    throughput = _num(server.get("gen_throughput"))
    cells: list[Cell] = [
        Cell("load: ", "header"),
        Cell("running "),
        Cell(_count(server.get("running")), "" if _int(server.get("running")) is not None else "na"),
        Cell(" · queue "),
        Cell(_count(server.get("queued")), "" if _int(server.get("queued")) is not None else "na"),
        Cell(SEP),
        Cell(f"{throughput:,.1f} tok/s") if throughput is not None else Cell(f"tok/s {NA}", "na"),
    ]
    for label, p50, p95 in (("TTFT", "ttft_p50_ms", "ttft_p95_ms"), ("ITL", "itl_p50_ms", "itl_p95_ms")):
        a, b = _ms(server.get(p50)), _ms(server.get(p95))
        text = f"{label} p50/p95 {a}/{b} ms" if (a, b) != (NA, NA) else f"{label} {NA}"
        cells += [Cell(SEP), Cell(text, "" if (a, b) != (NA, NA) else "na")]
    error = _text(server.get("poll_error"))
    if error:
        cells += [Cell(SEP), Cell(f"{WARN} poll: {error}", "warning")]
    return tuple(cells)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except (ValueError, OverflowError):
        return f"signal {number}"


def _failure_what(failure: Mapping[Any, Any]) -> str:
    kind = _text(failure.get("kind"))
    words = FAILURE_WORDS.get(kind or "", kind or f"failure {NA}")
    label = f"{words} ({kind})" if kind in FAILURE_WORDS and kind != "unknown" else words
    phase = _text(failure.get("phase"))
    details = []
    if phase in ("startup", "runtime"):
        details.append("while starting" if phase == "startup" else "while serving")
    exit_code = _int(failure.get("exit_code"))
    if exit_code is not None:
        details.append(f"killed by {_signal_name(-exit_code)}" if exit_code < 0 else f"exit code {exit_code}")
    return label + (f", {', '.join(details)}" if details else "")


def failure_lines(server: Any) -> list[Line]:
    """The last failure's class in words, what happened and its fix: "✘" while the server is
    down, "⚠ recovered from" once it is ready again; a start given up on says to restart it."""
    server = _map(server)
    failure = _map(server.get("last_failure"))
    state = _text(server.get("state"))
    lines: list[Line] = []
    if failure:
        current = _failed_now(server)
        level = "error" if current else "warning"
        head = f"{BAD} " if current else f"{WARN} recovered from: " if state == "ready" else f"{WARN} last failure: "
        lines.append((Cell(head + _failure_what(failure), level),))
        summary = _text(failure.get("summary"))
        if summary:
            lines.append((Cell("  "), Cell(summary, "na")))
        fix = _text(failure.get("fix"))
        lines.append((Cell("  → fix: ", level), Cell(fix or NA, "" if fix else "na")))
    if state == "failed":
        failures = _int(server.get("startup_failures"))
        times = f"{failures:,} times in a row" if failures is not None else "repeatedly"
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
    truncated = _int(server.get("log_lines_truncated"))
    if truncated:
        lines.append((Cell(f"{_plural(truncated, 'overlong log line')} cut at 16 KB", "na"),))
    return lines


def log_lines(lines: Any, *, shared: bool = False, limit: int = LOG_LINES) -> list[Line]:
    """The newest `limit` model-server log lines ("log: …"); `shared`: the lines are every model
    server's of this node, not told apart by the log (said so)."""
    kept = [text for text in (_text(line) for line in _list(lines)) if text is not None][-max(1, limit) :]
    label = "log (all servers): " if shared else "log: "
    if not kept:
        return [(Cell(label, "header"), Cell("no lines yet", "na"))]
    return [(Cell(label if i == 0 else " " * len(label), "header"), Cell(text)) for i, text in enumerate(kept)]


# ---- the gateway link -----------------------------------------------------------------------


def _worker(traffic: Any, hotkey: str | None, model: str | None) -> Mapping[Any, Any] | None:
    """The control plane's worker for this miner: its hotkey, and its model when one matches."""
    if hotkey is None:
        return None
    workers = [w for w in _list(_map(traffic).get("workers")) if isinstance(w, Mapping) and w.get("miner") == hotkey]
    return next((w for w in workers if w.get("model") == model), workers[0] if workers else None)


def _legs(gateway: Any, hotkey: str | None) -> list[Mapping[Any, Any]]:
    if hotkey is None:
        return []
    return [leg for leg in _list(_map(gateway).get("legs")) if isinstance(leg, Mapping) and leg.get("miner") == hotkey]


def legs_cell(miner: Any) -> Cell:
    """Legs admitted of those dialled: "4 legs ✔", "3/4 legs ⚠", "0/4 legs ✘", "dialling"."""
    miner = _map(miner)
    up, legs = _int(miner.get("legs_up")), _int(miner.get("legs"))
    if up is None or legs is None:
        return Cell(f"legs {NA}", "na")
    if legs <= 0:
        return Cell("dialling the gateway …")
    if up >= legs:
        return Cell(f"{_plural(legs, 'leg')} {OK}", "ok")
    return Cell(f"{up:,}/{legs:,} legs {BAD if up <= 0 else WARN}", "error" if up <= 0 else "warning")


def eligibility_cell(worker: Any, *, has_traffic: bool, hotkey: str | None) -> Cell:
    """The gateway's verdict on this miner: active ✔, probing, pulled ✘, new; "own" for a
    first-party worker (eligible whatever its state); n/a when this node cannot see it."""
    if hotkey is None:
        return Cell(f"eligibility {NA} (hotkey not known)", "na")
    if not has_traffic:
        return Cell(f"eligibility {NA} (decided at the gateway)", "na")
    worker = _map(worker)
    if not worker:
        return Cell("eligibility: not known to the gateway yet", "na")
    state = _text(worker.get("state"))
    own = " own" if worker.get("first_party") is True else ""
    if state == "active":
        return Cell(f"eligibility: active{own} {OK}", "ok")
    if state == "pulled":
        return Cell(f"eligibility: pulled{own} {BAD}", "error")
    if state == "probing":
        return Cell(f"eligibility: probing{own} (qualifying)", "info")
    if state == "new":
        return Cell(f"eligibility: new{own} (not connected)", "na")
    return Cell(f"eligibility: {state or NA}{own}", "" if state else "na")


def link_title(miner: Any, worker: Any, *, has_traffic: bool, hotkey: str | None, url: str | None = None) -> str:
    """ "wss://… · 4 legs ✔ · eligibility: active ✔"."""
    parts = [url, legs_cell(miner).text, eligibility_cell(worker, has_traffic=has_traffic, hotkey=hotkey).text]
    return SEP.join(p for p in parts if p)


def heartbeat_cell(legs: Sequence[Mapping[Any, Any]]) -> Cell | None:
    """The oldest heartbeat the gateway holds from this miner's legs (a local gateway's view),
    ⚠ past `HEARTBEAT_LATE_S`; None without legs."""
    ages = [age for age in (_num(leg.get("heartbeat_age_s")) for leg in legs) if age is not None]
    if not legs:
        return None
    if not ages:
        return Cell(f"heartbeat {NA}", "na")
    oldest = max(ages)
    if oldest > HEARTBEAT_LATE_S:
        return Cell(f"heartbeat {format_duration(oldest)} ago {WARN}", "warning")
    return Cell(f"heartbeat {format_duration(oldest)} ago")


def served_line(worker: Any) -> Line | None:
    """The breaker's window of served requests at the gateway: "served 120 (0 failed) in 60 s"."""
    window = _map(_map(worker).get("window"))
    if not window:
        return None
    requests, failed = _int(window.get("requests")), _int(window.get("failed"))
    span = format_duration(SERVED_WINDOW_S)
    if requests is None:
        return (Cell("served "), NA_CELL)
    if failed is None:
        return (Cell(f"served {requests:,} ({NA} failed) in {span}"),)
    return (
        Cell(
            f"served {requests:,} ({failed:,} failed{f' {WARN}' if failed else ''}) in {span}",
            "warning" if failed else "",
        ),
    )


def gateway_proof_line(worker: Any) -> Line | None:
    """This miner's verdicts in the gateway's breaker window: "audited 61 · 2 unproven (3.3%)";
    ⚠ past the breaker's unproven limit. The window counts pass and unproven (a cheat pulls at
    once, so it shows as the pull, not here)."""
    window = _map(_map(worker).get("window"))
    if not window:
        return None
    verdicts, unproven = _int(window.get("verdicts")), _int(window.get("unproven"))
    span = format_duration(VERDICT_WINDOW_S)
    if verdicts is None:
        return (Cell(f"audited at the gateway ({span}) "), NA_CELL)
    if unproven is None:
        return (Cell(f"audited {verdicts:,} · unproven {NA} in {span}"),)
    share = f" ({100 * unproven / verdicts:.1f}%)" if verdicts > 0 and 0 < unproven <= verdicts else ""
    high = verdicts > 0 and unproven * 100 > MAX_UNPROVEN_PCT * verdicts
    mark = f" {WARN} over {MAX_UNPROVEN_PCT}%" if high else (f" {OK}" if verdicts and not unproven else "")
    return (
        Cell(
            f"audited {verdicts:,} · {unproven:,} unproven{share}{mark} in {span}",
            "warning" if high else ("ok" if verdicts and not unproven else ""),
        ),
    )


def _round_text(worker: Mapping[Any, Any]) -> str | None:
    rnd = _map(worker.get("round"))
    probes = _int(rnd.get("probes"))
    if not probes:
        return None
    parts = [f"{_count(rnd.get('ok'))}/{probes:,} probes ok", f"{_count(rnd.get('pass'))} pass"]
    for key in ("unproven", "cheat"):
        if _int(rnd.get(key)):
            parts.append(f"{_count(rnd.get(key))} {key}")
    return ", ".join(parts)


def link_lines(
    miner: Any, worker: Any, legs: Sequence[Mapping[Any, Any]], *, now: float, has_traffic: bool
) -> list[Line]:
    """In flight over the miner's slots and the heartbeat; how long it has been in its
    eligibility state and the control plane's own reason; the served window."""
    miner, worker = _map(miner), _map(worker)
    first: list[Cell] = [
        Cell("in flight "),
        Cell(f"{_count(miner.get('inflight'))}/{_count(miner.get('max_inflight'))}"),
    ]
    if _int(miner.get("inflight")) is None:
        first[1] = Cell(first[1].text, "na")
    beat = heartbeat_cell(legs)
    if beat is not None:
        first += [Cell(SEP), beat]
    lines: list[Line] = [tuple(first)]
    if worker:
        state = _text(worker.get("state")) or NA
        since = format_age(now, worker.get("since"))
        reason = _text(worker.get("reason"))
        text = f"{state} for {since}" if since else state
        lines.append((Cell(text + (f": {reason}" if reason else "")),))
        if state == "probing":
            progress = _round_text(worker)
            lines.append(
                (Cell(f"qualifying round: {progress or 'no probe finished yet'}", "info" if progress else "na"),)
            )
        served = served_line(worker)
        if served is not None:
            lines.append(served)
    elif has_traffic:
        lines.append((Cell("the gateway on this node has not seen this miner yet", "na"),))
    return lines


def link_summary(
    miner: Any, worker: Any, legs: Sequence[Mapping[Any, Any]], *, now: float, has_traffic: bool, hotkey: str | None
) -> Line:
    """The link on one line, for a compact block: legs, eligibility and for how long, in flight,
    heartbeat, and the gateway's served and audited windows."""
    miner, worker = _map(miner), _map(worker)
    eligibility = eligibility_cell(worker, has_traffic=has_traffic, hotkey=hotkey)
    # Under the "gateway:" label the state word says it ("active own ✔"); n/a keeps its why.
    eligibility = eligibility._replace(text=eligibility.text.removeprefix("eligibility: "))
    cells: list[Cell] = [legs_cell(miner), Cell(SEP), eligibility]
    since = format_age(now, worker.get("since")) if worker else None
    if since:
        cells.append(Cell(f" for {since}"))
    inflight = _int(miner.get("inflight"))
    cells += [
        Cell(f"{SEP}in flight "),
        Cell(f"{_count(inflight)}/{_count(miner.get('max_inflight'))}", "" if inflight is not None else "na"),
    ]
    beat = heartbeat_cell(legs)
    if beat is not None:
        cells += [Cell(SEP), beat]
    for line in (served_line(worker), gateway_proof_line(worker)):
        if line is not None:
            cells += [Cell(SEP), *line]
    return tuple(cells)


def _report(worker: Mapping[Any, Any]) -> Mapping[Any, Any] | None:
    """A first-party worker's latest transition when it is a breaker report (it would have been
    pulled: `from == to`), else None."""
    history = [entry for entry in _list(worker.get("history")) if isinstance(entry, Mapping)]
    if worker.get("first_party") is not True or not history:
        return None
    last = history[-1]
    return last if last.get("from") == last.get("to") and last.get("code") in _BREAKER_CODES else None


def link_notes(miner: Any, worker: Any, *, now: float) -> list[Line]:
    """What is wrong with the link, and what to do: no leg admitted, legs down, pulled (with the
    control plane's reason and the cooldown), a first-party worker that would have been pulled."""
    miner, worker = _map(miner), _map(worker)
    notes: list[Line] = []
    up, legs = _int(miner.get("legs_up")), _int(miner.get("legs"))
    if up is not None and legs is not None and legs > 0:
        if up <= 0:
            notes += [
                (Cell(f"{BAD} no leg to the gateway is admitted: it routes no request here", "error"),),
                (
                    Cell("  → fix: ", "error"),
                    Cell(
                        "the miner.link log says why: a deny names the refused key or "
                        "hotkey; a lost leg re-dials by itself with backoff"
                    ),
                ),
            ]
        elif up < legs:
            notes.append(
                (
                    Cell(
                        f"{WARN} {legs - up:,} of {legs:,} legs down: the gateway workers behind them route "
                        "nothing here; they re-dial by themselves (the miner.link log says why)",
                        "warning",
                    ),
                )
            )
    if _text(worker.get("state")) == "pulled":
        history = [entry for entry in _list(worker.get("history")) if isinstance(entry, Mapping)]
        pull = next((entry for entry in reversed(history) if entry.get("to") == "pulled"), {})
        code = _text(pull.get("code"))
        until = _num(worker.get("until"))
        left = ""
        if until is not None and math.isfinite(now):
            left = f" · {format_duration(until - now)} of cooldown left" if until > now else " · cooldown over"
        notes.append(
            (
                Cell(
                    f"{BAD} pulled by the gateway{f' ({code})' if code else ''}{left}: "
                    f"{_text(worker.get('reason')) or 'no reason given'}",
                    "error",
                ),
            )
        )
        notes.append((Cell("  → fix: ", "error"), Cell(_PULL_FIXES.get(code or "", _PULL_FIX))))
    report = _report(worker)
    if report is not None:
        code = _text(report.get("code")) or ""
        notes.append(
            (
                Cell(
                    f"{WARN} would have been pulled ({code}), kept as first-party: "
                    f"{_text(report.get('reason')) or code}",
                    "warning",
                ),
            )
        )
        notes.append((Cell("  → fix: ", "warning"), Cell(_PULL_FIXES.get(code, _PULL_FIX))))
    return notes


# ---- proofs and chain -----------------------------------------------------------------------


def node_proof_lines(states: Any) -> list[Line]:
    """The proofs judged on this node: the verifier's verdicts since it started (pass, cheat ✘,
    unproven and its share) and the audit queue; n/a where this node runs neither."""
    states = _map(states)
    verifier, audit = states.get("verifier"), states.get("audit")
    lines: list[Line] = []
    if isinstance(verifier, Mapping):
        verdicts = verifier.get("verdicts")
        if not isinstance(verdicts, Mapping):
            state = _text(verifier.get("state"))
            lines.append((Cell("verifier: ", "header"), Cell(f"{state or 'state n/a'}, no verdict yet", "na")))
        else:
            passed, cheat, unproven = (_int(verdicts.get(k)) for k in ("pass", "cheat", "unproven"))
            known = [n for n in (passed, cheat, unproven) if n is not None and n >= 0]
            total = sum(known)
            share = f" ({100 * unproven / total:.1f}%)" if unproven is not None and total > 0 and unproven > 0 else ""
            high = unproven is not None and total > 0 and unproven * 100 > MAX_UNPROVEN_PCT * total
            lines.append(
                (
                    Cell("verifier: ", "header"),
                    Cell(f"pass {_count(passed)}", "" if passed is not None else "na"),
                    Cell("  "),
                    (
                        Cell(f"cheat {cheat:,} {BAD}", "error")
                        if cheat
                        else Cell(f"cheat 0 {OK}", "ok")
                        if cheat == 0
                        else Cell(f"cheat {NA}", "na")
                    ),
                    Cell("  "),
                    Cell(
                        f"unproven {_count(unproven)}{share}{f' {WARN}' if high else ''}",
                        "warning" if high else ("" if unproven is not None else "na"),
                    ),
                )
            )
    if isinstance(audit, Mapping) and audit:
        dropped = [_int(audit.get(key)) for key in ("dropped_full", "dropped_expired", "dropped_unjudged")]
        known_dropped = [n for n in dropped if n is not None]
        if not known_dropped:
            tail = Cell(f" · dropped {NA}", "na")
        elif any(known_dropped):
            tail = Cell(f" · {sum(known_dropped):,} dropped unjudged {WARN}", "warning")
        else:
            tail = Cell(f" · none dropped {OK}", "ok")
        lines.append(
            (
                Cell("audit: ", "header"),
                Cell(
                    f"{_count(audit.get('waiting'))} waiting · {_count(audit.get('leased'))} leased · "
                    f"{_count(audit.get('recorded'))} judged"
                ),
                tail,
            )
        )
    if not lines:
        lines += [
            (Cell("no verifier or audit desk on this node:", "na"),),
            (Cell("the gateway's verifiers judge its proofs", "na"),),
        ]
    return lines


def chain_lines(chain: Any, hotkey: str | None) -> list[Line]:
    """`validator.chain.miner_lines` (uid, incentive, emission, validators weighting it), or
    why it cannot be read: the hotkey or the chain state unknown to this node."""
    if hotkey is None:
        return [(Cell(f"hotkey {NA}: this node does not publish the miner's hotkey", "na"),)]
    if not isinstance(chain, Mapping) or not chain:
        return [(Cell(f"chain state {NA}: only a local network's dev chain is published", "na"),)]
    lines = [tuple(line) for line in miner_lines(chain, hotkey)]
    if len(lines) == 1 and lines[0] and lines[0][0].style == "error":
        lines.append(
            (
                Cell("  → fix: ", "error"),
                Cell(f"register the hotkey on netuid {_count(chain.get('netuid'))} (btcli subnet register)"),
            )
        )
    return lines


# ---- the views ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MinerView:
    """Everything one miner's block shows."""

    name: str
    server_title: str
    server_level: Level
    command: Line
    plan: Line | None
    load: Line
    failure: tuple[Line, ...]
    log: tuple[Line, ...]
    link_title: str
    link_level: Level
    link: tuple[Line, ...]
    link_summary: Line
    """`link` and `proofs` on one line, for a compact block."""
    link_notes: tuple[Line, ...]
    proofs: tuple[Line, ...]
    """This miner's verdicts at a gateway on this node (empty when there is none)."""
    chain_title: str
    chain: tuple[Line, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PanelView:
    mode: Literal["empty", "full", "compact"]
    miners: tuple[MinerView, ...]
    proofs: tuple[Line, ...]
    """The node's own proof counts (verifier, audit queue)."""
    empty: Line


def _server_log(server_log: Any, miner: str, several: bool) -> tuple[Any, bool]:
    """This server's lines, and whether they are every server's: the supervisor logs under one
    component ("model_server") whichever miner it serves, so the app may only have those."""
    logs = _map(server_log)
    own = logs.get(server_component(miner))
    if isinstance(own, (list, tuple)):
        return own, False
    shared = logs.get("model_server")
    return (shared, several) if isinstance(shared, (list, tuple)) else ((), False)


def miner_view(
    name: str, states: Any, *, now: float, names: Any = None, server_log: Any = None, several: bool = False
) -> MinerView:
    """One miner's block for the hub's `states` at wall-clock `now`; `names` is node info's
    `hotkeys` {name: ss58}, `server_log` {component: [newest lines]}."""
    states = _map(states)
    miner = _map(states.get(name))
    server = _map(states.get(server_component(name)))
    hotkey = miner_hotkey(name, names, miner)
    traffic = states.get("traffic")
    has_traffic = isinstance(traffic, Mapping)
    worker = _worker(traffic, hotkey, _text(miner.get("model")))
    legs = _legs(states.get("gateway"), hotkey)
    url = _text(_map(states.get("network")).get("miner_ws"))

    failure = failure_lines(server)
    down = _text(server.get("state")) in _DOWN
    lines, shared = _server_log(server_log, name, several)
    link_level: Level = (
        "error"
        if legs_cell(miner).style == "error" or _text(_map(worker).get("state")) == "pulled"
        else "warning"
        if legs_cell(miner).style == "warning"
        else ""
    )
    window = gateway_proof_line(worker)
    proofs = ((Cell("gateway: ", "header"), *window),) if window is not None else ()
    short = short_hotkey(hotkey) if hotkey else NA
    return MinerView(
        name=name,
        server_title=server_title(miner, server),
        server_level=server_level(miner, server),
        command=command_line(miner, server),
        plan=plan_line(miner),
        load=load_line(server),
        failure=tuple(failure),
        log=tuple(log_lines(lines, shared=shared, limit=FAILED_LOG_LINES if down else LOG_LINES)),
        link_title=link_title(miner, worker, has_traffic=has_traffic, hotkey=hotkey, url=url),
        link_level=link_level,
        link=tuple(link_lines(miner, worker, legs, now=now, has_traffic=has_traffic)),
        link_summary=link_summary(miner, worker, legs, now=now, has_traffic=has_traffic, hotkey=hotkey),
        link_notes=tuple(link_notes(miner, worker, now=now)),
        proofs=proofs,
        chain_title=f"{name} ({short})" if hotkey else name,
        chain=tuple(chain_lines(states.get("chain"), hotkey)),
    )


def panel_view(states: Any, *, now: float, names: Any = None, server_log: Any = None) -> PanelView:
    """What the panel shows for the hub's states (None before the first snapshot) at wall-clock
    `now`. `names` defaults to the "node" state's `hotkeys` (a local network publishes them)."""
    states = _map(states)
    if names is None:
        names = _map(states.get("node")).get("hotkeys")
    miners = miner_names(states)
    proofs = tuple(node_proof_lines(states))
    if not miners:
        why = "waiting for the node's first snapshot" if not states else "no miner on this node"
        return PanelView("empty", (), proofs, (Cell(why, "na"),))
    several = len(miners) > 1
    views = tuple(
        miner_view(name, states, now=now, names=names, server_log=server_log, several=several) for name in miners
    )
    return PanelView("compact" if several else "full", views, proofs, ())


# ---- the widgets ----------------------------------------------------------------------------


def lines_content(lines: Iterable[Sequence[Cell]]) -> Content:
    # Content.assemble never parses markup: log lines, reasons and commands come from outside.
    return cells_content(lines, STYLES)


def _title(text: str) -> Content:
    return Content(text)  # not markup: a model name or URL with "[" must show as it is


def _frame(widget: Widget, level: str) -> None:
    for name in ("error", "warning", "na"):
        widget.set_class(level == name, f"-{name}")


def _show(static: Static, lines: Sequence[Sequence[Cell]]) -> None:
    static.update(lines_content(lines))
    static.display = bool(lines)


class _FullBlock(Vertical):
    """One miner, the full layout: model server | proofs, gateway link | chain."""

    def __init__(self, view: MinerView, proofs: tuple[Line, ...]) -> None:
        super().__init__(classes="miner-block")
        self._view, self._proofs = view, proofs
        self._composed = False

    def compose(self) -> ComposeResult:
        with Horizontal(classes="row"):
            with Vertical(classes="box main server"):
                yield Static(classes="cmd line")
                yield Static(classes="plan line")
                yield Static(classes="load line")
                yield Static(classes="failure")
                yield Static(classes="log line")
            yield Static(classes="box side proofs")
        with Horizontal(classes="row"):
            with Vertical(classes="box main link"):
                yield Static(classes="link-lines")
                yield Static(classes="link-notes")
            yield Static(classes="box side chain")

    def on_mount(self) -> None:
        self._composed = True
        self.show(self._view, self._proofs)

    def show(self, view: MinerView, proofs: tuple[Line, ...]) -> None:
        self._view, self._proofs = view, proofs
        if not self._composed:
            return  # on_mount shows it
        server = self.query_one(".server", Vertical)
        server.border_title = _title(f"Model server · {view.server_title}")
        _frame(server, view.server_level)
        _show(self.query_one(".cmd", Static), [view.command])
        _show(self.query_one(".plan", Static), [view.plan] if view.plan else [])
        _show(self.query_one(".load", Static), [view.load])
        _show(self.query_one(".failure", Static), view.failure)
        _show(self.query_one(".log", Static), view.log)
        side = (*view.proofs, *proofs)
        box = self.query_one(".proofs", Static)
        box.border_title = _title("Proofs")
        _show(box, side)
        box.display = True
        # The side box stretches to the main box (height 100%); the main box is at least as
        # tall as the side box's lines, so neither is cut and both frames line up.
        server.styles.min_height = len(side) + 2
        link = self.query_one(".link", Vertical)
        link.border_title = _title(f"Gateway link · {view.link_title}")
        _frame(link, view.link_level)
        _show(self.query_one(".link-lines", Static), view.link)
        _show(self.query_one(".link-notes", Static), view.link_notes)
        chain = self.query_one(".chain", Static)
        chain.border_title = _title(f"Chain · {view.chain_title}")
        _show(chain, view.chain)
        chain.display = True
        link.styles.min_height = len(view.chain) + 2


class _CompactBlock(Vertical):
    """One miner of several: one box, a line each for its command, load, link, chain and log,
    then what is wrong and its fix."""

    def __init__(self, view: MinerView) -> None:
        super().__init__(classes="box miner-compact")
        self._view = view
        self._composed = False

    def compose(self) -> ComposeResult:
        yield Static(classes="lines line")
        yield Static(classes="notes")

    def on_mount(self) -> None:
        self._composed = True
        self.show(self._view)

    def show(self, view: MinerView) -> None:
        self._view = view
        if not self._composed:
            return  # on_mount shows it
        self.border_title = _title(f"{view.name} · {view.server_title}")
        level = (
            "error"
            if "error" in (view.server_level, view.link_level)
            else ("warning" if "warning" in (view.server_level, view.link_level) else view.server_level)
        )
        _frame(self, level)
        chain: list[Cell] = [Cell("chain: ", "header")]
        for index, line in enumerate(view.chain):
            chain += [*([Cell(SEP)] if index and not line[0].text.startswith("  →") else []), *line]
        lines = [view.command, view.load, (Cell("gateway: ", "header"), *view.link_summary), tuple(chain), *view.log]
        _show(self.query_one(".lines", Static), lines)
        _show(self.query_one(".notes", Static), (*view.failure, *view.link_notes))


_BOX_CSS = """
        border: round $primary;
        border-title-color: $text-primary;
        border-title-style: bold;
        padding: 0 1;
        height: auto;
"""


class MinerPanel(Widget):
    """The miners of this node: call `update_state(states, now=..., names=..., server_log=...)`
    with each hub snapshot. One miner gets model server | proofs over gateway link | chain;
    several get a compact box each and the node's proofs once."""

    DEFAULT_CSS = f"""
    MinerPanel {{
        height: auto;
    }}
    MinerPanel .miner-block, MinerPanel #miner-blocks {{
        height: auto;
    }}
    MinerPanel .row {{
        height: auto;
    }}
    MinerPanel .box {{{_BOX_CSS}}}
    MinerPanel .main {{
        width: 3fr;
    }}
    MinerPanel .side {{
        width: 2fr;
        height: 100%;
    }}
    MinerPanel .line, MinerPanel .side, MinerPanel #miner-proofs {{
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }}
    MinerPanel .box.-warning {{
        border: round $warning;
    }}
    MinerPanel .box.-error {{
        border: round $error;
    }}
    MinerPanel .box.-na {{
        border: round $foreground-muted;
    }}
    MinerPanel #miner-empty {{
        color: $foreground-muted;
        padding: 0 1;
    }}
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._shown: PanelView | None = None
        self._layout: tuple[str, tuple[str, ...]] | None = None
        self._blocks: list[_FullBlock | _CompactBlock] = []

    def compose(self) -> ComposeResult:
        yield Static(id="miner-empty")
        yield Vertical(id="miner-blocks")
        yield Static(id="miner-proofs", classes="box")

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def update_state(
        self,
        states: Mapping[str, Any] | None,
        *,
        now: float,
        names: Mapping[str, str] | None = None,
        server_log: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Show the hub's states (None: no snapshot yet) as of wall-clock `now`; `names` is node
        info's `hotkeys` {name: ss58}; `server_log` the newest model-server log lines by
        component ("model_server", "model_server.miner-1", …) that the app kept."""
        view = panel_view(states, now=now, names=names, server_log=server_log)
        if view == self._shown:
            return
        self._shown = view
        empty = self.query_one("#miner-empty", Static)
        _show(empty, [view.empty] if view.empty else [])
        blocks = self.query_one("#miner-blocks", Vertical)
        layout = (view.mode, tuple(m.name for m in view.miners))
        if layout != self._layout:
            # Another miner, or one more: new blocks (each shows its view once mounted).
            self._layout = layout
            blocks.remove_children()
            if view.mode == "full":
                self._blocks = [_FullBlock(view.miners[0], view.proofs)]
            else:
                self._blocks = [_CompactBlock(miner) for miner in view.miners]
            if self._blocks:
                blocks.mount_all(self._blocks)
        else:
            for block, miner in zip(self._blocks, view.miners):
                if isinstance(block, _FullBlock):
                    block.show(miner, view.proofs)
                else:
                    block.show(miner)
        proofs = self.query_one("#miner-proofs", Static)
        proofs.border_title = _title("Proofs on this node")
        _show(proofs, view.proofs if view.mode == "compact" else [])
