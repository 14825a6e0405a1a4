"""The GEMM audit measured on answers served in this process, beside TOPLOC on the same answers.

`bench/gemm_audit.py` (the published figures) and `engy-node calibrate --gemm-audits N` (a
machine's own check) measure the same thing, so the measuring lives here once: an answer served
on the reference server's engine with the activation capture on (`serve.capture`, what a request
with ``return_gemm_commitment`` gets), with its TOPLOC proofs' rows and its ``gemm_commitment``
(plus the rid its record is filed under), exactly as a miner would serve it; then the verifier's
side of each audit: a fresh 256-bit secret, `gemm_audit.draw_picks` after the commitment, the
openings as the server's ``POST /gemm/openings`` writes them round-tripped through a
``gemm_openings`` frame, and `gemm_audit.judge_openings`; and TOPLOC's verdict on the same
answer as the verifier reaches it (`proof.verify_commitment` on a float32 recompute).

`run_gemm_calibration` is calibrate's pass over its own cases (`GEMM_CASES`: honest, the cheats
calibrate asserts, and its detection-power cases), greedy, and `format_gemm_table` its table.
It sits in the verifier role because it judges with the verifier's `gemm_audit`; only the node's
`calibrate` and the bench import it, lazily, so the validator never reaches the model stack.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

DROPPED_LAYERS = 4
"""calibration's `truncated`: the last 4 of 30 decoder layers dropped."""


def zero_last_layers(runner: Any, drop: int = DROPPED_LAYERS) -> Any:
    """The smaller model inside the full model's shape: the last `drop` layers' projections
    zeroed, so each of those layers passes the residual stream through unchanged (exactly the
    model with them dropped) while the commitment still names every layer."""
    import torch

    with torch.no_grad():
        for layer in runner.model.model.layers[len(runner.model.model.layers) - drop :]:
            for block in (layer.self_attn, layer.mlp):
                for module in block.children():
                    if isinstance(module, torch.nn.Linear):
                        module.weight.zero_()
    return runner


# ---- serving: the miner's side -----------------------------------------------------------------


@dataclasses.dataclass
class Served:
    answer: int
    setting: tuple[float, float] | None
    """None: greedy; else (temperature, top_p), seeded with `answer`."""
    prompt_ids: list[int]
    output_ids: list[int]
    rows: Any
    """One final hidden state per output token: what the TOPLOC proofs are built from."""
    gemm_commitment: dict[str, Any]


class Serving:
    """The miner's side for one case: the engine's generation with the capture on."""

    def __init__(self, runner, layout, openings, weights_root: str, max_new_tokens: int) -> None:
        self.runner = runner
        self.layout = layout
        self.openings = openings
        self.weights_root = weights_root
        self.max_new_tokens = max_new_tokens
        self.served = 0

    def capture(self):
        from engy_node.serve.capture import ActivationCapture

        return ActivationCapture(self.layout, self.openings, weights_root=self.weights_root, arithmetic="bfloat16")

    def generation(self, prompt_ids: Sequence[int], setting, seed: int, *, capture: bool = True):
        """A request as our miner sends it (every sampling knob explicit, the gateway's seed)."""
        from engy_node.protocol.miner import SEEDED_TOP_K
        from engy_node.serve.engine import Generation
        from engy_node.serve.sampling import parse_sampling_params

        params: dict[str, Any] = {"temperature": 0, "max_new_tokens": self.max_new_tokens}
        if setting is not None:
            params.update(temperature=setting[0], top_p=setting[1], top_k=SEEDED_TOP_K, min_p=0.0, sampling_seed=seed)
        self.served += 1
        generation = Generation(
            rid=f"gemm-calibration-{self.served}",
            input_ids=list(prompt_ids),
            params=parse_sampling_params(params),
            return_hidden_states=True,
        )
        if capture:
            generation.capture = self.capture()
        return generation

    def serve(self, answer: int, prompt_ids: list[int], setting) -> Served:
        from engy_node.serve.engine import run_to_completion

        generation = run_to_completion(self.runner, self.generation(prompt_ids, setting, answer))
        return self.served_of(answer, prompt_ids, setting, generation)

    def served_of(self, answer: int, prompt_ids, setting, generation) -> Served:
        commitment = {**(generation.gemm_commitment or {}), "rid": generation.rid}
        return Served(
            answer, setting, list(prompt_ids), list(generation.output_ids), generation.proof_rows(), commitment
        )


