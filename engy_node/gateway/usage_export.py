"""`engy-node gateway usage ACCOUNT`: an account's usage per key, day and model, as a table, CSV
or JSON, read from the store the gateway writes (the shell of `billing.usage`).

The same report `GET /v1/usage` answers a buyer (`api/generations.py`), for an operator at a
shell: the JSON is that route's document, the CSV its lines and the window's credits and
deposits, and each carries what the ledger charged the account in the same window, which the
lines' cost adds up to when they cover every key and nothing was purged from the request log.
"""

from __future__ import annotations

import json
from typing import Literal

from engy_node.gateway.billing import usage
from engy_node.gateway.billing.costs import cost_usd
from engy_node.gateway.store import Store

Format = Literal["table", "csv", "json"]
FORMATS: tuple[Format, ...] = ("table", "csv", "json")


def export_usage(
    store: Store,
    *,
    account_id: int,
    since: float,
    until: float,
    key_id: int | None = None,
    group_by: usage.GroupBy = "day",
    fmt: Format = "table",
) -> str:
    """The account's paid requests logged in `[since, until)` (unix seconds), summed per key
    (only `key_id`'s when given), day (`group_by`) and model, in `fmt`."""
    rows = store.account_requests(account_id, since=since, until=until)
    if key_id is not None:
        rows = [row for row in rows if row.key_id == key_id]
    lines = usage.usage_report(rows, group_by=group_by)
    credits = store.credits_between(account_id, since=since, until=until)
    if fmt == "csv":
        # A key's lines only: credits come to the account, not to a key.
        return usage.as_csv(lines, credits if key_id is None else ())
    charged = store.charged_between(account_id, since=since, until=until)
    if fmt == "json":
        document = usage.usage_document(
            lines,
            account_id=account_id,
            since=since,
            until=until,
            group_by=group_by,
            key_id=key_id,
            ledger_charged=charged,
            credits=credits,
        )
        return json.dumps(document, indent=2) + "\n"
    window = f"{usage.utc_day(since)} to {usage.utc_day(until)}"
    title = f"account {account_id}{'' if key_id is None else f', key {key_id}'}, {window}"
    ledger = f"ledger charged ${cost_usd(charged)} in the window\n{usage.credits_table(credits)}"
    return f"{title}\n{usage.as_table(lines)}\n{ledger}\n"
