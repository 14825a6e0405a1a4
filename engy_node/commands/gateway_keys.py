"""`engy-node gateway key …` and `engy-node gateway account set-limits`: keys a team manages and
their limits, from a shell (the text is `gateway.key_admin`'s; this module is the flags)."""

from __future__ import annotations

import argparse
import time

LIMIT_HELP = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute (prompt + max_tokens, corrected at settlement)",
    "concurrent": "requests in flight at once",
    "daily-usd": "spend cap per UTC day, dollars (e.g. 5 or 0.50)",
    "monthly-usd": "spend cap per UTC month, dollars",
}


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    for flag, help_text in LIMIT_HELP.items():
        parser.add_argument(f"--{flag}", metavar="N", help=f"{help_text}; none clears it")


def add_parsers(admin_sub: argparse._SubParsersAction) -> None:
    """Add `key` and `account` to `engy-node gateway`'s actions."""
    key = admin_sub.add_parser("key", help="API keys a team manages: create, list, update, rotate, revoke, set-limits")
    key_sub = key.add_subparsers(dest="key_command", metavar="ACTION", required=True)
    create = key_sub.add_parser("create", help="create a named key for an account and print it (shown once)")
    create.add_argument("account", type=int)
    create.add_argument("--name", required=True, help="what the key is for (shown in key list)")
    create.add_argument("--expires", metavar="ISO|DAYS", help="expiry: a date/time (UTC unless given) or days from now")
    create.add_argument("--models", metavar="A,B", help="the only models it may use (default: all)")
    listing = key_sub.add_parser("list", help="an account's keys, masked, with their state, models and limits")
    listing.add_argument("account", type=int)
    update = key_sub.add_parser(
        "update", help="change a key's expiry or allowed models; applied from its next request on"
    )
    update.add_argument("key_id", type=int)
    update.add_argument(
        "--expires", metavar="ISO|DAYS|never", help="a date/time (UTC unless given), days from now, or never"
    )
    update.add_argument("--models", metavar="A,B|all", help="the only models it may use, or all")
    rotate = key_sub.add_parser("rotate", help="a new secret for a key (same settings); the old one is revoked")
    rotate.add_argument("key_id", type=int)
    revoke = key_sub.add_parser("revoke", help="revoke a key by its number: refused from its next request on")
    revoke.add_argument("key_id", type=int)
    limits = key_sub.add_parser("set-limits", help="set or clear a key's own limits")
    limits.add_argument("key_id", type=int)
    _limit_flags(limits)
    account = admin_sub.add_parser("account", help="an account's default limits for its keys")
    account_sub = account.add_subparsers(dest="account_command", metavar="ACTION", required=True)
    defaults = account_sub.add_parser(
        "set-limits", help="set or clear the limits its keys take unless they set their own"
    )
    defaults.add_argument("account", type=int)
    _limit_flags(defaults)


def _limits(args: argparse.Namespace) -> dict[str, str | None]:
    return {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag in LIMIT_HELP}


def run(store, args: argparse.Namespace) -> str:
    """The text for `gateway key …` or `gateway account …`."""
    from engy_node.gateway import key_admin

    if args.admin_command == "account":
        return key_admin.set_account_limits(store, account_id=args.account, values=_limits(args))
    action = args.key_command
    if action == "create":
        return key_admin.create_key(
            store, account_id=args.account, name=args.name, expires=args.expires, models=args.models, now=time.time()
        )
    if action == "list":
        return key_admin.list_keys(store, account_id=args.account, now=time.time())
    if action == "update":
        return key_admin.update_key(
            store, key_id=args.key_id, expires=args.expires, models=args.models, now=time.time()
        )
    if action == "rotate":
        return key_admin.rotate_key(store, key_id=args.key_id)
    if action == "revoke":
        return key_admin.revoke_key_id(store, key_id=args.key_id)
    return key_admin.set_key_limits(store, key_id=args.key_id, values=_limits(args))