class PrefillAttack(Serving):
    """Tokens from the cheap runner; the canonical runner's one forward pass over prompt and
    output (all but the last token, which is never fed) gives the proofs' rows and the capture."""

    def __init__(self, cheap, honest, *args) -> None:
        super().__init__(cheap, *args)
        self.honest = honest

    def serve(self, answer: int, prompt_ids: list[int], setting) -> Served:
        from engy_node.serve.engine import run_to_completion

        cheap = run_to_completion(self.runner, self.generation(prompt_ids, setting, answer, capture=False))
        capture = self.capture()
        tokens = list(prompt_ids) + list(cheap.output_ids[:-1])
        hidden, _ = self.honest.forward(tokens, self.honest.new_cache(), capture)
        commitment = {**capture.commit(cheap.rid), "rid": cheap.rid}
        rows = hidden[len(prompt_ids) - 1 :]
        return Served(answer, setting, list(prompt_ids), list(cheap.output_ids), rows, commitment)


# ---- judging: the verifier's side --------------------------------------------------------------


def gemm_audit_of(
    served: Served, store, model, *, audits: int
) -> tuple[list[str], float, int, int, int, list[frozenset[int]]]:
    """`audits` audits of one answer, each with a fresh secret: the verdicts (`pass` or
    `kind/gemm:reason`), the first's CPU seconds (draw_picks + judge_openings, in this thread,
    where both run: a serving side in the same process keeps threads of its own), its frames'
    JSON bytes (challenge, openings) and opening count, and each audit's layers opened in full
    (`gemm_audit.audited_layers`), so a cheat confined to some layers can be told apart from
    what the draw reached."""
    from engy_node.protocol.gemm import GemmChallenge, GemmOpenings
    from engy_node.verifier import gemm_audit

    rid = served.gemm_commitment["rid"]
    verdicts: list[str] = []
    layers: list[frozenset[int]] = []
    first_cpu, sizes = 0.0, (0, 0, 0)
    for audit in range(audits):
        secret = secrets.token_bytes(32)
        started = time.thread_time()
        picks = gemm_audit.draw_picks(secret, served.gemm_commitment, prompt_positions=len(served.prompt_ids))
        cpu = time.thread_time() - started
        # The miner's side: its serve opens the record (`serve.gemm_routes`' wire form).
        opened = store.open(rid, [(p.position, p.layer, p.group) for p in picks])
        if opened is None:
            raise RuntimeError(f"the record of {rid} left the openings store before its audit; give it more bytes")
        record, openings = opened
        wires = [o.to_wire(record.layout.dtype, record.layout.width(o.group)) for o in openings]
        challenge = orjson.dumps(GemmChallenge(f"c{audit}", rid, picks).to_wire())
        frame = orjson.dumps(GemmOpenings(f"c{audit}", tuple(wires)).to_wire())
        relayed = tuple(orjson.loads(frame)["openings"])
        evidence = gemm_audit.GemmEvidence(picks=picks, openings=relayed)
        started = time.thread_time()
        verdict = gemm_audit.judge_openings(
            model,
            served.gemm_commitment,
            evidence,
            expected_positions=len(served.prompt_ids) + len(served.output_ids) - 1,
        )
        cpu += time.thread_time() - started
        verdicts.append(verdict.kind if verdict.kind == "pass" else f"{verdict.kind}/gemm:{verdict.reason}")
        layers.append(frozenset(gemm_audit.audited_layers(record.layout, picks)))
        if audit == 0:
            first_cpu, sizes = cpu, (len(challenge), len(frame), len(wires))
    return verdicts, first_cpu, *sizes, layers


