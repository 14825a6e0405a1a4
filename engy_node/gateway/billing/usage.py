"""A buyer's usage report: the request log's rows summed per key, per day and model.

What `GET /v1/usage` answers and `engy-node gateway usage` prints. One function over plain rows
(`usage_report`), no IO, no clock: the shells read the rows (`RequestLog.account_requests`) and
render the result (JSON, CSV, a table).

Requests, not attempts. The log has a row per attempt: a request that failed on one miner and
was served by another has two. A request is counted once, in the group of its first row (the
day it arrived, the key that sent it) and its last row's model; it is an error when its last
row's status is not 200; its TTFT is its last row's. Its tokens and cost are the sum of its rows,
which is what the ledger charged for it: each settlement writes exactly one row carrying what
the ledger charged (`Store.settle_and_log`), and every other row carries 0 µUSD. So the cost of
a report over all of an account's retained history equals the ledger's charges to the µUSD
while nothing has been purged (a test compares them).

Money in. Beside the charges, a report lists the credits the account received in its window —
the operator's (`credit`) and deposits from the chain (`deposit`, with their extrinsic) — from
the ledger's own rows (`Deposits.credits_between`), so that what came in minus what was charged
is what the balance moved by, to the µUSD, and over all history the ledger's `credited` figure.

Percentiles are nearest rank over the group's requests that have a TTFT (`percentile.py`), in
whole milliseconds as logged; a group with none has none.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Literal

from engy_node.gateway.billing.costs import cost_usd
from engy_node.gateway.store import RequestLogEntry
from engy_node.gateway.store.deposits import CreditRecord
from engy_node.percentile import nearest_rank

DEFAULT_WINDOW_S = 30 * 86_400
"""A report with no `since`: the last 30 days."""

GroupBy = Literal["day", "total"]
GROUP_BYS: tuple[GroupBy, ...] = ("day", "total")


@dataclasses.dataclass(frozen=True, slots=True)
class UsageLine:
    """One key's requests to one model on one day (`day` None: the whole window)."""

    day: str | None
    """UTC date, `YYYY-MM-DD`."""
    key_id: int | None
    """None: requests logged before keys were recorded (store schema < 5)."""
    model: str | None
    requests: int
    errors: int
    """Requests whose last attempt did not end with status 200."""
    prompt_tokens: int
    """Including the cached ones, as OpenAI counts them."""
    cached_tokens: int
    completion_tokens: int
    """Including the reasoning ones."""
    reasoning_tokens: int
    cost_micro: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclasses.dataclass
class _Request:
    first: RequestLogEntry
    last: RequestLogEntry
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reasoning: int = 0
    cost: int = 0

    def add(self, row: RequestLogEntry) -> None:
        self.last = row
        self.prompt += row.prompt_tokens
        self.cached += row.cached_tokens
        self.completion += row.completion_tokens
        self.reasoning += row.reasoning_tokens
        self.cost += row.cost_micro


def utc_day(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d")


def usage_report(rows: Iterable[RequestLogEntry], *, group_by: GroupBy = "day") -> list[UsageLine]:
    """Sum `rows` (an account's log rows in the order they were logged) per key, day (when
    `group_by` is "day") and model; lines sorted by day, key and model."""
    if group_by not in GROUP_BYS:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BYS)}, got {group_by!r}")
    requests: dict[str, _Request] = {}
    for row in rows:
        request = requests.get(row.request_id)
        if request is None:
            request = requests[row.request_id] = _Request(first=row, last=row)
        request.add(row)
    groups: dict[tuple[str | None, int | None, str | None], list[_Request]] = {}
    for request in requests.values():
        day = utc_day(request.first.created_at) if group_by == "day" else None
        groups.setdefault((day, request.first.key_id, request.last.model), []).append(request)
    lines = [_line(key, members) for key, members in groups.items()]
    return sorted(lines, key=lambda line: (line.day or "", line.key_id or 0, line.model or ""))


def _line(key: tuple[str | None, int | None, str | None], members: list[_Request]) -> UsageLine:
    ttfts = sorted(request.last.ttft_ms for request in members if request.last.ttft_ms is not None)
    return UsageLine(
        day=key[0],
        key_id=key[1],
        model=key[2],
        requests=len(members),
        errors=sum(request.last.status != 200 for request in members),
        prompt_tokens=sum(request.prompt for request in members),
        cached_tokens=sum(request.cached for request in members),
        completion_tokens=sum(request.completion for request in members),
        reasoning_tokens=sum(request.reasoning for request in members),
        cost_micro=sum(request.cost for request in members),
        ttft_p50_ms=nearest_rank(ttfts, 50) if ttfts else None,
        ttft_p95_ms=nearest_rank(ttfts, 95) if ttfts else None,
    )


COLUMNS = (
    "day",
    "key_id",
    "model",
    "requests",
    "errors",
    "error_rate",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_micro_usd",
    "cost_usd",
    "ttft_p50_ms",
    "ttft_p95_ms",
)
"""A line's fields as JSON and CSV carry them, in this order."""


def line_fields(line: UsageLine) -> dict[str, object]:
    """A line as JSON: every figure, the cost both in µUSD and as exact dollars (a string, so no
    reader rounds it)."""
    values: dict[str, object] = dataclasses.asdict(line)
    cost = values.pop("cost_micro")
    values.update(cost_micro_usd=cost, cost_usd=cost_usd(line.cost_micro), error_rate=round(line.error_rate, 6))
    return {column: values[column] for column in COLUMNS}


