"""Tests for engy_node.protocol.epoch: the canonical result_json, the signed epoch payload, and the
validator's check that refuses anything the master did not sign for this subnet and epoch.

The payloads refused here are forged properly where it matters: a refusal for a wrong inner netuid
or a bad weight vector is tested on a payload whose digest and signature are genuine, so it is
that check, not an earlier one, that refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engy_node import keys
from engy_node.gateway.billing.settlement import EpochSettlement, RowAggregate
from engy_node.protocol.epoch import (
    JSON_INT_MAX,
    JSON_INT_MIN,
    MAX_PAYLOAD_BYTES,
    REASONS,
    RESERVED_KEYS,
    EpochPayloadError,
    VerifiedEpoch,
    build_result_json,
    encode_payload,
    parse_and_verify,
    sign_epoch,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
NETUID = 53
IDX = 12
MINER_A = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
MINER_B = "5FLSigC9HGRKVhB9FiEo4Y3koPsNmBmLJbpXg2mp1hXcS59Y"
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _settlement(weights=((MINER_A, 40000), (MINER_B, 25535))):
    return {"weights": [[hotkey, weight] for hotkey, weight in weights], "rows": [{"hotkey": MINER_A, "score": 7}]}


def _result_json(**over) -> bytes:
    return build_result_json(
        netuid=over.pop("netuid", NETUID),
        epoch_index=over.pop("epoch_index", IDX),
        settlement_json=over.pop("settlement_json", _settlement()),
        extra=over or None,
    )


def _published(keypair, **over) -> dict:
    return sign_epoch(keypair, netuid=NETUID, epoch_index=IDX, result_json=_result_json(**over))


def _forge(signer, result_text: str, *, netuid=NETUID, epoch_index=IDX, **envelope) -> dict:
    """A payload carrying any result text with a genuine digest and signature by `signer`: the
    way to reach the checks that run after the signature."""
    digest = hashlib.sha256(result_text.encode("utf-8")).hexdigest()
    wire = {
        "v": 1,
        "netuid": netuid,
        "epoch_index": epoch_index,
        "digest": digest,
        "result_json": result_text,
        "signature": keys.sign(signer, keys.epoch_message(netuid, epoch_index, digest)),
        "signed_hotkey": signer.ss58_address,
        "weights": [],
    }
    wire.update(envelope)
    return wire


def _inner(**over) -> str:
    """Result text in the public validator's test shape, with any key replaced."""
    result = {"epoch_index": IDX, "netuid": NETUID, "weights": [[MINER_A, 65535]], "rows": []}
    result.update(over)
    return json.dumps(result, sort_keys=True, separators=(",", ":"))


def _verify(payload, master, *, netuid=NETUID, **kwargs) -> VerifiedEpoch:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_and_verify(raw, master_hotkey=master.ss58_address, netuid=netuid, **kwargs)


def _refusal(payload, master, **kwargs) -> EpochPayloadError:
    with pytest.raises(EpochPayloadError) as caught:
        _verify(payload, master, **kwargs)
    assert caught.value.reason in REASONS
    return caught.value


# --- canonical result_json -------------------------------------------------------------------


def test_result_json_is_sorted_compact_and_byte_exact():
    result_json = build_result_json(
        netuid=53,
        epoch_index=12,
        settlement_json={
            "weights": [["5Aaa", 65535]],
            "rows": [{"model": "smol", "hotkey": "5Aaa", "gate_reason": None, "score": 7}],
        },
        extra={"epoch_start": 1784505600, "epoch_end": 1785110400},
    )
    assert result_json == (
        b'{"epoch_end":1785110400,"epoch_index":12,"epoch_start":1784505600,"netuid":53,'
        b'"rows":[{"gate_reason":null,"hotkey":"5Aaa","model":"smol","score":7}],"weights":[["5Aaa",65535]]}'
    )
    assert keys.epoch_digest(result_json) == hashlib.sha256(result_json).hexdigest()


