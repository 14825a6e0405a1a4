"""Tests for the dev chain's Balances pallet (engy_node/local/devchain_balances.py), driven through the
REAL bittensor SDK: `bt.Transfer` signed by a real wallet, and the block's contents and
`System.Events` read back the way a gateway's deposit watcher reads them."""

from __future__ import annotations

import bittensor as bt
import pytest

from engy_node.local.devchain import DevChain
from engy_node.local.devchain_balances import EXISTENTIAL_DEPOSIT_RAO

RAO = 10**9
DEST = "5DAAnrj7VHTznn2AWBemMuyBwZWs6FNFjdyVXUeYum3PTXFy"  # //Dave


@pytest.fixture(autouse=True)
def sdk_files_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))
    monkeypatch.setenv("BITTENSOR_RUNTIME_CACHE_DIR", str(tmp_path / "runtime-cache"))


@pytest.fixture
def chain():
    return DevChain(clock=lambda: 0.0, start_block=1000)


@pytest.fixture
def sub(chain):
    client = bt.SyncClient("local", substrate=chain, fallback_endpoints=[])
    yield client
    client.close()


@pytest.fixture
def buyer(tmp_path):
    wallet = bt.Wallet("buyer", "hotkey", path=str(tmp_path / "wallets"))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    return wallet


def transfer(sub, wallet, amount, *, keep_alive=True):
    intent = bt.Transfer(dest_ss58=DEST, amount_tao=amount, keep_alive=keep_alive)
    return sub.execute(intent, wallet, wait_for_finalization=False)


def test_a_transfer_moves_the_balance_and_its_block_carries_the_extrinsic_and_the_events(chain, sub, buyer):
    sender = buyer.coldkeypub.ss58_address
    chain.fund(sender, 5)
    result = transfer(sub, buyer, 1.5)
    assert result.success and result.extrinsic_id.endswith("-0001")
    number = int(result.extrinsic_id.split("-")[0])
    assert chain.free_balance(sender) == int(3.5 * RAO) and chain.free_balance(DEST) == int(1.5 * RAO)
    info = sub.block_info(number)
    assert info.hash == result.block_hash and info.header["parentHash"] == sub.block_info(number - 1).hash
    calls = [(e["call"]["call_module"], e["call"]["call_function"]) for e in info.extrinsics]
    assert calls == [("Timestamp", "set"), ("Balances", "transfer_keep_alive")]
    events = sub.query(("System", "Events"), block=number)
    transfers = [e for e in events if e["event"]["event_id"] == "Transfer"]
    assert transfers == [
        {
            "event": {
                "module_id": "Balances",
                "event_id": "Transfer",
                "attributes": {"from": sender, "to": DEST, "amount": int(1.5 * RAO)},
            },
            "topics": [],
            "extrinsic_idx": 1,
            "phase": {"ApplyExtrinsic": 1},
        }
    ]
    assert sub.query(("System", "Events"), block=number - 1) == []


def test_a_transfer_above_the_balance_fails_in_its_block_without_a_transfer_event(chain, sub, buyer):
    chain.fund(buyer.coldkeypub.ss58_address, 1)
    result = transfer(sub, buyer, 2)
    assert not result.success and result.error.name == "InsufficientBalance"
    number = int(result.extrinsic_id.split("-")[0])
    ids = [e["event"]["event_id"] for e in sub.query(("System", "Events"), block=number)]
    assert ids == ["ExtrinsicFailed"]
    assert chain.free_balance(DEST) == 0


def test_keep_alive_refuses_to_empty_the_sender_and_allow_death_reaps_it(chain, sub, buyer):
    sender = buyer.coldkeypub.ss58_address
    chain.fund(sender, 1)
    assert transfer(sub, buyer, 1).error.name == "Expendability"
    assert transfer(sub, buyer, 1, keep_alive=False).success
    assert chain.free_balance(sender) == 0 and chain.free_balance(DEST) == RAO
    assert sub.query(("System", "Account"), [DEST])["data"]["free"] == RAO
    assert EXISTENTIAL_DEPOSIT_RAO == 500


def test_balances_and_block_events_survive_save_and_load(chain, sub, buyer, tmp_path):
    chain.fund(buyer.coldkeypub.ss58_address, 2)
    number = int(transfer(sub, buyer, 1).extrinsic_id.split("-")[0])
    loaded = DevChain.load(chain.save(tmp_path / "chain.json"), clock=lambda: 0.0)
    assert loaded.free_balance(DEST) == RAO
    again = bt.SyncClient("local", substrate=loaded, fallback_endpoints=[])
    try:
        assert [e["event"]["event_id"] for e in again.query(("System", "Events"), block=number)][0] == "Transfer"
    finally:
        again.close()
