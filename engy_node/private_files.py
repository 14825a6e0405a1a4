"""Files and folders only the node's own user may read: the gateway's database (buyer accounts,
balances, key hashes, every request's metadata), the logs, and the data folder that holds them
and the wallets.

They were created under the process's umask, commonly 022: world-readable (issue 33). Creating
with a mode is not enough either, since the umask only takes bits away and a file or folder that
already exists keeps the mode it has; so each is created with the private mode and then set to
it, whether it was new or not. SQLite gives its `-wal` and `-shm` files the database file's mode,
so a private database file makes them private too (`private_file` before the first connection).
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path) -> None:
    """Create `path` (and any missing parents, which keep the umask's mode) and make it
    `PRIVATE_DIR_MODE`."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    os.chmod(path, PRIVATE_DIR_MODE)


def private_file(path: Path) -> None:
    """Create `path` empty if it is missing, and make it `PRIVATE_FILE_MODE`.

    An existing file is never opened: closing any descriptor of a file drops every POSIX lock
    this process holds on it, so opening and closing the gateway's SQLite store while another
    connection of this process had it open released that connection's locks, and the next
    connection to close deleted the write-ahead log under it (its commits then reached no other
    process)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))
    except FileExistsError:
        pass
    os.chmod(path, PRIVATE_FILE_MODE)


def make_private(path: Path) -> None:
    """Make an existing file `PRIVATE_FILE_MODE`; nothing when it is missing."""
    try:
        os.chmod(path, PRIVATE_FILE_MODE)
    except FileNotFoundError:
        pass
