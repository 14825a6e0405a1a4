"""One buyer request in flight, as data: what the steps of its life read and write.

`Flight` is the request from `Gateway.begin` to its log row (what was asked, the hold, the miner
serving it, what was relayed); `Accounting` is what its finished answer is accounted for as, once
checked against the miner's commitment (`accountant.Accountant.account_for`); `new_request_id`
names requests; `AuditSink` is where sampled answers' proof material goes. Plain data, so that
`lifecycle.py`, `relay.py` and `accountant.py` share it without importing one another's steps.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Literal, Protocol

from engy_node.gateway.api.chat import ApiName, ChatRequest
from engy_node.gateway.request.corrections import StructuredParts
from engy_node.gateway.routing.pool import PendingRequest
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import FEATURE_SAMPLING, ServeRequest
from engy_node.served_model import ServedModel


class AuditSink(Protocol):
    """Where sampled responses' proof material goes: the audit desk, or the link to it."""

    def offer(self, job: AuditJob) -> None: ...


@dataclasses.dataclass
class Flight:
    """One buyer request in progress."""

    request_id: str
    api: ApiName
    account_id: int | None
    """None for a probe."""
    chat: ChatRequest
    serve: ServeRequest
    model: ServedModel
    prompt_ids: list[int]
    hold: Any
    """The billing hold; None for a probe, which nobody pays for."""
    started: float
    pending: PendingRequest | None = None
    miner: str = ""
    relayed_text: str = ""
    """What the buyer has been sent of the answer."""
    miner_text: str = ""
    """What the miner sent of the answer's text (up to the stop string that ended it), before
    the gateway repaired it to the proven text: the delivery its verdict judges."""
    miner_parts: StructuredParts | None = None
    """The reasoning and tool calls of a miner that sent its answer in parts (None: one that
    sent raw text, its reasoning and calls inside it)."""
    created: int = 0
    """Wall-clock seconds when the request began (the APIs' `created`)."""
    first_output_at: float | None = None
    tried: set[str] = dataclasses.field(default_factory=set)
    seeded: bool = False
    """The miner serving it samples deterministically from the request's seed."""
    unmet: frozenset[str] = frozenset()
    """What the request needed that the miner serving it does not honour (no capable miner had room)."""
    kind: Literal["paid", "probe"] = "paid"
    target: str | None = None
    """A probe's miner (identity): it goes there or nowhere."""
    key_id: int | None = None
    """The API key that sent it (None: a probe); its usage is reported per key."""
    charged: int | None = None
    """µUSD the ledger charged for it, once settled (None: not settled, or a probe)."""
    audited: bool = False
    """Its answer was offered to the audit: a verdict on it is to come."""

    @property
    def delivered_text(self) -> str:
        """The miner's answer as the model's raw text, as far as it can be told without a proof:
        the text itself, after its reasoning in the `<think>` block the chat templates write.
        Tool calls sent in parts are left out: their raw form (JSON or XML) is the model's own,
        and the answer's tokens up to them are judged as a prefix."""
        if self.miner_parts is None or not self.miner_parts.reasoning:
            return self.miner_text
        return f"<think>\n{self.miner_parts.reasoning}\n</think>\n\n{self.miner_text}"

    @property
    def served_greedily(self) -> bool:
        """The buyer asked to sample, and a miner that answers greedily served it."""
        return FEATURE_SAMPLING in self.unmet


@dataclasses.dataclass(frozen=True, slots=True)
class Accounting:
    """What settlement needs from a finished answer (`accountant.Accountant.account_for`)."""

    claim: dict | None
    """The miner's output with `committed_completion` added, when its commitment could be read."""
    relayed_tokens: int
    """Completion tokens the buyer received."""
    output_ids: tuple[int, ...] | None
    """The committed output token ids (None: no readable commitment)."""
    stop: str | None
    """The stop string the answer ended at, when one did."""
    refused: str | None = None
    """Why the answer is proven wrong before its delivery ended (`prompt-mismatch`: the proof
    covers another prompt; `output-mismatch`: the miner's text is not what its tokens decode
    to): it is not delivered whole nor charged, and the miner is recorded as a cheat."""
    proven_text: str | None = None
    """What the buyer is to be given: the decode of the proven tokens, up to the stop string
    that ended the answer (None: nothing proven to repair the miner's text to)."""


def new_request_id() -> str:
    """A request id: 32 lowercase hex digits, the shape of `uuid4().hex`, at under half its cost
    (no `UUID` object is built): the milliseconds since the Unix epoch in the first 12, then 80
    random bits from the OS.

    Time first, so ids made later sort later, the way UUIDv7 orders them: the store's index of
    holds by request id then grows at its end, where its pages are already in memory. With
    random ids, each hold went to a random page of that index: on a store that had served
    200,000 requests, 2.7 reads and 30 KB written per request rather than 0.4 and 20 KB, and
    1.12× the store's CPU (`bench/store_backends.py --prefill`, `docs/performance.md`).

    Random after that, so ids from any number of processes and hosts do not collide (10^6 ids
    in one millisecond collide with a chance of ~10^-12), and nobody learns the gateway's
    request rate from the ids a miner or a buyer sees; the time in them is the request's, which
    both know. The id is a store `identifier`, and its last 12 digits name the request's tool
    calls (`relay`)."""
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"
