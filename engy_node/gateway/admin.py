"""The gateway operator's commands (docs/architecture.md, docs/billing.md): buyer keys (issued,
revoked) and credit,
balances and usage, miners, their eligibility and verdicts, published epochs.

Each function takes an open `Store`, calls its synchronous methods (the admin CLI runs outside
trio) and returns the text to print; `cli.py` owns argument parsing, printing and exit
codes. Secrets are printed exactly once, at creation, because only their hashes are kept.

Money typed by a person is parsed exactly, with `decimal`, never through a float: "0.10" must
credit 100,000 micro-USD, not 99,999. Input the ledger cannot represent exactly (more than six
decimal places) or that makes no sense as a credit (zero, negative) is refused with
`AdminError` rather than rounded: a silently altered amount is worse than a retyped command.
"""

from __future__ import annotations

import decimal
import json
import re
from datetime import UTC, datetime

from engy_node.errors import EngyError
from engy_node.gateway.store import Store
from engy_node.money import MICRO_USD_PER_USD, USD_DECIMALS, format_usd
from engy_node.protocol.api_keys import BUYER_KEY_PREFIX

_USD_TEXT = re.compile(r"\$?(?P<number>\d+(?:\.(?P<fraction>\d+))?)")
"""Plain positional dollars, optionally with a leading `$`: `25`, `0.50`, `$3.000001`. No
signs, exponents, grouping commas or NaN, which `Decimal` would otherwise accept."""


class AdminError(EngyError):
    title = "admin"


def parse_usd(text: str) -> int:
    """Micro-USD for a dollar amount typed by the operator (`"25"` → 25,000,000).

    Raises:
        AdminError: not a plain positive amount, or more than `USD_DECIMALS` decimal places.
    """
    match = _USD_TEXT.fullmatch(text.strip())
    if match is None:
        raise AdminError(f"{text!r} is not a dollar amount; write it like 25 or 0.50")
    if len(match["fraction"] or "") > USD_DECIMALS:
        raise AdminError(
            f"{text!r} has more than {USD_DECIMALS} decimal places; the ledger counts whole micro-dollars ($0.000001)"
        )
    number = match["number"]
    with decimal.localcontext() as context:
        # Enough digits for the whole product, and a trap in case that reasoning is ever wrong:
        # this multiplication must be exact.
        context.prec = len(number) + USD_DECIMALS
        context.traps[decimal.Inexact] = True
        micro = int(decimal.Decimal(number) * MICRO_USD_PER_USD)
    if micro <= 0:
        raise AdminError(f"{text!r} is not more than $0; a credit must add money")
    return micro


