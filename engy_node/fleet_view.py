"""The fleet file (`engy-tui --fleet fleet.toml`) and the fleet view's decisions that need no
screen and no network: which nodes to watch and how to reach each, the `ssh` command that opens
a tunnel to a node's control API, and how long to wait before trying an unreachable node again.

Failure posture: a fleet file with a mistake is refused whole, before anything is dialled, with
one message that names the file, the node and the fix (an operator edits it once, not once per
node). A node that does not answer is the opposite case: it is one row of many, so it never stops
the view; the watcher retries it with `retry.backoff_delay` and the row says why it failed. The
token is read when a node is dialled, not here, so a missing token file is that node's reason
("no control token at …"), not a refused fleet.

The control API binds loopback only (docs/control-api.md), so a remote node is reached through
`ssh -N -L`: the local end binds 127.0.0.1 too, and `BatchMode=yes` makes a host that would ask
for a password or a host key fail with ssh's own reason instead of prompting inside the TUI.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engy_node.errors import ConfigError
from engy_node.retry import backoff_delay

NODE_KEYS = ("name", "url", "ssh", "port", "token", "token_file")
RETRY_BASE_S = 1.0
RETRY_CAP_S = 30.0
"""An unreachable node is tried again after 1, 2, 4 … s, at most every 30 s: a rebooting box is
seen within half a minute of its node coming back, and a dead one costs one request per 30 s."""
SSH_OPTIONS = (
    "ExitOnForwardFailure=yes",
    "BatchMode=yes",
    "ServerAliveInterval=15",
    "ServerAliveCountMax=3",
)
"""Without ExitOnForwardFailure ssh stays up with no forward when the local port is taken; the
keep-alives end a tunnel whose host vanished within 45 s, so the watcher reopens it."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_SSH_HOST = re.compile(r"[^\s-][^\s]*")
"""What `ssh` takes as a destination: user@host, a host, a ~/.ssh/config alias, ssh://user@host:port.
Never a leading "-", which ssh would read as an option (-oProxyCommand=… runs a command)."""

EXAMPLE = """[[node]]
name = "rig-a"
url = "http://127.0.0.1:18083"
token_file = "~/.config/engy/rig-a.token"

[[node]]
name = "rig-b"
ssh = "miner@rig-b"
port = 18083
token_file = "rig-b.token\""""


@dataclasses.dataclass(frozen=True, slots=True)
class FleetNode:
    """One `[[node]]` of a fleet file: a name, and either a URL or an SSH host and the control
    API's port on it, and either a token or the file that holds it."""

    name: str
    url: str | None = None
    """The control API as this machine reaches it (`http://127.0.0.1:PORT`, or a URL an
    operator's own tunnel or proxy serves)."""
    ssh: str | None = None
    """The host to open a tunnel to (anything `ssh` takes as a destination)."""
    port: int | None = None
    """With `ssh`: the control API's port on that host (its `control.port`)."""
    token: str | None = None
    token_file: Path | None = None
    """Relative paths are read from the fleet file's directory; `~` is expanded."""

    @property
    def via(self) -> str:
        """How the node is reached, for its row: the URL, or "ssh HOST:PORT"."""
        return self.url if self.url is not None else f"ssh {self.ssh}:{self.port}"


def load_fleet(path: str | Path) -> list[FleetNode]:
    """The nodes of the fleet file at `path`; `ConfigError` naming the fix when it cannot be used."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no fleet file at {file}: write one, for example\n{EXAMPLE}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the fleet file {file} ({err}); check its permissions and encoding") from None
    return parse_fleet(text, where=str(file), base_dir=file.parent)


def parse_fleet(text: str, *, where: str = "fleet.toml", base_dir: Path | None = None) -> list[FleetNode]:
    """The nodes of a fleet file's text; `ConfigError` naming `where`, the node and the fix."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where} is not valid TOML ({err}); fix that line") from None
    extra = sorted(set(document) - {"node"})
    if extra:
        raise ConfigError(
            f"{where}: unknown top-level key(s) {', '.join(map(repr, extra))}; "
            "a fleet file holds only [[node]] tables, for example\n" + EXAMPLE
        )
    tables = document.get("node")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{where} lists no nodes: add one [[node]] table per node, for example\n{EXAMPLE}")
    nodes = [_node(table, number, where=where, base_dir=base_dir) for number, table in enumerate(tables, 1)]
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise ConfigError(f"{where}: two nodes are named {node.name!r}; give each [[node]] its own name")
        seen.add(node.name)
    return nodes


