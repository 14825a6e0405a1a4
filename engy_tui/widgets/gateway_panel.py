"""The gateway panel: the miners a gateway knows (eligibility, legs, load, evidence, breaker), its
audit queue and the latest epoch it published.

The widget is handed the hub's states (plain dicts, as the gateway publishes them) and the render
time through `update_state` by the app's fixed-rate timer; it never polls or reads the clock.
What every cell says and how it is styled is decided by the plain functions below, tested without
a terminal; the widget only turns their `Cell`s into Textual content.

Where each fact comes from (read the producers before changing a key):

* "traffic" (`gateway/trust/control_plane.py`): `workers`, one per (miner, model), each
  `TrafficState.to_json()` (miner, model, state, since, reason, eligible, first_party, connected,
  until, strikes, round{probes, ok, pass, unproven, cheat}, window{requests, failed, verdicts,
  unproven}) plus `history` (its last transitions: from, to, reason, at, code). Published only
  when a state or reason changes, so its counts can trail the live ones.
* "gateway" (`gateway/role.py`): state, buyer_url, miner_url, provider_url, models, worker,
  workers (processes), and `legs` (`MinerPool.snapshot()`: leg, miner, worker, model, capacity,
  inflight, heartbeat_age_s, and what the miner announced: region, tee (its GPU confidential
  computing mode, as told, not attested), context_length, kv_used; refreshed every 10 s).
* "audit" (`gateway/trust/trust_plane.py`): waiting, leased, dropped_full, dropped_expired,
  dropped_unjudged, recorded.
* "epochs" (`gateway/billing/publisher.py`): latest, digest, weights [[hotkey, u16], ...].

The hub does not carry per-worker latency percentiles, buyer keys or balances, the epoch in
flight or its gated rows, so the panel does not show them rather than guess.

Honesty rules: a fact the hub did not give is "n/a" or "—", dimmed, never 0; every input is
treated as untrusted JSON (a wrong type reads as missing, nothing raises); colour is never the
only signal (✔ ✘ ⚠ and state words carry the meaning). Hotkeys show by their local name when the
node info's `hotkeys` {name: ss58} knows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_tui.widgets.cells import (
    DASH,
    NA,
    Cell,
    cells_content,
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

__all__ = [
    "BREAKER_CODES",
    "COLUMNS",
    "HEARTBEAT_LATE_S",
    "MAX_NOTES",
    "MAX_WEIGHT_ROWS",
    "STYLES",
    "Cell",
    "GatewayPanel",
    "PanelView",
    "audit_line",
    "breaker_cell",
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
    "audited_cell",
    "short_key",
    "state_cell",
    "weight_bar",
    "worker_notes",
]

OK = "✔"
BAD = "✘"
WARN = "⚠"

COLUMNS = (
    "miner/worker",
    "model",
    "state",
    "in state",
    "breaker",
    "link",
    "load",
    "qualifying round",
    "served",
    "audited",
)
"""The miners table; "model" is left out while every row serves the same one."""
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


# ---- reading untrusted JSON ---------------------------------------------------------------------


def _count(value: Any) -> str | None:
    number = _int(value)
    return None if number is None else f"{number:,}"


# ---- formatting ---------------------------------------------------------------------------------


def format_age(seconds: Any) -> str | None:
    """A duration in words that fit a column: "4 s", "12 min", "3 h 2 min", "2 d 4 h"; None when
    it is not a finite number. A small negative (clocks a little apart) reads as 0 s."""
    value = _num(seconds)
    if value is None:
        return None
    s = int(max(0.0, value))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 2 * 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def short_key(key: Any, *, head: int = 4, tail: int = 4) -> str:
    """An ss58 hotkey as its first and last characters, "5F3s…k9Qa"; a key-admitted miner
    ("key:<id>") keeps its prefix, "key:a1b2c3…"."""
    text = _text(key)
    if text is None:
        return NA
    if text.startswith("key:"):
        rest = text[4:]
        return text if len(rest) <= 7 else f"key:{rest[:6]}…"
    return text if len(text) <= head + tail + 1 else f"{text[:head]}…{text[-tail:]}"


def display_names(names: Any) -> dict[str, str]:
    """Node info's `hotkeys` {name: ss58} turned round: ss58 -> name (the first name, in sorted
    order, when two share a key). Anything that is not a str -> str pair is ignored."""
    inverted: dict[str, str] = {}
    for name, key in sorted(((n, k) for n, k in _map(names).items() if _text(n) and _text(k))):
        inverted.setdefault(key, name)
    return inverted


def miner_label(miner: Any, names: Mapping[str, str]) -> str:
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


def state_cell(worker: Mapping[str, Any]) -> Cell:
    """The eligibility state as a word (with ✔/✘ for the two that decide traffic); a first-party
    worker says "own", since it is eligible whatever its state."""
    state = _text(worker.get("state"))
    if state is None:
        return NA_CELL
    text, style = _STATES.get(state, (state, ""))
    if worker.get("first_party") is True:
        text, style = f"{text} own", ("error" if state == "pulled" else "ok")
    return Cell(text, style)


def link_cell(worker: Mapping[str, Any], legs: Sequence[Mapping[str, Any]]) -> Cell:
    """The legs the gateway holds to this (miner, model), where the miner says it is and whether
    it says it serves in a TEE, and the oldest heartbeat among them; without legs, what the
    control plane last said about the connection."""
    if legs:
        text = f"{len(legs)} leg{'s' if len(legs) != 1 else ''}"
        told = sorted(
            {f"TEE {tee}" if tee != "on" else "TEE" for tee in (_text(leg.get("tee")) for leg in legs) if tee}
            | {region for region in (_text(leg.get("region")) for leg in legs) if region}
        )
        text = " · ".join([text, *told])
        ages = [age for age in (_num(leg.get("heartbeat_age_s")) for leg in legs) if age is not None]
        if not ages:
            return Cell(text)
        oldest = max(ages)
        if oldest > HEARTBEAT_LATE_S:
            return Cell(f"{text} · hb {format_age(oldest)} {WARN}", "warning")
        return Cell(f"{text} · hb {format_age(oldest)}")
    connected = worker.get("connected")
    if connected is True:
        return Cell("connected")
    if connected is False:
        # An active worker without a leg is on its reconnect grace: worth a look.
        return Cell(f"offline {WARN}", "warning") if worker.get("state") == "active" else Cell("offline", "na")
    return NA_CELL


def load_cell(legs: Sequence[Mapping[str, Any]]) -> Cell:
    """Requests in flight over the capacity the legs advertise, summed over the legs, and the
    fullest KV cache a leg reports: "12/32 · kv 71%" (the router sends nothing to a full one)."""
    if not legs:
        return DASH_CELL
    inflight = [_int(leg.get("inflight")) for leg in legs]
    capacity = [_int(leg.get("capacity")) for leg in legs]
    used = None if None in inflight else sum(i for i in inflight if i is not None)
    room = None if None in capacity else sum(c for c in capacity if c is not None)
    if used is None and room is None:
        return NA_CELL
    text = f"{NA if used is None else used}/{NA if room is None else room}"
    kv = [fraction for fraction in (_num(leg.get("kv_used")) for leg in legs) if fraction is not None]
    if kv:
        text += f" · kv {round(100 * max(kv))}%"
    if (used is not None and room is not None and used >= room) or (kv and max(kv) >= 1):
        return Cell(f"{text} full", "warning")
    return Cell(text)


def round_cell(worker: Mapping[str, Any]) -> Cell:
    """The current (or last) qualification round: how many of its probes finished well, their
    `pass` verdicts, and any `unproven` or `cheat` ones ("14/14 ok · 12 pass · 1 unproven"). A
    dash when no probe has finished."""
    rnd = _map(worker.get("round"))
    probes = _int(rnd.get("probes"))
    if not probes:
        return DASH_CELL if probes == 0 else NA_CELL
    ok = _int(rnd.get("ok"))
    parts = [f"{NA if ok is None else f'{ok:,}'}/{probes:,} ok", f"{_count(rnd.get('pass')) or NA} pass"]
    unproven, cheat = _int(rnd.get("unproven")), _int(rnd.get("cheat"))
    for label, value in (("unproven", unproven), ("cheat", cheat)):
        if value != 0:  # zero goes without saying; unknown does not
            parts.append(f"{NA if value is None else f'{value:,}'} {label}")
    text = " · ".join(parts)
    if cheat:
        return Cell(f"{text} {BAD}", "error")
    if ok is not None and ok < probes:
        return Cell(f"{text} {WARN}", "warning")
    return Cell(text)


def served_cell(worker: Mapping[str, Any]) -> Cell:
    """The breaker's window of served requests: "120, 2 failed"."""
    window = _map(worker.get("window"))
    requests, failed = _int(window.get("requests")), _int(window.get("failed"))
    if requests is None:
        return NA_CELL
    if failed is None:
        return Cell(f"{requests:,}, {NA} failed")
    return Cell(f"{requests:,}, {failed:,} failed", "warning" if failed else "")


