"""The verifier's loop, and the role that runs it: `engy-node --role verifier` leasing from a
gateway's audit API, or the verifier a gateway runs inside itself (`run_local_verifier`).

`Verifier.run` leases a batch when it has room, judges each job in a worker thread
(`concurrency` at a time, the only CPU/GPU work) and posts each verdict as soon as it is made.
A slow verifier only makes jobs wait; a gateway that is down or refuses a call is retried with
backoff, logged with the reason.

A job whose miner committed its activations is GEMM-audited too (issue 32): before judging, the
verifier draws the rows to open (`gemm_audit.draw_picks`) from the commitment's root and a secret
drawn once per `Verifier` and never sent anywhere, so the miner could not know them when it
committed, and asks its source for the openings (`AuditSource.open_gemm`), once, within
`GEMM_OPEN_TIMEOUT_S`. Whatever came back, or why nothing did, goes to the judge with the job
(`GemmEvidence`): no openings is the judge's `unproven`, never a retry that would give the miner
time it did not have.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from engy_node import proof
from engy_node.gemm.activations import CommitmentError
from engy_node.models import get_model
from engy_node.protocol.audit import (
    TOO_LATE,
    AuditJob,
    AuditRefused,
    AuditSource,
    GemmOpeningFailed,
    LeasedJob,
    PostedVerdict,
)
from engy_node.retry import backoff_delay
from engy_node.snapshots import encode
from engy_node.verdict_counts import ProofVerdicts
from engy_node.verifier.gemm_audit import GemmEvidence, draw_picks
from engy_node.verifier.judge import Judge
from engy_node.verifier.sources import HTTP_TIMEOUT_S, AuditCallFailed, GatheredAuditSource, HttpAuditSource

log = logging.getLogger("engy.verifier")

BACKOFF_CAP_S = 30.0
"""The longest pause between calls to a gateway that keeps failing (`retry.backoff_delay` from 1 s)."""
POST_ATTEMPTS = 4
"""Tries at posting one verdict before its job is left to return to the queue when its lease runs out."""
GEMM_OPEN_TIMEOUT_S = HTTP_TIMEOUT_S + 5
"""The longest a job's GEMM openings are waited for: the gateway gives the miner
`gateway.gemm_opening_timeout_s` (at most 25 s) and answers within the call's 30 s."""

JudgeFn = Callable[[AuditJob, GemmEvidence | None], proof.Verdict]
"""`Judge.judge`: a job's verdict, given the GEMM openings gathered for it (None: no commitment)."""


