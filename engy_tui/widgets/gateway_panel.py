"""The gateway panel: the miners a gateway knows (eligibility, legs, load, evidence, breaker), its
audit queue and the latest epoch it published.

The widget is handed the node's decoded states (`NodeStates`) and the render time through
`update_state` by the app's fixed-rate timer; it never polls or reads the clock. What every cell
says and how it is styled is decided by the plain functions below, tested without a terminal; the
widget only turns their `Cell`s into Textual content.

Where each fact comes from (`engy_node.snapshots` declares every field):

* `traffic` (`TrafficPolicyState`, `gateway/trust/control_plane.py`): one `TrafficStanding` per
  (miner, model): its state and why, its qualification `round`, the breaker's `window` (what it
  weighs now: served requests of the last `SERVED_WINDOW_S`, verdicts of the last
  `VERDICT_WINDOW_S`), its `lifetime` totals since the gateway started, and its `history`.
  The miners table shows the lifetime totals as "served" and "audited", and the window only in
  the breaker column, whose header names its lengths: a window is never shown as a total.
* `gateway` (`GatewayState`, `gateway/role.py`): its URLs, models, processes and `legs`
  (`MinerPool.snapshot()`, refreshed every 10 s: capacity, in flight, heartbeat, and what the
  miner announced — region, TEE mode, context, KV use).
* `audit` (`AuditState`, `gateway/trust/trust_plane.py`): the audit queue's counts.
* `epochs` (`EpochsState`, `gateway/billing/publisher.py`): the latest epoch and its weights.
* `buyers` (`BuyersState`): the accounts that spent most.

The hub does not carry per-worker latency percentiles, buyer keys, the epoch in flight or its
gated rows, so the panel does not show them rather than guess.

Honesty rules: a fact the hub did not give is "n/a" or "—", dimmed, never 0; text from the
network is shown as text (never markup, control characters blanked); colour is never the only
signal (✔ ✘ ⚠ and state words carry the meaning). Hotkeys show by their local name when the node
info's `hotkeys` {name: ss58} knows them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_node.money import format_usd
from engy_node.protocol.standing import SERVED_WINDOW_S, VERDICT_WINDOW_S
from engy_node.snapshots import (
    AuditState,
    BuyersState,
    EpochsState,
    GatewayLeg,
    GatewayState,
    NodeStates,
    StandingChange,
    TrafficStanding,
    gemm_audited,
)
from engy_tui.widgets.cells import DASH, NA, Cell, cells_content, fit_columns, format_duration, room
from engy_tui.widgets.cells import as_text as _text

__all__ = [
    "BREAKER_CODES",
    "BREAKER_HEADER",
    "COLUMNS",
    "HEARTBEAT_LATE_S",
    "MAX_NOTES",
    "MAX_WEIGHT_ROWS",
    "STYLES",
    "Cell",
    "GatewayPanel",
    "PanelView",
    "audit_line",
    "audited_cell",
    "breaker_cell",
    "buyers_lines",
    "display_names",
    "epoch_lines",
    "format_age",
    "gateway_line",
    "link_cell",
    "load_cell",
    "miner_label",
    "miner_rows",
    "one_model",
    "panel_view",
    "round_cell",
    "served_cell",
    "short_key",
    "state_cell",
    "weight_bar",
    "worker_notes",
]

OK = "✔"
BAD = "✘"
WARN = "⚠"


def format_age(seconds: float | None) -> str | None:
    """A duration in words that fit a column: "4 s", "12 min", "3 h 2 min", "2 d 4 h"; None when
    it is not a finite number. A small negative (clocks a little apart) reads as 0 s."""
    if seconds is None or not math.isfinite(seconds):
        return None
    return format_duration(seconds)


BREAKER_HEADER = f"breaker (last {format_age(SERVED_WINDOW_S)} / {format_age(VERDICT_WINDOW_S)})"
"""The breaker column's header: a closed breaker shows its windows (failed of the requests served
in the first, unproven of the verdicts in the second), as `protocol.standing` sets them."""

COLUMNS = (
    "miner/worker",
    "model",
    "state",
    "in state",
    BREAKER_HEADER,
    "link",
    "load",
    "qualifying round",
    "served",
    "audited",
)
"""The miners table; "model" is left out while every row serves the same one. "served" and
"audited" are totals since the gateway started."""
GAP = "  "

HEARTBEAT_LATE_S = 45.0
"""A miner beats every 30 s and the gateway republishes its legs every 10 s, so up to about 40 s
is normal; past 45 s one beat is late. The gateway drops a leg after 90 s."""
MAX_NOTES = 6
MAX_WEIGHT_ROWS = 8
BAR_WIDTH = 20

BREAKER_CODES = frozenset({"failures-in-a-row", "failure-rate", "slow-ttft", "slow-tpot", "unproven-rate", "cheat"})
"""`traffic_state.TransitionCode`s the breaker (or a cheat verdict) gives; a first-party worker gets them
as a report (`from == to`) where another worker would be pulled."""

STYLES: dict[str, str] = {
    "": "",
    "header": "bold $foreground-muted",
    "na": "$foreground-muted",
    "ok": "$text-success",
    "info": "$text-primary",
    "warning": "$text-warning",
    "error": "bold $text-error",
}
"""Cell style names -> Textual styles (theme variables, so every theme works)."""


NA_CELL = Cell(NA, "na")
DASH_CELL = Cell(DASH, "na")


# ---- names --------------------------------------------------------------------------------------


def short_key(key: str | None, *, head: int = 4, tail: int = 4) -> str:
    """An ss58 hotkey as its first and last characters, "5F3s…k9Qa"; a key-admitted miner
    ("key:<id>") keeps its prefix, "key:a1b2c3…"."""
    text = _text(key)
    if text is None:
        return NA
    if text.startswith("key:"):
        rest = text[4:]
        return text if len(rest) <= 7 else f"key:{rest[:6]}…"
    return text if len(text) <= head + tail + 1 else f"{text[:head]}…{text[-tail:]}"


def display_names(names: Mapping[str, str] | None) -> dict[str, str]:
    """Node info's `hotkeys` {name: ss58} turned round: ss58 -> name (the first name, in sorted
    order, when two share a key). Empty names and keys are ignored."""
    inverted: dict[str, str] = {}
    for name, key in sorted((names or {}).items()):
        if _text(name) and _text(key):
            inverted.setdefault(key, name)
    return inverted


def miner_label(miner: str | None, names: Mapping[str, str]) -> str:
    """The miner's local name if the node knows its hotkey, else its shortened hotkey."""
    text = _text(miner)
    if text is None:
        return NA
    return names.get(text) or short_key(text)


