"""Which miner worker serves a buyer request: the gateway's routing decision (§8.5).

Pure: no IO, no clock reads, no randomness. The same snapshot and request always give the same
worker, so every gateway worker process sends a conversation to the same miner without sharing
any state, and tests replay decisions exactly.

Two steps, two functions. `prefix_key` reduces a request to a key naming its cacheable head (the
tools, the messages through the first user turn, each part capped), a key that does not change
as the conversation grows. `choose` picks a worker from the candidate snapshot the pool hands it:
only workers with a free slot that this request has not already failed on; the highest priority
class among them; then, with a key, rendezvous (highest-random-weight) hashing bounded by load,
and without one, round-robin over the least-loaded workers. `retry_allowed` says whether a failed
dispatch may go to the next candidate. `capable_pool` narrows the snapshot for a request that
needs something some workers do not honour (sampling, tools) to the workers that do.

What it trusts. The snapshot: each worker's advertised `capacity` and the pool's `inflight`
count, as given. Health is not judged here (smg's split, STYLE §1): the traffic plane passes
only workers that are eligible to serve (§8.6), and the router only chooses among them. The
request's messages are buyer input. A buyer can craft prompts whose keys land on a chosen
worker, but each such request is paid for and the load bound caps what any one key can pile on
a worker. A miner can raise its advertised capacity to win a larger share of keys, but capacity
already buys traffic under any load-aware policy, and the breaker pulls a worker that cannot
serve what it claims.

Failure posture. `choose` returns None when no worker is eligible; the caller answers 503/529.
On a well-formed snapshot it never raises. Nonsense arguments (a load factor below 1, a negative
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

import dataclasses
import hashlib
import json
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any, Literal

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

# A worker takes a keyed request while its load after the assignment stays within 1.25× the
# mean, rounded up to a whole request. 1.25 is smg prefix_hash's default (reference §0 item 2,
# §1a). It is also the ε = 0.25 of consistent hashing with bounded loads (Mirrokni, Thorup and
# Zadimoghaddam 2018), where a hot key's home holds at most 25 % past its fair share before the
# overflow moves to the key's next choices. Those next choices are deterministic, so the hot
# prefix ends up cached on a few workers rather than recomputed on a random one each time.
DEFAULT_LOAD_FACTOR = 1.25

# Bumped whenever the key's rendering changes, so keys from two schemes never compare equal.
_KEY_SCHEME = b"engy-prefix/1"

Reason = Literal["affinity", "affinity-spill", "round-robin", "priority"]
"""Why `choose` picked its worker, for logs and metrics:

* `affinity`: the request has a key, and this worker ranks highest for it among the eligible
  workers of the winning priority class. It is the key's home, or, on a retry, the best one
  left.
* `affinity-spill`: the key's home was over the load bound, so the highest-ranked worker within
  the bound took the request.
