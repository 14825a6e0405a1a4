"""What the dev chain's SubtensorModule pallet decides: whether a weight set or a timelocked commit
is accepted, and what an epoch writes.

These are the chain's rules over plain state (`devchain_state.Subnet`), with no lock, clock or
SDK, so each decision reads as the pallet's and can be checked on its own; `devchain.DevChain`
calls them with its lock held, at the block it sealed for the extrinsic or the epoch.

* `set_mechanism_weights` / `set_weights` run the pallet's checks in its order and fail with its
  error names: WeightVecNotEqualSize, SubnetNotExists / MechanismDoesNotExist,
  HotKeyNotRegisteredInSubNet, CommitRevealEnabled, IncorrectWeightVersionKey,
  SettingWeightsTooFast (`block - last_update < weights_rate_limit`, a `last_update` of 0 meaning
  never set), DuplicateUids, UidsLengthExceedUidsInSubNet, UidVecContainInvalidOne,
  WeightVecLengthIsLow and NeuronNoValidatorPermit (self-weight alone is exempt from the last two).
  A stored row is max-upscaled to u16 as the pallet does (the SDK already sends it that way) and
  sets `last_update[uid]` to the block. `max_weights_limit` is reported, and the SDK clips to it,
  but it is not enforced here.
* With commit-reveal on, `commit_timelocked_mechanism_weights` is checked like a weight set,
  bumps `last_update` and is kept as the hotkey's pending commit, but it is never revealed: the
  dev chain has no drand beacon, so a commit-reveal subnet's weights never change.
* An epoch runs `yuma.run_epoch` and writes consensus, incentive, dividends, trust, validator
  trust, emission and permits. It pays `alpha_per_block` per block since the previous epoch, all
  of it to miners and validators (no owner cut, no root share); `emission` is the alpha (in rao)
  each uid earned, not added to stake, so permits stay where a test put them.

A failure is the pallet's error name; `dispatch_error` turns it into the SDK's own `ChainError`,
so `.code` matches the live chain (rate_limited, not_authorized, ...). Importing this module
imports no bittensor: `dispatch_error` imports the SDK when it is called.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from engy_node.local import yuma
from engy_node.local.devchain_state import PALLET, RAO_PER_TAO, U16_MAX, Commit, Subnet

if TYPE_CHECKING:
    from bittensor.result import ChainError

# The calls the dev chain can dispatch; DevChain.compose() refuses any other, so an unsupported call
# fails at plan time with a clear message instead of at submit.
SUPPORTED_CALLS = frozenset(
    {
        (PALLET, "set_mechanism_weights"),
        (PALLET, "set_weights"),
        (PALLET, "commit_timelocked_mechanism_weights"),
        (PALLET, "commit_timelocked_weights"),
    }
)


def dispatch(subnets: dict[int, Subnet], block: int, signer: str, function: str, params: dict[str, Any]) -> str | None:
    """Apply one of the SUPPORTED_CALLS at `block`; the chain's error name when it fails, else None.
    The calls without a `mecid` are the mechanism-0 forms of the ones with it."""
    netuid = int(params["netuid"])
    mecid = int(params.get("mecid", 0))
    if function in ("set_mechanism_weights", "set_weights"):
        return set_weights(
            subnets,
            block,
            signer,
            netuid,
            mecid,
            list(params["dests"]),
            list(params["weights"]),
            int(params["version_key"]),
        )
    return commit_weights(subnets, block, signer, netuid, mecid, params["commit"], int(params["reveal_round"]))


def registered_neuron(subnets: dict[int, Subnet], signer: str, netuid: int, mecid: int) -> tuple[Subnet, int] | str:
    """(the subnet, the signer's uid), or the chain's error name."""
    subnet = subnets.get(netuid)
    if subnet is None:
        return "SubnetNotExists"
    if mecid != 0:
        return "MechanismDoesNotExist"
    if signer not in subnet.uids:
        return "HotKeyNotRegisteredInSubNet"
    return subnet, subnet.uids[signer]


def rate_limited(subnet: Subnet, uid: int, block: int) -> bool:
    """Whether `uid` set (or committed) weights less than a rate-limit window before `block`."""
    last = subnet.neurons[uid].last_update
    return last != 0 and block - last < subnet.params.weights_rate_limit


def set_weights(
    subnets: dict[int, Subnet],
    block: int,
    signer: str,
    netuid: int,
    mecid: int,
    dests: list[Any],
    values: list[Any],
    version_key: int,
) -> str | None:
    """Store `signer`'s weight row at `block`, or return the error name of the first check it fails."""
    if len(dests) != len(values):
        return "WeightVecNotEqualSize"
    registered = registered_neuron(subnets, signer, netuid, mecid)
    if isinstance(registered, str):
        return registered
    subnet, uid = registered
    params = subnet.params
    n = len(subnet.neurons)
    uids = [int(d) for d in dests]
    is_self_weight = uids == [uid]
    checks = (
        (params.commit_reveal, "CommitRevealEnabled"),
        (version_key < params.weights_version, "IncorrectWeightVersionKey"),
        (rate_limited(subnet, uid, block), "SettingWeightsTooFast"),
        (len(set(uids)) != len(uids), "DuplicateUids"),
        (len(uids) > n, "UidsLengthExceedUidsInSubNet"),
        (any(not 0 <= d < n for d in uids), "UidVecContainInvalidOne"),
        (not is_self_weight and len(uids) < params.min_allowed_weights, "WeightVecLengthIsLow"),
        (not is_self_weight and not subnet.neurons[uid].permit, "NeuronNoValidatorPermit"),
    )
    for failed, name in checks:
        if failed:
            return name
    weights = [int(v) for v in values]
    top = max(weights, default=0)
    subnet.weights[uid] = [(d, round(v * U16_MAX / top) if top else 0) for d, v in zip(uids, weights)]
    subnet.neurons[uid].last_update = block
    return None


def commit_weights(
    subnets: dict[int, Subnet], block: int, signer: str, netuid: int, mecid: int, commit: Any, reveal_round: int
) -> str | None:
    """Keep `signer`'s timelocked commit as its pending one, or return the error name it fails with."""
    registered = registered_neuron(subnets, signer, netuid, mecid)
    if isinstance(registered, str):
        return registered
    subnet, uid = registered
    if not subnet.params.commit_reveal:
        return "CommitRevealDisabled"
    if rate_limited(subnet, uid, block):
        return "CommittingWeightsTooFast"
    ciphertext = commit if isinstance(commit, str) else "0x" + bytes(commit).hex()
    subnet.commits[signer] = Commit(signer, subnet.epoch_index, block, reveal_round, ciphertext)
    subnet.neurons[uid].last_update = block
    return None


def run_epoch(subnet: Subnet, block: int) -> yuma.EpochResult:
    """Run the subnet's epoch at `block`, write its results into the neurons, and return them."""
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
    return result


@functools.cache
def _dispatch_error_index(name: str) -> tuple[int, int]:
    from bittensor._generated.errors import ERRORS

    for index, info in ERRORS.items():
        if info.pallet == PALLET and info.name == name:
            return index
    raise KeyError(f"{PALLET} has no error named {name}")


def dispatch_error(name: str) -> ChainError:
    """The ChainError the SDK builds for a failed dispatch of the pallet error `name`: the same
    message, name and ErrorCode (e.g. NeuronNoValidatorPermit -> not_authorized) as on a node."""
    from bittensor.result import chain_error_from_dispatch

    pallet_index, error_index = _dispatch_error_index(name)
    return chain_error_from_dispatch({"Module": {"index": pallet_index, "error": error_index}})
