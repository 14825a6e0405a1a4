"""First-run setup, headless: what this machine can serve, which wallets it holds, what a set of
answers means for `node.toml`, and the exact commands that start the node (docs/architecture.md, "The TUI").

`engy-tui`'s setup wizard (`engy_tui.screens.setup`) is a view over these functions; everything
it decides is decided here, so each decision is tested without a terminal, and nothing here
imports Textual.

Failure posture:

* Reading is forgiving. A wallets directory that is missing or half-readable lists what it can
  (a hotkey whose address cannot be read still appears, without one); a model without a
  checkpoint gets the verdict "checkpoint needed" rather than a guessed plan. Nothing here
  unlocks a key or opens a coldkey: wallets are listed from their public files
  (`coldkeypub.txt`, `hotkeys/NAMEpub.txt`); a hotkey file is read only as far as needed to
  learn whether it is encrypted (the node signs unattended and cannot use an encrypted one),
  and whole only when its public file is missing, for the address stored next to the secret.
* Answers are checked by `validate`, which returns every problem at once, each naming the step
  and the fix; the wizard writes nothing while any remain.
* Writing is careful. `node.toml` may hold a miner key, so it is written 0600, atomically (a
  temporary file renamed over the old one), and the previous file is kept as `node.toml.bak`
  (also 0600). Settings the user had that setup does not decide are kept; comments are not
  (tomllib reads no comments), which is what the backup is for.
* A miner key is never shown: the review's commands take no secrets at all (the node reads the
  key from `node.toml`), and the preview of `node.toml` masks every secret field as
  `engy-node diagnose` does (`●●●●` and the last four characters of a long enough key).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from datetime import date, datetime, time
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from engy_node.config import ValidatorSection, checkpoint_pairs, resolve_paths
from engy_node.diagnose import is_secret_field, mask_value
from engy_node.errors import ConfigError, ModelError
from engy_node.hardware.gpu import CPU_MODE, GIB, GpuInfo, GpuInventory
from engy_node.hardware.model_shape import read_model_shape
from engy_node.hardware.plan import Plan, plan
from engy_node.models import CATALOG, DEFAULT_LOCAL_MODEL, ModelSpec

__all__ = [
    "CHECKPOINT_NEEDED",
    "DEFAULT_GATEWAY_URL",
    "DEFAULT_WALLETS_PATH",
    "ROLES",
    "ROLE_LABELS",
    "HotkeyEntry",
    "ModelChoice",
    "Role",
    "SetupAnswers",
    "SetupFacts",
    "WalletEntry",
    "answers_from",
    "commands",
    "decided_settings",
    "dumps_toml",
    "gather_facts",
    "list_wallets",
    "machine_line",
    "model_choices",
    "node_toml",
    "plan_verdict",
    "preview_toml",
    "read_existing",
    "short_ss58",
    "validate",
    "write_node_toml",
]

Role = Literal["miner", "validator", "gateway", "local"]
ROLES: tuple[Role, ...] = ("miner", "validator", "gateway", "local")
ROLE_LABELS: dict[Role, str] = {
    "miner": "miner",
    "validator": "validator",
    "gateway": "gateway",
    "local": "local network (try everything on this machine)",
}
DEFAULT_GATEWAY_URL = "wss://api.engy.ai/gw"
"""The public gateway's miner endpoint, offered as the starting value."""
DEFAULT_WALLETS_PATH = "~/.bittensor/wallets"
"""bittensor's (and btcli's) wallets directory."""
NETWORKS = ("finney", "test", "local")
VALIDATOR_DEFAULTS = ValidatorSection()
"""The validator's defaults: the public network, provider and its pinned master hotkey."""
CHECKPOINT_NEEDED = "checkpoint needed: pass its directory"
"""The verdict for a GPU model without a local checkpoint: the planner sizes everything from the
checkpoint's config.json and shard sizes, and the catalog does not repeat them."""
NODE_TOML_HEADER = "# engy node settings, written by engy-tui's setup; a file it replaced is kept as node.toml.bak.\n\n"
"""node.toml's first lines: who wrote it (the comments a user had live on in the backup)."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts a plain ws:// gateway URL may name: the miner key crosses no network to reach them."""
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SS58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]{46,48}")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ENCRYPTED_PREFIXES = (b"$NACL", b"$ANSIBLE_VAULT", b"gAAAAA")
"""How bittensor's encrypted keyfiles start (NaCl, ansible vault, legacy Fernet)."""
_ENCRYPTED_HEAD_BYTES = max(map(len, _ENCRYPTED_PREFIXES))