# ---- the miners table ---------------------------------------------------------------------------

_STATES = {
    "active": ("active " + OK, "ok"),
    "probing": ("probing", "info"),
    "new": ("new", "na"),
    "pulled": ("pulled " + BAD, "error"),
}


def state_cell(worker: TrafficStanding | None) -> Cell:
    """The eligibility state as a word (with ✔/✘ for the two that decide traffic); a first-party
    worker says "own", since it is eligible whatever its state."""
    state = None if worker is None else _text(worker.state)
    if worker is None or state is None:
        return NA_CELL
    text, style = _STATES.get(state, (state, ""))
    if worker.first_party:
        text, style = f"{text} own", ("error" if state == "pulled" else "ok")
    return Cell(text, style)


def _oldest_heartbeat(legs: Sequence[GatewayLeg]) -> float | None:
    ages = [
        leg.heartbeat_age_s for leg in legs if leg.heartbeat_age_s is not None and math.isfinite(leg.heartbeat_age_s)
    ]
    return max(ages) if ages else None


def link_cell(worker: TrafficStanding | None, legs: Sequence[GatewayLeg]) -> Cell:
    """The legs the gateway holds to this (miner, model), where the miner says it is and whether
    it says it serves in a TEE, and the oldest heartbeat among them; without legs, what the
    control plane last said about the connection."""
    if legs:
        told = sorted(
            {f"TEE {leg.tee}" if leg.tee != "on" else "TEE" for leg in legs if leg.tee}
            | {leg.region for leg in legs if leg.region}
        )
        text = " · ".join([f"{len(legs)} leg{'s' if len(legs) != 1 else ''}", *told])
        oldest = _oldest_heartbeat(legs)
        if oldest is None:
            return Cell(text)
        if oldest > HEARTBEAT_LATE_S:
            return Cell(f"{text} · hb {format_age(oldest)} {WARN}", "warning")
        return Cell(f"{text} · hb {format_age(oldest)}")
    if worker is None:
        return NA_CELL
    if worker.connected:
        return Cell("connected")
    # An active worker without a leg is on its reconnect grace: worth a look.
    return Cell(f"offline {WARN}", "warning") if worker.state == "active" else Cell("offline", "na")


