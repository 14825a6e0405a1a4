"""The model server panel: state, model, load, throughput and latency of one sglang-style server.

The widget is fed a `ServerStatus` snapshot through its `status` reactive and renders in
`watch_status`; it never polls or reads the clock. What it shows is decided by the plain
functions below (`panel_values` and the formatters), which are tested without a terminal.
Missing facts show as a dash, never as 0: "the server did not say" and "nothing is running"
are different answers. Colours live in `app.tcss`, keyed on the state classes.
"""

from __future__ import annotations

from typing import Literal

from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label, Static

from engy_tui.bridge import LatencySummary, ServerStatus

__all__ = [
    "ROWS",
    "ServerPanel",
    "State",
    "format_count",
    "format_ms",
    "format_percent",
    "format_rate",
    "latency_line",
    "panel_values",
    "shorten_root",
    "state_of",
]

DASH = "—"

State = Literal["connecting", "healthy", "unhealthy", "unreachable"]
STATES: tuple[State, ...] = ("connecting", "healthy", "unhealthy", "unreachable")

# (widget id, label), top to bottom.
ROWS: tuple[tuple[str, str], ...] = (
    ("state", "state"),
    ("problem", "problem"),
    ("model", "model"),
    ("device", "device"),
    ("root", "model_root"),
    ("load", "requests"),
    ("throughput", "throughput"),
    ("totals", "totals"),
    ("ttft", "TTFT"),
    ("itl", "ITL"),
)


def format_ms(seconds: float | None) -> str:
    """Seconds as milliseconds, with about three significant digits: 0.42 ms, 12.3 ms, 1,234 ms."""
    if seconds is None:
        return DASH
    ms = seconds * 1000
    if ms < 10:
        return f"{ms:.2f} ms"
    if ms < 100:
        return f"{ms:.1f} ms"
    return f"{ms:,.0f} ms"


def format_percent(part: float | None, whole: float | None) -> str:
    """part/whole as a percentage with one decimal; a dash when either is unknown or whole is 0."""
    if part is None or not whole:
        return DASH
    return f"{100 * part / whole:.1f}%"


def shorten_root(root: str | None, *, head: int = 8, tail: int = 4) -> str:
    """A long digest as its first `head` and last `tail` characters: enough to compare by eye."""
    if not root:
        return DASH
    if len(root) <= head + tail + 1:
        return root
    return f"{root[:head]}…{root[-tail:]}"


def format_count(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


def format_rate(tokens_per_s: float | None) -> str:
    return DASH if tokens_per_s is None else f"{tokens_per_s:,.1f} tok/s"


def latency_line(summary: LatencySummary | None) -> str:
    """p50/p95/p99 and the count they cover, or a note that nothing has been measured yet."""
    if summary is None:
        return "no requests measured yet"
    return (
        f"p50 {format_ms(summary.p50_s)} · p95 {format_ms(summary.p95_s)} · "
        f"p99 {format_ms(summary.p99_s)}  (n={summary.count:,})"
    )


def state_of(status: ServerStatus | None) -> State:
    if status is None:
        return "connecting"
    if not status.reachable:
        return "unreachable"
    return "healthy" if status.healthy else "unhealthy"


def _model(status: ServerStatus) -> str:
    # Our catalog id says the most; real sglang only knows its served name and path.
    shown = status.model_id or status.served_model_name or status.model_path
    if shown is None:
        return DASH
    served = status.served_model_name
    return f"{shown} (served as {served})" if served and served != shown else shown


def panel_values(status: ServerStatus | None) -> dict[str, str]:
    """The text of every row in `ROWS` for this snapshot (None: no poll has finished yet)."""
    if status is None:
        return {row: DASH for row, _ in ROWS} | {"state": "connecting", "problem": "waiting for the first poll"}
    s = status
    return {
        "state": state_of(s),
        "problem": s.error or "none",
        "model": _model(s),
        "device": f"{s.device or DASH} · {s.dtype or DASH}",
        "root": shorten_root(s.model_root),
        "load": (
            f"{format_count(s.running)} running · {format_count(s.queued)} queued · "
            f"max {format_count(s.max_running_requests)} ({format_percent(s.running, s.max_running_requests)} busy)"
        ),
        "throughput": format_rate(s.gen_throughput),
        "totals": (
            f"{format_count(s.requests_total)} requests · {format_count(s.aborted_total)} aborted "
            f"({format_percent(s.aborted_total, s.requests_total)}) · "
            f"{format_count(s.generation_tokens_total)} tokens generated"
        ),
        "ttft": latency_line(s.ttft),
        "itl": latency_line(s.itl),
    }


class ServerPanel(Widget):
    """Key/value rows for one model server; assign `status` to update it."""

    status: reactive[ServerStatus | None] = reactive(None)

    def compose(self) -> ComposeResult:
        for row, label in ROWS:
            yield Label(label, classes="key")
            # Values come from the server (an error text may hold "[Errno 111]"): never markup.
            yield Static(id=row, classes="value", markup=False)

    def on_mount(self) -> None:
        self.border_title = "model server"

    def watch_status(self, status: ServerStatus | None) -> None:
        for row, text in panel_values(status).items():
            self.query_one(f"#{row}", Static).update(text)
        state = self.query_one("#state", Static)
        state.remove_class(*(f"-{name}" for name in STATES))
        state.add_class(f"-{state_of(status)}")