def test_non_ascii_text_is_escaped_so_the_bytes_survive_any_re_encoding():
    result_json = build_result_json(
        netuid=53, epoch_index=0, settlement_json={"weights": [["5Aaa", 1]], "rows": [{"model": "modèle-€"}]}
    )
    assert b'"model":"mod\\u00e8le-\\u20ac"' in result_json
    assert json.loads(result_json)["rows"][0]["model"] == "modèle-€"


def test_a_real_settlement_builds_as_is():
    row = RowAggregate(
        hotkey=MINER_A,
        model="smol",
        requests=120,
        ok_2xx=120,
        status_499=0,
        buyer_faults=0,
        status_502=0,
        status_504=0,
        other_failures=0,
        counted=118,
        tokens=90_000,
        ttft_p99_ms=410,
        tpot_p99_ms=None,
        verdict_pass=3,
        verdict_cheat=0,
        verdict_unproven=1,
        score=90,
        gate_reason=None,
    )
    settlement = EpochSettlement(weights=((MINER_A, 65535),), rows=(row,))
    result = json.loads(build_result_json(netuid=53, epoch_index=3, settlement_json=settlement.to_json()))
    assert result["weights"] == [[MINER_A, 65535]]
    assert result["rows"] == [row.to_json()]
    assert (result["netuid"], result["epoch_index"]) == (53, 3)


def test_tuples_are_written_as_lists():
    result_json = build_result_json(netuid=53, epoch_index=1, settlement_json={"weights": ((MINER_A, 5),), "rows": ()})
    assert json.loads(result_json)["weights"] == [[MINER_A, 5]]


@pytest.mark.parametrize(
    ("settlement_json", "extra", "path"),
    [
        ({"weights": [[MINER_A, 65535.0]], "rows": []}, None, "result_json.weights[0][1]"),
        ({"weights": [[MINER_A, 1]], "rows": [{"tokens": 1.5}]}, None, "result_json.rows[0].tokens"),
        ({"weights": [[MINER_A, 1]], "rows": []}, {"params": {"rate": [1, 2.0]}}, "result_json.params.rate[1]"),
        ({"weights": [[MINER_A, 1]], "rows": []}, {"epoch_start": float("nan")}, "result_json.epoch_start"),
    ],
)
def test_a_float_anywhere_is_refused_naming_its_path(settlement_json, extra, path):
    with pytest.raises(ValueError, match="floats are not allowed") as caught:
        build_result_json(netuid=53, epoch_index=1, settlement_json=settlement_json, extra=extra)
    assert path in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"final": True}, "booleans are not allowed"),
        ({1: "x"}, "keys must be strings"),
        ({"big": JSON_INT_MAX + 1}, "outside"),
        ({"small": JSON_INT_MIN - 1}, "outside"),
        ({"when": object()}, "is not a JSON value"),
        ({"text": "\ud800"}, "lone surrogate"),
    ],
)
def test_values_that_would_not_serialise_identically_everywhere_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        build_result_json(netuid=53, epoch_index=1, settlement_json=_settlement(), extra=extra)


def test_the_64_bit_edges_are_written():
    result_json = build_result_json(
        netuid=53, epoch_index=1, settlement_json=_settlement(), extra={"hi": JSON_INT_MAX, "lo": JSON_INT_MIN}
    )
    assert json.loads(result_json)["hi"] == JSON_INT_MAX and json.loads(result_json)["lo"] == JSON_INT_MIN


@pytest.mark.parametrize("key", sorted(RESERVED_KEYS))
def test_extra_cannot_overwrite_what_the_module_or_the_settlement_writes(key):
    with pytest.raises(ValueError, match="written twice"):
        build_result_json(netuid=53, epoch_index=1, settlement_json=_settlement(), extra={key: 1})


def test_the_settlement_cannot_carry_its_own_netuid():
    with pytest.raises(ValueError, match="written twice"):
        build_result_json(netuid=53, epoch_index=1, settlement_json={**_settlement(), "netuid": 1})