def load_cell(legs: Sequence[GatewayLeg]) -> Cell:
    """Requests in flight over the capacity the legs advertise, summed over the legs, and the
    fullest KV cache a leg reports: "12/32 · kv 71%" (the router sends nothing to a full one)."""
    if not legs:
        return DASH_CELL
    used = sum(leg.inflight for leg in legs)
    room = sum(leg.capacity for leg in legs)
    text = f"{used:,}/{room:,}"
    # A fraction; one out of [0, 1] is read as the nearest bound (a full cache is the one that matters).
    kv = [min(max(leg.kv_used, 0.0), 1.0) for leg in legs if leg.kv_used is not None and math.isfinite(leg.kv_used)]
    if kv:
        text += f" · kv {round(100 * max(kv))}%"
    if used >= room or (kv and max(kv) >= 1):
        return Cell(f"{text} full", "warning")
    return Cell(text)


def round_cell(worker: TrafficStanding | None) -> Cell:
    """The current (or last) qualification round: how many of its probes finished well, their
    `pass` verdicts, and any `unproven` or `cheat` ones ("14/14 ok · 12 pass · 1 unproven"). A
    dash when no probe has finished."""
    if worker is None:
        return NA_CELL
    rnd = worker.round
    if rnd.probes <= 0:
        return DASH_CELL
    parts = [f"{rnd.ok:,}/{rnd.probes:,} ok", f"{rnd.passed:,} pass"]
    for label, value in (("unproven", rnd.unproven), ("cheat", rnd.cheat)):
        if value:  # zero goes without saying
            parts.append(f"{value:,} {label}")
    text = " · ".join(parts)
    if rnd.cheat:
        return Cell(f"{text} {BAD}", "error")
    if rnd.ok < rnd.probes:
        return Cell(f"{text} {WARN}", "warning")
    return Cell(text)


def served_cell(worker: TrafficStanding | None) -> Cell:
    """Requests served (paid and probes) since the gateway started, and how many failed:
    "1,204 · 2 failed" (the breaker's window is in the breaker column)."""
    if worker is None or worker.lifetime is None:
        return NA_CELL
    lifetime = worker.lifetime
    if lifetime.failed:
        return Cell(f"{lifetime.served:,} · {lifetime.failed:,} failed")
    return Cell(f"{lifetime.served:,}")


TOPLOC_ALONE = "TOPLOC alone"
"""What the audited column adds for a miner whose legs all announce no GEMM audits: only TOPLOC
judges it, and TOPLOC passes weights with small perturbations (docs/verification.md)."""


