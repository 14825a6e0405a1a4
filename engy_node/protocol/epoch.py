"""The published epoch result (docs/trust.md, "The published result"): its canonical
`result_json`, the master's signature over it, and the check a validator runs before it puts a
single weight on chain (docs/validator.md).

What it is for. When an epoch closes, the gateway publishes one signed object:

    {"v": 1, "netuid": 53, "epoch_index": i, "digest": sha256(result_json),
     "result_json": "<canonical JSON>", "signature": "<hex sr25519>",
     "signed_hotkey": "<master ss58>", "weights": [[hotkey, u16], ...]}

`result_json` carries everything needed to recompute the epoch (the weights and the per-row
aggregates they came from), so anyone can check the settlement, not only read it. Its bytes must
therefore be the same on every machine: `build_result_json` writes sorted keys, no spaces,
ASCII-only (non-ASCII text as `\\u` escapes of four hex digits, so the bytes are identical however the outer
object is re-encoded in transit) and no floats anywhere (a float's text can differ between
platforms and libraries; every number settlement produces is an integer).

What it trusts. Only the master hotkey the caller pins. The master signs
`keys.epoch_message(netuid, epoch_index, sha256(result_json))` (keys.py is the one source of the
message format), which binds exactly the `result_json` bytes and nothing else in the envelope. So
the verifier takes the weights from the verified `result_json` alone: the top-level `weights` is
a display copy that whoever serves the payload could change without touching the signature, and
it is ignored even when it disagrees. `signed_hotkey` is display metadata too: the signature is
always checked against the pinned key, never against the key the payload names.

Compatibility. The public SN53 light validator (hanlinai/engy, `validator/sync.py`
`verify_payload` and `fetch_weights`) must accept what we publish unchanged, and our validator
accepts what it accepts, with the exceptions listed below. Its checks, in its order: body at most
1 MiB; `v == 1`; envelope `netuid` equal to ours; `result_json` a string; sha256 of its UTF-8
encoding equal to `digest` (exact, lowercase hex); the sr25519 signature over the message built
from the *recomputed* digest, raw bytes only; `result_json` an object whose `epoch_index` and
`netuid` equal the envelope's; weights a list of `[str, int 0..65535]` pairs, bools refused.
Python's `==` makes it accept `v`, `netuid` and the inner counts written as integral floats
(`1.0`), and so do we; the envelope `epoch_index` is formatted into the signed message, so there
only a true integer can verify. Unknown keys anywhere are ignored.

Where we are stricter, each time toward the cheaper mistake. Refusing a payload costs one
resubmission of the cached vector (docs/validator.md); accepting a bad one puts it on chain. So we also
refuse: a weight vector with a repeated hotkey (its meaning, summed or last-wins, is ambiguous),
one whose total is zero (nothing to normalise; our settlement burns instead), a hotkey that is
not a plain base58 string, a bool where a number belongs, a negative epoch index, and a signature
written with spaces (`bytes.fromhex` skips them; keys.py does not). keys.py also reads the pinned
master only in ss58 format 42. Our own signer never produces any of these.

Failure posture. `parse_and_verify` reads attacker-controlled bytes: it never raises anything but
`EpochPayloadError`, whose `reason` is a short stable code (`REASONS`) and whose `detail` names
the field and what was wrong. The builders (`build_result_json`, `sign_epoch`) raise `ValueError`
or `TypeError` on the caller's mistakes, because publishing a result a validator would refuse, or
one another machine would serialise differently, is worse than publishing none.

No IO and no clock here; bittensor loads only when a signature is made or checked (via keys.py).
Replay is not this module's concern: a genuinely signed old epoch verifies, and the validator's
monotonic guard (never apply an epoch older than the last one applied) refuses to submit it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, get_args

from engy_node import keys

if TYPE_CHECKING:
    from bittensor.sp_core import Keypair

PAYLOAD_VERSION = 1

MAX_PAYLOAD_BYTES = 1 << 20
"""The public light validator refuses a body over 1 MiB (`MAX_RESPONSE_BYTES` in its sync.py), so
`sign_epoch` refuses to produce one and `parse_and_verify` reads no more by default."""

WEIGHT_MAX = 65535
"""Weights are u16 on chain."""

JSON_INT_MIN = -(2**63)
JSON_INT_MAX = 2**64 - 1
"""The integers `build_result_json` writes: the range mainstream JSON libraries (orjson, Go, Rust
serde) read back exactly, so a recomputation in another language sees the same numbers."""

RESERVED_KEYS = frozenset({"epoch_index", "netuid", "weights", "rows"})
"""Keys of `result_json` this module writes itself; `extra` may not set them."""

Reason = Literal[
    "too-large",
    "not-json",
    "malformed",
    "version",
    "netuid",
    "digest",
    "epoch-index",
    "wrong-signer",
    "signature",
    "weights",
]
REASONS: tuple[Reason, ...] = get_args(Reason)
"""Every reason code `EpochPayloadError` can carry."""

# An ss58 address's shape: base58 characters only. Whether it is a registered hotkey is the
# metagraph's question (an unknown one is dropped at submit time), not this module's.
_HOTKEY_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,64}")


class EpochPayloadError(ValueError):
    """A published epoch payload this side refuses: `reason` is a stable code from `REASONS`,
    `detail` says which field and what was wrong."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True, slots=True)