class Verifier:
    def __init__(
        self,
        source: AuditSource,
        judge: JudgeFn,
        *,
        concurrency: int = 1,
        poll_s: float = 2.0,
        on_verdict: Callable[[AuditJob, proof.Verdict], None] = lambda job, verdict: None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("a verifier needs a concurrency of at least 1")
        self.source = source
        self.judge = judge
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.on_verdict = on_verdict
        self.limiter = trio.CapacityLimiter(concurrency)
        self.judged = 0
        self._gemm_secret = os.urandom(32)
        """Where the GEMM picks' randomness comes from: this process's, never sent anywhere."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        failures = 0
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                room = self.concurrency - self.limiter.borrowed_tokens
                jobs: list[LeasedJob] = []
                if room > 0:
                    try:
                        with trio.fail_after(HTTP_TIMEOUT_S + 5):
                            jobs = await self.source.lease(room)
                        failures = 0
                    except (AuditCallFailed, AuditRefused, trio.TooSlowError) as error:
                        failures += 1
                        pause = backoff_delay(
                            consecutive_failures=failures, jitter=random.random(), cap_s=BACKOFF_CAP_S
                        )
                        log.warning("could not lease audit jobs (%s); retrying in %.1f s", _why(error), pause)
                        await trio.sleep(pause)
                        continue
                for leased in jobs:
                    slot = object()  # the judging task, not this loop, gives the slot back
                    await self.limiter.acquire_on_behalf_of(slot)
                    nursery.start_soon(self._judge_and_post, leased, slot)
                if not jobs:
                    await trio.sleep(self.poll_s)
                elif room <= len(jobs):
                    await trio.sleep(0.05)

    async def _judge_and_post(self, leased: LeasedJob, slot: object) -> None:
        job = leased.job
        try:
            started = time.perf_counter()
            evidence = await self._gemm_evidence(job)
            # Not abandoned on cancellation: a model pass cannot be interrupted, and a process
            # that exits while a thread is still inside torch is aborted by its C++ runtime
            # (SIGABRT at shutdown instead of a clean exit). Stopping waits for the pass instead.
            verdict = await trio.to_thread.run_sync(self._judge_safely, job, evidence)
            elapsed = time.perf_counter() - started
        finally:
            self.limiter.release_on_behalf_of(slot)
        self.on_verdict(job, verdict)
        for attempt in range(1, POST_ATTEMPTS + 1):
            try:
                with trio.fail_after(HTTP_TIMEOUT_S + 5):
                    await self.source.post([PostedVerdict(job.request_id, verdict.kind, _reason_code(verdict.code))])
                break
            except (AuditCallFailed, AuditRefused, trio.TooSlowError) as error:
                if attempt == POST_ATTEMPTS or isinstance(error, AuditRefused) and error.status < 500:
                    log.warning(
                        "verdict on job %s not delivered (%s); the job returns to the queue when its lease runs out",
                        job.request_id,
                        _why(error),
                    )
                    return
                await trio.sleep(
                    backoff_delay(consecutive_failures=attempt, jitter=random.random(), cap_s=BACKOFF_CAP_S)
                )
        self.judged += 1
        log.log(
            logging.WARNING if verdict.kind == "cheat" else logging.INFO,
            "job %s (%s, %d output tokens, %s): %s (%s) in %.2f s%s",
            job.request_id,
            job.model,
            len(job.commitment.get("output_token_ids") or job.delivery.relayed_output_ids),
            _asked(job),
            verdict.kind,
            verdict.code,
            elapsed,
            _evidence(verdict) if verdict.kind == "cheat" else "",
        )

    async def _gemm_evidence(self, job: AuditJob) -> GemmEvidence | None:
        """The openings of a job's GEMM commitment at picks only this verifier knows; None for a
        job without one. Never raises: what went wrong is the evidence's `failure`."""
        if job.gemm_commitment is None:
            return None
        try:
            picks = draw_picks(self._gemm_secret, job.gemm_commitment, prompt_positions=len(job.prompt_ids))
        except CommitmentError as error:
            # Nothing to open; the judge reads the commitment itself and says what is wrong with it.
            return GemmEvidence((), None, f"the commitment cannot be read ({error})")
        try:
            with trio.fail_after(GEMM_OPEN_TIMEOUT_S):
                openings = await self.source.open_gemm(job.request_id, picks)
        except GemmOpeningFailed as failed:
            if failed.code == TOO_LATE:
                log.info("job %s: judged by TOPLOC alone, %s", job.request_id, failed.message)
                return None
            failure = str(failed)
        except trio.TooSlowError:
            failure = f"the gateway did not answer within {GEMM_OPEN_TIMEOUT_S:g} s"
        else:
            return GemmEvidence(picks, openings)
        log.info("job %s: no GEMM openings (%s)", job.request_id, failure)
        return GemmEvidence(picks, None, failure)

    def _judge_safely(self, job: AuditJob, evidence: GemmEvidence | None) -> proof.Verdict:
        try:
            return self.judge(job, evidence)
        except Exception as error:  # broad on purpose: a verifier bug is "could not judge", never "cheat"
            log.exception("judging job %s failed (%s); answering unproven", job.request_id, type(error).__name__)
            return proof.Verdict("unproven", "verifier-error")


def _asked(job: AuditJob) -> str:
    """How the answer was asked for, as the token check judged it."""
    terms = job.sampling_terms()
    if terms is None:
        return "greedy"
    return f"T {terms.temperature:g} top_p {terms.top_p:g}, {'replayed' if terms.seed is not None else 'statistical'}"


def _evidence(verdict: proof.Verdict) -> str:
    """What a cheat verdict rests on, for the operator reading the log: the chunk statistics and
    the token check's (no buyer content: counts and distances only)."""
    return (
        f"; chunks {verdict.chunks_passed}/{verdict.chunks_total} passed (worst {verdict.max_exp_mismatches} exponent "
        f"mismatches, mantissa error mean {verdict.max_mant_err_mean:.1f}, median {verdict.max_mant_err_median:.1f}); "
        f"tokens: {verdict.token_misses} not chosen, largest gap {verdict.max_logit_gap:.3f} logits, "
        f"log e-value {verdict.token_evidence:.1f}"
    )


def _reason_code(reason: str) -> str:
    """`proof.Verdict.reason` is a code already; keep it inside the audit API's alphabet."""
    code = "".join(ch if ch.isalnum() or ch in "_.:+-" else "-" for ch in reason)[:128]
    return code or "unspecified"


def _why(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "the gateway did not answer in time"
    return str(error)


async def run_verifier_role(config, hub, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """`engy-node --role verifier`: lease from `verifier.gateway_url`, signing with the
    configured hotkey."""
    from engy_node.config import comma_list
    from engy_node.errors import ConfigError
    from engy_node.keys import load_hotkey

    settings = config.verifier
    if not settings.gateway_url:
        raise ConfigError(
            "verifier.gateway_url is empty: name the gateway's provider API, e.g. --provider http://127.0.0.1:8082"
        )
    if not settings.wallet_name or not settings.wallet_hotkey:
        raise ConfigError(
            "the verifier signs its calls: set --verifier-wallet and --verifier-hotkey (verifier.wallet_name, "
            "verifier.wallet_hotkey): a hotkey the gateway lists in gateway.verifiers"
        )
    keypair = await trio.to_thread.run_sync(
        load_hotkey, settings.wallets_path, settings.wallet_name, settings.wallet_hotkey
    )
    checkpoints = await trio.to_thread.run_sync(functools.partial(verifier_checkpoints, config))
    urls = comma_list(settings.gateway_url)
    sources = [HttpAuditSource(url, keypair=keypair, netuid=config.node.netuid) for url in urls]
    source = sources[0] if len(sources) == 1 else GatheredAuditSource(sources)
    judge = Judge(checkpoints, device=settings.device, dtype=settings.dtype, threads=settings.threads)
    tally = {"pass": 0, "cheat": 0, "unproven": 0}
    proofs = ProofVerdicts()

    def count(job: AuditJob, verdict: proof.Verdict) -> None:
        nonlocal proofs
        tally[verdict.kind] += 1
        proofs = proofs.counted(verdict.kind, verdict.code)
        hub.set_state("verifier", verdicts=dict(tally), proofs=encode(proofs))

    verifier = Verifier(source, judge.judge, concurrency=settings.concurrency, poll_s=settings.poll_s, on_verdict=count)
    hub.set_state("verifier", state="running", gateway=settings.gateway_url, hotkey=keypair.ss58_address)
    log.info(
        "verifier %s leasing from %s (%s on %s, %d at a time)",
        keypair.ss58_address,
        settings.gateway_url,
        settings.dtype,
        settings.device,
        settings.concurrency,
    )
    try:
        await verifier.run(task_status=task_status)
    finally:
        with trio.CancelScope(shield=True):
            await source.aclose()


def verifier_checkpoints(config) -> dict[str, Path]:
    """Each verifiable model's checkpoint (blocking: the embedded model may be converted once)."""
    from engy_node.config import checkpoint_pairs, comma_list
    from engy_node.serve.checkpoint import resolve_checkpoint

    settings = config.verifier
    pairs = checkpoint_pairs(settings.checkpoints)
    checkpoints = {}
    for model_id in comma_list(settings.models):
        spec = get_model(model_id)
        if not spec.embedded and model_id not in pairs:
            log.warning(
                'verifier: no checkpoint for %s (set verifier.checkpoints = "%s=/path"); its jobs are '
                "answered unproven",
                model_id,
                model_id,
            )
            continue
        checkpoints[model_id] = resolve_checkpoint(
            model_id=model_id,
            checkpoint=pairs.get(model_id, ""),
            models_dir=config.paths.models_dir,
            cache_dir=config.paths.model_cache_dir,
        )
    return checkpoints


async def run_local_verifier(
    source: AuditSource, checkpoints: Mapping[str, Path], *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """The verifier a gateway runs inside itself (`gateway.local_verifier`), on its own desk."""
    # One thread: this verifier shares the machine with the gateway and, on a local network, the miners' model servers.
    judge = Judge(checkpoints, device="cpu", dtype="float32", threads=1)
    log.info("judging audit jobs inside the gateway (gateway.local_verifier)")
    await Verifier(source, judge.judge).run(task_status=task_status)
