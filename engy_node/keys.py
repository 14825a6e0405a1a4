"""sr25519 signatures for SN53: the exact signed messages, signing, strict verification, the
signed-request and miner-hello checks, and the local wallets that hold the keys.

What it decides. Whether a signature was made by the key behind an ss58 address over exactly
the bytes we expect, whether a signed API request or a miner hello is fresh (inside
`SIGNATURE_WINDOW_S` of the caller's clock) and not a replay. A passing check returns the proven
hotkey; whether that hotkey may do anything (is registered, holds a validator permit) is the
caller's decision, not this module's.

What it trusts. The caller's `now`, its netuid and the method, path and body it actually
received; the sr25519 implementation in `bittensor.sp_core`. It trusts nothing the peer sends:
headers, hotkeys, timestamps, worker ids and signatures are all validated here.

Message formats (the one source of truth; every signer and verifier builds them here):

    engy-sn53:epoch:v1:<netuid>:<epoch_index>:<sha256(result_json) hex>
    engy-sn53:api:v1:<netuid>:<METHOD>:<path>:<unix_ts>:<sha256(body) hex>
    engy-sn53:hello:v1:<netuid>:<hotkey>:<ts>:<worker_id>

The prefix and kind make a signature for one purpose useless for another, the netuid makes it
useless on another subnet, and the version leaves room to change a format without ambiguity.

Strictness. The SDK's verify also accepts a signature over `b"<Bytes>" + msg + b"</Bytes>"`
(polkadot.js wallets wrap what they sign). That would let a signature a user gave a browser
wallet for some other purpose count as ours, so `verify_signature` asks the SDK twice: the
signature must verify for `msg` and must NOT verify for the wrapped `msg`. The SDK's fallback
always adds a wrapping, so a signature over the wrapped form passes the first question and
fails the second, while a signature over the exact bytes passes both (failing the second would
need it to be valid for two different messages at once).

Addresses must be the canonical ss58 of format 42: other formats name the same public key, and
accepting them would let one signature appear under several hotkey strings, defeating the
replay memory and any allow-list keyed by hotkey.

Failure posture. The checks never raise on peer-controlled input; they return a
`SignatureCheck` with a short reason code. They raise only for the caller's own mistakes (a
netuid, `now` or body of the wrong type). The message builders raise on invalid input, since a
signer must never sign something a verifier would build differently.

Clock. Nothing here reads a clock: `now` (unix seconds) is always passed in, which keeps the
decisions pure and testable. The replay memory assumes `now` does not go backwards by much; a
clock stepped back can make a pruned signature fresh again for the size of the step.

bittensor is imported inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeGuard

from engy_node.errors import EngyError

if TYPE_CHECKING:
    from bittensor import Wallet
    from bittensor.sp_core import Keypair

# Five minutes either side of the server's clock. Wide enough for hosts whose clocks drift
# without tight NTP and for a slow request that is retried; narrow enough that a captured request
# stops being usable soon, and that the replay memory only has to hold ten minutes of signatures.
SIGNATURE_WINDOW_S = 300

# A hard cap on the replay memory, far above what honest validators send in one window, so a
# flood of validly signed requests cannot grow it without bound.
REPLAY_MAX_ENTRIES = 100_000

# Bittensor's ss58 address format; the only one we accept (see the module docstring).
SS58_FORMAT = 42

HEADER_HOTKEY = "X-Validator-Hotkey"
HEADER_TS = "X-Validator-Ts"
HEADER_SIG = "X-Validator-Sig"

Reason = Literal["ok", "missing-header", "bad-timestamp", "stale", "bad-signature", "replay"]

_PREFIX = "engy-sn53"
_POLKADOT_OPEN = b"<Bytes>"
_POLKADOT_CLOSE = b"</Bytes>"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_METHOD_RE = re.compile(r"[A-Z]+")
_SS58_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,64}")
_SIG_RE = re.compile(r"[0-9a-fA-F]{128}")
# Canonical decimal only, as signed: "0300" or "+300" would verify as "300" yet be another
# string. Fifteen digits is ample and keeps a huge header from costing a big-int parse.
_TS_RE = re.compile(r"0|[1-9][0-9]{0,14}")


class WalletError(EngyError):
    """A wallet or hotkey the node cannot use; the message names the file and the fix."""

    title = "wallet"


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    """The outcome of a check. `hotkey` is set only when `ok`: it is the proven signer, never a
    hotkey the peer merely claimed."""

    ok: bool
    reason: Reason
    hotkey: str | None = None


# ---------------------------------------------------------------------------------------------
# Message builders


def epoch_digest(result_json: bytes) -> str:
    """The digest an epoch result is signed under: sha256 of the exact bytes published."""
    _require_bytes("result_json", result_json)
    return hashlib.sha256(result_json).hexdigest()


def epoch_message(netuid: int, epoch_index: int, digest_hex: str) -> bytes:
    _require_uint("netuid", netuid)
    _require_uint("epoch_index", epoch_index)
    if not isinstance(digest_hex, str) or _DIGEST_RE.fullmatch(digest_hex) is None:
        raise ValueError(f"digest_hex must be 64 lowercase hex characters, got {digest_hex!r}")
    return f"{_PREFIX}:epoch:v1:{netuid}:{epoch_index}:{digest_hex}".encode()


def api_message(netuid: int, method: str, path: str, ts: int, body: bytes) -> bytes:
    _require_uint("netuid", netuid)
    _require_uint("ts", ts)
    _require_bytes("body", body)
    if not isinstance(method, str) or not isinstance(path, str):
        raise TypeError("method and path must be str")
    method = method.upper()
    if _METHOD_RE.fullmatch(method) is None:
        raise ValueError(f"method must be letters only, got {method!r}")
    # Whitespace and control characters would make the signed line mean different things to
    # different parsers (and to whoever reads it in a log).
    if not path.startswith("/") or not path.isprintable() or any(c.isspace() for c in path):
        raise ValueError(f"path must start with '/' and contain no whitespace, got {path!r}")
    body_hex = hashlib.sha256(body).hexdigest()
    return f"{_PREFIX}:api:v1:{netuid}:{method}:{path}:{ts}:{body_hex}".encode()


def hello_message(netuid: int, hotkey: str, ts: int, worker_id: str) -> bytes:
    _require_uint("netuid", netuid)
    _require_uint("ts", ts)
    if not isinstance(hotkey, str) or _SS58_RE.fullmatch(hotkey) is None:
        raise ValueError(f"hotkey must be an ss58 address, got {hotkey!r}")
    if (
        not isinstance(worker_id, str)
        or not worker_id
        or not worker_id.isprintable()
        or any(c.isspace() for c in worker_id)
    ):
        raise ValueError(f"worker_id must be non-empty with no whitespace, got {worker_id!r}")
    return f"{_PREFIX}:hello:v1:{netuid}:{hotkey}:{ts}:{worker_id}".encode()


# ---------------------------------------------------------------------------------------------
# Signing and verification


def sign(keypair: Keypair, message: bytes) -> str:
    """Sign `message` with `keypair`; the signature as lowercase hex (128 characters)."""
    _require_bytes("message", message)
    return bytes(keypair.sign(message)).hex()


def verify_signature(ss58: str, message: bytes, sig_hex: object) -> bool:
    """True only if `sig_hex` is a signature by `ss58` over exactly `message`.

    Malformed hex, a malformed or non-canonical address, or a signature over the polkadot.js
    wrapped form all give False, never an exception.
    """
    _require_bytes("message", message)
    signature = _parse_signature(sig_hex)
    if not isinstance(ss58, str) or signature is None:
        return False
    return _verify_exact(ss58, message, signature)


def signed_headers(keypair: Keypair, netuid: int, method: str, path: str, body: bytes, now: int) -> dict[str, str]:
    """The headers that authenticate one API request as coming from `keypair`'s hotkey."""
    message = api_message(netuid, method, path, now, body)
    return {
        HEADER_HOTKEY: keypair.ss58_address,
        HEADER_TS: str(now),
        HEADER_SIG: sign(keypair, message),
    }


