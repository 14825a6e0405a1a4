"""The waiting room: where a request waits, briefly, when no eligible miner has room for it.

Answering 503/529 the moment every miner is busy turns a burst into errors that buyers' SDKs
then retry on their own schedule; waiting a few seconds for a slot to free is what they would
rather have. So a request that finds no capacity takes a ticket in its model's queue and waits
up to a deadline (`GatewaySettings.queue_wait_s`) for its turn and a free slot, then gets the
503/529 with `Retry-After` it would have had at once. A queue is bounded
(`GatewaySettings.queue_max`); a request arriving at a full one is refused at once.

Turns are fair across buyers, not first come first served: each model's queue keeps one line
per buyer, and the lines take turns, so a buyer with a hundred requests queued does not make
another buyer's single request wait behind all of them. Within a buyer's line, first come
first served. Only the request whose turn it is tries to dispatch when a slot may have freed;
the others wait, so a freed slot goes to the right request rather than the quickest to wake.

This module is the pure part (tickets and turns, no clock, no IO); `lifecycle.Gateway` waits.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Hashable


@dataclasses.dataclass(eq=False, slots=True)
class Ticket:
    model: str
    buyer: Hashable
    number: int


class WaitingRoom:
    """Per-model queues of tickets, one line per buyer, lines taking turns."""

    def __init__(self, *, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must not be negative")
        self.max_waiting = max_waiting
        self._lines: dict[str, collections.OrderedDict[Hashable, collections.deque[Ticket]]] = {}
        self._depth: collections.Counter[str] = collections.Counter()
        self._numbers = itertools.count()

    def depth(self, model: str) -> int:
        """Tickets waiting for `model`."""
        return self._depth[model]

    def join(self, model: str, buyer: Hashable) -> Ticket | None:
        """A ticket at the back of `buyer`'s line for `model`; None when that queue is full."""
        if self._depth[model] >= self.max_waiting:
            return None
        ticket = Ticket(model, buyer, next(self._numbers))
        self._lines.setdefault(model, collections.OrderedDict()).setdefault(buyer, collections.deque()).append(ticket)
        self._depth[model] += 1
        return ticket

    def turn(self, model: str) -> Ticket | None:
        """The ticket whose turn it is for `model`: the front of the line whose turn it is."""
        lines = self._lines.get(model)
        if not lines:
            return None
        return next(iter(lines.values()))[0]

    def leave(self, ticket: Ticket, *, served: bool) -> None:
        """Take `ticket` out (idempotent). A served ticket ends its line's turn: that line goes to
        the back, and the next buyer's line is up. One that gave up (deadline, hang-up) leaves
        its line's place in the rotation as it was."""
        lines = self._lines.get(ticket.model)
        if lines is None:
            return
        line = lines.get(ticket.buyer)
        if line is None or ticket not in line:
            return
        line.remove(ticket)
        self._depth[ticket.model] -= 1
        if not line:
            del lines[ticket.buyer]
        elif served:
            lines.move_to_end(ticket.buyer)
        if not lines:
            del self._lines[ticket.model]
            del self._depth[ticket.model]