class EpochPayload:
    """The signed epoch object as published (docs/trust.md, "The published result")."""

    netuid: int
    epoch_index: int
    digest: str
    """sha256 of `result_json`, lowercase hex."""
    result_json: bytes
    """The canonical result, exactly the bytes that were hashed and signed."""
    signature: str
    """The master's sr25519 signature over `keys.epoch_message(netuid, epoch_index, digest)`,
    lowercase hex."""
    signed_hotkey: str
    weights: tuple[tuple[str, int], ...]
    """The display copy, taken from `result_json`; verifiers never read it."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": PAYLOAD_VERSION,
            "netuid": self.netuid,
            "epoch_index": self.epoch_index,
            "digest": self.digest,
            "result_json": self.result_json.decode("utf-8"),
            "signature": self.signature,
            "signed_hotkey": self.signed_hotkey,
            "weights": [[hotkey, weight] for hotkey, weight in self.weights],
        }


@dataclasses.dataclass(frozen=True, slots=True)
class VerifiedEpoch:
    """What a verified payload proves: the master signed these bytes for this epoch."""

    netuid: int
    epoch_index: int
    digest: str
    result_json: bytes
    """The signed bytes (UTF-8), for caching or recomputing the epoch."""
    weights: tuple[tuple[str, int], ...]
    """From `result_json`, in its order: the only weights a validator may submit."""
    result: dict[str, Any]
    """`result_json` parsed: rows and any extra keys (epoch start and end, ...)."""


# ---------------------------------------------------------------------------------------------
# Building and signing


def build_result_json(
    *, netuid: int, epoch_index: int, settlement_json: Mapping[str, Any], extra: Mapping[str, Any] | None = None
) -> bytes:
    """The canonical `result_json` bytes for a closed epoch.

    `settlement_json` is `EpochSettlement.to_json()`: it must hold `weights` and `rows`; any
    other key it has is carried too. `extra` adds keys such as the epoch's start and end (unix
    seconds); it may not set `epoch_index`, `netuid`, `weights` or `rows`. Values may be ints
    (within `JSON_INT_MIN..JSON_INT_MAX`), strings, None, lists (or tuples) and objects with
    string keys; a float or a bool anywhere is refused, naming its path. The weights must pass
    the same check `parse_and_verify` applies, so nothing built here is refused later.
    """
    _require_uint("netuid", netuid)
    _require_uint("epoch_index", epoch_index)
    if not isinstance(settlement_json, Mapping):
        raise TypeError(f"settlement_json must be a mapping, got {type(settlement_json).__name__}")
    missing = {"weights", "rows"} - set(settlement_json)
    if missing:
        raise ValueError(f"settlement_json lacks {sorted(missing)}: pass EpochSettlement.to_json()")
    clashing = {"epoch_index", "netuid"} & set(settlement_json)
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a mapping or None, got {type(extra).__name__}")
        clashing |= (RESERVED_KEYS | set(settlement_json)) & set(extra)
    if clashing:
        raise ValueError(
            f"key(s) {sorted(clashing, key=str)} would be written twice; the module sets "
            "epoch_index and netuid, the settlement sets weights and rows"
        )
    document = {**(extra or {}), **settlement_json, "epoch_index": epoch_index, "netuid": netuid}
    plain = _plain(document, "result_json")
    read_weights(plain["weights"])  # raises EpochPayloadError (a ValueError) on a bad vector
    return _canonical(plain)


def sign_epoch(keypair: Keypair, *, netuid: int, epoch_index: int, result_json: bytes) -> dict[str, Any]:
    """The wire object (docs/trust.md, "The published result") publishing `result_json` for epoch
    `epoch_index`, signed by `keypair` (the master hotkey).

    `result_json` must be what `build_result_json` produced for this netuid and epoch: canonical,
    free of floats, with matching `netuid` and `epoch_index` and a valid weight vector; and the
    encoded object (`encode_payload`) must fit in `MAX_PAYLOAD_BYTES`. Anything else raises
    ValueError, since validators would refuse it.
    """
    _require_uint("netuid", netuid)
    _require_uint("epoch_index", epoch_index)
    if not isinstance(result_json, bytes):
        raise TypeError(f"result_json must be bytes, got {type(result_json).__name__}")
    try:
        parsed = json.loads(result_json)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"result_json is not JSON: {err}") from err
    if not isinstance(parsed, dict) or _canonical(_plain(parsed, "result_json")) != result_json:
        raise ValueError("result_json is not canonical: build it with build_result_json")
    weights = _read_result(parsed, netuid=netuid, epoch_index=epoch_index)
    digest = keys.epoch_digest(result_json)
    signature = keys.sign(keypair, keys.epoch_message(netuid, epoch_index, digest))
    payload = EpochPayload(
        netuid=netuid,
        epoch_index=epoch_index,
        digest=digest,
        result_json=result_json,
        signature=signature,
        signed_hotkey=keypair.ss58_address,
        weights=weights,
    ).to_wire()
    size = len(encode_payload(payload))
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"the signed payload is {size} bytes; validators refuse more than {MAX_PAYLOAD_BYTES}")
    return payload


def encode_payload(payload: Mapping[str, Any]) -> bytes:
    """The wire object as compact JSON bytes: what the gateway serves, and what
    `sign_epoch`'s size check measures."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("ascii")


