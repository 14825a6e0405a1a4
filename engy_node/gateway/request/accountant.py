"""An answer after its miner is done: checked against its proof, offered to the audit, charged,
recorded (docs/billing.md, docs/trust.md).

`Accountant` is the part of a `Gateway` that a finished answer goes through, whichever API it came
through (`relay.ChatEndpoint` calls it as `gateway.accountant`):

* **Account for it** (`account_for`): read the miner's commitment, check that it proves the prompt
  that was sent and the text that was relayed (`accounting.relayed_tokens`), and hand the proof
  material of a sampled response to the audit (`audit.py`: in memory only). An answer proven
  wrong before its delivery ended is refused and not charged; the miner is recorded as a cheat.
  An answer the gateway cut at a stop string while its miner went on (`account_for_cut`) is
  billed now and audited once the miner's commitment arrives (`keep_proofs`).
* **Settle** on usage the gateway can account for (`billing.billable_usage`) and release the rest
  of the hold, in the same store write as the request's log row.
* **Record** metadata only (no prompt or completion text, ever; queued to one writer task,
  `request_log`).

What comes before (authentication, the hold, routing and dispatch) is `lifecycle.Gateway`'s; the
measures themselves are `accounting.py`'s pure functions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from engy_node import proof
from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing import billing
from engy_node.gateway.request.accounting import (
    StopTerms,
    cache_claim,
    count_or_zero,
    reasoning_tokens,
    relayed_tokens,
    structured_relayed_tokens,
    usage_padding,
)
from engy_node.gateway.request.flight import Accounting, AuditSink, Flight
from engy_node.gateway.request.request_log import RequestLogWriter
from engy_node.gateway.routing.pool import MinerPool, PendingRequest
from engy_node.gateway.store import RequestLogEntry, Store, StoreError
from engy_node.gateway.trust.audit import audited
from engy_node.model_output import THINK_CLOSE
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import FEATURE_TOOLS
from engy_node.served_model import ServedModel

log = logging.getLogger("engy.gateway")


@dataclasses.dataclass
class PromptCacheTally:
    """How much of the prompts the miners served came from their prefix caches: what prefix
    affinity routing (`router.prefix_key`) earns, and what buyers are billed at the cached rate."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens

    @property
    def hit_rate(self) -> float | None:
        return None if not self.prompt_tokens else self.cached_tokens / self.prompt_tokens

    def to_state(self) -> dict[str, Any]:
        rate = self.hit_rate
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": None if rate is None else round(rate, 4),
        }


