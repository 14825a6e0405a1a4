"""`format_usd`: exact micro-dollars as text, the one money format of the CLI, the TUI and alerts."""

from __future__ import annotations

import decimal
import re

from hypothesis import given
from hypothesis import strategies as st

from engy_node.money import MICRO_USD_PER_USD, format_usd


@given(micro=st.integers(min_value=-(10**15), max_value=10**15))
def test_the_text_is_the_exact_decimal_of_the_micro_dollars(micro):
    text = format_usd(micro)
    assert re.fullmatch(r"-?\$\d+\.\d{6}", text)
    assert decimal.Decimal(text.replace("$", "")) * MICRO_USD_PER_USD == micro


@given(micro=st.integers(min_value=-(10**15), max_value=10**15).filter(bool))
def test_a_non_zero_amount_never_reads_as_zero(micro):
    assert any(digit in "123456789" for digit in format_usd(micro))


def test_sub_cent_charges_show_as_such():
    assert format_usd(150) == "$0.000150"
    assert format_usd(1) == "$0.000001"
    assert format_usd(0) == "$0.000000"
    assert format_usd(25_000_000) == "$25.000000"