# ---------------------------------------------------------------------------------------------
# Replay memory and the checks


class ReplayGuard:
    """The (hotkey, ts, signature) triples that already passed a check, for as long as a request
    carrying them could still be fresh.

    An entry lives until its `ts` falls out of the window relative to the `now` of a later call;
    after that the staleness check rejects it anyway. If more than `max_entries` are live, the
    ones closest to expiring are dropped first, which only happens under a flood of validly signed
    requests and keeps the hole as short as possible.
    """

    def __init__(self, *, max_entries: int = REPLAY_MAX_ENTRIES) -> None:
        _require_uint("max_entries", max_entries)
        if max_entries == 0:
            raise ValueError("max_entries must be positive")
        self._max_entries = max_entries
        self._live: set[tuple[str, int, bytes]] = set()
        self._by_expiry: list[tuple[int, tuple[str, int, bytes]]] = []

    def __len__(self) -> int:
        return len(self._live)

    def seen(self, hotkey: str, ts: int, signature: bytes, *, now: int) -> bool:
        self._prune(now)
        return (hotkey, ts, signature) in self._live

    def record(self, hotkey: str, ts: int, signature: bytes, *, now: int) -> None:
        key = (hotkey, ts, signature)
        if key not in self._live:
            self._live.add(key)
            heapq.heappush(self._by_expiry, (ts, key))
        self._prune(now)
        while len(self._live) > self._max_entries:
            _, oldest = heapq.heappop(self._by_expiry)
            self._live.discard(oldest)

    def _prune(self, now: int) -> None:
        horizon = now - SIGNATURE_WINDOW_S
        while self._by_expiry and self._by_expiry[0][0] < horizon:
            _, expired = heapq.heappop(self._by_expiry)
            self._live.discard(expired)