# ---- what this machine has ----------------------------------------------------------------------


def machine_line(inventory: GpuInventory, *, ram_bytes: int | None = None) -> str:
    """One line on this machine for the top of the wizard, e.g. `4 × RTX 4090 (24 GiB, PCIe
    4.0 x16) + 1 × RTX 5090 (32 GiB, PCIe 5.0 x16) · no P2P · driver 570.133.07 · CUDA 12.8 ·
    125 GiB RAM`, or `no NVIDIA GPU — CPU mode: <why>` without a GPU."""
    ram = [f"{ram_bytes / GIB:.0f} GiB RAM"] if ram_bytes else []
    if inventory.cpu_mode:
        why = inventory.reason.removesuffix(f": {CPU_MODE}")
        return " · ".join([f"no NVIDIA GPU — CPU mode: {why}", *ram])
    groups: dict[tuple[str, int | None], list[GpuInfo]] = {}
    for gpu in inventory.gpus:
        name = (gpu.name or "unknown GPU").removeprefix("NVIDIA ").removeprefix("GeForce ")
        groups.setdefault((name, gpu.memory_total_bytes), []).append(gpu)
    described = []
    for (name, memory), gpus in groups.items():
        facts = [f"{memory / GIB:.0f} GiB" if memory else "? GiB"]
        links = [
            f"{'?' if gpu.pcie_gen is None else f'{gpu.pcie_gen}.0'} x{gpu.pcie_width or '?'}"
            for gpu in gpus
            if gpu.pcie_gen is not None or gpu.pcie_width is not None
        ]
        if links:
            facts.append("PCIe " + _slash_join(links))
        described.append(f"{len(gpus)} × {name} ({', '.join(facts)})")
    parts = [" + ".join(described)]
    if len(inventory.gpus) > 1:
        parts.append(_p2p_words(inventory))
    parts += [f"driver {inventory.driver_version}"] if inventory.driver_version else []
    parts += [f"CUDA {inventory.cuda_driver_version}"] if inventory.cuda_driver_version else []
    return " · ".join(parts + ram)


def _slash_join(links: list[str]) -> str:
    """`4.0 x16/x8` for links that share a generation, else each in full."""
    gens = {link.split(" ")[0] for link in links}
    if len(gens) == 1:
        widths = list(dict.fromkeys(link.split(" ")[1] for link in links))
        return f"{gens.pop()} {'/'.join(widths)}"
    return "/".join(dict.fromkeys(links))


def _p2p_words(inventory: GpuInventory) -> str:
    count = len(inventory.gpus)
    pairs = [inventory.p2p_ok(a, b) for a in range(count) for b in range(count) if a != b]
    if all(ok is True for ok in pairs):
        return "P2P"
    if all(ok is False for ok in pairs):
        return "no P2P"
    if all(ok is None for ok in pairs):
        return "P2P unknown"
    return "partial P2P"