def audited_cell(worker: Mapping[str, Any]) -> Cell:
    """The breaker's window of verdicts on served requests: "61, 2 unproven"."""
    window = _map(worker.get("window"))
    verdicts, unproven = _int(window.get("verdicts")), _int(window.get("unproven"))
    if verdicts is None:
        return NA_CELL
    if unproven is None:
        return Cell(f"{verdicts:,}, {NA} unproven")
    return Cell(f"{verdicts:,}, {unproven:,} unproven", "warning" if unproven else "")


def _history(worker: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [entry for entry in _list(worker.get("history")) if isinstance(entry, Mapping)]


def _last_pull(worker: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((entry for entry in reversed(_history(worker)) if entry.get("to") == "pulled"), None)


def _report(worker: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A first-party worker's latest transition when it is a breaker report (it would have been
    pulled), else None."""
    history = _history(worker)
    if worker.get("first_party") is not True or not history:
        return None
    last = history[-1]
    if last.get("from") == last.get("to") and last.get("code") in BREAKER_CODES:
        return last
    return None


def breaker_cell(worker: Mapping[str, Any], *, now: float) -> Cell:
    """ "closed ✔" while active; "open ✘ <why> · <cooldown> left" while pulled; "tripped ⚠ <why>"
    when a first-party worker would have been pulled; a dash while new or probing."""
    state = _text(worker.get("state"))
    if state == "pulled":
        pull = _last_pull(worker)
        text = f"open {BAD}"
        if pull is not None and _text(pull.get("code")):
            text += f" {pull['code']}"
        until = _num(worker.get("until"))
        if until is not None:
            text += f" · {format_age(until - now) or NA} left" if until > now else " · cooldown over"
        strikes = _int(worker.get("strikes"))
        if strikes is not None and strikes > 1:
            text += f" · strike {strikes:,}"
        return Cell(text, "error")
    report = _report(worker)
    if report is not None:
        at = _num(report.get("at"))
        ago = "" if at is None or format_age(now - at) is None else f" {format_age(now - at)} ago"
        return Cell(f"tripped {WARN} {report['code']}{ago}", "warning")
    if state == "active":
        return Cell(f"closed {OK}", "ok")
    if state in ("new", "probing"):
        return DASH_CELL
    return NA_CELL


_ORDER = {"pulled": 0, "probing": 1, "new": 2, "active": 3}


@dataclasses.dataclass(frozen=True, slots=True)
class _Row:
    miner: str | None
    model: str | None
    worker: Mapping[str, Any]
    legs: tuple[Mapping[str, Any], ...]


def _rows(states: Mapping[str, Any], names: Mapping[str, str]) -> list[_Row]:
    """Every (miner, model) the control plane or the pool knows, needing attention first."""
    workers: dict[tuple[str | None, str | None], Mapping[str, Any]] = {}
    for worker in _list(_map(states.get("traffic")).get("workers")):
        if isinstance(worker, Mapping):
            workers.setdefault((_text(worker.get("miner")), _text(worker.get("model"))), worker)
    legs: dict[tuple[str | None, str | None], list[Mapping[str, Any]]] = {}
    for leg in _list(_map(states.get("gateway")).get("legs")):
        if isinstance(leg, Mapping):
            legs.setdefault((_text(leg.get("miner")), _text(leg.get("model"))), []).append(leg)
    keys = list(workers) + [key for key in legs if key not in workers]
    rows = [
        _Row(miner, model, workers.get((miner, model), {}), tuple(legs.get((miner, model), ())))
        for miner, model in keys
    ]

    def order(row: _Row) -> tuple[int, str, str]:
        state = _text(row.worker.get("state")) or ""
        return _ORDER.get(state, 4), miner_label(row.miner, names), row.model or ""

    return sorted(rows, key=order)


def _worker_names(legs: Sequence[Mapping[str, Any]]) -> str:
    workers = sorted({name for name in (_text(leg.get("worker")) for leg in legs) if name})
    if not workers:
        return ""
    return workers[0] if len(workers) == 1 else f"{workers[0]} +{len(workers) - 1}"


def _who(row: _Row, names: Mapping[str, str]) -> str:
    label = miner_label(row.miner, names)
    workers = _worker_names(row.legs)
    return f"{label}/{workers}" if workers else label


def _for_cell(worker: Mapping[str, Any], now: float) -> Cell:
    since = _num(worker.get("since"))
    return NA_CELL if since is None else Cell(format_age(now - since) or NA)


def miner_rows(states: Mapping[str, Any], *, now: float, names: Mapping[str, str]) -> list[tuple[Cell, ...]]:
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
            audited_cell(row.worker),
        )
        for row in _rows(states, names)
    ]


def one_model(states: Mapping[str, Any]) -> bool:
    """Whether the gateway serves at most one model and every miner row is for it: then the
    gateway line names it once and the table and notes leave it out."""
    models = {row.model for row in _rows(states, {})}
    served = [m for m in _list(_map(states.get("gateway")).get("models")) if _text(m)]
    return len(models | set(served)) <= 1


def worker_notes(states: Mapping[str, Any], *, now: float, names: Mapping[str, str]) -> tuple[Cell, ...]:
    """Under the table, one line for each worker that needs a look, with the control plane's own
    reason: pulled (✘), a first-party worker that would have been pulled (⚠), an active worker
    without a leg (⚠), a late heartbeat (⚠). At most `MAX_NOTES`, then how many more."""
    notes: list[Cell] = []
    single = one_model(states)
    for row in _rows(states, names):
        who = _who(row, names) if single else f"{_who(row, names)} ({row.model or NA})"
        worker = row.worker
        state = worker.get("state")
        reason = _text(worker.get("reason"))
        # The control plane's reasons say what happened and what follows ("pulled: cheat verdict
        # on request …; qualifies again after 3600 s (strike 1)"), so they are shown as they are.
        if state == "pulled":
            notes.append(Cell(f"{BAD} {who}: {reason or 'pulled (no reason given)'}", "error"))
        report = _report(worker)
        if report is not None:
            notes.append(Cell(f"{WARN} {who}: {_text(report.get('reason')) or report['code']}", "warning"))
        if state == "active" and worker.get("connected") is False and not row.legs:
            notes.append(Cell(f"{WARN} {who} has no live leg: {reason or 'disconnected'}", "warning"))
        ages = [age for age in (_num(leg.get("heartbeat_age_s")) for leg in row.legs) if age is not None]
        if ages and max(ages) > HEARTBEAT_LATE_S:
            notes.append(
                Cell(
                    f"{WARN} {who}: no heartbeat for {format_age(max(ages))} (a miner beats every 30 s; "
                    "the gateway drops a leg after 90 s): check the miner's network",
                    "warning",
                )
            )
    if len(notes) > MAX_NOTES:
        return (*notes[: MAX_NOTES - 1], Cell(f"… and {len(notes) - MAX_NOTES + 1} more", "na"))
    return tuple(notes)


# ---- the lines around it ------------------------------------------------------------------------


def gateway_line(gateway: Mapping[str, Any]) -> tuple[Cell, ...]:
    """Where buyers, miners and validators reach this gateway, the models it serves and its
    processes."""
    parts = []
    for label, key in (("buyers", "buyer_url"), ("miners", "miner_url"), ("provider", "provider_url")):
        url = _text(gateway.get(key))
        if url:
            parts.append(f"{label} {url}")
    models = [m for m in _list(gateway.get("models")) if _text(m)]
    if models:
        parts.append(f"model{'s' if len(models) != 1 else ''} {', '.join(models)}")
    processes = _int(gateway.get("workers"))
    if processes is not None and processes > 1:
        parts.append(f"{processes} processes")
    return (Cell(" · ".join(parts)),) if parts else ()


def audit_line(audit: Any) -> tuple[Cell, ...]:
    """The audit queue: jobs waiting for a verifier, leased to one, verdicts recorded, and any
    dropped unjudged (⚠: those requests were never checked)."""
    if not isinstance(audit, Mapping) or not audit:
        return (Cell("audit  no counts published (no audit desk on this node, or not started yet)", "na"),)
    cells = [Cell("audit  ", "header")]
    parts = [
        f"{_count(audit.get(key)) or NA} {label}"
        for key, label in (("waiting", "waiting"), ("leased", "leased to verifiers"), ("recorded", "verdicts recorded"))
    ]
    cells.append(Cell(" · ".join(parts)))
    dropped = {
        label: _int(audit.get(key))
        for key, label in (
            ("dropped_full", "queue full"),
            ("dropped_expired", "expired"),
            ("dropped_unjudged", "never judged"),
        )
    }
    known = {label: n for label, n in dropped.items() if n is not None}
    if not known:
        cells.append(Cell(f" · dropped {NA}", "na"))
    elif any(known.values()):
        detail = ", ".join(f"{n:,} {label}" for label, n in known.items() if n)
        cells.append(Cell(f" · {WARN} dropped {sum(known.values()):,} unaudited ({detail})", "warning"))
    else:
        cells.append(Cell(f" · none dropped {OK}", "ok"))
    return tuple(cells)


def weight_bar(share: float, *, width: int = BAR_WIDTH) -> str:
    """`share` (0 to 1) as a bar of `width` cells in eighths: "████▍"."""
    value = _num(share)
    if value is None or value <= 0:
        return ""
    eighths = round(min(value, 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[part]


def epoch_lines(epochs: Any, *, names: Mapping[str, str]) -> tuple[tuple[Cell, ...], ...]:
    """The latest epoch this gateway published: its index and digest, then each hotkey's weight
    and share of the total, largest first (at most `MAX_WEIGHT_ROWS`)."""
    epochs = _map(epochs)
    latest = _int(epochs.get("latest"))
    if latest is None:
        return ((Cell("epochs  ", "header"), Cell("none published yet", "na")),)
    digest = _text(epochs.get("digest"))
    pairs = []
    for pair in _list(epochs.get("weights")):
        pair = _list(pair)
        if len(pair) == 2 and _text(pair[0]) and _int(pair[1]) is not None and pair[1] >= 0:
            pairs.append((pair[0], pair[1]))
    title = f"epoch {latest:,} published · digest {short_key(digest, head=8, tail=4) if digest else NA}"
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
            Cell(f"{weight:,}"),
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


def buyers_lines(buyers: Any) -> tuple[tuple[Cell, ...], ...]:
    """The buyer accounts that spent most, with what each has left and has in flight (USD);
    accounts and balances only, never a key."""
    buyers = _map(buyers)
    count = _int(buyers.get("accounts"))
    if count is None:
        return ()
    head = (Cell("buyers  ", "header"), Cell(f"{count:,} account{'s' if count != 1 else ''} · top by spend"))
    rows = [tuple(Cell(name, "header") for name in ("  account", "spent", "balance", "in flight"))]
    for account in _list(buyers.get("top")):
        account = _map(account)
        label = (
            f"  #{_int(account.get('account_id')) if _int(account.get('account_id')) is not None else NA} "
            f"{_text(account.get('name')) or ''}".rstrip()
        )
        rows.append(
            (
                Cell(label),
                Cell(_usd(account.get("charged"))),
                Cell(_usd(account.get("available"))),
                Cell(_usd(account.get("held"))),
            )
        )
    return (head, *(_pad(rows, right=(1, 2, 3)) if len(rows) > 1 else ()))


def _usd(micro: Any) -> str:
    value = _int(micro)
    return NA if value is None or value < 0 else f"${value / 1_000_000:,.4f}"


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


def panel_view(states: Any, *, now: float, names: Any = None) -> PanelView:
    """What the panel shows for the hub's states (component -> state; None before the first
    snapshot) at wall-clock time `now`; `names`: node info's `hotkeys` {name: ss58}."""
    states = _map(states)
    local = display_names(names)
    gateway = states.get("gateway")
    if not isinstance(gateway, Mapping):
        why = "waiting for the node's first snapshot" if not states else "no gateway on this node"
        return PanelView("Gateway", "absent", (Cell(why, "na"),), (), (), (), ())
    word = _text(gateway.get("state"))
    if word == "ready":
        state_text = f"{OK} ready"
    elif word == "stopped":
        state_text = f"{BAD} stopped"
    else:
        state_text = word or "state n/a"
    rows = miner_rows(states, now=now, names=local)
    published = _map(states.get("traffic")).get("workers")
    workers = [w for w in _list(published) if isinstance(w, Mapping)]
    summary = f"{len(rows):,} miner{'s' if len(rows) != 1 else ''}"
    if isinstance(published, (list, tuple)):
        eligible = sum(1 for worker in workers if worker.get("eligible") is True)
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
        table = _pad(table_rows)
    else:
        table = ()
        status = (*status, Cell("no miner has connected yet", "na"))
    if rows and not isinstance(published, (list, tuple)):
        status = (*status, Cell("eligibility not published (qualification off, or no change yet): states n/a", "na"))
    return PanelView(
        title=title,
        state=word or "unknown",
        status=status,
        table=table,
        notes=worker_notes(states, now=now, names=local),
        audit=audit_line(states.get("audit")),
        epoch=epoch_lines(states.get("epochs"), names=local),
        buyers=buyers_lines(states.get("buyers")),
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

    def compose(self) -> ComposeResult:
        for widget_id in ("status", "table", "notes", "audit", "epoch", "buyers"):
            yield Static(id=widget_id)

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def update_state(
        self, states: Mapping[str, Any] | None, *, now: float, names: Mapping[str, str] | None = None
    ) -> None:
        """Show the hub's states (None: no snapshot yet) as of wall-clock `now`; `names` is node
        info's `hotkeys` {name: ss58}, to show known hotkeys by name."""
        view = panel_view(states, now=now, names=names)
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
