"""What the OpenAI and Anthropic wire-format tests share: one served model, the Qwen output both
encode, the SDKs' HTTP library behind an in-memory transport, and generated event streams.

The two test modules check different formats against different SDKs, so their request builders
and SSE decoders stay in each; what is here is the same for both, so that a change to the
gateway's internal language (`chat.py`, `engy_node.model_output`) is made once for both suites.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hypothesis import strategies as st

try:  # The SDKs' HTTP library: httpx2 since openai 3 and anthropic 2 (which rejects httpx), httpx before.
    import httpx2 as httpx
except ImportError:
    import httpx

from engy_node.gateway.api.chat import Usage
from engy_node.model_output import OutputEvent, ReasoningDelta, TextDelta, ToolCall

MODEL = "Qwen/Qwen3-8B"
MAX_OUTPUT = 8192
SERVED = {"known_models": {MODEL}, "max_output_tokens_for": lambda model: MAX_OUTPUT}
"""The parsers' view of the gateway's catalogue: `parse_…_request(body, **SERVED)`."""

QWEN_OUTPUT = (
    "<think>\nThey want the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
"""Raw miner text with reasoning, text and one tool call, as Qwen3's chat template has it answer."""

USAGE = Usage(prompt_tokens=120, completion_tokens=30, cached_tokens=64)


def mock_http(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    """An HTTP client for an SDK whose every request `handler` answers, with no network."""
    return httpx.Client(transport=httpx.MockTransport(handler))


def stream_response(chunks: list[bytes]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(chunks))


_raw_events = st.lists(
    st.one_of(
        st.text(max_size=6).map(TextDelta),
        st.text(max_size=6).map(ReasoningDelta),
        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2).map(lambda args: json.dumps(args)),
    ),
    max_size=12,
)


@st.composite
def event_batches(draw: st.DrawFn) -> tuple[list[OutputEvent], list[list[OutputEvent]]]:
    """Any sequence of output events (empty texts included, tool calls numbered as the parser
    numbers them), and the same events cut into the batches a stream's reads deliver them in."""
    events: list[OutputEvent] = []
    calls = 0
    for item in draw(_raw_events):
        if isinstance(item, str):  # a tool call's arguments
            events.append(ToolCall(index=calls, id=f"call_p_{calls}", name="f", arguments=item))
            calls += 1
        else:
            events.append(item)
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(events)), max_size=4)))
    return events, [events[start:end] for start, end in zip([0, *cuts], [*cuts, len(events)])]