def audited_cell(worker: TrafficStanding | None, legs: Sequence[GatewayLeg] = ()) -> Cell:
    """Verdicts on its answers (paid and probes) since the gateway started, with the `unproven`
    and `cheat` ones and how many the GEMM audit gave: "44 · 2 unproven · 12 GEMM" (the
    breaker's window is in the breaker column); "· TOPLOC alone ⚠" when its legs announce no GEMM
    audits."""
    alone = gemm_audited(leg.gemm_audit for leg in legs) is False
    if worker is None or worker.lifetime is None:
        return Cell(f"{NA} · {TOPLOC_ALONE} {WARN}", "warning") if alone else NA_CELL
    lifetime = worker.lifetime
    parts = [f"{lifetime.audited:,}"]
    for label, value in (("unproven", lifetime.unproven), ("cheat", lifetime.cheat)):
        if value:
            parts.append(f"{value:,} {label}")
    if lifetime.proofs.gemm.total:
        parts.append(f"{lifetime.proofs.gemm.total:,} GEMM")
    if alone:
        parts.append(f"{TOPLOC_ALONE} {WARN}")
    if lifetime.cheat:
        return Cell(f"{' · '.join(parts)} {BAD}", "error")
    return Cell(" · ".join(parts), "warning" if alone else "")


def _last_pull(worker: TrafficStanding) -> StandingChange | None:
    return next((entry for entry in reversed(worker.history) if entry.to_state == "pulled"), None)


def _report(worker: TrafficStanding | None) -> StandingChange | None:
    """A first-party worker's latest transition when it is a breaker report (it would have been
    pulled), else None."""
    if worker is None or not worker.first_party or not worker.history:
        return None
    last = worker.history[-1]
    if last.from_state == last.to_state and last.code in BREAKER_CODES:
        return last
    return None


def breaker_cell(worker: TrafficStanding | None, *, now: float) -> Cell:
    """ "closed ✔" while active, with its windows (`BREAKER_HEADER`): "closed ✔ · 0/5 failed ·
    1/12 unproven"; "open ✘ <why> · <cooldown> left" while pulled; "tripped ⚠ <why>" when a
    first-party worker would have been pulled; a dash while new or probing."""
    if worker is None:
        return NA_CELL
    state = _text(worker.state)
    if state == "pulled":
        pull = _last_pull(worker)
        text = f"open {BAD}"
        if pull is not None and _text(pull.code):
            text += f" {pull.code}"
        until = worker.until
        if until is not None and math.isfinite(until):
            text += f" · {format_age(until - now) or NA} left" if until > now else " · cooldown over"
        if worker.strikes > 1:
            text += f" · strike {worker.strikes:,}"
        return Cell(text, "error")
    report = _report(worker)
    if report is not None:
        age = None if report.at is None else format_age(now - report.at)
        return Cell(f"tripped {WARN} {report.code}{f' {age} ago' if age else ''}", "warning")
    if state == "active":
        window = worker.window
        text = f"closed {OK} · {window.failed:,}/{window.requests:,} failed · {window.unproven:,}/{window.verdicts:,} unproven"
        return Cell(text, "warning" if window.failed or window.unproven else "ok")
    if state in ("new", "probing"):
        return DASH_CELL
    return NA_CELL


_ORDER = {"pulled": 0, "probing": 1, "new": 2, "active": 3}


@dataclasses.dataclass(frozen=True, slots=True)
class _Row:
    miner: str | None
    model: str | None
    worker: TrafficStanding | None
    """None when only the pool knows this (miner, model): eligibility not published."""
    legs: tuple[GatewayLeg, ...]


def _rows(states: NodeStates, names: Mapping[str, str]) -> list[_Row]:
    """Every (miner, model) the control plane or the pool knows, needing attention first."""
    workers: dict[tuple[str | None, str | None], TrafficStanding] = {}
    for worker in states.traffic.workers if states.traffic is not None else ():
        workers.setdefault((_text(worker.miner), _text(worker.model)), worker)
    legs: dict[tuple[str | None, str | None], list[GatewayLeg]] = {}
    for leg in states.gateway.legs if states.gateway is not None else ():
        legs.setdefault((_text(leg.miner), _text(leg.model)), []).append(leg)
    keys = list(workers) + [key for key in legs if key not in workers]
    rows = [
        _Row(miner, model, workers.get((miner, model)), tuple(legs.get((miner, model), ()))) for miner, model in keys
    ]

    def order(row: _Row) -> tuple[int, str, str]:
        state = (_text(row.worker.state) if row.worker is not None else None) or ""
        return _ORDER.get(state, 4), miner_label(row.miner, names), row.model or ""

    return sorted(rows, key=order)


