"""The light loop (docs/validator.md): poll the provider's signed epoch result, verify it against the
pinned master hotkey, and keep it on chain all epoch.

The public light validator's semantics, tick by tick:

1. Fetch `/api/subnet/v1/epoch/latest` (at most 1 MiB read) and verify it fully
   (`protocol.epoch.parse_and_verify`). Nothing unverified is ever submitted.
2. No usable payload (provider down, refused, or older than the epoch already applied: the
   monotonic replay guard) → the cached vector this validator last landed, if any.
3. A resubmission that is clearly not due skips the chain on the wall clock alone (pre-gate);
   otherwise one block-pinned chain read decides (`schedule.decide`: the block is authoritative,
   ambiguity submits).
   The rows a settlement gate zeroed are published explained (`gated`), so a miner missing
   from the weights because of a gate is not mistaken for one merely unweighted.
4. Hotkeys become uids from that read; unregistered ones are dropped and logged with their share.
   A vector that lands nothing degrades to standby: the cache, else a burn to the subnet owner.
5. Submit; only a landed extrinsic advances the state file, all fields at once.

Why submit again and again. A validator whose last_update is older than the activity cutoff
(~5,000 blocks) drops out of consensus and earns nothing, while the weights themselves never
expire; so the same vector goes back every `resubmit_blocks`, and a provider outage resubmits the
cache rather than falling silent.

Every tick logs what it did or why it skipped (a silent skip looks like a hang), stamps the
heartbeat file `engy-node health` reads, and feeds a watchdog thread that exits the process if
ticks stop completing — a loop wedged in a chain call stays "running" forever otherwise. The
signed heartbeat to the provider is best-effort and never delays the loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from engy_node import __version__, keys
from engy_node.durations import duration_text
from engy_node.hub import Hub
from engy_node.models import CATALOG
from engy_node.protocol.epoch import MAX_PAYLOAD_BYTES, EpochPayloadError, VerifiedEpoch, parse_and_verify
from engy_node.protocol.gates import GateTerms, explain_rows
from engy_node.validator import liveness, schedule, uids
from engy_node.validator.chain import ChainClient, ChainView
from engy_node.validator.state import ValidatorState, after_submit, read_state, write_state

if TYPE_CHECKING:
    from bittensor.sp_core import Keypair

log = logging.getLogger("engy.validator")

EPOCH_PATH = "/api/subnet/v1/epoch/latest"
HEARTBEAT_PATH = "/api/subnet/v1/validator/heartbeat"
FETCH_TIMEOUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 10.0
WATCHDOG_CHECK_S = 30.0
SUBMISSIONS_KEPT = 20
GATE_TERMS = {model_id: GateTerms.of(spec) for model_id, spec in CATALOG.items()}
"""The catalog's latency ceilings, to say by how much a gated miner missed (`_publish_gated`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LightSettings:
    provider_url: str
    master_hotkey: str
    netuid: int
    state_path: Path
    heartbeat_path: Path
    poll_s: float = 300.0
    resubmit_blocks: int = schedule.RESUBMIT_BLOCKS
    block_s: float = schedule.BLOCK_S
    provider_heartbeat: bool = True
    max_payload_bytes: int = MAX_PAYLOAD_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """The vector a tick would put on chain, and where it came from."""

    weights: tuple[tuple[str, int], ...]
    epoch_index: int
    digest: str | None
    from_cache: bool


@dataclasses.dataclass(frozen=True, slots=True)
class TickResult:
    outcome: str
    """`applied`, `resubmitted`, `resubmitted:cached`, `standby:cached`, `standby:burn`,
    `skipped:too-soon`, `skipped:replay`, `no-epoch-yet`, `fetch-failed`, `rejected:<reason>`, `chain-failed`,
    `submit-failed`."""
    epoch: int | None = None
    block: int | None = None


