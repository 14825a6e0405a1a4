"""Layered configuration: defaults < `node.toml` < `ENGY_*` environment < command-line flags.

Each section is a frozen dataclass whose fields carry their defaults and a docstring; the loader
reads them generically, so adding a setting is adding a field. Everything is validated once at
startup and then passed explicitly to the component that owns the section — nothing reads a
global config later.

Where things live (docs/architecture.md, "Processes, ports and files"):

| what | default | with `--home DIR` (or `ENGY_HOME`) |
|---|---|---|
| `node.toml` | `user_config_dir("engy")` | `DIR/node.toml` |
| state: SQLite, wallets, logs, converted models | `user_data_dir("engy")` | `DIR/data` |
| converted embedded-model cache, shared by all homes | `user_cache_dir("engy")/models` | unchanged (`ENGY_MODEL_CACHE` moves it) |

The model cache deliberately ignores `--home`: converting the embedded GGUF takes ~15 s, and
tests run every node in a fresh temp home.

Environment variables are `ENGY_<SECTION>__<FIELD>` (e.g. `ENGY_SERVE__PORT=8000`). An unknown
section or field, in the file or the environment, is an error that suggests the closest name:
a typo that silently falls back to a default is the costlier mistake.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from engy_node.alerts import settings as alert_settings
from engy_node.alerts.settings import AlertsSection
from engy_node.errors import ConfigError
from engy_node.simulated_cheats import check_simulated_cheat

APP_NAME = "engy"
ENV_PREFIX = "ENGY_"
LogLevel = Literal["debug", "info", "warning", "error"]
MAX_GATEWAY_WORKERS = 64
MAX_GEMM_OPENING_TIMEOUT_S = 25.0
"""`gateway.gemm_opening_timeout_s` at most: under the verifier's 30 s timeout for an audit API call
(`verifier.sources.HTTP_TIMEOUT_S`), so it hears the miner's failure rather than its own timeout."""


# How long a miner's stop may take (`engy_node.miner.drain`): the steps' bounds, restated so that
# loading a config can refuse a `miner.drain_s` that would outlast systemd's stop.
SYSTEMD_STOP_S = 90.0
"""systemd's DefaultTimeoutStopSec: SIGTERM, then SIGKILL after this long."""
NODE_MARGIN_S = 10.0
"""The rest of a node's stop around the miner's: other services' cleanup, the interpreter's exit."""
ANNOUNCE_S = 2.0
"""Sending the capacity-0 heartbeat on every leg at once (one small frame each)."""
ABORT_S = 7.0
"""The serve client's abort call (`serve.client.ABORT_TIMEOUT_S`, 5 s) and then sending the
terminal responses (2 s)."""
CLOSE_S = 2.0
"""Closing every leg at once: the websocket close handshake (`link.CLOSE_TIMEOUT_S`)."""
SERVER_STOP_S = 22.0
"""The model server's stop: `SupervisorSettings.stop_grace_s` (15 s), the SIGKILL wait (5 s) and
the output drain (2 s) of the supervisor."""
MAX_DRAIN_S = SYSTEMD_STOP_S - NODE_MARGIN_S - ANNOUNCE_S - ABORT_S - CLOSE_S - SERVER_STOP_S
"""The longest `miner.drain_s` whose stop still fits systemd's: 47 s."""
DEFAULT_DRAIN_S = 30.0
"""Enough for a chat answer of a few hundred tokens already under way to finish at consumer-GPU
decode speeds; a 32k-token answer is aborted and the buyer told."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSection:
    netuid: int = 53
    """Subnet id used in every signed message."""
    log_level: LogLevel = "info"
    """Lowest level written to stderr and the log file; the in-memory hub keeps debug too."""
    log_ring_size: int = 10_000
    """Log and event records the hub keeps in memory for the TUI and the control API."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServeSection:
    model: str = "smollm2-135m"
    """Catalog id of the model the reference server loads."""
    checkpoint: str = ""
    """Checkpoint directory (config.json + *.safetensors + tokenizer). Empty: the embedded
    model, converted once from its GGUF."""
    host: str = "127.0.0.1"
    port: int = 30000
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses CUDA when torch sees a GPU."""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Serving precision. bf16 is what sglang serves; the verifier may recompute in float32."""
    max_running_requests: int = 8
    """Requests decoded concurrently; further requests wait in the queue."""
    enable_return_hidden_states: bool = True
    """Same meaning as sglang's `--enable-return-hidden-states`."""
    stream_hidden_states: Literal["cumulative", "final"] = "cumulative"
    """`cumulative` repeats every hidden state on every streamed event, as stock sglang does;
    `final` sends them only on the last event (what a trimmed sglang does; far less traffic)."""
    served_model_name: str = ""
    """Name reported by /model_info and /v1/models. Empty: the catalog id."""
    request_timeout_s: float = 1800.0
    """A request still running after this long is aborted."""
    prefix_cache_tokens: int = 16384
    """Tokens of recent prompts and answers whose KV cache is kept for requests that start the
    same way (sglang's radix cache; `cached_tokens` reports the hits). 0 turns it off, as
    sglang's `--disable-radix-cache` does."""
    simulate_cheat: str = ""
    """For demos and tests of the audits only: after the load-time weights check, alter the
    loaded weights in memory by this cheat of `engy_node.calibration.SIMULATED_CHEATS` (e.g.
    `noise-1%`), so the server serves other weights while reporting the checkpoint's
    `weights_root`, as a lying miner would. Logged as a warning and shown in `/server_info`.
    Empty: the weights as loaded."""