def _worker_names(legs: Sequence[GatewayLeg]) -> str:
    workers = sorted({name for name in (_text(leg.worker) for leg in legs) if name})
    if not workers:
        return ""
    return workers[0] if len(workers) == 1 else f"{workers[0]} +{len(workers) - 1}"


def _who(row: _Row, names: Mapping[str, str]) -> str:
    label = miner_label(row.miner, names)
    workers = _worker_names(row.legs)
    return f"{label}/{workers}" if workers else label


def _for_cell(worker: TrafficStanding | None, now: float) -> Cell:
    since = None if worker is None or worker.since is None else format_age(now - worker.since)
    return NA_CELL if since is None else Cell(since)


def miner_rows(states: NodeStates, *, now: float, names: Mapping[str, str]) -> list[tuple[Cell, ...]]:
    """One row per (miner, model), in `COLUMNS` order, pulled ones first."""
    return [
        (
            Cell(_who(row, names)),
            Cell(row.model) if row.model else NA_CELL,
            state_cell(row.worker),
            _for_cell(row.worker, now),
            breaker_cell(row.worker, now=now),
            link_cell(row.worker, row.legs),
            load_cell(row.legs),
            round_cell(row.worker),
            served_cell(row.worker),
            audited_cell(row.worker, row.legs),
        )
        for row in _rows(states, names)
    ]


def one_model(states: NodeStates) -> bool:
    """Whether the gateway serves at most one model and every miner row is for it: then the
    gateway line names it once and the table and notes leave it out."""
    models = {row.model for row in _rows(states, {})}
    served = {m for m in states.gateway.models if _text(m)} if states.gateway is not None else set()
    return len(models | served) <= 1


def worker_notes(states: NodeStates, *, now: float, names: Mapping[str, str]) -> tuple[Cell, ...]:
    """Under the table, one line for each worker that needs a look, with the control plane's own
    reason: pulled (✘), a first-party worker that would have been pulled (⚠), an active worker
    without a leg (⚠), a late heartbeat (⚠). At most `MAX_NOTES`, then how many more."""
    notes: list[Cell] = []
    single = one_model(states)
    for row in _rows(states, names):
        who = _who(row, names) if single else f"{_who(row, names)} ({row.model or NA})"
        worker = row.worker
        if worker is not None:
            reason = _text(worker.reason)
            # The control plane's reasons say what happened and what follows ("pulled: cheat
            # verdict on request …; qualifies again after 3600 s (strike 1)"), shown as they are.
            if worker.state == "pulled":
                notes.append(Cell(f"{BAD} {who}: {reason or 'pulled (no reason given)'}", "error"))
            report = _report(worker)
            if report is not None:
                notes.append(Cell(f"{WARN} {who}: {_text(report.reason) or report.code}", "warning"))
            if worker.state == "active" and not worker.connected and not row.legs:
                notes.append(Cell(f"{WARN} {who} has no live leg: {reason or 'disconnected'}", "warning"))
        oldest = _oldest_heartbeat(row.legs)
        if oldest is not None and oldest > HEARTBEAT_LATE_S:
            notes.append(
                Cell(
                    f"{WARN} {who}: no heartbeat for {format_age(oldest)} (a miner beats every 30 s; "
                    "the gateway drops a leg after 90 s): check the miner's network",
                    "warning",
                )
            )
    if len(notes) > MAX_NOTES:
        return (*notes[: MAX_NOTES - 1], Cell(f"… and {len(notes) - MAX_NOTES + 1} more", "na"))
    return tuple(notes)


# ---- the lines around it ------------------------------------------------------------------------


