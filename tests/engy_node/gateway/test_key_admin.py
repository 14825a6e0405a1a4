"""`engy-node gateway key …` and `gateway account set-limits`, as an operator types them (a real
subprocess on a temp home), and the parsing of what they type."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from engy_node.gateway.admin import AdminError
from engy_node.gateway.key_admin import expiry_change, models_change, parse_limits, parse_models
from engy_node.gateway.store import Store


def cli(home, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(home), "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode == 0) == ok, result.stderr
    return result


def test_a_team_creates_lists_limits_rotates_and_revokes_keys(tmp_path):
    cli(tmp_path, "create-buyer", "team")
    created = cli(tmp_path, "key", "create", "1", "--name", "ci", "--expires", "30", "--models", "m1,m2").stdout
    key = re.search(r"engy-sk-\S+", created)[0]
    assert "API key 2 (ci)" in created and "models: m1, m2" in created and "shown once" in created
    assert "60 rpm, $5.000000/day" in cli(tmp_path, "key", "set-limits", "2", "--rpm", "60", "--daily-usd", "5").stdout
    assert "4 at once" in cli(tmp_path, "account", "set-limits", "1", "--concurrent", "4").stdout
    listed = cli(tmp_path, "key", "list", "1").stdout
    assert key not in listed and f"{key[:12]}…{key[-4:]}" in listed
    assert "m1,m2" in listed and "active until" in listed and "default limits" in listed and "4 at once" in listed
    rotated = cli(tmp_path, "key", "rotate", "2").stdout
    new_key = re.search(r"engy-sk-\S+", rotated)[0]
    assert "replaced by key 3" in rotated
    assert "revoked" in cli(tmp_path, "key", "revoke", "1").stdout
    assert "no unrevoked API key 1" in cli(tmp_path, "key", "revoke", "1", ok=False).stderr
    assert "give at least one limit" in cli(tmp_path, "key", "set-limits", "3", ok=False).stderr
    updated = cli(tmp_path, "key", "update", "3", "--expires", "never", "--models", "all").stdout
    assert "API key 3 (ci): expires never; models: all" in updated and "next request" in updated
    assert "--expires ISO|DAYS|never" in cli(tmp_path, "key", "update", "3", ok=False).stderr
    assert "no unrevoked API key 2" in cli(tmp_path, "key", "update", "2", "--models", "m1", ok=False).stderr
    with Store.open(tmp_path / "data" / "gateway.sqlite3") as store:
        assert store.authenticate(key) is None
        new = store.authenticate(new_key)
        infos = {info.key_id: info for info in store.list_keys(1)}
        assert new.key_id == 3 and infos[3].limits.rpm == 60 and infos[3].models is None
        assert infos[3].expires_at is None and infos[2].models == ("m1", "m2")
        assert infos[1].revoked_at is not None and infos[2].revoked_at is not None
    # The older commands still work beside them.
    assert "engy-sk-" in cli(tmp_path, "issue-key", "1").stdout


def test_an_update_typed_by_a_person_is_parsed_or_refused_naming_the_form():
    assert expiry_change("never", 1000.0) is None and expiry_change(" Never ", 1000.0) is None
    assert expiry_change("1", 1000.0) == 1000.0 + 86_400
    assert expiry_change("2027-01-01", 0.0) == 1798761600.0
    with pytest.raises(AdminError, match="already past.*key revoke"):
        expiry_change("2020-01-01", 1798761600.0)
    with pytest.raises(AdminError, match="or never"):
        expiry_change("soon", 0.0)
    assert models_change("all") is None and models_change("a, b") == ("a", "b")
    with pytest.raises(AdminError, match="or all"):
        models_change(" , ")


def test_limits_typed_by_a_person_are_parsed_exactly_or_refused_naming_the_flag():
    assert parse_limits({"rpm": "10", "daily_usd": "0.10", "monthly_usd": "none", "tpm": None}) == {
        "rpm": 10,
        "daily_micro": 100_000,
        "monthly_micro": None,
    }
    assert parse_limits({"daily_usd": "0"}) == {"daily_micro": 0}
    with pytest.raises(AdminError, match="--concurrent"):
        parse_limits({"concurrent": "-3"})
    with pytest.raises(AdminError, match="decimal places"):
        parse_limits({"daily_usd": "0.0000001"})
    assert parse_models(" a, b ,") == ("a", "b") and parse_models("") is None
