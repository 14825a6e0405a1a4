"""What the gateway corrects in a miner's answer, from facts it holds (docs/protocol.md, docs/billing.md).

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

Newer peers send an answer's parts apart: reasoning as `reasoning_content`, tool calls as
`tool_calls` (whole or in fragments), the text alone as `content` (null when there is none).
The proven tokens hold the same answer as raw text (`<think>` reasoning, `<tool_call>` blocks),
and the gateway reads the parts out of it with the parser it gives buyers
(`engy_node.model_output`); `structured_account` measures the peer's parts against those, so a peer that
only split its answer as sglang's parsers do is neither refused nor a defect, and one whose
parts say something its tokens do not is a mismatch like any other.

Pure: no IO, no clock. `StopScanner`, `ReplacementHold` and `StructuredParts` keep a little
state across a stream's chunks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from engy_node.model_output import ReasoningDelta, TextDelta, ToolCall, parse_output
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
            return pending[: match.index]
        keep = stop_holdback(pending, self.stops)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

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
        while (
            j < len(proven)
            and (proven[j].isspace() or proven[j] == REPLACEMENT_CHARACTER)
            and not (i < len(text) and text[i] == REPLACEMENT_CHARACTER and proven[j] == REPLACEMENT_CHARACTER)
        ):
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


def corrected_finish(
    *, reported: str, completion_tokens: int, max_tokens: int, ended_by_end_token: bool, stop_matched: bool
) -> Literal["stop", "length"]:
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


@dataclasses.dataclass
class StructuredParts:
    """A peer's answer sent in parts: its reasoning, and its tool calls as `(name, arguments)`
    (the text itself is the flight's miner text). Fragments of a streamed call are merged by
    their `index`, as OpenAI clients merge them: the first names the call, every one adds to its
    arguments. The final message's own parts, complete, replace what was streamed."""

    reasoning: str = ""
    calls: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """index -> [name, arguments text]."""

    def add_calls(self, fragments: Sequence[Mapping[str, Any]]) -> None:
        for position, fragment in enumerate(fragments):
            index = fragment.get("index")
            index = index if isinstance(index, int) and not isinstance(index, bool) else len(self.calls) + position
            given = fragment.get("function")
            function: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
            call = self.calls.setdefault(index, ["", ""])
            if isinstance(function.get("name"), str) and function["name"]:
                call[0] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call[1] += arguments
            elif isinstance(arguments, Mapping):
                call[1] += json.dumps(arguments, ensure_ascii=False)

    def settle(self, message: Mapping[str, Any]) -> None:
        """Take the final message's parts where it has them."""
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            self.reasoning = reasoning
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            self.calls = {}
            self.add_calls([call for call in calls if isinstance(call, Mapping)])

    @property
    def tool_calls(self) -> list[tuple[str, str]]:
        return [(call[0], call[1]) for _, call in sorted(self.calls.items())]


def _loose(value: Any) -> Any:
    """A tool argument as far as fraud goes: scalars by their text (a template's `3` and a
    schema's 3 are one answer), case-folded; containers element by element. The buyer is given
    the proven calls either way; this only decides whether the peer said something else."""
    if isinstance(value, Mapping):
        return {str(key): _loose(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_loose(item) for item in value]
    text = value if isinstance(value, str) else json.dumps(value)
    return text.strip().casefold()


def _same_call(sent: tuple[str, str], proven: ToolCall) -> bool:
    if sent[0] != proven.name:
        return False
    try:
        return _loose(json.loads(sent[1] or "{}")) == _loose(json.loads(proven.arguments))
    except ValueError:
        return "".join(sent[1].split()) == "".join(proven.arguments.split())


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredAccount:
    text: str
    """The prefix of the proven raw text that the peer's parts account for: what the relayed
    tokens are measured as (`accounting.relayed_tokens`)."""
    defect: str | None
    """How the parts differ from the proven ones in presentation only, or None."""


def structured_account(
    content: str, parts: StructuredParts, proven: str, *, tools: Sequence[Mapping[str, Any]] | None = None
) -> StructuredAccount | None:
    """Measure a peer's answer sent in parts (`content`, its reasoning and tool calls) against
    the proven raw text, read into parts as the buyer is given them. None when the parts say
    something the proven text does not: reasoning or text that differ other than in presentation
    (`presentation_match`), or a call the proven text does not make, by name and arguments.

    The account covers the proven text up to what the peer's text covers of the proven text,
    so an answer the gateway cut at a stop string, or whose tail the peer held back, is measured
    as far as it went (calls come after the text in every template, so they count only when the
    text was covered whole)."""
    events = parse_output(proven, call_id_prefix="proven", tools=tools)
    proven_reasoning = "".join(event.text for event in events if isinstance(event, ReasoningDelta))
    proven_content = "".join(event.text for event in events if isinstance(event, TextDelta))
    proven_calls = [event for event in events if isinstance(event, ToolCall)]
    reasoning_covered = presentation_match(parts.reasoning, proven_reasoning)
    content_covered = presentation_match(content, proven_content)
    sent_calls = parts.tool_calls
    if reasoning_covered is None or content_covered is None or len(sent_calls) > len(proven_calls):
        return None
    if not all(_same_call(sent, called) for sent, called in zip(sent_calls, proven_calls)):
        return None
    whole = content_covered == len(proven_content) and reasoning_covered == len(proven_reasoning)
    if whole and len(sent_calls) == len(proven_calls):
        exact = parts.reasoning == proven_reasoning and content == proven_content
        return StructuredAccount(text=proven, defect=None if exact else "whitespace")
    defect = "held-back" if content == proven_content[:content_covered] else "whitespace"
    return StructuredAccount(text=_raw_prefix(proven, proven_content[:content_covered], tools=tools), defect=defect)


def _raw_prefix(proven: str, content: str, *, tools) -> str:
    """The shortest prefix of the proven raw text whose parts include `content` whole: the
    raw text a buyer given `content` (after the reasoning) has in effect received. A longer
    prefix never shows less text (the parser's output grows with its input), so a binary search
    finds it."""

    def shown(end: int) -> str:
        return "".join(
            e.text for e in parse_output(proven[:end], call_id_prefix="p", tools=tools) if isinstance(e, TextDelta)
        )

    low, high = 0, len(proven)
    while low < high:
        middle = (low + high) // 2
        if shown(middle).startswith(content):
            high = middle
        else:
            low = middle + 1
    return proven[:low]
