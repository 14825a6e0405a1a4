"""Money as people read it: micro-dollars (µUSD, the ledger's unit) as exact dollar text.

One function for every place a balance, charge or limit is shown (`engy-node gateway …`, the
TUI's buyers, alerts), so a figure never reads differently in two places. Exact, not rounded:
a sub-cent charge such as 150 µUSD is `$0.000150`, never `$0.0000`, and printed amounts add up
to the ledger's totals. Pure, with no imports, so the headless core and the TUI share it.
"""

from __future__ import annotations

__all__ = ["MICRO_USD_PER_USD", "USD_DECIMALS", "format_usd"]

MICRO_USD_PER_USD = 1_000_000
USD_DECIMALS = len(str(MICRO_USD_PER_USD)) - 1
"""Decimal places of a dollar amount the ledger can hold exactly (6: one micro-dollar)."""


def format_usd(micro: int) -> str:
    """`12_345_678` → `"$12.345678"`, `150` → `"$0.000150"`, `-1` → `"-$0.000001"`: every
    micro-dollar shown, so a non-zero amount never reads as zero."""
    sign = "-" if micro < 0 else ""
    dollars, micros = divmod(abs(micro), MICRO_USD_PER_USD)
    return f"{sign}${dollars}.{micros:0{USD_DECIMALS}d}"