def check_signed_request(
    *,
    headers: Mapping[str, str],
    netuid: int,
    method: str,
    path: str,
    body: bytes,
    now: int,
    replay: ReplayGuard,
) -> SignatureCheck:
    """Decide whether a request carries a fresh, unreplayed validator signature over exactly this
    netuid, method, path and body. Header names match case-insensitively; a required header that
    is absent, empty or given twice with different values is `missing-header`."""
    _require_uint("netuid", netuid)
    _require_uint("now", now)
    _require_bytes("body", body)
    values = _required_headers(headers)
    if values is None:
        return SignatureCheck(False, "missing-header")
    hotkey, ts_text, sig_hex = values
    if _TS_RE.fullmatch(ts_text) is None:
        return SignatureCheck(False, "bad-timestamp")
    ts = int(ts_text)
    try:
        message = api_message(netuid, method, path, ts, body)
    except ValueError:
        # A method or path our signers refuse to sign cannot carry a valid signature.
        message = None
    return _decide(hotkey=hotkey, ts=ts, sig_hex=sig_hex, message=message, now=now, replay=replay)


def check_hello(
    *,
    hotkey: object,
    ts: object,
    worker_id: object,
    sig_hex: object,
    netuid: int,
    now: int,
    replay: ReplayGuard,
) -> SignatureCheck:
    """Decide whether a miner's hello proves it holds `hotkey`'s key, freshly and once.

    The fields come straight from the miner's message, so any type is accepted: a `ts` that is
    not a non-negative int is `bad-timestamp`, anything else malformed is `bad-signature`.
    """
    _require_uint("netuid", netuid)
    _require_uint("now", now)
    if not _is_uint(ts):
        return SignatureCheck(False, "bad-timestamp")
    if not isinstance(hotkey, str) or not isinstance(worker_id, str):
        return SignatureCheck(False, "bad-signature")
    try:
        message = hello_message(netuid, hotkey, ts, worker_id)
    except ValueError:
        message = None
    return _decide(hotkey=hotkey, ts=ts, sig_hex=sig_hex, message=message, now=now, replay=replay)


def _decide(
    *,
    hotkey: str,
    ts: int,
    sig_hex: object,
    message: bytes | None,
    now: int,
    replay: ReplayGuard,
) -> SignatureCheck:
    if abs(now - ts) > SIGNATURE_WINDOW_S:
        return SignatureCheck(False, "stale")
    signature = _parse_signature(sig_hex)
    if signature is None or message is None:
        return SignatureCheck(False, "bad-signature")
    # Looked up before verifying, to spare the crypto on a replay; recorded only after verifying,
    # so a forged request cannot get a genuine future one rejected as a replay.
    if replay.seen(hotkey, ts, signature, now=now):
        return SignatureCheck(False, "replay")
    if not _verify_exact(hotkey, message, signature):
        return SignatureCheck(False, "bad-signature")
    replay.record(hotkey, ts, signature, now=now)
    return SignatureCheck(True, "ok", hotkey)


def _required_headers(headers: Mapping[str, str]) -> tuple[str, str, str] | None:
    wanted = (HEADER_HOTKEY.lower(), HEADER_TS.lower(), HEADER_SIG.lower())
    found: dict[str, set[str]] = {name: set() for name in wanted}
    for name, value in headers.items():
        if isinstance(name, str) and name.lower() in found and isinstance(value, str):
            found[name.lower()].add(value)
    picked = []
    for name in wanted:
        if len(found[name]) != 1:
            return None
        (value,) = found[name]
        if not value:
            return None
        picked.append(value)
    return picked[0], picked[1], picked[2]


