"""miners: a registered miner's key admits it, and names and hotkeys are unique."""

from __future__ import annotations

import pytest

from engy_node.gateway.store import MINER_KEY_PREFIX, StoreError


def test_a_registered_miners_key_authenticates_it(store, clock):
    miner_id, miner_key = store.register_miner("rig-1", hotkey="5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY")
    assert miner_key.startswith(MINER_KEY_PREFIX)
    record = store.authenticate_miner(miner_key)
    assert (record.miner_id, record.name, record.created_at) == (miner_id, "rig-1", clock.now)
    second_id, _ = store.register_miner("rig-2")
    assert [(m.miner_id, m.hotkey) for m in store.list_miners()] == [(miner_id, record.hotkey), (second_id, None)]
    assert store.authenticate_miner(MINER_KEY_PREFIX + "forged") is None
    _, buyer_key = store.create_buyer("buyer")
    assert store.authenticate_miner(buyer_key) is None
    assert store.authenticate(miner_key) is None


def test_miner_names_and_hotkeys_are_unique(store):
    store.register_miner("rig-1", hotkey="5Hot")
    with pytest.raises(StoreError, match="rig-1"):
        store.register_miner("rig-1")
    with pytest.raises(StoreError, match="rig-1"):
        store.register_miner("rig-9", hotkey="5Hot")