* `round-robin`: the request has no key, so the counter picked among the least-loaded workers.
* `priority`: the highest priority class had a single eligible worker and lower classes had
  others, so priority alone decided.
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One worker (a miner's leg) in the pool's snapshot. Worker ids are unique in a snapshot."""

    worker_id: str
    capacity: int
    """Requests the worker accepts at once, as it advertised. Zero means it takes none."""
    inflight: int
    """Requests the gateway has on it now. This can exceed `capacity` right after the capacity
    drops, and such a worker just is not eligible."""
    priority: int = 0
    """Higher classes are served first. A lower class gets traffic only while no worker in a
    higher class has a free slot."""
    lacks: frozenset[str] = frozenset()
    """What the worker does not honour of what a request may need (`protocol.miner.FEATURE_*`:
    the public miner answers greedily and without tools); `capable_pool` keeps requests that
    need those off such workers while others have room."""
    first_party: bool = False
    """The operator's own worker. The router does not read it. Eligibility of first-party
    workers is settled before the snapshot reaches the router (§8.6), and any routing preference
    for them is expressed as `priority`, so one lever decides, not two that could disagree."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        for name in ("capacity", "inflight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r} for worker {self.worker_id!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r} for worker {self.worker_id!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    worker_id: str
    reason: Reason


def prefix_key(*, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> bytes | None:
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
    first_user = next((index for index, message in enumerate(messages) if message.get("role") == "user"), len(messages) - 1)
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
    exclude: Container[str] = frozenset(),
) -> Choice | None:
    """The worker for one dispatch of a request, or None when no worker is eligible.

    1. Eligible: `inflight < capacity` and `worker_id` not in `exclude`. A retry passes the
       workers that already failed this request, so with a key the retry goes to the next
       worker in the key's ranking.
    2. Only the highest `priority` class among the eligible workers is considered further.
    3. With a `prefix` (from `prefix_key`), weighted rendezvous hashing. Each worker scores
       `capacity / -ln(u)`, with `u` uniform in (0, 1) from SHA-256 over the prefix and the
       worker id. The worker with the highest score is the key's home, and each worker is home to
       a share of keys proportional to its capacity (with equal capacities this is plain HRW).
       Scores are independent per worker, so adding, removing or resizing one worker moves keys
       only to or from that worker. The home takes the request if it is within the load bound;
       otherwise the highest-scored worker within the bound takes it (`affinity-spill`).

       The load bound. Let m = the class's in-flight requests + 1 (this request) and C = the
       class's total capacity. The mean load after the assignment is m / C. A worker is within
       the bound when its own load after the assignment stays within `load_factor` × that mean,
       rounded up to a whole request: `inflight + 1 <= ceil(load_factor * m * capacity / C)`,
       that is `inflight * C < load_factor * m * capacity` (exact for a dyadic factor such as
       1.25). Without the rounding, the first request on an idle cluster of two or more workers
       would already exceed 1.25× the mean, and affinity would be lost exactly when keeping it
       costs nothing. With `load_factor >= 1` some worker is always within the bound: the
       bounds sum to at least `load_factor * m >= m` slots, more than the m - 1 requests in
       flight (pigeonhole). So the walk always ends and no least-loaded fallback is needed.
       While a class of n equal workers has m <= n / load_factor requests, every worker's
       bound is one request. A second concurrent request for a key whose home is busy then
       goes to the key's next choice, which comes to cache the prefix as well.
    4. Without a prefix, round-robin over the least-loaded workers. The class's workers whose
       load `inflight / capacity` equals the class minimum (compared exactly, as integer cross
       products), sorted by `worker_id`; the pick is the one at `rr_counter % len(them)`. While
       the loads are equal, as in a lightly used cluster, the counter visits every worker once per
       cycle. Otherwise the least-loaded workers take turns.

    The caller increments `rr_counter` once per unkeyed request. Candidates that arrive sorted
    by worker id make the round-robin sort one linear pass.
    """
    if not (math.isfinite(load_factor) and load_factor >= 1):
        raise ValueError(f"load_factor must be finite and >= 1, got {load_factor!r}")
    if isinstance(rr_counter, bool) or not isinstance(rr_counter, int) or rr_counter < 0:
        raise ValueError(f"rr_counter must be an integer >= 0, got {rr_counter!r}")
    eligible = [c for c in candidates if c.inflight < c.capacity and c.worker_id not in exclude]
    if not eligible:
        return None
    top_priority = max(c.priority for c in eligible)
    top_class = [c for c in eligible if c.priority == top_priority]
    if len(top_class) == 1 and len(eligible) > 1:
        return Choice(top_class[0].worker_id, "priority")
    if prefix is None:
        return Choice(_round_robin(top_class, rr_counter).worker_id, "round-robin")
    return _rendezvous(top_class, prefix, load_factor)


def capable_pool(*, candidates: Sequence[Candidate], needs: frozenset[str], prefer: frozenset[str] = frozenset(),
                 exclude: Container[str] = frozenset()) -> Sequence[Candidate]:
    """The workers `choose` should pick among for a request that `needs` these features and would
    rather also get the ones in `prefer`.

    A request that needs and prefers nothing may go to any worker. Otherwise it goes to the
    workers that lack none of what it needs or prefers while any of them has a free slot, else
    to those that lack none of what it needs, else to all, because an answer without (say)
    sampling serves the buyer better than a 503. The caller reads what the chosen worker lacks
    (`needs & chosen.lacks`) and records it.
    """
    for wanted in (needs | prefer, needs):
        if not wanted:
            return candidates
        capable = [c for c in candidates if not wanted & c.lacks]
        if any(c.inflight < c.capacity and c.worker_id not in exclude for c in capable):
            return capable
    return candidates


def retry_allowed(*, first_byte_sent: bool, attempts: int, max_attempts: int) -> bool:
    """Whether a failed dispatch may be retried on the next candidate.

    `attempts` counts the dispatches already made for this request, the failed one included.
    A retry is allowed only while nothing has reached the buyer: once a byte is relayed, the
    buyer holds part of one miner's answer, and another miner's answer would not continue it
    (reference §7 item 5: never retry a stream midway). The failure then reaches the buyer in
    band. The caller passes the failed workers as `exclude` to `choose`, and a None from it
    ends the retries too.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an integer >= 1 (the failed dispatch counts), got {attempts!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
    return not first_byte_sent and attempts < max_attempts


def _render(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)[:PREFIX_PART_CHARS]


def _plain(value: Any) -> Any:
    # json.dumps takes dicts only; read-only views of messages are Mappings all the same.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"a chat message or tool holds {type(value).__name__}, which has no JSON form")


def _round_robin(workers: list[Candidate], rr_counter: int) -> Candidate:
    least = workers[0]
    for worker in workers:
        if worker.inflight * least.capacity < least.inflight * worker.capacity:
            least = worker
    tier = sorted(
        (w for w in workers if w.inflight * least.capacity == least.inflight * w.capacity),
        key=attrgetter("worker_id"),
    )
    return tier[rr_counter % len(tier)]


def _rendezvous(workers: list[Candidate], prefix: bytes, load_factor: float) -> Choice:
    total_capacity = sum(w.capacity for w in workers)
    slots_demanded = load_factor * (sum(w.inflight for w in workers) + 1)
    # Length-prefixed, so (prefix, worker id) pairs never run together into the same bytes.
    salt = len(prefix).to_bytes(8, "big") + prefix
    digests = [hashlib.sha256(salt + w.worker_id.encode()).digest() for w in workers]
    home = _highest_score(zip(digests, workers))
    if home.inflight * total_capacity < slots_demanded * home.capacity:
        return Choice(home.worker_id, "affinity")
    spill = _highest_score(
        (digest, worker) for digest, worker in zip(digests, workers)
        if worker.inflight * total_capacity < slots_demanded * worker.capacity
    )
    return Choice(spill.worker_id, "affinity-spill")


def _highest_score(scored: Iterable[tuple[bytes, Candidate]]) -> Candidate:
    """The worker with the highest (score, digest), where score = capacity / -ln(u).

    Workers of one capacity rank by digest alone: u rises with the digest and the score with
    u. So only the best digest of each capacity pays for the float score: a few logs a decision
    rather than one per worker, which more than halves a keyed decision at 10,000 workers
    (bench/router_decision.py).
    Comparing the digest as well breaks an exact tie the same way whatever the candidates'
    order. Callers pass at least one worker: the spill walk has one by the pigeonhole argument
    in `choose`.
    """
    best_by_capacity: dict[int, tuple[bytes, Candidate]] = {}
    for digest, worker in scored:
        best = best_by_capacity.get(worker.capacity)
        if best is None or digest > best[0]:
            best_by_capacity[worker.capacity] = (digest, worker)
    return max(best_by_capacity.values(), key=lambda entry: (_score(entry[1].capacity, entry[0]), entry[0]))[1]


def _score(capacity: int, digest: bytes) -> float:
    # The top 53 bits make a float u in (0, 1); -ln(u) is then an exponential draw, and
    # capacity / -ln(u) is highest for a worker with probability proportional to its capacity.
    u = ((int.from_bytes(digest[:8], "big") >> 11) + 0.5) * 2.0**-53
    return capacity / -math.log(u)
