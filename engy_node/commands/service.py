"""`engy-node service install --role ROLE`: write the systemd unit (and, for a validator, the
docker-compose file) that runs this node as a service.

The files come from `engy_node.units` (pure); this module resolves what they depend on (who runs
the node, its folders, this installation's interpreter) and writes them, or prints them with
`--dry-run`. It never runs systemctl: enabling a service is the operator's decision, and the
command prints the lines that do it.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from engy_node.config import Config
from engy_node.errors import ConfigError
from engy_node.units import ROLES, Install, service_files, unit_name

SYSTEM_UNIT_DIR = "/etc/systemd/system"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `service` and its actions to the sub-command parsers."""
    service = sub.add_parser("service", help="run this node as a systemd service (or the validator in docker)")
    actions = service.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    install = actions.add_parser(
        "install",
        help="write the systemd unit for a role (and a validator's docker-compose file)",
        description="Writes engy-<role>.service for the role, running this installation of engy-node with "
        "this --home; for a validator also docker-compose.validator.yml with a health check. Prints how "
        "to enable it; never starts anything (docs/operations.md).",
    )
    install.add_argument("--role", dest="service_role", required=True, choices=ROLES)
    install.add_argument("--user", action="store_true", help="a user unit (~/.config/systemd/user), no root needed")
    install.add_argument("--dir", metavar="DIR", help="write the files here (default: systemd's unit folder)")
    install.add_argument("--dry-run", action="store_true", help="print the files instead of writing them")


def resolve(config: Config, args: argparse.Namespace, *, home_given: str | None) -> tuple[Install, Path]:
    """The `Install` for `args` and the folder its files go to."""
    user_home = str(Path.home())
    if args.dir:
        directory = Path(args.dir).expanduser().resolve()
    elif args.user:
        directory = Path(user_home) / ".config" / "systemd" / "user"
    else:
        directory = Path(SYSTEM_UNIT_DIR)
    paths = config.paths
    source = Path(__file__).resolve().parent.parent.parent
    install = Install(
        role=args.service_role,
        command=(sys.executable, "-m", "engy_node"),
        user_home=user_home,
        writable=tuple(
            dict.fromkeys(
                str(path)
                for path in (
                    paths.data_dir,
                    paths.model_cache_dir,
                    paths.config_file.parent,
                    Path(user_home) / ".cache",
                )
            )
        ),
        env_file=str(paths.config_file.parent / f"engy-{args.service_role}.env"),
        node_home=str(Path(home_given).expanduser().resolve()) if home_given else None,
        user=None if args.user else getpass.getuser(),
        user_mode=args.user,
        source=str(source) if (source / "pyproject.toml").is_file() else None,
        directory=str(directory),
    )
    return install, directory


def run(config: Config, args: argparse.Namespace, *, home_given: str | None) -> int:
    install, directory = resolve(config, args, home_given=home_given)
    files = service_files(install)
    if args.dry_run:
        for name, text in files.items():
            print(f"# ---- {directory / name}")
            print(text)
        return 0
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text, encoding="utf-8")
    except OSError as error:
        raise ConfigError(
            f"cannot write to {directory} ({error.strerror}): run as root for a system unit, or add --user "
            "(a user unit) or --dir DIR"
        ) from None
    for name in files:
        print(f"wrote {directory / name}")
    systemctl = "systemctl --user" if args.user else "systemctl"
    print(f"settings and secrets: {install.env_file} (optional; ENGY_* variables, e.g. the public miner's GW)")
    if args.dir:
        print(f"outside systemd's folders: {systemctl} link {directory / unit_name(install.role)}")
    print(f"enable it: {systemctl} daemon-reload && {systemctl} enable --now {unit_name(install.role)}")
    if args.user:
        print(f"keep it running after you log out: loginctl enable-linger {os.environ.get('USER', getpass.getuser())}")
    if install.role == "validator":
        print(f"or in docker: docker compose -f {directory / 'docker-compose.validator.yml'} up -d --build")
    return 0
