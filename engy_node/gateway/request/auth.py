"""Who a buyer request is from: its API key looked up in the store, and cached per process.

Looking a key up is a store operation, as dear as a hold; each gateway process therefore
remembers who a valid key belongs to for `AUTH_CACHE_TTL_S`. The cache is not what stands
between a revoked key and the buyer's money: the hold every paid request makes requires the
key to be unrevoked in the same UPDATE that reserves the money (`Ledger.hold`'s `key_id`), on
the database every worker and host shares. A revocation (`engy-node gateway revoke-key`)
therefore takes effect on the key's next request everywhere, at no statement of its own, and
the refused hold drops the key from this process's cache (`KeyCache.forget`). A request that
makes no hold (counting tokens) looks its key up every time (`cached=False`).

The same hold counts the request against the key's limits and checks its expiry and allowed
models (`store.key_limits`); `KeyCache.hold` turns a refusal into the buyer's 401, 403 or 429
with `Retry-After` and the rate-limit headers (`gateway.limits.response_headers`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from engy_node.gateway import limits
from engy_node.gateway.api.chat import ApiName, GatewayError
from engy_node.gateway.store import Account, Hold, KeyRefused, KeyRevoked, Store

AUTH_CACHE_TTL_S = 30.0
"""How long a process takes a valid key's account from its cache. Unknown keys are never cached,
so guessing cannot fill memory."""
AUTH_CACHE_MAX_ENTRIES = 100_000
REVOKED_KEY = "this API key has been revoked; ask the gateway's operator for a new one"
MISSING_KEY: dict[ApiName, str] = {
    "openai": "missing API key: send it as Authorization: Bearer <key>",
    "anthropic": "missing API key: send it as x-api-key: <key>",
}
"""In each API's own terms: the header its SDKs send (the Anthropic routes take a bearer token too)."""


class KeyCache:
    """The accounts of the API keys this process has seen lately, by the keys' sha256."""

    def __init__(self, store: Store, monotonic: Callable[[], float]) -> None:
        self.store = store
        self.monotonic = monotonic
        self._accounts: dict[bytes, tuple[Account, float]] = {}

    async def authenticate(self, api_key: str | None, api: ApiName, *, cached: bool = True) -> Account:
        """The account `api_key` (sent to `api`'s routes) belongs to, from the cache unless
        `cached` is False.

        Raises:
            GatewayError: no key (401), or one the store does not know or has revoked.
        """
        if not api_key:
            raise GatewayError("authentication", MISSING_KEY[api])
        digest = hashlib.sha256(api_key.encode()).digest()
        entry = self._accounts.get(digest) if cached else None
        now = self.monotonic()
        if entry is not None and entry[1] > now:
            return entry[0]
        try:
            account = await self.store.run(self.store.authenticate, api_key)
        except KeyRefused as refused:  # expired
            raise GatewayError("authentication", refused.message) from None
        if account is None:
            raise GatewayError("authentication", "invalid API key")
        if len(self._accounts) >= AUTH_CACHE_MAX_ENTRIES:
            self._accounts.clear()
        self._accounts[digest] = (account, now + AUTH_CACHE_TTL_S)
        return account

    async def hold(
        self, account: Account, api: ApiName, *, model: str, amount: int, request_id: str, tokens: int
    ) -> Hold | None:
        """`Store.hold` for a request with `account`'s key: its balance, and the key's state and
        limits (`store.key_limits`) in the same transaction; None when the balance is short.

        Raises:
            GatewayError: the key is revoked or expired (401), may not use `model` (403), or is
                over a limit (429, `refused`).
        """
        try:
            return await self.store.run(
                self.store.hold,
                account.account_id,
                amount=amount,
                request_id=request_id,
                key_id=account.key_id,
                model=model,
                tokens=tokens,
            )
        except KeyRevoked:
            self.forget(account)
            raise GatewayError("authentication", REVOKED_KEY) from None
        except KeyRefused as refused:
            raise self._refused(account, refused, api) from None

    def _refused(self, account: Account, refused: KeyRefused, api: ApiName) -> GatewayError:
        """The buyer's error for a hold its key was refused (`store.key_limits`): 401 for an
        expired key, 403 for a model it may not use (both dropped from the cache), 429 with
        `Retry-After` and the rate-limit headers for a limit."""
        if refused.kind in ("authentication", "permission"):
            # Expired, or its models changed (`key update`): the next request reads the key afresh.
            self.forget(account)
        if refused.refusal is None:
            return GatewayError("permission" if refused.kind == "permission" else "authentication", refused.message)
        return GatewayError(
            "rate_limit",
            refused.message,
            retry_after_s=refused.refusal.retry_after_s,
            headers=dict(limits.response_headers(refused.refusal.view, api)),
        )

    def forget(self, account: Account) -> None:
        """Drop the key `account` was authenticated by (its hold found it revoked)."""
        self._accounts = {digest: entry for digest, entry in self._accounts.items() if entry[0] != account}