# ---- wallets ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class HotkeyEntry:
    name: str
    ss58: str | None
    """None when neither its public file nor an unencrypted keyfile gave the address."""
    encrypted: bool = False
    """The node signs unattended and refuses a password-encrypted hotkey (`keys.load_hotkey`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class WalletEntry:
    name: str
    coldkey_ss58: str | None
    hotkeys: tuple[HotkeyEntry, ...]


def list_wallets(wallets_path: str | os.PathLike[str]) -> list[WalletEntry]:
    """The wallets under bittensor's layout `PATH/NAME/{coldkeypub.txt, hotkeys/HK,
    hotkeys/HKpub.txt}`, by name. A directory is a wallet when it has a coldkey, a coldkeypub or
    a hotkeys directory. Never raises for what it finds on disk: a missing path lists nothing."""
    root = Path(wallets_path).expanduser()
    try:
        candidates = sorted(entry for entry in root.iterdir() if entry.is_dir())
    except OSError:
        return []
    wallets = []
    for directory in candidates:
        hotkeys_dir = directory / "hotkeys"
        is_wallet = hotkeys_dir.is_dir() or (directory / "coldkey").exists() or (directory / "coldkeypub.txt").exists()
        if not is_wallet:
            continue
        try:
            files = (
                {entry.name: entry for entry in hotkeys_dir.iterdir() if entry.is_file()}
                if hotkeys_dir.is_dir()
                else {}
            )
        except OSError:
            files = {}
        names = sorted(
            name for name in files if not (name.endswith("pub.txt") and name.removesuffix("pub.txt") in files)
        )
        wallets.append(
            WalletEntry(
                name=directory.name,
                coldkey_ss58=_public_ss58(directory / "coldkeypub.txt"),
                hotkeys=tuple(_hotkey_entry(files, name) for name in names),
            )
        )
    return wallets


def _public_ss58(path: Path) -> str | None:
    """`ss58Address` of a bittensor public keyfile (JSON), or None."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    address = document.get("ss58Address") if isinstance(document, dict) else None
    return address if isinstance(address, str) and address else None


def _hotkey_entry(files: Mapping[str, Path], name: str) -> HotkeyEntry:
    """The address from the public file when there is one; the keyfile is then read only far
    enough to see whether it is encrypted, so the secret is not loaded at all."""
    public = files.get(f"{name}pub.txt")
    ss58 = _public_ss58(public) if public is not None else None
    try:
        with files[name].open("rb") as keyfile:
            data = keyfile.read(_ENCRYPTED_HEAD_BYTES) if ss58 else keyfile.read()
    except OSError:
        return HotkeyEntry(name, ss58)
    encrypted = data.startswith(_ENCRYPTED_PREFIXES)
    if ss58 is None and not encrypted:
        try:
            document = json.loads(data)
        except ValueError:
            document = None
        address = document.get("ss58Address") if isinstance(document, dict) else None
        ss58 = address if isinstance(address, str) and address else None
    return HotkeyEntry(name, ss58, encrypted)


def short_ss58(address: str | None) -> str:
    """`5F3s…k9Qa`: enough to tell keys apart at a glance."""
    if not address:
        return "address unknown"
    return address if len(address) <= 10 else f"{address[:4]}…{address[-4:]}"


# ---- models -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ModelChoice:
    """One catalog model as this machine would serve it."""

    id: str
    display_name: str
    fits: bool | None
    """True: it fits; False: it does not; None: cannot tell without its checkpoint."""
    verdict: str
    """One line: `fits: tp 2, …`, `does not fit: …`, or `CHECKPOINT_NEEDED`."""
    reasons: tuple[str, ...]
    """The planner's reasons (`tp: …`, `mem_fraction_static: …`), or why there is no plan."""
    recommended: bool = False
    checkpoint: str = ""
    """The directory the verdict was planned from (empty: none)."""

    @property
    def mark(self) -> str:
        """✔, ✘ or ? (colour is never the only signal)."""
        return {True: "✔", False: "✘", None: "?"}[self.fits]


def model_choices(
    inventory: GpuInventory,
    *,
    checkpoints: Mapping[str, str] | None = None,
    target_context: int | None = None,
    catalog: Mapping[str, ModelSpec] = CATALOG,
) -> list[ModelChoice]:
    """Every catalog model with the planner's verdict on this machine, in catalog order; the
    fitting model with the highest score rate is `recommended`.

    `checkpoints` maps model id to a checkpoint directory to plan from (the planner reads its
    config.json and shard sizes). Without one, a model is judged only where the catalog alone
    decides: on a machine without GPUs only the embedded model runs, and the embedded model runs
    anywhere; any other case is `CHECKPOINT_NEEDED`, never a guess.

    Blocking: reads each given checkpoint's config.json and lists its shards.
    """
    checkpoints = checkpoints or {}
    choices = [_choice(spec, inventory, checkpoints.get(spec.id, ""), target_context) for spec in catalog.values()]
    fitting = [choice for choice in choices if choice.fits]
    if not fitting:
        return choices
    best = max(fitting, key=lambda choice: catalog[choice.id].score_rate)
    return [dataclasses.replace(choice, recommended=choice is best) for choice in choices]


def _choice(spec: ModelSpec, inventory: GpuInventory, checkpoint: str, target_context: int | None) -> ModelChoice:
    def made(fits: bool | None, verdict: str, reasons: tuple[str, ...]) -> ModelChoice:
        return ModelChoice(
            id=spec.id,
            display_name=spec.display_name,
            fits=fits,
            verdict=verdict,
            reasons=reasons,
            checkpoint=checkpoint,
        )

    if checkpoint:
        try:
            shape, weight_bytes = read_model_shape(Path(checkpoint).expanduser())
        except ModelError as err:
            return made(None, f"checkpoint unreadable: {err}", (f"checkpoint: {err}",))
        chosen = plan(
            shape=shape,
            weight_bytes=weight_bytes,
            gpus=inventory.gpus,
            p2p=inventory.p2p_ok_matrix,
            target_context=target_context,
            cpu_capable=spec.embedded,
        )
        return made(
            chosen.fits, plan_verdict(chosen), tuple(f"{name}: {reason}" for name, reason in chosen.reasons.items())
        )
    if spec.embedded:
        where = "on this machine's CPU (the reference server)" if inventory.cpu_mode else "on any GPU"
        return made(
            True,
            f"fits: the embedded model runs {where}",
            (
                "embedded: it ships inside a Python package and runs with no GPU and no download",
                "plan: the miner converts its checkpoint once at first start (~15 s) and plans exactly from it then",
            ),
        )
    if inventory.cpu_mode:
        return made(
            False,
            "does not fit: no NVIDIA GPU (in CPU mode only the embedded model runs)",
            (f"gpus: {inventory.reason}",),
        )
    return made(
        None,
        CHECKPOINT_NEEDED,
        (
            "plan: the planner sizes tensor parallelism, memory and concurrency from the checkpoint's "
            "config.json and shard sizes",
            f"checkpoint: download {spec.hf_repo} and enter the directory sglang loads",
        ),
    )


def plan_verdict(chosen: Plan) -> str:
    """`fits: tp 2, mem-fraction 0.86, 32 concurrent, FP8 KV, 262144 context`, `fits: CPU mode,
    …`, or `does not fit: <the planner's reason>`."""
    if not chosen.fits:
        return f"does not fit: {chosen.summary}"
    if chosen.server == "reference":
        return (
            f"fits: CPU mode, the reference server, {chosen.max_inflight} concurrent, {chosen.context_length} context"
        )
    parallel = f"tp {chosen.tp}" + (f" × dp {chosen.dp}" if chosen.dp > 1 else "")
    fraction = f"mem-fraction {chosen.mem_fraction_static:.2f}" if chosen.mem_fraction_static is not None else ""
    kv = "FP8 KV" if chosen.kv_cache_dtype.startswith("fp8") else f"{chosen.kv_cache_dtype} KV"
    parts = [parallel, fraction, f"{chosen.max_inflight} concurrent", kv, f"{chosen.context_length} context"]
    return "fits: " + ", ".join(part for part in parts if part)