@dataclasses.dataclass(frozen=True, slots=True)
class MinerSection:
    gateway_url: str = ""
    """Gateway websocket base, e.g. `wss://api.engy.ai/gw` (public miner: `GW`)."""
    miner_key: str = ""
    """Key issued by the gateway operator (public miner: `MINER_KEY`). Secret: never logged.
    Leave empty to be admitted by a registered hotkey's signature instead (`wallet_*`)."""
    model: str = "smollm2-135m"
    """Catalog id of the served model (public miner: `MODEL`)."""
    max_inflight: int = 0
    """Total concurrent requests advertised (public miner: `MAX_INFLIGHT`); 0 = from the plan."""
    worker_name: str = ""
    """Name of this rig at the gateway (public miner: `ENGY_WORKER_NAME`); empty = host name."""
    serve_urls: str = ""
    """Already-running model server(s), comma-separated (public miner: `SERVE_URL`,
    `--serve-url`). Empty: the miner plans, launches and supervises one itself."""
    checkpoint: str = ""
    """Checkpoint directory: tokenizer, chat template and model_root come from it. Empty: the
    embedded model."""
    serve_port: int = 0
    """Port for a model server the miner launches; 0 picks a free loopback port."""
    context_length: int = 0
    """Context length to plan for; 0 = the model's full context."""
    chunk_tokens: int = 4096
    """Tokens per /generate call for long outputs (docs/verification.md)."""
    fake_gpus: str = ""
    """Plan against simulated GPUs (e.g. `4xRTX4090`) and print the plan and command instead of
    launching anything."""
    wallets_path: str = "~/.bittensor/wallets"
    wallet_name: str = ""
    """With `wallet_hotkey`: sign hello with this registered hotkey (docs/protocol.md, "Signed hello")."""
    wallet_hotkey: str = ""
    drain_s: float = DEFAULT_DRAIN_S
    """On SIGTERM or Ctrl-C, requests in flight may finish for this long while no new ones are
    routed here; the rest are aborted and the buyers told. 0 aborts at once. At most 47, so the
    whole stop fits systemd's default 90 s (see `engy_node.miner.drain`)."""
    simulate_cheat: str = ""
    """For demos and tests of the audits only: the reference server this miner launches serves
    weights altered by this cheat (`serve.simulate_cheat`, e.g. `noise-1%`). Empty: honest."""
    gemm_capture: bool = False
    """Take GEMM audits on sglang (docs/verification.md): arm the audit's capture in the sglang
    server this miner launches. sglang then runs without its radix cache and CUDA graphs, which
    costs throughput, on one GPU (tp 1, dp 1) and for Llama-shaped models. The reference server
    (CPU mode) commits its activations without it."""
    gemm_capture_urls: str = ""
    """With `serve_urls` (servers you launched with the capture armed): each one's capture port,
    comma-separated in the same order, e.g. `http://127.0.0.1:30001`. Empty: those servers are
    judged by TOPLOC alone."""