def _parse_signature(sig_hex: object) -> bytes | None:
    # The regex, not bytes.fromhex alone: fromhex also accepts spaces. Bytes, not the text, so an
    # upper-case copy of a signature is the same replay entry as the original.
    if not isinstance(sig_hex, str) or _SIG_RE.fullmatch(sig_hex) is None:
        return None
    return bytes.fromhex(sig_hex)


def _verify_exact(ss58: str, message: bytes, signature: bytes) -> bool:
    if not _is_canonical_ss58(ss58):
        return False
    from bittensor.sp_core import verify

    wrapped = _POLKADOT_OPEN + message + _POLKADOT_CLOSE
    try:
        return bool(verify(message, signature, ss58)) and not verify(wrapped, signature, ss58)
    except ValueError:
        return False


def _is_canonical_ss58(ss58: str) -> bool:
    if _SS58_RE.fullmatch(ss58) is None:
        return False
    from bittensor.sp_core import ss58_decode, ss58_encode

    try:
        public_key = ss58_decode(ss58)
        return len(public_key) == 32 and ss58_encode(public_key, SS58_FORMAT) == ss58
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# Wallets (bittensor's layout: <wallets_path>/<name>/hotkeys/<hotkey>)


def load_hotkey(wallets_path: str | os.PathLike[str], name: str, hotkey: str) -> Keypair:
    """The hotkey keypair of wallet `name`, or a `WalletError` naming the file and the fix."""
    wallet = _wallet(wallets_path, name, hotkey)
    from bittensor.sp_core import KeyfileError

    keyfile = wallet.hotkey_file
    if not keyfile.exists_on_device():
        raise WalletError(
            f"no hotkey file at {keyfile.path}: create it with `btcli wallet new-hotkey "
            f"--wallet-name {name} --wallet-hotkey {hotkey} --wallet-path {wallet.path}`, "
            "or fix the wallets path, wallet name or hotkey name in the config"
        )
    # The node signs unattended, so it must never stop at a password prompt.
    if keyfile.is_encrypted():
        raise WalletError(
            f"hotkey file {keyfile.path} is password-encrypted; the node signs unattended and "
            "cannot ask for a password. Use an unencrypted hotkey (btcli's default)"
        )
    try:
        return keyfile.get_keypair()
    except (OSError, ValueError, KeyfileError) as err:
        raise WalletError(f"cannot read hotkey file {keyfile.path}: {err}") from err


def create_wallet(wallets_path: str | os.PathLike[str], name: str, hotkey: str) -> str:
    """Make sure wallet `name` has hotkey `hotkey`, creating unencrypted keys where missing, and
    return the hotkey's ss58 address. Meant for local networks; existing keys are never
    overwritten, so calling it again is harmless."""
    wallet = _wallet(wallets_path, name, hotkey)
    from bittensor.sp_core import KeyfileError

    if not wallet.hotkey_file.exists_on_device():
        try:
            # A coldkeypub alone is a watch-only wallet; it still owns the hotkey, so keep it.
            if not (wallet.coldkey_file.exists_on_device() or wallet.coldkeypub_file.exists_on_device()):
                wallet.create_new_coldkey(use_password=False, suppress=True)
            wallet.create_new_hotkey(use_password=False, suppress=True)
        except (OSError, KeyfileError) as err:
            raise WalletError(f"cannot create hotkey {hotkey!r} of wallet {name!r} under {wallet.path}: {err}") from err
    return load_hotkey(wallets_path, name, hotkey).ss58_address


def _wallet(wallets_path: str | os.PathLike[str], name: str, hotkey: str) -> Wallet:
    # bittensor reads "cold/hot" as a wallet plus hotkey and joins names into paths, so a name
    # must be one plain path component.
    for label, value in (("wallet name", name), ("hotkey name", hotkey)):
        if (
            not isinstance(value, str)
            or value in ("", ".", "..")
            or "/" in value
            or os.sep in value
            or (os.altsep is not None and os.altsep in value)
        ):
            raise WalletError(f"invalid {label} {value!r}: use a plain name such as 'default'")
    from bittensor import Wallet

    root = str(Path(wallets_path).expanduser())
    return Wallet(name=name, hotkey=hotkey, path=root)


def _is_uint(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require_uint(label: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{label} must be non-negative, got {value}")


def _require_bytes(label: str, value: object) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{label} must be bytes, got {type(value).__name__}")
