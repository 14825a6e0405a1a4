"""What each component of a node reports about itself, typed: the schema of the hub's states.

Every component that calls `Hub.set_state` has one snapshot type here, and the hub refuses a
field its type does not declare, so a producer cannot rename or invent a field without the
change showing up in this file. The control API serves the states as JSON (`/v1/status`, with
`STATE_SCHEMA`); the TUI and `engy-node status` decode that JSON back into these types with
`decode_states` and read attributes, so a field the TUI reads cannot disappear without mypy
and the schema tests failing.

The wire form is the JSON the hub already holds: producers pass plain values, and a few wire
keys are not Python names (`pass`, `from`) — those fields carry their wire key in
`field(metadata={"key": ...})`. Decoding is liberal, because a TUI may watch a node of another
version: unknown keys are ignored, a missing or ill-typed field takes its default. Tests decode
strictly (`strict=True`), which raises on anything the types do not describe.

Records nested in a state are declared here too, even those a role builds (a gateway leg, a
traffic standing, a server failure): the TUI must read them without importing the role. The GPU
monitor's sample and finding live here outright, since the monitor publishes them as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

# The alert task's state is declared beside its rules, and re-exported like the verdict tallies.
from engy_node.alerts.state import Alert as Alert
from engy_node.alerts.state import AlertsState as AlertsState
from engy_node.protocol import gates  # a miner's epoch and the gate findings, declared beside the gates

# The codec (JSON-ready data to these types and back) lives beside them, re-exported.
from engy_node.snapshot_codec import SchemaError as SchemaError
from engy_node.snapshot_codec import decode as decode
from engy_node.snapshot_codec import encode as encode
from engy_node.snapshot_codec import wire_key as wire_key
from engy_node.snapshot_codec import wire_keys as wire_keys

# The verdict tallies are part of the schema (re-exported: the dashboards read them from here).
from engy_node.verdict_counts import PROOFS as PROOFS
from engy_node.verdict_counts import ProofVerdicts as ProofVerdicts
from engy_node.verdict_counts import VerdictCounts as VerdictCounts
from engy_node.verdict_counts import gemm_audited as gemm_audited

STATE_SCHEMA = 1
"""The version of the states' shape that `/v1/status` reports. Raise it when a field is renamed
or removed, or its meaning changes (adding a field does not need it: readers ignore unknowns)."""


def _key(name: str) -> dict[str, str]:
    return {"key": name}


# ---- the node ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class NodeInfo:
    """Who the node is (`node`): from the control API's node info, and a local network's hub."""

    version: str | None = None
    pid: int | None = None
    roles: tuple[str, ...] = ()
    started_at: float | None = None
    home: str | None = None
    netuid: int | None = None
    network: str | None = None
    hotkeys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Name -> ss58 of each identity a local network made (owner, validator, miner-1, …)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ControlState:
    """Where this node's control API listens (`control`)."""

    url: str | None = None
    token_file: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class NetworkState:
    """Where a local network's services answer (`network`, `engy-node up`)."""

    buyer_api: str | None = None
    provider_api: str | None = None
    miner_ws: str | None = None
    control_api: str | None = None
    details: str | None = None
    """The network file with the buyer key."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChainNeuron:
    uid: int | None = None
    hotkey: str | None = None
    stake: float | None = None
    permit: bool = False
    active: bool = False
    last_update: int | None = None
    incentive: float | None = None
    dividends: float | None = None
    emission: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ChainState:
    """The local dev chain's subnet (`chain`, `engy-node up`)."""

    network: str | None = None
    netuid: int | None = None
    block: int | None = None
    block_time_s: float | None = None
    tempo: int | None = None
    epochs_run: int | None = None
    neurons: tuple[ChainNeuron, ...] = ()
    weights: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)
    """Validator uid -> miner uid -> weight (u16) as last set on chain."""


Level = Literal["warning", "error"]