def _node(table: Mapping[str, Any], number: int, *, where: str, base_dir: Path | None) -> FleetNode:
    name = table.get("name")
    label = f"{where}: node {name!r}" if isinstance(name, str) and name else f"{where}: [[node]] number {number}"
    for key in table:
        if key not in NODE_KEYS:
            close = difflib.get_close_matches(key, NODE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the keys are {', '.join(NODE_KEYS)}"
            raise ConfigError(f"{label} has an unknown key {key!r}; {hint}")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ConfigError(
            f'{label} needs a name: name = "rig-a" (letters, digits, ".", "_" and "-", up to 63, '
            f"starting with a letter or digit); got {name!r}"
        )
    url, ssh, port = table.get("url"), table.get("ssh"), table.get("port")
    if (url is None) == (ssh is None):
        raise ConfigError(
            f"{label} needs exactly one of url (its control API as this machine reaches it, "
            'url = "http://127.0.0.1:18083") or ssh (a host to tunnel to, ssh = "user@host" with port = 18083)'
        )
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise ConfigError(f'{label}: url = {url!r} is not an http(s) URL; write url = "http://127.0.0.1:18083"')
    if ssh is not None and (not isinstance(ssh, str) or _SSH_HOST.fullmatch(ssh) is None):
        raise ConfigError(
            f'{label}: ssh = {ssh!r} is not an ssh destination; write ssh = "user@host" '
            "(or a ~/.ssh/config alias; no spaces, no leading -)"
        )
    if ssh is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ConfigError(
            f"{label} reaches its node over ssh, so it needs port = N: the control API's port on that host "
            f"(its control.port; 1..65535), got {port!r}. A node's port 0 picks a new one each start: set "
            "control.port in that node's node.toml"
        )
    if url is not None and port is not None:
        raise ConfigError(f"{label}: port goes with ssh; with url, put the port in the URL ({url})")
    token, token_file = table.get("token"), table.get("token_file")
    if (token is None) == (token_file is None):
        raise ConfigError(
            f"{label} needs exactly one of token_file (a copy of the node's <data_dir>/control.token, "
            'token_file = "rig-a.token") or token = "…"'
        )
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ConfigError(f"{label}: token must be the text of the node's control.token, not {token!r}")
    if token_file is not None and (not isinstance(token_file, str) or not token_file.strip()):
        raise ConfigError(f'{label}: token_file must be a path, e.g. token_file = "rig-a.token"; got {token_file!r}')
    return FleetNode(
        name=name,
        url=url.rstrip("/") if isinstance(url, str) else None,
        ssh=ssh,
        port=port if ssh is not None else None,
        token=token.strip() if isinstance(token, str) else None,
        token_file=_path(token_file, base_dir) if isinstance(token_file, str) else None,
    )


def _path(value: str, base_dir: Path | None) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() or base_dir is None else base_dir / path


def ssh_command(host: str, *, local_port: int, remote_port: int) -> list[str]:
    """`ssh -N -L 127.0.0.1:LOCAL:127.0.0.1:REMOTE … -- HOST`: forwards loopback LOCAL here to the
    node's loopback control port there, runs no remote command, and never prompts."""
    if _SSH_HOST.fullmatch(host) is None:
        raise ValueError(f"{host!r} is not an ssh destination (no spaces, no leading -)")
    for what, port in (("local_port", local_port), ("remote_port", remote_port)):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"{what} must be 1..65535, got {port!r}")
    options = [item for option in SSH_OPTIONS for item in ("-o", option)]
    return ["ssh", "-N", "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}", *options, "--", host]


def retry_in(failures: int, *, jitter: float) -> float:
    """Seconds before dialling a node again after `failures` failed attempts in a row."""
    return backoff_delay(consecutive_failures=failures, jitter=jitter, base_s=RETRY_BASE_S, cap_s=RETRY_CAP_S)
