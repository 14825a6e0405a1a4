"""Reading a buyer's request body within what one gateway process may hold of bodies at once.

Each body is capped in size (`max_body_bytes`) and time (`body_timeout_s`), but those bound one
request: 60 slow uploads of 8 MB from one key held 518 MB of a process (issue 33). So the bytes
of the bodies being received are counted as they arrive, all requests together and per buyer
account (its keys together), and the chunk that would take either past its cap
(`body_bytes_in_flight`, `body_bytes_in_flight_per_account`) ends that request at once:

* per account: 429 with Retry-After, since it is that buyer's own uploads that fill its share;
  the others' are untouched;
* all together: 503 (529 on /v1/messages) with Retry-After, the gateway being busy.

A body's bytes count until it has been read and parsed; the parsed request that lives on is the
request's, like its tokens, and not counted here. The answer to a refused upload closes the
connection and says so (`Connection: close`, `hypercorn_edges`): the rest of the body is never
read. Counting is a few integer additions per chunk, and most bodies come in one.
"""

from __future__ import annotations

from typing import Any, Literal

from engy_node.asgi import BodyError, Receive, read_json_object
from engy_node.gateway.api.chat import GatewayError
from engy_node.metrics import Registry

BODY_RETRY_AFTER_S = 1
"""Retry-After on a body refused for room: uploads in flight finish or time out within
`body_timeout_s`, most within a second."""

Refusal = Literal["account", "total"]


def body_room(*, total: int, account: int, more: int, total_cap: int, account_cap: int) -> Refusal | None:
    """Whether `more` bytes of an account's body may be taken while `total` bytes of bodies are
    being received, `account` of them the account's: None if so, else the cap it would pass
    (the account's first: then it is that buyer, not the gateway, that is full)."""
    if account + more > account_cap:
        return "account"
    if total + more > total_cap:
        return "total"
    return None


class BodyBudget:
    """The bytes of request bodies this process is receiving, all together and per account; the
    total is the gauge `engy_gateway_body_bytes_receiving`."""

    def __init__(self, *, total_cap: int, account_cap: int, registry: Registry) -> None:
        self.total_cap = total_cap
        self.account_cap = account_cap
        self.total = 0
        self.by_account: dict[int, int] = {}
        self._gauge = registry.gauge(
            "engy_gateway_body_bytes_receiving", "Bytes of buyer request bodies being received (this process)."
        )

    def take(self, account_id: int, more: int) -> None:
        """Count `more` bytes of the account's body, or refuse them (and count nothing).

        Raises:
            GatewayError: 429 when the account's share is full, 503 when the process's is.
        """
        held = self.by_account.get(account_id, 0)
        refusal = body_room(
            total=self.total, account=held, more=more, total_cap=self.total_cap, account_cap=self.account_cap
        )
        if refusal == "account":
            raise GatewayError(
                "rate_limit",
                f"this account is already uploading {held} bytes of request bodies to this gateway process, "
                f"and {self.account_cap} at once is its limit; send fewer large requests at once, or wait "
                "for the ones in flight",
                retry_after_s=BODY_RETRY_AFTER_S,
            )
        if refusal == "total":
            raise GatewayError(
                "overloaded",
                f"the gateway is receiving {self.total} bytes of request bodies, its limit for uploads at once; "
                "retry shortly",
                retry_after_s=BODY_RETRY_AFTER_S,
            )
        self.total += more
        self.by_account[account_id] = held + more
        self._gauge.set(self.total)

    def give_back(self, account_id: int, taken: int) -> None:
        """Uncount `taken` bytes of the account's, as `take` counted them."""
        self.total -= taken
        left = self.by_account[account_id] - taken
        if left:
            self.by_account[account_id] = left
        else:
            del self.by_account[account_id]
        self._gauge.set(self.total)


async def read_body(
    receive: Receive, account_id: int, budget: BodyBudget, *, max_bytes: int, timeout_s: float
) -> dict[str, Any]:
    """The body as a JSON object (`asgi.read_json_object`), its bytes counted in `budget` while
    it arrives, and every refusal a `GatewayError` that says what to do."""
    taken = 0

    def take(more: int) -> None:
        nonlocal taken
        budget.take(account_id, more)
        taken += more

    try:
        return await read_json_object(receive, max_bytes=max_bytes, timeout_s=timeout_s, on_chunk=take)
    except BodyError as error:
        if error.status == 408:
            raise GatewayError(
                "request_timeout",
                f"the request body did not arrive within {timeout_s:g} s; send it in one go, or check the client's network",
            ) from None
        raise GatewayError("request_too_large" if error.status == 413 else "invalid_request", str(error)) from None
    finally:
        if taken:
            budget.give_back(account_id, taken)
