"""The operator's commands for keys a team manages and their limits (`engy-node gateway key …`,
`engy-node gateway account set-limits`), as text to print (docs/billing.md, "Limits and keys").

Like `admin.py`: each function takes an open `Store`, calls its synchronous methods and returns
the text; a key's secret appears once, when it is created or rotated, and otherwise only as its
masked hint (prefix…last 4). Limits typed by a person are parsed here, dollars exactly
(`admin.parse_usd`); `none` clears a limit (a key then takes its account's default; an account
default then means no limit).
"""

from __future__ import annotations

from datetime import UTC, datetime

from engy_node.gateway.admin import AdminError, format_usd, parse_usd
from engy_node.gateway.limits import Limits
from engy_node.gateway.store import KeyInfo, Store
from engy_node.gateway.store.key_limits import UNCHANGED, expiry_from

SHOWN_ONCE = "This key is shown once and stored only as a hash: give it to its user now."

LIMIT_FLAGS = {
    "rpm": ("rpm", "requests per minute"),
    "tpm": ("tpm", "tokens per minute (prompt + max_tokens, corrected at settlement)"),
    "concurrent": ("concurrent", "requests in flight at once"),
    "daily_usd": ("daily_micro", "spend cap per UTC day, in dollars"),
    "monthly_usd": ("monthly_micro", "spend cap per UTC month, in dollars"),
}
"""CLI flag (`--daily-usd`) → (store column, what it limits)."""


