"""What `engy-node service install` writes: a systemd unit per role and, for a validator, a
docker-compose file like the public validator's, with a health check that runs `engy-node health`.

Pure: `service_files(install)` returns file name -> text, and the command (`commands/service.py`)
decides where they go and writes them. The tests run `systemd-analyze verify` on the units.

Why the units look as they do:

* `Restart=on-failure` with a pause, and `KillMode=mixed`: systemd sends SIGTERM to the node only,
  which stops its own children (a miner's model server) within `TimeoutStopSec=90`, systemd's
  default that `config.MAX_DRAIN_S` is derived from; whatever is left is then killed.
* Hardening a system unit can afford: no new privileges, a private /tmp, the OS and home read-only
  except the node's own folders (`ReadWritePaths`, each `-`-prefixed so a folder not made yet does
  not fail the start), no kernel tunables, modules, logs or clock, no realtime or SUID, native
  system calls only, IP and Unix sockets only, files 0600 by default. A miner keeps the devices
  (its GPUs are /dev/nvidia*); other roles get a private /dev. A `--user` unit gets only what
  unprivileged systemd honours without user namespaces (no new privileges, the umask).
* The operator's settings and secrets stay out of the unit: it reads `node.toml` from the node's
  home and an optional environment file (`EnvironmentFile=-…/engy-<role>.env`, e.g. the public
  miner's `GW` and `MINER_KEY`), so the unit can be shown and shared.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence

ROLES = ("miner", "validator", "gateway", "verifier")
STOP_TIMEOUT_S = 90
RESTART_S = 10
CONTAINER_HOME = "/var/lib/engy"

_HARDENING = (
    "NoNewPrivileges=yes",
    "PrivateTmp=yes",
    "ProtectSystem=strict",
    "ProtectHome=read-only",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "RestrictSUIDSGID=yes",
    "RestrictRealtime=yes",
    "LockPersonality=yes",
    "SystemCallArchitectures=native",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "UMask=0077",
)
_USER_HARDENING = ("NoNewPrivileges=yes", "UMask=0077")


@dataclasses.dataclass(frozen=True, slots=True)
class Install:
    """Everything a role's files depend on, resolved by the command."""

    role: str
    command: tuple[str, ...]
    """How to run engy-node: the interpreter that runs the install and `-m engy_node`, so the unit
    uses the same installation (a virtual environment included)."""
    user_home: str
    """The home of the account the node runs as."""
    writable: tuple[str, ...]
    """The node's folders: its data dir, the model cache, the config dir."""
    env_file: str
    node_home: str | None = None
    """`--home` given to the install: the unit passes it on. None: the account's usual folders."""
    user: str | None = None
    """`User=` of a system unit; None for a `--user` unit."""
    user_mode: bool = False
    source: str | None = None
    """The checkout engy-node is installed from (a validator's image is built from it); None: the
    folder the files are written to, where the operator copies a checkout."""
    directory: str = "."
    """Where the files are written (the compose file names its Dockerfile there)."""


def unit_name(role: str) -> str:
    return f"engy-{role}.service"


def service_files(install: Install) -> dict[str, str]:
    """File name -> text for `install`'s role."""
    if install.role not in ROLES:
        raise ValueError(f"unknown role {install.role!r}; choose from {', '.join(ROLES)}")
    files = {unit_name(install.role): unit_text(install)}
    if install.role == "validator":
        files["docker-compose.validator.yml"] = compose_text(
            context=install.source or ".", dockerfile=f"{install.directory}/Dockerfile.validator"
        )
        files["Dockerfile.validator"] = DOCKERFILE
        files[".env.validator.example"] = VALIDATOR_ENV_EXAMPLE
    return files


def exec_line(argv: Sequence[str]) -> str:
    """`argv` as systemd's ExecStart= reads it: each word double-quoted where it needs to be,
    and `%` (a specifier there) doubled."""
    words = []
    for word in argv:
        word = word.replace("%", "%%")
        if not word or any(ch.isspace() or ch in "\"'\\;$" for ch in word):
            word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
        words.append(word)
    return " ".join(words)


