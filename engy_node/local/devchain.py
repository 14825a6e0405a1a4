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
* `set_mechanism_weights` / `set_weights` run the pallet's checks in its order and fail with its
  error names: WeightVecNotEqualSize, SubnetNotExists / MechanismDoesNotExist,
  HotKeyNotRegisteredInSubNet, CommitRevealEnabled, IncorrectWeightVersionKey,
  SettingWeightsTooFast (`block - last_update < weights_rate_limit`, a `last_update` of 0 meaning
  never set), DuplicateUids, UidsLengthExceedUidsInSubNet, UidVecContainInvalidOne,
  WeightVecLengthIsLow and NeuronNoValidatorPermit (self-weight alone is exempt from the last two).
  A stored row is max-upscaled to u16 as the pallet does (the SDK already sends it that way) and
  sets `last_update[uid]` to the block. Failures become `ExtrinsicResult(success=False)` carrying
  the SDK's own `ChainError` for that name, so `.code` matches the live chain (rate_limited,
  not_authorized, ...). `max_weights_limit` is reported, and the SDK clips to it, but it is not
  enforced here.
* `reject_next(code)` makes the next submission fail in the pool as "Custom error: N" does on a
  node (6 is RateLimitExceeded); it is not included and consumes no block.
* With commit-reveal on, `commit_timelocked_mechanism_weights` is checked like a weight set,
  bumps `last_update` and is kept as the hotkey's pending commit, but it is never revealed: the
  dev chain has no drand beacon, so a commit-reveal subnet's weights never change.
* Registration (`register`) and stake (`set_stake`) are administrative actions applied at the
  head, not extrinsics. Registration sets `last_update` to the block, as the chain does, so a new
  validator waits one rate-limit window before its first weights. Uids are never pruned.
* Validator permits go to the `max_validators` largest stakes among uids with stake, plus the
  owner's hotkey, which is uid 0 as on the real chain. The chain recomputes them only at epochs;
  the dev chain also recomputes them at registration and stake changes, so a local network
  started with staked validators can set weights before its first epoch.