# ---------------------------------------------------------------------------------------------
# Verifying


def parse_and_verify(
    raw: bytes, *, master_hotkey: str, netuid: int, max_bytes: int = MAX_PAYLOAD_BYTES
) -> VerifiedEpoch:
    """Verify a fetched payload as a validator does, and return what it proves.

    `raw` is the response body; `master_hotkey` the pinned ss58 of the master (never the
    payload's `signed_hotkey`); `netuid` ours. Raises `EpochPayloadError` for any payload it
    refuses, and TypeError/ValueError only for the caller's own arguments.
    """
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"raw must be bytes, got {type(raw).__name__}")
    if not isinstance(master_hotkey, str):
        raise TypeError(f"master_hotkey must be an ss58 string, got {type(master_hotkey).__name__}")
    _require_uint("netuid", netuid)
    _require_uint("max_bytes", max_bytes)

    if len(raw) > max_bytes:
        raise EpochPayloadError("too-large", f"the payload is {len(raw)} bytes, the cap is {max_bytes}")
    # The stdlib parser, as the public validator uses: same encodings (UTF-8/16/32, BOM), same
    # duplicate-key rule (last wins), so both sides read the same object.
    payload = _json_object(raw, "the payload")

    version = payload.get("v")
    if not _number_equals(version, PAYLOAD_VERSION):
        raise EpochPayloadError("version", f"v must be {PAYLOAD_VERSION}, got {_show(version)}")
    if not _number_equals(payload.get("netuid"), netuid):
        raise EpochPayloadError("netuid", f"netuid must be {netuid}, got {_show(payload.get('netuid'))}")

    result_text = payload.get("result_json")
    if not isinstance(result_text, str):
        raise EpochPayloadError("malformed", f"result_json must be a string, got {_describe(result_text)}")
    try:
        result_json = result_text.encode("utf-8")
    except UnicodeEncodeError:
        raise EpochPayloadError("malformed", "result_json holds a lone surrogate and has no UTF-8 bytes") from None
    # The digest is recomputed from the bytes received and compared exactly; the signature is
    # then checked over the recomputed one, so what is verified is what was hashed.
    digest = keys.epoch_digest(result_json)
    claimed = payload.get("digest")
    if claimed != digest:
        raise EpochPayloadError("digest", f"digest is {_show(claimed)} but sha256(result_json) is {digest}")

    epoch_index = payload.get("epoch_index")
    if not _is_uint(epoch_index):
        raise EpochPayloadError("epoch-index", f"epoch_index must be a non-negative integer, got {_show(epoch_index)}")
    message = keys.epoch_message(netuid, epoch_index, digest)
    if not keys.verify_signature(master_hotkey, message, payload.get("signature")):
        signed_hotkey = payload.get("signed_hotkey")
        if isinstance(signed_hotkey, str) and signed_hotkey != master_hotkey:
            # Diagnosis only: with a valid signature the name would be ignored. This is the
            # likely misconfiguration (a wrong pinned key), so say so.
            raise EpochPayloadError(
                "wrong-signer",
                f"the signature does not verify for the pinned master {master_hotkey}; the payload "
                f"says it was signed by {_show(signed_hotkey)}",
            )
        raise EpochPayloadError("signature", f"the signature does not verify for the pinned master {master_hotkey}")

    result = _json_object(result_text, "result_json")
    weights = _read_result(result, netuid=netuid, epoch_index=epoch_index)
    return VerifiedEpoch(
        netuid=netuid,
        epoch_index=epoch_index,
        digest=digest,
        result_json=result_json,
        weights=weights,
        result=result,
    )


