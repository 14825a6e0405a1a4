"""What a notification looks like to each chat service: pure (URL, JSON body) pairs.

* Discord: `{"content": …}` (an execute-webhook call; 2,000 characters at most).
* Slack: `{"text": …}` (an incoming webhook).
* Telegram: the Bot API's `sendMessage`, `{"chat_id": …, "text": …}`; the chat comes from the
  configured URL's `chat_id` query parameter, so one setting carries token and chat.
* json: the alert itself, for any receiver (Alertmanager-style relays, scripts, tests).

The text is one line a phone shows whole: a mark that does not depend on colour, the node, the
alert's text and, for a recovery, how long it fired.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from engy_node.alerts.rules import Notification
from engy_node.alerts.settings import Webhook
from engy_node.durations import duration_text

DISCORD_LIMIT = 2000
TELEGRAM_LIMIT = 4096
MARKS = {"firing": "🔴 FIRING", "reminder": "🔴 STILL FIRING", "resolved": "✅ RESOLVED"}


def message(note: Notification, *, node: str) -> str:
    alert = note.alert
    text = f"{MARKS[note.kind]} [{node}] {alert.rule}: {alert.text}"
    if note.kind == "resolved" and alert.since is not None:
        text += f" (fired for {duration_text(note.at - alert.since)})"
    return text


def request(hook: Webhook, note: Notification, *, node: str) -> tuple[str, dict[str, Any]]:
    """The URL to POST to and the JSON body for `note` on `hook`."""
    text = message(note, node=node)
    if hook.kind == "discord":
        return hook.url, {"content": _clip(text, DISCORD_LIMIT)}
    if hook.kind == "slack":
        return hook.url, {"text": text}
    if hook.kind == "telegram":
        parts = urllib.parse.urlsplit(hook.url)
        query = urllib.parse.parse_qs(parts.query)
        chat = query.get("chat_id", [""])[0]
        url = urllib.parse.urlunsplit(parts._replace(query=""))
        return url, {"chat_id": chat, "text": _clip(text, TELEGRAM_LIMIT)}
    alert = note.alert
    return hook.url, {
        "status": note.kind,
        "node": node,
        "key": alert.key,
        "rule": alert.rule,
        "level": alert.level,
        "subject": alert.subject,
        "text": alert.text,
        "since": alert.since,
        "at": note.at,
        "message": text,
    }


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
