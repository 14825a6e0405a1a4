"""The verifier worker (SPEC §10): lease audit jobs, recompute each answer on the canonical model,
judge it (SPEC §5), post the verdicts.

`engy-node --role verifier` leases from a gateway's signed audit API (`HttpAuditSource`, signed
with the verifier's hotkey, which the gateway allow-lists); a gateway with
`gateway.local_verifier` runs the same loop inside itself on its audit desk (`DeskAuditSource`).

Shape. `Judge` is the blocking part: one `ModelRunner` per model, loaded on first use, and
`proof.verify_commitment` with the runner's prefill as the recompute. `Verifier.run` is the trio
loop around it: lease a batch when it has room, judge each job in a worker thread
(`concurrency` at a time, the only CPU/GPU work), post each verdict as soon as it is made. A
slow verifier only makes jobs wait: it never touches the serving path, and a job whose lease
runs out goes back to the queue for another verifier. Every wait is bounded; a gateway that is
down or refuses a call is retried with backoff, logged with the reason.

A job the verifier cannot judge (an unknown model, a malformed commitment, a recompute that
fails) gets `unproven` with the reason, never `cheat`: only established misbehaviour is a cheat.
An answer that came with no commitment at all is still judged, on its delivered tokens against
the canonical model (`proof.judge_delivered`); its verdict's reason says so (`recompute:…`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

from engy_node import keys, proof
from engy_node.gateway.audit import AuditJob
from engy_node.gateway.audit_desk import AuditDesk, AuditRefused, PostedVerdict
from engy_node.gateway.store import LOCAL_VERIFIER
from engy_node.models import ModelSpec, get_model, model_root

log = logging.getLogger("engy.verifier")

HTTP_TIMEOUT_S = 30.0
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


@dataclasses.dataclass(frozen=True, slots=True)
class LeasedJob:
    job: AuditJob
    expires_in_s: float


class AuditSource(Protocol):
    """Where jobs come from and verdicts go."""

    name: str

    async def lease(self, limit: int) -> list[LeasedJob]: ...

    async def post(self, verdicts: list[PostedVerdict]) -> None: ...


class DeskAuditSource:
    """The gateway's own audit desk, in process."""

    name = LOCAL_VERIFIER

    def __init__(self, desk: AuditDesk) -> None:
        self.desk = desk

    async def lease(self, limit: int) -> list[LeasedJob]:
        now = self.desk.clock()
        return [LeasedJob(lease.job, lease.expires_at - now) for lease in self.desk.lease(LOCAL_VERIFIER, limit=limit)]

    async def post(self, verdicts: list[PostedVerdict]) -> None:
        await self.desk.submit(LOCAL_VERIFIER, verdicts)


class AuditCallFailed(Exception):
    """The gateway did not take a call; the message says why (and the fix, where it is ours)."""


class HttpAuditSource:
    """A gateway's signed audit API (`provider_api.py`)."""

    def __init__(
        self, provider_url: str, *, keypair: Any, netuid: int, client: httpx.AsyncClient | None = None
    ) -> None:
        self.base = provider_url.rstrip("/")
        self.keypair = keypair
        self.netuid = netuid
        self.name = keypair.ss58_address
        self.client = client or httpx.AsyncClient(timeout=HTTP_TIMEOUT_S)

    async def lease(self, limit: int) -> list[LeasedJob]:
        body = await self._call("/api/subnet/v1/audit/lease", {"max_jobs": limit})
        jobs = []
        for wire in body.get("jobs") or []:
            try:
                jobs.append(LeasedJob(AuditJob.from_wire(wire), float(wire.get("lease_expires_in_s") or 0.0)))
            except ValueError as error:
                log.warning(
                    "skipped a leased job the gateway sent malformed (%s); it returns to the queue when its "
                    "lease runs out",
                    error,
                )
        return jobs

    async def post(self, verdicts: list[PostedVerdict]) -> None:
        await self._call("/api/subnet/v1/audit/verdicts", {"verdicts": [dataclasses.asdict(v) for v in verdicts]})

    async def _call(self, path: str, payload: dict) -> dict:
        import orjson

        raw = orjson.dumps(payload)
        headers = keys.signed_headers(self.keypair, self.netuid, "POST", path, raw, int(time.time()))
        try:
            response = await self.client.post(
                self.base + path, content=raw, headers={**headers, "content-type": "application/json"}
            )
        except httpx.HTTPError as error:
            raise AuditCallFailed(f"cannot reach {self.base} ({type(error).__name__}: {error})") from None
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            if response.status_code == 403:
                message += f"; ask the gateway operator to add {self.name} to gateway.verifiers"
            raise AuditCallFailed(f"{path} answered {response.status_code}: {message}")
        return response.json()

    async def aclose(self) -> None:
        await self.client.aclose()


