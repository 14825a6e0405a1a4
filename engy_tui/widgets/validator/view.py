"""What the validator tab shows for one "validator" state at one time: each block's lines and
title, and how bad the warnings are (they frame their box). Plain data, so the widget can skip a
repaint when nothing changed by comparing two views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from engy_node.snapshots import ChainState, ValidatorState
from engy_tui.widgets.cells import NA, Cell
from engy_tui.widgets.validator.common import Line
from engy_tui.widgets.validator.findings import validator_warnings, warning_lines
from engy_tui.widgets.validator.next_action import next_action_lines
from engy_tui.widgets.validator.submissions import submission_lines
from engy_tui.widgets.validator.weights import weights_lines

__all__ = [
    "ValidatorView",
    "validator_view",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorView:
    """Everything the validator panel shows for one state at one time."""

    weights_title: str
    weights: tuple[Line, ...]
    next_action: tuple[Line, ...]
    warnings_title: str
    warnings: tuple[Line, ...]
    worst: Literal["none", "warning", "error"]
    submissions_title: str
    submissions: tuple[Line, ...]


def validator_view(
    validator: ValidatorState | None,
    *,
    now: float,
    chain: ChainState | None = None,
    names: Mapping[str, str] | None = None,
    poll_s: float | None = None,
) -> ValidatorView:
    """What the validator panel shows for the hub's "validator" state (None, or nothing in it:
    not reported yet) at wall-clock `now`; `chain` (the hub's "chain" state) and `names`
    ({name: ss58}) when the node has them."""
    if validator is None or validator == ValidatorState():
        waiting = ((Cell("waiting for the validator's first report", "na"),),)
        return ValidatorView(
            "Weights on chain",
            waiting,
            waiting,
            "Warnings",
            ((Cell(NA, "na"),),),
            "none",
            "Submissions (newest first)",
            waiting,
        )
    findings = validator_warnings(validator, chain, now, names=names, poll_s=poll_s)
    worst: Literal["none", "warning", "error"] = (
        "error" if any(f.level == "error" for f in findings) else "warning" if findings else "none"
    )
    epoch = validator.submitted_epoch if validator.submitted_epoch is not None else validator.last_applied
    submissions = validator.submissions
    refused = sum(1 for s in submissions if not s.landed)
    return ValidatorView(
        weights_title="Weights on chain" + (f" · epoch {epoch}" if epoch is not None else ""),
        weights=tuple(weights_lines(validator, names, chain=chain)),
        next_action=tuple(next_action_lines(validator, now, chain=chain)),
        warnings_title="Warnings" + (f" ({len(findings)})" if findings else ""),
        warnings=tuple(warning_lines(findings)),
        worst=worst,
        submissions_title="Submissions (newest first)"
        + (f" · {len(submissions)} kept, {refused} refused" if submissions else ""),
        submissions=tuple(submission_lines(validator, now)),
    )
