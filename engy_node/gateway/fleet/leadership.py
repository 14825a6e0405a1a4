"""Which gateway host of a fleet closes epochs and runs the traffic control plane: the one that
holds the store's `leader` lease (`store.leases`), renewed while it runs and handed back when it
stops.

Why a lease in the store, not a lock held by a connection: every host already depends on the
store, and a lease there needs no extra channel between hosts, outlives a dropped connection by
a bounded time rather than by none or forever, and is the same on SQLite (several gateways on
one file) and PostgreSQL. A host that dies stops renewing; another takes the lease once it
expires (`LEASE_TTL_S`), so a crashed leader costs at most that long without epoch closing or
traffic decisions, both of which tolerate it (an epoch closes a grace period after it ends).

When a host may act. Only while its own view of the lease is current: `leading` turns false
`LEASE_TTL_S - SAFETY_S` after the claim that granted it was sent, measured on this host's
monotonic clock, so a host cut off from the store stops acting before any other could take over.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from engy_node.gateway.store import Store, StoreError

log = logging.getLogger("engy.gateway.fleet")

LEADER_LEASE = "leader"
LEASE_TTL_S = 30.0
RENEW_S = 10.0
"""Three renewals per lease: two may fail (a slow store, a restart of it) before the lease lapses."""
SAFETY_S = 5.0
"""How long before the lease's end this host stops acting on it: margin for clock drift between
hosts and for the claim's own round trip."""


class Leadership:
    """This host's claim on the leader lease. `run` keeps claiming; `leading` says whether this
    host may act as leader now; `changed` is set when a claim finds that changed (a lease that
    lapses between claims turns `leading` false by itself: `while_leading` watches for that)."""

    def __init__(
        self,
        store: Store,
        *,
        holder: str,
        ttl_s: float = LEASE_TTL_S,
        renew_s: float = RENEW_S,
        safety_s: float = SAFETY_S,
        monotonic: Callable[[], float] = trio.current_time,
    ) -> None:
        if not 0 < safety_s < ttl_s or not 0 < renew_s < ttl_s - safety_s:
            raise ValueError(
                f"a lease of {ttl_s:g} s needs 0 < safety ({safety_s:g}) and renewals ({renew_s:g} s) well inside it"
            )
        self.store = store
        self.holder = holder
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.safety_s = safety_s
        self.monotonic = monotonic
        self.leader: str | None = None
        """Who held the lease at the last claim (None before the first answer)."""
        self._valid_until = -float("inf")
        self.changed = trio.Event()

    @property
    def leading(self) -> bool:
        return self.monotonic() < self._valid_until

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                was_leading = self.leading
                sent_at = self.monotonic()
                try:
                    holder, _expires_at = await self.store.run(
                        self.store.claim_lease, LEADER_LEASE, holder=self.holder, ttl_s=self.ttl_s
                    )
                except StoreError as error:
                    log.error(
                        "could not renew the leader lease (%s); retrying in %.0f s%s",
                        error,
                        self.renew_s,
                        " (this host stops leading when its lease runs out)" if was_leading else "",
                    )
                else:
                    if holder == self.holder:
                        self._valid_until = sent_at + self.ttl_s - self.safety_s
                    if holder != self.leader:
                        log.info(
                            "%s leads the gateway fleet (closes epochs, runs traffic control)",
                            "this host" if holder == self.holder else f"host {holder}",
                        )
                        self.leader = holder
                if self.leading != was_leading:
                    self._flip()
                await trio.sleep_until(sent_at + self.renew_s)
        finally:
            if self.leading:
                self._valid_until = -float("inf")
                with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                    try:
                        await self.store.run(self.store.release_lease, LEADER_LEASE, holder=self.holder)
                        log.info("handed the leader lease back")
                    except StoreError as error:
                        log.warning("could not hand the leader lease back (%s); it lapses in %.0f s", error, self.ttl_s)

    def _flip(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def while_leading(
        self, job: Callable[[], Awaitable[object]], *, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run `job()` (an async callable, fresh each term) for as long as this host leads,
        cancelling it when it stops leading; start it again on the next term."""
        task_status.started()
        while True:
            while not self.leading:
                await self.changed.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(job)
                while self.leading:
                    with trio.move_on_at(self._valid_until):
                        await self.changed.wait()
                nursery.cancel_scope.cancel(reason="this host no longer leads the fleet")
