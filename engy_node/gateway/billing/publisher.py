"""Closes epochs and publishes them (docs/trust.md, "Epochs"): the shell around `epochs.py`.

Runs in the gateway's first process. When an epoch's close time comes (its end plus the grace
for late verdicts) it settles the epoch from the store's request log and verdicts, builds the
canonical `result_json`, signs it with the master hotkey and stores the payload bytes; the
provider API serves exactly those bytes from then on, after any restart too. An epoch is
published once: the store refuses other bytes for an index it has (`save_epoch`), so a clock
that jumps back, or two gateways on one file, can never publish two different results for one
epoch.

Without a master hotkey nothing is published; `/epoch/current` still shows the settlement so far.

In a fleet (several hosts on one store) only the host holding the leader lease closes epochs
(`leadership.py`): signatures are randomised, so two hosts signing one epoch would publish
different bytes, and the store would refuse the second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import trio

from engy_node.gateway.billing import epochs
from engy_node.gateway.billing.settlement import GateMinimums
from engy_node.gateway.fleet.leadership import Leadership
from engy_node.gateway.store import Store, StoreError
from engy_node.hub import Hub
from engy_node.keys import epoch_digest
from engy_node.models import ModelSpec
from engy_node.protocol.epoch import encode_payload, sign_epoch

log = logging.getLogger("engy.gateway.epochs")

MAX_SLEEP_S = 30.0
"""The loop looks at the clock at least this often (a suspended machine wakes up late)."""
RETRY_S = 10.0
OWNER_NOT_SET = "(gateway.owner_hotkey not set)"
"""Where `/epoch/current` shows the burn going when no owner hotkey is configured."""


class EpochPublisher:
    def __init__(
        self,
        *,
        store: Store,
        clock: epochs.EpochClock,
        netuid: int,
        master,
        owner_hotkey: str,
        models: Mapping[str, ModelSpec],
        minimums: GateMinimums,
        hub: Hub,
        wall: Callable[[], float] = time.time,
        leadership: Leadership | None = None,
    ) -> None:
        self.store = store
        self.leadership = leadership
        """None: this gateway is alone on its store and closes every epoch."""
        self.clock = clock
        self.netuid = netuid
        self.master = master
        """The master hotkey's keypair; None: settle, never publish."""
        self.owner_hotkey = owner_hotkey
        self.models = dict(models)
        self.minimums = minimums
        self.hub = hub
        self.wall = wall
        self.published: list[int] = []

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.master is None:
            log.warning(
                "epochs are settled but not published: set gateway.master_wallet (NAME/HOTKEY) and "
                "gateway.owner_hotkey to sign and serve them"
            )
            task_status.started()
            await trio.sleep_forever()
        first_seen = await self.store.run(self.store.first_request_at) or self.wall()
        task_status.started()
        while True:
            now = self.wall()
            if self.leadership is not None and not self.leadership.leading:
                with trio.move_on_after(MAX_SLEEP_S):
                    await self.leadership.changed.wait()
                continue
            try:
                latest = await self.store.run(self.store.latest_epoch)
                due = self.clock.due(
                    now=now, last_published=None if latest is None else latest[0], first_seen=first_seen
                )
                for index in due:
                    await self.close(index)
            except StoreError as error:
                log.error("could not close epochs (%s); retrying in %.0f s", error, RETRY_S)
                await trio.sleep(RETRY_S)
                continue
            next_close = self.clock.closes_at(self.clock.index_at(now - self.clock.grace_s))
            await trio.sleep(min(MAX_SLEEP_S, max(0.05, next_close - self.wall())))

    async def _rows(self, index: int, *, until: float | None = None):
        start, window_end = self.clock.window(index)
        end = window_end if until is None else min(window_end, until)
        entries = await self.store.run(self.store.requests_in, since=start, until=end)
        verdicts = await self.store.run(self.store.verdict_counts, since=start, until=end)
        hotkeys = await self._hotkeys({entry.miner for entry in entries if entry.miner} | set(verdicts))
        return entries, verdicts, hotkeys

    async def settle(self, index: int) -> epochs.SettledEpoch:
        entries, verdicts, hotkeys = await self._rows(index)
        return epochs.settle(
            clock=self.clock,
            index=index,
            netuid=self.netuid,
            entries=entries,
            verdicts=verdicts,
            hotkeys=hotkeys,
            models=self.models,
            owner_hotkey=self.owner_hotkey,
            minimums=self.minimums,
        )

    async def close(self, index: int) -> bytes:
        settled = await self.settle(index)
        payload = encode_payload(
            sign_epoch(self.master, netuid=self.netuid, epoch_index=index, result_json=settled.result_json)
        )
        digest = epoch_digest(settled.result_json)
        inserted = await self.store.run(self.store.save_epoch, index, payload, digest, closed_at=self.wall())
        if inserted:
            self.published.append(index)
            weights = ", ".join(f"{hotkey[:8]}…={weight}" for hotkey, weight in settled.settlement.weights)
            gated = [
                f"{row.hotkey[:8]}…/{row.model}: {row.gate_reason}"
                for row in settled.settlement.rows
                if row.gate_reason
            ]
            log.info(
                "epoch %d published (digest %s…): weights %s%s",
                index,
                digest[:12],
                weights,
                f"; gated {', '.join(gated)}" if gated else "",
            )
            self.hub.set_state(
                "epochs", latest=index, digest=digest, weights=[list(pair) for pair in settled.settlement.weights]
            )
        return payload

    async def current(self) -> dict:
        """The epoch in progress, settled so far (unsigned: it is not a result yet)."""
        now = self.wall()
        index = max(self.clock.index_at(now), 0)
        start, end = self.clock.window(index)
        entries, verdicts, hotkeys = await self._rows(index, until=now)
        so_far = epochs.settlement_of(
            entries=entries,
            verdicts=verdicts,
            hotkeys=hotkeys,
            models=self.models,
            owner_hotkey=self.owner_hotkey or OWNER_NOT_SET,
            minimums=self.minimums,
        )
        return {
            "v": 1,
            "netuid": self.netuid,
            "epoch_index": index,
            "start": start,
            "end": end,
            "closes_at": self.clock.closes_at(index),
            "final": False,
            **so_far.to_json(),
        }

    async def _hotkeys(self, identities: set[str]) -> dict[str, str]:
        """Identity -> hotkey: a hotkey-admitted miner is its hotkey; a key-admitted one has the
        hotkey registered with its key, if any."""
        mapping = {identity: identity for identity in identities if not identity.startswith("key:")}
        if any(identity.startswith("key:") for identity in identities):
            for record in await self.store.run(self.store.list_miners):
                if record.hotkey:
                    mapping[f"key:{record.miner_id}"] = record.hotkey
        return mapping
