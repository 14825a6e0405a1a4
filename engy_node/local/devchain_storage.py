"""The dev chain's answers to the SDK's reads: SubtensorModule storage items and the runtime API
records, already decoded, in the shapes the SDK reads from a node.

A node returns these SCALE-encoded and the SDK decodes them; the dev chain hands back what the
decoder would have produced, built from plain state (`devchain_state.Subnet`). Keeping that
mapping here, one table or function per item, leaves `devchain.DevChain` to hold the lock and
pick the block, and makes "which storage items does the dev chain answer" one file to read.
Reads answer from the head state whatever block they are pinned to (`Timestamp.Now`, computed
for the pinned block, is answered by `DevChain`). Stake is one amount per hotkey, reported as
alpha stake and total stake at a price of 1; rank is reported equal to incentive, as the
chain's ranks are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engy_node.local.devchain_state import MECHANISM_STRIDE, PALLET, RAO_PER_TAO, Subnet

log = logging.getLogger("engy.devchain")

# Storage items keyed by [netuid], as (subnet, head block) -> decoded value.
SUBNET_ITEMS: dict[str, Callable[[Subnet, int], Any]] = {
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
MECHANISM_ITEMS: dict[str, Callable[[Subnet], Any]] = {
    "LastUpdate": lambda s: s.column("last_update"),
    "Incentive": lambda s: s.column("incentive"),
}


def storage(subnets: dict[int, Subnet], module: str, item: str, params: list[Any], head: int) -> Any:
    """The decoded value of storage `module.item` at `params`; None for an item the dev chain lacks."""
    if module != PALLET:
        log.debug("dev chain has no storage %s.%s", module, item)
        return None
    if item in SUBNET_ITEMS and params:
        subnet = subnets.get(int(params[0]))
        return None if subnet is None else SUBNET_ITEMS[item](subnet, head)
    if item in MECHANISM_ITEMS and params:
        subnet = mechanism_subnet(subnets, int(params[0]))
        return None if subnet is None else MECHANISM_ITEMS[item](subnet)
    if item in ("Uids", "Keys", "BlockAtRegistration"):
        subnet = subnets.get(int(params[0]))
        if subnet is None:
            return None
        if item == "Uids":
            return subnet.uids.get(params[1])
        uid = int(params[1])
        if not 0 <= uid < len(subnet.neurons):
            return None
        return subnet.neurons[uid].hotkey if item == "Keys" else subnet.neurons[uid].registered_at
    if item in ("Weights", "Bonds"):
        subnet = mechanism_subnet(subnets, int(params[0]))
        if subnet is None or item == "Bonds":
            return []
        return list(subnet.weights.get(int(params[1]), []))
    if item == "Owner":
        return next((s.neurons[s.uids[params[0]]].coldkey for s in subnets.values() if params[0] in s.uids), None)
    if item == "IsNetworkMember":
        subnet = subnets.get(int(params[1]))
        return subnet is not None and params[0] in subnet.uids
    if item == "TotalNetworks":
        return len(subnets)
    log.debug("dev chain has no storage %s.%s", module, item)
    return None


def storage_map(
    subnets: dict[int, Subnet], module: str, item: str, params: list[Any], head: int
) -> list[tuple[Any, Any]]:
    """The (key, value) entries of storage map `module.item` under the prefix `params`."""
    if module == PALLET and not params and item in SUBNET_ITEMS:
        return [(netuid, SUBNET_ITEMS[item](subnet, head)) for netuid, subnet in sorted(subnets.items())]
    if module == PALLET and item in ("Uids", "Keys") and params:
        subnet = subnets.get(int(params[0]))
        pairs = [] if subnet is None else sorted(subnet.uids.items(), key=lambda pair: pair[1])
        return pairs if item == "Uids" else [(uid, hotkey) for hotkey, uid in pairs]
    if module == PALLET and item in ("Weights", "Bonds", "TimelockedWeightCommits") and params:
        subnet = mechanism_subnet(subnets, int(params[0]))
        if subnet is None or item == "Bonds":
            return []
        if item == "Weights":
            return [(uid, list(row)) for uid, row in sorted(subnet.weights.items())]
        by_epoch: dict[int, list[Any]] = {}
        for commit in subnet.commits.values():
            entry = (commit.hotkey, commit.block, commit.ciphertext, commit.reveal_round)
            by_epoch.setdefault(commit.epoch, []).append(entry)
        return sorted(by_epoch.items())
    if module == PALLET and item == "IsNetworkMember" and params:
        return [(netuid, True) for netuid, subnet in sorted(subnets.items()) if params[0] in subnet.uids]
    log.debug("dev chain has no storage map %s.%s %s", module, item, params)
    return []


def mechanism_subnet(subnets: dict[int, Subnet], storage_index: int) -> Subnet | None:
    # Mechanisms other than 0 do not exist on the dev chain.
    return subnets.get(storage_index) if storage_index < MECHANISM_STRIDE else None


def metagraph(subnet: Subnet, head: int) -> dict[str, Any]:
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


def hyperparameters(subnet: Subnet, head: int) -> list[dict[str, Any]]:
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


def neuron_records(subnet: Subnet, *, full: bool) -> list[dict[str, Any]]:
    """Decoded `NeuronInfoRuntimeApi.get_neurons(_lite)` records."""
    records = []
    for uid, neuron in enumerate(subnet.neurons):
        record: dict[str, Any] = {
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


# The runtime API methods the dev chain answers, as (subnet, head block) -> decoded record.
RUNTIME_CALLS: dict[tuple[str, str], Callable[[Subnet, int], Any]] = {
    ("SubnetInfoRuntimeApi", "get_metagraph"): metagraph,
    ("SubnetInfoRuntimeApi", "get_subnet_hyperparams_v3"): hyperparameters,
    ("SubnetInfoRuntimeApi", "get_next_epoch_start_block"): lambda s, head: s.last_epoch_block + s.params.tempo,
    ("NeuronInfoRuntimeApi", "get_neurons_lite"): lambda s, head: neuron_records(s, full=False),
    ("NeuronInfoRuntimeApi", "get_neurons"): lambda s, head: neuron_records(s, full=True),
}
