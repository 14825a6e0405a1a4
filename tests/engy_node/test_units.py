"""`engy-node service install` (engy_node.units, engy_node.commands.service): the units each role
gets, checked by `systemd-analyze verify` where systemd is installed (scripts/bootstrap.sh
installs it), and the validator's docker-compose file with its `engy-node health` check."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from engy_node.cli import main
from engy_node.units import ROLES, Install, exec_line, service_files, unit_name

ANALYZE = shutil.which("systemd-analyze")
NO_ANALYZE = "systemd-analyze is not installed: run scripts/bootstrap.sh (make test does), or apt-get install systemd"
"""Not a skip: `make test` installs it, and a unit nothing verified must not pass as checked."""


def install(role: str, tmp_path: Path, *, user_mode: bool = False) -> Install:
    return Install(
        role=role,
        command=(sys.executable, "-m", "engy_node"),
        user_home=str(tmp_path),
        writable=(str(tmp_path / "data"), str(tmp_path / ".cache")),
        env_file=str(tmp_path / f"engy-{role}.env"),
        node_home=str(tmp_path / "home dir"),
        user=None if user_mode else "root",
        user_mode=user_mode,
        directory=str(tmp_path),
    )


def settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("role", ROLES)
def test_each_role_runs_the_node_with_its_role_and_restarts_on_failure(role: str, tmp_path: Path) -> None:
    files = service_files(install(role, tmp_path))
    unit = settings(files[unit_name(role)])
    assert shlex.split(unit["ExecStart"][0]) == [
        sys.executable,
        "-m",
        "engy_node",
        "--home",
        str(tmp_path / "home dir"),
        "--role",
        role,
    ]
    assert unit["Restart"] == ["on-failure"] and unit["KillMode"] == ["mixed"] and unit["User"] == ["root"]
    assert unit["ProtectSystem"] == ["strict"] and unit["NoNewPrivileges"] == ["yes"]
    assert unit["ReadWritePaths"] == [f"-{tmp_path / 'data'}", f"-{tmp_path / '.cache'}"]
    assert unit["EnvironmentFile"] == [f"-{tmp_path / f'engy-{role}.env'}"]
    # A miner keeps /dev (its GPUs); the other roles get a private one.
    assert ("PrivateDevices" in unit) is (role != "miner")
    assert set(files) == (
        {unit_name(role), "docker-compose.validator.yml", "Dockerfile.validator", ".env.validator.example"}
        if role == "validator"
        else {unit_name(role)}
    )


def test_a_user_unit_asks_only_for_what_user_systemd_honours(tmp_path: Path) -> None:
    unit = settings(service_files(install("miner", tmp_path, user_mode=True))[unit_name("miner")])
    assert "User" not in unit and "ProtectSystem" not in unit and unit["WantedBy"] == ["default.target"]


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=12), max_size=6))
def test_exec_line_quotes_every_word_back(words: list[str]) -> None:
    line = exec_line(words)
    assert shlex.split(line.replace("%%", "%")) == words


def verify(path: Path, *, user_mode: bool, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None, NO_ANALYZE
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0"}
    args = [ANALYZE, "verify", "--man=no", str(path)]
    if user_mode:
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        args.insert(1, "--user")
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("user_mode", [False, True], ids=["system", "user"])
def test_systemd_analyze_verify_accepts_every_generated_unit(user_mode: bool, tmp_path: Path) -> None:
    for role in ROLES:
        name = unit_name(role)
        path = tmp_path / name
        path.write_text(service_files(install(role, tmp_path, user_mode=user_mode))[name])
        result = verify(path, user_mode=user_mode, tmp_path=tmp_path)
        # verify exits 0 on a directive it ignores, so anything it says is a failure too.
        assert (result.returncode, result.stdout + result.stderr) == (0, ""), name


def test_systemd_analyze_verify_would_catch_a_bad_unit(tmp_path: Path) -> None:
    path = tmp_path / "bad.service"
    unit = service_files(install("gateway", tmp_path))[unit_name("gateway")]
    path.write_text(unit.replace("[Install]", "ProtectSystem=wrong\n\n[Install]"))
    result = verify(path, user_mode=False, tmp_path=tmp_path)
    assert "ignoring: wrong" in result.stdout + result.stderr


def test_the_validator_compose_file_checks_health_with_engy_node(tmp_path: Path) -> None:
    files = service_files(install("validator", tmp_path))
    compose = yaml.safe_load(files["docker-compose.validator.yml"])
    validator = compose["services"]["validator"]
    check = validator["healthcheck"]
    assert check["test"][0] == "CMD-SHELL" and check["retries"] == 3
    assert validator["restart"] == "unless-stopped" and validator["network_mode"] == "host"
    assert validator["build"]["dockerfile"] == f"{tmp_path}/Dockerfile.validator"
    assert "engy_validator_data" in compose["volumes"]
    # The check is `engy-node health`: a home whose validator never ran is unhealthy.
    argv = shlex.split(check["test"][1])
    assert argv[:1] == ["engy-node"] and argv[-1] == "health"
    assert main(["--home", str(tmp_path / "empty"), *argv[3:]]) != 0


def test_install_writes_the_files_and_says_how_to_enable_them(tmp_path: Path, capsys) -> None:
    target = tmp_path / "units"
    assert (
        main(["--home", str(tmp_path / "node"), "service", "install", "--role", "validator", "--dir", str(target)]) == 0
    )
    out = capsys.readouterr().out
    assert sorted(path.name for path in target.iterdir()) == sorted(
        [".env.validator.example", "Dockerfile.validator", "docker-compose.validator.yml", "engy-validator.service"]
    )
    assert "systemctl daemon-reload && systemctl enable --now engy-validator.service" in out
    assert f"--home {tmp_path / 'node'} --role validator" in (target / "engy-validator.service").read_text()


def test_dry_run_writes_nothing(tmp_path: Path, capsys) -> None:
    target = tmp_path / "units"
    assert (
        main(
            [
                "--home",
                str(tmp_path),
                "service",
                "install",
                "--role",
                "miner",
                "--user",
                "--dir",
                str(target),
                "--dry-run",
            ]
        )
        == 0
    )
    assert not target.exists()
    assert "--role miner" in capsys.readouterr().out


def test_an_unwritable_folder_names_the_fix(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["--home", str(tmp_path), "service", "install", "--role", "gateway", "--dir", str(blocker / "x")]) == 2
    assert "add --user" in capsys.readouterr().err
