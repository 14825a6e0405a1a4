"""`engy-node diagnose`: one `.tar.gz` a support person can read instead of asking twenty
questions: versions, the resolved config with secrets masked, GPU facts, recent logs, and, when
a node runs in this home, its status, metrics, events and model-server command (docs/architecture.md).

Trust and failure posture:

* The bundle leaves the machine, so what goes in is chosen, never swept up. Only files built
  here and the tails of log files are added; the gateway's SQLite store (balances, key hashes),
  `local/network.json` and `local/buyer.json` (the local buyer key), `control.token` and wallet
  files are never read into it. Leaking a key costs far more than a support person missing a
  file, so the rule is an allow-list, not a deny-list.
* Everything that goes in passes one `Scrubber`: engy API keys by their prefix, bearer tokens,
  passwords in URLs, and the literal values of this home's secrets (the config's secret fields
  and the control token, which has no prefix to match). Config fields are masked by name
  (`is_secret_field`) before that, so `config.json` still says whether a key is set, and which.
* The bundle is written mode 0600 through a temporary file and a rename: it describes the
  machine, and a reader never sees half of one.
* Collecting never fails on the machine's state: a log that cannot be read, a GPU probe that
  breaks, or a node that does not answer becomes a line in `errors.txt` and the bundle is still
  written. A diagnostics tool that fails when things are broken fails exactly when it is needed.
  Only an output path that cannot be written is an error (`DiagnoseError`, naming the fix).

Shape: the pure helpers (masking, scrubbing, names, the manifest, the model-server report) take
plain data and return plain data; `collect` does the IO and calls them. Collecting blocks (it is
a CLI command): from trio, run it in a thread.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import os
import platform
import re
import sys
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from engy_node import __version__
from engy_node.config import Config, config_document, resolve_paths
from engy_node.errors import EngyError
from engy_node.protocol.api_keys import BUYER_KEY_PREFIX, MINER_KEY_PREFIX

DEFAULT_LOG_LINES = 2000
"""Lines kept from the end of each log file: a few minutes of a busy node, about 300 KB."""
EVENTS_LIMIT = 2000
"""Hub events asked of a running node (the control API caps a page at 5,000)."""
CONTROL_TIMEOUT_S = 5.0
"""Per request to a running node; a node too busy to answer within this is itself a finding."""
MODEL_SERVER_LOG_LINES = 200
"""Model-server output lines in `node/model-server.txt`: the supervisor keeps as many."""
PACKAGES = ("torch", "transformers", "bittensor", "toploc", "sglang", "textual", "trio", "hypercorn", "httpx")
"""Distributions whose versions explain most support cases; read from metadata, never imported
(importing torch alone takes seconds and may touch the GPU)."""
NOT_INSTALLED = "not installed"
MASK = "●●●●"
MASK_TAIL_MIN_CHARS = 12
"""Masked values keep their last four characters, so two keys can be told apart, only when at
least this many others stay hidden; a shorter secret is masked whole."""
MIN_LITERAL_SECRET_CHARS = 6
"""Secret values shorter than this are not scrubbed as literals from free text: replacing every
`abc` would mangle the logs, and no key this node issues or reads is that short (gateway keys
are 51 characters, the control token 43)."""
SECRET_WORDS = frozenset({"key", "token", "secret", "password", "passphrase", "credentials", "webhooks"})
"""A config field is secret when one of its `_`-separated words is one of these. Whole words,
not substrings: `wallet_hotkey` names a wallet file (a hotkey is a public address),
`keepalive_s` and `chunk_tokens` are numbers, and masking them would hide what support needs."""
MODEL_SERVER_HOME = "model-server"
"""The home the miner gives the reference server it launches, inside its data dir (see
`miner/role.py`); that server writes its log under `<home>/data/logs`."""
LOCAL_HOMES = "local"
"""`engy-node up` gives each local miner a data dir of its own under `<data_dir>/local/` (see
`local/up.py`); those hold their model servers' homes."""
NEVER_COLLECTED = (
    ("gateway store (SQLite)", "balances and buyer key hashes; buyer content never leaves the machine"),
    ("local/network.json, local/buyer.json", "they hold the local buyer's API key"),
    ("control.token", "the control API's secret"),
    ("wallets", "key files"),
    ("node.toml", "shown as config.json, with secrets masked"),
)
TAIL_BLOCK_BYTES = 64 * 1024

