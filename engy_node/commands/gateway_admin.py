"""`engy-node gateway …`: a gateway operator's actions on its store, from a shell.

Buyer accounts, their keys (issued, revoked), credit and usage, miner registration, each miner's eligibility, the
published epochs, and the HAProxy configuration for a fleet of gateway hosts. Each action is a
function of `gateway.admin` (or `gateway.fleet.load_balancer`) that returns the text to print;
this module is only their flags and the one store they run against, apart from `cli.py`'s
dispatch because the group has a parser of its own.
"""

from __future__ import annotations

import argparse
import sys
import time

from engy_node.commands import gateway_keys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `gateway` and its actions to the sub-command parsers."""
    admin = sub.add_parser("gateway", help="gateway administration: buyer keys, credit, usage, miners")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    create = admin_sub.add_parser("create-buyer", help="create a buyer account and print its API key (shown once)")
    create.add_argument("name")
    issue = admin_sub.add_parser(
        "issue-key", help="issue another API key for an account and print it (shown once); to rotate, then revoke-key"
    )
    issue.add_argument("account", type=int)
    revoke = admin_sub.add_parser(
        "revoke-key",
        help="revoke a buyer's API key: every gateway on this store refuses it from its next request on",
    )
    revoke.add_argument("key", help="the API key (engy-sk-…); - reads it from standard input, out of the shell history")
    gateway_keys.add_parsers(admin_sub)
    credit = admin_sub.add_parser("credit", help="add prepaid credit to an account")
    credit.add_argument("account", type=int)
    credit.add_argument("usd", help="dollars, e.g. 25 or 0.50")
    credit.add_argument("--memo", default="")
    balance = admin_sub.add_parser("balance", help="show an account's balance")
    balance.add_argument("account", type=int)
    usage = admin_sub.add_parser(
        "usage",
        help="an account's usage per key, day and model (requests, tokens, cost, errors, TTFT), with the ledger's charges",
    )
    usage.add_argument("account", type=int)
    usage.add_argument("--key", type=int, metavar="KEY_ID", help="only this API key's requests (its number)")
    usage.add_argument("--since", help="from: unix seconds, a date (2026-12-01) or an ISO time (default: 30 days ago)")
    usage.add_argument("--until", help="to, not included (default: now)")
    usage.add_argument("--group-by", choices=("day", "total"), default="day")
    usage.add_argument("--format", choices=("table", "csv", "json"), default="table")
    link = admin_sub.add_parser(
        "link-coldkey",
        help="link a buyer's coldkey: its TAO sent to gateway.deposit_address is credited to the account",
    )
    link.add_argument("account", type=int)
    link.add_argument("coldkey", help="the buyer's coldkey (ss58)")
    deposits = admin_sub.add_parser("deposits", help="list an account's deposits from the chain")
    deposits.add_argument("account", type=int)
    register = admin_sub.add_parser("register-miner", help="register a miner and print its miner key (shown once)")
    register.add_argument("name")
    register.add_argument("--hotkey", help="the miner's ss58 hotkey, to admit it by signed hello")
    admin_sub.add_parser("miners", help="list registered miners")
    admin_sub.add_parser("trust", help="each miner's eligibility (probing, active, pulled) and why, with its verdicts")
    admin_sub.add_parser("epochs", help="the latest published epochs and their weights")
    lb = admin_sub.add_parser(
        "haproxy-config",
        help="print the HAProxy configuration for a fleet of gateway hosts",
        description="One public buyer port and miner port for several gateway hosts on one "
        "PostgreSQL store (docs/scale-out.md).",
    )
    lb.add_argument(
        "--host",
        action="append",
        required=True,
        metavar="NAME=ADDRESS:BUYER_PORT:MINER_PORT:FIRST_LEG:LEGS",
        help="one gateway host (repeat for each): FIRST_LEG is its gateway.fleet_offset, LEGS its gateway.workers",
    )
    lb.add_argument("--bind", default="0.0.0.0", help="address HAProxy listens on (default 0.0.0.0)")
    lb.add_argument("--buyer-port", type=int, default=8080, help="public buyer API port (default 8080)")
    lb.add_argument("--miner-port", type=int, default=8081, help="public miner port (default 8081)")


def _usage(store, args: argparse.Namespace) -> str:
    from engy_node.gateway.admin import AdminError, show_usage
    from engy_node.gateway.billing.usage import DEFAULT_WINDOW_S, parse_time
    from engy_node.gateway.usage_export import export_usage

    try:
        until = time.time() if args.until is None else parse_time(args.until, param="--until")
        since = until - DEFAULT_WINDOW_S if args.since is None else parse_time(args.since, param="--since")
    except ValueError as error:
        raise AdminError(str(error)) from None
    report = export_usage(
        store,
        account_id=args.account,
        key_id=args.key,
        since=since,
        until=until,
        group_by=args.group_by,
        fmt=args.format,
    )
    if args.format != "table":
        return report
    # A person reading a table gets the account's summary first; csv and json stay machine-readable.
    return f"{show_usage(store, account_id=args.account, since=since)}\n\n{report}"


def run(config, args: argparse.Namespace) -> int:
    """Run the action `args.admin_command` names and print its result."""
    from engy_node.gateway import admin
    from engy_node.gateway.role import store_location
    from engy_node.gateway.store import Store
    from engy_node.private_files import private_dir

    if args.admin_command == "haproxy-config":
        from engy_node.errors import ConfigError
        from engy_node.gateway.fleet.load_balancer import haproxy_config, parse_host

        try:
            print(
                haproxy_config(
                    [parse_host(spec) for spec in args.host],
                    bind=args.bind,
                    buyer_port=args.buyer_port,
                    miner_port=args.miner_port,
                ),
                end="",
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return 0
    private_dir(config.paths.data_dir)
    with Store.open(store_location(config)) as store:
        action = args.admin_command
        if action == "create-buyer":
            print(admin.create_buyer(store, name=args.name))
        elif action == "issue-key":
            print(admin.issue_key(store, account_id=args.account))
        elif action == "revoke-key":
            print(admin.revoke_key(store, api_key=sys.stdin.readline() if args.key == "-" else args.key))
        elif action in ("key", "account"):
            print(gateway_keys.run(store, args))
        elif action == "credit":
            print(admin.credit(store, account_id=args.account, dollars=args.usd, memo=args.memo))
        elif action == "balance":
            print(admin.show_balance(store, account_id=args.account))
        elif action == "usage":
            print(_usage(store, args), end="")
        elif action == "link-coldkey":
            print(admin.link_coldkey(store, account_id=args.account, coldkey=args.coldkey))
        elif action == "deposits":
            print(admin.list_deposits(store, account_id=args.account))
        elif action == "register-miner":
            print(admin.register_miner(store, name=args.name, hotkey=args.hotkey))
        elif action == "miners":
            print(admin.list_miners(store))
        elif action == "trust":
            print(admin.show_trust(store, now=time.time()))
        elif action == "epochs":
            print(admin.list_epochs(store))
    return 0
