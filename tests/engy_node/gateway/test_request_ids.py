"""Request ids: the shape buyers, miners and the store take, unique, and ordered by time."""

from __future__ import annotations

import re
import time

from engy_node.gateway.request.flight import new_request_id
from engy_node.gateway.store.checks import identifier

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_a_request_id_is_32_hex_digits_the_store_takes_and_every_one_is_different():
    ids = [new_request_id() for _ in range(20_000)]
    assert all(HEX32.fullmatch(request_id) and identifier("request_id", request_id) for request_id in ids)
    assert len(set(ids)) == len(ids)
    # Made within a few milliseconds, they share their time: what names their tool calls differs.
    assert len({request_id[-12:] for request_id in ids}) == len(ids)


def test_a_request_id_begins_with_the_millisecond_it_was_made_in_so_later_ids_sort_later():
    before_ms = time.time_ns() // 1_000_000
    first = new_request_id()
    time.sleep(0.002)
    second = new_request_id()
    after_ms = time.time_ns() // 1_000_000
    assert before_ms <= int(first[:12], 16) < int(second[:12], 16) <= after_ms
    assert first < second
