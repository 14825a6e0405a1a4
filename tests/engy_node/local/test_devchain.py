"""Tests for the dev chain (engy_node/local/devchain.py), driven through the REAL bittensor SDK.

Every test talks to the chain as a validator would: `bt.SyncClient("local", substrate=chain)` with
real wallets in tmp_path, so the SDK's reads, preflight, call composition and result mapping all
run. The chain's clock is manual, so no test sleeps.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import threading

import bittensor as bt
import pytest
from bittensor import storage
from bittensor._substrate import Substrate
from bittensor.settings import DEFAULT_ERA_PERIOD

from engy_node.local import devchain
from engy_node.local.devchain import DevChain
from engy_node.local.devchain_state import SubnetParams

NETUID = 53
START = 1000
RATE_LIMIT = 100
TEMPO = 360
# Addresses of the dev keys //m1 and //m2, for neurons that never sign anything.
HOTKEY_A = "5E1gvigY1X7zdvf4bU3RgrgKH1Wknt1kGwyG2usTjQF77Hic"
HOTKEY_B = "5CwFVdzQ5o5Qg7EmXLoZFxbi1zAnSKL3dPSSRrUkAWzPPbaa"


class ManualClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def sdk_files_in_tmp(tmp_path, monkeypatch):
    # connect() caches token symbols and runtime metadata under ~/.bittensor unless told otherwise.
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))
    monkeypatch.setenv("BITTENSOR_RUNTIME_CACHE_DIR", str(tmp_path / "runtime-cache"))


@pytest.fixture
def wallet(tmp_path):
    def make(name: str) -> bt.Wallet:
        created = bt.Wallet(name, "hotkey", path=str(tmp_path / "wallets"))
        created.create_new_coldkey(use_password=False, suppress=True)
        created.create_new_hotkey(use_password=False, suppress=True)
        return created

    return make


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def chain(clock):
    return DevChain(clock=clock, start_block=START)


@pytest.fixture
def connect():
    """Open SDK clients over dev chains; every client is closed at teardown."""
    clients = []

    def open_client(dev_chain: DevChain) -> bt.SyncClient:
        client = bt.SyncClient("local", substrate=dev_chain, fallback_endpoints=[])
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


@pytest.fixture
def sub(chain, connect):
    return connect(chain)


@pytest.fixture
def network(chain, wallet):
    """One staked validator (uid 1) and two miners (uids 2 and 3, with wallets so they can sign)."""
    validator, miner_a, miner_b = wallet("validator"), wallet("miner-a"), wallet("miner-b")
    chain.register(validator.hotkey.ss58_address, validator.coldkeypub.ss58_address, stake_tao=1000)
    chain.register(miner_a.hotkey.ss58_address, miner_a.coldkeypub.ss58_address)
    chain.register(miner_b.hotkey.ss58_address, miner_b.coldkeypub.ss58_address)
    return validator, miner_a, miner_b


def set_weights(sub, signer, uids, weights, netuid=NETUID):
    return sub.execute(
        bt.SetWeights(netuid=netuid, uids=uids, weights=weights),
        signer,
        wait_for_inclusion=True,
        wait_for_finalization=False,
        period=32,
    )


# --- reads ---------------------------------------------------------------------------------------------


def test_the_block_follows_the_clock_and_advance(chain, sub, clock):
    assert sub.block == START
    clock.now += 11.9
    assert sub.block == START
    clock.now += 0.1
    assert sub.block == START + 1
    assert chain.advance(5) == START + 6
    assert sub.block == START + 6
    assert sub.finalized_block == START + 6 - devchain.FINALITY_LAG
    assert sub.block_time() == 12.0


def test_the_block_time_comes_from_the_aura_slot_duration(clock, connect):
    fast = DevChain(clock=clock, block_time_s=1.0)
    fast_sub = connect(fast)
    assert fast_sub.block_time() == 1.0
    assert fast_sub.constant(("Aura", "SlotDuration")) == 1000
    assert fast_sub.is_fast_blocks() is False  # fast blocks are the 0.25 s of subtensor's localnet
    clock.now += 10
    assert fast_sub.block == START + 10


def test_the_metagraph_reports_owner_registrations_stake_and_permits(chain, sub, network):
    validator, miner_a, _ = network
    graph = sub.subnets.metagraph(NETUID, commitments=False)
    assert graph.netuid == NETUID and graph.block == START and graph.tempo == TEMPO and len(graph) == 4
    owner = graph.neuron(0)
    assert graph.owner_hotkey == owner.hotkey == chain.neurons()[0].hotkey
    assert sub.query(storage.SubtensorModule.SubnetOwnerHotkey, [NETUID]) == owner.hotkey
    # The owner always holds a permit, the staked validator earns one, unstaked miners do not.
    assert [n.validator_permit for n in graph] == [True, True, False, False]
    assert [n.uid for n in graph.validators] == [0, 1]
    assert graph.neuron(1).hotkey == validator.hotkey.ss58_address
    assert graph.neuron(1).coldkey == validator.coldkeypub.ss58_address
    assert graph.neuron(1).total_stake.alpha == pytest.approx(1000)
    # Registration stamps last_update, as the chain does.
    assert all(n.last_update == START and n.block_at_registration == START for n in graph)
    assert graph.neuron(2).incentive == 0.0 and graph.neuron(2).emission.rao == 0
    assert sub.neurons.uid(miner_a.hotkey.ss58_address, NETUID) == 2
    assert sub.subnets.metagraph(99, commitments=False) is None
    # A block-pinned snapshot reads the same state.
    snapshot = sub.at()
    assert snapshot.block == START
    assert len(snapshot.subnets.metagraph(NETUID, commitments=False)) == 4


def test_hyperparameters_report_the_activity_cutoff_derived_from_factor_and_tempo(clock, connect):
    params = SubnetParams(tempo=100, activity_cutoff_factor_milli=20_000, weights_rate_limit=7, commit_reveal=True)
    dev = DevChain(clock=clock, params=params)
    client = connect(dev)
    hyperparameters = client.subnets.subnet_hyperparameters(NETUID)
    assert hyperparameters["tempo"] == 100
    assert hyperparameters["activity_cutoff"] == 2000
    assert hyperparameters["activity_cutoff_factor"] == 20_000
    assert hyperparameters["weights_rate_limit"] == 7
    assert hyperparameters["kappa"] == 32767
    assert client.hyperparameters.weights_rate_limit(NETUID) == 7
    assert client.subnets.commit_reveal_enabled(NETUID) is True
    assert client.subnets.subnet_hyperparameters(99) is None
    default = connect(DevChain(clock=clock))
    assert default.subnets.subnet_hyperparameters(NETUID)["activity_cutoff"] == 5000  # 13889 per mille of 360


# --- set weights ---------------------------------------------------------------------------------------


def test_set_weights_is_applied_in_the_next_block_and_stored(chain, sub, network):
    validator, _, _ = network
    chain.advance(RATE_LIMIT)
    head = sub.block
    result = set_weights(sub, validator, [2, 3], [3, 1])
    assert result.success, result
    assert result.extrinsic_id == f"{head + 1}-0001"
    assert result.block_hash == asyncio.run(chain.block_hash(head + 1))
    assert sub.block == head + 1
    # Stored max-upscaled, as the SDK sends it and the pallet keeps it.
    assert chain.weights() == {1: {2: 65535, 3: 21845}}
    assert sub.weights.weights(NETUID) == {1: {2: 0.75, 3: 0.25}}
    assert sub.subnets.metagraph(NETUID, commitments=False).neuron(1).last_update == head + 1
    assert sub.epochs.blocks_since_last_update(NETUID, 1) == 0
    last = chain.submissions[-1]
    assert (last.block, last.netuid, last.hotkey, last.call, last.ok, last.error) == (
        head + 1,
        NETUID,
        validator.hotkey.ss58_address,
        "SubtensorModule.set_mechanism_weights",
        True,
        None,
    )


def test_a_second_set_inside_the_rate_limit_is_refused_by_the_preflight_without_an_extrinsic(chain, sub, network):
    validator, _, _ = network
    chain.advance(RATE_LIMIT)
    assert set_weights(sub, validator, [2, 3], [1, 1]).success
    last_update = chain.neurons()[1].last_update
    chain.advance(last_update + RATE_LIMIT - 1 - chain.block)
    with pytest.raises(bt.ChainError) as refused:
        set_weights(sub, validator, [2, 3], [1, 2])
    assert refused.value.code == bt.ErrorCode.RATE_LIMITED
    assert "last set 99 blocks ago" in str(refused.value)
    assert len(chain.submissions) == 1
    # At exactly the limit the chain allows it again.
    chain.advance(1)
    assert set_weights(sub, validator, [2, 3], [1, 2]).success


def test_a_newly_registered_validator_waits_one_rate_limit_window(chain, sub, network):
    validator, _, _ = network
    with pytest.raises(bt.ChainError) as refused:
        set_weights(sub, validator, [2], [1])
    assert refused.value.code == bt.ErrorCode.RATE_LIMITED
    chain.advance(RATE_LIMIT)
    assert set_weights(sub, validator, [2], [1]).success


def test_weights_from_a_hotkey_without_a_permit_fail_on_chain(chain, sub, network):
    _, miner_a, _ = network
    chain.advance(RATE_LIMIT)
    head = sub.block
    result = set_weights(sub, miner_a, [1, 3], [1, 1])
    assert not result.success
    assert result.error.name == "NeuronNoValidatorPermit"
    assert result.error.code == bt.ErrorCode.NOT_AUTHORIZED
    assert result.message == "The caller is attempting to set non-self weights without being a permitted validator."
    assert result.extrinsic_id == f"{head + 1}-0001"  # included, and failed
    assert chain.weights() == {}
    assert chain.submissions[-1].error == "NeuronNoValidatorPermit"
    # A weight on itself alone needs no permit.
    chain.advance(RATE_LIMIT)
    assert set_weights(sub, miner_a, [2], [1]).success
    assert chain.weights() == {2: {2: 65535}}


def test_an_injected_pool_rejection_fails_without_a_block_or_a_state_change(chain, sub, network):
    validator, _, _ = network
    chain.advance(RATE_LIMIT)
    head = sub.block
    chain.reject_next(6)
    result = set_weights(sub, validator, [2, 3], [1, 1])
    assert not result.success
    assert result.error.name == "RateLimitExceeded"
    assert result.error.code == bt.ErrorCode.RATE_LIMITED
    assert result.extrinsic_id is None
    assert sub.block == head
    assert chain.weights() == {}
    assert (chain.submissions[-1].ok, chain.submissions[-1].error) == (False, "RateLimitExceeded")
    assert set_weights(sub, validator, [2, 3], [1, 1]).success


def test_an_unregistered_hotkey_is_refused_by_the_preflight(chain, sub, network, wallet):
    stranger = wallet("stranger")
    with pytest.raises(bt.ChainError) as refused:
        set_weights(sub, stranger, [2], [1])
    assert refused.value.code == bt.ErrorCode.NOT_REGISTERED
    assert chain.submissions == []


@pytest.mark.parametrize(
    ("dests", "weights", "blocks_first", "error_name", "code"),
    [
        ([2, 2], [1, 1], RATE_LIMIT, "DuplicateUids", "invalid_argument"),
        ([2, 9], [1, 1], RATE_LIMIT, "UidVecContainInvalidOne", "invalid_argument"),
        ([2, 3], [1], RATE_LIMIT, "WeightVecNotEqualSize", "invalid_argument"),
        ([2, 3], [1, 1], RATE_LIMIT - 2, "SettingWeightsTooFast", "rate_limited"),
    ],
)
def test_raw_calls_meet_the_chains_own_checks(chain, sub, network, dests, weights, blocks_first, error_name, code):
    # submit_call skips the intent's preflight, so these reach the chain as a careless client would send them.
    validator, _, _ = network
    chain.advance(blocks_first)
    call = bt.calls.SubtensorModule.set_mechanism_weights(
        netuid=NETUID, mecid=0, dests=dests, weights=weights, version_key=0
    )
    result = sub.submit_call(call, validator, signer="hotkey", wait_for_finalization=False)
    assert not result.success
    assert (result.error.name, result.error.code.value) == (error_name, code)
    assert chain.weights() == {}


def test_calls_the_dev_chain_does_not_implement_are_refused_before_signing(sub, network):
    validator, _, _ = network
    call = bt.calls.SubtensorModule.serve_axon(
        netuid=NETUID, version=1, ip=0, port=1, ip_type=4, protocol=4, placeholder1=0, placeholder2=0
    )
    with pytest.raises(bt.ChainError, match="does not support the call SubtensorModule.serve_axon"):
        sub.submit_call(call, validator, signer="hotkey", wait_for_finalization=False)


def test_not_waiting_for_inclusion_still_applies_the_call(chain, sub, network):
    validator, _, _ = network
    chain.advance(RATE_LIMIT)
    result = sub.execute(
        bt.SetWeights(netuid=NETUID, uids=[2], weights=[1]),
        validator,
        wait_for_inclusion=False,
        wait_for_finalization=False,
    )
    assert result.success and result.message == "Submitted (not waiting)."
    assert chain.weights() == {1: {2: 65535}}


def test_with_commit_reveal_on_a_commit_bumps_last_update_but_is_never_revealed(chain, sub, network):
    validator, _, _ = network
    chain.set_hyperparameters(commit_reveal=True)
    chain.advance(RATE_LIMIT)
    head = sub.block
    result = set_weights(sub, validator, [2, 3], [3, 1])
    assert result.success, result
    assert "reveal_round" in result.data
    assert chain.submissions[-1].call == "SubtensorModule.commit_timelocked_mechanism_weights"
    assert chain.neurons()[1].last_update == head + 1
    assert chain.weights() == {}
    pending = sub.weights.timelocked_weight_commits(NETUID)
    [(epoch, [commit])] = pending.items()
    assert (commit["hotkey"], commit["commit_block"], commit["reveal_round"]) == (
        validator.hotkey.ss58_address,
        head + 1,
        result.data["reveal_round"],
    )
    chain.advance(TEMPO * 2)
    assert chain.weights() == {}
    # A plain set is refused on a commit-reveal subnet, as on chain.
    call = bt.calls.SubtensorModule.set_mechanism_weights(netuid=NETUID, mecid=0, dests=[2], weights=[1], version_key=0)
    refused = sub.submit_call(call, validator, signer="hotkey", wait_for_finalization=False)
    assert refused.error.name == "CommitRevealEnabled"


# --- epochs ---------------------------------------------------------------------------------------------------


def test_an_epoch_turns_one_validators_weights_into_proportional_incentive(chain, sub, network):
    validator, _, _ = network
    chain.advance(RATE_LIMIT)
    assert set_weights(sub, validator, [2, 3], [3, 1]).success
    assert sub.epochs.blocks_until_next_epoch(NETUID) == START + TEMPO - sub.block
    chain.advance(START + TEMPO - 1 - sub.block)
    assert sub.subnets.metagraph(NETUID, commitments=False).neuron(2).incentive == 0.0
    assert chain.epochs_run == 0
    chain.advance(1)
    graph = sub.subnets.metagraph(NETUID, commitments=False)
    assert chain.epochs_run == 1
    assert graph.last_step == START + TEMPO and graph.blocks_since_last_step == 0
    assert graph.neuron(2).incentive == pytest.approx(0.75, abs=1e-4)
    assert graph.neuron(3).incentive == pytest.approx(0.25, abs=1e-4)
    assert graph.neuron(2).consensus == pytest.approx(0.75, abs=1e-4)
    assert graph.neuron(2).rank == graph.neuron(2).incentive
    assert graph.neuron(1).dividends == pytest.approx(1.0)
    assert graph.neuron(1).incentive == 0.0
    # One alpha per block over the tempo: half to the miners by incentive, half to the validator.
    assert graph.neuron(1).emission.alpha == pytest.approx(TEMPO / 2)
    assert graph.neuron(2).emission.alpha == pytest.approx(TEMPO * 0.375)
    assert graph.neuron(3).emission.alpha == pytest.approx(TEMPO * 0.125)
    assert graph.neuron(0).emission.rao == 0
    assert [n.incentive for n in chain.neurons()] == [n.incentive for n in graph]
    status = sub.epochs.epoch_status(NETUID)
    assert status["epoch_index"] == 1 and status["next_epoch_start_block"] == START + 2 * TEMPO


def test_a_validator_that_stops_setting_weights_goes_inactive(clock, connect, wallet):
    params = SubnetParams(tempo=50, weights_rate_limit=10, activity_cutoff_factor_milli=2_000)  # cutoff 100 blocks
    dev = DevChain(clock=clock, params=params)
    client = connect(dev)
    validator = wallet("validator")
    dev.register(validator.hotkey.ss58_address, stake_tao=10)
    dev.register(HOTKEY_A)
    dev.advance(10)
    assert set_weights(client, validator, [2], [1]).success
    dev.advance(START + 50 - dev.block)
    assert client.subnets.metagraph(NETUID, commitments=False).neuron(2).incentive == pytest.approx(1.0)
    # Three epochs later the last update is more than 100 blocks old.
    dev.advance(150)
    graph = client.subnets.metagraph(NETUID, commitments=False)
    assert not graph.neuron(1).active
    assert graph.neuron(2).incentive == 0.0
    # Nothing weighted and no active stake: emission goes to validators by stake.
    assert graph.neuron(1).emission.alpha == pytest.approx(50)
    assert dev.epochs_run == 4


def test_epochs_of_several_subnets_run_on_their_own_schedules(chain, connect):
    chain.advance(100)
    chain.add_subnet(54, params=SubnetParams(tempo=10), owner_stake_tao=5)
    client = connect(chain)
    assert client.subnets.metagraph(54, commitments=False).network_registered_at == START + 100
    chain.advance(25)
    assert client.epochs.epoch_status(54)["epoch_index"] == 2
    assert client.epochs.epoch_status(NETUID)["epoch_index"] == 0
    # The owner of subnet 54 has stake and nothing is weighted: it receives the emission.
    assert chain.neurons(54)[0].emission == pytest.approx(10.0)
    with pytest.raises(ValueError, match="already exists"):
        chain.add_subnet(54)


def test_a_shortened_tempo_runs_the_overdue_epoch_in_the_next_block(chain):
    chain.advance(100)
    chain.set_hyperparameters(tempo=50)
    assert chain.epochs_run == 0
    chain.advance(1)
    assert chain.epochs_run == 1


# --- registration and stake --------------------------------------------------------------------------------------


def test_registering_again_returns_the_same_uid_and_a_full_subnet_refuses(clock):
    dev = DevChain(clock=clock, params=SubnetParams(max_uids=2))
    assert dev.register(HOTKEY_A) == 1
    assert dev.register(HOTKEY_A, stake_tao=5) == 1
    with pytest.raises(ValueError, match="full"):
        dev.register(HOTKEY_B)
    with pytest.raises(KeyError):
        dev.register(HOTKEY_B, netuid=7)


def test_permits_follow_stake_changes_at_once(clock):
    dev = DevChain(clock=clock, params=SubnetParams(max_validators=2))
    dev.register(HOTKEY_A, stake_tao=10)
    dev.register(HOTKEY_B, stake_tao=20)
    assert [n.permit for n in dev.neurons()] == [True, True, True]  # two by stake, plus the owner
    dev.set_stake(HOTKEY_A, 0)
    assert [n.permit for n in dev.neurons()] == [True, False, True]
    with pytest.raises(ValueError):
        dev.set_stake(HOTKEY_B, -1)


# --- persistence ---------------------------------------------------------------------------------------------------


def test_save_and_load_continue_the_block_and_keep_weights_and_incentive(chain, sub, network, tmp_path, connect):
    validator, _, _ = network
    chain.advance(RATE_LIMIT)
    assert set_weights(sub, validator, [2, 3], [1, 1]).success
    chain.advance(START + TEMPO - chain.block)
    # Set again right after the epoch, so the saved chain holds a fresh last_update.
    assert set_weights(sub, validator, [2, 3], [3, 1]).success
    path = chain.save(tmp_path / "chain.json")
    saved_block, saved_neurons, saved_weights = chain.block, chain.neurons(), chain.weights()

    later = ManualClock()
    later.now = 5_000.0  # a different process: its monotonic clock has nothing to do with the old one
    restored = DevChain.load(path, clock=later)
    assert restored.block == saved_block
    assert restored.neurons() == saved_neurons
    assert restored.weights() == saved_weights
    assert restored.epochs_run == 1
    assert restored.submissions == chain.submissions
    later.now += 12
    assert restored.block == saved_block + 1
    client = connect(restored)
    graph = client.subnets.metagraph(NETUID, commitments=False)
    assert graph.neuron(2).incentive == pytest.approx(0.5, abs=1e-4)
    # The validator's rate limit carries over: its last update is remembered.
    with pytest.raises(bt.ChainError) as refused:
        set_weights(client, validator, [2, 3], [1, 1])
    assert refused.value.code == bt.ErrorCode.RATE_LIMITED
    # The weights saved just before the restart become incentive at the restored chain's next epoch.
    restored.advance(START + 2 * TEMPO - restored.block)
    assert restored.epochs_run == 2
    assert restored.neurons()[2].incentive == pytest.approx(0.75, abs=1e-4)


def test_a_chain_with_a_state_path_saves_after_every_applied_write(clock, connect, wallet, tmp_path):
    path = tmp_path / "state" / "devchain.json"
    dev = DevChain(clock=clock, state_path=path)
    validator = wallet("validator")
    dev.register(validator.hotkey.ss58_address, stake_tao=1)
    assert json.loads(path.read_text())["subnets"][0]["neurons"][1]["hotkey"] == validator.hotkey.ss58_address
    client = connect(dev)
    dev.advance(RATE_LIMIT)
    result = set_weights(client, validator, [1], [1])
    assert result.success
    saved = json.loads(path.read_text())
    assert saved["block"] == dev.block
    assert saved["subnets"][0]["weights"] == {"1": [[1, 65535]]}
    assert [p.name for p in path.parent.iterdir()] == ["devchain.json"]  # no temp files left behind
    # Closing the client saves the exact head; loading continues from it.
    clock.now += 12 * 7
    client.close()
    assert DevChain.load(path, clock=ManualClock()).block == START + RATE_LIMIT + 1 + 7


def test_loading_something_that_is_not_a_dev_chain_state_fails_clearly(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a engy-devchain/1 state file"):
        DevChain.load(path)
    with pytest.raises(ValueError, match="no path"):
        DevChain(clock=ManualClock()).save()


# --- the seam itself --------------------------------------------------------------------------------------------------


def test_the_protocol_methods_keep_the_sdk_signatures():
    protocol_methods = [
        name for name, member in vars(Substrate).items() if callable(member) and not name.startswith("_")
    ]
    assert "submit" in protocol_methods and "blocks" in protocol_methods
    for name in protocol_methods:
        expected = inspect.signature(getattr(Substrate, name))
        actual = inspect.signature(getattr(DevChain, name))
        shape = [(p.name, p.kind, p.default) for p in expected.parameters.values()]
        assert [(p.name, p.kind, p.default) for p in actual.parameters.values()] == shape, name
        # `blocks` is declared as a plain method returning an async iterator; an async generator is one.
        is_async = inspect.iscoroutinefunction(getattr(DevChain, name))
        assert is_async == inspect.iscoroutinefunction(getattr(Substrate, name)), name
    assert devchain.DEFAULT_ERA_PERIOD == DEFAULT_ERA_PERIOD


def test_importing_the_dev_chain_imports_no_bittensor_numpy_or_torch():
    probe = (
        "import sys, engy_node.local.devchain; "
        "print(sorted(m for m in ('bittensor', 'numpy', 'torch') if m in sys.modules))"
    )
    output = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"


def test_status_reads_from_other_threads_while_the_sdk_writes(chain, sub, network):
    validator, _, _ = network
    stop = threading.Event()
    failures: list[BaseException] = []

    def read_status() -> None:
        try:
            while not stop.is_set():
                assert len(chain.neurons()) == 4
                chain.weights()
                assert chain.block >= START
        except BaseException as error:  # noqa: BLE001 - reported to the test thread below
            failures.append(error)

    readers = [threading.Thread(target=read_status) for _ in range(3)]
    for reader in readers:
        reader.start()
    try:
        for round_index in range(5):
            chain.advance(RATE_LIMIT)
            assert set_weights(sub, validator, [2, 3], [round_index + 1, 1]).success
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    assert failures == []
    assert len(chain.submissions) == 5


def test_the_block_stream_yields_each_new_block(chain):
    async def first_headers(count: int) -> list[int]:
        numbers = []
        async for block in chain.blocks():
            numbers.append(int(block["header"]["number"]))
            if len(numbers) == 1:
                chain.advance(2)
            if len(numbers) == count:
                return numbers
        return numbers

    assert asyncio.run(first_headers(3)) == [START, START + 1, START + 2]