* The epoch fires at `LastEpochBlock + tempo`, the schedule the SDK's `next_epoch_start_block`
  documents (the subnet's registration block starts it), not the legacy
  `(block + netuid + 1) % (tempo + 1)` formula. It runs `yuma.run_epoch` and writes consensus,
  incentive, dividends, trust, validator trust and emission; rank is reported equal to incentive,
  as the chain's ranks are. The epoch pays `alpha_per_block` per block since the previous epoch,
  all of it to miners and validators (no owner cut, no root share). The metagraph's `emission`
  is, as on chain, the alpha (in rao) each uid earned at the last epoch; it is not added to stake,
  so permits stay where the test put them.
* Reads answer from the head state whatever block hash they are pinned to; only
  `Timestamp.Now` is computed for the pinned block. Stake is one amount per hotkey, reported as
  alpha stake and total stake at a price of 1.

Persistence: `save()` / `DevChain.load()` write and read JSON through a temp file and
`os.replace`. A chain built with `state_path` (or loaded from one) also saves itself after every
applied extrinsic, epoch, registration and parameter change, so a crash never loses a block a
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
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from engy_node.local import yuma

if TYPE_CHECKING:
    from bittensor import Balance, ExtrinsicResult
    from bittensor.result import ChainError

log = logging.getLogger("engy.devchain")

PALLET = "SubtensorModule"
RAO_PER_TAO = 10**9
U16_MAX = yuma.U16_MAX

# Weights, LastUpdate, Incentive and Bonds are keyed by the mechanism storage index
# mechid * 4096 + netuid (bittensor.settings.GLOBAL_MAX_SUBNET_COUNT). The dev chain runs
# mechanism 0 only, whose index is the netuid itself.
MECHANISM_STRIDE = 4096

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

STATE_FORMAT = "engy-devchain/1"

# The owner keys a subnet gets when none are given: Alice's well-known dev coldkey and a hotkey
# derived from it, so every dev chain without configuration has the same, recognisable owner.
DEV_OWNER_COLDKEY_URI = "//Alice"
DEV_OWNER_HOTKEY_URI = "//Alice//owner"

# The calls the dev chain can dispatch; compose() refuses any other, so an unsupported call fails
# at plan time with a clear message instead of at submit.
SUPPORTED_CALLS = frozenset(
    {
        (PALLET, "set_mechanism_weights"),
        (PALLET, "set_weights"),
        (PALLET, "commit_timelocked_mechanism_weights"),
        (PALLET, "commit_timelocked_weights"),
    }
)

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class SubnetParams:
    """A subnet's hyperparameters, with the chain's defaults except `min_allowed_weights` (0, so a
    validator with one miner can set weights).

    `kappa`, `bonds_penalty` and `max_weights_limit` are u16 fractions over 65535, as stored on
    chain. `alpha_per_block` is the subnet's emission per block, paid out at each epoch.
    """

    tempo: int = 360
    weights_rate_limit: int = 100
    activity_cutoff_factor_milli: int = 13_889
    min_allowed_weights: int = 0
    max_weights_limit: int = U16_MAX
    commit_reveal: bool = False
    kappa: int = 32_767
    bonds_penalty: int = U16_MAX
    max_validators: int = yuma.DEFAULT_MAX_VALIDATORS
    max_uids: int = 256
    weights_version: int = 0
    alpha_per_block: float = 1.0
    name: str = "engy devnet"
    symbol: str = "α"

    def __post_init__(self) -> None:
        if self.tempo < 1:
            raise ValueError(f"tempo must be >= 1, got {self.tempo!r}")
        if not 1_000 <= self.activity_cutoff_factor_milli <= 50_000:
            raise ValueError(
                "activity_cutoff_factor_milli must be in 1000..50000 (the chain's bounds), "
                f"got {self.activity_cutoff_factor_milli!r}"
            )
        for name in ("max_weights_limit", "kappa", "bonds_penalty"):
            if not 0 <= getattr(self, name) <= U16_MAX:
                raise ValueError(f"{name} is a u16, got {getattr(self, name)!r}")
        for name in ("weights_rate_limit", "min_allowed_weights", "max_validators", "weights_version"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 1 <= self.max_uids <= U16_MAX:
            raise ValueError(f"max_uids must be in 1..65535, got {self.max_uids!r}")
        if self.alpha_per_block < 0:
            raise ValueError(f"alpha_per_block must be >= 0, got {self.alpha_per_block!r}")

    @property
    def activity_cutoff(self) -> int:
        """Blocks without weights after which a validator is inactive, derived as the chain does."""
        return self.activity_cutoff_factor_milli * self.tempo // 1000


@dataclass(frozen=True)
class NeuronStatus:
    """One uid as a status display shows it. `stake` is in TAO (alpha at price 1); `incentive`,
    `dividends` and `consensus` are 0..1; `emission` is the alpha it earned at the last epoch."""

    uid: int
    hotkey: str
    coldkey: str
    stake: float
    permit: bool
    active: bool
    last_update: int
    incentive: float
    dividends: float
    consensus: float
    emission: float


@dataclass(frozen=True)
class Submission:
    """One extrinsic the dev chain received: included at `block` (or refused by the pool at the head
    `block`), `call` as "Pallet.function", and the chain's error name when it failed."""

    block: int
    netuid: int | None
    hotkey: str
    call: str
    ok: bool
    error: str | None


@dataclass
class _Neuron:
    hotkey: str
    coldkey: str
    stake_rao: int
    registered_at: int
    last_update: int
    permit: bool = False
    active: bool = True
    consensus: int = 0
    incentive: int = 0
    dividends: int = 0
    trust: int = 0
    validator_trust: int = 0
    emission_rao: int = 0


@dataclass
class _Commit:
    hotkey: str
    epoch: int
    block: int
    reveal_round: int
    ciphertext: str


@dataclass
class _Subnet:
    netuid: int
    params: SubnetParams
    registered_at: int
    last_epoch_block: int
    epoch_index: int = 0
    neurons: list[_Neuron] = field(default_factory=list)
    uids: dict[str, int] = field(default_factory=dict)
    weights: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)

    @property
    def owner(self) -> _Neuron:
        return self.neurons[0]

    def column(self, name: str) -> list:
        return [getattr(neuron, name) for neuron in self.neurons]

    def refresh_permits(self) -> None:
        permits = yuma.top_stake_permits(
            self.column("stake_rao"), max_validators=self.params.max_validators, owner_uid=0
        )
        for neuron, permit in zip(self.neurons, permits):
            neuron.permit = permit


# Storage items keyed by [netuid], as (subnet, head block) -> decoded value.
_SUBNET_ITEMS: dict[str, Callable[[_Subnet, int], Any]] = {
    "Tempo": lambda s, head: s.params.tempo,
    "WeightsSetRateLimit": lambda s, head: s.params.weights_rate_limit,
    "CommitRevealWeightsEnabled": lambda s, head: s.params.commit_reveal,
    "MinAllowedWeights": lambda s, head: s.params.min_allowed_weights,
    "MaxWeightsLimit": lambda s, head: s.params.max_weights_limit,
    "SubnetEpochConsensus": lambda s, head: "Yuma",
    "ActivityCutoff": lambda s, head: s.params.activity_cutoff,
    "ActivityCutoffFactorMilli": lambda s, head: s.params.activity_cutoff_factor_milli,
    "Kappa": lambda s, head: s.params.kappa,
    "BondsPenalty": lambda s, head: s.params.bonds_penalty,
    "MaxAllowedValidators": lambda s, head: s.params.max_validators,
    "MaxAllowedUids": lambda s, head: s.params.max_uids,
    "WeightsVersionKey": lambda s, head: s.params.weights_version,
    "RevealPeriodEpochs": lambda s, head: 1,
    "Yuma3On": lambda s, head: False,
    "LiquidAlphaOn": lambda s, head: False,
    "LastEpochBlock": lambda s, head: s.last_epoch_block,
    "PendingEpochAt": lambda s, head: 0,
    "SubnetEpochIndex": lambda s, head: s.epoch_index,
    "BlocksSinceLastStep": lambda s, head: head - s.last_epoch_block,
    "SubnetOwnerHotkey": lambda s, head: s.owner.hotkey,
    "SubnetOwner": lambda s, head: s.owner.coldkey,
    "SubnetworkN": lambda s, head: len(s.neurons),
    "NetworksAdded": lambda s, head: True,
    "NetworkRegisteredAt": lambda s, head: s.registered_at,
    "TokenSymbol": lambda s, head: list(s.params.symbol.encode()),
    "ValidatorPermit": lambda s, head: s.column("permit"),
    "Active": lambda s, head: s.column("active"),
    "Consensus": lambda s, head: s.column("consensus"),
    "Dividends": lambda s, head: s.column("dividends"),
    "ValidatorTrust": lambda s, head: s.column("validator_trust"),
    "Emission": lambda s, head: s.column("emission_rao"),
}

# Storage items keyed by the mechanism storage index [mechid * 4096 + netuid].
_MECHANISM_ITEMS: dict[str, Callable[[_Subnet], Any]] = {
    "LastUpdate": lambda s: s.column("last_update"),
    "Incentive": lambda s: s.column("incentive"),
}


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
        self._subnets: dict[int, _Subnet] = {}
        self._default_netuid: int | None = None
        self._pool_rejections: deque[int] = deque()
        self._submissions: deque[Submission] = deque(maxlen=SUBMISSION_HISTORY)
        self._nonces: dict[str, int] = {}
        self._epochs_run = 0
        self._state_path = Path(state_path) if state_path is not None else None
        self._dirty = False
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
        stake_rao = _rao(owner_stake_tao)
        with self._changing():
            if netuid in self._subnets:
                raise ValueError(f"subnet {netuid} already exists")
            head = self._catch_up()
            subnet = _Subnet(netuid=netuid, params=params, registered_at=head, last_epoch_block=head)
            subnet.neurons.append(_Neuron(owner_hotkey, owner_coldkey, stake_rao, registered_at=head, last_update=head))
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
        stake_rao = _rao(stake_tao)
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
            subnet.neurons.append(_Neuron(hotkey_ss58, coldkey, stake_rao, registered_at=head, last_update=head))
            subnet.uids[hotkey_ss58] = uid
            subnet.refresh_permits()
            self._dirty = True
            return uid

    def set_stake(self, hotkey_ss58: str, stake_tao: float, *, netuid: int | None = None) -> None:
        """Set a registered hotkey's stake; permits are recomputed at once."""
        stake_rao = _rao(stake_tao)
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
            _write_atomically(target, self._state())
            if target == self._state_path:
                self._dirty = False
            return target

    @classmethod
    def load(cls, path: PathLike, *, clock: Callable[[], float] = time.monotonic) -> DevChain:
        """Restore a saved chain; its head continues from the saved block, and it keeps saving to `path`."""
        data = json.loads(Path(path).read_text())
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"{path} is not a {STATE_FORMAT} state file (format {data.get('format')!r})")
        chain = cls(
            netuid=None,
            start_block=int(data["block"]),
            block_time_s=float(data["block_time_s"]),
            clock=clock,
            state_path=path,
        )
        for record in data["subnets"]:
            subnet = _Subnet(
                netuid=int(record["netuid"]),
                params=SubnetParams(**record["params"]),
                registered_at=int(record["registered_at"]),
                last_epoch_block=int(record["last_epoch_block"]),
                epoch_index=int(record["epoch_index"]),
                neurons=[_Neuron(**neuron) for neuron in record["neurons"]],
                weights={int(uid): [(int(j), int(w)) for j, w in row] for uid, row in record["weights"].items()},
                commits={commit["hotkey"]: _Commit(**commit) for commit in record["commits"]},
            )
            subnet.uids = {neuron.hotkey: uid for uid, neuron in enumerate(subnet.neurons)}
            chain._subnets[subnet.netuid] = subnet
        chain._default_netuid = data["default_netuid"]
        chain._epochs_run = int(data["epochs_run"])
        chain._nonces = {address: int(nonce) for address, nonce in data["nonces"].items()}
        chain._submissions.extend(Submission(**submission) for submission in data["submissions"])
        chain._pool_rejections.extend(int(code) for code in data["pool_rejections"])
        return chain

    def _state(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "block": self._block,
            "block_time_s": self._block_time_s,
            "default_netuid": self._default_netuid,
            "epochs_run": self._epochs_run,
            "nonces": dict(self._nonces),
            "submissions": [dataclasses.asdict(submission) for submission in self._submissions],
            "pool_rejections": list(self._pool_rejections),
            "subnets": [
                {
                    "netuid": subnet.netuid,
                    "params": dataclasses.asdict(subnet.params),
                    "registered_at": subnet.registered_at,
                    "last_epoch_block": subnet.last_epoch_block,
                    "epoch_index": subnet.epoch_index,
                    "neurons": [dataclasses.asdict(neuron) for neuron in subnet.neurons],
                    "weights": {str(uid): [list(entry) for entry in row] for uid, row in subnet.weights.items()},
                    "commits": [dataclasses.asdict(commit) for commit in subnet.commits.values()],
                }
                for subnet in self._subnets.values()
            ],
        }

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
        return {"header": _header(number), "extrinsics": []}

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
            self._catch_up()
            return self._storage_map(module, storage_function, list(params or []))

    async def query_batch(
        self,
        module: str,
        storage_function: str,
        param_sets: list[list],
        block_hash: str | None = None,
    ) -> list[Any]:
        return [await self.query(module, storage_function, params, block_hash) for params in param_sets]

    async def runtime_call(self, api: str, method: str, params: list, block_hash: str | None = None) -> Any:
        builders: dict[tuple[str, str], Callable[[_Subnet, int], Any]] = {
            ("SubnetInfoRuntimeApi", "get_metagraph"): self._metagraph,
            ("SubnetInfoRuntimeApi", "get_subnet_hyperparams_v3"): _hyperparameters,
            ("SubnetInfoRuntimeApi", "get_next_epoch_start_block"): lambda s, head: s.last_epoch_block + s.params.tempo,
            ("NeuronInfoRuntimeApi", "get_neurons_lite"): lambda s, head: _neuron_records(s, full=False),
            ("NeuronInfoRuntimeApi", "get_neurons"): lambda s, head: _neuron_records(s, full=True),
        }
        build = builders.get((api, method))
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
        # The dev chain records outcomes in ExtrinsicResult and `submissions`, not as events.
        return []

    # Substrate protocol: calls and fees ----------------------------------------------------

    async def compose(self, call) -> Any:
        module, function, _params = call
        if (module, function) not in SUPPORTED_CALLS:
            raise _unsupported(f"the call {module}.{function}")
        return call

    async def estimate_fee(self, call, keypair) -> Balance:
        from bittensor import Balance

        # Weight setting is fee-free on the real chain too (it is a hotkey operation with no
        # transfer); the dev chain keeps no balances at all.
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
        if (module, function) not in SUPPORTED_CALLS:
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
            error_name = self._dispatch(block, signer, function, params)
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
        error = _dispatch_error(error_name)
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
                _write_atomically(self._state_path, self._state())
            self._dirty = False

    def _subnet(self, netuid: int | None) -> _Subnet:
        key = self._default_netuid if netuid is None else netuid
        if key not in self._subnets:
            raise KeyError(f"the dev chain has no subnet {key}")
        return self._subnets[key]

    @staticmethod
    def _uid(subnet: _Subnet, hotkey: str) -> int:
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

    def _run_epoch(self, subnet: _Subnet, block: int) -> None:
        params = subnet.params
        result = yuma.run_epoch(
            {uid: dict(row) for uid, row in subnet.weights.items()},
            subnet.column("stake_rao"),
            validator_permits=subnet.column("permit"),
            last_update=subnet.column("last_update"),
            block_at_registration=subnet.column("registered_at"),
            current_block=block,
            activity_cutoff=params.activity_cutoff,
            kappa=params.kappa / U16_MAX,
            owner_uid=0,
            bonds_penalty=params.bonds_penalty / U16_MAX,
            max_validators=params.max_validators,
        )
        epoch_emission_rao = round(params.alpha_per_block * RAO_PER_TAO) * (block - subnet.last_epoch_block)
        for uid, neuron in enumerate(subnet.neurons):
            neuron.active = result.active[uid]
            neuron.consensus = yuma.to_u16(result.consensus[uid])
            neuron.incentive = yuma.to_u16(result.incentive[uid])
            neuron.dividends = yuma.to_u16(result.dividends[uid])
            neuron.trust = yuma.to_u16(result.trust[uid])
            neuron.validator_trust = yuma.to_u16(result.validator_trust[uid])
            neuron.emission_rao = round(result.emission[uid] * epoch_emission_rao)
            neuron.permit = result.validator_permits[uid]
        subnet.last_epoch_block = block
        subnet.epoch_index += 1
        self._epochs_run += 1
        self._dirty = True
        log.info(
            "block %d: epoch %d on subnet %d, incentive %s",
            block,
            subnet.epoch_index,
            subnet.netuid,
            {uid: round(i, 4) for uid, i in enumerate(result.incentive) if i},
        )

    def _dispatch(self, block: int, signer: str, function: str, params: dict) -> str | None:
        """Apply one of the SUPPORTED_CALLS at `block`; the chain's error name when it fails, else None.
        The calls without a `mecid` are the mechanism-0 forms of the ones with it."""
        netuid = int(params["netuid"])
        mecid = int(params.get("mecid", 0))
        if function in ("set_mechanism_weights", "set_weights"):
            return self._set_weights(
                block, signer, netuid, mecid, list(params["dests"]), list(params["weights"]), int(params["version_key"])
            )
        return self._commit_weights(block, signer, netuid, mecid, params["commit"], int(params["reveal_round"]))

    def _registered_neuron(self, signer: str, netuid: int, mecid: int) -> tuple[_Subnet, int] | str:
        """(the subnet, the signer's uid), or the chain's error name."""
        subnet = self._subnets.get(netuid)
        if subnet is None:
            return "SubnetNotExists"
        if mecid != 0:
            return "MechanismDoesNotExist"
        if signer not in subnet.uids:
            return "HotKeyNotRegisteredInSubNet"
        return subnet, subnet.uids[signer]

    @staticmethod
    def _rate_limited(subnet: _Subnet, uid: int, block: int) -> bool:
        last = subnet.neurons[uid].last_update
        return last != 0 and block - last < subnet.params.weights_rate_limit

    def _set_weights(
        self, block: int, signer: str, netuid: int, mecid: int, dests: list, values: list, version_key: int
    ) -> str | None:
        if len(dests) != len(values):
            return "WeightVecNotEqualSize"
        registered = self._registered_neuron(signer, netuid, mecid)
        if isinstance(registered, str):
            return registered
        subnet, uid = registered
        params = subnet.params
        n = len(subnet.neurons)
        dests = [int(d) for d in dests]
        is_self_weight = dests == [uid]
        checks = (
            (params.commit_reveal, "CommitRevealEnabled"),
            (version_key < params.weights_version, "IncorrectWeightVersionKey"),
            (self._rate_limited(subnet, uid, block), "SettingWeightsTooFast"),
            (len(set(dests)) != len(dests), "DuplicateUids"),
            (len(dests) > n, "UidsLengthExceedUidsInSubNet"),
            (any(not 0 <= d < n for d in dests), "UidVecContainInvalidOne"),
            (not is_self_weight and len(dests) < params.min_allowed_weights, "WeightVecLengthIsLow"),
            (not is_self_weight and not subnet.neurons[uid].permit, "NeuronNoValidatorPermit"),
        )
        for failed, name in checks:
            if failed:
                return name
        values = [int(v) for v in values]
        top = max(values, default=0)
        subnet.weights[uid] = [(d, round(v * U16_MAX / top) if top else 0) for d, v in zip(dests, values)]
        subnet.neurons[uid].last_update = block
        return None

    def _commit_weights(
        self, block: int, signer: str, netuid: int, mecid: int, commit: Any, reveal_round: int
    ) -> str | None:
        registered = self._registered_neuron(signer, netuid, mecid)
        if isinstance(registered, str):
            return registered
        subnet, uid = registered
        if not subnet.params.commit_reveal:
            return "CommitRevealDisabled"
        if self._rate_limited(subnet, uid, block):
            return "CommittingWeightsTooFast"
        ciphertext = commit if isinstance(commit, str) else "0x" + bytes(commit).hex()
        subnet.commits[signer] = _Commit(signer, subnet.epoch_index, block, reveal_round, ciphertext)
        subnet.neurons[uid].last_update = block
        return None

    def _storage(self, module: str, item: str, params: list, head: int, at_block: int) -> Any:
        if (module, item) == ("Timestamp", "Now"):
            return round((self._wall_origin_s + (at_block - self._origin_block) * self._block_time_s) * 1000)
        if module != PALLET:
            log.debug("dev chain has no storage %s.%s", module, item)
            return None
        if item in _SUBNET_ITEMS and params:
            subnet = self._subnets.get(int(params[0]))
            return None if subnet is None else _SUBNET_ITEMS[item](subnet, head)
        if item in _MECHANISM_ITEMS and params:
            subnet = self._mechanism_subnet(int(params[0]))
            return None if subnet is None else _MECHANISM_ITEMS[item](subnet)
        if item in ("Uids", "Keys", "BlockAtRegistration"):
            subnet = self._subnets.get(int(params[0]))
            if subnet is None:
                return None
            if item == "Uids":
                return subnet.uids.get(params[1])
            uid = int(params[1])
            if not 0 <= uid < len(subnet.neurons):
                return None
            return subnet.neurons[uid].hotkey if item == "Keys" else subnet.neurons[uid].registered_at
        if item in ("Weights", "Bonds"):
            subnet = self._mechanism_subnet(int(params[0]))
            if subnet is None or item == "Bonds":
                return []
            return list(subnet.weights.get(int(params[1]), []))
        if item == "Owner":
            return next(
                (s.neurons[s.uids[params[0]]].coldkey for s in self._subnets.values() if params[0] in s.uids), None
            )
        if item == "IsNetworkMember":
            subnet = self._subnets.get(int(params[1]))
            return subnet is not None and params[0] in subnet.uids
        if item == "TotalNetworks":
            return len(self._subnets)
        log.debug("dev chain has no storage %s.%s", module, item)
        return None

    def _storage_map(self, module: str, item: str, params: list) -> list[tuple[Any, Any]]:
        if module == PALLET and not params and item in _SUBNET_ITEMS:
            return [
                (netuid, _SUBNET_ITEMS[item](subnet, self._block)) for netuid, subnet in sorted(self._subnets.items())
            ]
        if module == PALLET and item in ("Uids", "Keys") and params:
            subnet = self._subnets.get(int(params[0]))
            pairs = [] if subnet is None else sorted(subnet.uids.items(), key=lambda pair: pair[1])
            return pairs if item == "Uids" else [(uid, hotkey) for hotkey, uid in pairs]
        if module == PALLET and item in ("Weights", "Bonds", "TimelockedWeightCommits") and params:
            subnet = self._mechanism_subnet(int(params[0]))
            if subnet is None or item == "Bonds":
                return []
            if item == "Weights":
                return [(uid, list(row)) for uid, row in sorted(subnet.weights.items())]
            by_epoch: dict[int, list] = {}
            for commit in subnet.commits.values():
                entry = (commit.hotkey, commit.block, commit.ciphertext, commit.reveal_round)
                by_epoch.setdefault(commit.epoch, []).append(entry)
            return sorted(by_epoch.items())
        if module == PALLET and item == "IsNetworkMember" and params:
            return [(netuid, True) for netuid, subnet in sorted(self._subnets.items()) if params[0] in subnet.uids]
        log.debug("dev chain has no storage map %s.%s %s", module, item, params)
        return []

    def _mechanism_subnet(self, storage_index: int) -> _Subnet | None:
        # Mechanisms other than 0 do not exist on the dev chain.
        return self._subnets.get(storage_index) if storage_index < MECHANISM_STRIDE else None

    def _metagraph(self, subnet: _Subnet, head: int) -> dict:
        """The decoded `SubnetInfoRuntimeApi.get_metagraph` record, in the shape the SDK's metagraph reads."""
        params = subnet.params
        n = len(subnet.neurons)
        stake = subnet.column("stake_rao")
        # Spot price 1: equal reserves, and a moving price of 1.0 as I96F32 bits.
        reserve_rao = 1_000 * RAO_PER_TAO
        return {
            "netuid": subnet.netuid,
            "name": list(params.name.encode()),
            "symbol": list(params.symbol.encode()),
            "identity": None,
            "network_registered_at": subnet.registered_at,
            "owner_hotkey": subnet.owner.hotkey,
            "owner_coldkey": subnet.owner.coldkey,
            "block": head,
            "tempo": params.tempo,
            "last_step": subnet.last_epoch_block,
            "blocks_since_last_step": head - subnet.last_epoch_block,
            "tao_in": reserve_rao,
            "alpha_in": reserve_rao,
            "moving_price": {"bits": 2**32},
            "num_uids": n,
            "max_uids": params.max_uids,
            "activity_cutoff": params.activity_cutoff,
            "weights_rate_limit": params.weights_rate_limit,
            "max_weights_limit": params.max_weights_limit,
            "min_allowed_weights": params.min_allowed_weights,
            "commit_reveal_weights_enabled": params.commit_reveal,
            "kappa": params.kappa,
            "weights_version": params.weights_version,
            "hotkeys": subnet.column("hotkey"),
            "coldkeys": subnet.column("coldkey"),
            "identities": [None] * n,
            "axons": [{"ip": 0, "port": 0, "ip_type": 4, "protocol": 4, "version": 0}] * n,
            "active": subnet.column("active"),
            "validator_permit": subnet.column("permit"),
            "last_update": subnet.column("last_update"),
            "block_at_registration": subnet.column("registered_at"),
            "rank": subnet.column("incentive"),
            "trust": subnet.column("trust"),
            "consensus": subnet.column("consensus"),
            "incentives": subnet.column("incentive"),
            "dividends": subnet.column("dividends"),
            "validator_trust": subnet.column("validator_trust"),
            "pruning_score": [0] * n,
            "emission": subnet.column("emission_rao"),
            "alpha_stake": stake,
            "tao_stake": [0] * n,
            "total_stake": stake,
        }