class Toploc:
    """TOPLOC as the verifier runs it: the float32 recompute and `proof.verify_commitment`."""

    def __init__(self, checkpoint: Path, spec, root: str, end_ids, max_new_tokens: int, *, device: str = "cpu") -> None:
        from engy_node.calibration import CachedPrefill
        from engy_node.serve.engine import ModelRunner

        self.runner = ModelRunner.load(checkpoint, device=device, dtype="float32")
        self.recompute = CachedPrefill
        self.spec, self.root, self.end_ids, self.max_new_tokens = spec, root, end_ids, max_new_tokens

    def judge(self, served: Served) -> tuple[str, float]:
        """The verdict (`pass` or `kind/code`) and its CPU seconds."""
        from engy_node import logit_stats, proof

        commitment = proof.build_commitment(
            model_root=self.root,
            prompt_ids=served.prompt_ids,
            output_ids=served.output_ids,
            rows=served.rows,
            params=self.spec.proof,
        )
        sampling = (
            None
            if served.setting is None
            else logit_stats.SamplingTerms(served.setting[0], served.setting[1], seed=served.answer)
        )
        started = time.process_time()
        verdict = proof.verify_commitment(
            commitment,
            model=self.spec,
            canonical_root=self.root,
            expected_prompt_ids=served.prompt_ids,
            recompute=self.recompute(self.runner),
            greedy=sampling is None,
            delivery=proof.Delivery(tuple(served.output_ids), ended_at_stop=False, max_tokens=self.max_new_tokens),
            end_token_ids=self.end_ids,
            sampling=sampling,
        )
        cpu = time.process_time() - started
        return (verdict.kind if verdict.kind == "pass" else f"{verdict.kind}/{verdict.code}"), cpu


def caught(verdicts: Sequence[str]) -> int:
    """How many of these verdicts (`pass`, `kind/code`) are `cheat`."""
    return sum(1 for v in verdicts if v.startswith("cheat"))


def reasons(verdicts: Sequence[str]) -> str:
    """The commonest codes among the verdicts, most first (`–`: none)."""
    counts = Counter(v.split("/", 1)[1] for v in verdicts if "/" in v)
    return ", ".join(f"{code} {n}" for code, n in counts.most_common(4)) or "–"


def rate(k: int, n: int) -> str:
    """`k/n (low–high %)`, the exact 95 % interval calibrate uses."""
    from engy_node.calibration import proportion_interval

    low, high = proportion_interval(k, n)
    return f"{k}/{n} ({100 * low:.1f}–{100 * high:.1f} %)"


# ---- calibrate's pass --------------------------------------------------------------------------


def _gemm_cases() -> tuple[tuple[str, Any, Callable[[Any], Any] | None], ...]:
    """(name, the verdict calibrate expects of either proof, how the serving weights are
    altered): calibrate's greedy cases that serve an answer (its commitment-tampering cases
    have no second answer to audit) and its detection-power cases, measured, not asserted."""
    from engy_node import calibration as cal

    return (
        ("honest", "pass", None),
        ("quantised-4bit", "cheat", cal.quantise_linear_weights),
        ("truncated", "cheat", zero_last_layers),
        ("prefill-attack", "cheat", cal.quantise_linear_weights),
        *((name, None, alter) for name, alter in cal.POWER_CASES),
    )


def gemm_case_names() -> tuple[str, ...]:
    """The cases `run_gemm_calibration` can serve, in order."""
    return tuple(name for name, _, _ in _gemm_cases())


@dataclasses.dataclass(frozen=True, slots=True)
class GemmCaseResult:
    case: str
    expected: str | None
    """`pass`, `cheat` (by either proof), or None for a detection-power case."""
    prompt: int
    gemm: tuple[str, ...]
    """Each audit's verdict on the answer: `pass` or `kind/gemm:reason`."""
    toploc: str
    """TOPLOC's (and the token check's) verdict on the same answer: `pass` or `kind/code`."""

    @property
    def judged(self) -> str:
        """`cheat` when either proof judged it one, else `pass`."""
        return "cheat" if caught(self.gemm) or self.toploc.startswith("cheat") else "pass"


