"""private_files, and where the node uses it (issue 33, item 8: the gateway's database and the
logs were world-readable): the gateway's SQLite file with its -wal and -shm, the data folder and
the log folder and files are this user's only, under a permissive umask, when new and when they
already existed with looser modes."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engy_node import hub as hub_module
from engy_node.gateway.store import Store
from engy_node.hub import Hub, install_logging
from engy_node.private_files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, make_private, private_dir, private_file


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def permissive_umask():
    """The common default: new files world-readable unless asked otherwise."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_folders_and_files_are_private_when_new_and_when_they_were_not(tmp_path):
    private_dir(tmp_path / "new" / "data")
    assert mode(tmp_path / "new" / "data") == PRIVATE_DIR_MODE
    (tmp_path / "open").mkdir(mode=0o755)
    private_dir(tmp_path / "open")
    assert mode(tmp_path / "open") == PRIVATE_DIR_MODE
    private_file(tmp_path / "new" / "data" / "file")
    assert mode(tmp_path / "new" / "data" / "file") == PRIVATE_FILE_MODE
    readable = tmp_path / "readable"
    readable.write_text("kept")
    os.chmod(readable, 0o644)
    private_file(readable)
    make_private(tmp_path / "missing")  # nothing to do
    assert mode(readable) == PRIVATE_FILE_MODE and readable.read_text() == "kept"


def test_the_gateways_database_and_its_wal_and_shm_are_this_users_only(tmp_path):
    path = tmp_path / "data" / "gateway.sqlite3"
    with Store(path) as store:
        store.create_buyer("acme")  # a write: the -wal and -shm exist now
        files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
        assert all(file.exists() for file in files)
        assert [mode(file) for file in files] == [PRIVATE_FILE_MODE] * 3
    assert mode(path.parent) == PRIVATE_DIR_MODE
    # A database left readable by an earlier version is made private when it is opened.
    for file in files:
        if file.exists():
            os.chmod(file, 0o644)
    with Store(path) as store:
        store.create_buyer("again")
        assert [mode(file) for file in files if file.exists()] == [PRIVATE_FILE_MODE] * sum(f.exists() for f in files)


def test_the_log_folder_and_files_are_this_users_only_also_after_rotation(tmp_path, monkeypatch, engy_logger):
    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o755)
    old_backup = log_dir / "engy-node.log.1"
    old_backup.write_text("written before the logs were private\n")
    os.chmod(old_backup, 0o644)
    monkeypatch.setattr(hub_module, "LOG_FILE_BYTES", 200)
    # engy_logger puts the engy logger back as it was (install_logging stops its propagation,
    # which would hide every later test's records from caplog).
    install_logging(Hub(), level="info", log_dir=log_dir, stderr=False)
    for index in range(20):
        logging.getLogger("engy.test").info("line %d of a log that rotates", index)
    assert mode(log_dir) == PRIVATE_DIR_MODE
    logs = sorted(log_dir.iterdir())
    assert len(logs) == 1 + hub_module.LOG_FILE_BACKUPS
    assert {file.name: mode(file) for file in logs} == dict.fromkeys((f.name for f in logs), PRIVATE_FILE_MODE)


def test_a_second_store_opened_and_closed_in_the_process_leaves_the_first_ones_commits_visible(tmp_path):
    """Making the store's file private must not open it when it exists: closing that descriptor
    dropped the first connection's locks, and the second connection's close then deleted the
    write-ahead log the first one was still writing (its commits reached no other process)."""
    path = tmp_path / "gateway.sqlite3"
    first = Store.open(path)
    try:
        account, _ = first.create_buyer("buyer")
        with Store.open(path) as second:
            second.credit(account, micro_usd=5)
        first.credit(account, micro_usd=7)
        read = "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute('SELECT credited FROM accounts').fetchone()[0])"
        seen = subprocess.run([sys.executable, "-c", read, str(path)], capture_output=True, text=True, timeout=60)
        assert seen.stdout.strip() == "12", seen
        assert path.with_name(path.name + "-wal").exists()
    finally:
        first.close()