def unit_text(install: Install) -> str:
    argv = [*install.command]
    if install.node_home is not None:
        argv += ["--home", install.node_home]
    argv += ["--role", install.role]
    service = [
        "Type=exec",
        f"ExecStart={exec_line(argv)}",
        "Restart=on-failure",
        f"RestartSec={RESTART_S}",
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        f"WorkingDirectory={install.user_home}",
        "Environment=PYTHONUNBUFFERED=1",
        f"EnvironmentFile=-{install.env_file}",
    ]
    if install.user is not None and not install.user_mode:
        service.insert(0, f"User={install.user}")
    if install.user_mode:
        service += _USER_HARDENING
    else:
        service += _HARDENING
        service += [f"ReadWritePaths=-{path}" for path in install.writable]
        if install.role != "miner":
            service.append("PrivateDevices=yes")
    target = "default.target" if install.user_mode else "multi-user.target"
    lines = [
        "# Written by `engy-node service install`; re-run it rather than editing (docs/operations.md).",
        "[Unit]",
        f"Description=engy node ({install.role})",
        "Documentation=man:systemd.service(5)",
        "After=network-online.target",
        "Wants=network-online.target",
        "StartLimitIntervalSec=600",
        "StartLimitBurst=10",
        "",
        "[Service]",
        *service,
        "",
        "[Install]",
        f"WantedBy={target}",
    ]
    return "\n".join(lines) + "\n"


def compose_text(
    *,
    context: str = ".",
    dockerfile: str = "Dockerfile.validator",
    health_interval_s: int = 60,
    start_period_s: int = 600,
) -> str:
    """The validator as a container: restarts unless stopped, host networking (the chain and the
    provider are reached as from the host), the wallets read-only, its state in a named volume so
    a restart resumes the resubmit schedule, and a health check that is `engy-node health` (exit
    1: the loop stalled, 3: no weights landed within the activity cutoff). No auto-updater: an
    upgrade is a rebuild the operator chooses."""
    health = shlex.join(["engy-node", "--home", CONTAINER_HOME, "health"])
    return f"""\
# Written by `engy-node service install --role validator` (docs/operations.md).
#   1. cp .env.validator.example .env.validator  and fill it in
#   2. docker compose --env-file .env.validator -f docker-compose.validator.yml up -d --build
#   3. docker compose -f docker-compose.validator.yml logs -f validator
#   4. docker inspect -f '{{{{.State.Health.Status}}}}' engy_validator
services:
  validator:
    build:
      context: {json.dumps(context)}
      dockerfile: {json.dumps(dockerfile)}
    image: engy-node-validator:local
    container_name: engy_validator
    restart: unless-stopped
    network_mode: host
    env_file:
      - .env.validator
    environment:
      ENGY_HOME: {CONTAINER_HOME}
      ENGY_VALIDATOR__WALLETS_PATH: /root/.bittensor/wallets
    volumes:
      - ~/.bittensor/wallets:/root/.bittensor/wallets:ro
      - engy_validator_data:{CONTAINER_HOME}
    healthcheck:
      test: ["CMD-SHELL", "{health}"]
      interval: {health_interval_s}s
      timeout: 20s
      retries: 3
      start_period: {start_period_s}s
    stop_grace_period: {STOP_TIMEOUT_S}s
    logging:
      driver: json-file
      options:
        max-size: "10m"
        max-file: "3"

volumes:
  engy_validator_data:
"""


DOCKERFILE = """\
# Written by `engy-node service install --role validator`: the validator needs no torch, textual
# or GPU (the `validator` extra); the compose file builds it from the engy-node checkout.
FROM python:3.11-slim
WORKDIR /src
# Only what the package is built from: a checkout's .venv, models and caches stay out.
COPY pyproject.toml README.md /src/
COPY engy_node /src/engy_node
COPY engy_tui /src/engy_tui
RUN pip install --no-cache-dir "/src[validator]"
ENTRYPOINT ["engy-node", "--role", "validator"]
"""

VALIDATOR_ENV_EXAMPLE = """\
# The validator's settings (ENGY_<SECTION>__<FIELD>, docs/validator.md); copy to .env.validator.
ENGY_VALIDATOR__WALLET_NAME=
ENGY_VALIDATOR__WALLET_HOTKEY=
ENGY_VALIDATOR__NETWORK=finney
# Alerts to a chat (docs/operations.md), e.g. discord=https://discord.com/api/webhooks/…
ENGY_ALERTS__WEBHOOKS=
"""