@dataclasses.dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one moment. Every reading may be None: NVML had none (see `hardware.monitor`)."""

    index: int
    """NVML index (PCI bus order)."""
    name: str | None = None
    temperature_c: int | None = None
    temperature_slowdown_c: int | None = None
    """Where the GPU starts cutting clocks to cool down."""
    temperature_shutdown_c: int | None = None
    fan_percent: int | None = None
    """The speed the driver asks for, not a measurement: a blocked fan still reads its target."""
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    """The enforced limit."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    gpu_util_percent: int | None = None
    memory_util_percent: int | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    clock_event_reasons: tuple[str, ...] | None = None
    """Why clocks are below max right now (`gpu_idle`, `sw_power_cap`, `hw_thermal`, ...)."""
    errors: tuple[str, ...] = ()
    """Readings NVML failed on for a reason other than "not supported", e.g.
    `"fan speed (Unknown Error)"`."""
    lost: bool = False
    """NVML said the GPU is lost: it stopped answering (fell off the bus)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists."""
        return {
            field.name: list(value) if isinstance(value, tuple) else value
            for field in dataclasses.fields(self)
            for value in (getattr(self, field.name),)
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One thing a miner should act on, with the fix in `text`."""

    gpu: int
    kind: str
    """Short code, stable for tests and for the TUI to mark the cell it is about: `pcie`,
    `throttling`, `temperature`, `fan`, `lost`, `read_errors`, `xid`."""
    level: Level
    text: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class XidRecord:
    """The Xid errors (NVML `nvmlEventTypeXidCriticalError` events) one GPU reported since the
    monitor started: the last one and how many (`engy_node.hardware.xids` explains each)."""

    gpu: int
    xid: int
    """The last Xid number, as in the kernel log's `NVRM: Xid (...): 79, ...`."""
    at: float
    """When it came (Unix time)."""
    count: int = 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class GpusState:
    """The GPU monitor's latest reading (`gpus`)."""

    samples: tuple[GpuSample, ...] = ()
    findings: tuple[Finding, ...] = ()
    xids: tuple[XidRecord, ...] = ()
    """By GPU, only those that reported one."""
    reason: str | None = None
    """Why there is nothing to monitor (CPU mode), if so."""
    error: str | None = None
    sampled_at: float | None = None


# ---- the miner ----------------------------------------------------------------------------------


GEMM_AND_TOPLOC = "GEMM audits + TOPLOC"
TOPLOC_ALONE = "TOPLOC alone"
"""`MinerState.proofs`: which proofs judge a miner's answers."""


@dataclasses.dataclass(frozen=True, slots=True)
class MinerState:
    """One miner (`miner`, or `miner-N` in a local network): its plan and its link to the gateway."""

    model: str | None = None
    max_inflight: int | None = None
    cpu_mode: bool | None = None
    plan: str | None = None
    command: str | None = None
    """The model server's command line, when this miner launches one."""
    legs_up: int | None = None
    legs: int | None = None
    inflight: int | None = None
    link_error: str | None = None
    """Why the link's last dial failed (the gateway's meta or a leg); None once a leg is admitted."""
    denied: str | None = None
    """The gateway's reason for denying the last leg; None once a leg is admitted."""
    hotkey: str | None = None
    weights_root: str | None = None
    """The weight commitment of the checkpoint its model server loads (engy_node.gemm.loaded)."""
    weights_pinned: bool | None = None
    """True: it is the root the catalog pins for the model; False: the catalog pins none."""
    simulated_cheat: str | None = None
    """The cheat its model server is told to serve (`miner.simulate_cheat`, demos and tests
    only); None: honest."""
    proofs: str | None = None
    """Which proofs judge it: `GEMM_AND_TOPLOC` or `TOPLOC_ALONE` (`ServeRotation.gemm_support`);
    None until its model server was asked."""
    proofs_detail: str | None = None
    """With GEMM audits, the commitment format and the positions an answer may have; alone, why
    (the model server's or its capture's reason, with the fix)."""
    epoch: gates.MinerEpoch | None = None
    """Its newest published epoch, gates explained, as its gateway tells it (`miner.epoch_watch`)."""

    @property
    def link_down(self) -> str | None:
        """Why this miner has no leg up at the gateway: the gateway's denial, else the dial's
        error; None while a leg is up or no failure is known. The miner_link alert and the
        Overview's requests panel both read this."""
        return None if self.legs_up else (self.denied or self.link_error)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerFailure:
    """Why a supervised model server stopped, and what to change."""

    kind: str = "unknown"
    summary: str = ""
    fix: str = ""
    phase: str | None = None
    """`startup` or `runtime`."""
    exit_code: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ModelServerState:
    """A miner's supervised model server (`model_server`, or `model_server.<miner>`)."""

    state: str | None = None
    """starting, ready, unhealthy, restarting, stopped, failed."""
    kind: str | None = None
    """`sglang` or `reference`."""
    url: str | None = None
    command: str | None = None
    pid: int | None = None
    restarts: int = 0
    startup_failures: int = 0
    last_failure: ServerFailure | None = None
    restart_in_s: float | None = None
    log_lines_truncated: int = 0
    running: int | None = None
    queued: int | None = None
    generation_tokens_total: int | None = None
    gen_throughput: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    poll_error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ServeState:
    """A reference server run on its own (`serve`, `engy-node serve`)."""

    state: str | None = None
    url: str | None = None
    model: str | None = None
    model_root: str | None = None
    weights_root: str | None = None
    """The loaded checkpoint's weight commitment (engy_node.gemm.loaded); a mismatch with the
    catalog's pin refuses to serve, so it is never reported."""
    weights_pinned: bool | None = None
    """True: the catalog pins this model's weights_root and it matches; False: it pins none."""
    device: str | None = None
    dtype: str | None = None
    simulated_cheat: str | None = None
    """The cheat its weights were altered by in memory after the check (`serve.simulate_cheat`,
    demos and tests only); None: served as loaded."""


# ---- the gateway --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayLeg:
    """One miner websocket leg the gateway holds."""

    leg: str | None = None
    miner: str | None = None
    worker: str | None = None
    model: str | None = None
    capacity: int = 0
    inflight: int = 0
    heartbeat_age_s: float | None = None
    region: str | None = None
    """Where the miner says it serves from (its hello's `hw`, informational)."""
    tee: str | None = None
    """Its GPU confidential-computing mode, if it claims one."""
    context_length: int | None = None
    kv_used: float | None = None
    gemm_audit: bool | None = None
    """Its hello announced GEMM audits (`protocol.gemm.FEATURE_GEMM`): its answers commit their
    activations and it answers challenges. False: TOPLOC alone judges it. None: a gateway that
    does not say."""


@dataclasses.dataclass(frozen=True, slots=True)
class PromptCacheState:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_rate: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayState:
    """The gateway process (`gateway`)."""

    state: str | None = None
    """ready, draining, stopped."""
    buyer_url: str | None = None
    miner_url: str | None = None
    provider_url: str | None = None
    models: tuple[str, ...] = ()
    worker: int | None = None
    workers: int | None = None
    in_flight: int | None = None
    legs: tuple[GatewayLeg, ...] = ()
    prompt_cache: PromptCacheState | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeRound:
    """A qualification round's probes so far."""

    probes: int = 0
    ok: int = 0
    passed: int = dataclasses.field(default=0, metadata=_key("pass"))
    unproven: int = 0
    cheat: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class BreakerWindow:
    """What the breaker weighs now: the last minutes of served requests and verdicts
    (`protocol.standing` sets the windows), not lifetime totals."""

    requests: int = 0
    failed: int = 0
    verdicts: int = 0
    unproven: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class LifetimeCounts:
    """Everything a (miner, model) served and had judged since this gateway started."""

    served: int = 0
    failed: int = 0
    audited: int = 0
    passed: int = dataclasses.field(default=0, metadata=_key("pass"))
    cheat: int = 0
    unproven: int = 0
    proofs: ProofVerdicts = dataclasses.field(default_factory=ProofVerdicts)
    """The same verdicts by the proof that judged them."""


@dataclasses.dataclass(frozen=True, slots=True)
class StandingChange:
    """One move of a (miner, model) between traffic states, and why."""

    from_state: str | None = dataclasses.field(default=None, metadata=_key("from"))
    to_state: str | None = dataclasses.field(default=None, metadata=_key("to"))
    reason: str | None = None
    at: float | None = None
    code: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficStanding:
    """Where a (miner, model) stands for paid traffic, and why."""

    miner: str | None = None
    model: str | None = None
    state: str | None = None
    """new, qualifying, active, probation, pulled, …"""
    since: float | None = None
    reason: str | None = None
    eligible: bool = False
    first_party: bool = False
    connected: bool = False
    until: float | None = None
    strikes: int = 0
    round: ProbeRound = dataclasses.field(default_factory=ProbeRound)
    window: BreakerWindow = dataclasses.field(default_factory=BreakerWindow)
    lifetime: LifetimeCounts | None = None
    """None from a gateway older than these totals: unknown, which is not zero."""
    history: tuple[StandingChange, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficPolicyState:
    """The gateway's traffic policy (`traffic`): every (miner, model) it knows."""

    workers: tuple[TrafficStanding, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class AuditState:
    """The gateway's audit queue (`audit`)."""

    waiting: int = 0
    leased: int = 0
    dropped_full: int = 0
    dropped_expired: int = 0
    dropped_unjudged: int = 0
    recorded: int = 0
    """Verdicts recorded since the gateway started."""


@dataclasses.dataclass(frozen=True, slots=True)
class BuyerAccount:
    account_id: int | None = None
    name: str | None = None
    available: int = 0
    """µUSD a new request can hold."""
    held: int = 0
    charged: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class BuyersState:
    """The buyers with the largest balances (`buyers`)."""

    accounts: int = 0
    top: tuple[BuyerAccount, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class EpochsState:
    """The newest epoch this gateway published (`epochs`)."""

    latest: int | None = None
    digest: str | None = None
    weights: tuple[tuple[str, int], ...] = ()
    """(hotkey, u16 weight) pairs of the published settlement."""


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficGeneratorState:
    """The demo buyer of a local network (`traffic_generator`, `engy-node up --traffic`)."""

    paused: bool = False
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    output_chars: int = 0
    last_error: str | None = None


# ---- the validator and the verifier ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WeightEntry:
    uid: int | None = None
    hotkey: str | None = None
    weight: int = 0
    """u16, as submitted."""


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    """One weights submission, newest first in `ValidatorState.submissions`."""

    ts: float | None = None
    block: int | None = None
    epoch: int | None = None
    kind: str | None = None
    landed: bool = False
    detail: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorState:
    """The light validator's loop (`validator`)."""

    hotkey: str | None = None
    network: str | None = None
    provider: str | None = None
    netuid: int | None = None
    resubmit_blocks: int | None = None
    poll_s: float | None = None
    block: int | None = None
    block_time_s: float | None = None
    uid: int | None = None
    permit: bool | None = None
    last_update: int | None = None
    weights_rate_limit: int | None = None
    activity_cutoff: int | None = None
    tempo: int | None = None
    commit_reveal: bool | None = None
    chain_error: str | None = None
    """Why the last chain read failed; None once one succeeds."""
    provider_error: str | None = None
    """Why the last poll got no usable payload from the provider; None when it got one."""
    cached_vector: bool | None = None
    """Whether a landed vector is cached to resubmit while the provider gives none."""
    last_tick: float | None = None
    last_outcome: str | None = None
    last_applied: int | None = None
    last_submit_block: int | None = None
    last_submit_ts: float | None = None
    blocks_since_submit: int | None = None
    next_resubmit_in_blocks: int | None = None
    submitted_epoch: int | None = None
    submitted_block: int | None = None
    digest: str | None = None
    dropped: tuple[str, ...] = ()
    """Hotkeys of the epoch's weights that have no uid on chain."""
    dropped_share: float = 0.0
    gated: tuple[gates.GateFinding, ...] = ()
    """Rows of the newest verified epoch a settlement gate zeroed: absent from `weights`, not dropped."""
    weights: tuple[WeightEntry, ...] = ()
    submissions: tuple[Submission, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierState:
    """The verifier (`verifier`): where it leases and what it has judged."""

    state: str | None = None
    gateway: str | None = None
    hotkey: str | None = None
    verdicts: VerdictCounts = dataclasses.field(default_factory=VerdictCounts)
    proofs: ProofVerdicts = dataclasses.field(default_factory=ProofVerdicts)
    """The same verdicts by the proof that judged them."""


# ---- the whole node ------------------------------------------------------------------------------

SINGLE_COMPONENTS: Mapping[str, type] = {
    "node": NodeInfo,
    "control": ControlState,
    "network": NetworkState,
    "chain": ChainState,
    "gpus": GpusState,
    "serve": ServeState,
    "gateway": GatewayState,
    "traffic": TrafficPolicyState,
    "audit": AuditState,
    "buyers": BuyersState,
    "epochs": EpochsState,
    "traffic_generator": TrafficGeneratorState,
    "validator": ValidatorState,
    "verifier": VerifierState,
    "alerts": AlertsState,
}
"""Each component a node has at most one of, by hub name."""

MINER = "miner"
MODEL_SERVER = "model_server"


def is_miner(component: str) -> bool:
    """`miner`, or a local network's `miner-N`."""
    return component == MINER or (component.startswith(f"{MINER}-") and len(component) > len(MINER) + 1)


def is_model_server(component: str) -> bool:
    """`model_server`, or `model_server.<miner>`."""
    return component == MODEL_SERVER or (
        component.startswith(f"{MODEL_SERVER}.") and len(component) > len(MODEL_SERVER) + 1
    )


def server_component(miner: str) -> str:
    """The hub component of `miner`'s model server (`miner.role.run_miner`, `local.up`)."""
    return MODEL_SERVER if miner == MINER else f"{MODEL_SERVER}.{miner}"


def miner_of_server(component: str) -> str:
    return MINER if component == MODEL_SERVER else component.removeprefix(f"{MODEL_SERVER}.")


def state_type(component: str) -> type | None:
    """The snapshot type of hub component `component`, or None for a name no component has."""
    if component in SINGLE_COMPONENTS:
        return SINGLE_COMPONENTS[component]
    if is_miner(component):
        return MinerState
    if is_model_server(component):
        return ModelServerState
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class NodeStates:
    """One node's states, decoded: what the TUI renders and `engy-node status` prints."""

    node: NodeInfo = dataclasses.field(default_factory=NodeInfo)
    control: ControlState | None = None
    network: NetworkState | None = None
    chain: ChainState | None = None
    gpus: GpusState | None = None
    serve: ServeState | None = None
    gateway: GatewayState | None = None
    traffic: TrafficPolicyState | None = None
    audit: AuditState | None = None
    buyers: BuyersState | None = None
    epochs: EpochsState | None = None
    traffic_generator: TrafficGeneratorState | None = None
    validator: ValidatorState | None = None
    verifier: VerifierState | None = None
    alerts: AlertsState | None = None
    miners: dict[str, MinerState] = dataclasses.field(default_factory=dict)
    """By hub component (`miner`, `miner-1`, …)."""
    model_servers: dict[str, ModelServerState] = dataclasses.field(default_factory=dict)
    """By the miner they serve (`miner`, `miner-1`, …), not by hub component."""

    def miner_names(self) -> list[str]:
        """Every miner of this node, in natural order (miner-2 before miner-10), including one
        whose server reported first; a name with control characters is not shown."""
        found = {name for name in (*self.miners, *self.model_servers) if name.isprintable()}
        return sorted(found, key=_natural)


def _natural(name: str) -> tuple[tuple[int, int, str], ...]:
    # Digit runs compare by length, then text: numeric order with no int() of a huge number.
    return tuple(
        (0, 0, part) if i % 2 == 0 else (1, len(part), part) for i, part in enumerate(re.split(r"(\d+)", name))
    )


def decode_states(states: Mapping[str, Any], *, strict: bool = False) -> NodeStates:
    """The hub's states (`Hub.states()`, or `/v1/status`'s `states`) as `NodeStates`. Liberal
    unless `strict`: a component or field this version does not know is skipped."""
    singles: dict[str, Any] = {}
    miners: dict[str, MinerState] = {}
    servers: dict[str, ModelServerState] = {}
    for component, value in states.items():
        if not isinstance(component, str):
            continue
        kind = state_type(component)
        if kind is None:
            if strict:
                raise SchemaError(f"hub component {component!r} has no snapshot type in engy_node.snapshots")
            continue
        if not isinstance(value, Mapping):
            if strict:
                raise SchemaError(f"hub component {component!r} is {type(value).__name__}, not an object")
            continue
        decoded: Any = decode(kind, value, strict=strict, where=component)
        if kind is MinerState:
            miners[component] = decoded
        elif kind is ModelServerState:
            servers[miner_of_server(component)] = decoded
        else:
            singles[component] = decoded
    return NodeStates(**singles, miners=miners, model_servers=servers)
