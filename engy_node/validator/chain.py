"""The validator's view of the chain, on bittensor 11: read a block-pinned snapshot of the subnet,
submit weights, and say exactly what happened.

Why one long-lived blocking client. The SDK is asyncio-only; the node runs on trio. Its blocking
`SyncClient` runs a private asyncio loop on a daemon thread, so the light loop calls it through
`trio.to_thread.run_sync` (one thread at a time: a hotkey's nonce is fetched per submit, and two
reads racing the client's lazy start are not safe). Every call has a deadline here, because the
client has none of its own beyond per-request transport timeouts.

Why one snapshot per read. Block, metagraph and hyperparameters come from `client.at()`, pinned
to one block, so the uid a hotkey resolves to and the block the schedule compares are the same
chain state.

What a submit can do, all reported as a `SubmitOutcome` and never as an exception:
* raise `ChainError` before anything is signed: the SDK's preflight refuses an unregistered
  hotkey, a submit inside the rate limit, too few weights (`stage="preflight"`);
* raise `BittensorError` for a vector with no positive weight (`stage="preflight"`);
* return `ExtrinsicResult(success=False)` for a pool refusal or a dispatch failure, with the
  chain's error name, e.g. `NeuronNoValidatorPermit` (`stage="chain"`);
* fail in transport: a dropped socket, a timeout here (`stage="transport"`; the extrinsic may
  still land, which the next read's `last_update` shows).
Only `landed` is a success; the light loop records nothing else.

Networks: finney, test, local (`$BT_CHAIN_ENDPOINT` or ws://127.0.0.1:9944), or a ws:// / wss://
URL, as the SDK resolves them; `substrate=` replaces the websocket transport with an in-process
chain (`devchain.DevChain`), which is how local networks and tests run the real SDK.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import trio

from engy_node.errors import ConfigError

if TYPE_CHECKING:
    from bittensor.sp_core import Keypair

log = logging.getLogger("engy.validator.chain")

NAMED_NETWORKS = ("finney", "test", "local")
READ_TIMEOUT_S = 60.0
SUBMIT_TIMEOUT_S = 180.0
"""Inclusion takes a block or two on finney; `period` below bounds how long the extrinsic stays
valid (32 blocks), so waiting much longer than a few minutes learns nothing more."""
SUBMIT_PERIOD_BLOCKS = 32
PREFLIGHT_CODES = frozenset({"not_registered", "rate_limited", "invalid_argument", "not_authorized"})
"""Codes of the `ChainError`s the SDK raises before signing; any other raised `ChainError` is the
transport failing between signing and inclusion."""
DEFAULT_ACTIVITY_FACTOR_MILLI = 13_889
"""The chain's default activity cutoff factor (per mille of tempo): 5,000 blocks at tempo 360."""


def check_network(network: str) -> str:
    """`network` if the SDK can reach it, else a `ConfigError` listing what it accepts."""
    if network in NAMED_NETWORKS or network.startswith(("ws://", "wss://")):
        return network
    raise ConfigError(
        f"unknown chain network {network!r}: use one of {', '.join(NAMED_NETWORKS)} "
        "or a ws:// / wss:// endpoint URL (validator.network)"
    )


def isolate_sdk_caches(data_dir: Path) -> None:
    """Point the SDK's on-disk caches (token symbols, runtime metadata) into the node's data dir
    rather than ~/.bittensor, so a node with `--home` writes nothing outside it. An operator's
    own setting of either variable wins."""
    os.environ.setdefault("BTCLI_TOKEN_SYMBOLS_CACHE", str(data_dir / "bittensor" / "token_symbols.json"))
    os.environ.setdefault("BITTENSOR_RUNTIME_CACHE_DIR", str(data_dir / "bittensor" / "runtime-cache"))


@dataclasses.dataclass(frozen=True, slots=True)
class Neuron:
    uid: int
    hotkey: str
    coldkey: str
    validator_permit: bool
    last_update: int
    stake: float
    """Total stake, in the subnet's token."""
    incentive: float
    """0..1, this uid's share of the miners' emission at the last epoch."""
    dividends: float
    emission: float
    """Emission at the last epoch, in the subnet's token."""
    active: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ChainView:
    """The subnet at one block: what the light loop needs to resolve uids and schedule submits."""

    netuid: int
    block: int
    block_time_s: float
    owner_hotkey: str | None
    tempo: int
    weights_rate_limit: int
    activity_cutoff: int
    commit_reveal: bool
    neurons: tuple[Neuron, ...]

    @property
    def hotkeys(self) -> tuple[str, ...]:
        """Hotkeys indexed by uid."""
        return tuple(neuron.hotkey for neuron in self.neurons)

    def neuron_of(self, hotkey: str) -> Neuron | None:
        return next((neuron for neuron in self.neurons if neuron.hotkey == hotkey), None)


Stage = Literal["landed", "preflight", "chain", "transport"]


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitOutcome:
    stage: Stage
    message: str
    error_name: str | None = None
    """The chain's own error name (`NeuronNoValidatorPermit`, `SettingWeightsTooFast`, ...)."""
    code: str | None = None
    """The SDK's error class (`not_authorized`, `rate_limited`, ...)."""
    extrinsic_id: str | None = None
    remediation: str | None = None
    """The SDK's advice for this refusal (e.g. how to get a validator permit)."""

    @property
    def landed(self) -> bool:
        return self.stage == "landed"

    def describe(self) -> str:
        if self.landed:
            return f"included as {self.extrinsic_id or 'an extrinsic'}"
        name = f"{self.error_name} " if self.error_name else ""
        code = f"[{self.code}] " if self.code else ""
        return f"{self.stage} refusal: {name}{code}{self.message}".strip()