# ---- answers ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SetupAnswers:
    """What the user chose. Fields a role does not use are ignored for it."""

    role: Role = "miner"
    model: str = DEFAULT_LOCAL_MODEL
    checkpoint: str = ""
    """Checkpoint directory of `model` (empty: the embedded model, converted automatically)."""
    wallets_path: str = DEFAULT_WALLETS_PATH
    wallet_name: str = ""
    wallet_hotkey: str = ""
    gateway_url: str = DEFAULT_GATEWAY_URL
    miner_key: str = dataclasses.field(default="", repr=False)
    """Secret: kept out of repr, so it reaches no log or traceback through this object."""
    network: str = VALIDATOR_DEFAULTS.network
    provider_url: str = VALIDATOR_DEFAULTS.provider_url
    master_hotkey: str = VALIDATOR_DEFAULTS.master_hotkey


def answers_from(existing: Mapping[str, Any]) -> SetupAnswers:
    """Starting answers from a parsed node.toml, so running setup again edits what is there.
    node.toml records no role: it starts as validator when only `[validator]` names a hotkey,
    else as miner."""
    miner, validator, gateway = (_table(existing, name) for name in ("miner", "validator", "gateway"))
    defaults = SetupAnswers()

    def text(table: Mapping[str, Any], key: str, default: str) -> str:
        value = table.get(key)
        return value if isinstance(value, str) else default

    role: Role = (
        "validator" if text(validator, "wallet_hotkey", "") and not text(miner, "wallet_hotkey", "") else "miner"
    )
    model = text(miner, "model", defaults.model)
    if model not in CATALOG:
        model = defaults.model
    checkpoint = text(miner, "checkpoint", "") or checkpoint_pairs(text(gateway, "checkpoints", "")).get(model, "")
    source = validator if role == "validator" else miner
    return SetupAnswers(
        role=role,
        model=model,
        checkpoint=checkpoint,
        wallets_path=text(source, "wallets_path", defaults.wallets_path) or defaults.wallets_path,
        wallet_name=text(source, "wallet_name", ""),
        wallet_hotkey=text(source, "wallet_hotkey", ""),
        gateway_url=text(miner, "gateway_url", "") or defaults.gateway_url,
        miner_key=text(miner, "miner_key", ""),
        network=text(validator, "network", defaults.network),
        provider_url=text(validator, "provider_url", defaults.provider_url),
        master_hotkey=text(validator, "master_hotkey", defaults.master_hotkey),
    )


