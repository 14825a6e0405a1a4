"""The light loop's persisted state (docs/validator.md): what this validator last put on chain, read
defensively and written atomically.

The fields: which epoch was last applied, at which block and wall-clock time it was submitted,
and the last scored vector that landed with its master-signed digest. They move together or not
at all: `write_state` replaces the whole file in one rename, and the loop writes only after the
chain confirmed a submission. A partial advance would make the loop believe it had submitted when
it had not, and wait a whole resubmit interval before trying again.

Why each field validates on its own. One poisoned value must not discard the rest: the loop
degrades a little with each field it loses (no block anchor → the wall clock; no timestamp →
submit now; no cache → nothing to resubmit through a provider outage), and losing all of them
costs one redundant submission. `read_state` says which fields it dropped so the caller can log
them. The cached vector is held to the epoch parser's rule (`engy_node.protocol.epoch`), because
during an outage it goes to the chain as it is: a corrupt file must not become a corrupt
submission.

Why a standby submission never overwrites the cache (`after_submit`). The standby vector (the
cache again, or a burn to the subnet owner) is a liveness stopgap for a payload that landed
nothing, not a scored result. Caching it would let a later provider outage resubmit a burn as if
the provider had scored it.

The file uses the public light validator's key names and shapes, so an operator can move a state
file between the two. `atomic_write_json` is shared with the heartbeat file (liveness.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engy_node.protocol.epoch import EpochPayloadError, read_weights

# The epoch parser's hotkey shape: base58 characters only. Registration is the metagraph's
# question, answered at submit time.
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

FILE_PROBLEM = "file"
"""The problem `read_state` names when the file as a whole could not be used."""


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorState:
    """What this validator last put on chain. None means unknown (never written, or discarded on
    read), and every consumer treats unknown as "submit"."""

    last_applied: int | None = None
    """The newest epoch index submitted; the replay guard never goes below it."""
    last_submit_block: int | None = None
    """The block read just before the last confirmed submission; None if the chain gave none."""
    last_submit_ts: float | None = None
    """Unix time of the last confirmed submission, for the wall-clock fallback and pre-gate."""
    cached_weights: tuple[tuple[str, int], ...] | None = None
    """The last scored vector that landed, resubmitted through a provider outage."""
    cached_digest: str | None = None
    """The master-signed digest of `cached_weights`: telemetry only, never a submission input."""


EMPTY = ValidatorState()


def read_state(path: str | os.PathLike[str]) -> tuple[ValidatorState, tuple[str, ...]]:
    """The state at `path`, and the names of the fields that were present but invalid and so
    discarded (in field order).

    A missing file is a fresh validator: EMPTY, no problems. A file that cannot be read, is not
    JSON or is not a JSON object gives EMPTY with the single problem `FILE_PROBLEM`. JSON null is
    how an unknown field is written, so it reads as None without a problem; unknown keys are
    ignored.
    """
    try:
        document = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return EMPTY, ()
    # RecursionError: absurdly nested JSON. ValueError covers bad JSON and bad UTF-8.
    except (OSError, ValueError, RecursionError):
        return EMPTY, (FILE_PROBLEM,)
    if not isinstance(document, dict):
        return EMPTY, (FILE_PROBLEM,)
    return _from_document(document)


def write_state(path: str | os.PathLike[str], state: ValidatorState) -> None:
    """Replace the state file atomically with `state`, all fields at once.

    Raises ValueError if a field holds something `read_state` would discard (the caller's
    mistake: writing it would silently lose that field on the next read), and OSError if the
    file cannot be written, in which case the previous file is left as it was.
    """
    document = _to_document(state)
    _, problems = _from_document(document)
    if problems:
        raise ValueError(f"refusing to write a state that would not read back: invalid {', '.join(problems)}")
    atomic_write_json(path, document)


def after_submit(
    state: ValidatorState,
    *,
    epoch_index: int,
    block: int | None,
    now: float,
    weights: Sequence[tuple[str, int]],
    digest: str | None,
    standby: bool,
) -> ValidatorState:
    """The state after a confirmed submission of `weights` for `epoch_index`.

    Every submission moves the anchor (epoch, block, time), so the resubmit interval gates the
    next attempt. Only a scored vector replaces the cache; a standby one keeps the previous cache
    and its digest (see the module docstring).
    """
    anchored = dataclasses.replace(state, last_applied=epoch_index, last_submit_block=block, last_submit_ts=now)
    if standby:
        return anchored
    return dataclasses.replace(
        anchored, cached_weights=tuple((hotkey, weight) for hotkey, weight in weights), cached_digest=digest
    )


def atomic_write_json(path: str | os.PathLike[str], document: Mapping[str, Any]) -> None:
    """Write `document` as JSON to `path` so that a reader sees the old file or the new one,
    never a mix: a temp file in the same directory (mode 0600), fsynced, then renamed over
    `path`. Creates the parent directory. Raises OSError on IO failure and ValueError or
    TypeError if the document is not plain JSON (NaN and infinities included); either way the
    previous file is untouched and the temp file removed.

    The directory itself is not fsynced: a power cut may undo the rename, which for both users
    (state, heartbeat) costs at most one redundant submission or one stale reading.
    """
    target = Path(path)
    # Serialise before touching the disk, so a bad document leaves nothing behind.
    text = json.dumps(document, allow_nan=False) + "\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp creates the file with mode 0600 and a name no other writer can race for.
    descriptor, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as temp_file:
            temp_file.write(text)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.replace(temp_name, target)
    except BaseException:
        # Re-raised at once; the except only removes the half-written temp file.
        Path(temp_name).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# Field by field


def _to_document(state: ValidatorState) -> dict[str, Any]:
    return {
        "last_applied": state.last_applied,
        "last_submit_block": state.last_submit_block,
        "last_submit_ts": state.last_submit_ts,
        "cached_weights": None
        if state.cached_weights is None
        else [[hotkey, weight] for hotkey, weight in state.cached_weights],
        "cached_digest": state.cached_digest,
    }


def _from_document(document: Mapping[str, Any]) -> tuple[ValidatorState, tuple[str, ...]]:
    values: dict[str, Any] = {}
    problems: list[str] = []
    for field in dataclasses.fields(ValidatorState):
        raw = document.get(field.name)
        if raw is None:
            continue
        value = _READERS[field.name](raw)
        if value is None:
            problems.append(field.name)
        else:
            values[field.name] = value
    return ValidatorState(**values), tuple(problems)


def _read_count(raw: Any) -> int | None:
    # bool is an int subclass: `true` must never read as epoch or block 1.
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return raw
    return None


def _read_timestamp(raw: Any) -> float | None:
    # Python's json reads NaN and Infinity; neither is a time.
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw):
        return float(raw)
    return None


def _read_weights(raw: Any) -> tuple[tuple[str, int], ...] | None:
    """The epoch parser's own rule: this vector goes to the chain during a provider outage, so a
    corrupt file must not become a corrupt submission."""
    try:
        return read_weights(raw, "cached_weights")
    except EpochPayloadError:
        return None


def _read_digest(raw: Any) -> str | None:
    if isinstance(raw, str) and _DIGEST_RE.fullmatch(raw):
        return raw
    return None


_READERS: dict[str, Callable[[Any], Any]] = {
    "last_applied": _read_count,
    "last_submit_block": _read_count,
    "last_submit_ts": _read_timestamp,
    "cached_weights": _read_weights,
    "cached_digest": _read_digest,
}
