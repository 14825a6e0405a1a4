"""epochs: a published payload is stored byte for byte, once; the same bytes again are a no-op,
other bytes are refused, and the database itself refuses any change."""

from __future__ import annotations

import hashlib

import pytest

from engy_node.gateway.store import Store, StoreError
from tests.engy_node.gateway.store.support import INTEGRITY_ERRORS, raw

PAYLOAD = b'{"v":1,"epoch_index":7,"result_json":"{\\"weights\\":[]}"}'
DIGEST = hashlib.sha256(b'{"weights":[]}').hexdigest()


def test_an_epoch_is_stored_byte_for_byte_and_saving_it_again_is_a_no_op(store, location):
    assert store.epoch_payload(7) is None and store.latest_epoch() is None
    assert store.save_epoch(7, PAYLOAD, DIGEST, closed_at=1_000.0) is True
    assert store.save_epoch(7, PAYLOAD, DIGEST, closed_at=2_000.0) is False
    with Store(location) as other:  # a second gateway process closing the same epoch
        assert other.save_epoch(7, PAYLOAD, DIGEST, closed_at=3_000.0) is False
    assert store.epoch_payload(7) == PAYLOAD
    with raw(location) as conn:
        assert conn.execute("SELECT epoch_index, digest, closed_at FROM epochs").fetchall() == [(7, DIGEST, 1_000.0)]


def test_other_bytes_for_a_published_epoch_are_refused(store):
    store.save_epoch(7, PAYLOAD, DIGEST, closed_at=1_000.0)
    with pytest.raises(StoreError, match="epoch 7 was already published with other bytes"):
        store.save_epoch(7, PAYLOAD + b" ", DIGEST, closed_at=1_000.0)
    with pytest.raises(StoreError, match="already published"):
        store.save_epoch(7, PAYLOAD, "f" * 64, closed_at=1_000.0)
    assert store.epoch_payload(7) == PAYLOAD


def test_the_latest_epoch_is_the_highest_index_whatever_the_order_saved(store):
    store.save_epoch(3, b"three", DIGEST, closed_at=3.0)
    store.save_epoch(10, b"ten", DIGEST, closed_at=1.0)
    store.save_epoch(5, b"five", DIGEST, closed_at=5.0)
    assert store.latest_epoch() == (10, b"ten")
    assert store.epoch_payload(5) == b"five"


def test_the_database_refuses_to_update_or_delete_a_published_epoch(store, location, backend):
    store.save_epoch(7, PAYLOAD, DIGEST, closed_at=1_000.0)
    with raw(location) as conn:
        with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
            conn.execute("UPDATE epochs SET payload = ?", (b"\x00",))
        with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
            conn.execute("DELETE FROM epochs")
        if backend == "sqlite":
            # REPLACE would delete the stored row without firing the delete trigger.
            with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
                conn.execute("INSERT OR REPLACE INTO epochs VALUES (7, x'00', ?, 0)", (DIGEST,))
        else:
            with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
                conn.execute(
                    "INSERT INTO epochs VALUES (7, ?, ?, 0) ON CONFLICT (epoch_index) DO UPDATE SET payload = "
                    "excluded.payload",
                    (b"\x00", DIGEST),
                )
            with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
                conn.execute("TRUNCATE epochs")
        with pytest.raises(INTEGRITY_ERRORS):
            conn.execute("INSERT INTO epochs VALUES (-1, ?, ?, 0)", (b"\x00", DIGEST))
    assert store.epoch_payload(7) == PAYLOAD


@pytest.mark.parametrize(
    ("epoch_index", "payload", "digest", "closed_at", "error"),
    [
        (-1, PAYLOAD, DIGEST, 1.0, ValueError),
        (True, PAYLOAD, DIGEST, 1.0, ValueError),
        (7, PAYLOAD.decode(), DIGEST, 1.0, TypeError),
        (7, bytearray(PAYLOAD), DIGEST, 1.0, TypeError),
        (7, PAYLOAD, DIGEST.upper(), 1.0, ValueError),
        (7, PAYLOAD, DIGEST[:-1], 1.0, ValueError),
        (7, PAYLOAD, "sha256:" + DIGEST, 1.0, ValueError),
        (7, PAYLOAD, DIGEST, float("nan"), ValueError),
    ],
)
def test_a_malformed_epoch_is_refused_before_anything_is_written(store, epoch_index, payload, digest, closed_at, error):
    with pytest.raises(error):
        store.save_epoch(epoch_index, payload, digest, closed_at=closed_at)
    assert store.latest_epoch() is None
