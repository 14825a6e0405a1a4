"""The proof tee (SPEC §8.7, first half): each response's proof material, in RAM, for a while.

The audit pipeline samples responses and has verifiers recompute them; they need the request's
prompt ids, the served output ids, the commitment and who served it. Buyer content never touches
disk (SPEC §8.3), and token ids are buyer content, so the tee is memory only: bounded in entries
and in age, oldest evicted first. Losing entries on restart is the accepted cost — an unverified
response is `unproven`, which never gates settlement.

No clock reads: `now` comes in with every call.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal

from engy_node.proof import Delivery
from engy_node.protocol.miner import Sampling


@dataclasses.dataclass(frozen=True, slots=True)
class TeeEntry:
    request_id: str
    model: str
    miner: str
    """Miner identity at the gateway: its hotkey, or its miner-key id."""
    kind: Literal["paid", "probe"]
    prompt_ids: tuple[int, ...]
    commitment: dict[str, Any]
    greedy: bool
    sampling: Sampling
    """How the request asked to be sampled, with the seed the gateway drew for it."""
    seeded: bool
    """The miner announced it samples deterministically from that seed: the verifier replays
    its draws (`proof.SamplingTerms.seed`) instead of the statistical test."""
    delivery: Delivery
    """What the buyer received and where the answer ended, which the proof must agree with."""
    created_at: float


class ProofTee:
    def __init__(self, *, ttl_s: float = 3600.0, max_entries: int = 20_000) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("the proof tee needs a positive TTL and room for at least one entry")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, TeeEntry] = collections.OrderedDict()
        self.evicted = 0

    def add(self, entry: TeeEntry, *, now: float) -> None:
        self.expire(now=now)
        self._entries[entry.request_id] = entry
        self._entries.move_to_end(entry.request_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1

    def get(self, request_id: str, *, now: float) -> TeeEntry | None:
        self.expire(now=now)
        return self._entries.get(request_id)

    def take(self, request_id: str, *, now: float) -> TeeEntry | None:
        """Remove and return an entry (an audit job leases it)."""
        self.expire(now=now)
        return self._entries.pop(request_id, None)

    def expire(self, *, now: float) -> None:
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.created_at < self.ttl_s:
                break
            self._entries.popitem(last=False)
            self.evicted += 1

    def __len__(self) -> int:
        return len(self._entries)
