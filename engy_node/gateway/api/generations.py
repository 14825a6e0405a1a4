"""What a buyer reads back about its own requests: `GET /v1/generation?id=…` (one request) and
`GET /v1/usage` (its usage per key, day and model), docs/billing.md "Costs, generations and usage".

Both are read from the request log (metadata only, docs/reliability.md "Data": no prompt or
completion text is there to leak), the verdicts and the ledger, and both answer only about the
account of the key that asks: a generation of another account is a 404, the same answer as an
id that never existed, so an id tells a stranger nothing. Keys are looked up in the store on
every call (not the 30 s cache), as for token counting: these routes make no hold, which is
where a revoked key meets its refusal on a chat route. Errors are in OpenAI's dialect; a key
may come as `Authorization: Bearer` or `x-api-key`.

The documents are built by pure functions (`generation_body`, `billing.usage`); the handlers
only authenticate, read and answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engy_node.gateway.api.chat import GatewayError
from engy_node.gateway.billing import usage
from engy_node.gateway.billing.costs import cost_number, cost_usd
from engy_node.gateway.request.relay import ANTHROPIC, OPENAI
from engy_node.gateway.store import RequestLogEntry, VerdictRecord
from engy_node.gateway.store.checks import identifier

if TYPE_CHECKING:
    from engy_node.gateway.request.lifecycle import Gateway

ID_PREFIXES = ("chatcmpl-", "msg_")
"""What the two APIs put before the request id in a body's `id`; a lookup takes either form."""

MAX_USAGE_WINDOW_S = 366 * 86_400
"""The longest window one usage call reads (its rows are summed in memory): a year."""


def request_id_of(generation_id: str) -> str | None:
    """The gateway's request id in a body `id` (`chatcmpl-…`, `msg_…`) or an `x-request-id`;
    None when it cannot be one."""
    for prefix in ID_PREFIXES:
        if generation_id.startswith(prefix):
            generation_id = generation_id[len(prefix) :]
            break
    try:
        return identifier("id", generation_id)
    except ValueError:
        return None


def verification(rows: list[RequestLogEntry], verdict: VerdictRecord | None) -> dict[str, Any]:
    """The verifier's verdict on the answer (`pass`, `cheat`, `unproven`) with the proof's reason
    code; `pending` while an answer offered to the audit awaits one; `not audited` otherwise."""
    if verdict is not None:
        return {
            "status": verdict.verdict,
            "reason": verdict.reason,
            "verifier": verdict.verifier,
            "judged_at": verdict.judged_at,
        }
    return {"status": "pending" if any(row.audited for row in rows) else "not audited"}


def generation_body(rows: list[RequestLogEntry], verdict: VerdictRecord | None) -> dict[str, Any]:
    """One request's record: its last attempt's outcome, the tokens and cost of all its attempts
    (only a settled one has any), latency, and the verdict. Never its text: the log has none."""
    last = rows[-1]
    cost = sum(row.cost_micro for row in rows)
    return {
        "data": {
            "id": last.request_id,
            "model": last.model,
            "api": last.api,
            "created_at": rows[0].created_at,
            "status": last.status,
            "finish_reason": last.finish_reason,
            "attempts": len(rows),
            "tokens_prompt": sum(row.prompt_tokens for row in rows),
            "tokens_cached": sum(row.cached_tokens for row in rows),
            "tokens_completion": sum(row.completion_tokens for row in rows),
            "tokens_reasoning": sum(row.reasoning_tokens for row in rows),
            "cost_micro_usd": cost,
            "total_cost": cost_number(cost),
            "cost_usd": cost_usd(cost),
            "ttft_ms": last.ttft_ms,
            "total_ms": last.total_ms,
            "verification": verification(rows, verdict),
        }
    }


class BuyerRecords:
    """The handlers of `/v1/generation` and `/v1/usage` over one `Gateway`."""

    def __init__(self, gateway: Gateway, *, clock) -> None:
        self.gateway = gateway
        self.clock = clock

    async def generation(self, request: Request) -> Response:
        gateway = self.gateway
        try:
            account = await gateway.authenticate(ANTHROPIC.api_key(request.headers), OPENAI.name, cached=False)
            wanted = request.query_params.get("id")
            if not wanted:
                raise GatewayError(
                    "invalid_request", "name the generation: GET /v1/generation?id=<x-request-id or body id>", "id"
                )
            request_id = request_id_of(wanted)
            store = gateway.store
            rows = [] if request_id is None else await store.run(store.request_rows, request_id, account.account_id)
            if request_id is None or not rows:
                raise GatewayError(
                    "not_found",
                    f"no generation {wanted!r} for this API key's account; it may still be in flight, or be "
                    "older than the request log keeps",
                    "id",
                )
            verdict = await store.run(store.verdict, request_id)
            return JSONResponse(generation_body(rows, verdict))
        except GatewayError as err:
            return OPENAI.error_response(err, gateway.new_id())

    async def usage(self, request: Request) -> Response:
        gateway = self.gateway
        try:
            account = await gateway.authenticate(ANTHROPIC.api_key(request.headers), OPENAI.name, cached=False)
            query = request.query_params
            until = _bound(query.get("until"), "until", default=self.clock())
            since = _bound(query.get("since"), "since", default=until - usage.DEFAULT_WINDOW_S)
            if not 0 < until - since <= MAX_USAGE_WINDOW_S:
                raise GatewayError(
                    "invalid_request",
                    f"since must be before until, and at most {MAX_USAGE_WINDOW_S // 86_400} days before it; "
                    "ask for a longer period in several calls",
                    "since",
                )
            group_by = query.get("group_by", "day")
            if group_by not in usage.GROUP_BYS:
                raise GatewayError(
                    "invalid_request",
                    f"group_by must be one of {', '.join(usage.GROUP_BYS)}, got {group_by!r}",
                    "group_by",
                )
            key_id = _key(query.get("key_id"))
            store = gateway.store
            rows = await store.run(store.account_requests, account.account_id, since=since, until=until)
            if key_id is not None:
                rows = [row for row in rows if row.key_id == key_id]
            charged = await store.run(store.charged_between, account.account_id, since=since, until=until)
            credits = await store.run(store.credits_between, account.account_id, since=since, until=until)
            lines = usage.usage_report(rows, group_by=group_by)
            return JSONResponse(
                usage.usage_document(
                    lines,
                    account_id=account.account_id,
                    since=since,
                    until=until,
                    group_by=group_by,
                    key_id=key_id,
                    ledger_charged=charged,
                    credits=credits,
                )
            )
        except GatewayError as err:
            return OPENAI.error_response(err, gateway.new_id())


def _bound(text: str | None, param: str, *, default: float) -> float:
    if text is None:
        return default
    try:
        return usage.parse_time(text, param=param)
    except ValueError as error:
        raise GatewayError("invalid_request", str(error), param) from None


def _key(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise GatewayError("invalid_request", f"key_id must be an API key's number (>= 1), got {text!r}", "key_id")
    return int(text)
