"""The probe corpus: the buyer-like conversations the gateway sends miners as probes.

A probe is a synthetic chat request the gateway sends a miner to check that it serves the model
it claims, fast enough and correctly (`engy_node.gateway.trust.traffic`). Once a worker is `active`,
probes arrive mixed into paid traffic, and they only keep a miner honest if the miner cannot tell
them apart from paid requests: a miner that could recognise probes could serve them faithfully
and cut corners on everything else. `traffic_probes.probe_plan` makes the request's settings
(max_tokens, sampling, streaming) look like buyers'; this corpus makes the conversation itself
look like a buyer's. Each entry is a realistic request of the kind API traffic carries (coding
questions and code review, debugging, SQL and shell, writing and editing, summaries,
translation, maths, explanations, brainstorming, data extraction, support-bot system prompts,
classification, short factual questions), with or without a system prompt, some with prior
turns, from one line to a few paragraphs, mostly English, and with nothing that marks it as a
probe.

Why shipped data. The corpus is a package data file (`data/probe_corpus.jsonl`), so every
gateway sends the same reviewed prompts and anyone can audit what miners are sent. That also
makes it public: a miner can read it and try to match incoming prompts against it. Secrecy is
therefore not the defence; size and variety are. With hundreds of varied conversations that
overlap heavily with what real buyers ask, keeping a matcher up to date and acting on it (and
risking a paid request that happens to resemble a probe) costs more than simply serving every
request honestly. Growing the corpus, or an operator supplying their own with
`load_probe_corpus(path)`, raises that cost further.

Format: JSON Lines, one object per line, `{"messages": [{"role": ..., "content": ...}, ...]}`,
roles `system` (first message only), `user` and `assistant`, every content a non-empty string,
the last message from the user. `load_probe_corpus` checks every line and raises ValueError
naming the first bad one: a corpus that does not load is a packaging or operator error, and it
must fail at start-up, not when a probe is due.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib.resources import files
from pathlib import Path

__all__ = ["ProbePrompt", "load_probe_corpus"]

_ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True, slots=True)
class ProbePrompt:
    """One corpus entry: the chat messages of a buyer-like request, last one from the user.

    The message dicts are shared by every caller of the cached default corpus: read them, and
    copy them (`[dict(m) for m in prompt.messages]`) before building a request that may change
    them.
    """

    messages: tuple[dict[str, str], ...]

    @property
    def chars(self) -> int:
        """Total length of every message's content, in characters."""
        return sum(len(message["content"]) for message in self.messages)


def load_probe_corpus(path: Path | None = None) -> tuple[ProbePrompt, ...]:
    """The probe corpus, from `path` or, by default, the file shipped with the package.

    The default load is cached: the shipped file cannot change while the process runs.

    Raises:
        ValueError: a line that is not a valid entry (see the module docstring), naming its line
            number and the file; or a file with no entries.
        OSError: the file cannot be read.
    """
    if path is None:
        return _default_corpus()
    return _parse(Path(path).read_text(encoding="utf-8"), str(path))


@functools.cache
def _default_corpus() -> tuple[ProbePrompt, ...]:
    resource = files("engy_node") / "data" / "probe_corpus.jsonl"
    return _parse(resource.read_text(encoding="utf-8"), "the shipped probe corpus")


def _parse(text: str, source: str) -> tuple[ProbePrompt, ...]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(_entry(line))
        except ValueError as exc:
            raise ValueError(f"{source}, line {number}: {exc}") from None
    if not prompts:
        raise ValueError(f"{source} holds no entries")
    return tuple(prompts)


def _entry(line: str) -> ProbePrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"an entry must be a JSON object, got {type(obj).__name__}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise ValueError(f"messages[{index}].role must be one of {', '.join(_ROLES)}, got {role!r}")
        if role == "system" and index != 0:
            raise ValueError(f"messages[{index}] is a system message; only the first message may be one")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"messages[{index}].content must be a non-empty string")
        checked.append({"role": role, "content": content})
    if checked[-1]["role"] != "user":
        raise ValueError(f"the last message must be from the user, got {checked[-1]['role']!r}")
    return ProbePrompt(messages=tuple(checked))