def _when(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def parse_models(text: str | None) -> tuple[str, ...] | None:
    """`a,b` → ("a", "b"); None or empty: every model."""
    if not text:
        return None
    models = tuple(part.strip() for part in text.split(",") if part.strip())
    return models or None


def parse_limits(values: dict[str, str | None]) -> dict[str, int | None]:
    """The store's changes for the limits given on the command line (flag name → text; None:
    not given). `none` clears one; dollar caps are exact dollars ("0" blocks all spending).

    Raises:
        AdminError: a value that is not a whole number (or dollars), or not given at all.
    """
    changes: dict[str, int | None] = {}
    for flag, text in values.items():
        if text is None:
            continue
        column, _ = LIMIT_FLAGS[flag]
        dashed = "--" + flag.replace("_", "-")
        if text.strip().lower() == "none":
            changes[column] = None
        elif flag.endswith("_usd"):
            changes[column] = 0 if text.strip().strip("$") in ("0", "0.0", "0.00") else parse_usd(text)
        elif text.strip().isdigit():
            changes[column] = int(text)
        else:
            raise AdminError(f"{dashed} takes a whole number, or none to clear it; got {text!r}")
    if not changes:
        raise AdminError(
            "give at least one limit: "
            + ", ".join("--" + flag.replace("_", "-") for flag in LIMIT_FLAGS)
            + " (N or none)"
        )
    return changes


def describe_limits(limits: Limits) -> str:
    parts = []
    if limits.rpm is not None:
        parts.append(f"{limits.rpm} rpm")
    if limits.tpm is not None:
        parts.append(f"{limits.tpm} tpm")
    if limits.concurrent is not None:
        parts.append(f"{limits.concurrent} at once")
    if limits.daily_micro is not None:
        parts.append(f"{format_usd(limits.daily_micro)}/day")
    if limits.monthly_micro is not None:
        parts.append(f"{format_usd(limits.monthly_micro)}/month")
    return ", ".join(parts) or "none"


def create_key(store: Store, *, account_id: int, name: str, expires: str | None, models: str | None, now: float) -> str:
    try:
        expires_at = None if expires is None else expiry_from(expires, now)
    except ValueError as error:
        raise AdminError(str(error)) from None
    if expires_at is not None and expires_at <= now:
        raise AdminError(f"--expires {expires} is already past; give a later date or a number of days")
    allowed = parse_models(models)
    key_id, key = store.create_key(account_id, name=name, expires_at=expires_at, models=allowed)
    return (
        f"API key {key_id} ({name}) for account {account_id}: {key}\n"
        f"expires: {'never' if expires_at is None else _when(expires_at)}; "
        f"models: {'all' if allowed is None else ', '.join(allowed)}\n"
        f"{SHOWN_ONCE}"
    )


def expiry_change(text: str, now: float) -> float | None:
    """A new expiry as `key update --expires` takes it: `never`, a number of days from `now`,
    or an ISO date or time (UTC unless it names a zone), not already past.

    Raises:
        AdminError: none of those, or a time already past.
    """
    if text.strip().lower() == "never":
        return None
    try:
        expires_at = expiry_from(text.strip(), now)
    except ValueError as error:
        raise AdminError(f"{error}, or never") from None
    if expires_at <= now:
        raise AdminError(
            f"--expires {text} is already past; give a later date or a number of days (to stop a key now, "
            "engy-node gateway key revoke)"
        )
    return expires_at


def models_change(text: str) -> tuple[str, ...] | None:
    """New allowed models as `key update --models` takes them: `a,b`, or `all`.

    Raises:
        AdminError: no model named.
    """
    if text.strip().lower() == "all":
        return None
    models = parse_models(text)
    if models is None:
        raise AdminError("--models takes model ids separated by commas (smollm2-135m,glm-5.2), or all")
    return models


def update_key(store: Store, *, key_id: int, expires: str | None, models: str | None, now: float) -> str:
    """Change key `key_id`'s expiry or allowed models (None: leave it)."""
    if expires is None and models is None:
        raise AdminError("give --expires ISO|DAYS|never, --models A,B|all, or both")
    info = store.update_key(
        key_id,
        expires_at=UNCHANGED if expires is None else expiry_change(expires, now),
        models=UNCHANGED if models is None else models_change(models),
    )
    return f"{describe_key(info)}: every gateway on this store applies it from the key's next request on"


def describe_key(info: KeyInfo) -> str:
    """`API key 12 (ci-agent): expires …; models: …`."""
    expires = "never" if info.expires_at is None else _when(info.expires_at)
    models = "all" if info.models is None else ", ".join(info.models)
    return f"API key {info.key_id} ({info.name or 'unnamed'}): expires {expires}; models: {models}"


def _state(info: KeyInfo, now: float) -> str:
    if info.revoked_at is not None:
        return f"revoked {_when(info.revoked_at)}"
    if info.expires_at is not None and info.expires_at <= now:
        return f"expired {_when(info.expires_at)}"
    return "active" if info.expires_at is None else f"active until {_when(info.expires_at)}"


def list_keys(store: Store, *, account_id: int, now: float) -> str:
    """The account's keys, masked, with their state, models and own limits, and the account's
    default limits."""
    keys = store.list_keys(account_id)
    rows = [("ID", "NAME", "KEY", "STATE", "MODELS", "LIMITS")]
    for info in keys:
        rows.append(
            (
                str(info.key_id),
                info.name or "-",
                info.hint or "(issued unnamed; masked hint unknown)",
                _state(info, now),
                "all" if info.models is None else ",".join(info.models),
                describe_limits(info.limits),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    defaults = store.account_limits(account_id)
    lines.append(f"account {account_id} default limits (for limits a key leaves unset): {describe_limits(defaults)}")
    return "\n".join(lines)


def rotate_key(store: Store, *, key_id: int) -> str:
    new_id, key = store.rotate_key(key_id)
    return (
        f"API key {key_id} revoked and replaced by key {new_id} (same name, expiry, models and limits): {key}\n"
        f"{SHOWN_ONCE}"
    )


def revoke_key_id(store: Store, *, key_id: int) -> str:
    if not store.revoke_key_id(key_id):
        raise AdminError(
            f"no unrevoked API key {key_id} in {store.where}; `engy-node gateway key list ACCOUNT` shows them"
        )
    return f"API key {key_id} revoked: every gateway on this store refuses it from its next request on"


def set_key_limits(store: Store, *, key_id: int, values: dict[str, str | None]) -> str:
    limits = store.set_key_limits(key_id, parse_limits(values))
    return f"API key {key_id} limits: {describe_limits(limits)} (unset ones take the account's defaults)"


def set_account_limits(store: Store, *, account_id: int, values: dict[str, str | None]) -> str:
    limits = store.set_account_limits(account_id, parse_limits(values))
    return f"account {account_id} default limits: {describe_limits(limits)} (a key's own limits override them)"