def test_a_settlement_without_rows_is_refused():
    with pytest.raises(ValueError, match="rows"):
        build_result_json(netuid=53, epoch_index=1, settlement_json={"weights": [[MINER_A, 1]]})


def test_a_weight_vector_a_validator_would_refuse_is_never_built():
    with pytest.raises(EpochPayloadError) as caught:
        build_result_json(netuid=53, epoch_index=1, settlement_json={"weights": [[MINER_A, 0]], "rows": []})
    assert caught.value.reason == "weights" and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("netuid", "epoch_index", "error"), [(-1, 0, ValueError), (53, True, TypeError), (53.0, 0, TypeError)]
)
def test_bad_netuid_or_epoch_index_is_the_callers_mistake(netuid, epoch_index, error):
    with pytest.raises(error):
        build_result_json(netuid=netuid, epoch_index=epoch_index, settlement_json=_settlement())


# --- signing ---------------------------------------------------------------------------------


def test_the_wire_object_is_exactly_specs_shape(alice):
    result_json = _result_json()
    wire = sign_epoch(alice, netuid=NETUID, epoch_index=IDX, result_json=result_json)
    assert list(wire) == [
        "v",
        "netuid",
        "epoch_index",
        "digest",
        "result_json",
        "signature",
        "signed_hotkey",
        "weights",
    ]
    assert wire["v"] == 1 and wire["netuid"] == NETUID and wire["epoch_index"] == IDX
    assert wire["digest"] == hashlib.sha256(result_json).hexdigest()
    assert wire["result_json"] == result_json.decode()
    assert wire["signed_hotkey"] == alice.ss58_address
    assert wire["weights"] == [[MINER_A, 40000], [MINER_B, 25535]]
    assert keys.verify_signature(alice.ss58_address, keys.epoch_message(NETUID, IDX, wire["digest"]), wire["signature"])


def test_a_published_payload_verifies_and_yields_the_signed_weights(alice):
    wire = _published(alice, epoch_start=100, epoch_end=200)
    verified = _verify(encode_payload(wire), alice)
    assert verified.weights == ((MINER_A, 40000), (MINER_B, 25535))
    assert (verified.netuid, verified.epoch_index, verified.digest) == (NETUID, IDX, wire["digest"])
    assert verified.result_json == wire["result_json"].encode()
    assert verified.result["epoch_start"] == 100 and verified.result["rows"] == [{"hotkey": MINER_A, "score": 7}]


def test_the_public_light_validators_steps_accept_what_we_publish(alice):
    # The checks of hanlinai/engy validator/sync.py verify_payload, restated: parse the body,
    # v and netuid by ==, sha256 of result_json's UTF-8 against digest, the raw sr25519
    # signature over the message from the recomputed digest, then the inner fields.
    from bittensor.sp_core import verify

    body = encode_payload(_published(alice, epoch_start=100, epoch_end=200))
    assert len(body) <= 1024 * 1024
    payload = json.loads(body)
    assert payload["v"] == 1 and payload["netuid"] == NETUID
    local_digest = hashlib.sha256(payload["result_json"].encode("utf-8")).hexdigest()
    assert local_digest == payload["digest"]
    message = f"engy-sn53:epoch:v1:{NETUID}:{payload['epoch_index']}:{local_digest}".encode()
    raw_sig = bytes.fromhex(payload["signature"])
    assert len(raw_sig) == 64 and verify(message, raw_sig, alice.ss58_address)
    result = json.loads(payload["result_json"])
    assert result["epoch_index"] == payload["epoch_index"] and result["netuid"] == NETUID
    assert all(isinstance(h, str) and type(w) is int and 0 <= w <= 65535 for h, w in result["weights"])