def _hyperparameters(subnet: _Subnet, head: int) -> list[dict]:
    """The decoded `get_subnet_hyperparams_v3` record: `{name, value: {TypeTag: payload}}` entries."""
    params = subnet.params
    entries = (
        ("tempo", "U16", params.tempo),
        ("weights_rate_limit", "U64", params.weights_rate_limit),
        ("activity_cutoff", "U64", params.activity_cutoff),
        ("activity_cutoff_factor", "U32", params.activity_cutoff_factor_milli),
        ("min_allowed_weights", "U16", params.min_allowed_weights),
        ("max_weights_limit", "U16", params.max_weights_limit),
        ("kappa", "U16", params.kappa),
        ("bonds_penalty", "U16", params.bonds_penalty),
        ("max_validators", "U16", params.max_validators),
        ("max_allowed_uids", "U16", params.max_uids),
        ("weights_version", "U64", params.weights_version),
        ("commit_reveal_weights_enabled", "Bool", params.commit_reveal),
        ("commit_reveal_period", "U64", 1),
        ("liquid_alpha_enabled", "Bool", False),
        ("yuma3_enabled", "Bool", False),
        ("epoch_consensus", "U8", 0),
        ("registration_allowed", "Bool", True),
        ("subnet_is_active", "Bool", True),
    )
    return [{"name": name, "value": {tag: value}} for name, tag, value in entries]