@dataclasses.dataclass(frozen=True, slots=True)
class GatewaySection:
    host: str = "127.0.0.1"
    """Bind address of the buyer API and the miner endpoint (loopback unless you front it)."""
    port: int = 8080
    """Buyer API port (OpenAI and Anthropic routes); 0 picks a free one."""
    miner_port: int = 8081
    """Miner websocket port (`/gw`, `/gw/meta`); 0 picks a free one."""
    models: str = "smollm2-135m"
    """Served models, comma-separated catalog ids."""
    checkpoints: str = ""
    """`model=DIR` pairs, comma-separated: where each model's tokenizer and config live (the
    gateway tokenises every request itself). The embedded model needs none."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest buyer request body; a 200k-token conversation is well under 2 MB of JSON."""
    body_timeout_s: float = 60.0
    """Longest a buyer's request body may take to arrive (408 after): a client trickling it holds
    a connection no longer than this."""
    body_bytes_in_flight: int = 128 * 1024 * 1024
    """Bytes of buyer request bodies one gateway process may be receiving at once, all requests
    together; a body that would pass it is refused with 503 (529 on /v1/messages) and Retry-After.
    At least `body_bytes_in_flight_per_account`."""
    body_bytes_in_flight_per_account: int = 32 * 1024 * 1024
    """The same per buyer account (all its keys): a body that would pass it is refused with 429
    and Retry-After, so one buyer's slow uploads cannot take the whole. At least `max_body_bytes`."""
    keepalive_s: float = 15.0
    """Streams with nothing to send get a keepalive this often (SSE comment / Anthropic ping)."""
    first_byte_wait_s: float = 15.0
    """How long a stream waits for the miner's first output before committing the response
    (status 200, keepalives). Until then a failed miner is retried and errors keep their status;
    a miner that sent nothing by then is told to cancel, logged as timed out (504, its failure)
    and the request retried on another, within what is left of its deadline."""
    max_attempts: int = 2
    """Miners tried per request while no byte has reached the buyer."""
    queue_wait_s: float = 5.0
    """When no eligible miner has room, how long a request waits for one (fair across buyers)
    before 503/529 with Retry-After; 0 answers at once."""
    queue_max: int = 256
    """Requests that may wait per model; one more is refused at once."""
    drain_s: float = 60.0
    """On SIGTERM, how long requests in flight may run to their end while no new ones are taken;
    then the rest end with an error in the API's format. Fits systemd's default 90 s stop."""
    stale_after_s: float = 90.0
    """A miner leg with no heartbeat for this long gets no new requests and is closed (three
    missed 30 s beats: docs/protocol.md)."""
    max_rigs_per_miner: int = 16
    """Rigs (miner processes) one miner identity (its miner key or hotkey) may connect. Each
    opens a leg per leg of the fleet (`/gw/meta`), so a gateway worker admits an identity's legs up
    to what this many rigs can honestly open on it (`workers.miner_legs_cap`); one more is denied,
    naming this setting."""
    proof_tee_ttl_s: float = 3600.0
    """Audit jobs (proof material, RAM only) not judged within this long are dropped."""
    proof_tee_max_entries: int = 20_000
    """Audit jobs kept at most; the oldest go first."""
    no_capacity_retry_after_s: int = 5
    """Retry-After sent with 503/529 when no miner has a free slot."""
    workers: int = 1
    """Gateway processes sharing both ports (miners open one leg per worker: docs/protocol.md). One
    process serves about one core's worth of requests; each also loads the served models'
    tokenizers (~400 MiB of memory). Use up to one per core the gateway may have."""
    provider_port: int = 8082
    """Provider API port (published epochs, the audit API, validator heartbeats), served by the
    first worker process; 0 picks a free one."""
    store_url: str = ""
    """The store several gateway hosts share: `postgresql://USER:PASSWORD@HOST:5432/DB` (an empty
    database of its own; docs/scale-out.md). Empty: the SQLite file in the data dir, one host."""
    fleet_legs: int = 0
    """Behind one load balancer, the legs a miner opens across every gateway host (`/gw/meta`
    says this; the balancer sends `/gw/{i}` to the host serving leg i). 0: this host's `workers`."""
    fleet_offset: int = 0
    """This host's first leg in the fleet: it serves `/gw/{fleet_offset}` up to
    `/gw/{fleet_offset + workers - 1}`, and any other leg a balancer fails over to it."""
    host_name: str = ""
    """This host's name in the fleet (who holds the leader lease, in logs); empty: the hostname."""
    leader_lease_s: float = 30.0
    """In a fleet, how long the leader's lease lasts unrenewed (it renews every third of it): a
    dead leader's epoch closing and traffic control pass to another host within about this long."""
    qualification: bool = True
    """Miners serve paid traffic only once probes qualified them (docs/trust.md). Off: every
    admitted miner is eligible at once (a private gateway with only your own miners)."""
    first_party: str = ""
    """Miner identities (hotkeys, or `key:<id>` for key-admitted miners), comma-separated, that
    are always eligible: your own rigs. Their degradation is still reported."""
    traffic_time_scale: float = 1.0
    """Multiplies every duration of the traffic control plane (probe gaps, windows, cooldowns,
    round timeout); local networks with short epochs use less than 1."""
    qualify_probes: int = 20
    """Finished probes, and `pass` verdicts, a qualification round needs."""
    probe_max_tokens: int = 0
    """Most output tokens a probe asks for; 0: as buyers do, up to the model's limit. A CPU-only
    local network wants a small cap (long probes tie up a slow miner)."""
    probe_concurrency: int = 16
    """Probes out at once across all miners; a CPU-only local network wants a few."""
    probe_corpus: str = ""
    """A JSON Lines file of probe conversations of your own (a private corpus miners cannot
    learn; format as `engy_node/data/probe_corpus.jsonl`). Empty: the shipped corpus."""
    audit_paid_pct: float = 5.0
    """Share of paid responses re-verified, in percent (every probe is)."""
    audit_lease_s: float = 120.0
    """How long a verifier holds a leased job before it can be leased again."""
    verifiers: str = ""
    """Hotkeys (ss58), comma-separated, allowed to lease audit jobs and post verdicts."""
    local_verifier: bool = False
    """Judge audit jobs inside the gateway too, on its CPU (local networks; ~0.5 GB of memory)."""
    gemm_audit: bool = True
    """Ask every miner that announced GEMM audits (`gemm-audit` in its hello) to commit the
    activations of every answer, so that a verifier can open a few rows of an audited one later
    (docs/trust.md, "GEMM audits"). Asked on all answers, not only the audited ones: a miner told
    which answers are audited would compute only those honestly. It costs the miner: capture and
    hashing add ~12 % to generation on SmolLM2's reference server, and each answer's record is
    kept in memory for the challenge window. Off: no miner is asked, and answers are judged by
    TOPLOC alone."""
    gemm_opening_timeout_s: float = 20.0
    """How long the gateway waits for a miner's openings when a verifier challenges an answer;
    then the verifier judges it unproven (`no-opening`). At most 25 s, inside the 30 s a verifier
    gives each call to the audit API."""
    epoch_genesis: int = 1767571200
    """Unix seconds where epoch 0 starts (2026-01-05 00:00 UTC, a Monday)."""
    epoch_s: int = 604800
    """Epoch length; weekly in production, minutes on a local network."""
    epoch_grace_s: int = 900
    """An epoch closes this long after it ends, so verdicts on its last requests still count."""
    gate_min_samples: int = 100
    """Sample below which each settlement gate passes (docs/trust.md, "Settlement"); short local epochs need less."""
    owner_hotkey: str = ""
    """The subnet owner's hotkey: an epoch with no score burns its weight to it. Needed to publish."""
    wallets_path: str = "~/.bittensor/wallets"
    master_wallet: str = ""
    """`NAME/HOTKEY` of the master hotkey that signs published epochs. Empty: epochs are settled
    (see `/epoch/current`) but not published."""
    deposit_address: str = ""
    """An ss58 address of yours: TAO a buyer's linked coldkey sends to it is credited to the buyer
    (docs/billing.md, "Deposits from the chain"). Empty: no deposits are watched."""
    deposit_usd_per_tao: str = ""
    """What one TAO deposited credits, in USD, as an exact decimal (e.g. `"412.5"`)."""
    deposit_confirmations: int = 12
    """Blocks (the deposit's own included) before a deposit is credited; at least 2."""
    deposit_network: str = "finney"
    """The chain deposits are read from: finney, test, local, or a ws(s):// URL."""
    deposit_start_block: int = 0
    """The first block scanned when the store has no deposit cursor yet; 0: the head at that start."""


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierSection:
    gateway_url: str = ""
    """The gateway's provider API, e.g. `http://127.0.0.1:8082`, whose audit jobs this verifier
    judges; for a fleet, every host's, comma-separated (each host keeps its own jobs)."""
    wallets_path: str = "~/.bittensor/wallets"
    wallet_name: str = ""
    """With `wallet_hotkey`: the hotkey that signs lease and verdict calls; the gateway operator
    lists it in `gateway.verifiers`."""
    wallet_hotkey: str = ""
    models: str = "smollm2-135m"
    """Models this verifier judges, comma-separated catalog ids."""
    checkpoints: str = ""
    """`model=DIR` pairs, comma-separated; the embedded model needs none."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    dtype: Literal["bfloat16", "float32", "float16"] = "float32"
    """Recompute precision. The thresholds hold for fp32 and bf16 recomputes (docs/verification.md)."""
    concurrency: int = 1
    """Jobs judged at once (each is a prefill of prompt + output on the device)."""
    threads: int = 0
    """CPU threads for the recompute; 0: torch's default (every core). Set it when the verifier
    shares the machine with a model server."""
    poll_s: float = 2.0
    """Pause between lease calls while the queue is empty."""


@dataclasses.dataclass(frozen=True, slots=True)
class ControlSection:
    host: str = "127.0.0.1"
    """The control API (status, events, metrics, actions for the TUI and `engy-node status`)
    listens on loopback only; reach a remote node through `ssh -L`."""
    port: int = 0
    """0 picks a free port; the node writes where it listens to `control.json` in the data dir."""


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorSection:
    network: str = "finney"
    """The chain: finney, test, local (`$BT_CHAIN_ENDPOINT` or ws://127.0.0.1:9944), or a ws(s):// URL."""
    provider_url: str = "https://provider.engy.ai"
    """The provider API that publishes signed epoch results. Set it together with `master_hotkey`:
    a provider's results verify only against its own master key."""
    master_hotkey: str = "5DXSBCCKH5ENuyHFNaAvtaMfbhEEWpjSJB4rzc4mJfsc1uvJ"
    """The pinned ss58 of the master hotkey that signs epoch results (the public SN53 provider's)."""
    wallets_path: str = "~/.bittensor/wallets"
    wallet_name: str = ""
    """With `wallet_hotkey`: this validator's hotkey, which signs the weights (registered on the
    subnet with a validator permit). No default: a validator must never sign with a wallet it
    picked up by accident."""
    wallet_hotkey: str = ""
    poll_s: float = 300.0
    """Pause between polls of the provider."""
    resubmit_blocks: int = 120
    """Blocks between resubmissions of the same vector; must clear the chain's weights_rate_limit
    (100 on SN53) with room for inclusion lag, and stay far inside the activity cutoff."""
    block_s: float = 12.0
    """Nominal block time, used only to skip opening the chain when a resubmit is clearly not due;
    the chain's own block time replaces it after the first read."""
    provider_heartbeat: bool = True
    """Post a signed liveness heartbeat (epoch and digest on chain) to the provider; best-effort."""


@dataclasses.dataclass(frozen=True, slots=True)
class Paths:
    config_file: Path
    data_dir: Path
    model_cache_dir: Path

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    paths: Paths
    node: NodeSection = NodeSection()
    serve: ServeSection = ServeSection()
    miner: MinerSection = MinerSection()
    gateway: GatewaySection = GatewaySection()
    verifier: VerifierSection = VerifierSection()
    validator: ValidatorSection = ValidatorSection()
    control: ControlSection = ControlSection()
    alerts: AlertsSection = AlertsSection()


SECTIONS: dict[str, type] = {
    "node": NodeSection,
    "serve": ServeSection,
    "miner": MinerSection,
    "gateway": GatewaySection,
    "verifier": VerifierSection,
    "validator": ValidatorSection,
    "control": ControlSection,
    "alerts": AlertsSection,
}

PUBLIC_MINER_ENV: dict[str, tuple[str, str]] = {
    "GW": ("miner", "gateway_url"),
    "MINER_KEY": ("miner", "miner_key"),
    "MODEL": ("miner", "model"),
    "MAX_INFLIGHT": ("miner", "max_inflight"),
    "ENGY_WORKER_NAME": ("miner", "worker_name"),
    "SERVE_URL": ("miner", "serve_urls"),
}
"""The public one-file miner's environment, accepted so its operators can switch unchanged.
Read only when the miner role runs (`MODEL` is too generic a name to honour otherwise), and
below `ENGY_MINER__*` in precedence."""


def comma_list(text: str) -> list[str]:
    """A comma-separated setting (`gateway.models`, `gateway.verifiers`, ...) as its items, in order."""
    return [item.strip() for item in text.split(",") if item.strip()]


def checkpoint_pairs(text: str) -> dict[str, str]:
    """A `model=DIR,...` setting (`gateway.checkpoints`, `verifier.checkpoints`) as model -> directory."""
    return dict(
        (model.strip(), path.strip())
        for model, path in (item.split("=", 1) for item in comma_list(text) if "=" in item)
    )


def config_document(config: Config) -> dict[str, Any]:
    """The resolved config as JSON-ready data, for a process that must run with exactly this
    config (a gateway worker) rather than re-resolve it from a possibly changed file or env."""
    document: dict[str, Any] = {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}
    document["paths"] = {field.name: str(getattr(config.paths, field.name)) for field in dataclasses.fields(Paths)}
    return document


def config_from_document(document: Mapping[str, Any]) -> Config:
    """`config_document`'s inverse."""
    paths = Paths(**{name: Path(value) for name, value in document["paths"].items()})
    config = Config(paths=paths, **{name: cls(**document[name]) for name, cls in SECTIONS.items()})
    _validate(config)
    return config


def resolve_paths(home: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Paths:
    import platformdirs

    home = home or env.get(f"{ENV_PREFIX}HOME") or None
    cache = env.get(f"{ENV_PREFIX}MODEL_CACHE")
    model_cache_dir = Path(cache) if cache else Path(platformdirs.user_cache_dir(APP_NAME)) / "models"
    if home:
        root = Path(home).expanduser().resolve()
        return Paths(root / "node.toml", root / "data", model_cache_dir)
    return Paths(
        Path(platformdirs.user_config_dir(APP_NAME)) / "node.toml",
        Path(platformdirs.user_data_dir(APP_NAME)),
        model_cache_dir,
    )


def load_config(
    *,
    home: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    public_miner_env: bool = False,
) -> Config:
    """Build the config from all layers. Raises `ConfigError` naming the file/variable/flag."""
    env = os.environ if env is None else env
    paths = resolve_paths(home, env)
    layers: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}

    for section, values in _read_toml(paths.config_file).items():
        layers[section].update({k: _coerce(section, k, v, f"{paths.config_file}") for k, v in values.items()})
    if public_miner_env:
        for name, (section, key) in PUBLIC_MINER_ENV.items():
            if env.get(name):
                layers[section][key] = _coerce(section, key, env[name], f"${name}")
    for section, key, raw in _env_settings(env):
        layers[section][key] = _coerce(section, key, raw, f"${ENV_PREFIX}{section.upper()}__{key.upper()}")
    for section, flags in (overrides or {}).items():
        _check_section(section, "command line")
        for key, value in flags.items():
            if value is not None:
                layers[section][key] = _coerce(section, key, value, "command line")

    built = {name: cls(**layers[name]) for name, cls in SECTIONS.items()}
    config = Config(paths=paths, **built)
    _validate(config)
    return config


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML ({err}); fix the file or move it aside") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror}); check its permissions") from None
    for section, values in document.items():
        _check_section(section, str(path))
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: [{section}] must be a table of settings")
    return document


