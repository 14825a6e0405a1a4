"""An in-process chain with real state, behind bittensor 11's `Substrate` seam.

Local networks and tests need a chain the REAL SDK can run every code path against (reads,
`SetWeights` with its client-side preflight, result and error mapping) with no node, and whose
state the writes actually change: weights a validator sets must be refused or stored the way the
chain does it, and must turn into incentive at the next epoch. `DevChain` is that chain. Pass it
as `bt.SyncClient("local", substrate=chain, fallback_endpoints=[])` (or to `bt.Client`), exactly
where the SDK would otherwise build its websocket `RpcSubstrate`.

What it models, and how it decides:

* Blocks come from a clock: block = start_block + whole `block_time_s` periods elapsed on the
  injected monotonic `clock` + blocks added by `advance()` and by sealing. The chain catches up
  lazily whenever anything reads or writes, running every epoch that fell due on the way, at its
  own block. Tests pass a manual clock and call `advance()`, so nothing sleeps.
* A submitted extrinsic is applied in the next block, which the chain seals at once (what a
  substrate dev node does with instant sealing), so `wait_for_inclusion` never waits and the
  result is visible to the next read; finality is not modelled, so `wait_for_finalization`
  returns at the same moment. Each seal puts the head one block further ahead of the clock; at
  one submission per rate-limit window that drift is about 1%.
* `set_mechanism_weights` / `set_weights` (and, with commit-reveal on, the timelocked commits) are
  checked in the pallet's order and fail with its error names (`devchain_pallet`); a failure
  becomes `ExtrinsicResult(success=False)` carrying the SDK's own `ChainError` for that name.
* `reject_next(code)` makes the next submission fail in the pool as "Custom error: N" does on a
  node (6 is RateLimitExceeded); it is not included and consumes no block.
* Registration (`register`) and stake (`set_stake`) are administrative actions applied at the
  head, not extrinsics. Registration sets `last_update` to the block, as the chain does, so a new
  validator waits one rate-limit window before its first weights. Uids are never pruned.
* Validator permits go to the `max_validators` largest stakes among uids with stake, plus the
  owner's hotkey, which is uid 0 as on the real chain. The chain recomputes them only at epochs;
  the dev chain also recomputes them at registration and stake changes, so a local network
  started with staked validators can set weights before its first epoch.
* The epoch fires at `LastEpochBlock + tempo`, the schedule the SDK's `next_epoch_start_block`
  documents (the subnet's registration block starts it), not the legacy
  `(block + netuid + 1) % (tempo + 1)` formula. It runs `yuma.run_epoch` and pays
  `alpha_per_block` per block since the previous epoch (`devchain_pallet.run_epoch`).
* Reads answer from the head state whatever block hash they are pinned to (`devchain_storage`);
  only `Timestamp.Now` is computed for the pinned block.
* Balances (`devchain_balances`): accounts endowed by `fund` send TAO with `bt.Transfer`
  (`transfer_keep_alive` / `transfer_allow_death`, no fees); a block that applied an extrinsic
  has it in `get_block` and its `System.Events` (`Balances.Transfer`, `ExtrinsicSuccess` or
  `ExtrinsicFailed`) pinned to that block, which is how a gateway finds deposits.

Persistence: `save()` / `DevChain.load()` write and read JSON through a temp file and
`os.replace` (the format is `devchain_state`'s). A chain built with `state_path` (or loaded from
one) also saves itself after every applied extrinsic, epoch, registration and parameter change, so a crash never loses a block a
validator saw its weights included in; `close()` saves as well, so a clean restart continues
from the exact head. A loaded chain continues from the saved block.

Threads: the SDK calls the async methods on its own event-loop thread while status displays read
from others, so all state sits behind one re-entrant lock (re-entrant because saving runs inside
the operations that change state). None of the async methods awaits while holding it.

Importing this module imports no bittensor: the SDK types are imported inside the methods that
build them, so status code and tests of the pure parts start fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engy_node.local import devchain_balances, devchain_pallet, devchain_storage
from engy_node.local.devchain_balances import TRANSFER_CALLS, Balances
from engy_node.local.devchain_pallet import SUPPORTED_CALLS
from engy_node.local.devchain_state import (
    MECHANISM_STRIDE,
    RAO_PER_TAO,
    U16_MAX,
    ChainState,
    Neuron,
    NeuronStatus,
    PathLike,
    Submission,
    Subnet,
    SubnetParams,
    load_state,
    rao,
    to_document,
    write_atomically,
)

if TYPE_CHECKING:
    from bittensor import Balance, ExtrinsicResult
    from bittensor.result import ChainError

log = logging.getLogger("engy.devchain")

# bittensor.settings.DEFAULT_ERA_PERIOD, the protocol's default for `period`; repeated here so
# importing this module does not import bittensor (a test checks the two agree).
DEFAULT_ERA_PERIOD = 128

# GRANDPA on a local node finalizes a couple of blocks behind the head.
FINALITY_LAG = 2

# The timestamp inherent is extrinsic 0 of every block; the one signed extrinsic a sealed block
# carries is therefore extrinsic 1.
EXTRINSIC_INDEX = 1

# Reported as the runtime's spec_version. Below 435, so the SDK expects no collateral columns.
SPEC_VERSION = 400

# Recent extrinsics kept for status displays and tests.
SUBMISSION_HISTORY = 256

# The owner keys a subnet gets when none are given: Alice's well-known dev coldkey and a hotkey
# derived from it, so every dev chain without configuration has the same, recognisable owner.
DEV_OWNER_COLDKEY_URI = "//Alice"
DEV_OWNER_HOTKEY_URI = "//Alice//owner"


class DevChain:
    """An in-process chain implementing bittensor 11's `Substrate` protocol; see the module docstring.

    The constructor creates subnet `netuid` (53 by default; None for none) owned by
    `owner_hotkey`/`owner_coldkey` (Alice's dev keys when omitted), with the owner's hotkey at
    uid 0 holding `owner_stake_tao`. More subnets come from `add_subnet`. Blocks start at
    `start_block` and advance every `block_time_s` seconds of `clock`.
    """

    def __init__(
        self,
        *,
        netuid: int | None = 53,
        params: SubnetParams = SubnetParams(),
        owner_hotkey: str | None = None,
        owner_coldkey: str | None = None,
        owner_stake_tao: float = 0.0,
        start_block: int = 1000,
        block_time_s: float = 12.0,
        clock: Callable[[], float] = time.monotonic,
        state_path: PathLike | None = None,
    ):
        if start_block < 1:
            # Block 0 would make a registration's last_update 0, which the rate limit reads as "never set".
            raise ValueError(f"start_block must be >= 1, got {start_block!r}")
        if not block_time_s > 0:
            raise ValueError(f"block_time_s must be > 0, got {block_time_s!r}")
        # netuid -> token symbol, installed by Client.connect (the Substrate protocol's display metadata).
        self.token_symbols: dict[int, str] = {}
        self._lock = threading.RLock()
        self._clock = clock
        self._clock_origin = clock()
        self._origin_block = start_block
        self._wall_origin_s = time.time()
        self._block_time_s = float(block_time_s)
        self._extra_blocks = 0
        self._block = start_block
        self._subnets: dict[int, Subnet] = {}
        self._default_netuid: int | None = None
        self._pool_rejections: deque[int] = deque()
        self._submissions: deque[Submission] = deque(maxlen=SUBMISSION_HISTORY)
        self._nonces: dict[str, int] = {}
        self._epochs_run = 0
        self._state_path = Path(state_path) if state_path is not None else None
        self._dirty = False
        self._balances = Balances()
        if netuid is not None:
            self.add_subnet(
                netuid,
                params=params,
                owner_hotkey=owner_hotkey,
                owner_coldkey=owner_coldkey,
                owner_stake_tao=owner_stake_tao,
            )

    # Administration ---------------------------------------------------------------

    def add_subnet(
        self,
        netuid: int,
        *,
        params: SubnetParams = SubnetParams(),
        owner_hotkey: str | None = None,
        owner_coldkey: str | None = None,
        owner_stake_tao: float = 0.0,
    ) -> None:
        """Create a subnet at the head block, its owner's hotkey at uid 0. The first subnet added is
        the default for every method that takes `netuid=None`."""
        if not 1 <= netuid < MECHANISM_STRIDE:
            raise ValueError(f"netuid must be in 1..{MECHANISM_STRIDE - 1}, got {netuid!r}")
        if owner_hotkey is None or owner_coldkey is None:
            from bittensor.sp_core import Keypair

            owner_hotkey = owner_hotkey or Keypair.create_from_uri(DEV_OWNER_HOTKEY_URI).ss58_address
            owner_coldkey = owner_coldkey or Keypair.create_from_uri(DEV_OWNER_COLDKEY_URI).ss58_address
        stake_rao = rao(owner_stake_tao)
        with self._changing():
            if netuid in self._subnets:
                raise ValueError(f"subnet {netuid} already exists")
            head = self._catch_up()
            subnet = Subnet(netuid=netuid, params=params, registered_at=head, last_epoch_block=head)
            subnet.neurons.append(Neuron(owner_hotkey, owner_coldkey, stake_rao, registered_at=head, last_update=head))
            subnet.uids[owner_hotkey] = 0
            subnet.refresh_permits()
            self._subnets[netuid] = subnet
            if self._default_netuid is None:
                self._default_netuid = netuid
            self._dirty = True

    def register(
        self, hotkey_ss58: str, coldkey_ss58: str | None = None, *, stake_tao: float = 0.0, netuid: int | None = None
    ) -> int:
        """Register a hotkey at the head block and return its uid; an already registered hotkey
        returns its uid unchanged. The coldkey defaults to the hotkey itself (a dev shortcut)."""
        stake_rao = rao(stake_tao)
        with self._changing():
            subnet = self._subnet(netuid)
            if hotkey_ss58 in subnet.uids:
                return subnet.uids[hotkey_ss58]
            if len(subnet.neurons) >= subnet.params.max_uids:
                raise ValueError(
                    f"subnet {subnet.netuid} is full ({subnet.params.max_uids} uids) and the dev chain never prunes"
                )
            head = self._catch_up()
            uid = len(subnet.neurons)
            coldkey = coldkey_ss58 or hotkey_ss58
            subnet.neurons.append(Neuron(hotkey_ss58, coldkey, stake_rao, registered_at=head, last_update=head))
            subnet.uids[hotkey_ss58] = uid
            subnet.refresh_permits()
            self._dirty = True
            return uid

    def fund(self, address_ss58: str, tao: float) -> int:
        """Endow `address_ss58` with `tao` more free TAO (the dev chain's genesis endowment: accounts
        get balances only this way or by transfer); returns its free balance in rao."""
        with self._changing():
            self._catch_up()
            self._dirty = True
            return self._balances.fund(address_ss58, rao(tao))

    def free_balance(self, address_ss58: str) -> int:
        """`address_ss58`'s free balance in rao."""
        with self._lock:
            return self._balances.free.get(address_ss58, 0)

    def set_stake(self, hotkey_ss58: str, stake_tao: float, *, netuid: int | None = None) -> None:
        """Set a registered hotkey's stake; permits are recomputed at once."""
        stake_rao = rao(stake_tao)
        with self._changing():
            subnet = self._subnet(netuid)
            self._catch_up()
            subnet.neurons[self._uid(subnet, hotkey_ss58)].stake_rao = stake_rao
            subnet.refresh_permits()
            self._dirty = True

    def set_hyperparameters(self, netuid: int | None = None, **changes: Any) -> SubnetParams:
        """Change fields of a subnet's `SubnetParams` (e.g. `commit_reveal=True`) and return the new set."""
        with self._changing():
            subnet = self._subnet(netuid)
            self._catch_up()
            subnet.params = dataclasses.replace(subnet.params, **changes)
            subnet.refresh_permits()
            self._dirty = True
            return subnet.params

    def advance(self, blocks: int) -> int:
        """Produce `blocks` blocks now, running any epochs they reach, and return the new head."""
        if blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {blocks!r}")
        with self._changing():
            self._extra_blocks += blocks
            return self._catch_up()

    def reject_next(self, custom_error_code: int) -> None:
        """Make the next submission fail in the transaction pool with "Custom error: N" (queued, FIFO)."""
        with self._lock:
            self._pool_rejections.append(int(custom_error_code))

    # Inspection (plain data, no SDK types) ----------------------------------------

    @property
    def block(self) -> int:
        with self._changing():
            return self._catch_up()

    @property
    def block_time_s(self) -> float:
        return self._block_time_s

    @property
    def epochs_run(self) -> int:
        """Epochs run on all subnets since the chain was created (persisted across save/load)."""
        with self._changing():
            self._catch_up()
            return self._epochs_run

    @property
    def submissions(self) -> list[Submission]:
        """The most recent extrinsics (up to 256), oldest first."""
        with self._lock:
            return list(self._submissions)

    def neurons(self, netuid: int | None = None) -> list[NeuronStatus]:
        with self._changing():
            self._catch_up()
            return [
                NeuronStatus(
                    uid=uid,
                    hotkey=neuron.hotkey,
                    coldkey=neuron.coldkey,
                    stake=neuron.stake_rao / RAO_PER_TAO,
                    permit=neuron.permit,
                    active=neuron.active,
                    last_update=neuron.last_update,
                    incentive=neuron.incentive / U16_MAX,
                    dividends=neuron.dividends / U16_MAX,
                    consensus=neuron.consensus / U16_MAX,
                    emission=neuron.emission_rao / RAO_PER_TAO,
                )
                for uid, neuron in enumerate(self._subnet(netuid).neurons)
            ]

    def weights(self, netuid: int | None = None) -> dict[int, dict[int, int]]:
        """Stored weight rows as {validator_uid: {uid: u16}}."""
        with self._changing():
            self._catch_up()
            return {uid: dict(row) for uid, row in sorted(self._subnet(netuid).weights.items())}

    # Persistence ----------------------------------------------------------------------

    def save(self, path: PathLike | None = None) -> Path:
        """Write the whole state as JSON (atomically) to `path`, or to the chain's `state_path`."""
        with self._lock:
            target = Path(path) if path is not None else self._state_path
            if target is None:
                raise ValueError("no path given and the chain has no state_path")
            self._catch_up()
            write_atomically(target, self._document())
            if target == self._state_path:
                self._dirty = False
            return target

    @classmethod
    def load(cls, path: PathLike, *, clock: Callable[[], float] = time.monotonic) -> DevChain:
        """Restore a saved chain; its head continues from the saved block, and it keeps saving to `path`."""
        state = load_state(path)
        chain = cls(
            netuid=None,
            start_block=state.block,
            block_time_s=state.block_time_s,
            clock=clock,
            state_path=path,
        )
        chain._subnets = state.subnets
        chain._default_netuid = state.default_netuid
        chain._epochs_run = state.epochs_run
        chain._nonces = state.nonces
        chain._submissions.extend(state.submissions)
        chain._pool_rejections.extend(state.pool_rejections)
        chain._balances = Balances.from_document(state.balances)
        return chain

    def _document(self) -> dict:
        return to_document(
            ChainState(
                block=self._block,
                block_time_s=self._block_time_s,
                default_netuid=self._default_netuid,
                epochs_run=self._epochs_run,
                nonces=self._nonces,
                submissions=list(self._submissions),
                pool_rejections=list(self._pool_rejections),
                subnets=self._subnets,
                balances=self._balances.to_document(),
            )
        )

    # Substrate protocol: display metadata and lifecycle --------------------------------

    def balance(self, rao: int, netuid: int = 0) -> Balance:
        from bittensor import Balance

        symbol = self.token_symbols.get(netuid) if netuid else None
        return Balance(int(rao), netuid, symbol)

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        # Saving here makes a clean restart continue from the exact head, not the last event.
        if self._state_path is not None:
            self.save()

    # Substrate protocol: reads ---------------------------------------------------------

    async def block_hash(self, block: int | None = None) -> str:
        with self._changing():
            head = self._catch_up()
            if block is not None and not 0 <= block <= head:
                raise _chain_error(f"block {block} does not exist (head is {head})")
            return _hash_of(head if block is None else block)

    async def block_number(self) -> int:
        return self.block

    async def finalized_block_number(self) -> int:
        return max(0, self.block - FINALITY_LAG)

    async def block_time(self) -> float:
        return int(await self.constant("Aura", "SlotDuration")) / 1000.0

    async def spec_version(self) -> int:
        return SPEC_VERSION

    async def get_block(self, block_number: int | None = None, block_hash: str | None = None) -> dict | None:
        head = self.block
        number = _block_of(block_hash) if block_hash is not None else (head if block_number is None else block_number)
        if not 0 <= number <= head:
            return None
        with self._lock:
            timestamp_ms = self._storage("Timestamp", "Now", [], head, number)
            return {"header": _header(number), "extrinsics": self._balances.extrinsics(number, timestamp_ms)}

    async def query(
        self,
        module: str,
        storage_function: str,
        params: list | None = None,
        block_hash: str | None = None,
    ) -> Any:
        with self._changing():
            head = self._catch_up()
            at_block = _block_of(block_hash) if block_hash else head
            return self._storage(module, storage_function, list(params or []), head, at_block)

    async def map_has_entries(
        self,
        module: str,
        storage_function: str,
        params: list,
        block_hash: str | None = None,
    ) -> bool:
        return bool(await self.query_map(module, storage_function, params, block_hash))

    async def query_map(
        self,
        module: str,
        storage_function: str,
        params: list | None = None,
        block_hash: str | None = None,
    ) -> list[tuple[Any, Any]]:
        with self._changing():
            head = self._catch_up()
            return devchain_storage.storage_map(self._subnets, module, storage_function, list(params or []), head)

    async def query_batch(
        self,
        module: str,
        storage_function: str,
        param_sets: list[list],
        block_hash: str | None = None,
    ) -> list[Any]:
        return [await self.query(module, storage_function, params, block_hash) for params in param_sets]

    async def runtime_call(self, api: str, method: str, params: list, block_hash: str | None = None) -> Any:
        build = devchain_storage.RUNTIME_CALLS.get((api, method))
        if build is None:
            raise _chain_error(f"the dev chain does not implement the runtime API {api}.{method}")
        with self._changing():
            head = self._catch_up()
            subnet = self._subnets.get(int(params[0]))
            return None if subnet is None else build(subnet, head)

    async def constant(self, module: str, name: str) -> Any:
        if (module, name) == ("Aura", "SlotDuration"):
            return round(self._block_time_s * 1000)
        log.debug("dev chain has no constant %s.%s", module, name)
        return None

    async def decode_scale(self, type_string: str, data: Any) -> Any:
        raise _unsupported("SCALE decoding")

    async def blocks(self, *, finalized: bool = False) -> AsyncIterator[dict]:
        """Headers of new blocks as the clock (or `advance`) produces them, polled a few times a block."""
        lag = FINALITY_LAG if finalized else 0
        poll_s = min(1.0, max(0.05, self._block_time_s / 4))
        last: int | None = None
        while True:
            newest = self.block - lag
            for number in range(newest if last is None else last + 1, newest + 1):
                yield {"header": _header(number)}
            last = newest if last is None else max(last, newest)
            await asyncio.sleep(poll_s)

    async def events(self, block_hash: str | None = None) -> list[dict]:
        # Blocks that applied an extrinsic keep its events (`devchain_balances`); others have none.
        return await self.query("System", "Events", [], block_hash)

    # Substrate protocol: calls and fees ----------------------------------------------------

    async def compose(self, call) -> Any:
        module, function, _params = call
        if (module, function) not in SUPPORTED_CALLS | TRANSFER_CALLS:
            raise _unsupported(f"the call {module}.{function}")
        return call

    async def estimate_fee(self, call, keypair) -> Balance:
        from bittensor import Balance

        # Weight setting is fee-free on the real chain too (it is a hotkey operation with no
        # transfer); the dev chain charges no fee for transfers either.
        return Balance.from_rao(0)

    async def estimate_weight(self, call, keypair) -> dict:
        return {"ref_time": 0, "proof_size": 0}

    async def account_next_index(self, address: str) -> int:
        with self._lock:
            return self._nonces.get(address, 0)

    # Substrate protocol: writes -------------------------------------------------------------

    async def mev_next_key(self) -> bytes | None:
        # No MEV shield on the dev chain.
        return None

    async def sign_extrinsic(self, call, keypair, *, nonce: int, period: int) -> tuple[bytes, str]:
        raise _unsupported("signing without submitting")

    async def find_extrinsic(self, extrinsic_hash: str, block_hash: str) -> ExtrinsicResult | None:
        raise _unsupported("finding extrinsics by hash")

    async def prepare(
        self,
        call,
        *,
        address: str,
        crypto_type: int = 1,
        nonce: int | None = None,
        period: int | None = DEFAULT_ERA_PERIOD,
        tip: int = 0,
        metadata_hash: bytes | None = None,
    ) -> Any:
        raise _unsupported("out-of-process signing")

    async def submit_signature(
        self,
        unsigned: Any,
        signature: bytes | str,
        *,
        wait_for_inclusion: bool = True,
        wait_for_finalization: bool = True,
    ) -> ExtrinsicResult:
        raise _unsupported("out-of-process signing")

    async def submit(
        self,
        call,
        keypair,
        *,
        nonce: int | None = None,
        period: int | None = DEFAULT_ERA_PERIOD,
        wait_for_inclusion: bool = True,
        wait_for_finalization: bool = True,
    ) -> ExtrinsicResult:
        """Apply `call` signed by `keypair` in a freshly sealed block (or refuse it in the pool when a
        rejection is queued). Nonce and era are accepted and ignored: the dev chain signs nothing."""
        from bittensor import Balance, ExtrinsicResult
        from bittensor.result import chain_error_from_substrate_request

        module, function, params = call
        if (module, function) not in SUPPORTED_CALLS | TRANSFER_CALLS:
            raise _unsupported(f"the call {module}.{function}")
        signer = keypair.ss58_address
        netuid = params.get("netuid")
        with self._changing():
            if self._pool_rejections:
                code = self._pool_rejections.popleft()
                # The shape a node's author_submitAndWatchExtrinsic error takes for InvalidTransaction::Custom.
                error = chain_error_from_substrate_request(
                    Exception(str({"code": 1010, "message": "Invalid Transaction", "data": f"Custom error: {code}"}))
                )
                self._submissions.append(
                    Submission(self._catch_up(), netuid, signer, f"{module}.{function}", False, error.name)
                )
                self._dirty = True
                return ExtrinsicResult(success=False, message=error.message, error=error)
            block = self._seal_next_block()
            if (module, function) in TRANSFER_CALLS:
                error_name = self._balances.transfer(block, signer, function, params)
            else:
                error_name = devchain_pallet.dispatch(self._subnets, block, signer, function, params)
                self._balances.record_other(block, signer, module, function, error_name is None)
            self._nonces[signer] = self._nonces.get(signer, 0) + 1
            self._submissions.append(
                Submission(block, netuid, signer, f"{module}.{function}", error_name is None, error_name)
            )
            self._dirty = True
        if error_name is None:
            log.info("block %d: %s.%s from %s applied", block, module, function, signer)
        else:
            log.info("block %d: %s.%s from %s failed: %s", block, module, function, signer, error_name)
        if not (wait_for_inclusion or wait_for_finalization):
            return ExtrinsicResult(success=True, message="Submitted (not waiting).")
        extrinsic_id = f"{block}-{EXTRINSIC_INDEX:04d}"
        if error_name is None:
            return ExtrinsicResult(
                success=True,
                message="Success",
                block_hash=_hash_of(block),
                extrinsic_id=extrinsic_id,
                fee=Balance.from_rao(0),
            )
        if (module, function) in TRANSFER_CALLS:
            error = devchain_balances.dispatch_error(error_name)
        else:
            error = devchain_pallet.dispatch_error(error_name)
        return ExtrinsicResult(
            success=False, message=error.message, block_hash=_hash_of(block), extrinsic_id=extrinsic_id, error=error
        )

    async def submit_signed(
        self,
        extrinsic,
        keypair,
        *,
        wait_for_inclusion: bool = True,
        wait_for_finalization: bool = True,
    ) -> ExtrinsicResult:
        raise _unsupported("submitting pre-signed extrinsics")

    # Substrate protocol: multisig -------------------------------------------------------------

    def multisig_account(self, signatories: list[str], threshold: int) -> Any:
        raise _unsupported("multisig")

    async def submit_multisig(
        self,
        call,
        keypair,
        multisig_account,
        *,
        wait_for_inclusion: bool = True,
        wait_for_finalization: bool = True,
    ) -> ExtrinsicResult:
        raise _unsupported("multisig")

    # Internals (callers hold the lock) ------------------------------------------------------------

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock; afterwards save to `state_path` if the operation (or an epoch it ran) changed state."""
        with self._lock:
            yield
            if self._dirty and self._state_path is not None:
                write_atomically(self._state_path, self._document())
            self._dirty = False

    def _subnet(self, netuid: int | None) -> Subnet:
        key = self._default_netuid if netuid is None else netuid
        if key not in self._subnets:
            raise KeyError(f"the dev chain has no subnet {key}")
        return self._subnets[key]

    @staticmethod
    def _uid(subnet: Subnet, hotkey: str) -> int:
        if hotkey not in subnet.uids:
            raise KeyError(f"{hotkey} is not registered on subnet {subnet.netuid}")
        return subnet.uids[hotkey]

    def _catch_up(self) -> int:
        elapsed = int(max(0.0, self._clock() - self._clock_origin) // self._block_time_s)
        self._produce_until(self._origin_block + self._extra_blocks + elapsed)
        return self._block

    def _seal_next_block(self) -> int:
        self._catch_up()
        self._extra_blocks += 1
        self._produce_until(self._block + 1)
        return self._block

    def _produce_until(self, target: int) -> None:
        """Move the head to `target`, running each epoch at the block it falls due.

        An epoch is due at LastEpochBlock + tempo, but never before the next block: a tempo shortened
        by `set_hyperparameters` runs its overdue epoch in the next block produced.
        """
        while True:
            due = {
                netuid: max(subnet.last_epoch_block + subnet.params.tempo, self._block + 1)
                for netuid, subnet in self._subnets.items()
            }
            block = min((b for b in due.values() if b <= target), default=None)
            if block is None:
                break
            self._block = block
            for netuid in sorted(n for n, b in due.items() if b == block):
                self._run_epoch(self._subnets[netuid], block)
        self._block = max(self._block, target)

    def _run_epoch(self, subnet: Subnet, block: int) -> None:
        result = devchain_pallet.run_epoch(subnet, block)
        self._epochs_run += 1
        self._dirty = True
        log.info(
            "block %d: epoch %d on subnet %d, incentive %s",
            block,
            subnet.epoch_index,
            subnet.netuid,
            {uid: round(i, 4) for uid, i in enumerate(result.incentive) if i},
        )

    def _storage(self, module: str, item: str, params: list, head: int, at_block: int) -> Any:
        if (module, item) == ("Timestamp", "Now"):
            return round((self._wall_origin_s + (at_block - self._origin_block) * self._block_time_s) * 1000)
        if (module, item) == ("System", "Account"):
            return self._balances.account(str(params[0]))
        if (module, item) == ("System", "Events"):
            return self._balances.events(at_block)
        return devchain_storage.storage(self._subnets, module, item, params, head)


def _hash_of(block: int) -> str:
    # Block hashes encode the block number, so any hash the chain hands out maps back to its block.
    return f"0x{block:064x}"


def _block_of(block_hash: str) -> int:
    try:
        return int(block_hash, 16)
    except ValueError:
        raise _chain_error(f"{block_hash!r} is not a dev chain block hash") from None


def _header(number: int) -> dict:
    return {"number": number, "hash": _hash_of(number), "parentHash": _hash_of(max(0, number - 1))}


def _chain_error(message: str) -> ChainError:
    from bittensor.result import ChainError

    return ChainError(message)


def _unsupported(what: str) -> ChainError:
    return _chain_error(f"the dev chain does not support {what}")
