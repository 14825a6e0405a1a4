"""The blocking part of a verifier: recompute an answer on the canonical model and judge it.

`Judge` keeps one `ModelRunner` per model, loaded on first use, and runs
`proof.verify_commitment` with the runner's prefill as the recompute; an answer that came with
no commitment is judged on its delivered tokens alone (`proof.judge_delivered`), segmented as
the model would have written them (`model_segmentation`).

An answer that also committed its activations (`AuditJob.gemm_commitment`) is GEMM-audited on
the openings the verifier role gathered for it (`gemm_audit.judge_openings`, against a
`GemmModel` built once per model from the same runner). Both judge; a TOPLOC or recompute cheat
stands as it is, otherwise a GEMM cheat or unproven is the verdict (path ``gemm``), otherwise
TOPLOC's — which, when the GEMM audit passed the answer too, is posted as the GEMM audit's
(``gemm:ok``), so the dashboards count how much of the traffic the stronger proof covered. A job whose miner was asked to commit and sent nothing is unproven (``gemm:no-commitment``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engy_node import proof
from engy_node.models import ModelSpec, get_model, model_root
from engy_node.protocol.audit import AuditJob
from engy_node.verifier.gemm_audit import GemmEvidence, GemmJudgement, GemmModel, gemm_model_of, judge_openings

log = logging.getLogger("engy.verifier")


class Judge:
    """Judges jobs on the canonical models. Blocking; safe to call from several threads (each
    model loads once; prefill runs under the runner's own inference mode)."""

    def __init__(
        self,
        checkpoints: Mapping[str, Path],
        *,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int = 0,
        gemm_secret: bytes | None = None,
    ) -> None:
        self.checkpoints = dict(checkpoints)
        self.device = device
        self.dtype = dtype
        self.threads = threads
        """CPU threads for the recompute (torch's, process-wide); 0 leaves torch's default. A
        verifier sharing a machine with a model server wants few: two thread pools spinning on
        the same cores make both several times slower."""
        self._loaded: dict[str, tuple[Any, str, frozenset[int]]] = {}
        self._gemm_models: dict[str, GemmModel] = {}
        self._gemm_secret = os.urandom(32) if gemm_secret is None else gemm_secret
        """The Freivalds keys' secret: this process's own, never sent anywhere (tests pass one)."""
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

    def _gemm_model(self, model: str) -> GemmModel:
        runner, _, _ = self._runner(model)
        with self._lock:
            if model not in self._gemm_models:
                self._gemm_models[model] = gemm_model_of(runner, secret=self._gemm_secret)
            return self._gemm_models[model]

    def judge(self, job: AuditJob, gemm: GemmEvidence | None = None) -> proof.Verdict:
        """The verdict on one job, with the GEMM audit's openings `gemm` when the role gathered
        them; one that passes on a delivery the gateway repaired says how the miner's text fell
        short of its proven tokens (`defect:<kind>`: counted, never a cheat)."""
        verdict = self._judge(job)
        if verdict.kind != "cheat" and job.model in self.checkpoints:
            audited = self._judge_gemm(job, gemm)
            if audited is not None and audited.kind != "pass":
                return dataclasses.replace(verdict, kind=audited.kind, reason=audited.reason, path="gemm")
            if audited is not None and verdict.kind == "pass" and job.delivery.defect is None:
                return dataclasses.replace(verdict, path="gemm")
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

    def _judge_gemm(self, job: AuditJob, gemm: GemmEvidence | None) -> GemmJudgement | None:
        """The GEMM audit's judgement; None when there is nothing to audit (no commitment was
        asked for, or the role gathered no evidence)."""
        if job.gemm_commitment is None:
            return GemmJudgement("unproven", "no-commitment") if job.gemm_asked else None
        if gemm is None:
            return None
        # The positions a commitment covers: the prompt and every output token fed back (all
        # but the last), the output as the TOPLOC commitment states it or else as relayed.
        committed = job.commitment.get("output_token_ids") if job.commitment else None
        output = committed if isinstance(committed, list) else job.delivery.relayed_output_ids
        judgement = judge_openings(
            self._gemm_model(job.model),
            job.gemm_commitment,
            gemm,
            expected_positions=len(job.prompt_ids) + len(output) - 1,
            prompt_positions=len(job.prompt_ids),
        )
        failed = judgement.failed
        if failed is not None:
            log.warning(
                "job %s: GEMM audit failed %s at layer %d, position %d (%.3g × its tolerance)",
                job.request_id,
                failed.step,
                failed.layer,
                failed.position,
                failed.worst,
            )
        elif judgement.kind != "pass":
            log.info("job %s: GEMM audit %s (%s%s)", job.request_id, judgement.kind, judgement.reason, _why(gemm))
        return judgement

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


def _why(gemm: GemmEvidence) -> str:
    return f": {gemm.failure}" if gemm.failure else ""


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