class GatheredAuditSource:
    """Every host of a gateway fleet: each host keeps the audit jobs of the responses it served
    (their proof material is buyer content and stays in that host's memory, SPEC §8.3), so a
    verifier gathers from all of them, and each verdict goes back to the host it leased from.

    A host that cannot be reached costs only its own jobs: the others are leased from as usual,
    and the call fails only when every host failed."""

    def __init__(self, sources: list[HttpAuditSource]) -> None:
        if not sources:
            raise ValueError("a gathered source needs at least one gateway")
        self.sources = sources
        self.name = sources[0].name
        self._from: dict[str, HttpAuditSource] = {}
        self._turn = 0

    async def lease(self, limit: int) -> list[LeasedJob]:
        jobs: list[LeasedJob] = []
        failures: list[str] = []
        # Start at a different host each call, so a small `limit` does not always go to the first.
        order = self.sources[self._turn :] + self.sources[: self._turn]
        self._turn = (self._turn + 1) % len(self.sources)
        for source in order:
            if len(jobs) >= limit:
                break
            try:
                leased = await source.lease(limit - len(jobs))
            except AuditCallFailed as error:
                failures.append(str(error))
                continue
            for job in leased:
                self._from[job.job.request_id] = source
            jobs += leased
        if len(failures) == len(self.sources):
            raise AuditCallFailed("; ".join(failures))
        for failure in failures:
            log.warning("leasing from one gateway host failed (%s); leasing from the others", failure)
        return jobs

    async def post(self, verdicts: list[PostedVerdict]) -> None:
        by_source: dict[int, tuple[HttpAuditSource, list[PostedVerdict]]] = {}
        for verdict in verdicts:
            source = self._from.pop(verdict.job_id, None)
            if source is None:
                log.warning("verdict on job %s, which no gateway host leased to this verifier; dropped", verdict.job_id)
                continue
            by_source.setdefault(id(source), (source, []))[1].append(verdict)
        for source, posted in by_source.values():
            await source.post(posted)

    async def aclose(self) -> None:
        for source in self.sources:
            await source.aclose()


class Judge:
    """Judges jobs on the canonical models. Blocking; safe to call from several threads (each
    model loads once; prefill runs under the runner's own inference mode)."""

    def __init__(
        self, checkpoints: Mapping[str, Path], *, device: str = "cpu", dtype: str = "float32", threads: int = 0
    ) -> None:
        self.checkpoints = dict(checkpoints)
        self.device = device
        self.dtype = dtype
        self.threads = threads
        """CPU threads for the recompute (torch's, process-wide); 0 leaves torch's default. A
        verifier sharing a machine with a model server wants few: two thread pools spinning on
        the same cores make both several times slower."""
        self._loaded: dict[str, tuple[Any, str, frozenset[int]]] = {}
        self._lock = threading.Lock()

    def _runner(self, model: str):
        with self._lock:
            if model not in self._loaded:
                from engy_node.serve.engine import ModelRunner
                from engy_node.served_model import end_token_ids_of

                if self.threads:
                    import torch

                    torch.set_num_threads(self.threads)
                checkpoint = self.checkpoints[model]
                runner = ModelRunner.load(checkpoint, device=self.device, dtype=self.dtype)
                self._loaded[model] = (runner, model_root(checkpoint), end_token_ids_of(checkpoint, runner.tokenizer))
                log.info("verifier loaded %s (%s on %s)", model, self.dtype, runner.device)
            return self._loaded[model]

    def judge(self, job: AuditJob) -> proof.Verdict:
        """The verdict on one job; one that passes on a delivery the gateway repaired says how
        the miner's text fell short of its proven tokens (`defect:<kind>`: counted, never a cheat)."""
        verdict = self._judge(job)
        if verdict.kind == "pass" and job.delivery.defect is not None:
            return dataclasses.replace(verdict, reason=f"defect:{job.delivery.defect}")
        return verdict

    def _judge(self, job: AuditJob) -> proof.Verdict:
        if job.model not in self.checkpoints:
            return proof.Verdict("unproven", "model-not-verifiable")
        if not job.commitment:
            return self._judge_delivered(job)
        try:
            commitment = proof.Commitment.from_wire(job.commitment)
        except proof.ProofFormatError:
            return proof.Verdict("unproven", "malformed-commitment")
        spec: ModelSpec = get_model(job.model)
        runner, root, end_ids = self._runner(job.model)
        return proof.verify_commitment(
            commitment,
            model=spec,
            canonical_root=root,
            expected_prompt_ids=job.prompt_ids,
            recompute=runner.prefill,
            greedy=job.greedy,
            delivery=job.delivery,
            end_token_ids=end_ids,
            sampling=job.sampling_terms(),
        )

    def _judge_delivered(self, job: AuditJob) -> proof.Verdict:
        """No commitment (a TEE miner, or any miner that sends `commitment: {}`): the delivered
        tokens judged on the canonical model alone (`proof.judge_delivered`)."""
        runner, _, _ = self._runner(job.model)
        return proof.judge_delivered(
            job.prompt_ids,
            job.delivery.relayed_output_ids,
            model=get_model(job.model),
            recompute=runner.prefill,
            greedy=job.greedy,
            sampling=job.sampling_terms(),
            resegment=functools.partial(model_segmentation, runner),
        )


