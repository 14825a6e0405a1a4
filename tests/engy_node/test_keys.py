"""Tests for engy_node.keys: exact messages, strict signatures, the signed-request and hello
checks, the replay memory, and local wallets."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node import keys
from engy_node.keys import (
    HEADER_HOTKEY,
    HEADER_SIG,
    HEADER_TS,
    SIGNATURE_WINDOW_S,
    ReplayGuard,
    SignatureCheck,
    WalletError,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
NETUID = 53
NOW = 1_700_000_000
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
BODY = b'{"model":"smol","prompt":"hi"}'
PATH = "/v1/completions"


def _check(headers, *, method="POST", path=PATH, body=BODY, now=NOW, replay=None, netuid=NETUID):
    return keys.check_signed_request(
        headers=headers,
        netuid=netuid,
        method=method,
        path=path,
        body=body,
        now=now,
        replay=replay if replay is not None else ReplayGuard(),
    )


def _hello(alice, *, ts=NOW, worker_id="gpu-0", now=NOW, replay=None, netuid=NETUID, sig=None):
    message = keys.hello_message(NETUID, alice.ss58_address, ts, worker_id)
    return keys.check_hello(
        hotkey=alice.ss58_address,
        ts=ts,
        worker_id=worker_id,
        sig_hex=sig if sig is not None else keys.sign(alice, message),
        netuid=netuid,
        now=now,
        replay=replay if replay is not None else ReplayGuard(),
    )


# --- import cost ---------------------------------------------------------------------------


def test_importing_the_module_does_not_import_bittensor():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    code = "import engy_node.keys, sys; assert 'bittensor' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- messages ------------------------------------------------------------------------------


def test_the_epoch_message_is_the_exact_documented_string():
    digest = keys.epoch_digest(b"")
    assert digest == EMPTY_SHA256
    expected = f"engy-sn53:epoch:v1:53:7:{EMPTY_SHA256}".encode()
    assert keys.epoch_message(NETUID, 7, digest) == expected


def test_the_epoch_digest_is_sha256_of_the_exact_result_bytes():
    result_json = b'{"epoch":7,"weights":[1,2]}'
    assert keys.epoch_digest(result_json) == hashlib.sha256(result_json).hexdigest()


def test_the_api_message_is_the_exact_documented_string_with_the_method_upper_cased():
    message = keys.api_message(NETUID, "post", "/v1/chat", NOW, b"")
    assert message == f"engy-sn53:api:v1:53:POST:/v1/chat:{NOW}:{EMPTY_SHA256}".encode()


def test_the_hello_message_is_the_exact_documented_string(alice):
    message = keys.hello_message(NETUID, alice.ss58_address, NOW, "gpu-0")
    assert message == f"engy-sn53:hello:v1:53:{alice.ss58_address}:{NOW}:gpu-0".encode()


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda: keys.epoch_message(True, 1, EMPTY_SHA256), TypeError),
        (lambda: keys.epoch_message(-1, 1, EMPTY_SHA256), ValueError),
        (lambda: keys.epoch_message(NETUID, 1.0, EMPTY_SHA256), TypeError),
        (lambda: keys.epoch_message(NETUID, 1, EMPTY_SHA256.upper()), ValueError),
        (lambda: keys.epoch_message(NETUID, 1, EMPTY_SHA256[:-1]), ValueError),
        (lambda: keys.epoch_message(NETUID, 1, EMPTY_SHA256 + "\n"), ValueError),
        (lambda: keys.api_message(NETUID, "", PATH, NOW, b""), ValueError),
        (lambda: keys.api_message(NETUID, "GET:X", PATH, NOW, b""), ValueError),
        (lambda: keys.api_message(NETUID, "GET", "v1/x", NOW, b""), ValueError),
        (lambda: keys.api_message(NETUID, "GET", "/v1/x y", NOW, b""), ValueError),
        (lambda: keys.api_message(NETUID, "GET", "/v1/x\n", NOW, b""), ValueError),
        (lambda: keys.api_message(NETUID, "GET", PATH, False, b""), TypeError),
        (lambda: keys.api_message(NETUID, "GET", PATH, NOW, "text"), TypeError),
        (lambda: keys.hello_message(NETUID, "5Grw:x", NOW, "gpu-0"), ValueError),
        (lambda: keys.hello_message(NETUID, "5GrwvaEF", NOW, ""), ValueError),
        (lambda: keys.hello_message(NETUID, "5GrwvaEF", NOW, "gpu 0"), ValueError),
        (lambda: keys.hello_message(NETUID, "5GrwvaEF", -5, "gpu-0"), ValueError),
    ],
)
def test_builders_refuse_inputs_a_verifier_could_read_differently(build, error):
    with pytest.raises(error):
        build()


# --- sign / verify -------------------------------------------------------------------------


def test_a_signature_by_alice_verifies_for_alice_and_not_for_bob(alice, bob):
    message = keys.epoch_message(NETUID, 3, EMPTY_SHA256)
    sig = keys.sign(alice, message)
    assert len(sig) == 128 and sig == sig.lower()
    assert keys.verify_signature(alice.ss58_address, message, sig)
    assert not keys.verify_signature(bob.ss58_address, message, sig)
    assert keys.verify_signature(bob.ss58_address, message, keys.sign(bob, message))


def test_a_signature_does_not_verify_for_a_different_message(alice):
    sig = keys.sign(alice, keys.epoch_message(NETUID, 3, EMPTY_SHA256))
    other = keys.epoch_message(NETUID, 4, EMPTY_SHA256)
    assert not keys.verify_signature(alice.ss58_address, other, sig)


def test_the_sdk_itself_accepts_a_polkadot_wrapped_signature_so_strictness_is_ours(alice):
    # Without this the next test could pass for the wrong reason.
    from bittensor.sp_core import verify

    message = b"engy-sn53:epoch:v1:53:1:" + EMPTY_SHA256.encode()
    wrapped_sig = alice.sign(b"<Bytes>" + message + b"</Bytes>")
    assert verify(message, wrapped_sig, alice.ss58_address)


def test_a_signature_over_the_polkadot_wrapped_message_is_rejected(alice):
    message = b"engy-sn53:epoch:v1:53:1:" + EMPTY_SHA256.encode()
    wrapped_sig = bytes(alice.sign(b"<Bytes>" + message + b"</Bytes>")).hex()
    assert not keys.verify_signature(alice.ss58_address, message, wrapped_sig)


def test_a_message_that_is_itself_wrapped_still_verifies_when_signed_exactly(alice):
    message = b"<Bytes>payload</Bytes>"
    assert keys.verify_signature(alice.ss58_address, message, keys.sign(alice, message))


def test_the_same_key_under_another_ss58_format_is_rejected(alice):
    from bittensor.sp_core import ss58_decode, ss58_encode

    polkadot_form = ss58_encode(ss58_decode(alice.ss58_address), 0)
    message = b"m"
    assert not keys.verify_signature(polkadot_form, message, keys.sign(alice, message))


@pytest.mark.parametrize(
    "sig_hex",
    [
        "",
        "zz" * 64,
        "00" * 63,
        "00" * 65,
        "0x" + "00" * 64,
        " " + "00" * 64,
        "00 " * 64,
        None,
        7,
        b"00" * 64,
    ],
)
def test_malformed_signature_hex_makes_verify_return_false(alice, sig_hex):
    assert keys.verify_signature(alice.ss58_address, b"m", sig_hex) is False


@pytest.mark.parametrize(
    "ss58",
    ["", "not an address", "5" * 48, "1" * 1000, "0OIl", "é", None, 42, b"5Grw"],
)
def test_malformed_addresses_make_verify_return_false(alice, ss58):
    assert keys.verify_signature(ss58, b"m", keys.sign(alice, b"m")) is False


def test_an_address_with_a_broken_checksum_makes_verify_return_false(alice):
    address = alice.ss58_address
    broken = address[:-1] + ("A" if address[-1] != "A" else "B")
    assert keys.verify_signature(broken, b"m", keys.sign(alice, b"m")) is False


# --- signed requests -----------------------------------------------------------------------


def test_a_signed_request_passes_and_names_the_signer(alice):
    headers = keys.signed_headers(alice, NETUID, "post", PATH, BODY, NOW)
    assert set(headers) == {HEADER_HOTKEY, HEADER_TS, HEADER_SIG}
    assert headers[HEADER_HOTKEY] == alice.ss58_address and headers[HEADER_TS] == str(NOW)
    assert _check(headers) == SignatureCheck(True, "ok", alice.ss58_address)


def test_the_method_is_compared_case_insensitively(alice):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, method="post").ok


@pytest.mark.parametrize(
    "tamper",
    [
        {"body": BODY + b" "},
        {"path": "/v1/chat/completions"},
        {"method": "PUT"},
        {"netuid": NETUID + 1},
    ],
    ids=["body", "path", "method", "netuid"],
)
def test_a_request_with_a_tampered_part_is_rejected(alice, tamper):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, **tamper) == SignatureCheck(False, "bad-signature")


def test_a_request_with_a_tampered_timestamp_is_rejected(alice):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    headers[HEADER_TS] = str(NOW + 1)
    assert _check(headers) == SignatureCheck(False, "bad-signature")


def test_a_request_claiming_another_hotkey_is_rejected(alice, bob):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    headers[HEADER_HOTKEY] = bob.ss58_address
    assert _check(headers) == SignatureCheck(False, "bad-signature")


@pytest.mark.parametrize("skew", [SIGNATURE_WINDOW_S, -SIGNATURE_WINDOW_S])
def test_a_request_exactly_at_the_window_edge_is_accepted(alice, skew):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, now=NOW + skew).ok


@pytest.mark.parametrize("skew", [SIGNATURE_WINDOW_S + 1, -(SIGNATURE_WINDOW_S + 1)])
def test_a_request_one_second_outside_the_window_is_stale_in_either_direction(alice, skew):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, now=NOW + skew) == SignatureCheck(False, "stale")


def test_a_replayed_request_is_rejected_even_inside_the_window(alice):
    replay = ReplayGuard()
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, replay=replay).ok
    assert _check(headers, now=NOW + 10, replay=replay) == SignatureCheck(False, "replay")


def test_the_same_signature_in_upper_case_hex_is_still_a_replay(alice):
    replay = ReplayGuard()
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, replay=replay).ok
    shouted = {**headers, HEADER_SIG: headers[HEADER_SIG].upper()}
    assert _check(shouted, replay=replay) == SignatureCheck(False, "replay")


def test_a_fresh_signature_for_the_same_second_is_not_a_replay(alice):
    replay = ReplayGuard()
    first = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    second = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert first[HEADER_SIG] != second[HEADER_SIG]  # sr25519 signing is randomised
    assert _check(first, replay=replay).ok
    assert _check(second, replay=replay).ok


def test_a_forged_request_does_not_poison_the_replay_guard(alice):
    # An attacker who sees a request in flight races it with the same headers and another body.
    replay = ReplayGuard()
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, body=b"evil", replay=replay) == SignatureCheck(False, "bad-signature")
    assert len(replay) == 0
    assert _check(headers, replay=replay).ok


def test_a_polkadot_wrapped_signature_does_not_pass_a_signed_request_check(alice):
    message = keys.api_message(NETUID, "POST", PATH, NOW, BODY)
    wrapped_sig = bytes(alice.sign(b"<Bytes>" + message + b"</Bytes>")).hex()
    headers = {HEADER_HOTKEY: alice.ss58_address, HEADER_TS: str(NOW), HEADER_SIG: wrapped_sig}
    assert _check(headers) == SignatureCheck(False, "bad-signature")


def test_headers_are_found_whatever_their_case(alice):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    lower = {name.lower(): value for name, value in headers.items()}
    upper = {name.upper(): value for name, value in headers.items()}
    assert _check(lower).ok
    assert _check(upper).ok


@pytest.mark.parametrize("header", [HEADER_HOTKEY, HEADER_TS, HEADER_SIG])
def test_a_missing_or_empty_header_is_reported_as_missing(alice, header):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check({k: v for k, v in headers.items() if k != header}).reason == "missing-header"
    assert _check({**headers, header: ""}).reason == "missing-header"


def test_a_header_given_twice_with_different_values_is_reported_as_missing(alice):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    headers[HEADER_TS.lower()] = str(NOW + 1)
    assert _check(headers) == SignatureCheck(False, "missing-header")


@pytest.mark.parametrize("ts", ["abc", "-5", "+5", "05", " 5", "5 ", "1.5", "1e3", "1_000", "٣", "9" * 20])
def test_a_non_canonical_timestamp_header_is_a_bad_timestamp(alice, ts):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    headers[HEADER_TS] = ts
    assert _check(headers) == SignatureCheck(False, "bad-timestamp")


@pytest.mark.parametrize(("method", "path"), [("GET POST", PATH), ("", PATH), ("GET", "no-slash"), ("GET", "/a\nb")])
def test_a_method_or_path_no_signer_would_sign_is_a_bad_signature_not_an_exception(alice, method, path):
    headers = keys.signed_headers(alice, NETUID, "POST", PATH, BODY, NOW)
    assert _check(headers, method=method, path=path) == SignatureCheck(False, "bad-signature")


header_names = st.sampled_from([HEADER_HOTKEY, HEADER_TS, HEADER_SIG, HEADER_TS.upper(), HEADER_SIG.lower(), "Other"])


@settings(max_examples=150, deadline=None)
@given(headers=st.dictionaries(header_names, st.text(max_size=140)), now=st.integers(0, 2 * NOW))
def test_arbitrary_headers_never_raise_and_never_pass(headers, now):
    result = _check(headers, now=now)
    assert isinstance(result, SignatureCheck) and not result.ok and result.hotkey is None


def test_the_callers_own_mistakes_raise():
    with pytest.raises(TypeError):
        _check({}, now=float(NOW))
    with pytest.raises(TypeError):
        _check({}, body="text")


# --- miner hello ---------------------------------------------------------------------------


def test_a_miner_hello_proves_its_hotkey(alice):
    assert _hello(alice) == SignatureCheck(True, "ok", alice.ss58_address)


def test_a_hello_signed_for_another_worker_or_subnet_is_rejected(alice):
    message = keys.hello_message(NETUID, alice.ss58_address, NOW, "gpu-0")
    sig = keys.sign(alice, message)
    assert _hello(alice, worker_id="gpu-1", sig=sig).reason == "bad-signature"
    assert _hello(alice, netuid=NETUID + 1, sig=sig).reason == "bad-signature"


def test_a_hello_claiming_someone_elses_hotkey_is_rejected(alice, bob):
    message = keys.hello_message(NETUID, alice.ss58_address, NOW, "gpu-0")
    result = keys.check_hello(
        hotkey=alice.ss58_address,
        ts=NOW,
        worker_id="gpu-0",
        sig_hex=keys.sign(bob, message),
        netuid=NETUID,
        now=NOW,
        replay=ReplayGuard(),
    )
    assert result == SignatureCheck(False, "bad-signature")


def test_a_replayed_hello_is_rejected(alice):
    replay = ReplayGuard()
    message = keys.hello_message(NETUID, alice.ss58_address, NOW, "gpu-0")
    sig = keys.sign(alice, message)
    assert _hello(alice, sig=sig, replay=replay).ok
    assert _hello(alice, sig=sig, replay=replay, now=NOW + 1) == SignatureCheck(False, "replay")


@pytest.mark.parametrize(("skew", "ok"), [(300, True), (-300, True), (301, False), (-301, False)])
def test_a_hello_obeys_the_same_window(alice, skew, ok):
    result = _hello(alice, now=NOW + skew)
    assert result.ok is ok and (ok or result.reason == "stale")


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=130),
    st.binary(max_size=70),
)


@settings(max_examples=150, deadline=None)
@given(hotkey=anything, ts=anything, worker_id=anything, sig_hex=anything)
def test_malformed_hello_fields_never_raise_and_never_pass(hotkey, ts, worker_id, sig_hex):
    result = keys.check_hello(
        hotkey=hotkey,
        ts=ts,
        worker_id=worker_id,
        sig_hex=sig_hex,
        netuid=NETUID,
        now=NOW,
        replay=ReplayGuard(),
    )
    assert not result.ok and result.reason in {"bad-timestamp", "stale", "bad-signature"}


@pytest.mark.parametrize("ts", [True, 1.0 * NOW, str(NOW), -1, None])
def test_a_hello_timestamp_that_is_not_a_non_negative_int_is_a_bad_timestamp(alice, ts):
    result = keys.check_hello(
        hotkey=alice.ss58_address,
        ts=ts,
        worker_id="gpu-0",
        sig_hex="00" * 64,
        netuid=NETUID,
        now=NOW,
        replay=ReplayGuard(),
    )
    assert result == SignatureCheck(False, "bad-timestamp")


# --- replay memory -------------------------------------------------------------------------


def test_the_replay_guard_forgets_an_entry_once_it_could_only_be_stale():
    replay = ReplayGuard()
    replay.record("hk", NOW, b"s", now=NOW)
    assert replay.seen("hk", NOW, b"s", now=NOW + SIGNATURE_WINDOW_S)
    assert not replay.seen("hk", NOW, b"s", now=NOW + SIGNATURE_WINDOW_S + 1)
    assert len(replay) == 0


def test_at_capacity_the_replay_guard_drops_the_entry_closest_to_expiry():
    replay = ReplayGuard(max_entries=2)
    replay.record("hk", NOW + 5, b"a", now=NOW)
    replay.record("hk", NOW - 5, b"b", now=NOW)
    replay.record("hk", NOW, b"c", now=NOW)
    assert len(replay) == 2
    assert not replay.seen("hk", NOW - 5, b"b", now=NOW)
    assert replay.seen("hk", NOW + 5, b"a", now=NOW) and replay.seen("hk", NOW, b"c", now=NOW)


def test_a_replay_guard_needs_room_for_at_least_one_entry():
    with pytest.raises(ValueError):
        ReplayGuard(max_entries=0)


steps = st.lists(
    st.tuples(
        st.integers(0, 2 * SIGNATURE_WINDOW_S),  # how far the clock moves
        st.integers(-2 * SIGNATURE_WINDOW_S, 2 * SIGNATURE_WINDOW_S),  # ts relative to now
        st.sampled_from(["hk1", "hk2"]),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(steps=steps, cap=st.integers(1, 12))
def test_the_replay_guard_stays_bounded(steps, cap):
    replay = ReplayGuard(max_entries=cap)
    now = NOW
    recorded: set[tuple[str, int, bytes]] = set()
    never_over_cap = True
    for advance, offset, hotkey in steps:
        now += advance
        key = (hotkey, now + offset, b"sig")
        recorded.add(key)
        replay.record(*key, now=now)
        live = {k for k in recorded if k[1] >= now - SIGNATURE_WINDOW_S}
        never_over_cap = never_over_cap and len(live) <= cap
        assert len(replay) <= cap
        assert len(replay) <= len(live)  # nothing that could only be stale is kept
        if never_over_cap:
            assert len(replay) == len(live)
            assert all(replay.seen(*k, now=now) for k in live)


# --- wallets -------------------------------------------------------------------------------


def test_create_wallet_makes_an_unencrypted_wallet_in_bittensor_layout(tmp_path, capsys):
    ss58 = keys.create_wallet(tmp_path, "local", "validator")
    hotkey_file = tmp_path / "local" / "hotkeys" / "validator"
    assert hotkey_file.is_file() and (tmp_path / "local" / "coldkey").is_file()
    assert keys.load_hotkey(tmp_path, "local", "validator").ss58_address == ss58
    assert capsys.readouterr().out == ""  # no mnemonic on stdout


def test_create_wallet_twice_returns_the_same_hotkey_and_overwrites_nothing(tmp_path):
    first = keys.create_wallet(tmp_path, "local", "validator")
    files = sorted(p for p in (tmp_path / "local").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    assert keys.create_wallet(str(tmp_path), "local", "validator") == first
    assert {p: p.read_bytes() for p in files} == before


def test_create_wallet_adds_a_hotkey_to_an_existing_wallet_without_touching_its_coldkey(tmp_path):
    first = keys.create_wallet(tmp_path, "local", "validator")
    coldkey = (tmp_path / "local" / "coldkey").read_bytes()
    second = keys.create_wallet(tmp_path, "local", "miner")
    assert second != first
    assert (tmp_path / "local" / "coldkey").read_bytes() == coldkey


def test_a_loaded_hotkey_signs_for_its_address(tmp_path):
    ss58 = keys.create_wallet(tmp_path, "local", "validator")
    keypair = keys.load_hotkey(tmp_path, "local", "validator")
    assert keys.verify_signature(ss58, b"m", keys.sign(keypair, b"m"))


def test_loading_a_missing_hotkey_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(WalletError) as raised:
        keys.load_hotkey(tmp_path, "nowallet", "nohotkey")
    message = str(raised.value)
    assert str(tmp_path / "nowallet" / "hotkeys" / "nohotkey") in message
    assert "btcli wallet new-hotkey" in message


def test_loading_an_unreadable_hotkey_file_names_the_file(tmp_path):
    hotkey_file = tmp_path / "broken" / "hotkeys" / "default"
    hotkey_file.parent.mkdir(parents=True)
    hotkey_file.write_text("not a keyfile")
    with pytest.raises(WalletError, match=str(hotkey_file)):
        keys.load_hotkey(tmp_path, "broken", "default")


def test_loading_an_encrypted_hotkey_fails_instead_of_prompting(tmp_path):
    from bittensor import Wallet

    Wallet(name="locked", hotkey="default", path=str(tmp_path)).create_new_hotkey(
        use_password=True, hotkey_password="pw", suppress=True
    )
    with pytest.raises(WalletError, match="encrypted"):
        keys.load_hotkey(tmp_path, "locked", "default")


@pytest.mark.parametrize(
    ("name", "hotkey"),
    [("cold/hot", "default"), ("..", "default"), ("local", ""), ("local", "a/b")],
)
def test_a_wallet_or_hotkey_name_that_is_not_a_plain_name_is_refused(tmp_path, name, hotkey):
    with pytest.raises(WalletError, match="invalid"):
        keys.create_wallet(tmp_path, name, hotkey)
