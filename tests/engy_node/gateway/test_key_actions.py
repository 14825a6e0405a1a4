"""The key actions of the control API (`gateway.key_actions`), through the real control app: what
`engy-node gateway key …` does, as JSON, with refusals answered 400 naming the fix."""

from __future__ import annotations

import functools

import httpx
import pytest

from engy_node.control import Actions, serve_control
from engy_node.gateway.key_actions import register_key_actions
from engy_node.gateway.store import Store
from engy_node.hub import Hub


@pytest.fixture
async def control(nursery, tmp_path):
    location = tmp_path / "gateway.sqlite3"
    with Store.open(location) as store:
        account, _ = store.create_buyer("team")
    actions = Actions()
    register_key_actions(actions, location)
    endpoint = await nursery.start(
        functools.partial(serve_control, Hub(), data_dir=tmp_path / "data", actions=actions, node_info={"version": "t"})
    )
    token = endpoint.token_file.read_text().strip()
    async with httpx.AsyncClient(
        base_url=endpoint.url, headers={"authorization": f"Bearer {token}"}, timeout=30, trust_env=False
    ) as client:
        yield client, location, account


async def test_a_key_is_created_listed_limited_rotated_and_revoked_through_the_control_api(control):
    client, location, account = control

    async def act(action: str, **params):
        response = await client.post(f"/v1/actions/{action}", json=params)
        return response.status_code, response.json()

    status, created = await act("gateway-key-create", account=account, name="ci", expires="30", models=["m1"])
    assert status == 200 and created["result"]["key"].startswith("engy-sk-")
    key_id = created["result"]["key_id"]
    status, limited = await act("gateway-key-set-limits", key_id=key_id, rpm=60, daily_usd="2.5")
    assert status == 200 and limited["result"]["limits"]["daily_micro"] == 2_500_000
    status, defaults = await act("gateway-account-set-limits", account=account, concurrent=4)
    assert status == 200 and defaults["result"]["limits"]["concurrent"] == 4
    status, listed = await act("gateway-key-list", account=account)
    keys = {key["key_id"]: key for key in listed["result"]["keys"]}
    assert keys[key_id]["models"] == ["m1"] and keys[key_id]["limits"]["rpm"] == 60 and keys[key_id]["active"]
    assert created["result"]["key"] not in str(listed) and listed["result"]["account_limits"]["concurrent"] == 4
    status, updated = await act("gateway-key-update", key_id=key_id, expires="never", models=["m1", "m2"])
    assert status == 200 and (updated["result"]["expires_at"], updated["result"]["models"]) == (None, ["m1", "m2"])
    status, updated = await act("gateway-key-update", key_id=key_id, models="all")
    assert status == 200 and updated["result"]["models"] is None and updated["result"]["expires_at"] is None
    status, rotated = await act("gateway-key-rotate", key_id=key_id)
    assert status == 200 and rotated["result"]["revoked_key_id"] == key_id
    status, revoked = await act("gateway-key-revoke", key_id=rotated["result"]["key_id"])
    assert status == 200 and "revoked" in revoked["result"]["text"]
    with Store.open(location) as store:
        assert store.authenticate(rotated["result"]["key"]) is None


@pytest.mark.parametrize(
    ("action", "params", "fix"),
    [
        ("gateway-key-create", {"account": 1}, '"name"'),
        ("gateway-key-create", {"account": 99, "name": "x"}, "no buyer account 99"),
        ("gateway-key-revoke", {"key_id": 99}, "key list"),
        ("gateway-key-set-limits", {"key_id": 1, "burst": 3}, "the limits are"),
        ("gateway-key-set-limits", {"key_id": 1, "rpm": "many"}, "--rpm"),
        ("gateway-key-list", {}, '"account"'),
        ("gateway-key-update", {"key_id": 1}, "expires, models or both"),
        ("gateway-key-update", {"key_id": 1, "name": "x"}, "unknown: name"),
        ("gateway-key-update", {"key_id": 1, "expires": "2020-01-01"}, "already past"),
        ("gateway-key-update", {"key_id": 1, "models": []}, '"all"'),
        ("gateway-key-update", {"key_id": 99, "models": "all"}, "no unrevoked API key 99"),
    ],
)
async def test_a_refused_key_action_answers_400_naming_the_fix(control, action, params, fix):
    client, _, _ = control
    response = await client.post(f"/v1/actions/{action}", json=params)
    assert response.status_code == 400 and fix in response.json()["error"]["message"]
