"""What the gateway corrects in a miner's answer, from facts it holds (SPEC §4, §8.9).

Miners the gateway does not control get some things wrong, and the buyer must not see it: the
public one-file miner reports `finish_reason: "stop"` even when the answer hit `max_tokens`, and
it ignores stop strings (it is always greedy). The gateway holds the facts that settle both: the
request's `max_tokens` and stop strings, the completion tokens it bills, and whether the
committed output ends with the model's end-of-answer token. A miner that got them right is not
changed by any of this: applying a stop string twice, or confirming a true `length`, is a no-op.

Pure: no IO, no clock. `StopScanner` keeps a little state across a stream's chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from engy_node.serve.sampling import find_stop, stop_holdback


class StopScanner:
    """Applies the buyer's stop strings to relayed text, whether or not the miner did.

    Text goes in as it arrives; what comes out may be relayed at once: everything before the
    first stop string, less a tail that could still become one (held until the next text shows
    it did not). After a match nothing more comes out, and `matched` names the stop string.
    With no stop strings, text passes straight through.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stop for stop in stops if stop)
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        pending = self.held + text
        match = find_stop(pending, self.stops)
        if match is not None:
            self.matched, self.held = match.matched, ""
            return pending[:match.index]
        keep = stop_holdback(pending, self.stops)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def finish(self) -> str:
        """At the end of the answer: the held tail, which never became a stop string."""
        tail, self.held = self.held, ""
        return "" if self.matched is not None else tail


def corrected_finish(*, reported: str, completion_tokens: int, max_tokens: int, ended_by_end_token: bool,
                     stop_matched: bool) -> Literal["stop", "length"]:
    """The real finish reason of an answer.

    `stop` when a stop string ended it. Otherwise `length` when the billed completion reached
    `max_tokens` and the committed output does not end with the model's end-of-answer token
    (an answer can end naturally on its last allowed token, and then it did stop). Otherwise
    what the miner reported, read as `length` or `stop`.
    """
    if stop_matched:
        return "stop"
    if completion_tokens >= max_tokens and not ended_by_end_token:
        return "length"
    return "length" if reported == "length" else "stop"
