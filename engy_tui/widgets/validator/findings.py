"""The "Warnings" block: what must the operator act on?

Each finding says what is wrong and what to do about it (`Finding`), worst first: not
registered, no permit, the chain unreachable (with its error), the provider giving no usable
payload (with its error, and whether a cached vector stands in: the state says, never assumed), a
resubmit interval that does not clear the rate limit, the activity cutoff near or passed, no tick
for too long, dropped hotkeys, a refused submission (with the fix for the chain error it names)
and a last tick that did not go to plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from engy_node.config import ValidatorSection
from engy_node.snapshots import ChainState, ValidatorState
from engy_tui.widgets.cells import NA, Cell, format_duration, short_hotkey
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.validator.common import ERROR, OK, WARN, Line, count_or_na, names_by_ss58, percent_text
from engy_tui.widgets.validator.standing import idle_blocks, own_neuron

__all__ = [
    "DEFAULT_POLL_S",
    "Finding",
    "OUTCOME_FIXES",
    "REFUSAL_FIXES",
    "outage_findings",
    "refusal_fix",
    "validator_warnings",
    "warning_lines",
]

DEFAULT_POLL_S = 300.0
"""`validator.poll_s`'s default: the validator state does not publish its poll interval, so a
tick counts as old after three of these unless the caller or the state says otherwise."""


class Finding(NamedTuple):
    """One warning: what is wrong, and what to do about it."""

    level: Literal["warning", "error"]
    text: str
    fix: str

    def lines(self) -> tuple[Line, Line]:
        """ "✘ what is wrong" (or ⚠), then "  → what to do"."""
        symbol = ERROR if self.level == "error" else WARN
        return (Cell(f"{symbol} {self.text}", self.level),), (Cell(f"  → {self.fix}"),)


REFUSAL_FIXES: tuple[tuple[str, str], ...] = (
    (
        "NeuronNoValidatorPermit",
        "get a validator permit: stake more on this hotkey (permits go to the largest stakes, recomputed each epoch)",
    ),
    ("NotEnoughStakeToSetWeights", "stake more on this hotkey: the subnet sets a minimum stake for weights"),
    ("HotKeyNotRegisteredInSubNet", "register this hotkey on the subnet"),
    (
        "SettingWeightsTooFast",
        "raise validator.resubmit_blocks above the weights rate limit; the next interval retries",
    ),
    ("RateLimitExceeded", "raise validator.resubmit_blocks above the weights rate limit; the next interval retries"),
    ("rate_limited", "raise validator.resubmit_blocks above the weights rate limit; the next interval retries"),
    ("Custom error: 6", "raise validator.resubmit_blocks above the weights rate limit; the next interval retries"),
    ("CommitRevealEnabled", "the subnet now requires commit-reveal: update engy-node"),
    ("IncorrectWeightVersionKey", "update engy-node: the subnet expects another weights version"),
    (
        "transport",
        "the chain endpoint did not answer: check validator.network and the connection; the next interval retries",
    ),
)


def refusal_fix(detail: str | None) -> str:
    """What to do about a refused submission, from the chain error named in its detail."""
    text = detail or ""
    for needle, fix in REFUSAL_FIXES:
        if needle in text:
            return fix
    return "nothing was recorded and the next interval retries; the validator log has the SDK's advice"


OUTCOME_FIXES: dict[str, tuple[Literal["warning", "error"], str, str]] = {
    "fetch-failed": (
        "error",
        "the provider did not answer the last poll and no cached vector exists: nothing is submitted",
        "check validator.provider_url and the provider; the first epoch it serves goes on chain",
    ),
    "resubmitted:cached": (
        "warning",
        "the provider gave no usable payload: the cached vector was resubmitted",
        "check the provider; nothing is lost while the cache lasts",
    ),
    "standby:cached": (
        "warning",
        "no hotkey of the payload is registered: the last landed vector was resubmitted",
        "tell the provider: its payload names hotkeys this subnet does not have",
    ),
    "standby:burn": (
        "warning",
        "no hotkey of the payload is registered: the weights were burned to the subnet owner",
        "check the provider's owner_hotkey and netuid",
    ),
    "skipped:replay": (
        "warning",
        "the provider serves an epoch older than the one on chain (replay guard)",
        "tell the provider; the validator keeps the newer epoch on chain",
    ),
    "chain-failed": (
        "error",
        "the last chain read failed: nothing was submitted",
        "check validator.network and the connection; the next tick retries",
    ),
    "submit-failed": ("error", "the last tick could not submit", "see the submissions below and the validator log"),
    "error": ("error", "the last tick raised an error", "see the validator log (this is a bug if it repeats)"),
}


def outage_findings(validator: ValidatorState) -> list[Finding]:
    """The chain and the provider, each unreachable or not, from the errors the loop published:
    the chain's read error; the provider's (not for a provider with no epoch yet, nor for a
    rejected or replayed payload, which have their own finding), saying whether a cached vector
    stands in, as the state says."""
    findings: list[Finding] = []
    chain_error = _text(validator.chain_error)
    if chain_error is not None:
        findings.append(
            Finding(
                "error",
                f"chain unreachable: {chain_error}",
                "check validator.network and the connection; nothing is submitted until a read succeeds, "
                "and the next tick retries",
            )
        )
    provider_error = _text(validator.provider_error)
    outcome = _text(validator.last_outcome) or ""
    if provider_error is None or outcome in ("no-epoch-yet", "skipped:replay") or outcome.startswith("rejected:"):
        return findings
    check = "check validator.provider_url and the provider"
    epoch = f"epoch {validator.last_applied} " if validator.last_applied is not None else ""
    if validator.cached_vector is True:
        when = "once the chain answers" if chain_error is not None else "every resubmit interval"
        findings.append(
            Finding(
                "warning",
                f"the provider gave no usable payload: {provider_error}",
                f"{check}; meanwhile the cached {epoch}vector is resubmitted {when}",
            )
        )
    elif validator.cached_vector is False:
        findings.append(
            Finding(
                "error",
                f"the provider gave no usable payload: {provider_error}; no cached vector exists, so nothing "
                "is submitted",
                f"{check}; the first epoch it serves goes on chain",
            )
        )
    else:
        findings.append(Finding("warning", f"the provider gave no usable payload: {provider_error}", check))
    return findings


def validator_warnings(
    validator: ValidatorState | None,
    chain: ChainState | None,
    now: float,
    *,
    names: Mapping[str, str] | None = None,
    poll_s: float | None = None,
) -> list[Finding]:
    """Everything about this validator an operator must act on, worst first, each with its fix:
    not registered, no permit, an interval that does not clear the rate limit, the activity
    cutoff coming near or passed, an old last tick (more than three polls: `poll_s`, else the
    state's `poll_s`, else `DEFAULT_POLL_S`), dropped hotkeys, a refused last submission, and a
    last tick that did not go to plan."""
    if validator is None or validator == ValidatorState():
        return []
    findings: list[Finding] = []
    me = own_neuron(validator, chain)
    netuid = validator.netuid
    where = f"netuid {netuid}" if netuid is not None else "the subnet"
    who = short_hotkey(validator.hotkey, names_by_ss58(names))
    if me.registered is False:
        findings.append(
            Finding(
                "error",
                f"hotkey {who} is not registered on {where}",
                f"register it (btcli subnets register --netuid {count_or_na(netuid)}); until then every submit is refused",
            )
        )
    elif me.permit is False:
        findings.append(
            Finding(
                "error",
                f"uid {count_or_na(me.uid)} has no validator permit: the chain refuses its weights",
                "stake more on this hotkey (permits go to the largest stakes, recomputed each epoch)",
            )
        )
    outages = outage_findings(validator)
    findings += outages
    # What the outage findings say in full, the tick's outcome would only repeat.
    covered = {"chain-failed"} if _text(validator.chain_error) is not None else set()
    if len(outages) > len(covered):
        covered |= {"fetch-failed", "resubmitted:cached"}

    interval = validator.resubmit_blocks
    limit = validator.weights_rate_limit
    if interval is not None and limit is not None and interval <= limit:
        findings.append(
            Finding(
                "warning",
                f"resubmit interval {interval:,} blocks does not clear the weights rate limit of {limit:,}",
                f"set validator.resubmit_blocks above {limit:,} (default {ValidatorSection().resubmit_blocks}), or the "
                "chain refuses resubmits as too fast",
            )
        )

    cutoff = validator.activity_cutoff
    idle = idle_blocks(validator, chain)
    if cutoff is not None and idle is not None and me.registered is not False:
        if idle > cutoff:
            findings.append(
                Finding(
                    "error",
                    f"{idle:,} blocks since this validator's last update, past the activity "
                    f"cutoff of {cutoff:,}: out of consensus, earning nothing",
                    "a landed submit restores it: fix what the other warnings and the submissions say",
                )
            )
        elif 2 * idle > cutoff:
            findings.append(
                Finding(
                    "warning",
                    f"{idle:,} blocks since this validator's last update: {cutoff - idle:,} "
                    f"left before the activity cutoff of {cutoff:,}",
                    "resubmits have stopped landing: see the submissions and the validator log",
                )
            )

    poll = poll_s if poll_s is not None and poll_s > 0 else _num(validator.poll_s)
    poll = poll if poll is not None and poll > 0 else DEFAULT_POLL_S
    tick = _num(validator.last_tick)
    if tick is not None and math.isfinite(now) and now - tick > 3 * poll:
        findings.append(
            Finding(
                "warning",
                f"no tick for {format_duration(now - tick)} (polls every {format_duration(poll)})",
                "the loop may be stuck in a chain call; the watchdog restarts it — see the validator log",
            )
        )

    dropped = validator.dropped
    dropped_share = _num(validator.dropped_share)  # finite
    if dropped_share is not None and dropped_share > 0:
        count = f"{len(dropped)} payload hotkey{'s' if len(dropped) != 1 else ''}" if dropped else "payload hotkeys"
        findings.append(
            Finding(
                "warning",
                f"{count} not registered on chain, {percent_text(dropped_share)} of the weight, dropped",
                "miners that left the subnet; the provider's next epoch should leave them out — "
                "tell the provider if it persists",
            )
        )

    newest = validator.submissions[0] if validator.submissions else None
    refused = newest is not None and not newest.landed
    if newest is not None and refused:
        detail = _text(newest.detail)
        block = newest.block
        at = f" at block {block:,}" if block is not None else ""
        findings.append(Finding("error", f"last submission refused{at}: {detail or NA}", refusal_fix(detail)))

    outcome = _text(validator.last_outcome)
    if outcome is not None:
        known = OUTCOME_FIXES.get(outcome)
        if outcome.startswith("rejected:"):
            known = (
                "warning",
                f"the provider's payload was rejected ({outcome.removeprefix('rejected:')})",
                "check validator.master_hotkey and netuid match the provider; nothing unverified is submitted",
            )
        # A refused submission already has its own warning above.
        if known is not None and not (outcome == "submit-failed" and refused) and outcome not in covered:
            findings.append(Finding(*known))
    findings.sort(key=lambda finding: finding.level != "error")
    return findings


def warning_lines(findings: Sequence[Finding]) -> list[Line]:
    if not findings:
        return [(Cell(f"none {OK}", "ok"),)]
    return [line for finding in findings for line in finding.lines()]