def _table(document: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = document.get(name)
    return table if isinstance(table, Mapping) else {}


def validate(answers: SetupAnswers, choices: Sequence[ModelChoice] = ()) -> list[str]:
    """Every problem with `answers`, each naming what to change; empty when they can be written.
    `choices` (from `model_choices`) adds "does not fit this machine" for the chosen model."""
    if answers.role not in ROLES:
        return [f"role {answers.role!r}: choose {', '.join(ROLES[:-1])} or {ROLES[-1]}"]
    problems: list[str] = []
    if answers.role in ("miner", "gateway"):
        problems += _model_problems(answers, choices)
    if answers.role in ("miner", "validator"):
        problems += _wallet_problems(answers)
    if answers.role == "miner":
        problems += _gateway_problems(answers)
    if answers.role == "validator":
        problems += _chain_problems(answers)
    return problems


def _model_problems(answers: SetupAnswers, choices: Sequence[ModelChoice]) -> list[str]:
    spec = CATALOG.get(answers.model)
    if spec is None:
        return [f"model {answers.model!r} is not in the catalog: choose one of {', '.join(CATALOG)}"]
    problems = []
    if not answers.checkpoint and not spec.embedded:
        problems.append(
            f"model {spec.id} needs its checkpoint: enter the directory sglang loads "
            "(config.json and *.safetensors) in the Model step"
        )
    if answers.role == "gateway" and "," in answers.checkpoint:
        problems.append(
            "checkpoint path has a comma, which gateway.checkpoints uses between models: "
            "move or link the checkpoint to a path without one"
        )
    chosen = next((choice for choice in choices if choice.id == spec.id), None)
    if answers.role == "miner" and chosen is not None and chosen.fits is False:
        problems.append(
            f"model {spec.id} does not fit this machine ({chosen.verdict.removeprefix('does not fit: ')}): "
            "choose a model marked ✔"
        )
    return problems


def _wallet_problems(answers: SetupAnswers) -> list[str]:
    problems = []
    if answers.role == "validator" and not (answers.wallet_name and answers.wallet_hotkey):
        problems.append(
            "a validator signs weights with its own hotkey: choose a wallet and hotkey in the Wallet step "
            "(registered on the subnet, with a validator permit)"
        )
    elif bool(answers.wallet_name) != bool(answers.wallet_hotkey):
        problems.append("choose both a wallet and one of its hotkeys in the Wallet step, or neither")
    for label, value in (("wallet name", answers.wallet_name), ("hotkey name", answers.wallet_hotkey)):
        if value and (not _PLAIN_NAME.fullmatch(value) or value in (".", "..")):
            problems.append(
                f"{label} {value!r}: use a plain name of letters, digits, '.', '_' or '-' such as 'default'"
            )
    if answers.wallet_name and not answers.wallets_path.strip():
        problems.append(
            f"wallets path is empty: enter the directory that holds your wallets, e.g. {DEFAULT_WALLETS_PATH}"
        )
    return problems


def _gateway_problems(answers: SetupAnswers) -> list[str]:
    problems = []
    url = answers.gateway_url
    if not url:
        problems.append(f"gateway URL is empty: enter the gateway's websocket URL, e.g. {DEFAULT_GATEWAY_URL}")
    elif any(ch.isspace() for ch in url) or not url.isprintable():
        problems.append(
            f"gateway URL {url!r} has spaces or control characters: paste it again, e.g. {DEFAULT_GATEWAY_URL}"
        )
    elif not url.startswith(("ws://", "wss://")):
        problems.append(f"gateway URL {url!r}: use the gateway's wss:// URL, e.g. {DEFAULT_GATEWAY_URL}")
    elif url.startswith("ws://") and _host(url) not in LOOPBACK_HOSTS:
        problems.append(
            f"gateway URL {url!r}: plain ws:// sends the miner key unencrypted; use wss:// "
            "(ws:// is only for a gateway on this machine)"
        )
    key = answers.miner_key
    if not key and not (answers.wallet_name and answers.wallet_hotkey):
        problems.append(
            "a miner needs a miner key (issued by the gateway operator) or a registered hotkey: "
            "enter the key in the Gateway step, or choose a hotkey in the Wallet step"
        )
    if key and (any(ch.isspace() for ch in key) or not key.isprintable()):
        problems.append("the miner key has spaces, line breaks or control characters in it: paste it again as one word")
    return problems


def _host(url: str) -> str:
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


def _chain_problems(answers: SetupAnswers) -> list[str]:
    problems = []
    if answers.network not in NETWORKS and not answers.network.startswith(("ws://", "wss://")):
        problems.append(f"network {answers.network!r}: use finney, test, local or a ws(s):// URL")
    if not answers.provider_url.startswith(("http://", "https://")):
        problems.append(
            f"provider URL {answers.provider_url!r}: use the provider's https:// URL, "
            f"e.g. {VALIDATOR_DEFAULTS.provider_url}"
        )
    if not _SS58.fullmatch(answers.master_hotkey):
        problems.append(
            f"master hotkey {answers.master_hotkey!r}: enter the provider's master hotkey as an ss58 "
            f"address (the public provider's is {VALIDATOR_DEFAULTS.master_hotkey})"
        )
    return problems


# ---- node.toml ----------------------------------------------------------------------------------


def decided_settings(answers: SetupAnswers, existing: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The settings setup owns for this role, by section; everything else in node.toml
    (`existing`, parsed) is the user's and is kept. A gateway serves the chosen model, and its
    `checkpoints` keeps the other models' entries. A local network needs no settings:
    `engy-node up` generates its own."""
    if answers.role == "miner":
        return {
            "miner": {
                "model": answers.model,
                "checkpoint": answers.checkpoint,
                "gateway_url": answers.gateway_url,
                "miner_key": answers.miner_key,
                "wallets_path": answers.wallets_path,
                "wallet_name": answers.wallet_name,
                "wallet_hotkey": answers.wallet_hotkey,
            }
        }
    if answers.role == "validator":
        return {
            "validator": {
                "network": answers.network,
                "provider_url": answers.provider_url,
                "master_hotkey": answers.master_hotkey,
                "wallets_path": answers.wallets_path,
                "wallet_name": answers.wallet_name,
                "wallet_hotkey": answers.wallet_hotkey,
            }
        }
    if answers.role == "gateway":
        current = _table(existing, "gateway").get("checkpoints")
        pairs = checkpoint_pairs(current if isinstance(current, str) else "")
        pairs.pop(answers.model, None)
        if answers.checkpoint:
            pairs[answers.model] = answers.checkpoint
        return {
            "gateway": {
                "models": answers.model,
                "checkpoints": ",".join(f"{model}={path}" for model, path in pairs.items()),
            }
        }
    return {}


def node_toml(answers: SetupAnswers, existing: Mapping[str, Any]) -> str:
    """node.toml's text: `existing` (a parsed node.toml) with `decided_settings` written over it;
    other sections and keys keep their values and order, new ones go at the end."""
    document: dict[str, Any] = {
        name: dict(value) if isinstance(value, Mapping) else value for name, value in existing.items()
    }
    for section, values in decided_settings(answers, existing).items():
        table = document.get(section)
        document[section] = {**(table if isinstance(table, dict) else {}), **values}
    return NODE_TOML_HEADER + dumps_toml(document)


def preview_toml(answers: SetupAnswers, existing: Mapping[str, Any]) -> str:
    """`node_toml` as the wizard shows it: every secret field masked, here and in `existing`."""
    masked = dataclasses.replace(answers, miner_key=mask_value(answers.miner_key) if answers.miner_key else "")
    return node_toml(masked, _mask_secrets(existing))


def _mask_secrets(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            key: mask_value(item)
            if is_secret_field(str(key)) and isinstance(item, str) and item
            else _mask_secrets(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_mask_secrets(item) for item in value]
    return value


def dumps_toml(document: Mapping[str, Any]) -> str:
    """TOML text for a document as tomllib returns them: top-level values first, then one
    `[table]` per table, nested tables inline. tomllib parses it back to an equal document."""
    lines = [
        f"{_toml_key(key)} = {_toml_value(value)}" for key, value in document.items() if not isinstance(value, Mapping)
    ]
    for name, table in document.items():
        if isinstance(table, Mapping):
            lines += [*([""] if lines else []), f"[{_toml_key(name)}]"]
            lines += [f"{_toml_key(key)} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n" if lines else ""


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    escaped = (_ESCAPES.get(ch) or (f"\\u{ord(ch):04X}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch) for ch in text)
    return '"' + "".join(escaped) + '"'


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(key)} = {_toml_value(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def read_existing(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The node.toml at `path` parsed ({} when there is none). Raises `ConfigError` naming the
    file when it cannot be read or is not TOML."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML ({err}); fix the file or move it aside") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror}); check its permissions") from None


def write_node_toml(path: str | os.PathLike[str], text: str) -> Path | None:
    """Write node.toml atomically with mode 0600 (it may hold a miner key), keeping the previous
    file as `node.toml.bak` (0600 too). Returns the backup's path, or None when there was no
    file. Raises OSError when the directory cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    backup = None
    if path.is_file():
        backup = path.with_name(path.name + ".bak")
        _write_private(backup, path.read_bytes())
    _write_private(path, text.encode("utf-8"))
    return backup


def _write_private(target: Path, data: bytes) -> None:
    fd, staging = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


# ---- commands -----------------------------------------------------------------------------------


def commands(answers: SetupAnswers, *, home: str | None = None) -> list[str]:
    """The exact commands that start this node once node.toml is written, for the review page
    and the clipboard. They name no secret: the node reads the miner key from node.toml. A miner
    gets `engy-node plan` first, which prints the GPUs, the plan and the exact sglang command
    the miner will launch and supervise."""
    base = ["engy-node", *(["--home", home] if home else [])]
    if answers.role == "miner":
        argvs = [[*base, "plan"], [*base, "--role", "miner"]]
    elif answers.role == "validator":
        argvs = [
            [
                *base,
                "--role",
                "validator",
                "--validator-wallet",
                answers.wallet_name,
                "--validator-hotkey",
                answers.wallet_hotkey,
            ]
        ]
    elif answers.role == "gateway":
        argvs = [[*base, "--role", "gateway"]]
    else:
        argvs = [[*base, "up", "--traffic"]]
    return [shlex.join(argv) for argv in argvs]


# ---- gathering the facts ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SetupFacts:
    """What the wizard shows and decides with, gathered once (`gather_facts`) or made up in
    tests."""

    inventory: GpuInventory
    config_file: Path
    """Where node.toml is written."""
    existing: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The current node.toml, parsed ({} on a first run)."""
    wallets_path: str = DEFAULT_WALLETS_PATH
    checkpoints: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Model id -> checkpoint directory already known (from node.toml)."""
    ram_bytes: int | None = None
    home: str | None = None
    """The node's `--home`, repeated in the commands (None: the user dirs)."""


def gather_facts(home: str | None = None, *, env: Mapping[str, str] | None = None, nvml: Any = None) -> SetupFacts:
    """Detect GPUs (NVML, or the `nvml` fake), read node.toml and the memory size. Blocking:
    call it from a thread. Raises `ConfigError` when node.toml exists but is not readable TOML."""
    import psutil

    from engy_node.hardware.gpu import detect

    paths = resolve_paths(home, os.environ if env is None else env)
    existing = read_existing(paths.config_file)
    answers = answers_from(existing)
    gateway_checkpoints = _table(existing, "gateway").get("checkpoints")
    known = checkpoint_pairs(gateway_checkpoints if isinstance(gateway_checkpoints, str) else "")
    if answers.checkpoint:
        known[answers.model] = answers.checkpoint
    return SetupFacts(
        inventory=detect(nvml=nvml),
        config_file=paths.config_file,
        existing=existing,
        wallets_path=answers.wallets_path,
        checkpoints=known,
        ram_bytes=psutil.virtual_memory().total,
        home=home,
    )
