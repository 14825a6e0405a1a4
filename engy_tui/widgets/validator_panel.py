"""The validator's dashboard (weights on chain, next action, warnings, submissions) and the chain
panel (every neuron of the subnet and the weights each validator has on chain).

Both widgets are handed plain dicts — the hub's "validator" state (`engy_node.validator.light`
and `role`), the "chain" state (`engy_node.local.up._chain_snapshot`) and the node's
`hotkeys` {name: ss58} — with the render time, through `update_state`, by the app's fixed-rate
render timer; they never poll or read the clock. What every line says and how it is styled is
decided by the plain functions below, tested without a terminal; the widgets only turn their
`Cell`s into Textual content, and skip the repaint when nothing changed.

Honesty rules:

* Anything the node did not report (a missing key, None, a value of the wrong type) is "n/a",
  dimmed; never a 0, and no function here raises on a malformed document.
* Colour is never the only signal: ✔ ✘ ⚠ and words say it, and every warning names its fix.
* When the chain state is at hand (a local network's dev chain) its head block is used for
  "blocks ago" and the resubmit countdown, since it is published every second; otherwise the
  validator's last chain read is used, moved on by the wall clock since its last tick and
  marked "~" as an estimate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_node.config import ValidatorSection
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
    "BAR_WIDTH",
    "DEFAULT_POLL_S",
    "NEURON_COLUMNS",
    "STYLES",
    "Cell",
    "ChainPanel",
    "ChainPanelView",
    "Finding",
    "ValidatorPanel",
    "ValidatorView",
    "chain_summary_line",
    "chain_view",
    "chain_weight_lines",
    "format_age",
    "lines_content",
    "format_duration",
    "miner_lines",
    "neuron_rows",
    "next_action_lines",
    "refusal_fix",
    "share_bar",
    "short_hotkey",
    "submission_lines",
    "validator_view",
    "validator_warnings",
    "warning_lines",
    "weights_lines",
    "weights_rows",
]

OK = "✔"
WARN = "⚠"
ERROR = "✘"

BAR_WIDTH = 20
"""Cells of a 100% share bar; eighth blocks make the bar exact to 1/160."""

DEFAULT_POLL_S = 300.0
"""`validator.poll_s`'s default: the validator state does not publish its poll interval, so a
tick counts as old after three of these unless the caller or the state says otherwise."""

MAX_WEIGHT_ROWS = 12
MAX_SUBMISSIONS = 8
MAX_TARGETS = 8
"""Rows shown per table before the rest is summed up in one line."""

# The activity cutoff warns once more than half of it has passed since the chain last saw this
# validator (a healthy one resubmits every ~2% of it), and is an error once it has passed.

STYLES: dict[str, str] = {
    "": "",
    "header": "bold $text-muted",
    "na": "$text-muted",
    "ok": "$text-success",
    "warning": "$text-warning",
    "error": "bold $text-error",
    "bar": "$text-accent",
}
"""Cell style names -> Textual styles (theme variables, so every theme works)."""


Line = tuple[Cell, ...]
NA_CELL = Cell(NA, "na")


class Finding(NamedTuple):
    """One warning: what is wrong, and what to do about it."""

    level: Literal["warning", "error"]
    text: str
    fix: str

    def lines(self) -> tuple[Line, Line]:
        """ "✘ what is wrong" (or ⚠), then "  → what to do"."""
        symbol = ERROR if self.level == "error" else WARN
        return (Cell(f"{symbol} {self.text}", self.level),), (Cell(f"  → {self.fix}"),)


# ---- reading untrusted values ---------------------------------------------------------------


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _count(value: int | None) -> str:
    return NA if value is None else f"{value:,}"


def _names_by_ss58(names: Any) -> dict[str, str]:
    """{name: ss58} (the node's `hotkeys`) -> {ss58: name}."""
    return {ss58: name for name, ss58 in _map(names).items() if isinstance(name, str) and isinstance(ss58, str)}


# ---- formatting -----------------------------------------------------------------------------


def short_hotkey(ss58: Any, names: Mapping[str, str] | None = None) -> str:
    """The local name of `ss58` if `names` ({ss58: name}) has one, else "5F3s…k9Qa"; n/a for a
    missing hotkey."""
    text = _text(ss58)
    if text is None:
        return NA
    if names and text in names:
        return names[text]
    return text if len(text) <= 10 else f"{text[:4]}…{text[-4:]}"


def _short_digest(digest: Any) -> str:
    text = _text(digest)
    if text is None:
        return NA
    return text if len(text) <= 12 else f"{text[:6]}…{text[-4:]}"


def format_duration(seconds: float | None) -> str:
    """ "41 s", "12 min", "3 h 5 min", "2 d 4 h"; n/a for an unknown or non-finite time."""
    if seconds is None or not math.isfinite(seconds):
        return NA
    whole = max(0, int(seconds))
    if whole < 120:
        return f"{whole} s"
    if whole < 7200:
        return f"{whole // 60} min"
    if whole < 2 * 86400:
        return f"{whole // 3600} h {whole % 3600 // 60} min"
    return f"{whole // 86400} d {whole % 86400 // 3600} h"


def format_age(now: float, then: Any) -> str | None:
    """How long ago `then` (a unix time) was, or None when it is not a usable time."""
    then_s = _num(then)
    if then_s is None or not math.isfinite(now):
        return None
    return format_duration(now - then_s)


def _clock(ts: Any) -> str:
    seconds = _num(ts)
    if seconds is None:
        return "--:--:--"
    try:
        return time.strftime("%H:%M:%S", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):
        return "--:--:--"


def _ratio(part: int | None, whole: int) -> float | None:
    """part/whole for a share of a weight row; None when unknown, negative (not a weight) or
    not a float."""
    if part is None or part < 0 or whole <= 0:
        return None
    try:
        return part / whole
    except OverflowError:
        return None


def _percent(share: float | None) -> str:
    return NA if share is None else f"{share * 100:.1f}%"


def share_bar(share: float | None, width: int = BAR_WIDTH) -> str:
    """`share` (0..1) of `width` cells in eighth blocks; any share above 0 shows at least a sliver,
    so a small weight never looks like none."""
    if share is None or not math.isfinite(share) or share <= 0 or width <= 0:
        return ""
    eighths = max(1, round(min(share, 1.0) * width * 8))
    full, rest = divmod(eighths, 8)
    return "█" * full + (" ▏▎▍▌▋▊▉"[rest] if rest else "")


def _pad(rows: Sequence[Line], align: str, gap: str = "  ") -> tuple[Line, ...]:
    """Pad every cell to its column's widest text ("l"/"r" per column in `align`), with `gap`
    between columns; the last column is not padded on the right."""
    if not rows:
        return ()
    columns = max(len(row) for row in rows)
    widths = [max((cell_len(row[c].text) for row in rows if c < len(row)), default=0) for c in range(columns)]
    padded = []
    for row in rows:
        cells = []
        for c, cell in enumerate(row):
            right = c < len(align) and align[c] == "r"
            room = " " * (widths[c] - cell_len(cell.text))
            if c == len(row) - 1 and not right:
                cells.append(cell)
                continue
            text = room + cell.text if right else cell.text + room
            cells.append(cell._replace(text=text + ("" if c == len(row) - 1 else gap)))
        padded.append(tuple(cells))
    return tuple(padded)


def _header(*names: str) -> Line:
    return tuple(Cell(name, "header") for name in names)


# ---- the validator: where it stands ---------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Me:
    """This validator's own neuron: from the chain state when it lists the hotkey (fresher),
    else from the validator's last chain read."""

    uid: int | None
    permit: bool | None
    last_update: int | None
    registered: bool | None
    """None: not known (no chain read yet)."""


def _neurons(chain: Any) -> list[Mapping[Any, Any]]:
    return [_map(neuron) for neuron in _list(_map(chain).get("neurons"))]


def _me(validator: Mapping[Any, Any], chain: Any) -> _Me:
    hotkey = _text(validator.get("hotkey"))
    neurons = _neurons(chain)
    if hotkey is not None and neurons:
        mine = next((n for n in neurons if n.get("hotkey") == hotkey), None)
        if mine is None:
            return _Me(None, None, None, False)
        return _Me(_int(mine.get("uid")), _bool(mine.get("permit")), _int(mine.get("last_update")), True)
    uid = _int(validator.get("uid"))
    # The loop publishes uid=None after a chain read that did not find the hotkey; before any
    # read there is no "uid" key at all (or no block).
    registered = (
        True
        if uid is not None
        else (
            False
            if "uid" in validator and _int(validator.get("block")) is not None and validator.get("uid") is None
            else None
        )
    )
    return _Me(uid, _bool(validator.get("permit")), _int(validator.get("last_update")), registered)


def _head(validator: Mapping[Any, Any], chain: Any) -> tuple[int | None, bool]:
    """The chain's head block, and whether it is current (the chain state's, published every
    second) rather than the validator's last read."""
    block = _int(_map(chain).get("block"))
    if block is not None:
        return block, True
    return _int(validator.get("block")), False


def _block_time(validator: Mapping[Any, Any], chain: Any) -> float | None:
    for source in (_map(chain), validator):
        seconds = _num(source.get("block_time_s"))
        if seconds is not None and seconds > 0:
            return seconds
    return None


def _blocks_since_submit(validator: Mapping[Any, Any], chain: Any) -> int | None:
    head, current = _head(validator, chain)
    last = _int(validator.get("last_submit_block"))
    if current and head is not None and last is not None:
        return head - last
    return _int(validator.get("blocks_since_submit"))


def _resubmit_left(validator: Mapping[Any, Any], chain: Any, now: float) -> tuple[int | None, bool]:
    """Blocks until the next resubmission is due (negative: overdue), and whether it is an
    estimate (no current head: the validator's count at its last tick, moved on by the clock)."""
    head, current = _head(validator, chain)
    last = _int(validator.get("last_submit_block"))
    interval = _int(validator.get("resubmit_blocks"))
    if current and head is not None and last is not None and interval is not None:
        return last + interval - head, False
    left = _int(validator.get("next_resubmit_in_blocks"))
    if left is None:
        return None, False
    tick = _num(validator.get("last_tick"))
    block_s = _block_time(validator, chain)
    if tick is None or block_s is None or not math.isfinite(now) or now < tick:
        return left, False
    try:
        passed = int((now - tick) / block_s)
    except (OverflowError, ValueError):
        return left, False
    return left - passed, passed > 0


def _landed_kind(validator: Mapping[Any, Any]) -> str | None:
    for submission in _list(validator.get("submissions")):
        submission = _map(submission)
        if submission.get("landed") is True:
            return _text(submission.get("kind"))
    return None


class _Weight(NamedTuple):
    uid: int | None
    hotkey: Any
    weight: int | None
    share: float | None


def _weights(validator: Mapping[Any, Any]) -> list[_Weight]:
    """The published weights, heaviest first, each with its share of the positive total."""
    entries = [_map(entry) for entry in _list(validator.get("weights"))]
    values = [_int(entry.get("weight")) for entry in entries]
    total = sum(value for value in values if value is not None and value > 0)
    rows = [
        _Weight(_int(entry.get("uid")), entry.get("hotkey"), value, _ratio(value, total))
        for entry, value in zip(entries, values)
    ]
    rows.sort(key=lambda row: -(row.weight or 0))
    return rows


def weights_rows(validator: Mapping[str, Any] | None, names: Mapping[str, str] | None = None) -> list[Line]:
    """One row per uid this validator last put on chain, heaviest first: uid, hotkey (local
    name when `names` {name: ss58} has it), weight (u16), share of the row, share bar."""
    by_ss58 = _names_by_ss58(names)
    lines: list[Line] = []
    for uid, hotkey, weight, share in _weights(_map(validator)):
        lines.append(
            (
                Cell(str(uid)) if uid is not None else NA_CELL,
                Cell(short_hotkey(hotkey, by_ss58), "" if _text(hotkey) else "na"),
                Cell(f"{weight:,}") if weight is not None else NA_CELL,
                Cell(_percent(share), "" if share is not None else "na"),
                Cell(share_bar(share), "bar"),
            )
        )
    return lines


def weights_lines(
    validator: Mapping[str, Any] | None,
    names: Mapping[str, str] | None = None,
    *,
    chain: Mapping[str, Any] | None = None,
    max_rows: int = MAX_WEIGHT_ROWS,
) -> list[Line]:
    """The "Weights on chain" box: who this validator is, which epoch it has on chain and how
    that vector came (master-signed, cached, burn), its last submit, then the weights table."""
    validator = _map(validator)
    by_ss58 = _names_by_ss58(names)
    me = _me(validator, chain)
    hotkey = validator.get("hotkey")
    who = short_hotkey(hotkey)
    if isinstance(hotkey, str) and hotkey in by_ss58:
        who = f"{by_ss58[hotkey]} ({who})"
    permit = (
        Cell(f"permit {OK}", "ok")
        if me.permit is True
        else Cell(f"no permit {ERROR}", "error")
        if me.permit is False
        else Cell(f"permit {NA}", "na")
    )
    uid = (
        Cell(f"uid {me.uid}")
        if me.uid is not None
        else Cell(f"not registered {ERROR}", "error")
        if me.registered is False
        else Cell(f"uid {NA}", "na")
    )
    netuid = _int(validator.get("netuid"))
    network = _text(validator.get("network"))
    lines: list[Line] = [
        (
            Cell(who, "" if who != NA else "na"),
            Cell(" · "),
            uid,
            Cell(" · "),
            permit,
            Cell(f" · netuid {_count(netuid)} on {network or NA}"),
        )
    ]

    epoch = _int(validator.get("submitted_epoch"))
    if epoch is None:
        epoch = _int(validator.get("last_applied"))
    last = _int(validator.get("last_submit_block"))
    if epoch is None and last is None:
        lines.append((Cell("nothing on chain from this validator yet", "na"),))
        return lines
    kind = _landed_kind(validator)
    if kind == "standby:burn":
        source = Cell(f"burn to the subnet owner {WARN} (standby)", "warning")
    elif kind in ("standby:cached", "resubmitted:cached"):
        source = Cell(f"cached vector {WARN} (provider unavailable)", "warning")
    elif _text(validator.get("digest")):
        source = Cell(f"signed by master {OK}", "ok")
    else:
        source = NA_CELL
    lines.append(
        (
            Cell(f"epoch {_count(epoch)} · digest "),
            Cell(_short_digest(validator.get("digest")), "" if _text(validator.get("digest")) else "na"),
            Cell(" · "),
            source,
        )
    )
    since = _blocks_since_submit(validator, chain)
    ago = f" ({since:,} ago)" if since is not None else ""
    if last is not None:
        lines.append((Cell(f"last submit block {last:,}{ago} "), Cell(f"{OK} landed", "ok")))
    else:
        lines.append((Cell("last submit block "), NA_CELL))

    rows = weights_rows(validator, names)
    if not _list(validator.get("weights")):
        lines.append((Cell("the weights table appears after this process's first submit", "na"),))
    else:
        shown = rows[: max(0, max_rows)]
        lines += _pad([_header("uid", "hotkey", "weight", "share", ""), *shown], "llrrl")
        rest = _weights(validator)[len(shown) :]
        if rest:
            shares = [row.share for row in rest if row.share is not None and row.share > 0]
            share = sum(shares) if shares else (0.0 if any(row.share is not None for row in rest) else None)
            lines.append((Cell(f"… {len(rest)} more uid{'s' if len(rest) != 1 else ''} ({_percent(share)})", "na"),))
    dropped = [d for d in _list(validator.get("dropped"))]
    dropped_share = _num(validator.get("dropped_share"))
    if dropped or (dropped_share is not None and dropped_share > 0):
        count = f"{len(dropped)} unregistered hotkey{'s' if len(dropped) != 1 else ''}"
        lines.append((Cell(f"dropped: {count} ({_percent(dropped_share)} of the weight) {WARN}", "warning"),))
    elif "dropped" in validator:
        lines.append((Cell("dropped: none"),))
    return lines


def _interval_cells(validator: Mapping[Any, Any]) -> Line:
    interval = _int(validator.get("resubmit_blocks"))
    limit = _int(validator.get("weights_rate_limit"))
    if interval is None or limit is None:
        return (Cell(f"interval {_count(interval)} · rate limit {_count(limit)}", "na"),)
    if interval > limit:
        return (Cell(f"interval {interval:,} > rate limit {limit:,} "), Cell(OK, "ok"))
    return (Cell(f"interval {interval:,} ≤ rate limit {limit:,} {WARN}", "warning"),)


OUTCOMES: dict[str, tuple[str, str]] = {
    "applied": ("ok", OK),
    "resubmitted": ("ok", OK),
    "skipped:too-soon": ("ok", OK),
    "resubmitted:cached": ("warning", WARN),
    "standby:cached": ("warning", WARN),
    "standby:burn": ("warning", WARN),
    "skipped:replay": ("warning", WARN),
    "fetch-failed": ("warning", WARN),
    "chain-failed": ("error", ERROR),
    "submit-failed": ("error", ERROR),
    "error": ("error", ERROR),
}
"""`TickResult.outcome` -> (style, symbol); `rejected:<reason>` is a warning."""


def _outcome_cell(outcome: Any) -> Cell:
    text = _text(outcome)
    if text is None:
        return NA_CELL
    style, symbol = OUTCOMES.get(text, ("warning", WARN) if text.startswith("rejected:") else ("", ""))
    return Cell(f"{text} {symbol}".rstrip(), style)


def next_action_lines(
    validator: Mapping[str, Any] | None, now: float, *, chain: Mapping[str, Any] | None = None
) -> list[Line]:
    """The "Next action" box: the resubmit countdown against the rate limit, the room left
    before the activity cutoff, the last tick, commit-reveal, the provider."""
    validator = _map(validator)
    block_s = _block_time(validator, chain)
    left, estimated = _resubmit_left(validator, chain, now)
    approx = "~" if estimated else ""
    if left is None:
        if _int(validator.get("last_submit_block")) is None and _int(validator.get("last_applied")) is None:
            countdown: Line = (Cell("first submit when the provider publishes an epoch", "na"),)
        else:
            countdown = (Cell("resubmit in "), NA_CELL)
    elif left > 0:
        eta = f" (~{_eta(left, block_s)})" if block_s is not None else ""
        countdown = (Cell(f"resubmit in {approx}{left:,} blocks{eta}"),)
    elif left == 0:
        countdown = (Cell("resubmit due: the next tick submits"),)
    else:
        countdown = (Cell(f"resubmit due {approx}{-left:,} blocks ago"),)
    lines: list[Line] = [(*countdown, Cell(" · "), *_interval_cells(validator))]

    cutoff = _int(validator.get("activity_cutoff"))
    idle = _idle_blocks(validator, chain)
    if cutoff is None:
        lines.append((Cell("activity cutoff "), NA_CELL))
    elif idle is None:
        lines.append((Cell(f"activity cutoff {cutoff:,} blocks: spare "), NA_CELL))
    else:
        spare = cutoff - idle
        if spare < 0:
            lines.append(
                (Cell(f"activity cutoff {cutoff:,} blocks: passed {-spare:,} blocks ago {ERROR} inactive", "error"),)
            )
        elif 2 * idle > cutoff:
            lines.append((Cell(f"activity cutoff {cutoff:,} blocks: only {spare:,} to spare {WARN}", "warning"),))
        else:
            lines.append((Cell(f"activity cutoff {cutoff:,} blocks: {spare:,} to spare "), Cell(OK, "ok")))

    age = format_age(now, validator.get("last_tick"))
    if age is None:
        lines.append((Cell("last tick "), NA_CELL))
    else:
        lines.append((Cell(f"last tick {age} ago: "), _outcome_cell(validator.get("last_outcome"))))

    reveal = _bool(validator.get("commit_reveal"))
    tempo = _int(validator.get("tempo"))
    lines.append(
        (
            Cell("commit-reveal: "),
            Cell("on (weights count after the reveal)") if reveal else Cell("off") if reveal is False else NA_CELL,
            Cell(f" · tempo {_count(tempo)}" + (f" · {block_s:g} s blocks" if block_s is not None else "")),
        )
    )
    provider = _text(validator.get("provider"))
    lines.append((Cell("provider "), Cell(provider) if provider else NA_CELL))
    return lines


def _eta(blocks: int, block_s: float) -> str:
    try:
        return format_duration(blocks * block_s)
    except OverflowError:  # an integer too large for a float
        return NA


def _idle_blocks(validator: Mapping[Any, Any], chain: Any) -> int | None:
    """Blocks since the chain last saw this validator (its last_update), else since its last
    submit as the validator counts them."""
    head, _ = _head(validator, chain)
    last_update = _me(validator, chain).last_update
    if head is not None and last_update is not None:
        return head - last_update
    return _blocks_since_submit(validator, chain)


# ---- warnings -------------------------------------------------------------------------------


REFUSAL_FIXES: tuple[tuple[str, str], ...] = (
    (
        "NeuronNoValidatorPermit",
        "get a validator permit: stake more on this hotkey (permits go to the largest stakes, recomputed each epoch)",
    ),
    ("NotEnoughStakeToSetWeights", "stake more on this hotkey: the subnet sets a minimum stake for weights"),
    ("HotKeyNotRegisteredInSubNet", "register this hotkey on the subnet"),
    (
        "SettingWeightsTooFast",
        "raise validator.resubmit_blocks above the weights rate limit; the next interval retries",
    ),
    ("RateLimitExceeded", "raise validator.resubmit_blocks above the weights rate limit; the next interval retries"),
    ("rate_limited", "raise validator.resubmit_blocks above the weights rate limit; the next interval retries"),
    ("Custom error: 6", "raise validator.resubmit_blocks above the weights rate limit; the next interval retries"),
    ("CommitRevealEnabled", "the subnet now requires commit-reveal: update engy-node"),
    ("IncorrectWeightVersionKey", "update engy-node: the subnet expects another weights version"),
    (
        "transport",
        "the chain endpoint did not answer: check validator.network and the connection; the next interval retries",
    ),
)


def refusal_fix(detail: str | None) -> str:
    """What to do about a refused submission, from the chain error named in its detail."""
    text = detail or ""
    for needle, fix in REFUSAL_FIXES:
        if needle in text:
            return fix
    return "nothing was recorded and the next interval retries; the validator log has the SDK's advice"


OUTCOME_FIXES: dict[str, tuple[Literal["warning", "error"], str, str]] = {
    "fetch-failed": (
        "warning",
        "the provider did not answer the last poll",
        "check validator.provider_url and the provider; the cached vector is resubmitted meanwhile",
    ),
    "resubmitted:cached": (
        "warning",
        "the provider gave no usable payload: the cached vector was resubmitted",
        "check the provider; nothing is lost while the cache lasts",
    ),
    "standby:cached": (
        "warning",
        "no hotkey of the payload is registered: the last landed vector was resubmitted",
        "tell the provider: its payload names hotkeys this subnet does not have",
    ),
    "standby:burn": (
        "warning",
        "no hotkey of the payload is registered: the weights were burned to the subnet owner",
        "check the provider's owner_hotkey and netuid",
    ),
    "skipped:replay": (
        "warning",
        "the provider serves an epoch older than the one on chain (replay guard)",
        "tell the provider; the validator keeps the newer epoch on chain",
    ),
    "chain-failed": (
        "error",
        "the last chain read failed: nothing was submitted",
        "check validator.network and the connection; the next tick retries",
    ),
    "submit-failed": ("error", "the last tick could not submit", "see the submissions below and the validator log"),
    "error": ("error", "the last tick raised an error", "see the validator log (this is a bug if it repeats)"),
}


def validator_warnings(
    validator: Mapping[str, Any] | None,
    chain: Mapping[str, Any] | None,
    now: float,
    *,
    names: Mapping[str, str] | None = None,
    poll_s: float | None = None,
) -> list[Finding]:
    """Everything about this validator an operator must act on, worst first, each with its fix:
    not registered, no permit, an interval that does not clear the rate limit, the activity
    cutoff coming near or passed, an old last tick (more than three polls: `poll_s`, else the
    state's `poll_s`, else `DEFAULT_POLL_S`), dropped hotkeys, a refused last submission, and a
    last tick that did not go to plan."""
    validator = _map(validator)
    if not validator:
        return []
    findings: list[Finding] = []
    me = _me(validator, chain)
    netuid = _int(validator.get("netuid"))
    where = f"netuid {netuid}" if netuid is not None else "the subnet"
    who = short_hotkey(validator.get("hotkey"), _names_by_ss58(names))
    if me.registered is False:
        findings.append(
            Finding(
                "error",
                f"hotkey {who} is not registered on {where}",
                f"register it (btcli subnets register --netuid {_count(netuid)}); until then every submit is refused",
            )
        )
    elif me.permit is False:
        findings.append(
            Finding(
                "error",
                f"uid {_count(me.uid)} has no validator permit: the chain refuses its weights",
                "stake more on this hotkey (permits go to the largest stakes, recomputed each epoch)",
            )
        )

    interval = _int(validator.get("resubmit_blocks"))
    limit = _int(validator.get("weights_rate_limit"))
    if interval is not None and limit is not None and interval <= limit:
        findings.append(
            Finding(
                "warning",
                f"resubmit interval {interval:,} blocks does not clear the weights rate limit of {limit:,}",
                f"set validator.resubmit_blocks above {limit:,} (default {ValidatorSection().resubmit_blocks}), or the "
                "chain refuses resubmits as too fast",
            )
        )

    cutoff = _int(validator.get("activity_cutoff"))
    idle = _idle_blocks(validator, chain)
    if cutoff is not None and idle is not None and me.registered is not False:
        if idle > cutoff:
            findings.append(
                Finding(
                    "error",
                    f"{idle:,} blocks since this validator's last update, past the activity "
                    f"cutoff of {cutoff:,}: out of consensus, earning nothing",
                    "a landed submit restores it: fix what the other warnings and the submissions say",
                )
            )
        elif 2 * idle > cutoff:
            findings.append(
                Finding(
                    "warning",
                    f"{idle:,} blocks since this validator's last update: {cutoff - idle:,} "
                    f"left before the activity cutoff of {cutoff:,}",
                    "resubmits have stopped landing: see the submissions and the validator log",
                )
            )

    poll = poll_s if poll_s is not None and poll_s > 0 else _num(validator.get("poll_s"))
    poll = poll if poll is not None and poll > 0 else DEFAULT_POLL_S
    tick = _num(validator.get("last_tick"))
    if tick is not None and math.isfinite(now) and now - tick > 3 * poll:
        findings.append(
            Finding(
                "warning",
                f"no tick for {format_duration(now - tick)} (polls every {format_duration(poll)})",
                "the loop may be stuck in a chain call; the watchdog restarts it — see the validator log",
            )
        )

    dropped = _list(validator.get("dropped"))
    dropped_share = _num(validator.get("dropped_share"))
    if dropped_share is not None and dropped_share > 0:
        count = f"{len(dropped)} payload hotkey{'s' if len(dropped) != 1 else ''}" if dropped else "payload hotkeys"
        findings.append(
            Finding(
                "warning",
                f"{count} not registered on chain, {_percent(dropped_share)} of the weight, dropped",
                "miners that left the subnet; the provider's next epoch should leave them out — "
                "tell the provider if it persists",
            )
        )

    newest = _map(next(iter(_list(validator.get("submissions"))), None))
    if newest.get("landed") is False:
        detail = _text(newest.get("detail"))
        block = _int(newest.get("block"))
        at = f" at block {block:,}" if block is not None else ""
        findings.append(Finding("error", f"last submission refused{at}: {detail or NA}", refusal_fix(detail)))

    outcome = _text(validator.get("last_outcome"))
    if outcome is not None:
        known = OUTCOME_FIXES.get(outcome)
        if outcome.startswith("rejected:"):
            known = (
                "warning",
                f"the provider's payload was rejected ({outcome.removeprefix('rejected:')})",
                "check validator.master_hotkey and netuid match the provider; nothing unverified is submitted",
            )
        # A refused submission already has its own warning above.
        if known is not None and not (outcome == "submit-failed" and newest.get("landed") is False):
            findings.append(Finding(*known))
    findings.sort(key=lambda finding: finding.level != "error")
    return findings


def warning_lines(findings: Sequence[Finding]) -> list[Line]:
    if not findings:
        return [(Cell(f"none {OK}", "ok"),)]
    return [line for finding in findings for line in finding.lines()]


def submission_lines(validator: Mapping[str, Any] | None, now: float, *, max_rows: int = MAX_SUBMISSIONS) -> list[Line]:
    """The newest submissions first: local time and age, block, epoch, kind, and how it ended
    (✔ included, or ✘ the chain's refusal and that nothing was recorded)."""
    submissions = [_map(s) for s in _list(_map(validator).get("submissions"))]
    if not submissions:
        return [(Cell("no submissions from this process yet", "na"),)]
    rows: list[Line] = []
    for submission in submissions[: max(0, max_rows)]:
        age = format_age(now, submission.get("ts"))
        block = _int(submission.get("block"))
        epoch = _int(submission.get("epoch"))
        kind = _text(submission.get("kind"))
        landed = submission.get("landed")
        detail = _text(submission.get("detail"))
        if landed is True:
            end = Cell(f"{OK} {detail or 'landed'}", "ok")
        elif landed is False:
            end = Cell(f"{ERROR} {detail or 'refused'} (not recorded; retried next interval)", "error")
        else:
            end = Cell(f"{detail or NA}", "" if detail else "na")
        rows.append(
            (
                Cell(_clock(submission.get("ts")), "" if age is not None else "na"),
                Cell(f"{age} ago" if age is not None else NA, "" if age is not None else "na"),
                Cell(f"block {block:,}") if block is not None else Cell(f"block {NA}", "na"),
                Cell(f"epoch {epoch}") if epoch is not None else Cell(f"epoch {NA}", "na"),
                Cell(kind) if kind else NA_CELL,
                end,
            )
        )
    lines = list(_pad(rows, "lrrlll"))
    if len(submissions) > len(rows):
        older = len(submissions) - len(rows)
        lines.append((Cell(f"… {older} older", "na"),))
    return lines


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorView:
    """Everything the validator panel shows for one state at one time."""

    weights_title: str
    weights: tuple[Line, ...]
    next_action: tuple[Line, ...]
    warnings_title: str
    warnings: tuple[Line, ...]
    worst: Literal["none", "warning", "error"]
    submissions_title: str
    submissions: tuple[Line, ...]


def validator_view(
    validator: Mapping[str, Any] | None,
    *,
    now: float,
    chain: Mapping[str, Any] | None = None,
    names: Mapping[str, str] | None = None,
    poll_s: float | None = None,
) -> ValidatorView:
    """What the validator panel shows for the hub's "validator" state (None or {}: not reported
    yet) at wall-clock `now`; `chain` (the hub's "chain" state) and `names` ({name: ss58}) when
    the node has them."""
    validator = _map(validator)
    if not validator:
        waiting = ((Cell("waiting for the validator's first report", "na"),),)
        return ValidatorView(
            "Weights on chain",
            waiting,
            waiting,
            "Warnings",
            ((Cell(NA, "na"),),),
            "none",
            "Submissions (newest first)",
            waiting,
        )
    findings = validator_warnings(validator, chain, now, names=names, poll_s=poll_s)
    worst: Literal["none", "warning", "error"] = (
        "error" if any(f.level == "error" for f in findings) else "warning" if findings else "none"
    )
    epoch = _int(validator.get("submitted_epoch"))
    epoch = epoch if epoch is not None else _int(validator.get("last_applied"))
    submissions = [_map(s) for s in _list(validator.get("submissions"))]
    refused = sum(1 for s in submissions if s.get("landed") is False)
    return ValidatorView(
        weights_title="Weights on chain" + (f" · epoch {epoch}" if epoch is not None else ""),
        weights=tuple(weights_lines(validator, names, chain=chain)),
        next_action=tuple(next_action_lines(validator, now, chain=chain)),
        warnings_title="Warnings" + (f" ({len(findings)})" if findings else ""),
        warnings=tuple(warning_lines(findings)),
        worst=worst,
        submissions_title="Submissions (newest first)"
        + (f" · {len(submissions)} kept, {refused} refused" if submissions else ""),
        submissions=tuple(submission_lines(validator, now)),
    )


# ---- the chain ------------------------------------------------------------------------------


NEURON_COLUMNS = ("uid", "name", "stake τ", "permit", "last update", "incentive", "dividends", "emission α")
NEURON_ALIGN = "llrllrrr"


def chain_summary_line(chain: Mapping[str, Any] | None) -> Line:
    chain = _map(chain)
    block = _int(chain.get("block"))
    block_s = _num(chain.get("block_time_s"))
    return (
        Cell(
            f"block {_count(block)} · {f'{block_s:g} s' if block_s is not None else NA} blocks · "
            f"tempo {_count(_int(chain.get('tempo')))} · epochs run {_count(_int(chain.get('epochs_run')))}"
        ),
    )


def _fraction(value: Any) -> Cell:
    number = _num(value)
    return NA_CELL if number is None else Cell(f"{number:.4f}")


def neuron_rows(chain: Mapping[str, Any] | None, names: Mapping[str, str] | None = None) -> list[Line]:
    """One row per neuron, in `NEURON_COLUMNS` order: uid, local name or short ss58, stake,
    permit (✔/—), last update (and blocks ago, "⚠ inactive" when the chain says so), incentive,
    dividends, emission at the last epoch."""
    chain = _map(chain)
    head = _int(chain.get("block"))
    by_ss58 = _names_by_ss58(names)
    rows: list[Line] = []
    for neuron in _neurons(chain):
        uid = _int(neuron.get("uid"))
        hotkey = neuron.get("hotkey")
        stake = _num(neuron.get("stake"))
        permit = _bool(neuron.get("permit"))
        last_update = _int(neuron.get("last_update"))
        emission = _num(neuron.get("emission"))
        if last_update is None:
            update = NA_CELL
        else:
            ago = f" ({head - last_update:,} ago)" if head is not None else ""
            inactive = neuron.get("active") is False
            update = Cell(
                f"{last_update:,}{ago}" + (f" {WARN} inactive" if inactive else ""), "warning" if inactive else ""
            )
        rows.append(
            (
                Cell(str(uid)) if uid is not None else NA_CELL,
                Cell(short_hotkey(hotkey, by_ss58), "" if _text(hotkey) else "na"),
                Cell(f"{stake:,.2f}") if stake is not None else NA_CELL,
                Cell(OK, "ok") if permit else Cell(DASH) if permit is False else NA_CELL,
                update,
                _fraction(neuron.get("incentive")),
                _fraction(neuron.get("dividends")),
                Cell(f"{emission:,.4f}") if emission is not None else NA_CELL,
            )
        )
    return rows


def _uid_key(key: Any) -> tuple[int, int | str]:
    text = str(key)
    return (0, int(text)) if text.isascii() and text.isdigit() and len(text) < 20 else (1, text)


def chain_weight_lines(
    chain: Mapping[str, Any] | None, names: Mapping[str, str] | None = None, *, max_targets: int = MAX_TARGETS
) -> list[Line]:
    """The weights each validator has on chain: per validator uid, its targets heaviest first
    with their share of the row and a bar; past `max_targets`, one line sums up the rest."""
    chain = _map(chain)
    weights = _map(chain.get("weights"))
    if not weights:
        return [(Cell("no weights on chain yet" if "weights" in chain else f"weights {NA}", "na"),)]
    by_ss58 = _names_by_ss58(names)
    hotkeys = {str(_int(n.get("uid"))): n.get("hotkey") for n in _neurons(chain) if _int(n.get("uid")) is not None}
    rows: list[Line] = []
    extra: dict[int, Line] = {}
    for validator_uid, row in sorted(weights.items(), key=lambda item: _uid_key(item[0])):
        targets = [(target, _int(value)) for target, value in _map(row).items()]
        total = sum(value for _, value in targets if value is not None and value > 0)
        targets.sort(key=lambda item: (-(item[1] or 0), _uid_key(item[0])))
        source = f"uid {_one(validator_uid)}"
        if hotkeys.get(str(validator_uid)) is not None:
            source += f" {short_hotkey(hotkeys[str(validator_uid)], by_ss58)}"
        if not targets:
            rows.append((Cell(source), Cell("→"), Cell("none", "na"), Cell(""), Cell(""), Cell("")))
            continue
        for index, (target, value) in enumerate(targets[: max(1, max_targets)]):
            share = _ratio(value, total)
            name = short_hotkey(hotkeys.get(str(target)), by_ss58) if hotkeys.get(str(target)) is not None else ""
            rows.append(
                (
                    Cell(source if index == 0 else ""),
                    Cell("→" if index == 0 else ""),
                    Cell(f"uid {_one(target)} {name}".rstrip()),
                    Cell(f"{value:,}") if value is not None else NA_CELL,
                    Cell(_percent(share), "" if share is not None else "na"),
                    Cell(share_bar(share), "bar"),
                )
            )
        rest = targets[max(1, max_targets) :]
        if rest:
            kept = sum(value for _, value in rest if value is not None and value > 0)
            extra[len(rows) - 1] = (
                Cell(f"… {len(rest)} more uid{'s' if len(rest) != 1 else ''} ({_percent(_ratio(kept, total))})", "na"),
            )
    table = _pad([_header("set by", "", "on", "weight", "share", ""), *rows], "lllrrl")
    indent = Cell(" " * sum(cell_len(cell.text) for cell in table[0][:2]))
    lines: list[Line] = [table[0]]
    for index, line in enumerate(table[1:]):
        lines.append(line)
        if index in extra:
            lines.append((indent, *extra[index]))
    return lines


def _one(value: Any) -> str:
    return _text(str(value)) or NA


def miner_lines(chain: Mapping[str, Any] | None, hotkey: str | None) -> list[Line]:
    """A miner's own standing for its dashboard: uid, incentive, emission, and how many permit
    holders weight it, with the newest such update's age in blocks."""
    chain = _map(chain)
    neurons = _neurons(chain)
    mine = next((n for n in neurons if hotkey is not None and n.get("hotkey") == hotkey), None)
    if mine is None:
        if not neurons:
            return [(Cell("chain state n/a", "na"),)]
        return [(Cell(f"not registered on netuid {_count(_int(chain.get('netuid')))} {ERROR}", "error"),)]
    uid = _int(mine.get("uid"))
    emission = _num(mine.get("emission"))
    head = _int(chain.get("block"))
    validators = [n for n in neurons if n.get("permit") is True and _int(n.get("uid")) is not None]
    weights = _map(chain.get("weights"))
    weighting = [n for n in validators if (_int(_map(weights.get(str(n["uid"]))).get(str(uid))) or 0) > 0]
    updates = [_int(n.get("last_update")) for n in weighting]
    newest = max((u for u in updates if u is not None), default=None)
    age = f", newest {head - newest:,} blocks ago" if newest is not None and head is not None else ""
    style = "ok" if weighting else "warning"
    return [
        (
            Cell(f"uid {_count(uid)} · incentive "),
            _fraction(mine.get("incentive")),
            Cell(" · emission "),
            Cell(f"{emission:,.4f} α/epoch") if emission is not None else NA_CELL,
        ),
        (Cell(f"weights from {len(weighting)}/{len(validators)} validators{age} {OK if weighting else WARN}", style),),
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class ChainPanelView:
    title: str
    summary: Line
    neurons: tuple[Line, ...]
    weights: tuple[Line, ...]


def chain_view(
    chain: Mapping[str, Any] | None, *, now: float | None = None, names: Mapping[str, str] | None = None
) -> ChainPanelView:
    """What the chain panel shows for the hub's "chain" state (None or {}: not reported yet).
    `now` is accepted for symmetry; the chain state carries blocks, not times."""
    chain = _map(chain)
    if not chain:
        return ChainPanelView("Chain", (Cell("waiting for the chain's first report", "na"),), (), ())
    network = _text(chain.get("network")) or NA
    title = f"Chain · {network} · netuid {_count(_int(chain.get('netuid')))}"
    rows = neuron_rows(chain, names)
    neurons = (
        _pad([_header(*NEURON_COLUMNS), *rows], NEURON_ALIGN)
        if rows
        else ((Cell("no neurons" if "neurons" in chain else f"neurons {NA}", "na"),),)
    )
    return ChainPanelView(title, chain_summary_line(chain), tuple(neurons), tuple(chain_weight_lines(chain, names)))


# ---- the widgets ----------------------------------------------------------------------------


def lines_content(lines: Iterable[Sequence[Cell]]) -> Content:
    """Cells as Textual content, one line each (styles from `STYLES`; text never parsed as markup)."""
    return cells_content(lines, STYLES)


_BOX_CSS = """
    border: round $primary;
    border-title-color: $text-primary;
    border-title-style: bold;
    padding: 0 1;
    height: auto;
    text-wrap: nowrap;
    text-overflow: ellipsis;
"""


class ValidatorPanel(Widget):
    """Weights on chain and next action side by side, warnings under the next action, the
    submissions across the bottom. Call `update_state` with the hub's "validator" state."""

    DEFAULT_CSS = f"""
    ValidatorPanel {{
        height: auto;
    }}
    ValidatorPanel > #validator-top {{
        height: auto;
    }}
    ValidatorPanel #validator-side {{
        width: 1fr;
        height: auto;
    }}
    ValidatorPanel #validator-weights {{
        width: 1fr;
    }}
    ValidatorPanel .box {{{_BOX_CSS}}}
    ValidatorPanel #validator-warnings {{
        text-wrap: wrap;
    }}
    ValidatorPanel #validator-warnings.-warning {{
        border: round $warning;
    }}
    ValidatorPanel #validator-warnings.-error {{
        border: round $error;
    }}
    """

    def __init__(
        self, *, poll_s: float | None = None, name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.poll_s = poll_s
        self._shown: ValidatorView | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="validator-top"):
            yield Static(id="validator-weights", classes="box")
            with Vertical(id="validator-side"):
                yield Static(id="validator-next", classes="box")
                yield Static(id="validator-warnings", classes="box")
        yield Static(id="validator-submissions", classes="box")

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def update_state(
        self,
        state: Mapping[str, Any] | None,
        *,
        now: float,
        names: Mapping[str, str] | None = None,
        chain: Mapping[str, Any] | None = None,
    ) -> None:
        """Show the hub's "validator" state as of wall-clock `now`; `names` is the node's
        `hotkeys` ({name: ss58}), `chain` its "chain" state, when it has them."""
        view = validator_view(state, now=now, chain=chain, names=names, poll_s=self.poll_s)
        if view == self._shown:
            return
        self._shown = view
        for widget_id, title, lines in (
            ("validator-weights", view.weights_title, view.weights),
            ("validator-next", "Next action", view.next_action),
            ("validator-warnings", view.warnings_title, view.warnings),
            ("validator-submissions", view.submissions_title, view.submissions),
        ):
            box = self.query_one(f"#{widget_id}", Static)
            box.border_title = title
            box.update(lines_content(lines))
        warnings = self.query_one("#validator-warnings", Static)
        warnings.set_class(view.worst == "warning", "-warning")
        warnings.set_class(view.worst == "error", "-error")


class ChainPanel(Widget):
    """The subnet's neurons and the weights on chain. Call `update_state` with the hub's
    "chain" state."""

    DEFAULT_CSS = f"""
    ChainPanel {{{_BOX_CSS}}}
    ChainPanel > Static {{
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }}
    ChainPanel > #chain-weights {{
        margin-top: 1;
    }}
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._shown: ChainPanelView | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="chain-summary")
        yield Static(id="chain-neurons")
        yield Static(id="chain-weights")

    def on_mount(self) -> None:
        self.update_state(None, now=0.0)

    def update_state(
        self, state: Mapping[str, Any] | None, *, now: float, names: Mapping[str, str] | None = None
    ) -> None:
        """Show the hub's "chain" state; `names` is the node's `hotkeys` ({name: ss58})."""
        view = chain_view(state, now=now, names=names)
        if view == self._shown:
            return
        self._shown = view
        self.border_title = view.title
        for widget_id, lines in (
            ("chain-summary", (view.summary,)),
            ("chain-neurons", view.neurons),
            ("chain-weights", view.weights),
        ):
            static = self.query_one(f"#{widget_id}", Static)
            static.update(lines_content(lines))
            static.display = bool(lines)