def test_a_payload_in_the_public_validators_test_shape_is_accepted(alice):
    # Their fixture: extra inner keys (miners, params, v, epoch bounds), extra envelope keys,
    # a short hotkey string.
    inner = json.dumps(
        {
            "epoch_end": 2,
            "epoch_index": IDX,
            "epoch_start": 1,
            "miners": [],
            "netuid": NETUID,
            "params": {},
            "v": 1,
            "weights": [["5Aaa", 65535]],
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    payload = _forge(alice, inner, epoch_start=1, epoch_end=2, signed_at=612, weights=[["5Aaa", 65535]])
    assert _verify(payload, alice).weights == (("5Aaa", 65535),)


def test_sign_refuses_result_json_that_is_not_canonical(alice):
    loose = json.dumps(json.loads(_result_json()), indent=1).encode()
    with pytest.raises(ValueError, match="not canonical"):
        sign_epoch(alice, netuid=NETUID, epoch_index=IDX, result_json=loose)


def test_sign_refuses_result_json_with_a_float(alice):
    with pytest.raises(ValueError, match="floats"):
        sign_epoch(alice, netuid=NETUID, epoch_index=IDX, result_json=_inner(score=1.5).encode())


@pytest.mark.parametrize(("netuid", "epoch_index", "reason"), [(54, IDX, "netuid"), (NETUID, IDX + 1, "epoch-index")])
def test_sign_refuses_result_json_for_another_subnet_or_epoch(alice, netuid, epoch_index, reason):
    with pytest.raises(EpochPayloadError) as caught:
        sign_epoch(alice, netuid=netuid, epoch_index=epoch_index, result_json=_result_json())
    assert caught.value.reason == reason


def test_sign_refuses_a_payload_validators_would_refuse_for_size(alice):
    result_json = _result_json(padding="x" * MAX_PAYLOAD_BYTES)
    with pytest.raises(ValueError, match="validators refuse more than"):
        sign_epoch(alice, netuid=NETUID, epoch_index=IDX, result_json=result_json)


def test_sign_refuses_text_instead_of_bytes(alice):
    with pytest.raises(TypeError):
        sign_epoch(alice, netuid=NETUID, epoch_index=IDX, result_json=_result_json().decode())


# --- what the verifier ignores, and what it tolerates ------------------------------------------


def test_display_weights_that_disagree_are_ignored(alice):
    wire = dict(_published(alice), weights=[["5Evil", 65535]])
    assert _verify(wire, alice).weights == ((MINER_A, 40000), (MINER_B, 25535))


def test_missing_or_malformed_display_weights_are_ignored(alice):
    wire = _published(alice)
    del wire["weights"]
    assert _verify(wire, alice).weights[0] == (MINER_A, 40000)
    assert _verify(dict(wire, weights="junk"), alice).weights[0] == (MINER_A, 40000)


def test_signed_hotkey_is_display_only_when_the_signature_is_genuine(alice, bob):
    assert _verify(dict(_published(alice), signed_hotkey=bob.ss58_address), alice).epoch_index == IDX
    wire = _published(alice)
    del wire["signed_hotkey"]
    assert _verify(wire, alice).epoch_index == IDX


def test_numbers_the_public_validator_compares_with_equals_may_be_integral_floats(alice):
    wire = dict(_forge(alice, _inner(netuid=53.0, epoch_index=12.0)), v=1.0, netuid=53.0)
    assert _verify(wire, alice).weights == ((MINER_A, 65535),)


def test_an_upper_case_signature_verifies(alice):
    wire = _published(alice)
    assert _verify(dict(wire, signature=wire["signature"].upper()), alice).epoch_index == IDX


def test_a_payload_exactly_at_the_cap_is_accepted_and_one_byte_more_is_not(alice):
    body = encode_payload(_published(alice))
    cap = len(body) + 10
    padded = body + b" " * 10
    assert _verify(padded, alice, max_bytes=cap).epoch_index == IDX
    assert _refusal(padded + b" ", alice, max_bytes=cap).reason == "too-large"


def test_an_old_epoch_still_verifies_replay_is_the_schedulers_to_refuse(alice):
    wire = _forge(alice, _inner(epoch_index=3), epoch_index=3)
    assert _verify(wire, alice).epoch_index == 3


# --- every refusal ---------------------------------------------------------------------------


def test_oversize_is_refused_before_parsing(alice):
    error = _refusal(b"{" * (MAX_PAYLOAD_BYTES + 1), alice)
    assert error.reason == "too-large" and str(MAX_PAYLOAD_BYTES) in error.detail


@pytest.mark.parametrize("raw", [b"", b"{not json", b"\xff\xfe\x00junk", b"[" * 100_000, b'{"v": 1,}'])
def test_malformed_json_is_refused(alice, raw):
    assert _refusal(raw, alice).reason == "not-json"


@pytest.mark.parametrize("payload", [[1, 2], "nope", 5, None])
def test_a_payload_that_is_not_an_object_is_malformed(alice, payload):
    assert _refusal(payload, alice).reason == "malformed"


@pytest.mark.parametrize("version", [2, 0, "1", True, None, 1.5])
def test_any_version_but_one_is_refused(alice, version):
    wire = _published(alice)
    error = _refusal(dict(wire, v=version), alice)
    assert error.reason == "version"


@pytest.mark.parametrize("netuid", [54, "53", True, None])
def test_an_envelope_for_another_subnet_is_refused(alice, netuid):
    assert _refusal(dict(_published(alice), netuid=netuid), alice).reason == "netuid"


def test_verifying_for_another_subnet_is_refused(alice):
    assert _refusal(_published(alice), alice, netuid=54).reason == "netuid"


@pytest.mark.parametrize("result_json", [None, 12345, ["x"]])
def test_a_result_json_that_is_not_a_string_is_malformed(alice, result_json):
    assert _refusal(dict(_published(alice), result_json=result_json), alice).reason == "malformed"


def test_a_lone_surrogate_in_result_json_is_malformed_not_a_crash(alice):
    raw = encode_payload(_published(alice)).replace(b'"result_json":"{', b'"result_json":"\\ud800{')
    assert _refusal(raw, alice).reason == "malformed"


def test_tampered_result_json_is_refused_by_the_digest(alice):
    wire = _published(alice)
    tampered = wire["result_json"].replace("40000", "40001")
    error = _refusal(dict(wire, result_json=tampered), alice)
    assert error.reason == "digest" and wire["digest"] in error.detail


def test_a_tampered_digest_is_refused(alice):
    wire = _published(alice)
    assert _refusal(dict(wire, digest="0" * 64), alice).reason == "digest"
    assert _refusal(dict(wire, digest=wire["digest"].upper()), alice).reason == "digest"
    del wire["digest"]
    assert _refusal(wire, alice).reason == "digest"


def test_tampering_result_json_and_digest_together_is_refused_by_the_signature(alice):
    wire = _published(alice)
    tampered = wire["result_json"].replace("40000", "40001")
    wire.update(result_json=tampered, digest=hashlib.sha256(tampered.encode()).hexdigest())
    assert _refusal(wire, alice).reason == "signature"


@pytest.mark.parametrize("epoch_index", [12.0, True, "12", None, -1])
def test_an_envelope_epoch_index_that_is_not_a_plain_integer_is_refused(alice, epoch_index):
    assert _refusal(dict(_published(alice), epoch_index=epoch_index), alice).reason == "epoch-index"


def test_a_signature_by_another_key_is_refused(alice, bob):
    wire = _forge(bob, _inner(), signed_hotkey=alice.ss58_address)
    error = _refusal(wire, alice)
    assert error.reason == "signature" and alice.ss58_address in error.detail


def test_a_wrong_pinned_master_is_named(alice, bob):
    error = _refusal(_published(alice), bob)
    assert error.reason == "wrong-signer"
    assert alice.ss58_address in error.detail and bob.ss58_address in error.detail


@pytest.mark.parametrize("signature", ["", "00" * 64, "zz" * 64, "00", None, 7])
def test_a_malformed_or_false_signature_is_refused(alice, signature):
    assert _refusal(dict(_published(alice), signature=signature), alice).reason == "signature"


def test_a_missing_signature_is_refused(alice):
    wire = _published(alice)
    del wire["signature"]
    assert _refusal(wire, alice).reason == "signature"


def test_a_signature_over_the_polkadot_wrapped_message_is_refused(alice):
    wire = _published(alice)
    wrapped = b"<Bytes>" + keys.epoch_message(NETUID, IDX, wire["digest"]) + b"</Bytes>"
    assert _refusal(dict(wire, signature=bytes(alice.sign(wrapped)).hex()), alice).reason == "signature"


def test_a_signature_for_another_epoch_is_refused(alice):
    wire = _published(alice)
    assert _refusal(dict(wire, epoch_index=IDX + 1), alice).reason == "signature"


def test_a_signed_result_json_that_is_not_json_is_refused(alice):
    assert _refusal(_forge(alice, "{oops"), alice).reason == "not-json"


def test_a_signed_result_json_that_is_not_an_object_is_malformed(alice):
    assert _refusal(_forge(alice, "[1,2]"), alice).reason == "malformed"


def test_a_signed_result_json_for_another_subnet_is_refused(alice):
    error = _refusal(_forge(alice, _inner(netuid=99)), alice)
    assert error.reason == "netuid" and "result_json.netuid" in error.detail


@pytest.mark.parametrize("inner_index", [IDX + 1, None, True, "12"])
def test_a_signed_result_json_for_another_epoch_is_refused(alice, inner_index):
    assert _refusal(_forge(alice, _inner(epoch_index=inner_index)), alice).reason == "epoch-index"


@pytest.mark.parametrize(
    ("weights", "detail"),
    [
        ([[MINER_A, -1]], "[0][1] must be an integer 0..65535"),
        ([[MINER_A, 65536]], "[0][1] must be an integer 0..65535"),
        ([[MINER_A, 65535.0]], "[0][1] must be an integer 0..65535"),
        ([[MINER_A, True]], "[0][1] must be an integer 0..65535"),
        ([[MINER_A, "1"]], "[0][1] must be an integer 0..65535"),
        ([[MINER_A, 1], [MINER_A, 2]], "appears more than once"),
        ([[MINER_A, 0], [MINER_B, 0]], "no positive weight"),
        ([], "no positive weight"),
        (None, "must be a list"),
        ("nope", "must be a list"),
        ([[MINER_A, 1], "not-a-pair"], "[1] must be a [hotkey, weight] pair"),
        ([[MINER_A, 1, 2]], "[0] must be a [hotkey, weight] pair"),
        ([[7, 1]], "[0][0] must be an ss58 hotkey"),
        ([["5Aa a", 1]], "[0][0] must be an ss58 hotkey"),
        ([["", 1]], "[0][0] must be an ss58 hotkey"),
    ],
)
def test_a_bad_signed_weight_vector_is_refused(alice, weights, detail):
    error = _refusal(_forge(alice, _inner(weights=weights)), alice)
    assert error.reason == "weights" and detail in error.detail


def test_zero_weights_beside_a_positive_one_are_allowed(alice):
    wire = _forge(alice, _inner(weights=[[MINER_A, 0], [MINER_B, 65535]]))
    assert _verify(wire, alice).weights == ((MINER_A, 0), (MINER_B, 65535))


def test_the_callers_own_mistakes_raise_type_errors(alice):
    with pytest.raises(TypeError):
        parse_and_verify("{}", master_hotkey=alice.ss58_address, netuid=NETUID)
    with pytest.raises(TypeError):
        parse_and_verify(b"{}", master_hotkey=None, netuid=NETUID)
    with pytest.raises(TypeError):
        parse_and_verify(b"{}", master_hotkey=alice.ss58_address, netuid="53")


def test_the_error_message_carries_the_reason_and_the_detail(alice):
    error = _refusal(dict(_published(alice), v=2), alice)
    assert str(error) == "version: v must be 1, got 2"


def test_importing_the_module_does_not_import_bittensor():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    code = "import engy_node.protocol.epoch, sys; assert 'bittensor' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


# --- properties ------------------------------------------------------------------------------

hotkeys = st.text(alphabet=BASE58, min_size=1, max_size=48)
weight_vectors = st.lists(
    st.tuples(hotkeys, st.integers(0, 65535)), min_size=1, max_size=8, unique_by=lambda pair: pair[0]
).filter(lambda pairs: sum(weight for _, weight in pairs) > 0)
scalars = st.one_of(st.none(), st.integers(JSON_INT_MIN, JSON_INT_MAX), st.text(max_size=12))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10,
)
rows = st.lists(st.dictionaries(st.text(max_size=10), scalars, max_size=6), max_size=4)
extras = st.dictionaries(st.text(max_size=10).filter(lambda key: key not in RESERVED_KEYS), values, max_size=4)


@settings(deadline=None, max_examples=60)
@given(weights=weight_vectors, rows=rows, extra=extras, netuid=st.integers(0, 65535), epoch_index=st.integers(0, 2**40))
def test_any_settlement_round_trips_through_sign_and_verify(alice, weights, rows, extra, netuid, epoch_index):
    settlement_json = {"weights": [list(pair) for pair in weights], "rows": rows}
    result_json = build_result_json(
        netuid=netuid, epoch_index=epoch_index, settlement_json=settlement_json, extra=extra
    )
    wire = sign_epoch(alice, netuid=netuid, epoch_index=epoch_index, result_json=result_json)
    verified = parse_and_verify(encode_payload(wire), master_hotkey=alice.ss58_address, netuid=netuid)
    assert verified.weights == tuple(weights)
    assert verified.result_json == result_json
    assert verified.result == {**extra, **settlement_json, "netuid": netuid, "epoch_index": epoch_index}
    # Rebuilding from the parsed result gives the same bytes: the encoding is a function of
    # the content alone.
    again = {key: value for key, value in verified.result.items() if key not in ("netuid", "epoch_index")}
    assert build_result_json(netuid=netuid, epoch_index=epoch_index, settlement_json=again) == result_json


@given(weights=weight_vectors, data=st.data())
def test_the_digest_changes_when_any_weight_changes(weights, data):
    position = data.draw(st.integers(0, len(weights) - 1))
    hotkey, old = weights[position]
    new = data.draw(st.integers(0, 65535).filter(lambda weight: weight != old))
    changed = [*weights[:position], (hotkey, new), *weights[position + 1 :]]
    assume(sum(weight for _, weight in changed) > 0)

    def digest(vector):
        return keys.epoch_digest(
            build_result_json(netuid=NETUID, epoch_index=IDX, settlement_json={"weights": vector, "rows": []})
        )

    assert digest(changed) != digest(weights)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_the_payload_error(raw):
    from bittensor.sp_core import Keypair

    master = Keypair.create_from_uri("//Alice").ss58_address
    with pytest.raises(EpochPayloadError):
        parse_and_verify(raw, master_hotkey=master, netuid=NETUID)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
ENVELOPE_KEYS = ("v", "netuid", "epoch_index", "digest", "result_json", "signature", "signed_hotkey", "weights")


@settings(deadline=None)
@given(key=st.sampled_from(ENVELOPE_KEYS), value=json_values)
def test_replacing_any_envelope_field_refuses_or_changes_nothing(alice, key, value):
    wire = _published(alice)
    genuine = _verify(wire, alice)
    try:
        verified = _verify(dict(wire, **{key: value}), alice)
    except EpochPayloadError as error:
        assert error.reason in REASONS
    else:
        # Only the display fields, or a value equal to the genuine one, may pass.
        assert key in ("weights", "signed_hotkey") or value == wire[key]
        assert verified == genuine
