"""The dev chain's state as plain data: subnet parameters, neurons, pending commits, and the JSON
file they are saved in.

`devchain.DevChain` owns one of these worlds (a `Subnet` per netuid) behind its lock;
`devchain_pallet` decides how extrinsics and epochs change it and `devchain_storage` answers the
SDK's reads from it. Keeping the records here, apart from the lock, the clock and the SDK, lets
each of those be read (and tested) on its own, and keeps the save format in one place: `to_document()`
and `load_state()` are each other's inverse, and `write_atomically` is the only writer.

Importing this module imports no bittensor (a dev chain's importers rely on that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from engy_node.local import yuma

PALLET = "SubtensorModule"
RAO_PER_TAO = 10**9
U16_MAX = yuma.U16_MAX

# Weights, LastUpdate, Incentive and Bonds are keyed by the mechanism storage index
# mechid * 4096 + netuid (bittensor.settings.GLOBAL_MAX_SUBNET_COUNT). The dev chain runs
# mechanism 0 only, whose index is the netuid itself.
MECHANISM_STRIDE = 4096

STATE_FORMAT = "engy-devchain/1"

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
class Neuron:
    """One uid's on-chain record; the u16 columns are stored as the chain stores them."""

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
class Commit:
    """A hotkey's pending timelocked weight commit (never revealed: the dev chain has no drand)."""

    hotkey: str
    epoch: int
    block: int
    reveal_round: int
    ciphertext: str


@dataclass
class Subnet:
    """One subnet: its parameters, its neurons by uid (the owner's hotkey at uid 0), weight rows by
    validator uid and pending commits by hotkey."""

    netuid: int
    params: SubnetParams
    registered_at: int
    last_epoch_block: int
    epoch_index: int = 0
    neurons: list[Neuron] = field(default_factory=list)
    uids: dict[str, int] = field(default_factory=dict)
    weights: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    @property
    def owner(self) -> Neuron:
        return self.neurons[0]

    def column(self, name: str) -> list[Any]:
        return [getattr(neuron, name) for neuron in self.neurons]

    def refresh_permits(self) -> None:
        permits = yuma.top_stake_permits(
            self.column("stake_rao"), max_validators=self.params.max_validators, owner_uid=0
        )
        for neuron, permit in zip(self.neurons, permits):
            neuron.permit = permit


@dataclass
class ChainState:
    """Everything `DevChain.save()` writes besides the clock: what `load_state` gives back."""

    block: int
    block_time_s: float
    default_netuid: int | None
    epochs_run: int
    nonces: dict[str, int]
    submissions: list[Submission]
    pool_rejections: list[int]
    subnets: dict[int, Subnet]
    balances: dict[str, Any] | None = None
    """`devchain_balances.Balances.to_document()`; None in files from before balances."""


def rao(tao: float) -> int:
    """A stake in TAO as rao, refusing a negative one."""
    if tao < 0:
        raise ValueError(f"stake must be >= 0, got {tao!r}")
    return round(tao * RAO_PER_TAO)


def to_document(state: ChainState) -> dict[str, Any]:
    """The JSON document a dev chain is saved as."""
    return {
        "format": STATE_FORMAT,
        "block": state.block,
        "block_time_s": state.block_time_s,
        "default_netuid": state.default_netuid,
        "epochs_run": state.epochs_run,
        "nonces": dict(state.nonces),
        "submissions": [dataclasses.asdict(submission) for submission in state.submissions],
        "pool_rejections": list(state.pool_rejections),
        "balances": state.balances,
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
            for subnet in state.subnets.values()
        ],
    }


def load_state(path: PathLike) -> ChainState:
    """Read a file `to_document()` wrote; a file of another format is refused."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != STATE_FORMAT:
        raise ValueError(f"{path} is not a {STATE_FORMAT} state file (format {data.get('format')!r})")
    subnets: dict[int, Subnet] = {}
    for record in data["subnets"]:
        subnet = Subnet(
            netuid=int(record["netuid"]),
            params=SubnetParams(**record["params"]),
            registered_at=int(record["registered_at"]),
            last_epoch_block=int(record["last_epoch_block"]),
            epoch_index=int(record["epoch_index"]),
            neurons=[Neuron(**neuron) for neuron in record["neurons"]],
            weights={int(uid): [(int(j), int(w)) for j, w in row] for uid, row in record["weights"].items()},
            commits={commit["hotkey"]: Commit(**commit) for commit in record["commits"]},
        )
        subnet.uids = {neuron.hotkey: uid for uid, neuron in enumerate(subnet.neurons)}
        subnets[subnet.netuid] = subnet
    return ChainState(
        block=int(data["block"]),
        block_time_s=float(data["block_time_s"]),
        default_netuid=data["default_netuid"],
        epochs_run=int(data["epochs_run"]),
        nonces={address: int(nonce) for address, nonce in data["nonces"].items()},
        submissions=[Submission(**submission) for submission in data["submissions"]],
        pool_rejections=[int(code) for code in data["pool_rejections"]],
        subnets=subnets,
        balances=data.get("balances"),
    )


def write_atomically(path: Path, document: dict[str, Any]) -> None:
    """Write `document` as JSON so a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, ensure_ascii=False, separators=(",", ":"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
