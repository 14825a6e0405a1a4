"""A miner's own newest epoch, served where the miner already connects (`GET /gw/epoch/latest`).

A miner zeroed by a settlement gate must be able to see why on its own machine, wherever it runs.
The published epoch is public (the provider API serves it to validators), but a remote miner
knows only its gateway's miner endpoint (`miner.gateway_url`), not the provider port, which an
operator may keep private. So the miner endpoint answers too, with what concerns one hotkey: its
rows of the newest published `result_json`, its weight, the ceilings of its models and when the
next epoch ends and closes (`engy_node.protocol.gates.epoch_answer`), and the block time of the
gateway's chain where the gateway knows it, so a miner started on its own counts blocks to that
end in the gateway's chain's (a local network's dev chain makes one a second, not subtensor's 12).
Every worker process and every host of a fleet answers it from the shared store, so it works
behind a load balancer too.

The answer is read from the stored payload, the exact bytes validators fetch, never re-settled;
the parsed result of the newest epoch is kept, so a miner polling costs one small store read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engy_node.gateway.billing.epochs import EpochClock
from engy_node.gateway.store import Store
from engy_node.protocol.gates import GateTerms, epoch_answer


class MinerEpochs:
    """`answer(hotkey)`: the newest published epoch as `hotkey` sees it, or None before the first.
    `block_time_s`: the gateway's chain's block time, told with every answer; None (unknown)
    leaves it out."""

    def __init__(
        self,
        *,
        store: Store,
        clock: EpochClock,
        terms: Mapping[str, GateTerms],
        block_time_s: float | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.terms = dict(terms)
        self.block_time_s = block_time_s
        self._parsed: tuple[int, dict[str, Any]] | None = None

    async def answer(self, hotkey: str) -> dict[str, Any] | None:
        latest = await self.store.run(self.store.latest_epoch)
        if latest is None:
            return None
        index, payload = latest
        if self._parsed is None or self._parsed[0] != index:
            self._parsed = (index, json.loads(json.loads(payload)["result_json"]))
        return epoch_answer(
            self._parsed[1],
            hotkey=hotkey,
            terms=self.terms,
            epoch_s=self.clock.epoch_s,
            grace_s=self.clock.grace_s,
            block_time_s=self.block_time_s,
        )
