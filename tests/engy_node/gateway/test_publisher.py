"""The epoch publisher over a real store: epochs close on schedule after their grace, the payload
verifies against the master hotkey, key-admitted miners are paid through their registered
hotkey, and a restarted gateway serves the same bytes rather than a new signature."""

from __future__ import annotations

import json

import pytest
import trio

from engy_node.gateway.billing.epochs import EpochClock
from engy_node.gateway.billing.publisher import OWNER_NOT_SET, EpochPublisher
from engy_node.gateway.billing.settlement import GateMinimums
from engy_node.gateway.store import RequestLogEntry, Store, VerdictRecord
from engy_node.hub import Hub
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.epoch import parse_and_verify
from tests.waiting import Changes

GENESIS = 1_000_000
CLOCK = EpochClock(genesis=GENESIS, epoch_s=60, grace_s=10)
MODEL = SMOLLM2_135M.id


class Wall:
    """The publisher's wall clock, counting its reads (one publisher to a wall)."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.reads = 0
        self.read = Changes()

    def __call__(self) -> float:
        self.reads += 1
        self.read.notify()
        return self.now

    async def first_pass_over(self) -> None:
        """Return once the publisher's first pass is over: it has decided which epochs are due and
        stored any it closed. A pass reads the wall at its top, for the close time of each epoch it
        stores, and after storing them to plan its sleep (`first_seen` comes from the store, which
        has requests in these tests), so the third read comes after a pass that closed an epoch has
        stored it, or begins the pass after one that closed none."""
        await self.read.wait_for(lambda: self.reads >= 3, timeout_s=30, what="the publisher's first pass over")


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "gateway.sqlite3") as opened:
        yield opened


def serve(
    store: Store, miner: str, *, at: float, request_id: str, tokens: int = 500, verdict: str | None = "pass"
) -> None:
    store.log_request(
        RequestLogEntry(
            request_id=request_id,
            account_id=store.create_buyer(f"b-{request_id}")[0],
            miner=miner,
            model=MODEL,
            api="openai",
            kind="paid",
            status=200,
            prompt_tokens=tokens,
            completion_tokens=tokens,
            cached_tokens=0,
            cost_micro=10,
            ttft_ms=100.0,
            tpot_ms=10.0,
            created_at=at,
        )
    )
    if verdict:
        store.record_verdict(
            VerdictRecord(
                request_id=request_id,
                miner=miner,
                model=MODEL,
                kind="paid",
                verdict=verdict,
                reason="ok" if verdict == "pass" else "chunks",
                verifier="local",
                request_created_at=at,
                judged_at=at + 1,
            )
        )


def publisher(store: Store, wall: Wall, master, owner: str) -> EpochPublisher:
    return EpochPublisher(
        store=store,
        clock=CLOCK,
        netuid=53,
        master=master,
        owner_hotkey=owner,
        models={MODEL: SMOLLM2_135M},
        minimums=GateMinimums(1, 1, 1),
        hub=Hub(),
        wall=wall,
    )


async def test_an_epoch_is_published_after_its_grace_signed_and_the_same_after_a_restart(nursery, store, alice, bob):
    honest_id, _ = store.register_miner("honest", hotkey=bob.ss58_address)
    serve(store, f"key:{honest_id}", at=GENESIS + 5, request_id="r1")
    serve(store, "5CheaterHotkeyxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", at=GENESIS + 6, request_id="r2", verdict="cheat")
    wall = Wall(GENESIS + 69.95)  # it sleeps 0.05 s until epoch 0 closes, and looks again
    first = publisher(store, wall, alice, alice.ss58_address)
    await nursery.start(first.run)
    await wall.first_pass_over()
    assert store.latest_epoch() is None, "epoch 0 is still in its grace"
    wall.now = GENESIS + 70.5
    with trio.fail_after(60):
        while not first.published:
            await trio.sleep(0.05)
    index, payload = store.latest_epoch()
    assert index == 0 and first.published == [0]
    epoch = parse_and_verify(payload, master_hotkey=alice.ss58_address, netuid=53)
    assert dict(epoch.weights) == {bob.ss58_address: 65535}
    result = json.loads(json.loads(payload)["result_json"])
    assert (result["start"], result["end"]) == (GENESIS, GENESIS + 60)
    assert {row["gate_reason"] for row in result["rows"]} == {None, "cheat"}

    restarted_wall = Wall(GENESIS + 129.95)  # epoch 0 long closed, epoch 1 closing 0.05 s later
    restarted = publisher(store, restarted_wall, alice, alice.ss58_address)
    await nursery.start(restarted.run)
    await restarted_wall.first_pass_over()
    assert restarted.published == [] and store.latest_epoch() == (0, payload)


async def test_a_quiet_epoch_burns_to_the_owner(nursery, store, alice, bob):
    wall = Wall(GENESIS + 5.0)
    quiet = publisher(store, wall, alice, bob.ss58_address)
    await nursery.start(quiet.run)
    wall.now = GENESIS + 71
    with trio.fail_after(60):
        while store.latest_epoch() is None:
            await trio.sleep(0.05)
    assert dict(parse_and_verify(store.latest_epoch()[1], master_hotkey=alice.ss58_address, netuid=53).weights) == {
        bob.ss58_address: 65535
    }


async def test_the_current_epoch_is_shown_unsigned_even_without_keys(store, bob):
    honest_id, _ = store.register_miner("honest", hotkey=bob.ss58_address)
    serve(store, f"key:{honest_id}", at=GENESIS + 65, request_id="r1")
    current = await publisher(store, Wall(GENESIS + 70), None, "").current()
    assert (current["epoch_index"], current["final"], current["closes_at"]) == (1, False, GENESIS + 130)
    assert current["weights"] == [[bob.ss58_address, 65535]]
    empty = await publisher(store, Wall(GENESIS + 200), None, "").current()
    assert empty["weights"] == [[OWNER_NOT_SET, 65535]]