def credit_fields(credit: CreditRecord) -> dict[str, object]:
    """A credit or deposit as JSON: its amount in µUSD and exact dollars, its day and ledger row,
    and a deposit's extrinsic, sender and TAO (in rao) or a credit's memo."""
    fields: dict[str, object] = {
        "kind": credit.kind,
        "day": utc_day(credit.created_at),
        "created_at": credit.created_at,
        "micro_usd": credit.micro_usd,
        "usd": cost_usd(credit.micro_usd),
        "ledger_id": credit.ledger_id,
    }
    if credit.kind == "deposit":
        fields.update(extrinsic_id=credit.extrinsic_id, coldkey=credit.coldkey, amount_rao=credit.amount_rao)
    else:
        fields.update(memo=credit.memo)
    return fields


def reference(credit: CreditRecord) -> str:
    """What names a credit to a person: a deposit's extrinsic and sender, a credit's memo."""
    if credit.kind == "deposit":
        return f"deposit {credit.extrinsic_id} from {credit.coldkey}"
    return credit.memo


CSV_COLUMNS = ("kind", *COLUMNS, "credit_micro_usd", "credit_usd", "reference")
"""The CSV's columns: each line of requests (kind `requests`) and each credit or deposit in the
window (kind `credit`, `deposit`: its day, amount and reference), a field that does not apply
left empty."""


def as_csv(lines: Iterable[UsageLine], credits: Sequence[CreditRecord] = ()) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for line in lines:
        values = ["requests", *("" if value is None else value for value in line_fields(line).values())]
        writer.writerow([*values, "", "", ""])
    blank = [""] * (len(COLUMNS) - 1)
    for credit in credits:
        day = utc_day(credit.created_at)
        writer.writerow([credit.kind, day, *blank, credit.micro_usd, cost_usd(credit.micro_usd), reference(credit)])
    return out.getvalue()


def credits_table(credits: Sequence[CreditRecord]) -> str:
    """The credits and deposits of a window, summed, then one line each."""
    deposits = [credit for credit in credits if credit.kind == "deposit"]
    total, deposited = sum(c.micro_usd for c in credits), sum(c.micro_usd for c in deposits)
    lines = [
        f"credited ${cost_usd(total)} in the window: {len(deposits)} deposit(s) ${cost_usd(deposited)}, "
        f"{len(credits) - len(deposits)} credit(s) ${cost_usd(total - deposited)}"
    ]
    lines += [
        f"  {utc_day(c.created_at)}  {c.kind:<7}  ${cost_usd(c.micro_usd)}  {reference(c)}".rstrip() for c in credits
    ]
    return "\n".join(lines)


def as_table(lines: list[UsageLine]) -> str:
    header = ("day", "key", "model", "requests", "errors", "prompt", "cached", "completion", "reasoning", "cost")
    rows = [header] + [
        (
            line.day or "all",
            "-" if line.key_id is None else str(line.key_id),
            line.model or "-",
            str(line.requests),
            str(line.errors),
            str(line.prompt_tokens),
            str(line.cached_tokens),
            str(line.completion_tokens),
            str(line.reasoning_tokens),
            f"${cost_usd(line.cost_micro)}",
        )
        for line in lines
    ]
    total = sum(line.cost_micro for line in lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([*text, f"total cost ${cost_usd(total)} over {sum(line.requests for line in lines)} requests"])


def parse_time(text: str, *, param: str) -> float:
    """A `since`/`until` bound as unix seconds: unix seconds, a UTC date (`2026-12-05`, its
    midnight) or an ISO 8601 time (UTC unless it names an offset).

    Raises:
        ValueError: none of those; the message names `param` and the forms it takes.
    """
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if value == value and abs(value) != float("inf"):
            return value
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{param} must be unix seconds, a date (2026-12-05) or an ISO 8601 time (2026-12-05T14:00:00Z), "
            f"got {text!r}"
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def usage_document(
    lines: list[UsageLine],
    *,
    account_id: int,
    since: float,
    until: float,
    group_by: GroupBy,
    key_id: int | None,
    ledger_charged: int,
    credits: Sequence[CreditRecord] = (),
) -> dict[str, object]:
    """What `GET /v1/usage` answers and `--format json` prints: the lines, their totals, and what
    the ledger charged the account in the same window (`ledger_charged` µUSD, every key's), the
    figure the lines' cost adds up to when they cover every key and no log row was purged; and
    the account's `credits` in the window (credits and deposits, every key's: money comes to
    an account, not a key), summed in the ledger section."""
    cost = sum(line.cost_micro for line in lines)
    credited = sum(credit.micro_usd for credit in credits)
    deposited = sum(credit.micro_usd for credit in credits if credit.kind == "deposit")
    return {
        "object": "usage",
        "account_id": account_id,
        "key_id": key_id,
        "since": since,
        "until": until,
        "group_by": group_by,
        "data": [line_fields(line) for line in lines],
        "total": {
            "requests": sum(line.requests for line in lines),
            "errors": sum(line.errors for line in lines),
            "prompt_tokens": sum(line.prompt_tokens for line in lines),
            "cached_tokens": sum(line.cached_tokens for line in lines),
            "completion_tokens": sum(line.completion_tokens for line in lines),
            "reasoning_tokens": sum(line.reasoning_tokens for line in lines),
            "cost_micro_usd": cost,
            "cost_usd": cost_usd(cost),
        },
        "ledger": {
            "charged_micro_usd": ledger_charged,
            "charged_usd": cost_usd(ledger_charged),
            "credited_micro_usd": credited,
            "credited_usd": cost_usd(credited),
            "deposited_micro_usd": deposited,
            "deposited_usd": cost_usd(deposited),
        },
        "credits": [credit_fields(credit) for credit in credits],
    }
