"""The alert task: every `alerts.check_s`, read the hub's states, run the rules, log and post
what they say, and publish the `alerts` state (the TUI's overview and `engy-node status` show it).

Error handling. A webhook post has `alerts.timeout_s` from connect to answer; a post that fails
(no answer, a refused connection, a status other than 2xx) is tried again `alerts.retries` times
with the shared backoff (`engy_node.retry`), then given up: logged with its reason and counted in
`failed`, never raised — a broken chat service must not stop the node, and the alert still shows
in the TUI. A notification is not queued past its check: the next notice of the same alert is
its recovery, or a reminder if `alerts.renotify_s` is set. Posts to different webhooks run at
once; each webhook gets its notifications in order, so a recovery never arrives before its alert.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
import time
from collections.abc import Sequence

import httpx
import trio

from engy_node.alerts.rules import RULES, Book, Limits, Notification, evaluate
from engy_node.alerts.settings import AlertsSection, Webhook, webhooks
from engy_node.alerts.state import AlertsState
from engy_node.alerts.webhooks import request
from engy_node.hub import Hub
from engy_node.metrics import Gauge
from engy_node.retry import backoff_delay
from engy_node.snapshots import decode_states, encode

log = logging.getLogger("engy.alerts")

COMPONENT = "alerts"
RETRY_CAP_S = 30.0


def limits(section: AlertsSection) -> Limits:
    return Limits(
        weights_stale_blocks=section.weights_stale_blocks,
        balance_low_usd_micro=section.balance_low_usd_micro,
        restart_window_s=section.restart_window_s,
        renotify_s=section.renotify_s,
    )


@dataclasses.dataclass
class _Delivery:
    sent: int = 0
    failed: int = 0
    last_error: str | None = None


async def run_alerts(
    section: AlertsSection, hub: Hub, *, node: str | None = None, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Check and notify until cancelled. `node` names this node in messages (the host name)."""
    hooks = webhooks(section)
    rules = limits(section)
    name = node or socket.gethostname()
    book = Book()
    delivery = _Delivery()
    # For a Prometheus that scrapes many nodes (deploy/prometheus/rules.yml, EngyNodeAlert).
    gauge = hub.registry.gauge(
        "engy_alerts_firing", "Alerts of this node firing now, by rule (docs/operations.md).", labelnames=("rule",)
    )
    async with httpx.AsyncClient(timeout=section.timeout_s, trust_env=False) as client:
        task_status.started(
            f"{len(hooks)} webhook(s)"
            if hooks
            else "no webhooks (alerts.webhooks): shown in engy-node status and the TUI only"
        )
        while True:
            now = time.time()
            book, notes = evaluate(book, decode_states(hub.states()), rules, now)
            for note in notes:
                level = logging.INFO if note.kind == "resolved" else logging.WARNING
                log.log(level, "alert %s: %s: %s", note.kind, note.alert.key, note.alert.text)
            # Published before the posts too: a slow webhook must not hold back what the TUI shows.
            _publish(hub, gauge, book, hooks, delivery, now)
            if notes and hooks:
                async with trio.open_nursery() as nursery:
                    for hook in hooks:
                        nursery.start_soon(_deliver_all, client, hook, notes, name, section, delivery)
                _publish(hub, gauge, book, hooks, delivery, now)
            await trio.sleep(section.check_s)


def _publish(hub: Hub, gauge: Gauge, book: Book, hooks: Sequence[Webhook], delivery: _Delivery, now: float) -> None:
    state = AlertsState(
        firing=tuple(book.firing.values()),
        webhooks=len(hooks),
        sent=delivery.sent,
        failed=delivery.failed,
        last_error=delivery.last_error,
        checked_at=now,
    )
    hub.set_state(COMPONENT, **encode(state))
    for rule in RULES:
        gauge.labels(rule=rule).set(sum(1 for alert in book.firing.values() if alert.rule == rule))


async def _deliver_all(
    client: httpx.AsyncClient,
    hook: Webhook,
    notes: Sequence[Notification],
    node: str,
    section: AlertsSection,
    delivery: _Delivery,
) -> None:
    for note in notes:
        url, body = request(hook, note, node=node)
        error = await _post(client, url, body, section)
        if error is None:
            delivery.sent += 1
            delivery.last_error = None
            continue
        delivery.failed += 1
        delivery.last_error = f"{hook.kind}: {error}"
        log.warning(
            "alert %s %s not delivered to the %s webhook after %d tries: %s; check alerts.webhooks",
            note.kind,
            note.alert.key,
            hook.kind,
            section.retries + 1,
            error,
        )


async def _post(client: httpx.AsyncClient, url: str, body: dict, section: AlertsSection) -> str | None:
    """POST `body`, with retries; None once one succeeds, else the last failure's reason. The
    reason never includes the URL: a webhook URL is its secret."""
    error = "not tried"
    for attempt in range(section.retries + 1):
        if attempt:
            await trio.sleep(backoff_delay(consecutive_failures=attempt, jitter=random.random(), cap_s=RETRY_CAP_S))
        with trio.move_on_after(section.timeout_s) as scope:
            try:
                response = await client.post(url, json=body)
            except httpx.HTTPError as failure:
                error = f"{type(failure).__name__}: {failure}".replace(url, "<webhook>")
                continue
            if response.is_success:
                return None
            error = f"HTTP {response.status_code}: {response.text[:200]}"
        if scope.cancelled_caught:
            error = f"no answer within {section.timeout_s:g} s"
    return error