_API_KEY = re.compile("(" + "|".join(re.escape(p) for p in (BUYER_KEY_PREFIX, MINER_KEY_PREFIX)) + r")[A-Za-z0-9_\-]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+")
_URL_PASSWORD = re.compile(r"(://[^/\s:@\"']+:)[^/\s@\"']+@")
_HOST_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class DiagnoseError(EngyError):
    title = "diagnose"


# ---- pure helpers ----------------------------------------------------------------------------
def is_secret_field(name: str) -> bool:
    """Whether a config field holds a secret (see `SECRET_WORDS`): `miner_key` yes,
    `wallet_hotkey` and `chunk_tokens` no."""
    return any(word in SECRET_WORDS for word in name.lower().split("_"))


def mask_value(value: Any) -> str:
    """`"(empty)"`, or `MASK` plus the last four characters of a long enough value."""
    text = "" if value is None else str(value)
    if not text:
        return "(empty)"
    return MASK + text[-4:] if len(text) >= MASK_TAIL_MIN_CHARS else MASK


def masked_config(document: Mapping[str, Any]) -> dict[str, Any]:
    """`config_document`'s output with every secret field masked, at any depth."""

    def walk(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: mask_value(item) if is_secret_field(str(key)) else walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [walk(item) for item in value]
        return value

    return walk(document)


def secret_values(document: Mapping[str, Any]) -> list[str]:
    """The non-empty values of `document`'s secret fields, at any depth, for literal scrubbing."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if is_secret_field(str(key)) and item not in (None, ""):
                    found.append(str(item))
                else:
                    walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(document)
    return found


class Scrubber:
    """Removes secrets from text and from JSON-ready data bound for the bundle.

    Literal secrets go first (longest first, so one that contains another is removed whole),
    then the patterns: engy API keys keep their prefix (`engy-sk-●●●●`, so the reader still
    knows a buyer key was there), bearer tokens and URL passwords become `MASK`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        literals = sorted({s for s in secrets if len(s) >= MIN_LITERAL_SECRET_CHARS}, key=len, reverse=True)
        self._literal = re.compile("|".join(map(re.escape, literals))) if literals else None

    def text(self, text: str) -> str:
        if self._literal is not None:
            text = self._literal.sub(MASK, text)
        text = _API_KEY.sub(lambda m: m.group(1) + MASK, text)
        text = _BEARER.sub(lambda m: m.group(1) + MASK, text)
        return _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + "@", text)

    def data(self, value: Any) -> Any:
        """`value` with every string in it, keys included, scrubbed."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.data(str(key)): self.data(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(item) for item in value]
        return value


def bundle_stem(host: str, now: dt.datetime) -> str:
    """`engy-diagnose-<host>-<UTC timestamp>`; the host reduced to characters safe in a file name."""
    safe_host = _HOST_CHARS.sub("-", host).strip("-.") or "host"
    return f"engy-diagnose-{safe_host}-{now.astimezone(dt.UTC):%Y%m%dT%H%M%SZ}"


def last_lines(data: bytes, count: int) -> list[str]:
    """The last `count` lines of `data` (decoded leniently: a log may hold any bytes)."""
    if count <= 0:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-count:]


def gpu_document(inventory: Any) -> dict[str, Any]:
    """A `GpuInventory` as JSON-ready data: its fields, `cpu_mode`, the summary line, and per GPU
    its one-line description and whether its PCIe link runs below its max."""
    document = _json_ready(dataclasses.asdict(inventory))
    document["cpu_mode"] = inventory.cpu_mode
    document["summary"] = inventory.summary()
    for gpu, facts in zip(inventory.gpus, document["gpus"]):
        facts["describe"] = gpu.describe()
        facts["pcie_downgraded"] = gpu.pcie_downgraded
    return document


def model_server_report(
    status: Mapping[str, Any], events: Sequence[Mapping[str, Any]], *, lines: int = MODEL_SERVER_LOG_LINES
) -> str | None:
    """Each supervised model server's state, command and last failure from a status document,
    then the last `lines` model-server events (its output and the supervisor's notes); None when
    the node supervises no model server."""
    states = status.get("states") or {}
    servers = {name: state for name, state in states.items() if isinstance(state, Mapping) and state.get("command")}
    if not servers:
        return None
    out: list[str] = []
    for name, state in sorted(servers.items()):
        out += [
            f"[{name}] state: {state.get('state')}, kind: {state.get('kind')}, url: {state.get('url')}, "
            f"restarts: {state.get('restarts')}",
            f"command: {state['command']}",
        ]
        failure = state.get("last_failure")
        if isinstance(failure, Mapping):
            out.append(f"last failure: {failure.get('kind')}: {failure.get('summary')} (fix: {failure.get('fix')})")
        out.append("")
    tail = [event for event in events if str(event.get("component", "")).startswith("model_server")][-lines:]
    out.append(f"last {len(tail)} model-server log lines:")
    out += [f"{event.get('level', '')} {event.get('message', '')}" for event in tail]
    return "\n".join(out) + "\n"


def build_manifest(
    *,
    created_at: dt.datetime,
    data_dir: Path,
    config_file: Path,
    files: Mapping[str, int],
    skipped: Sequence[tuple[str, str]],
    errors: Sequence[str],
) -> dict[str, Any]:
    """What the bundle holds (name -> bytes), when, from which home, and what was left out and why."""
    return {
        "format": 1,
        "engy_node_version": __version__,
        "created_at": created_at.astimezone(dt.UTC).isoformat(),
        "data_dir": str(data_dir),
        "config_file": str(config_file),
        "files": [{"name": name, "bytes": size} for name, size in files.items()],
        "skipped": [{"what": what, "why": why} for what, why in [*NEVER_COLLECTED, *skipped]],
        "errors": list(errors),
    }


def _json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_ready(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


# ---- collecting ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Bundle:
    """A written bundle: where it is and what it holds."""

    path: Path
    files: tuple[str, ...]
    """Paths inside the bundle, below its top folder."""
    log_files: int
    log_lines: int
    gpu_summary: str
    node_running: bool
    errors: tuple[str, ...]

    def summary(self) -> str:
        """One line for the terminal."""
        node = "node status, metrics and events" if self.node_running else "no running node"
        errors = f"; {len(self.errors)} problem(s) collecting, see errors.txt" if self.errors else ""
        return (
            f"versions, config (secrets masked), GPUs ({self.gpu_summary}), {self.log_files} log file(s) "
            f"({self.log_lines} lines), {node}{errors}"
        )


class _Contents:
    """The bundle's files, in memory until written; everything added passes the scrubber."""

    def __init__(self, scrubber: Scrubber) -> None:
        self.scrubber = scrubber
        self.files: dict[str, bytes] = {}
        self.skipped: list[tuple[str, str]] = []
        self.errors: list[str] = []

    def text(self, name: str, text: str) -> None:
        self.files[name] = self.scrubber.text(text).encode("utf-8")

    def json(self, name: str, value: Any) -> None:
        document = self.scrubber.data(_json_ready(value))
        self.files[name] = (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    def error(self, what: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.errors.append(self.scrubber.text(f"{what}: {detail}"))


def collect(
    config: Config,
    *,
    output: str | os.PathLike[str] | None = None,
    log_lines: int = DEFAULT_LOG_LINES,
    config_error: str | None = None,
    now: dt.datetime | None = None,
    nvml: Any = None,
) -> Bundle:
    """Gather the bundle for `config`'s home and write it to `output` (a file, or a directory for
    the default name; default: the default name in the current directory).

    `config_error`: the config could not be loaded (that message); `config` then holds the
    defaults, and the bundle says so. `nvml` is passed to `gpu.detect` (tests give a fake).

    Errors: `DiagnoseError` when the bundle cannot be written there. Nothing else raises:
    what cannot be collected is recorded in `errors.txt` (see the module docstring).

    Blocking: yes (file reads, NVML, HTTP to the local node).
    """
    if log_lines < 0:
        raise DiagnoseError(f"--log-lines must be 0 or more, not {log_lines}")
    now = now or dt.datetime.now(dt.UTC)
    host = platform.node()
    stem = bundle_stem(host, now)
    target = _output_path(output, stem)
    if not (target.parent.is_dir() and os.access(target.parent, os.W_OK | os.X_OK)):
        # Checked before collecting too, so a typo costs no wait; the write below is what counts.
        raise DiagnoseError(
            f"cannot write the bundle to {target}: {target.parent} is not a directory you can write to; "
            "pass --output with a file or directory you can write to"
        )
    data_dir = config.paths.data_dir
    document = config_document(config)
    contents = _Contents(Scrubber([*secret_values(document), *_control_tokens(data_dir)]))

    contents.json("versions.json", versions(host))
    config_json = masked_config(document)
    if config_error is not None:
        config_json = {
            "error": config_error,
            "note": "the config could not be loaded; these are the defaults",
            **config_json,
        }
        contents.error("config", config_error)
    contents.json("config.json", config_json)
    gpu_summary = _collect_gpus(contents, nvml)
    log_files, kept_lines = _collect_logs(contents, data_dir, log_lines)
    try:
        node_running = _collect_node(contents, data_dir)
    except Exception as error:  # broad on purpose: the node is the most likely thing to be broken
        contents.error("node", error)
        node_running = False
    if contents.errors:
        contents.text("errors.txt", "\n".join(contents.errors) + "\n")
    manifest = build_manifest(
        created_at=now,
        data_dir=data_dir,
        config_file=config.paths.config_file,
        files={name: len(data) for name, data in contents.files.items()},
        skipped=contents.skipped,
        errors=contents.errors,
    )
    contents.json("manifest.json", manifest)
    _write_bundle(target, stem, contents.files, mtime=now.timestamp())
    return Bundle(
        path=target,
        files=tuple(contents.files),
        log_files=log_files,
        log_lines=kept_lines,
        gpu_summary=gpu_summary,
        node_running=node_running,
        errors=tuple(contents.errors),
    )


def versions(host: str, *, lookup: Callable[[str], str] = metadata.version) -> dict[str, Any]:
    """engy-node, Python, the platform and `PACKAGES` (from their metadata, never imported)."""
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = lookup(name)
        except metadata.PackageNotFoundError:
            packages[name] = NOT_INSTALLED
    return {
        "engy_node": __version__,
        "python": sys.version,
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "host": host,
        "cpus": os.cpu_count(),
        "packages": packages,
    }


def _control_tokens(data_dir: Path) -> list[str]:
    # Read only to scrub it (a token pasted into a log line would otherwise ship): never bundled.
    from engy_node.control import ControlError, read_endpoint, token_path

    paths = {token_path(data_dir)}
    try:
        paths.add(read_endpoint(data_dir).token_file)
    except ControlError:
        pass
    tokens = []
    for path in paths:
        try:
            tokens.append(path.read_text(encoding="ascii", errors="replace").strip())
        except OSError:
            continue
    return [token for token in tokens if token]


def _collect_gpus(contents: _Contents, nvml: Any) -> str:
    from engy_node.hardware.gpu import detect

    try:
        inventory = detect(nvml=nvml)
    except Exception as error:  # broad on purpose: detect() promises not to raise; the bundle must not depend on it
        contents.error("GPU detection", error)
        contents.json("gpus.json", {"error": f"{type(error).__name__}: {error}"})
        return "detection failed"
    contents.json("gpus.json", gpu_document(inventory))
    return f"{len(inventory.gpus)} GPU(s)" if inventory.available else "CPU mode"


def _log_dirs(contents: _Contents, data_dir: Path) -> list[tuple[str, Path, str]]:
    """(label in the bundle, directory, file pattern) for every log this home can hold: the node's
    own, its reference server's, and each local-network miner's and its model server's."""

    def server_logs(home: Path) -> Path:
        return resolve_paths(home, {}).log_dir

    dirs = [
        ("", data_dir / "logs", "engy-node*.log"),
        (MODEL_SERVER_HOME, server_logs(data_dir / MODEL_SERVER_HOME), "*.log"),
    ]
    local = data_dir / LOCAL_HOMES
    try:
        miner_dirs = sorted(path for path in local.iterdir() if path.is_dir()) if local.is_dir() else []
    except OSError as error:
        contents.error(f"listing {local}", error)
        miner_dirs = []
    for miner_dir in miner_dirs:
        label = f"{LOCAL_HOMES}/{miner_dir.name}"
        dirs.append((label, miner_dir / "logs", "*.log"))
        dirs.append((f"{label}/{MODEL_SERVER_HOME}", server_logs(miner_dir / MODEL_SERVER_HOME), "*.log"))
    return dirs


def _collect_logs(contents: _Contents, data_dir: Path, count: int) -> tuple[int, int]:
    """The last `count` lines of every log file (see `_log_dirs`) under `logs/`; returns how many
    files and lines went in."""
    files = kept = 0
    for label, directory, pattern in _log_dirs(contents, data_dir):
        try:
            paths = sorted(directory.glob(pattern)) if directory.is_dir() else []
        except OSError as error:
            contents.error(f"listing {directory}", error)
            continue
        for path in paths:
            name = "/".join(part for part in ("logs", label, path.name) if part)
            try:
                lines = _tail_file(path, count)
            except OSError as error:
                contents.error(f"reading {path}", error)
                continue
            contents.text(name, "".join(line + "\n" for line in lines))
            files += 1
            kept += len(lines)
    if files == 0:
        contents.skipped.append(("logs/", f"no log files under {data_dir}"))
    return files, kept


def _tail_file(path: Path, count: int) -> list[str]:
    """The last `count` lines of a file, read backwards in blocks: a 10 MB log costs only what
    is kept."""
    with open(path, "rb") as file:
        position = file.seek(0, os.SEEK_END)
        data = b""
        # One newline more than needed, so the first, partial line read can be dropped whole.
        while position > 0 and data.count(b"\n") <= count:
            step = min(TAIL_BLOCK_BYTES, position)
            position -= step
            file.seek(position)
            data = file.read(step) + data
    return last_lines(data, count)


def _collect_node(contents: _Contents, data_dir: Path) -> bool:
    """The running node's status, metrics and events under `node/`; False (with `node/README.txt`
    saying why) when none runs in this home or it does not answer."""
    from engy_node.control import NodeNotRunningError, endpoint_path, fetch_status, read_endpoint, read_token

    try:
        endpoint = read_endpoint(data_dir)
        token = read_token(endpoint.token_file)
        status = fetch_status(endpoint.url, token, timeout=CONTROL_TIMEOUT_S)
    except NodeNotRunningError as error:
        contents.text(
            "node/README.txt",
            f"No engy node answered for the data dir {data_dir}, so there is no status, "
            f"metrics or events here.\n{error}\nRun `engy-node diagnose` while the node "
            "runs to include them.\n",
        )
        contents.skipped.append(("node/", "no node is running in this home"))
        if endpoint_path(data_dir).exists():
            contents.error("node", error)  # a record left behind: the node died or hangs
        return False
    except EngyError as error:  # a refused or unreadable token, a node that answers nonsense
        contents.text("node/README.txt", f"The node for {data_dir} could not be read: {error}\n")
        contents.error("node status", error)
        return False
    contents.json("node/status.json", status)
    events = _fetch_node_extras(contents, endpoint.url, token)
    report = model_server_report(status, events)
    if report is not None:
        contents.text("node/model-server.txt", report)
    return True


def _fetch_node_extras(contents: _Contents, url: str, token: str) -> list[dict[str, Any]]:
    """`GET /metrics` and the event ring into the bundle; returns the events (empty on failure)."""
    import httpx

    headers = {"authorization": f"Bearer {token}"}
    events: list[dict[str, Any]] = []
    # trust_env=False: a proxy from the environment must never see (or relay) a loopback token.
    with httpx.Client(base_url=url, headers=headers, timeout=CONTROL_TIMEOUT_S, trust_env=False) as client:
        try:
            response = client.get("/metrics")
            response.raise_for_status()
            contents.text("node/metrics.txt", response.text)
        except httpx.HTTPError as error:
            contents.error("node metrics", error)
        try:
            response = client.get("/v1/events", params={"since": 0, "limit": EVENTS_LIMIT})
            response.raise_for_status()
            document = response.json()
            events = [event for event in document.get("events", []) if isinstance(event, dict)]
            contents.json("node/events.json", document)
        except (httpx.HTTPError, ValueError, AttributeError) as error:
            contents.error("node events", error)
    return events


def _output_path(output: str | os.PathLike[str] | None, stem: str) -> Path:
    name = f"{stem}.tar.gz"
    if output is None:
        return Path.cwd() / name
    path = Path(output).expanduser()
    return path / name if path.is_dir() else path


def _write_bundle(path: Path, stem: str, files: Mapping[str, bytes], *, mtime: float) -> None:
    """Write `files` under a top folder `stem` as a gzipped tar at `path`, mode 0600, through a
    temporary file and a rename."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as error:
        raise DiagnoseError(
            f"cannot write the bundle to {path} ({error.strerror}); pass --output with a file "
            "or directory you can write to"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover temporary file
        with os.fdopen(fd, "wb") as raw:
            fd = -1
            with tarfile.open(fileobj=raw, mode="w:gz") as archive:
                for name, data in files.items():
                    info = tarfile.TarInfo(f"{stem}/{name}")
                    info.size, info.mode, info.mtime = len(data), 0o600, int(mtime)
                    archive.addfile(info, io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(temporary, path)
    except OSError as error:
        raise DiagnoseError(
            f"cannot write the bundle to {path} ({error.strerror or error}); pass --output with a "
            "file or directory you can write to, with space to spare"
        ) from None
    finally:
        if fd != -1:
            os.close(fd)
        temporary.unlink(missing_ok=True)