def _env_settings(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    settings = []
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name or name in PUBLIC_MINER_ENV:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        _check_section(section, f"${name}")
        settings.append((section, key, raw))
    return settings


def _check_section(section: str, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section {section!r}{_suggest(section, SECTIONS)}")


def _suggest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(choices))}"


def _coerce(section: str, key: str, value: Any, where: str) -> Any:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    if key not in hints:
        raise ConfigError(f"{where}: [{section}] has no setting {key!r}{_suggest(key, hints)}")
    expected = hints[key]
    try:
        return _convert(expected, value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {section}.{key} = {value!r}: {err}") from None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(expected: Any, value: Any) -> Any:
    origin = typing.get_origin(expected)
    if origin is Literal:
        choices = typing.get_args(expected)
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}")
        return value
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError("must be true or false")
    if expected is int:
        if isinstance(value, bool):
            raise ValueError("must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value.strip())
        raise ValueError("must be an integer")
    if expected is float:
        if isinstance(value, bool):
            raise ValueError("must be a number")
        return float(value)
    if expected is str:
        if not isinstance(value, str):
            raise ValueError("must be a string")
        return value
    raise TypeError(f"unsupported setting type {expected!r}")


def _validate(config: Config) -> None:
    serve = config.serve
    if not 0 <= serve.port <= 65535:
        raise ConfigError(f"serve.port = {serve.port}: must be 0..65535 (0 picks a free port)")
    if serve.max_running_requests < 1:
        raise ConfigError("serve.max_running_requests must be at least 1")
    miner = config.miner
    if miner.max_inflight < 0:
        raise ConfigError("miner.max_inflight must be 0 (from the plan) or positive")
    if miner.chunk_tokens < 2:
        raise ConfigError("miner.chunk_tokens must be at least 2")
    if not 0 <= miner.serve_port <= 65535:
        raise ConfigError(f"miner.serve_port = {miner.serve_port}: must be 0..65535")
    if not 0 <= miner.drain_s <= MAX_DRAIN_S:
        raise ConfigError(
            f"miner.drain_s = {miner.drain_s}: must be 0..{MAX_DRAIN_S:g} seconds, so the miner's whole stop "
            "fits systemd's default 90 s before it kills the service"
        )
    if miner.gateway_url and not miner.gateway_url.startswith(("ws://", "wss://")):
        raise ConfigError(
            f"miner.gateway_url = {miner.gateway_url!r}: use a ws:// or wss:// URL, e.g. wss://api.engy.ai/gw"
        )
    gateway = config.gateway
    for name in ("port", "miner_port"):
        if not 0 <= getattr(gateway, name) <= 65535:
            raise ConfigError(f"gateway.{name} = {getattr(gateway, name)}: must be 0..65535 (0 picks a free port)")
    if not 1 <= gateway.workers <= MAX_GATEWAY_WORKERS:
        raise ConfigError(f"gateway.workers = {gateway.workers}: must be 1..{MAX_GATEWAY_WORKERS} (about one per core)")
    if gateway.max_attempts < 1:
        raise ConfigError("gateway.max_attempts must be at least 1")
    if gateway.max_rigs_per_miner < 1:
        raise ConfigError("gateway.max_rigs_per_miner must be at least 1")
    if gateway.queue_wait_s < 0 or gateway.queue_max < 0:
        raise ConfigError("gateway.queue_wait_s and gateway.queue_max must be 0 (no waiting room) or more")
    if gateway.body_timeout_s <= 0 or gateway.drain_s < 0:
        raise ConfigError("gateway.body_timeout_s must be positive and gateway.drain_s 0 or more")
    if not gateway.max_body_bytes <= gateway.body_bytes_in_flight_per_account <= gateway.body_bytes_in_flight:
        raise ConfigError(
            f"gateway.max_body_bytes ({gateway.max_body_bytes}) <= gateway.body_bytes_in_flight_per_account "
            f"({gateway.body_bytes_in_flight_per_account}) <= gateway.body_bytes_in_flight "
            f"({gateway.body_bytes_in_flight}) does not hold: raise the larger or lower the smaller, so that a body "
            "of the largest size can always be received"
        )
    if gateway.fleet_legs:
        if not gateway.store_url:
            raise ConfigError(
                "gateway.fleet_legs is set but gateway.store_url is empty: the hosts of a fleet share one "
                'PostgreSQL store; set gateway.store_url = "postgresql://USER:PASSWORD@HOST/DB"'
            )
        if gateway.fleet_offset < 0 or gateway.fleet_offset + gateway.workers > gateway.fleet_legs:
            raise ConfigError(
                f"gateway.fleet_offset = {gateway.fleet_offset} with {gateway.workers} worker(s) does not fit "
                f"gateway.fleet_legs = {gateway.fleet_legs}: this host's legs must lie in 0..fleet_legs-1"
            )
    elif gateway.fleet_offset:
        raise ConfigError("gateway.fleet_offset is set but gateway.fleet_legs is 0; set both, or neither")
    if not 3.0 <= gateway.leader_lease_s <= 3600.0:
        raise ConfigError(f"gateway.leader_lease_s = {gateway.leader_lease_s:g}: must be 3..3600 seconds")
    if gateway.host_name and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", gateway.host_name):
        raise ConfigError(
            f"gateway.host_name = {gateway.host_name!r}: use letters, digits and . _ : - (a hostname fits)"
        )
    if gateway.store_url and not gateway.store_url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            f"gateway.store_url must be a postgresql:// URL (got {gateway.store_url[:24]!r}…); leave it empty "
            "for the SQLite file in the data dir"
        )
    if not 0 <= gateway.provider_port <= 65535:
        raise ConfigError(f"gateway.provider_port = {gateway.provider_port}: must be 0..65535 (0 picks a free port)")
    if not 0.0 < gateway.gemm_opening_timeout_s <= MAX_GEMM_OPENING_TIMEOUT_S:
        raise ConfigError(
            f"gateway.gemm_opening_timeout_s = {gateway.gemm_opening_timeout_s:g}: must be more than 0 and at most "
            f"{MAX_GEMM_OPENING_TIMEOUT_S:g} s, so the gateway answers within the 30 s a verifier waits for it"
        )
    if not 0.0 <= gateway.audit_paid_pct <= 100.0:
        raise ConfigError(f"gateway.audit_paid_pct = {gateway.audit_paid_pct}: a percentage, 0 to 100")
    if gateway.traffic_time_scale <= 0:
        raise ConfigError("gateway.traffic_time_scale must be positive (1 is production timing)")
    if gateway.qualify_probes < 1 or gateway.probe_concurrency < 1 or gateway.probe_max_tokens < 0:
        raise ConfigError("gateway.qualify_probes and probe_concurrency must be at least 1, probe_max_tokens 0 or more")
    if gateway.audit_lease_s <= 0 or gateway.proof_tee_ttl_s <= 0 or gateway.proof_tee_max_entries < 1:
        raise ConfigError("gateway.audit_lease_s, proof_tee_ttl_s and proof_tee_max_entries must be positive")
    if gateway.epoch_s < 1 or gateway.epoch_grace_s < 0 or gateway.epoch_genesis < 0 or gateway.gate_min_samples < 0:
        raise ConfigError("gateway.epoch_s must be positive; epoch_grace_s, epoch_genesis and gate_min_samples >= 0")
    if gateway.master_wallet and gateway.master_wallet.count("/") != 1:
        raise ConfigError(f"gateway.master_wallet = {gateway.master_wallet!r}: write it as NAME/HOTKEY")
    if gateway.master_wallet and not gateway.owner_hotkey:
        raise ConfigError(
            "gateway.master_wallet is set but gateway.owner_hotkey is empty: set the subnet owner's "
            "hotkey (an epoch with no score burns to it)"
        )
    if gateway.deposit_address:
        # The same checks as the deposit watcher's (`gateway/billing/deposits.py`), made at load.
        try:
            rate = decimal.Decimal(gateway.deposit_usd_per_tao.strip())
        except decimal.InvalidOperation:
            rate = decimal.Decimal("NaN")
        if not rate.is_finite() or rate <= 0:
            raise ConfigError(
                f"gateway.deposit_usd_per_tao = {gateway.deposit_usd_per_tao!r}: write the positive USD one TAO "
                'credits as a decimal, e.g. "412.5"'
            )
        if gateway.deposit_confirmations < 2 or gateway.deposit_start_block < 0:
            raise ConfigError("gateway.deposit_confirmations must be at least 2 and deposit_start_block 0 or more")
    verifier = config.verifier
    if verifier.concurrency < 1 or verifier.poll_s <= 0 or verifier.threads < 0:
        raise ConfigError(
            "verifier.concurrency must be at least 1, verifier.poll_s positive and verifier.threads 0 or more"
        )
    if verifier.gateway_url and not verifier.gateway_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"verifier.gateway_url = {verifier.gateway_url!r}: use the provider API's http(s):// URL, "
            "e.g. http://127.0.0.1:8082"
        )
    if not 0 <= config.control.port <= 65535:
        raise ConfigError(f"control.port = {config.control.port}: must be 0..65535 (0 picks a free port)")
    validator = config.validator
    if validator.poll_s <= 0 or validator.block_s <= 0 or validator.resubmit_blocks < 1:
        raise ConfigError(
            "validator.poll_s and validator.block_s must be positive, validator.resubmit_blocks at least 1"
        )
    if validator.provider_url and not validator.provider_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"validator.provider_url = {validator.provider_url!r}: use the provider's http(s):// URL, "
            "e.g. https://provider.engy.ai"
        )
    if serve.request_timeout_s <= 0:
        raise ConfigError("serve.request_timeout_s must be positive")
    if serve.prefix_cache_tokens < 0:
        raise ConfigError("serve.prefix_cache_tokens must be 0 (off) or a number of tokens")
    alert_settings.validate(config.alerts)
    if config.node.log_ring_size < 100:
        raise ConfigError("node.log_ring_size must be at least 100")
    for section in ("serve", "miner"):
        cheat = getattr(config, section).simulate_cheat
        if cheat:
            check_simulated_cheat(cheat, where=f"{section}.simulate_cheat =")
