"""Which miner worker serves a buyer request: the gateway's routing decision (docs/architecture.md, "Routing").

Pure: no IO, no clock reads, no randomness. The same workers and request always give the same
worker, so every gateway worker process sends a conversation to the same miner without sharing
any state, and tests replay decisions exactly.

Two steps. `prefix_key` reduces a request to a key naming its cacheable head (the tools, the
messages through the first user turn, each part capped), a key that does not change as the
conversation grows. The choice itself is `route_table.RouteTable.choose`: the pool keeps one
table per model, updated as legs come, go and change, so a decision reads a few entries rather
than every worker. Among the workers with a free slot that this request has not already failed
on, narrowed to those that honour what it needs while any has room: the highest priority class;
then, with a key, the first worker in the key's order (a weighted hash race, so each worker is
home to a share of keys proportional to its capacity and a join or leave moves only that
worker's keys) within the load bound, and without one, round-robin over the least-loaded
workers. `choose` here is the same decision over a list of candidates, for callers that hold a
handful of workers rather than a table (a probe's one miner, tests). `retry_allowed` says
whether a failed dispatch may go to the next worker in the key's order.

What it trusts. Each worker's advertised `capacity` and the pool's `inflight` count, as given.
Health is not judged here (as in sglang's model gateway, routing and health are apart): the traffic plane passes only workers that are
eligible to serve (docs/trust.md), and the router only chooses among them. The request's messages are
buyer input. A buyer can craft prompts whose keys land on a chosen worker, but each such request
is paid for and the load bound caps what any one key can pile on a worker. A miner can raise its
advertised capacity to win a larger share of keys, but capacity already buys traffic under any
load-aware policy, and the breaker pulls a worker that cannot serve what it claims.

Failure posture. A decision returns None when no worker is eligible; the caller answers 503/529.
On well-formed input it never raises. Nonsense arguments (a load factor below 1, a negative
counter, a negative capacity) raise ValueError naming the argument, because they are the
caller's bugs.

The cheaper mistake. Spilling an affinity request to another worker costs one cache miss: the
prefix is prefilled again (about 0.4 ms a token on a 32B model, reference §3.2 C4, so hundreds
of milliseconds for a long agent prompt) on a worker that then caches it too. Leaving it on an
overloaded home worker adds latency to every request on that worker for as long as the hot spot
lasts, and pure stickiness is how cache-aware routers build hot spots (reference §6.7, sglang
#14305). So affinity always gives way to the load bound, never the other way round.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from engy_node.gateway.routing.route_table import DEFAULT_LOAD_FACTOR, Candidate, Choice, Reason, RouteTable

__all__ = [
    "DEFAULT_LOAD_FACTOR",
    "MIN_USEFUL_PREFIX_CHARS",
    "PREFIX_PART_CHARS",
    "Candidate",
    "Choice",
    "Reason",
    "choose",
    "prefix_key",
    "retry_allowed",
]

# Each part of the key (the tools, then each message of the head) counts its first 4,096
# rendered characters, about 1,000 tokens at ~4 characters a token (English BPE; code and CJK
# pack more tokens into a character, so there the cap covers more tokens, which is the safe
# side). Two requests that agree on the first 4,096 characters of every part get the same key
# and go to the same worker. That costs nothing: they share at least ~1,000 tokens of prefix,
# which saves hundreds of milliseconds of prefill when it is cached (reference §3.2 C4), so they
# belong together. Capping every part, not the whole head, keeps a long system prompt or tool
# list from pushing the first user turn out of the key. If it did, every conversation under
# one system prompt would share one worker (sglang #26263). The cap also bounds the hashing
# work per part. smg's prefix_hash keys on the first 256 tokens in all; we key each part.
PREFIX_PART_CHARS = 4096

# A head whose rendering is under 256 characters (~64 tokens) gets no key. A prefix that short
# saves nothing when cached: a forward pass over a few dozen tokens is bound by reading the
# weights, not by the token count, until well past the GPU's compute ridge (~300 tokens for FP8
# weights on an RTX 4090: ~660 TFLOP/s over ~1 TB/s at 2 FLOP per 1-byte parameter). Keying it
# would send every "hi" and "test" from every buyer to one worker. Without a key such requests
# go round-robin. The threshold errs low: keying a head that gains nothing costs little,
# because the load bound caps it, but leaving a long head without a key costs a miss.
MIN_USEFUL_PREFIX_CHARS = 256

# Bumped whenever the key's rendering changes, so keys from two schemes never compare equal.
_KEY_SCHEME = b"engy-prefix/1"


def prefix_key(
    *, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> bytes | None:
    """The routing key of a chat request: 32 bytes, or None when it has no useful prefix.

    The key is the SHA-256 of the request's head, taken part by part: the tools, then the
    messages in order through the first user turn (the system prompt and anything else before
    it, then that turn), then any later messages needed to bring the head to
    `MIN_USEFUL_PREFIX_CHARS`. Each part is rendered as canonical JSON (sorted keys, no spaces)
    and counts its first `PREFIX_PART_CHARS` characters. `tools=None` and `tools=[]` both mean
    no tools.

    Properties the tests pin:

    * Once a conversation that has a user turn has a key, appending turns never changes it. The
      head is fixed by its earliest messages, so every turn of a conversation goes to the worker
      that cached the previous one.
    * The first user turn is always part of the key, so conversations that share a system
      prompt and tools are still told apart (sglang #26263).
    * None means the whole request renders under `MIN_USEFUL_PREFIX_CHARS` even with every
      message counted. Such a request goes round-robin. A conversation that starts short gets
      its key on the first turn that brings it past the threshold and keeps that key. The one
      cache miss this causes is on a history too short to be worth caching.
    """
    parts = [_render(tools) if tools else ""]
    head_chars = len(parts[0])
    first_user = next(
        (index for index, message in enumerate(messages) if message.get("role") == "user"), len(messages) - 1
    )
    for index, message in enumerate(messages):
        part = _render(message)
        parts.append(part)
        head_chars += len(part)
        if index >= first_user and head_chars >= MIN_USEFUL_PREFIX_CHARS:
            break
    if head_chars < MIN_USEFUL_PREFIX_CHARS:
        return None
    digest = hashlib.sha256(_KEY_SCHEME)
    for part in parts:
        # surrogatepass: JSON may carry lone surrogates ("\ud800"), which strict UTF-8 refuses.
        # They are still distinct text, so they hash rather than fail the request.
        encoded = part.encode("utf-8", "surrogatepass")
        # Length-prefixed, so no two different lists of parts hash the same bytes.
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
    return digest.digest()


def choose(
    *,
    candidates: Sequence[Candidate],
    prefix: bytes | None,
    rr_counter: int,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    exclude: Collection[str] = frozenset(),
    needs: frozenset[str] = frozenset(),
    prefer: frozenset[str] = frozenset(),
) -> Choice | None:
    """The worker among `candidates` for one dispatch of a request, or None when none is eligible.

    The decision of `RouteTable.choose` (eligibility, what the request needs, priority, the
    key's order under the load bound, round-robin), over a table holding exactly these
    candidates, all admitted. The table scores every eligible candidate over its ring points
    (about 10 µs each, the points of the last few hundred ids remembered), so it suits a few
    workers, such as a probe's legs of one miner; the pool keeps a table per model instead.
    Candidate order does not matter; a worker id twice is the caller's bug (ValueError).
    """
    table = RouteTable(keyed_search="scan")
    for candidate in candidates:
        table.join(candidate, admitted=True)
    return table.choose(
        prefix=prefix, rr_counter=rr_counter, load_factor=load_factor, exclude=exclude, needs=needs, prefer=prefer
    )


def retry_allowed(*, first_byte_sent: bool, attempts: int, max_attempts: int, time_left_s: float) -> bool:
    """Whether a failed dispatch may be retried on the next candidate.

    `attempts` counts the dispatches already made for this request, the failed one included;
    `time_left_s` is what is left of the request's deadline (`lifecycle.longest_request_s`),
    which every attempt shares: a request with none left is not retried however few miners it
    tried. A retry is allowed only while nothing has reached the buyer: once a byte is relayed,
    the buyer holds part of one miner's answer, and another miner's answer would not continue it
    (reference §7 item 5: never retry a stream midway). The failure then reaches the buyer in
    band. The caller passes the failed workers as `exclude` to `choose`, and a None from it
    ends the retries too.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an integer >= 1 (the failed dispatch counts), got {attempts!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
    if math.isnan(time_left_s):
        raise ValueError("time_left_s must be a number of seconds, got NaN")
    return not first_byte_sent and attempts < max_attempts and time_left_s > 0


def _render(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)[
        :PREFIX_PART_CHARS
    ]


def _plain(value: Any) -> Any:
    # json.dumps takes dicts only; read-only views of messages are Mappings all the same.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"a chat message or tool holds {type(value).__name__}, which has no JSON form")
