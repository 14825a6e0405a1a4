"""A checkpoint's `weights_root`, remembered across starts so checking it costs nothing the second time.

Committing the embedded model hashes every row of its 270 MB (about 1.7 s of CPU, plus torch's
import); a 35B checkpoint takes minutes. The miner and the reference server check the root of
the checkpoint they load at every start (`engy_node.gemm.loaded`), so the root is cached, keyed
by what identifies the checkpoint's bytes cheaply: config.json's sha256 and each shard's name,
size and ``st_mtime_ns`` (and the shard index's, when there is one). Rewriting a shard changes its
mtime, so the entry no longer matches and the root is computed again; an entry that is corrupt,
written for another commitment format or for other stats is never trusted, only recomputed.

Where: one small JSON file per checkpoint under the machine's model cache (``ENGY_MODEL_CACHE``,
beside the converted embedded model), named by a hash of the stats. Not under a home's models
dir: every home hard-links the same converted shards (`engy_node.serve.checkpoint`), so their
stats agree and one entry serves every home — the test suite's many servers, each in a temporary
home, compute the root once per machine. A checkpoint rewritten in place leaves its old entry
behind under its old name, a few hundred bytes that are never read again. Entries are written
atomically (a temporary sibling renamed into place, mode 0644), so a concurrent reader sees a
whole entry or none; two processes computing the same root write the same bytes.

The cache guards against a wasted computation, not against tampering: whoever can write the
cache can also swap the checkpoint, and the GEMM audits check the served products themselves.

The decision whether an entry holds for these stats (`cached_root`) is pure; `checkpoint_stats`,
`read_entry` and `write_entry` are the IO around it, `weights_root` puts them together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from engy_node.errors import ModelError
from engy_node.gemm.commitment import FORMAT, canonical_json

log = logging.getLogger("engy.gemm.root_cache")

SUBDIR = "weights-roots"
"""The entries' folder inside the model cache."""
INDEX = "model.safetensors.index.json"
ROOT_HEX = 64


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointStats:
    """What identifies a checkpoint's bytes without reading its shards."""

    config_sha256: str
    files: tuple[tuple[str, int, int], ...]
    """Each shard's (and the index's) name, size in bytes and mtime in ns, in name order."""

    def document(self) -> dict[str, Any]:
        return {"format": FORMAT, "config_sha256": self.config_sha256, "files": [list(f) for f in self.files]}

    def key(self) -> str:
        """The entry's file name stem: a hash of everything an entry must match."""
        return hashlib.sha256(canonical_json(self.document())).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, slots=True)
class CachedRoot:
    root: str
    """`weights_root`, lowercase hex."""
    cached: bool
    """Read from the cache (True) or computed now (False)."""
    seconds: float
    """What finding it took."""


def cached_root(entry: object, stats: CheckpointStats) -> str | None:
    """The root an entry records, if it is a well-formed entry of this commitment format for exactly
    these stats; None otherwise (the caller computes the root again)."""
    if not isinstance(entry, dict):
        return None
    root = entry.get("weights_root")
    if not isinstance(root, str) or len(root) != ROOT_HEX or root.strip("0123456789abcdef"):
        return None
    recorded = {key: value for key, value in entry.items() if key != "weights_root"}
    # Compared as canonical JSON, so a `true` where a size was cannot pass for the 1 it equals.
    return root if canonical_json(recorded) == canonical_json(stats.document()) else None


def entry_bytes(stats: CheckpointStats, root: str) -> bytes:
    return orjson.dumps({**stats.document(), "weights_root": root}, option=orjson.OPT_INDENT_2) + b"\n"


def checkpoint_stats(checkpoint: Path) -> CheckpointStats:
    config = checkpoint / "config.json"
    if not config.is_file():
        raise ModelError(f"{checkpoint} has no config.json; point --checkpoint at a model directory")
    paths = sorted(checkpoint.glob("*.safetensors"))
    if not paths:
        raise ModelError(f"{checkpoint} has no *.safetensors shards; convert the checkpoint first")
    if (checkpoint / INDEX).is_file():
        paths.append(checkpoint / INDEX)
    files = []
    for path in sorted(paths):
        status = path.stat()
        files.append((path.name, status.st_size, status.st_mtime_ns))
    return CheckpointStats(hashlib.sha256(config.read_bytes()).hexdigest(), tuple(files))


def entry_path(cache_dir: Path, stats: CheckpointStats) -> Path:
    return cache_dir / SUBDIR / f"{stats.key()}.json"


def read_entry(path: Path) -> object:
    """The entry's JSON, or None when there is none or it is not JSON."""
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def write_entry(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically, readable by all (0644)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".staging-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(staging, 0o644)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def weights_root(checkpoint: str | os.PathLike[str], cache_dir: Path) -> CachedRoot:
    """The checkpoint's `weights_root`, from the cache when an entry matches its stats, else
    computed (`engy_node.gemm.checkpoint`, needs the model stack) and recorded. Blocking: run it
    in a worker thread. A cache that cannot be written costs the next start a computation, no more."""
    started = time.perf_counter()
    directory = Path(checkpoint)
    stats = checkpoint_stats(directory)
    path = entry_path(cache_dir, stats)
    root = cached_root(read_entry(path), stats)
    if root is not None:
        return CachedRoot(root, cached=True, seconds=time.perf_counter() - started)
    from engy_node.gemm.checkpoint import commit_checkpoint

    root = commit_checkpoint(directory).weights_root.hex()
    # The shards may have changed while they were hashed: record the root only if they did not.
    if checkpoint_stats(directory) == stats:
        try:
            write_entry(path, entry_bytes(stats, root))
        except OSError as error:
            log.warning(
                "cannot cache the weights_root of %s in %s (%s); the next start computes it again",
                directory,
                path.parent,
                error,
            )
    return CachedRoot(root, cached=False, seconds=time.perf_counter() - started)