def _read_result(result: Mapping[str, Any], *, netuid: int, epoch_index: int) -> tuple[tuple[str, int], ...]:
    inner_netuid = result.get("netuid")
    if not _number_equals(inner_netuid, netuid):
        raise EpochPayloadError("netuid", f"result_json.netuid is {_show(inner_netuid)}, the envelope says {netuid}")
    inner_index = result.get("epoch_index")
    if not _number_equals(inner_index, epoch_index):
        raise EpochPayloadError(
            "epoch-index", f"result_json.epoch_index is {_show(inner_index)}, the envelope says {epoch_index}"
        )
    return read_weights(result.get("weights"))


def read_weights(raw: Any, where: str = "result_json.weights") -> tuple[tuple[str, int], ...]:
    """`raw` as a weight vector a validator may submit: a list of [ss58 hotkey, u16] pairs, hotkeys
    unique, total positive. The one rule for verified payloads and for a validator's cached
    vector alike; raises `EpochPayloadError("weights", ...)` naming `where`."""
    if not isinstance(raw, list):
        raise EpochPayloadError("weights", f"{where} must be a list of [hotkey, weight] pairs, got {_describe(raw)}")
    weights: list[tuple[str, int]] = []
    seen: set[str] = set()
    for position, pair in enumerate(raw):
        at = f"{where}[{position}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise EpochPayloadError("weights", f"{at} must be a [hotkey, weight] pair, got {_show(pair)}")
        hotkey, weight = pair
        if not isinstance(hotkey, str) or _HOTKEY_RE.fullmatch(hotkey) is None:
            raise EpochPayloadError("weights", f"{at}[0] must be an ss58 hotkey, got {_show(hotkey)}")
        if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= WEIGHT_MAX:
            raise EpochPayloadError("weights", f"{at}[1] must be an integer 0..{WEIGHT_MAX}, got {_show(weight)}")
        if hotkey in seen:
            raise EpochPayloadError("weights", f"{at}: hotkey {hotkey} appears more than once")
        seen.add(hotkey)
        weights.append((hotkey, weight))
    if sum(weight for _, weight in weights) == 0:
        raise EpochPayloadError("weights", f"{where} has no positive weight (an empty epoch burns to the owner)")
    return tuple(weights)


# ---------------------------------------------------------------------------------------------
# Canonical JSON


def _canonical(plain: dict[str, Any]) -> bytes:
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _plain(value: Any, path: str) -> Any:
    """`value` as plain dicts, lists, ints, strings and None, or a ValueError naming `path`."""
    if value is None:
        return None
    if isinstance(value, bool):
        # A bool is an int in Python: True where a count belongs would be written as `true`.
        raise ValueError(f"{path}: booleans are not allowed in result_json, got {value}")
    if isinstance(value, int):
        if not JSON_INT_MIN <= value <= JSON_INT_MAX:
            raise ValueError(f"{path}: integer {value} is outside {JSON_INT_MIN}..{JSON_INT_MAX}")
        return int(value)
    if isinstance(value, float):
        raise ValueError(f"{path}: floats are not allowed in result_json (got {value!r}); use integers")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path}: the string holds a lone surrogate") from None
        return str(value)
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path}: object keys must be strings, got {key!r}")
            plain[_plain(key, path)] = _plain(item, f"{path}.{key}")
        return plain
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{path}[{position}]") for position, item in enumerate(value)]
    raise ValueError(f"{path}: {type(value).__name__} is not a JSON value (ints, strings, None, lists, objects)")


# ---------------------------------------------------------------------------------------------
# Small helpers


def _require_uint(label: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{label} must be non-negative, got {value}")


def _is_uint(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number_equals(value: object, expected: int) -> bool:
    """`value == expected` as the public validator reads it (so `53.0` counts as 53), except that
    a bool never counts as a number."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", int: "a number", float: "a number"}
    return kind.get(type(value), type(value).__name__)


def _show(value: Any, limit: int = 80) -> str:
    """A peer's value for a message: short, and printable whatever it holds."""
    try:
        text = ascii(value)
    except RecursionError:  # nesting as deep as the parser allows
        return _describe(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_object(text: str | bytes, what: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise EpochPayloadError("not-json", f"{what} is not JSON: {_short(err)}") from None
    if not isinstance(value, dict):
        raise EpochPayloadError("malformed", f"{what} must be a JSON object, got {_describe(value)}")
    return value


def _short(err: BaseException) -> str:
    return _show(str(err) or type(err).__name__, limit=120).strip("'\"")