def _timestamp(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def create_buyer(store: Store, *, name: str) -> str:
    """Create a buyer account and its API key; the key appears in this text and never again."""
    account_id, api_key = store.create_buyer(name)
    return (
        f"buyer account {account_id} ({name}) created\n"
        f"API key: {api_key}\n"
        "This key is shown once and stored only as a hash: give it to the buyer now."
    )


def issue_key(store: Store, *, account_id: int) -> str:
    """Another API key for an account (to rotate one: issue, hand it over, revoke the old one);
    the key appears in this text and never again."""
    api_key = store.issue_key(account_id)
    return (
        f"API key for account {account_id}: {api_key}\n"
        "This key is shown once and stored only as a hash: give it to the buyer now."
    )


def revoke_key(store: Store, *, api_key: str) -> str:
    """Stop accepting `api_key`: every gateway worker and host on this store refuses it from its
    next request on (the hold every request makes checks the key in the same statement).

    Raises:
        AdminError: the key is unknown here or already revoked.
    """
    api_key = api_key.strip()
    if not store.revoke_key(api_key):
        raise AdminError(
            f"no unrevoked API key {mask_key(api_key)} in {store.where}: it was revoked already, or it is not "
            f"a key of this gateway (check that the whole key was copied; buyer keys start with {BUYER_KEY_PREFIX})"
        )
    return f"API key {mask_key(api_key)} revoked: every gateway on this store refuses it from its next request on"


def mask_key(api_key: str) -> str:
    """A key as it may be printed after its creation: its prefix and last four characters."""
    prefix = BUYER_KEY_PREFIX if api_key.startswith(BUYER_KEY_PREFIX) else ""
    return f"{prefix}…{api_key[-4:]}" if len(api_key) > len(prefix) + 8 else f"{prefix}…"


def credit(store: Store, *, account_id: int, dollars: str, memo: str = "") -> str:
    """Credit `dollars` (decimal text such as "25" or "0.50") to the account."""
    micro_usd = parse_usd(dollars)
    available = store.credit(account_id, micro_usd=micro_usd, memo=memo)
    return f"credited {format_usd(micro_usd)} to account {account_id}; available {format_usd(available)}"


def show_balance(store: Store, *, account_id: int) -> str:
    balance = store.balance(account_id)
    return "\n".join(
        (
            f"account {account_id}",
            f"  available {format_usd(balance.available)}",
            f"  held      {format_usd(balance.held)}  (requests in flight)",
            f"  credited  {format_usd(balance.credited)}",
            f"  charged   {format_usd(balance.charged)}",
            deposits_line(store, account_id),
        )
    )


def show_usage(store: Store, *, account_id: int, since: float | None = None) -> str:
    """Paid usage of the account since `since` (unix seconds; None: all retained history)."""
    usage = store.usage(account_id, since=since)
    window = "all retained history" if since is None else f"since {_timestamp(since)}"
    return "\n".join(
        (
            f"account {account_id}, {window}",
            f"  requests          {usage.requests}",
            f"  prompt tokens     {usage.prompt_tokens} ({usage.cached_tokens} cached)",
            f"  completion tokens {usage.completion_tokens}",
            f"  cost              {format_usd(usage.cost_micro)}",
            deposits_line(store, account_id, since=since),
        )
    )


def register_miner(store: Store, *, name: str, hotkey: str | None = None) -> str:
    """Register a miner and issue its key; the key appears in this text and never again."""
    miner_id, miner_key = store.register_miner(name, hotkey=hotkey)
    return (
        f"miner {miner_id} ({name}) registered\n"
        f"miner key: {miner_key}\n"
        "This key is shown once and stored only as a hash: set it as the miner's MINER_KEY now."
    )


def show_trust(store: Store, *, now: float) -> str:
    """Each (miner, model)'s eligibility and why, with the verdicts on its audited requests."""
    rows = store.eligibility()
    verdicts = store.verdict_counts(since=0.0, until=now + 1)
    defects = store.defect_counts(since=0.0, until=now + 1)
    if not rows and not verdicts:
        return "no miner has been probed or audited yet"
    lines = [
        f"{'miner':<50} {'model':<16} {'state':<8} {'since':<20} {'pass':>5} {'cheat':>5} {'unpr.':>5} {'def.':>5}  why"
    ]
    for row in rows:
        passed, cheat, unproven = verdicts.get(row.miner, (0, 0, 0))
        lines.append(
            f"{row.miner:<50} {row.model:<16} {row.state:<8} {_timestamp(row.since):<20} {passed:>5} {cheat:>5} "
            f"{unproven:>5} {defects.get(row.miner, 0):>5}  {row.reason}"
        )
    for miner in sorted(set(verdicts) - {row.miner for row in rows}):
        passed, cheat, unproven = verdicts[miner]
        lines.append(
            f"{miner:<50} {'-':<16} {'-':<8} {'-':<20} {passed:>5} {cheat:>5} {unproven:>5} {defects.get(miner, 0):>5}  "
            "(not connected since the restart)"
        )
    if any(defects.values()):
        lines.append(
            "def.: answers that passed but whose text differed from the proven tokens in presentation (a held-back "
            "tail, whitespace, U+FFFD); buyers got the proven text. The miner's software needs fixing, its pay does not change."
        )
    return "\n".join(lines)


def list_epochs(store: Store, *, limit: int = 20) -> str:
    """The latest published epochs: when each closed, its digest, and its weights."""
    epochs = store.published_epochs(limit=limit)
    if not epochs:
        return "no epoch published yet (a gateway publishes once gateway.master_wallet is set and an epoch closes)"
    lines = []
    for index, payload, closed_at in epochs:
        wire = json.loads(payload)
        weights = ", ".join(f"{hotkey}={weight}" for hotkey, weight in json.loads(wire["result_json"])["weights"])
        lines.append(f"epoch {index}  closed {_timestamp(closed_at)}  digest {wire['digest'][:16]}…  weights {weights}")
    return "\n".join(lines)


def list_miners(store: Store) -> str:
    """One line per registered miner (keys are never shown: only their hashes are kept)."""
    miners = store.list_miners()
    if not miners:
        return "no miners registered"
    lines = [f"{'id':>4}  {'name':<24} {'hotkey':<48}  registered"]
    lines += [f"{m.miner_id:>4}  {m.name:<24} {m.hotkey or '-':<48}  {_timestamp(m.created_at)}" for m in miners]
    return "\n".join(lines)


# -- deposits from the chain (docs/billing.md, "Deposits from the chain") ---------------------------

RAO_PER_TAO = 10**9


def link_coldkey(store: Store, *, account_id: int, coldkey: str) -> str:
    """Link `coldkey` (ss58) to the account; its transfers to the deposit address are credited."""
    from bittensor.wallets import is_bittensor_address

    if not is_bittensor_address(coldkey):
        raise EngyError(f"{coldkey!r} is not an ss58 address; give the buyer's coldkey, e.g. 5F…")
    if store.link_coldkey(account_id, coldkey):
        return f"linked coldkey {coldkey} to account {account_id}: its transfers to the deposit address are credited"
    return f"coldkey {coldkey} was already linked to account {account_id}"


def deposits_line(store: Store, account_id: int, *, since: float | None = None) -> str:
    """`deposits  N from the chain, $X` (credited since `since`, when given), for `balance` and `usage`."""
    records = [r for r in store.deposits_of(account_id) if since is None or r.created_at >= since]
    total = sum(record.micro_usd for record in records)
    return f"  deposits  {len(records)} from the chain, {format_usd(total)}  (included in credited)"


def list_deposits(store: Store, *, account_id: int) -> str:
    """The account's deposits, oldest first: extrinsic id, TAO, credit, coldkey, ledger row, block."""
    records = store.deposits_of(account_id)
    if not records:
        return f"account {account_id}: no deposits from the chain"
    lines = [f"account {account_id}: {len(records)} deposit(s) from the chain"]
    for record in records:
        tao = f"{record.amount_rao // RAO_PER_TAO}.{record.amount_rao % RAO_PER_TAO:09d}"
        lines.append(
            f"  {_timestamp(record.created_at)}  deposit {record.extrinsic_id}  {tao} TAO  "
            f"{format_usd(record.micro_usd)}  from {record.coldkey}  ledger #{record.ledger_id}  "
            f"block {record.block_hash}"
        )
    return "\n".join(lines)