def _neuron_records(subnet: _Subnet, *, full: bool) -> list[dict]:
    """Decoded `NeuronInfoRuntimeApi.get_neurons(_lite)` records."""
    records = []
    for uid, neuron in enumerate(subnet.neurons):
        record = {
            "uid": uid,
            "netuid": subnet.netuid,
            "hotkey": neuron.hotkey,
            "coldkey": neuron.coldkey,
            "active": neuron.active,
            "validator_permit": neuron.permit,
            "last_update": neuron.last_update,
            "stake": [(neuron.coldkey, neuron.stake_rao)],
            "rank": neuron.incentive,
            "trust": neuron.trust,
            "consensus": neuron.consensus,
            "incentive": neuron.incentive,
            "dividends": neuron.dividends,
            "validator_trust": neuron.validator_trust,
            "emission": neuron.emission_rao,
            "pruning_score": 0,
        }
        if full:
            record["weights"] = list(subnet.weights.get(uid, []))
            record["bonds"] = []
        records.append(record)
    return records


def _rao(tao: float) -> int:
    if tao < 0:
        raise ValueError(f"stake must be >= 0, got {tao!r}")
    return round(tao * RAO_PER_TAO)


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


@functools.cache
def _dispatch_error_index(name: str) -> tuple[int, int]:
    from bittensor._generated.errors import ERRORS

    for index, info in ERRORS.items():
        if info.pallet == PALLET and info.name == name:
            return index
    raise KeyError(f"{PALLET} has no error named {name}")


def _dispatch_error(name: str) -> ChainError:
    """The ChainError the SDK builds for a failed dispatch of the pallet error `name`: the same
    message, name and ErrorCode (e.g. NeuronNoValidatorPermit -> not_authorized) as on a node."""
    from bittensor.result import chain_error_from_dispatch

    pallet_index, error_index = _dispatch_error_index(name)
    return chain_error_from_dispatch({"Module": {"index": pallet_index, "error": error_index}})


def _write_atomically(path: Path, state: dict) -> None:
    """Write `state` as JSON so a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle, ensure_ascii=False, separators=(",", ":"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