def run_gemm_calibration(
    checkpoint: Path,
    *,
    model,
    prompts: Sequence[str],
    max_new_tokens: int,
    audits: int,
    cases: Sequence[str] | None = None,
    device: str = "cpu",
    recompute_device: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[GemmCaseResult]:
    """Serve each prompt greedily through each case (default: all of `gemm_case_names`) with
    the capture on, audit every answer `audits` times and judge it by TOPLOC too. The verifier
    side (the GEMM model and TOPLOC's float32 recompute) runs on `recompute_device` (default:
    `device`)."""
    from engy_node.calibration import chat_ids
    from engy_node.gemm.activations import llama_layout
    from engy_node.models import model_root
    from engy_node.serve.capture import SharedOpenings
    from engy_node.serve.engine import ModelRunner
    from engy_node.served_model import end_token_ids_of
    from engy_node.verifier import gemm_audit

    def load() -> Any:
        return ModelRunner.load(checkpoint, device=device, dtype="bfloat16")

    honest = load()
    layout = llama_layout(honest.model.config.to_dict(), "bfloat16")
    store = SharedOpenings(max_bytes=512 * 1024**2)
    toploc = Toploc(
        checkpoint,
        model,
        model_root(checkpoint),
        end_token_ids_of(checkpoint, honest.tokenizer),
        max_new_tokens,
        device=recompute_device or device,
    )
    verifier = gemm_audit.gemm_model_of(toploc.runner)
    prompt_ids_of = [chat_ids(honest, prompt) for prompt in prompts]
    results: list[GemmCaseResult] = []
    for name, expected, alter in _gemm_cases():
        if cases is not None and name not in cases:
            continue
        common = (layout, store, model.weights_root, max_new_tokens)
        if alter is None:
            serving = Serving(honest, *common)
        elif name == "prefill-attack":
            serving = PrefillAttack(alter(load()), honest, *common)
        else:
            serving = Serving(alter(load()), *common)
        for index, prompt_ids in enumerate(prompt_ids_of):
            served = serving.serve(index, prompt_ids, None)
            gemm = tuple(gemm_audit_of(served, store, verifier, audits=audits)[0])
            verdict, _ = toploc.judge(served)
            results.append(GemmCaseResult(name, expected, index, gemm, verdict))
            progress(f"prompt {index} {name:22} GEMM caught {caught(gemm)}/{audits}, TOPLOC {verdict}")
        del serving
    return results


def gemm_unexpected(results: Sequence[GemmCaseResult]) -> list[str]:
    """What makes calibrate fail, each as a line: an honest answer judged a cheat by either
    proof, or a case expected to be caught that neither proof caught on any of its answers
    (detection-power cases are measured, never asserted)."""
    wrong = [
        f"{r.case} prompt {r.prompt}: GEMM {reasons(r.gemm)}, TOPLOC {r.toploc}; expected pass"
        for r in results
        if r.expected == "pass" and r.judged == "cheat"
    ]
    for case in dict.fromkeys(r.case for r in results if r.expected == "cheat"):
        if all(r.judged == "pass" for r in results if r.case == case):
            wrong.append(f"{case}: caught by neither the GEMM audit nor TOPLOC; expected cheat")
    return wrong


def format_gemm_table(results: Sequence[GemmCaseResult]) -> str:
    """Per case: the GEMM audits that judged cheat of all audits (95 % interval) and their
    reasons, beside TOPLOC's verdicts on the same answers."""
    lines = [
        "| case | expected | answers | GEMM audits: judged cheat (95 % interval) | GEMM reasons "
        "| TOPLOC: judged cheat (95 % interval) | TOPLOC reasons |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(r.case for r in results):
        rows = [r for r in results if r.case == case]
        every = [v for r in rows for v in r.gemm]
        toploc = [r.toploc for r in rows]
        lines.append(
            f"| {case} | {rows[0].expected or '–'} | {len(rows)} | {rate(caught(every), len(every))} | "
            f"{reasons(every)} | {rate(caught(toploc), len(rows))} | {reasons(toploc)} |"
        )
    return "\n".join(lines)