class ChainClient:
    """One SDK client for the process; every method but `close` is safe to call from trio."""

    def __init__(self, network: str, *, substrate: Any = None) -> None:
        self.network = network if substrate is not None else check_network(network)
        self._substrate = substrate
        self._client: Any = None
        self._limiter = trio.CapacityLimiter(1)

    def _sdk(self) -> Any:
        """The connected SyncClient, created on first use (blocking; in the worker thread)."""
        if self._client is None:
            import bittensor as bt

            client = bt.SyncClient(
                self.network, substrate=self._substrate, fallback_endpoints=[] if self._substrate is not None else None
            )
            client.connect()
            self._client = client
        return self._client

    def read_blocking(self, netuid: int) -> ChainView:
        snapshot = self._sdk().at()
        graph = snapshot.subnets.metagraph(netuid, commitments=False)
        if graph is None:
            raise ConfigError(f"subnet {netuid} does not exist on {self.network} (node.netuid)")
        hyper = snapshot.subnets.subnet_hyperparameters(netuid) or {}
        tempo = _int(hyper.get("tempo"), graph.tempo)
        cutoff = hyper.get("activity_cutoff")
        if not isinstance(cutoff, int) or cutoff <= 0:
            # Newer runtimes derive the cutoff from a per-mille factor of the tempo.
            factor = _int(hyper.get("activity_cutoff_factor"), DEFAULT_ACTIVITY_FACTOR_MILLI)
            cutoff = factor * tempo // 1000
        return ChainView(
            netuid=netuid,
            block=int(snapshot.block),
            block_time_s=float(snapshot.block_time()),
            owner_hotkey=graph.owner_hotkey or None,
            tempo=tempo,
            weights_rate_limit=_int(hyper.get("weights_rate_limit"), 0),
            activity_cutoff=int(cutoff),
            commit_reveal=bool(hyper.get("commit_reveal_weights_enabled", False)),
            neurons=tuple(_neuron(entry) for entry in graph.neurons),
        )

    def set_weights_blocking(
        self, signer: Keypair, *, netuid: int, uids: Sequence[int], values: Sequence[int], version_key: int = 0
    ) -> SubmitOutcome:
        import bittensor as bt

        intent = bt.SetWeights(
            netuid=netuid, uids=list(uids), weights=[float(value) for value in values], version_key=version_key
        )
        try:
            # Inclusion, not finalisation: finality adds ~a minute and changes nothing the
            # schedule needs. `retries` covers only transient pool errors ("priority too low").
            result = self._sdk().execute(
                intent,
                signer,
                wait_for_inclusion=True,
                wait_for_finalization=False,
                period=SUBMIT_PERIOD_BLOCKS,
                retries=2,
            )
        except bt.ChainError as err:
            stage: Stage = "preflight" if _code(err) in PREFLIGHT_CODES else "transport"
            return SubmitOutcome(stage, str(err), err.name, _code(err), remediation=_remediation(err))
        except bt.RpcConnectionError as err:
            return SubmitOutcome("transport", f"{type(err).__name__}: {err}")
        except bt.BittensorError as err:
            # The SDK's own refusal to build the call, e.g. "All weights are zero".
            return SubmitOutcome("preflight", f"{type(err).__name__}: {err}")
        if result.success:
            return SubmitOutcome("landed", result.message or "included", extrinsic_id=result.extrinsic_id)
        error = result.error
        return SubmitOutcome(
            "chain",
            result.message or (str(error) if error else "refused"),
            error.name if error else None,
            _code(error) if error else None,
            remediation=_remediation(error) if error else None,
        )

    async def read(self, netuid: int, *, timeout_s: float = READ_TIMEOUT_S) -> ChainView:
        with trio.fail_after(timeout_s):
            return await trio.to_thread.run_sync(
                self.read_blocking, netuid, limiter=self._limiter, abandon_on_cancel=True
            )

    async def set_weights(
        self,
        signer: Keypair,
        *,
        netuid: int,
        uids: Sequence[int],
        values: Sequence[int],
        timeout_s: float = SUBMIT_TIMEOUT_S,
    ) -> SubmitOutcome:
        with trio.move_on_after(timeout_s):
            # Abandoning the thread stops the wait, not the extrinsic: it may still land.
            return await trio.to_thread.run_sync(
                lambda: self.set_weights_blocking(signer, netuid=netuid, uids=uids, values=values),
                limiter=self._limiter,
                abandon_on_cancel=True,
            )
        return SubmitOutcome(
            "transport",
            f"no answer from the chain within {timeout_s:.0f} s; the extrinsic may "
            "still land (the next read's last_update shows it)",
        )

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _neuron(entry: Any) -> Neuron:
    return Neuron(
        uid=int(entry.uid),
        hotkey=str(entry.hotkey),
        coldkey=str(entry.coldkey),
        validator_permit=bool(entry.validator_permit),
        last_update=int(entry.last_update),
        stake=_amount(entry.total_stake),
        incentive=float(entry.incentive),
        dividends=float(entry.dividends),
        emission=_amount(entry.emission),
        active=bool(entry.active),
    )


def _amount(balance: Any) -> float:
    """A `Balance` in whole tokens. From rao, because the metagraph's stake and emission are
    subnet-alpha balances and the SDK refuses to read those as `.tao`."""
    rao = getattr(balance, "rao", None)
    if isinstance(rao, int):
        return rao / 1e9
    try:
        amount = float(balance)
    except (TypeError, ValueError):
        return 0.0
    return amount if math.isfinite(amount) else 0.0


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _code(error: Any) -> str | None:
    code = getattr(error, "code", None)
    return getattr(code, "value", None) if code is not None else None


def _remediation(error: Any) -> str | None:
    try:
        return str(error.remediation) or None
    except Exception:  # broad on purpose: advice text must never turn a refusal into a crash
        return None