SEGMENTATION_CANDIDATES = 256
"""The most probable tokens at each step among which `model_segmentation` looks for the piece."""
SEGMENTATION_WINDOW = 4


def model_segmentation(runner, prompt_ids: Sequence[int], delivered_ids: Sequence[int]) -> list[int] | None:
    """The delivered text in the pieces the canonical model would most likely have written it
    in: decoding after the prompt, each step takes the most probable of the step's likeliest
    tokens that keeps the decoded output a prefix of the text, and the tokenizer's own next
    piece only when none does. An honest greedy answer comes back exactly as the model wrote
    it (its argmax always fits). Text that ends inside a piece (a tail a peer held back, a stop
    string cut mid-token) ends with the likeliest piece that covers what is left of it. None
    when the text cannot be followed piece by piece (a character split across tokens at a point
    the model did not split it)."""
    import torch

    text = runner.decode_text(list(delivered_ids))
    cache = runner.new_cache()
    _, logits = runner.forward(list(prompt_ids), cache)
    pieces: list[int] = []
    written = ""

    def extended(token: int) -> str:
        # The text a token adds, decoded with the few tokens before it (a byte-level piece may
        # finish a character they began), rather than the whole answer again per candidate.
        window = pieces[-SEGMENTATION_WINDOW:]
        before = runner.decode_text(window)
        after = runner.decode_text(window + [token])
        if "\ufffd" in after or not after.startswith(before):
            return runner.decode_text(pieces + [token])
        return written + after[len(before) :]

    for _ in range(2 * len(delivered_ids) + 8):
        if written == text:
            return pieces
        chosen = None
        for token in torch.topk(logits, SEGMENTATION_CANDIDATES).indices.tolist():
            candidate = extended(token)
            if len(candidate) > len(written) and (text.startswith(candidate) or candidate.startswith(text)):
                chosen, written = token, candidate
                break
        if chosen is None:
            rest = runner.tokenizer.encode(text[len(written) :], add_special_tokens=False)
            if not rest or not text.startswith(candidate := extended(rest[0])) or len(candidate) <= len(written):
                return None
            chosen, written = rest[0], candidate
        pieces.append(chosen)
        if written.startswith(text):
            return pieces
        _, logits = runner.forward([chosen], cache)
    return None


class Verifier:
    def __init__(
        self,
        source: AuditSource,
        judge: Callable[[AuditJob], proof.Verdict],
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
                        pause = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                        failures += 1
                        log.warning("could not lease audit jobs (%s); retrying in %.0f s", _why(error), pause)
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
            # Not abandoned on cancellation: a model pass cannot be interrupted, and a process
            # that exits while a thread is still inside torch is aborted by its C++ runtime
            # (SIGABRT at shutdown instead of a clean exit). Stopping waits for the pass instead.
            verdict = await trio.to_thread.run_sync(self._judge_safely, job)
            elapsed = time.perf_counter() - started
        finally:
            self.limiter.release_on_behalf_of(slot)
        self.on_verdict(job, verdict)
        for pause in (*BACKOFF_S[:3], None):
            try:
                with trio.fail_after(HTTP_TIMEOUT_S + 5):
                    await self.source.post([PostedVerdict(job.request_id, verdict.kind, _reason_code(verdict.code))])
                break
            except (AuditCallFailed, AuditRefused, trio.TooSlowError) as error:
                if pause is None or isinstance(error, AuditRefused) and error.status < 500:
                    log.warning(
                        "verdict on job %s not delivered (%s); the job returns to the queue when its lease runs out",
                        job.request_id,
                        _why(error),
                    )
                    return
                await trio.sleep(pause)
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

    def _judge_safely(self, job: AuditJob) -> proof.Verdict:
        try:
            return self.judge(job)
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

    def count(job: AuditJob, verdict: proof.Verdict) -> None:
        tally[verdict.kind] += 1
        hub.set_state("verifier", verdicts=dict(tally))

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