def gateway_line(gateway: GatewayState) -> tuple[Cell, ...]:
    """Where buyers, miners and validators reach this gateway, the models it serves and its
    processes."""
    parts = []
    for label, url in (
        ("buyers", gateway.buyer_url),
        ("miners", gateway.miner_url),
        ("provider", gateway.provider_url),
    ):
        if _text(url):
            parts.append(f"{label} {_text(url)}")
    models = [m for m in (_text(m) for m in gateway.models) if m]
    if models:
        parts.append(f"model{'s' if len(models) != 1 else ''} {', '.join(models)}")
    if gateway.workers is not None and gateway.workers > 1:
        parts.append(f"{gateway.workers} processes")
    return (Cell(" · ".join(parts)),) if parts else ()


def audit_line(audit: AuditState | None) -> tuple[Cell, ...]:
    """The audit queue: jobs waiting for a verifier, leased to one, verdicts recorded, and any
    dropped unjudged (⚠: those requests were never checked)."""
    if audit is None:
        return (Cell("audit  no counts published (no audit desk on this node, or not started yet)", "na"),)
    parts = [
        f"{audit.waiting:,} waiting",
        f"{audit.leased:,} leased to verifiers",
        f"{audit.recorded:,} verdicts recorded",
    ]
    cells = [Cell("audit  ", "header"), Cell(" · ".join(parts))]
    dropped = {
        "queue full": audit.dropped_full,
        "expired": audit.dropped_expired,
        "never judged": audit.dropped_unjudged,
    }
    if any(dropped.values()):
        detail = ", ".join(f"{n:,} {label}" for label, n in dropped.items() if n)
        cells.append(Cell(f" · {WARN} dropped {sum(dropped.values()):,} unaudited ({detail})", "warning"))
    else:
        cells.append(Cell(f" · none dropped {OK}", "ok"))
    return tuple(cells)


