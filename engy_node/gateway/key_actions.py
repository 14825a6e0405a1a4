"""Keys a team manages, through the node's control API: the `engy-node gateway key …` and
`account set-limits` commands as actions (`POST /v1/actions/gateway-key-create` and the rest,
docs/control-api.md), registered when the node runs the gateway role.

Each action opens the gateway's store for its one operation, in a worker thread, as the CLI
does (a store of its own, so it shares nothing with the request path but the database), and
answers JSON: the same fields the CLI prints, a key's secret only from `create` and `rotate`.
A request it refuses (an unknown account or key, a bad limit) is a `ControlError`: 400 with the
message naming the fix.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from engy_node.control import Actions, ControlError
from engy_node.errors import EngyError
from engy_node.gateway import key_admin
from engy_node.gateway.store import KeyInfo, Store
from engy_node.gateway.store.key_limits import UNCHANGED, Unchanged, expiry_from

LIMIT_PARAMS = ("rpm", "tpm", "concurrent", "daily_usd", "monthly_usd")
"""The limits an action's parameters may set, named as the CLI's flags (`daily_usd` in dollars,
as text or a number; null clears one)."""


def _integer(params: dict[str, Any], name: str) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ControlError(f'send {{"{name}": N}} with N the number `engy-node gateway key list` shows; got {value!r}')
    return value


def _limit_values(params: dict[str, Any]) -> dict[str, str | None]:
    unknown = sorted(set(params) - set(LIMIT_PARAMS) - {"key_id", "account"})
    if unknown:
        raise ControlError(f"unknown parameters {', '.join(unknown)}; the limits are {', '.join(LIMIT_PARAMS)}")
    return {name: ("none" if params[name] is None else str(params[name])) for name in LIMIT_PARAMS if name in params}


def _models_change(value: Any) -> tuple[str, ...] | None:
    """`models` as an action takes it: a list of model ids, or `"all"` / null for every model."""
    if value is None:
        return None
    if isinstance(value, str):
        return key_admin.models_change(value)
    if isinstance(value, list) and value and all(isinstance(m, str) and m.strip() for m in value):
        return tuple(m.strip() for m in value)
    raise ControlError('"models" is a list of model ids, e.g. ["smollm2-135m"], or "all"')


def _key(info: KeyInfo, now: float) -> dict[str, Any]:
    return {
        "key_id": info.key_id,
        "name": info.name,
        "hint": info.hint,
        "created_at": info.created_at,
        "expires_at": info.expires_at,
        "revoked_at": info.revoked_at,
        "active": info.revoked_at is None and (info.expires_at is None or info.expires_at > now),
        "models": None if info.models is None else list(info.models),
        "limits": dataclasses.asdict(info.limits),
    }


def register_key_actions(actions: Actions, location: str | os.PathLike[str]) -> None:
    """Register the key actions for the gateway whose store is at `location`."""

    async def on_store(work: Callable[[Store], dict[str, Any]]) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            with Store.open(location) as store:
                try:
                    return work(store)
                except EngyError as refused:
                    raise ControlError(str(refused)) from None
                except ValueError as refused:  # the store's own checks (a name, a limit)
                    raise ControlError(str(refused)) from None

        return await trio.to_thread.run_sync(run)

    async def create(params: dict[str, Any]) -> dict[str, Any]:
        account = _integer(params, "account")
        name, expires, models = params.get("name"), params.get("expires"), params.get("models")
        if not isinstance(name, str) or not name.strip():
            raise ControlError('send {"account": N, "name": "what the key is for"} (and "expires", "models")')
        if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
            raise ControlError('"models" is a list of model ids, e.g. ["smollm2-135m"]')
        now = time.time()
        try:
            expires_at = None if expires is None else expiry_from(str(expires), now)
        except ValueError as error:
            raise ControlError(str(error)) from None

        def work(store: Store) -> dict[str, Any]:
            key_id, key = store.create_key(
                account, name=name, expires_at=expires_at, models=None if models is None else tuple(models)
            )
            return {"key_id": key_id, "key": key, "expires_at": expires_at, "note": key_admin.SHOWN_ONCE}

        return await on_store(work)

    async def listing(params: dict[str, Any]) -> dict[str, Any]:
        account = _integer(params, "account")
        now = time.time()
        return await on_store(
            lambda store: {
                "keys": [_key(info, now) for info in store.list_keys(account)],
                "account_limits": dataclasses.asdict(store.account_limits(account)),
            }
        )

    async def update(params: dict[str, Any]) -> dict[str, Any]:
        key_id = _integer(params, "key_id")
        unknown = sorted(set(params) - {"key_id", "expires", "models"})
        if unknown or not {"expires", "models"} & set(params):
            raise ControlError(
                'send {"key_id": N, "expires": "ISO date" | days | "never" | null, "models": ["id", …] | "all" | null} '
                f"with expires, models or both{'' if not unknown else '; unknown: ' + ', '.join(unknown)}"
            )
        now = time.time()
        try:
            expires_at: float | None | Unchanged = UNCHANGED
            if "expires" in params:
                expires = params["expires"]
                expires_at = None if expires is None else key_admin.expiry_change(str(expires), now)
            models: tuple[str, ...] | None | Unchanged = UNCHANGED
            if "models" in params:
                models = _models_change(params["models"])
        except EngyError as error:
            raise ControlError(str(error)) from None
        return await on_store(
            lambda store: _key(store.update_key(key_id, expires_at=expires_at, models=models), time.time())
        )

    async def rotate(params: dict[str, Any]) -> dict[str, Any]:
        key_id = _integer(params, "key_id")

        def work(store: Store) -> dict[str, Any]:
            new_id, key = store.rotate_key(key_id)
            return {"revoked_key_id": key_id, "key_id": new_id, "key": key, "note": key_admin.SHOWN_ONCE}

        return await on_store(work)

    async def revoke(params: dict[str, Any]) -> dict[str, Any]:
        key_id = _integer(params, "key_id")
        return await on_store(lambda store: {"text": key_admin.revoke_key_id(store, key_id=key_id)})

    async def key_limits(params: dict[str, Any]) -> dict[str, Any]:
        key_id, values = _integer(params, "key_id"), _limit_values(params)
        return await on_store(
            lambda store: {"limits": dataclasses.asdict(store.set_key_limits(key_id, key_admin.parse_limits(values)))}
        )

    async def account_limits(params: dict[str, Any]) -> dict[str, Any]:
        account, values = _integer(params, "account"), _limit_values(params)
        return await on_store(
            lambda store: {
                "limits": dataclasses.asdict(store.set_account_limits(account, key_admin.parse_limits(values)))
            }
        )

    actions.register("gateway-key-create", 'create a named API key: {"account", "name", "expires"?, "models"?}', create)
    actions.register("gateway-key-list", 'an account\'s API keys, masked, and its default limits: {"account"}', listing)
    actions.register(
        "gateway-key-update",
        'change an API key\'s expiry or models: {"key_id", "expires"? (ISO, days, "never"), "models"? (list, "all")}',
        update,
    )
    actions.register("gateway-key-rotate", 'a new secret for a key, the old one revoked: {"key_id"}', rotate)
    actions.register("gateway-key-revoke", 'revoke an API key: {"key_id"}', revoke)
    actions.register(
        "gateway-key-set-limits",
        'set or clear (null) a key\'s limits: {"key_id", "rpm"?, "tpm"?, "concurrent"?, "daily_usd"?, "monthly_usd"?}',
        key_limits,
    )
    actions.register(
        "gateway-account-set-limits",
        'set or clear (null) an account\'s default limits: {"account", "rpm"?, …}',
        account_limits,
    )