class Accountant:
    """A finished answer's accounting, audit offer, charge and log row; one per `Gateway`, sharing
    its store, pool, clocks and tokenizer threads.

    `clock` is the wall clock (log rows, audit jobs), `monotonic` measures durations (TTFT, TPOT,
    a cut answer's remaining time), `off_loop` runs tokenizer work inline when it is small and in a
    worker thread when it is not (`Gateway.off_loop_if_large`).
    """

    def __init__(
        self,
        *,
        store: Store,
        pool: MinerPool,
        request_log: RequestLogWriter | None,
        audit: AuditSink | None,
        audit_draw: Callable[[], float],
        audit_paid_pct: float,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        tokenize_limiter: trio.CapacityLimiter,
        off_loop: Callable[..., Awaitable[Any]],
        prompt_cache: PromptCacheTally,
    ) -> None:
        self.store = store
        self.pool = pool
        self.request_log = request_log
        """Where request-log rows queue, so a buyer never waits for them (None: written inline)."""
        self.audit = audit
        """None: nothing is audited (no desk in this gateway)."""
        self.audit_draw = audit_draw
        self.audit_paid_pct = audit_paid_pct
        self.clock = clock
        self.monotonic = monotonic
        self.tokenize_limiter = tokenize_limiter
        self.off_loop = off_loop
        self.prompt_cache = prompt_cache
        """Prompt tokens settled in this process, and how many came from the miners' caches."""
        self._proof_waits: trio.Nursery | None = None
        """Where answers cut at a stop string wait for their miner's commitment (`keep_proofs`)."""

    async def reasoning_tokens(self, flight: Flight, accounting: Accounting) -> int:
        """How many of the answer's completion tokens are its reasoning (`reasoning_tokens`)."""
        answer = accounting.proven_text if accounting.proven_text is not None else flight.delivered_text
        if THINK_CLOSE not in answer and not answer.startswith("<think>"):
            return 0
        return await trio.to_thread.run_sync(
            reasoning_tokens, flight.model, accounting.output_ids, answer, limiter=self.tokenize_limiter
        )

    async def settle(self, flight: Flight, *, status: int, completion_claim: dict | None, relayed_tokens: int) -> Usage:
        """Charge for what the buyer got, release the rest of the hold, record metadata."""
        usage = self.billable(flight, completion_claim=completion_claim, relayed_tokens=relayed_tokens)
        await self.charge(flight, usage, status=status)
        return usage

    def billable(self, flight: Flight, *, completion_claim: dict | None, relayed_tokens: int) -> Usage:
        """The usage the buyer is billed for (`billing.billable_usage`), before `charge`."""
        prompt = len(flight.prompt_ids)
        claimed = Usage(prompt_tokens=prompt, completion_tokens=relayed_tokens, cached_tokens=0)
        committed_completion = relayed_tokens
        if completion_claim is not None:
            usage = completion_claim.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            claimed = Usage(
                prompt_tokens=prompt,
                completion_tokens=count_or_zero(usage.get("completion_tokens")),
                cached_tokens=min(prompt, count_or_zero(details.get("cached_tokens"))),
            )
            committed_completion = completion_claim.get("committed_completion", relayed_tokens)
        return billing.billable_usage(
            claimed=claimed,
            committed_prompt=prompt,
            committed_completion=committed_completion,
            relayed_completion=relayed_tokens,
        )

    async def charge(self, flight: Flight, usage: Usage, *, status: int, finish: str | None = None) -> None:
        """Charge `usage` (`billable`), release the rest of the hold, record metadata with the
        answer's `finish` reason; `flight.charged` is then what the ledger charged."""
        self.prompt_cache.add(usage)
        if flight.hold is None:
            await self.log_outcome(flight, status=status, usage=usage, finish=finish)
            return
        # One write: the charge and the request's log row (which epochs are settled from, so it
        # records what the ledger charged) land together or not at all.
        settlement = await self.store.run(
            self.store.settle_and_log,
            flight.hold,
            cost=billing.charge(price=flight.model.spec.price, usage=usage),
            entry=self._log_entry(flight, status=status, usage=usage, cost=0, finish=finish),
        )
        flight.charged = settlement.charged
        if not settlement.applied:
            log.error(
                "request %s: its hold was closed before it settled (charged %d µUSD, released %d); the answer is "
                "not charged again",
                flight.request_id,
                settlement.charged,
                settlement.released,
            )

    async def log_outcome(
        self, flight: Flight, *, status: int, usage: Usage | None, cost: int = 0, finish: str | None = None
    ) -> None:
        entry = self._log_entry(flight, status=status, usage=usage, cost=cost, finish=finish)
        if self.request_log is not None and self.request_log.add(entry):
            return
        try:
            with trio.CancelScope(shield=True):
                await self.store.run(self.store.log_request, entry)
        except StoreError as error:
            # The request itself is served and billed; losing its log row must not fail it.
            log.error("request %s: could not write the request log (%s)", entry.request_id, error)

    def _log_entry(
        self, flight: Flight, *, status: int, usage: Usage | None, cost: int, finish: str | None = None
    ) -> RequestLogEntry:
        elapsed_ms = int((self.monotonic() - flight.started) * 1000)
        ttft_ms = int((flight.first_output_at - flight.started) * 1000) if flight.first_output_at else None
        tpot_ms = None
        if usage is not None and ttft_ms is not None and usage.completion_tokens > 1:
            tpot_ms = max(0, (elapsed_ms - ttft_ms) // (usage.completion_tokens - 1))
        return RequestLogEntry(
            request_id=flight.request_id,
            account_id=flight.account_id,
            miner=flight.miner or None,
            model=flight.chat.model,
            api=flight.api,
            kind=flight.kind,
            status=status,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            cost_micro=cost,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            created_at=self.clock(),
            served_greedily=flight.served_greedily,
            key_id=flight.key_id,
            # Counted on the answer as proven, which a miner's lower completion claim can undercut.
            reasoning_tokens=min(usage.reasoning_tokens, usage.completion_tokens) if usage else 0,
            finish_reason=finish,
            total_ms=elapsed_ms,
            audited=flight.audited,
        )

    def encode(self, model: ServedModel, text: str) -> list[int]:
        return model.tokenizer.encode(text, add_special_tokens=False) if text else []

    async def account_for(self, flight: Flight, pending: PendingRequest, *, cut_at: str | None = None) -> Accounting:
        """What settlement needs, checking the commitment against what was relayed (docs/billing.md),
        and the delivery the audit judges the proof against. `cut_at`: the stop string at which
        the gateway ended an answer the miner went on with; the relayed text is then billed as
        it stands, with no stop token after it."""
        response = pending.response
        commitment = None
        if response is not None and response.output is not None and response.commitment is not None:
            try:
                commitment = proof.Commitment.from_wire(response.commitment)
            except proof.ProofFormatError as error:
                log.warning(
                    "request %s: miner %s sent a malformed commitment (%s)", flight.request_id, flight.miner, error
                )
        if commitment is None:
            relayed = await trio.to_thread.run_sync(
                self.encode, flight.model, flight.delivered_text, limiter=self.tokenize_limiter
            )
            # Audited all the same: with no commitment at all the verifier judges the delivered
            # tokens on the canonical model (`proof.judge_delivered`); with an unreadable one the
            # answer is `unproven`, and a rising share of those pulls a miner hiding behind them.
            self._offer_audit(
                flight,
                pending,
                (response.commitment if response is not None else None) or {},
                proof.Delivery(
                    relayed_output_ids=tuple(relayed),
                    ended_at_stop=cut_at is not None,
                    max_tokens=flight.chat.max_tokens,
                ),
            )
            return Accounting(
                claim=cache_claim(response, len(relayed)), relayed_tokens=len(relayed), output_ids=None, stop=cut_at
            )
        # A commitment was read, so the response has one, and its output.
        assert response is not None and response.output is not None and response.commitment is not None
        if list(commitment.prompt_ids) != flight.prompt_ids and await self._rendered_as_public_miner(
            flight, pending, commitment
        ):
            # An honest public miner: it proved the prompt as it renders the request, without
            # what it does not honour. That is what it computed, and what is billed and audited.
            log.info(
                "request %s: miner %s proved the prompt as the public miner renders it (%d tokens, not %d)",
                flight.request_id,
                flight.miner,
                len(commitment.prompt_ids),
                len(flight.prompt_ids),
            )
            flight.prompt_ids = list(commitment.prompt_ids)
        if list(commitment.prompt_ids) != flight.prompt_ids:
            # Established before the answer is delivered: whatever the text says, it was not
            # computed for this buyer's prompt. Recorded as a cheat at once (it pulls the miner,
            # qualification or not) and refused: the buyer is not charged for it.
            log.warning(
                "request %s: miner %s proved a different prompt than the one sent; the answer is refused and "
                "not charged",
                flight.request_id,
                flight.miner,
            )
            self._offer_audit(
                flight,
                pending,
                response.commitment,
                proof.Delivery((), cut_at is not None, flight.chat.max_tokens),
                found=("cheat", "prompt-mismatch"),
            )
            return Accounting(claim=None, relayed_tokens=0, output_ids=None, stop=cut_at, refused="prompt-mismatch")
        padding = usage_padding(
            response.output, prompt_tokens=len(flight.prompt_ids), committed_tokens=len(commitment.output_token_ids)
        )
        finish_stop = cut_at is None and (response.output.get("choices") or [{}])[0].get("finish_reason") == "stop"
        terms = StopTerms(stops=flight.chat.sampling.stop, cut_at=cut_at, finish_stop=finish_stop)
        if flight.miner_parts is None:
            relay = await self.off_loop(
                len(flight.miner_text),
                functools.partial(relayed_tokens, **terms),
                flight.model,
                flight.miner_text,
                list(commitment.output_token_ids),
            )
        else:
            relay = await trio.to_thread.run_sync(
                functools.partial(
                    structured_relayed_tokens, parts=flight.miner_parts, tools=flight.chat.tools, **terms
                ),
                flight.model,
                flight.miner_text,
                list(commitment.output_token_ids),
                limiter=self.tokenize_limiter,
            )
        if not relay.proved:
            # Established before the answer's end, like a proof of another prompt: the text is
            # not what the proven tokens say, so it is neither completed nor charged.
            log.warning(
                "request %s: miner %s sent text its proven tokens do not decode to; the answer is refused and not "
                "charged",
                flight.request_id,
                flight.miner,
            )
            self._offer_audit(
                flight,
                pending,
                response.commitment,
                proof.Delivery(relay.output_ids, relay.stop is not None, flight.chat.max_tokens),
                found=("cheat", "output-mismatch"),
            )
            return Accounting(claim=None, relayed_tokens=0, output_ids=None, stop=cut_at, refused="output-mismatch")
        if relay.defect is not None:
            log.info(
                "request %s: miner %s sent text that differs from its proven tokens in presentation only (%s); the "
                "buyer is given the proven text",
                flight.request_id,
                flight.miner,
                relay.defect,
            )
        if padding is not None:
            log.warning(
                "request %s: miner %s claims more usage than it served (%s)", flight.request_id, flight.miner, padding
            )
        self._offer_audit(
            flight,
            pending,
            response.commitment,
            proof.Delivery(
                relayed_output_ids=relay.output_ids,
                ended_at_stop=relay.stop is not None,
                max_tokens=flight.chat.max_tokens,
                defect=relay.defect,
            ),
            found=None if padding is None else ("cheat", "usage-padding"),
        )
        return Accounting(
            claim={**response.output, "committed_completion": len(commitment.output_token_ids)},
            relayed_tokens=relay.tokens,
            output_ids=tuple(commitment.output_token_ids),
            stop=relay.stop,
            proven_text=relay.proven_text,
        )

    async def _rendered_as_public_miner(
        self, flight: Flight, pending: PendingRequest, commitment: proof.Commitment
    ) -> bool:
        """Whether a miner that does not announce our features (a public one) proved the prompt
        one of the public miners renders for this request (`ServedModel.public_miner_prompts`)."""
        if FEATURE_TOOLS not in pending.leg.lacks:
            return False
        proven = list(commitment.prompt_ids)
        renders = await trio.to_thread.run_sync(
            flight.model.public_miner_prompts, flight.serve, limiter=self.tokenize_limiter
        )
        return proven in renders

    async def keep_proofs(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The service that lets an answer cut at a stop string stay provable (`account_for_cut`):
        its miner finishes and commits after the buyer's stream has ended, and the audit waits
        for that here rather than in the buyer's request."""
        async with trio.open_nursery() as nursery:
            self._proof_waits = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._proof_waits = None

    async def account_for_cut(self, flight: Flight, pending: PendingRequest, *, cut_at: str) -> Accounting:
        """An answer the gateway ended at a stop string while its miner was still generating (a
        miner that ignores stop strings, as the public one does). The buyer's stream ends now,
        billed for the relayed text as it stands; the miner is not cancelled, because its
        commitment comes only with its last frame, and a cancelled miner would leave the answer
        unproven for the gateway's own cut. The audit waits for that frame in `keep_proofs`, up
        to the request's time limit; a miner that never sends it is stopped then, and the answer
        is judged on its delivered tokens alone (`proof.judge_delivered`)."""
        relayed = await trio.to_thread.run_sync(
            self.encode, flight.model, flight.delivered_text, limiter=self.tokenize_limiter
        )
        waits = self._proof_waits
        if waits is None:
            await self.pool.cancel(pending)
            # Cancelled by the gateway before it could commit: no GEMM commitment is owed.
            self._offer_audit(flight, None, {}, proof.Delivery(tuple(relayed), True, flight.chat.max_tokens))
        else:
            waits.start_soon(self._audit_when_proven, flight, pending, cut_at, tuple(relayed))
        return Accounting(claim=None, relayed_tokens=len(relayed), output_ids=None, stop=cut_at)

    async def _audit_when_proven(
        self, flight: Flight, pending: PendingRequest, cut_at: str, relayed: tuple[int, ...]
    ) -> None:
        with trio.move_on_after(max(0.0, flight.started + flight.model.spec.max_request_s - self.monotonic())):
            while not pending.finished:
                await pending.changed.wait()
        response = pending.response
        if response is not None and response.output is not None and response.commitment:
            await self.account_for(flight, pending, cut_at=cut_at)
            return
        if not pending.finished:
            log.info(
                "request %s: miner %s sent no commitment within the request's time after the gateway cut its answer at a "
                "stop string; stopped, and its delivered tokens are audited",
                flight.request_id,
                flight.miner,
            )
            await self.pool.cancel(pending)
        self._offer_audit(flight, pending, {}, proof.Delivery(relayed, True, flight.chat.max_tokens))

    def _offer_audit(
        self,
        flight: Flight,
        pending: PendingRequest | None,
        commitment: dict,
        delivery: proof.Delivery,
        *,
        found: tuple[proof.VerdictKind, str] | None = None,
    ) -> None:
        """Make the answer an audit job if `audited` draws it. `pending`: the attempt that served
        it, whose leg a GEMM challenge goes back over (None: the gateway stopped it before it
        could commit, so no GEMM commitment is owed)."""
        if self.audit is None:
            return
        if found is None and not audited(flight.kind, draw=self.audit_draw(), paid_sample_pct=self.audit_paid_pct):
            return
        flight.audited = True
        gemm, rid = None, None
        if pending is not None and pending.response is not None and pending.response.gemm_commitment is not None:
            # The rid is the miner's name for its record: the gateway relays it, verifiers never see it.
            gemm = {key: value for key, value in pending.response.gemm_commitment.items() if key != "rid"}
            rid = pending.response.gemm_commitment["rid"]
        self.audit.offer(
            AuditJob(
                request_id=flight.request_id,
                model=flight.chat.model,
                miner=flight.miner,
                kind=flight.kind,
                prompt_ids=tuple(flight.prompt_ids),
                commitment=commitment,
                greedy=flight.chat.sampling.greedy or flight.served_greedily,
                sampling=flight.serve.sampling,
                seeded=flight.seeded,
                delivery=delivery,
                created_at=self.clock(),
                found=found,
                gemm_asked=pending is not None and pending.gemm_asked,
                gemm_commitment=gemm,
                gemm_rid=rid,
                leg_id="" if pending is None else pending.leg.leg_id,
            )
        )