def weight_bar(share: float | None, *, width: int = BAR_WIDTH) -> str:
    """`share` (0 to 1) as a bar of `width` cells in eighths: "████▍"."""
    if share is None or not math.isfinite(share) or share <= 0:
        return ""
    eighths = round(min(share, 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[part]


def epoch_lines(epochs: EpochsState | None, *, names: Mapping[str, str]) -> tuple[tuple[Cell, ...], ...]:
    """The latest epoch this gateway published: its index and digest, then each hotkey's weight
    and share of the total, largest first (at most `MAX_WEIGHT_ROWS`)."""
    if epochs is None or epochs.latest is None:
        return ((Cell("epochs  ", "header"), Cell("none published yet", "na")),)
    digest = _text(epochs.digest)
    # Weights are u16 (`EpochSettlement.weights`); a negative one is junk.
    pairs = [(hotkey, weight) for hotkey, weight in epochs.weights if hotkey and weight >= 0]
    title = f"epoch {epochs.latest:,} published · digest {short_key(digest, head=8, tail=4) if digest else NA}"
    head = (
        Cell("epochs  ", "header"),
        Cell(f"{title} · {len(pairs):,} hotkey{'s' if len(pairs) != 1 else ''} weighted"),
    )
    if not pairs:
        return (head,)
    total = sum(weight for _, weight in pairs)
    pairs.sort(key=lambda pair: (-pair[1], pair[0]))
    rows = [
        (
            Cell(names.get(hotkey, "")),
            Cell(short_key(hotkey)),
            Cell(f"{weight:,.0f}"),
            Cell(f"{100 * weight / total:.1f}%" if total else NA, "" if total else "na"),
            Cell(weight_bar(weight / total) if total else "", "info"),
        )
        for hotkey, weight in pairs[:MAX_WEIGHT_ROWS]
    ]
    table = _pad(
        [
            (
                Cell("name", "header"),
                Cell("hotkey", "header"),
                Cell("weight", "header"),
                Cell("share", "header"),
                Cell("", "header"),
            )
        ]
        + rows,
        right=(2, 3),
    )
    lines: list[tuple[Cell, ...]] = [head, *((Cell("  "), *row) for row in table)]
    rest = pairs[MAX_WEIGHT_ROWS:]
    if rest:
        share = f" ({100 * sum(w for _, w in rest) / total:.1f}%)" if total else ""
        lines.append((Cell(f"  … and {len(rest):,} more{share}", "na"),))
    return tuple(lines)


# ---- the whole panel ----------------------------------------------------------------------------


def buyers_lines(buyers: BuyersState | None) -> tuple[tuple[Cell, ...], ...]:
    """The buyer accounts that spent most, with what each has left and has in flight (USD);
    accounts and balances only, never a key."""
    if buyers is None:
        return ()
    count = buyers.accounts
    head = (
        Cell("buyers  ", "header"),
        Cell(f"{count:,} account{'s' if count != 1 else ''} · top by spend (the ledger's, all time)"),
    )
    rows = [tuple(Cell(name, "header") for name in ("  account", "spent", "balance", "in flight"))]
    for account in buyers.top:
        label = f"  #{NA if account.account_id is None else account.account_id} {_text(account.name) or ''}".rstrip()
        rows.append((Cell(label), Cell(_usd(account.charged)), Cell(_usd(account.available)), Cell(_usd(account.held))))
    return (head, *(_pad(rows, right=(1, 2, 3)) if len(rows) > 1 else ()))


def _usd(micro: int) -> str:
    """Exact dollars (`format_usd`): a buyer's $0.000150 is never shown as $0.0000. Negative
    means the snapshot lacked the figure."""
    return NA if micro < 0 else format_usd(micro)


@dataclasses.dataclass(frozen=True, slots=True)
class PanelView:
    """Everything the panel shows for one set of states at one time."""

    title: str
    state: str
    """The gateway's state word ("ready", "stopped"), "absent" when the node runs no gateway, or
    "unknown"."""
    status: tuple[Cell, ...]
    """The line above the table: where the gateway listens, or why there is nothing to show."""
    table: tuple[tuple[Cell, ...], ...]
    """Header and one row per (miner, model), padded to the columns; empty with no miner."""
    notes: tuple[Cell, ...]
    audit: tuple[Cell, ...]
    epoch: tuple[tuple[Cell, ...], ...]
    buyers: tuple[tuple[Cell, ...], ...] = ()


NARROW_DROPS = ("load", "qualifying round", "in state", "link")
"""The miners table's columns a narrow terminal leaves out, first to last: what a row's state,
breaker and the notes below already tell. Who, state, breaker, served and audited stay whole."""


def panel_view(
    states: NodeStates | None, *, now: float, names: Mapping[str, str] | None = None, width: int | None = None
) -> PanelView:
    """What the panel shows for the node's states (None before the first snapshot) at wall-clock
    time `now`; `names`: node info's `hotkeys` {name: ss58}; `width`: the cells a line has (the
    miners table leaves out `NARROW_DROPS` until it fits), None for every column."""
    local = display_names(names)
    gateway = None if states is None else states.gateway
    if states is None or gateway is None:
        why = "waiting for the node's first snapshot" if states is None else "no gateway on this node"
        return PanelView("Gateway", "absent", (Cell(why, "na"),), (), (), (), ())
    word = _text(gateway.state)
    if word == "ready":
        state_text = f"{OK} ready"
    elif word == "stopped":
        state_text = f"{BAD} stopped"
    else:
        state_text = word or "state n/a"
    rows = miner_rows(states, now=now, names=local)
    summary = f"{len(rows):,} miner{'s' if len(rows) != 1 else ''}"
    if states.traffic is not None:
        eligible = sum(1 for worker in states.traffic.workers if worker.eligible)
        summary += f", {eligible:,} eligible"
    title = f"Gateway {state_text} · {summary}"
    status = gateway_line(gateway)
    if word == "stopped":
        status = (Cell(f"{BAD} the gateway has stopped: buyers and miners cannot reach it", "error"), *status)
    if rows:
        table_rows = [tuple(Cell(name, "header") for name in COLUMNS), *rows]
        if one_model(states):
            model = COLUMNS.index("model")
            table_rows = [row[:model] + row[model + 1 :] for row in table_rows]
        table = _pad(fit_columns(table_rows, width, drop=NARROW_DROPS))
    else:
        table = ()
        status = (*status, Cell("no miner has connected yet", "na"))
    if rows and states.traffic is None:
        status = (*status, Cell("eligibility not published (qualification off, or no change yet): states n/a", "na"))
    return PanelView(
        title=title,
        state=word or "unknown",
        status=status,
        table=table,
        notes=worker_notes(states, now=now, names=local),
        audit=audit_line(states.audit),
        epoch=epoch_lines(states.epochs, names=local),
        buyers=buyers_lines(states.buyers),
    )


def _pad(rows: Sequence[tuple[Cell, ...]], *, right: Iterable[int] = ()) -> tuple[tuple[Cell, ...], ...]:
    """Pad every cell to its column's widest text plus the gap (none after the last column);
    columns in `right` are right-aligned (numbers)."""
    columns = max(len(row) for row in rows)
    widths = [max(cell_len(row[c].text) for row in rows if c < len(row)) for c in range(columns)]
    right = set(right)
    last = columns - 1

    def fit(cell: Cell, column: int) -> Cell:
        if column == last and column not in right:
            return cell
        room = " " * (widths[column] - cell_len(cell.text))
        text = room + cell.text if column in right else cell.text + room
        return cell._replace(text=text if column == last else text + GAP)

    return tuple(tuple(fit(cell, column) for column, cell in enumerate(row)) for row in rows)


def _content(lines: Iterable[Sequence[Cell]]) -> Content:
    # Content.assemble never parses markup: reasons and URLs come from the network.
    return cells_content(lines, STYLES)


class GatewayPanel(Widget):
    """The gateway's miners, audit queue and latest epoch; call `update_state(states, now=...,
    names=...)` with each new hub snapshot."""

    DEFAULT_CSS = """
    GatewayPanel {
        height: auto;
        padding: 0 1;
        border: round $primary;
        border-title-color: $text-primary;
        border-title-style: bold;
    }
    GatewayPanel.-stopped {
        border: round $error;
    }
    GatewayPanel.-absent {
        border: round $foreground-muted;
    }
    GatewayPanel > #table {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    GatewayPanel > #audit {
        margin-top: 1;
    }
    GatewayPanel > #buyers {
        margin-top: 1;
        text-wrap: nowrap;
    }
    GatewayPanel > #epoch {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    _shown: tuple[NodeStates | None, float, Mapping[str, str] | None] = (None, 0.0, None)
    """What `update_state` was last given, to lay out again for a new width."""

    def compose(self) -> ComposeResult:
        for widget_id in ("status", "table", "notes", "audit", "epoch", "buyers"):
            yield Static(id=widget_id)

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def on_resize(self) -> None:
        # Another width: the miners table keeps or leaves out its narrow-terminal columns.
        states, now, names = self._shown
        self.update_state(states, now=now, names=names)

    def update_state(self, states: NodeStates | None, *, now: float, names: Mapping[str, str] | None = None) -> None:
        """Show the node's states (None: no snapshot yet) as of wall-clock `now`; `names` is node
        info's `hotkeys` {name: ss58}, to show known hotkeys by name."""
        self._shown = (states, now, names)
        view = panel_view(states, now=now, names=names, width=room(self))
        self.border_title = view.title
        self.set_class(view.state == "stopped", "-stopped")
        self.set_class(view.state == "absent", "-absent")
        for widget_id, lines in (
            ("status", [(c,) for c in view.status]),
            ("table", view.table),
            ("notes", [(c,) for c in view.notes]),
            ("audit", [view.audit] if view.audit else []),
            ("epoch", view.epoch),
            ("buyers", view.buyers),
        ):
            static = self.query_one(f"#{widget_id}", Static)
            static.update(_content(lines))
            static.display = bool(lines)
