"""What a request must pass before the gateway spends real work on it.

Rendering and tokenising a conversation costs CPU in proportion to its size (about 0.4 s per MB
of text on this project's 2-core machine), and a hostile buyer picks the size. So the order of
a request's checks is cheapest first: the key (cached), the body's size (read no further than
the cap), then the conversation's size against the model's input limit — without the tokenizer,
by a floor on its token count that no tokenisation can beat — and, for a conversation large
enough that tokenising it costs more than a store read, the balance against the smallest hold
the request could need. Only then is it tokenised, and the hold made on the exact count.

The floor: a tokenizer turns a text of B UTF-8 bytes into at least ceil(B / L) tokens, where L
is the byte length of its longest token's text (`ServedModel.max_token_bytes`), because the
tokens' texts concatenate back to the input. A chat template copies each message's content into
the prompt (stripping at most the whitespace around it), so the contents' stripped bytes bound
the prompt from below. A tokenizer that normalises its input may drop bytes, so none of this is
claimed for one (`max_token_bytes` is None there) and only the exact count decides.

Everything here is pure: sizes in, a verdict out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from engy_node.gateway.api.chat import ChatRequest


@dataclasses.dataclass(frozen=True, slots=True)
class PromptSize:
    """How big a conversation is before it is rendered."""

    chars: int
    """Characters of every text the template will render (contents, tool calls, tool schemas)."""
    content_bytes: int
    """UTF-8 bytes of the message contents alone, stripped: what the prompt copies verbatim."""


def _contents(chat: ChatRequest) -> Iterable[str]:
    for message in chat.messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content


def prompt_size(chat: ChatRequest) -> PromptSize:
    """The conversation's size, in one pass over its texts (C-speed string operations only)."""
    chars = 0
    content_bytes = 0
    for message in chat.messages:
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
            stripped = content.strip()
            # An ASCII text's bytes are its characters: skip the encode for most conversations.
            content_bytes += len(stripped) if stripped.isascii() else len(stripped.encode("utf-8", "surrogatepass"))
        elif content is not None:
            chars += len(str(content))
        if message.get("tool_calls"):
            chars += len(str(message["tool_calls"]))
    if chat.tools:
        chars += len(str(chat.tools))
    return PromptSize(chars=chars, content_bytes=content_bytes)


def token_floor(size: PromptSize, *, max_token_bytes: int | None) -> int:
    """A number of prompt tokens the rendered conversation certainly reaches (0: none known)."""
    if not max_token_bytes or max_token_bytes <= 0:
        return 0
    return -(-size.content_bytes // max_token_bytes)


def too_long(size: PromptSize, *, floor: int, max_input_tokens: int, model: str) -> str | None:
    """Why the conversation cannot fit the model's input, known without tokenising, or None."""
    if floor > max_input_tokens:
        return (
            f"the prompt is at least {floor} tokens ({size.content_bytes} bytes of message text); {model} accepts at "
            f"most {max_input_tokens}: shorten the conversation"
        )
    return None
