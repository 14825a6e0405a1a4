"""What the gateway corrects in a miner's answer, from facts it holds (SPEC §4, §8.9).

Miners the gateway does not control get some things wrong, and the buyer must not see it: the
public one-file miner reports `finish_reason: "stop"` even when the answer hit `max_tokens`, and
it ignores stop strings (it is always greedy). The gateway holds the facts that settle both: the
request's `max_tokens` and stop strings, the completion tokens it bills, and whether the
committed output ends with the model's end-of-answer token. A miner that got them right is not
changed by any of this: applying a stop string twice, or confirming a true `length`, is a no-op.

Peers also get the text wrong around the tokens they proved: a stream that holds back a tail and
drops it, spaces lost where a stream was sliced out of cumulative text, a U+FFFD streamed for a
character whose bytes had not all arrived. The proven tokens settle that too: the buyer is given
their decode (`presentation_match` says how far a peer's text covers it), and a peer whose text
differs from it only in presentation has a defect to fix, not a fraud to answer for.

Pure: no IO, no clock. `StopScanner` and `ReplacementHold` keep a little state across a
stream's chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from engy_node.serve.sampling import REPLACEMENT_CHARACTER, find_stop, stop_holdback


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


class ReplacementHold:
    """Keeps U+FFFD a peer streams for a character still incomplete from reaching the buyer.

    sglang never streams one (its detokenizer holds incomplete bytes back), but a peer slicing
    a server's cumulative text that does not hold them back sends U+FFFD and then the text after
    the character, never the character itself. A run of U+FFFD at the end of what has arrived is
    held; when more text follows, the run is dropped, since what it stood for cannot be known
    until the proven tokens come (`presentation_match` then accounts for it). At the end of the
    answer a held run is simply not sent: the relay sends what the buyer lacks of the proven
    text, which has the run only if the model produced it.
    """

    def __init__(self) -> None:
        self.holding = False

    def feed(self, text: str) -> str:
        if self.holding:
            text = text.lstrip(REPLACEMENT_CHARACTER)  # the rest of the run being held
        if not text:
            return ""
        settled = text.rstrip(REPLACEMENT_CHARACTER)
        self.holding = len(settled) < len(text)
        return settled


def presentation_match(text: str, proven: str) -> int | None:
    """How much of `proven` (the decode of the proven tokens) a peer's `text` covers, as an end
    index into it, when the two differ only in presentation; None when they differ in content.

    Presentation is whitespace (added, lost or changed anywhere), and U+FFFD: a run of them in
    `text` stands for one or more non-ASCII characters of `proven` (bytes of one multi-byte
    character, or a replacement the model's own bytes produced), and a U+FFFD in `proven` may be
    missing from `text`. Every other character must appear in the same order in both. The end
    index falls after the last character `text` accounts for, and after the whitespace that
    follows it only when `text` ends with whitespace too.
    """
    i = j = covered = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        while j < len(proven) and (proven[j].isspace() or proven[j] == REPLACEMENT_CHARACTER) and not (
                i < len(text) and text[i] == REPLACEMENT_CHARACTER and proven[j] == REPLACEMENT_CHARACTER):
            j += 1
        if i == len(text):
            break
        if j < len(proven) and text[i] == proven[j]:
            i += 1
            j += 1
        elif text[i] == REPLACEMENT_CHARACTER:
            while i < len(text) and text[i] == REPLACEMENT_CHARACTER:
                i += 1
            if j == len(proven) or proven[j].isascii():
                return None
            j += 1
            following = next((ch for ch in text[i:] if not ch.isspace()), None)
            while j < len(proven) and not proven[j].isascii() and not proven[j].isspace() and proven[j] != following:
                j += 1
        else:
            return None
        covered = j
    return j if text and text[-1].isspace() else covered


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
