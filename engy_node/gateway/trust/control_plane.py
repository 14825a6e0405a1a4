"""The traffic control plane's shell (docs/trust.md): feeds `traffic.py`'s decisions and acts on them.

`TrafficControl` runs in the gateway's first process. Once a second it

* compares the miners connected to it with the last look (`WorkerConnected` / `WorkerDisconnected`;
  every miner opens a leg to every worker process, so the first process sees them all);
* reads the request-log rows and verdicts written since the last look, by every worker process,
  from the store (`PaidFinished` / `ProbeFinished`, `PaidVerdict` / `ProbeVerdict`): the store is
  already where every process's outcomes land, so nothing else has to travel between processes;
* lets time act (`traffic.tick`), logs every transition with its reason, writes the states that
  changed to the store's `eligibility` table, and publishes every state to the hub with what the
  breaker weighs now (its windows) beside each (miner, model)'s totals since this process
  started (`snapshots.LifetimeCounts`), so a dashboard never shows a window as a total;
* sends the probes that are due (`traffic_probes.next_probe_at`, `traffic_probes.probe_plan` over the shipped
  corpus), each as an ordinary request to that one miner through the same relay buyers get.

`EligibilityView` is what every worker process's router asks: the `eligibility` table, re-read
every `REFRESH_S`. A worker is eligible while it is `active`, or first-party. A miner the table
does not know yet is not eligible: qualification comes first.

Across a restart (or a change of the fleet's leader) the states resume from the `eligibility`
table (`traffic_state.resumed_state`): an active miner that re-dials within the reconnect grace stays
active, a pulled one stays out for the longest cooldown a pull can have, and a round of
qualification under way starts again (its probes are not in the store).

Probes leave from the first process only, so they reach miners on that process's legs; paid
traffic arrives on every leg, the first process's included, and is audited whichever leg it took.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

import trio

from engy_node.gateway.billing.settlement import BUYER_FAULTS, HUNG_UP
from engy_node.gateway.store import EligibilityRow, Store, StoreError
from engy_node.gateway.trust import traffic, traffic_probes, traffic_state
from engy_node.hub import Hub
from engy_node.models import ModelSpec
from engy_node.probe_corpus import ProbePrompt
from engy_node.proof import VerdictKind
from engy_node.snapshots import LifetimeCounts, encode

log = logging.getLogger("engy.gateway.traffic")

TICK_S = 1.0
REFRESH_S = 1.0
"""How often a worker process re-reads eligibility: a pull reaches every process within it."""
PROBE_RETRY_S = 5.0
"""A probe that found its miner with no free slot is tried again this much later."""
ROWS_PER_READ = 1000
HISTORY_PER_WORKER = 20

ProbeSender = Callable[[str, str, traffic_probes.ProbePlan, ProbePrompt], Awaitable[None]]
"""(miner, model, plan, prompt): send one probe and wait for it to end."""


def scaled_policy(*, time_scale: float = 1.0, qualify_probes: int = 20) -> traffic_state.TrafficPolicy:
    """The default policy with every duration multiplied by `time_scale` (local networks run
    minutes-long epochs and cannot wait production's minutes) and rounds of `qualify_probes`."""
    base = traffic_state.TrafficPolicy()
    durations = {
        field.name: getattr(base, field.name) * time_scale
        for field in dataclasses.fields(base)
        if field.name.endswith("_s")
    }
    return dataclasses.replace(base, **durations, min_probes=qualify_probes, max_probes=2 * qualify_probes)


class TrafficControl:
    def __init__(
        self,
        *,
        store: Store,
        connected: Callable[[], set[tuple[str, str]]],
        models: Mapping[str, ModelSpec],
        send_probe: ProbeSender,
        corpus: Sequence[ProbePrompt],
        hub: Hub,
        policy: traffic_state.TrafficPolicy = traffic_state.TrafficPolicy(),
        first_party: Iterable[str] = (),
        max_probe_tokens: int = 0,
        probe_concurrency: int = 16,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.connected = connected
        self.models = dict(models)
        self.send_probe = send_probe
        self.corpus = tuple(corpus)
        self.hub = hub
        self.policy = policy
        self.first_party = frozenset(first_party)
        self.max_probe_tokens = max_probe_tokens
        """Cap on a probe's max_tokens (0: the model's limit, as buyers may ask)."""
        self.probe_concurrency = probe_concurrency
        """Probes out at once across all miners; a due probe waits for the next tick beyond this."""
        self.rng = rng or random.SystemRandom()
        self.clock = clock
        self.states: dict[tuple[str, str], traffic_state.TrafficState] = {}
        self.next_probe: dict[tuple[str, str], float] = {}
        self.in_flight: set[tuple[str, str]] = set()
        self.history: dict[tuple[str, str], collections.deque[traffic_state.Transition]] = {}
        """Each worker's recent transitions, for the hub."""
        self.lifetime: dict[tuple[str, str], LifetimeCounts] = {}
        """What each (miner, model) served and had judged since this control plane started."""
        self._changed: set[tuple[str, str]] = set()
        self._seen: set[tuple[str, str]] = set()
        self._request_cursor = 0
        self._verdict_cursor = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # Outcomes from before this start belong to the states they were folded into, which
        # resume from the store (`traffic_state.resumed_state`): an active miner stays active across
        # a restart or a change of the fleet's leader, a pulled one stays out.
        self._request_cursor = await self.store.run(self.store.last_request_row)
        self._verdict_cursor = await self.store.run(self.store.last_verdict_row)
        now = self.clock()
        for row in await self.store.run(self.store.eligibility):
            if row.model in self.models:
                key = (row.miner, row.model)
                self.states[key] = traffic_state.resumed_state(
                    miner=row.miner,
                    model=row.model,
                    stored=traffic_state.Eligibility(row.state),
                    since=row.since,
                    reason=row.reason,
                    now=now,
                    policy=self.policy,
                    first_party=row.miner in self.first_party,
                )
        task_status.started()
        async with trio.open_nursery() as probes:
            while True:
                now = self.clock()
                self._follow_connections(now)
                try:
                    await self._ingest(now)
                except StoreError as error:
                    log.error("could not read outcomes from the store (%s); retrying in %.0f s", error, TICK_S)
                for key in list(self.states):
                    self._apply(key, traffic.tick(self.states[key], now=now, policy=self.policy), now)
                await self._persist()
                self._publish()
                self._send_due_probes(now, probes)
                await trio.sleep(TICK_S)

    def eligible(self, miner: str, model: str) -> bool:
        state = self.states.get((miner, model))
        return miner in self.first_party if state is None else traffic_state.eligible(state)

    # ---- observations ----------------------------------------------------------------------
    def _state(self, key: tuple[str, str], now: float) -> traffic_state.TrafficState:
        if key not in self.states:
            self.states[key] = traffic_state.initial_state(
                miner=key[0], model=key[1], now=now, first_party=key[0] in self.first_party
            )
            self._changed.add(key)
        return self.states[key]

    def _observe(self, key: tuple[str, str], observation: traffic_state.Observation, now: float) -> None:
        if key[1] not in self.models:
            return
        state = self._state(key, now)
        self._apply(
            key, traffic.step(state, observation, now=now, policy=self.policy, model_terms=self.models[key[1]]), now
        )

    def _apply(
        self,
        key: tuple[str, str],
        outcome: tuple[traffic_state.TrafficState, list[traffic_state.Transition]],
        now: float,
    ) -> None:
        state, transitions = outcome
        before = self.states.get(key)
        self.states[key] = state
        if before is None or before.state is not state.state or before.reason != state.reason:
            self._changed.add(key)
        for transition in transitions:
            self.history.setdefault(key, collections.deque(maxlen=HISTORY_PER_WORKER)).append(transition)
            level = (
                logging.WARNING
                if transition.to_state is traffic_state.Eligibility.PULLED or transition.code == "cheat"
                else logging.INFO
            )
            log.log(
                level,
                "miner %s (%s): %s -> %s: %s",
                key[0],
                key[1],
                transition.from_state.value,
                transition.to_state.value,
                transition.reason,
            )
            self.next_probe.pop(key, None)
        if key not in self.next_probe:
            at = traffic_probes.next_probe_at(state, now=now, policy=self.policy, rng_value=self.rng.random())
            if at is not None:
                self.next_probe[key] = at

    def _follow_connections(self, now: float) -> None:
        live = self.connected()
        for key in live - self._seen:
            self._observe(key, traffic_state.WorkerConnected(), now)
        for key in self._seen - live:
            self._observe(key, traffic_state.WorkerDisconnected(), now)
        self._seen = live

    async def _ingest(self, now: float) -> None:
        rows = await self.store.run(self.store.requests_after, self._request_cursor, limit=ROWS_PER_READ)
        for row_id, entry in rows:
            self._request_cursor = row_id
            if (
                entry.miner is None
                or entry.model is None
                or entry.status == HUNG_UP
                or (entry.kind != "probe" and entry.status in BUYER_FAULTS)
            ):
                # Reached no miner, or the buyer hung up or sent what its miner could not serve:
                # says nothing about the miner. A probe, the gateway's own, is never at fault.
                continue
            ok = 200 <= entry.status < 300
            ttft = None if entry.ttft_ms is None else int(round(entry.ttft_ms))
            tpot = None if entry.tpot_ms is None else int(round(entry.tpot_ms))
            finished = traffic_state.ProbeFinished if entry.kind == "probe" else traffic_state.PaidFinished
            key = (entry.miner, entry.model)
            self._observe(key, finished(entry.request_id, ok, ttft, tpot), now)
            if key[1] in self.models:
                self.lifetime[key] = served(self.lifetime.get(key, LifetimeCounts()), ok=ok)
        verdicts = await self.store.run(self.store.verdicts_after, self._verdict_cursor, limit=ROWS_PER_READ)
        for row_id, record in verdicts:
            self._verdict_cursor = row_id
            judged = traffic_state.ProbeVerdict if record.kind == "probe" else traffic_state.PaidVerdict
            key = (record.miner, record.model)
            self._observe(key, judged(record.request_id, record.verdict), now)
            if key[1] in self.models:
                self.lifetime[key] = audited(self.lifetime.get(key, LifetimeCounts()), record.verdict, record.reason)

    async def _persist(self) -> None:
        if not self._changed:
            return
        now = self.clock()
        rows = [
            EligibilityRow(
                miner=miner,
                model=model,
                state=state.state.value,
                reason=state.reason[:500],
                since=state.since,
                updated_at=now,
            )
            for (miner, model), state in ((key, self.states[key]) for key in sorted(self._changed))
        ]
        try:
            await self.store.run(self.store.save_eligibility, rows)
        except StoreError as error:
            log.error("could not save eligibility (%s); workers keep the previous view until the next tick", error)
            return
        self._changed.clear()

    def _publish(self) -> None:
        self.hub.set_state(
            "traffic",
            workers=[
                {
                    **state.to_json(),
                    "lifetime": encode(self.lifetime.get(key, LifetimeCounts())),
                    "history": [transition.to_json() for transition in self.history.get(key, ())],
                }
                for key, state in sorted(self.states.items())
            ],
        )

    # ---- probes ----------------------------------------------------------------------------
    def _send_due_probes(self, now: float, nursery: trio.Nursery) -> None:
        for key, at in sorted(self.next_probe.items(), key=lambda item: item[1]):
            if at > now or len(self.in_flight) >= self.probe_concurrency:
                break
            if key in self.in_flight or key not in self._seen:
                continue
            del self.next_probe[key]
            limit = self.models[key[1]].max_output_tokens
            if self.max_probe_tokens:
                limit = min(limit, self.max_probe_tokens)
            plan = traffic_probes.probe_plan(
                corpus=self.corpus,
                draws=[self.rng.random() for _ in range(traffic_probes.PROBE_PLAN_DRAWS)],
                max_output_tokens=limit,
            )
            self.in_flight.add(key)
            nursery.start_soon(self._probe, key, plan)

    async def _probe(self, key: tuple[str, str], plan: traffic_probes.ProbePlan) -> None:
        try:
            await self.send_probe(key[0], key[1], plan, self.corpus[plan.prompt_index])
        except Exception as error:  # broad on purpose: one failed probe must not stop the control plane
            log.warning(
                "probe to miner %s (%s) not sent (%s); trying again in %.0f s", key[0], key[1], error, PROBE_RETRY_S
            )
            self.next_probe.setdefault(key, self.clock() + PROBE_RETRY_S)
        finally:
            self.in_flight.discard(key)
        if key not in self.next_probe and key in self.states:
            at = traffic_probes.next_probe_at(
                self.states[key], now=self.clock(), policy=self.policy, rng_value=self.rng.random()
            )
            if at is not None:
                self.next_probe[key] = at


def served(counts: LifetimeCounts, *, ok: bool) -> LifetimeCounts:
    """`counts` with one more request served (`ok`: it succeeded)."""
    return dataclasses.replace(counts, served=counts.served + 1, failed=counts.failed + (not ok))


def audited(counts: LifetimeCounts, verdict: VerdictKind, reason: str) -> LifetimeCounts:
    """`counts` with one more verdict recorded, also under the proof its `reason` code names."""
    tallied = {"pass": "passed", "cheat": "cheat", "unproven": "unproven"}[verdict]
    return dataclasses.replace(
        counts,
        audited=counts.audited + 1,
        proofs=counts.proofs.counted(verdict, reason),
        **{tallied: getattr(counts, tallied) + 1},
    )


async def _keep_refreshed(refresh: Callable[[], Awaitable[None]], on_store_error: str, task_status) -> None:
    """Read once before reporting started, then every `REFRESH_S`; a store outage keeps the last
    view rather than ending the worker's task."""
    await refresh()
    task_status.started()
    while True:
        await trio.sleep(REFRESH_S)
        try:
            await refresh()
        except StoreError as error:
            log.error(on_store_error, error)


class EligibilityView:
    """Every worker process's copy of the eligibility table, refreshed every `REFRESH_S`."""

    def __init__(self, store: Store, *, first_party: Iterable[str] = ()) -> None:
        self.store = store
        self.first_party = frozenset(first_party)
        self._active: set[tuple[str, str]] = set()

    def eligible(self, miner: str, model: str) -> bool:
        return miner in self.first_party or (miner, model) in self._active

    async def refresh(self) -> None:
        rows = await self.store.run(self.store.eligibility)
        self._active = {(row.miner, row.model) for row in rows if row.state == traffic_state.Eligibility.ACTIVE.value}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await _keep_refreshed(
            self.refresh, "could not re-read eligibility (%s); keeping the previous view", task_status
        )


class CheatBans:
    """Eligibility with qualification off (`gateway.qualification = false`, a private gateway):
    every admitted miner serves at once, except one caught cheating, which is out for
    `cooldown_s` from the verdict (the breaker's cheat cooldown). With qualification on the
    breaker pulls a cheat; without it nothing else would, and buyers would go on paying a miner
    whose answers are established wrong. Every worker process follows the store's verdicts
    (written by any verifier and by the gateway's own findings) with a cursor, every `REFRESH_S`.
    First-party miners are the operator's own and stay eligible, as everywhere."""

    def __init__(
        self,
        store: Store,
        *,
        cooldown_s: float,
        first_party: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.cooldown_s = cooldown_s
        self.first_party = frozenset(first_party)
        self.clock = clock
        self._until: dict[tuple[str, str], float] = {}
        self._cursor = 0

    def eligible(self, miner: str, model: str) -> bool:
        return miner in self.first_party or self._until.get((miner, model), 0.0) <= self.clock()

    async def refresh(self) -> None:
        while True:
            rows = await self.store.run(self.store.verdicts_after, self._cursor, limit=ROWS_PER_READ)
            for row_id, record in rows:
                self._cursor = row_id
                if record.verdict != "cheat":
                    continue
                until = record.judged_at + self.cooldown_s
                key = (record.miner, record.model)
                if until > self.clock() and until > self._until.get(key, 0.0):
                    if key not in self._until or self._until[key] <= self.clock():
                        log.warning(
                            "%s (%s) judged a cheat (%s, request %s): out of the pool until %s",
                            record.miner,
                            record.model,
                            record.reason,
                            record.request_id,
                            time.strftime("%H:%M:%S", time.localtime(until)),
                        )
                    self._until[key] = until
            if len(rows) < ROWS_PER_READ:
                return

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await _keep_refreshed(self.refresh, "could not read new verdicts (%s); cheat bans as they were", task_status)
