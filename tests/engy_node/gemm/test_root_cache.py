"""The weights_root cache: an entry holds only for the exact stats it was written for, and a real
checkpoint's root is computed once, then read back until a shard changes."""

from __future__ import annotations

import os
import stat

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gemm import root_cache
from engy_node.gemm.commitment import FORMAT
from engy_node.gemm.root_cache import (
    CheckpointStats,
    cached_root,
    checkpoint_stats,
    entry_bytes,
    entry_path,
    read_entry,
    weights_root,
)
from engy_node.models import SMOLLM2_135M
from tests.engy_node.gemm.synthetic import config, dense_tensors, write_checkpoint

ROOT = "ab" * 32

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
sizes = st.integers(min_value=0, max_value=2**40)
mtimes = st.integers(min_value=0, max_value=2**63 - 1)
stats_strategy = st.builds(
    CheckpointStats,
    config_sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
    files=st.lists(st.tuples(names, sizes, mtimes), min_size=1, max_size=4, unique_by=lambda f: f[0]).map(
        lambda files: tuple(sorted(files))
    ),
)


def entry_of(stats: CheckpointStats, root: str = ROOT) -> object:
    """The entry as a reader finds it: its file's bytes parsed back."""
    return orjson.loads(entry_bytes(stats, root))


@given(stats_strategy)
def test_an_entry_holds_for_the_stats_it_was_written_for(stats):
    assert cached_root(entry_of(stats), stats) == ROOT


@given(stats_strategy, st.data())
def test_any_changed_stat_invalidates_an_entry(stats, data):
    index = data.draw(st.integers(0, len(stats.files) - 1))
    name, size, mtime = stats.files[index]
    field = data.draw(st.sampled_from(["size", "mtime", "config", "extra shard", "lost shard"]))
    files = list(stats.files)
    if field == "size":
        files[index] = (name, size + data.draw(st.integers(1, 10)), mtime)
    elif field == "mtime":
        files[index] = (name, size, mtime + data.draw(st.integers(-10, 10).filter(bool)))
    elif field == "extra shard":
        files.append(("\uffff" + name, size, mtime))
    elif field == "lost shard":
        del files[index]
    config_sha256 = ("0" if stats.config_sha256[0] != "0" else "1") + stats.config_sha256[1:]
    now = CheckpointStats(config_sha256 if field == "config" else stats.config_sha256, tuple(sorted(files)))
    assert cached_root(entry_of(stats), now) is None


@given(
    stats_strategy,
    st.one_of(
        st.none(),
        st.integers(),
        st.text(),
        st.lists(st.integers()),
        st.dictionaries(st.text(max_size=16), st.one_of(st.none(), st.integers(), st.text(max_size=70))),
    ),
)
def test_a_malformed_entry_is_never_trusted(stats, entry):
    assert cached_root(entry, stats) is None


@given(stats_strategy, st.data())
def test_a_tampered_entry_is_never_trusted(stats, data):
    entry = entry_of(stats)
    assert isinstance(entry, dict)
    broken = data.draw(
        st.sampled_from(
            [
                {**entry, "weights_root": ROOT.upper()},
                {**entry, "weights_root": ROOT[:-1]},
                {**entry, "weights_root": None},
                {key: value for key, value in entry.items() if key != "weights_root"},
                {**entry, "format": "engy-weights-v0"},
                {key: value for key, value in entry.items() if key != "format"},
                {**entry, "extra": 1},
                # JSON's true equals Python's 1, but it is not a size an entry records.
                {**entry, "files": [[name, True if size == 1 else size, mtime] for name, size, mtime in stats.files]}
                if any(size == 1 for _, size, _ in stats.files)
                else {**entry, "files": []},
            ]
        )
    )
    assert cached_root(broken, stats) is None


def test_an_entry_records_the_format_and_the_stats():
    stats = CheckpointStats("0" * 64, (("model.safetensors", 10, 5),))
    assert entry_of(stats) == {
        "format": FORMAT,
        "config_sha256": "0" * 64,
        "files": [["model.safetensors", 10, 5]],
        "weights_root": ROOT,
    }


def test_the_embedded_checkpoints_root_is_computed_once_then_read_from_the_cache(checkpoint, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = weights_root(checkpoint, cache)
    assert (first.root, first.cached) == (SMOLLM2_135M.weights_root, False)
    path = entry_path(cache, checkpoint_stats(checkpoint))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging file left behind

    def no_hashing(directory):
        raise AssertionError("a cached root was computed again")

    monkeypatch.setattr("engy_node.gemm.checkpoint.commit_checkpoint", no_hashing)
    second = weights_root(checkpoint, cache)
    assert (second.root, second.cached) == (first.root, True)
    assert second.seconds < 0.1


@pytest.fixture
def tiny(tmp_path):
    return write_checkpoint(tmp_path / "tiny", dense_tensors(), config())


def test_touching_a_shard_invalidates_its_entry(tiny, tmp_path):
    cache = tmp_path / "cache"
    root = weights_root(tiny, cache).root
    assert weights_root(tiny, cache).cached
    shard = tiny / "model.safetensors"
    status = shard.stat()
    os.utime(shard, ns=(status.st_atime_ns, status.st_mtime_ns + 1))
    again = weights_root(tiny, cache)
    assert (again.root, again.cached) == (root, False)
    assert weights_root(tiny, cache).cached


def test_a_changed_config_or_a_corrupt_entry_is_computed_again(tiny, tmp_path):
    cache = tmp_path / "cache"
    weights_root(tiny, cache)
    entry = entry_path(cache, checkpoint_stats(tiny))
    entry.write_bytes(b'{"weights_root": "')
    assert read_entry(entry) is None
    assert not weights_root(tiny, cache).cached
    assert weights_root(tiny, cache).cached  # rewritten whole

    before = weights_root(tiny, cache).root
    (tiny / "config.json").write_text((tiny / "config.json").read_text().replace("llama", "mistral"))
    changed = weights_root(tiny, cache)
    assert not changed.cached and changed.root != before


def test_a_shard_rewritten_while_it_was_hashed_is_not_recorded(tiny, tmp_path, monkeypatch):
    from engy_node.gemm import checkpoint as gemm_checkpoint

    real = gemm_checkpoint.commit_checkpoint

    def rewritten_meanwhile(directory):
        commitment = real(directory)
        shard = tiny / "model.safetensors"
        status = shard.stat()
        os.utime(shard, ns=(status.st_atime_ns, status.st_mtime_ns + 1))
        return commitment

    monkeypatch.setattr(gemm_checkpoint, "commit_checkpoint", rewritten_meanwhile)
    assert not weights_root(tiny, tmp_path / "cache").cached
    assert not (tmp_path / "cache" / root_cache.SUBDIR).exists()


def test_an_unwritable_cache_costs_a_computation_not_the_start(tiny, tmp_path, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder should be")
    found = weights_root(tiny, blocked)
    assert not found.cached and len(found.root) == 64
    assert "cannot cache the weights_root" in caplog.text