class LightValidator:
    """One validator hotkey's loop. `tick` is one poll cycle; `run` is the node service."""

    def __init__(
        self,
        settings: LightSettings,
        *,
        chain: ChainClient,
        signer: Keypair,
        http: httpx.AsyncClient,
        hub: Hub | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.chain = chain
        self.signer = signer
        self.http = http
        self.hub = hub
        self.clock = clock
        self.block_s = settings.block_s
        self.last_view: ChainView | None = None
        self.last_tick_monotonic = time.monotonic()
        self.started = clock()
        self.submissions: collections.deque[dict[str, Any]] = collections.deque(maxlen=SUBMISSIONS_KEPT)
        self._warned_interval = False

    # ---- the loop ---------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        settings = self.settings
        log.info(
            "light loop: provider %s, master %s, netuid %d, hotkey %s, poll every %.0f s, resubmit every %d blocks",
            settings.provider_url,
            settings.master_hotkey,
            settings.netuid,
            self.signer.ss58_address,
            settings.poll_s,
            settings.resubmit_blocks,
        )
        log.info(
            "liveness: heartbeat file %s, watchdog exits after %.0f s without a completed tick",
            settings.heartbeat_path,
            schedule.stall_limit(settings.poll_s),
        )
        async with trio.open_nursery() as nursery:
            task_status.started(self.signer.ss58_address)
            await self._check_registration()
            while True:
                try:
                    result = await self.tick()
                except Exception:  # broad on purpose: one bad tick must not end the loop
                    log.exception("tick failed; trying again in %.0f s", settings.poll_s)
                    result = TickResult("error")
                await self._stamp(result)
                if settings.provider_heartbeat:
                    nursery.start_soon(self._post_heartbeat)
                await trio.sleep(settings.poll_s)

    async def tick(self) -> TickResult:
        state, discarded = await trio.to_thread.run_sync(read_state, self.settings.state_path)
        if discarded:
            log.warning(
                "state file %s: discarded invalid %s; continuing with the rest",
                self.settings.state_path,
                ", ".join(discarded),
            )
        candidate, failure = await self._candidate(state)
        if candidate is None:
            return TickResult(failure)

        now = self.clock()
        is_new = state.last_applied is None or candidate.epoch_index > state.last_applied
        if not is_new:
            wait_s = schedule.pregate_skip(
                now=now,
                last_submit_ts=state.last_submit_ts,
                interval_blocks=self.settings.resubmit_blocks,
                block_s=self.block_s,
            )
            if wait_s is not None:
                log.info(
                    "epoch %d already submitted; next resubmit in ~%s (not contacting the chain yet)",
                    candidate.epoch_index,
                    duration_text(wait_s),
                )
                return TickResult("skipped:too-soon", candidate.epoch_index)

        try:
            view = await self.chain.read(self.settings.netuid)
        except Exception as err:  # broad on purpose: connecting fails in as many ways as the SDK has layers
            log.warning("chain read failed (%s: %s); nothing submitted this tick", type(err).__name__, err)
            self._publish(chain_error=_chain_error(err))
            return TickResult("chain-failed", candidate.epoch_index)
        self._observe(view)

        decision = schedule.decide(
            epoch_index=candidate.epoch_index,
            last_applied=state.last_applied,
            current_block=view.block,
            last_submit_block=state.last_submit_block,
            now=now,
            last_submit_ts=state.last_submit_ts,
            interval_blocks=self.settings.resubmit_blocks,
            block_s=self.block_s,
        )
        if not decision.submit:
            if decision.reason == "replay":
                return TickResult("skipped:replay", candidate.epoch_index, view.block)
            left = f"{decision.blocks_left} more blocks" if decision.blocks_left is not None else "the wall clock"
            log.info(
                "epoch %d already submitted at block %s; resubmit after %s (%s)",
                candidate.epoch_index,
                state.last_submit_block,
                left,
                decision.reason,
            )
            return TickResult("skipped:too-soon", candidate.epoch_index, view.block)
        if decision.reason == "chain-behind":
            log.warning(
                "the chain is at block %d, before this validator's last submit at block %s: the state file "
                "was written against another chain; submitting",
                view.block,
                state.last_submit_block,
            )

        return await self._submit(state, candidate, view, is_new=is_new)

    async def _check_registration(self) -> None:
        """Say at start-up, not at the first epoch, whether this hotkey can set weights at all."""
        try:
            view = await self.chain.read(self.settings.netuid)
        except Exception as err:  # broad on purpose: the loop retries the chain every tick anyway
            log.warning("chain not readable at start-up (%s: %s); the loop will keep trying", type(err).__name__, err)
            self._publish(chain_error=_chain_error(err))
            return
        self._observe(view)
        me = view.neuron_of(self.signer.ss58_address)
        if me is None:
            log.warning(
                "hotkey %s is not registered on netuid %d: register it (and stake for a validator permit) "
                "before weights can be set",
                self.signer.ss58_address,
                self.settings.netuid,
            )
        elif not me.validator_permit:
            log.warning(
                "hotkey %s is uid %d but has no validator permit yet: the chain refuses weights until its "
                "stake ranks among the subnet's validators",
                self.signer.ss58_address,
                me.uid,
            )
        else:
            log.info(
                "hotkey %s is uid %d with a validator permit, at block %d", self.signer.ss58_address, me.uid, view.block
            )

    # ---- the steps --------------------------------------------------------------------------

    async def _candidate(self, state: ValidatorState) -> tuple[Candidate | None, str]:
        """A freshly verified vector, else the cache; else (None, why). Publishes why the provider
        gave no usable payload (`provider_error`, None when it did) and whether a cached vector
        exists to fall back on (`cached_vector`)."""
        cached, cached_epoch = state.cached_weights, state.last_applied
        candidate, failure, why = await self._fresh_candidate(state)
        self._publish(provider_error=why, cached_vector=cached is not None and cached_epoch is not None)
        if candidate is not None:
            return candidate, ""
        if cached is None or cached_epoch is None:
            log.log(
                logging.INFO if failure == "no-epoch-yet" else logging.WARNING,
                "no usable payload (%s) and no cached vector yet; nothing to submit",
                failure,
            )
            return None, failure
        log.info(
            "no usable payload (%s); resubmitting the cached epoch %d vector (%d hotkeys)",
            failure,
            cached_epoch,
            len(cached),
        )
        return Candidate(cached, cached_epoch, state.cached_digest, from_cache=True), ""

    async def _fresh_candidate(self, state: ValidatorState) -> tuple[Candidate | None, str, str | None]:
        """A freshly verified vector from the provider, else (None, the outcome, why in words)."""
        failure = "fetch-failed"
        url = f"{self.settings.provider_url}{EPOCH_PATH}"
        try:
            raw = await self._fetch()
        except ProviderAnswer as err:
            # 404 is a provider that has not closed an epoch yet (a new gateway): expected, not alarming.
            level = logging.INFO if err.status == 404 else logging.WARNING
            log.log(level, "fetch of %s answered HTTP %d: %s", url, err.status, err)
            if err.status == 404:
                failure = "no-epoch-yet"
            why = f"{url} answered HTTP {err.status}: {err}"
        except (httpx.HTTPError, trio.TooSlowError) as err:
            reason = (
                f"no complete answer within {FETCH_TIMEOUT_S:.0f} s"
                if isinstance(err, trio.TooSlowError)
                else _reason(err)
            )
            log.warning("fetch of %s failed: %s", url, reason)
            why = f"{url}: {reason}"
        else:
            try:
                verified = parse_and_verify(
                    raw,
                    master_hotkey=self.settings.master_hotkey,
                    netuid=self.settings.netuid,
                    max_bytes=self.settings.max_payload_bytes,
                )
            except EpochPayloadError as err:
                log.warning("payload rejected (%s): %s", err.reason, err.detail)
                failure = f"rejected:{err.reason}"
                why = f"payload rejected ({err.reason}): {err.detail}"
            else:
                replayed = state.last_applied is not None and verified.epoch_index < state.last_applied
                if not replayed:
                    self._publish_gated(verified)
                    return _fresh(verified), "", None
                why = f"epoch {verified.epoch_index} is older than epoch {state.last_applied} already applied"
                log.warning("payload refused: %s (replay guard)", why)
                failure = "rejected:replay"
        return None, failure, why

    async def _fetch(self) -> bytes:
        """The body of the latest epoch, read no further than the size cap allows."""
        url = f"{self.settings.provider_url.rstrip('/')}{EPOCH_PATH}"
        cap = self.settings.max_payload_bytes
        with trio.fail_after(FETCH_TIMEOUT_S):
            async with self.http.stream("GET", url, timeout=FETCH_TIMEOUT_S) as response:
                if response.status_code != 200:
                    body = (await response.aread())[:200].decode("utf-8", "replace")
                    raise ProviderAnswer(response.status_code, body.strip())
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > cap:
                        # Stop reading: the verifier refuses it by size anyway, without the rest.
                        chunks.append(chunk[: cap + 1 - (size - len(chunk))])
                        break
                    chunks.append(chunk)
        return b"".join(chunks)

    async def _submit(
        self, state: ValidatorState, candidate: Candidate, view: ChainView, *, is_new: bool
    ) -> TickResult:
        weights = candidate.weights
        target = uids.burn_target(weights)
        if target is not None and view.owner_hotkey and target != view.owner_hotkey:
            log.warning(
                "the payload burns to %s but the chain's subnet owner is %s; submitting anyway (check the "
                "provider's owner_hotkey)",
                target,
                view.owner_hotkey,
            )
        resolution = uids.resolve(weights, view.hotkeys)
        if resolution.dropped:
            log.warning(
                "%d payload hotkey(s) not registered on chain, holding %.1f%% of the weight, dropped: %s",
                len(resolution.dropped),
                resolution.dropped_share * 100,
                ", ".join(resolution.dropped),
            )
        standby_kind = None
        if not resolution.lands:
            who = ", ".join(hotkey for hotkey, _ in weights[:5])
            log.warning(
                "none of the vector's hotkeys are registered on chain (%s); for a burn this usually means the "
                "provider's owner_hotkey is wrong",
                who,
            )
            fallback = uids.standby(
                cached=state.cached_weights,
                hotkeys_by_uid=view.hotkeys,
                owner_hotkey=view.owner_hotkey,
                cache_already_tried=candidate.from_cache,
            )
            if fallback is None:
                log.warning(
                    "no standby vector lands either (no cache, owner hotkey not registered); submitting nothing"
                )
                return TickResult("submit-failed", candidate.epoch_index, view.block)
            standby_kind, standby_weights = fallback
            log.info(
                "%s: submitting %s instead",
                standby_kind,
                "the last vector this validator landed"
                if standby_kind == "standby:cached"
                else f"a burn to the owner hotkey {view.owner_hotkey}",
            )
            resolution = uids.resolve(standby_weights, view.hotkeys)

        me = view.neuron_of(self.signer.ss58_address)
        if me is None:
            log.warning(
                "this validator's hotkey %s is not registered on netuid %d; the submit will be refused",
                self.signer.ss58_address,
                self.settings.netuid,
            )
        elif not me.validator_permit:
            log.warning(
                "hotkey %s (uid %d) has no validator permit; the chain will refuse weights until it has one",
                self.signer.ss58_address,
                me.uid,
            )
        outcome = await self.chain.set_weights(
            self.signer, netuid=self.settings.netuid, uids=resolution.uids, values=resolution.values
        )
        if not outcome.landed:
            advice = f" ({outcome.remediation})" if outcome.remediation else ""
            log.warning(
                "submit of epoch %d refused, nothing recorded: %s%s", candidate.epoch_index, outcome.describe(), advice
            )
            self._record_submission(
                view.block, candidate.epoch_index, "new" if is_new else "resubmit", outcome.describe(), landed=False
            )
            return TickResult("submit-failed", candidate.epoch_index, view.block)

        new_state = after_submit(
            state,
            epoch_index=candidate.epoch_index,
            block=view.block,
            now=self.clock(),
            weights=candidate.weights,
            digest=candidate.digest,
            standby=standby_kind is not None,
        )
        await trio.to_thread.run_sync(write_state, self.settings.state_path, new_state)
        gap = (
            "first submit"
            if state.last_submit_block is None
            else f"{view.block - state.last_submit_block} blocks since the last"
        )
        log.info(
            "epoch %d: weights for %d uid(s) on chain at block %d, %s (%s)",
            candidate.epoch_index,
            len(resolution.uids),
            view.block,
            outcome.describe(),
            gap,
        )
        outcome_name: str
        if standby_kind is not None:
            outcome_name = standby_kind
        elif candidate.from_cache:
            outcome_name = "resubmitted:cached"
        else:
            outcome_name = "applied" if is_new else "resubmitted"
        self._publish_weights(
            view,
            resolution,
            candidate.epoch_index,
            dropped=resolution.dropped,
            dropped_share=resolution.dropped_share,
            digest=candidate.digest,
        )
        self._record_submission(view.block, candidate.epoch_index, outcome_name, outcome.describe(), landed=True)
        return TickResult(outcome_name, candidate.epoch_index, view.block)

    # ---- liveness and reporting -------------------------------------------------------------

    def _publish(self, **fields: Any) -> None:
        if self.hub is not None:
            self.hub.set_state("validator", **fields)

    def _observe(self, view: ChainView) -> None:
        self.last_view = view
        if view.block_time_s > 0:
            self.block_s = view.block_time_s
        warning = schedule.check_interval(self.settings.resubmit_blocks, view.weights_rate_limit)
        if warning and not self._warned_interval:
            log.warning("%s", warning)
            self._warned_interval = True
        if self.hub is not None:
            me = view.neuron_of(self.signer.ss58_address)
            self.hub.set_state(
                "validator",
                block=view.block,
                block_time_s=view.block_time_s,
                uid=me.uid if me else None,
                permit=me.validator_permit if me else None,
                last_update=me.last_update if me else None,
                weights_rate_limit=view.weights_rate_limit,
                activity_cutoff=view.activity_cutoff,
                tempo=view.tempo,
                commit_reveal=view.commit_reveal,
                chain_error=None,
            )

    def _publish_weights(
        self,
        view: ChainView,
        resolution: uids.Resolution,
        epoch_index: int,
        *,
        dropped: tuple[str, ...],
        dropped_share: float,
        digest: str | None,
    ) -> None:
        if self.hub is None:
            return
        by_uid = dict(enumerate(view.hotkeys))
        self.hub.set_state(
            "validator",
            submitted_epoch=epoch_index,
            submitted_block=view.block,
            digest=digest,
            dropped=list(dropped),
            dropped_share=dropped_share,
            weights=[
                {"uid": uid, "hotkey": by_uid.get(uid), "weight": value}
                for uid, value in zip(resolution.uids, resolution.values)
            ],
        )

    def _publish_gated(self, verified: VerifiedEpoch) -> None:
        """The rows a settlement gate zeroed in the verified epoch, explained (`protocol.gates`): a
        miner gated to 0 is absent from the weights, and would otherwise look merely unweighted."""
        rows = verified.result.get("rows")
        findings = explain_rows(rows if isinstance(rows, list) else [], GATE_TERMS, epoch=verified.epoch_index)
        self._publish(gated=[dataclasses.asdict(finding) for finding in findings])

    def _record_submission(self, block: int, epoch_index: int, kind: str, detail: str, *, landed: bool) -> None:
        """The newest submissions first, for the dashboards: what went to the chain and how it ended."""
        self.submissions.appendleft(
            {"ts": self.clock(), "block": block, "epoch": epoch_index, "kind": kind, "landed": landed, "detail": detail}
        )
        if self.hub is not None:
            self.hub.set_state("validator", submissions=list(self.submissions))

    async def _stamp(self, result: TickResult) -> None:
        now = self.clock()
        self.last_tick_monotonic = time.monotonic()
        view = self.last_view
        detail = {
            "outcome": result.outcome,
            "epoch": result.epoch,
            "block": result.block,
            "started": self.started,
            "activity_cutoff_s": view.activity_cutoff * self.block_s if view is not None else None,
        }
        error = await trio.to_thread.run_sync(
            lambda: liveness.write_heartbeat(self.settings.heartbeat_path, now=now, detail=detail)
        )
        if error:
            log.warning("heartbeat file not written (%s); `engy-node health` will report it stale", error)
        if self.hub is not None:
            state, _ = await trio.to_thread.run_sync(read_state, self.settings.state_path)
            blocks_since = (
                self.last_view.block - state.last_submit_block
                if self.last_view is not None and state.last_submit_block is not None
                else None
            )
            self.hub.set_state(
                "validator",
                last_tick=now,
                last_outcome=result.outcome,
                last_applied=state.last_applied,
                last_submit_block=state.last_submit_block,
                last_submit_ts=state.last_submit_ts,
                blocks_since_submit=blocks_since,
                next_resubmit_in_blocks=(
                    max(0, self.settings.resubmit_blocks - blocks_since) if blocks_since is not None else None
                ),
            )

    async def _post_heartbeat(self) -> None:
        """Tell the provider which epoch and digest this validator runs on chain. Never raises."""
        state, _ = await trio.to_thread.run_sync(read_state, self.settings.state_path)
        body: dict[str, Any] = {"v": 1, "version": f"engy-node {__version__}"}
        if state.last_applied is not None:
            body["synced_epoch"] = state.last_applied
            if state.cached_digest:
                body["consensus"] = {"epoch_index": state.last_applied, "digest": state.cached_digest}
        raw = json.dumps(body, separators=(",", ":")).encode()
        headers = {
            **keys.signed_headers(self.signer, self.settings.netuid, "POST", HEARTBEAT_PATH, raw, int(self.clock())),
            "Content-Type": "application/json",
        }
        url = f"{self.settings.provider_url.rstrip('/')}{HEARTBEAT_PATH}"
        try:
            with trio.fail_after(HEARTBEAT_TIMEOUT_S):
                response = await self.http.post(url, content=raw, headers=headers, timeout=HEARTBEAT_TIMEOUT_S)
        except (httpx.HTTPError, trio.TooSlowError) as err:
            log.debug("provider heartbeat not sent: %s", _reason(err))
            return
        if response.status_code != 200:
            log.info("provider heartbeat refused: HTTP %d %s", response.status_code, response.text[:160])


class ProviderAnswer(Exception):
    """The provider answered, but not with a payload (an error status)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(body or f"HTTP {status}")
        self.status = status


class Watchdog:
    """Exits the process when the loop stops completing ticks.

    A thread, not a trio task: the failure it exists for is the trio loop itself being stuck (a
    blocking call that never returns), and then no trio task would run to notice. `exit_fn` is
    `os._exit` in production: a wedged process cannot be trusted to unwind."""

    def __init__(
        self,
        loop: LightValidator,
        *,
        limit_s: float,
        check_s: float = WATCHDOG_CHECK_S,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.loop = loop
        self.limit_s = limit_s
        self.check_s = check_s
        self.exit_fn = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="validator-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.check_s + 5)

    def _watch(self) -> None:
        while not self._stop.wait(self.check_s):
            age = time.monotonic() - self.loop.last_tick_monotonic
            if age > self.limit_s:
                log.error(
                    "watchdog: no completed tick in %.0f s (limit %.0f s); exiting so the service manager "
                    "restarts the validator",
                    age,
                    self.limit_s,
                )
                self.exit_fn(1)
                return


def _fresh(verified: VerifiedEpoch) -> Candidate:
    return Candidate(verified.weights, verified.epoch_index, verified.digest, from_cache=False)


def _chain_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _reason(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}" if isinstance(err, httpx.HTTPError) else text
