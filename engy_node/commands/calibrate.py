"""`engy-node calibrate`: how far honest serving and known cheats sit apart on this machine.

It serves prompts honestly and through known cheats, verifies them as a validator would, and
prints the statistics behind each verdict as Markdown tables; with its measurement flags it also
measures honest numeric drift, the sampling cheats against seeded replay, answers without a
commitment, false positives over honest sampled requests and GEMM audits beside TOPLOC
(docs/verification.md publishes every table). It has more flags than any other sub-command, and
its run is a sequence of measurements, so it lives here apart from `cli.py`'s dispatch; the
measuring itself is `calibration.py`, `drift.py`, `strictness.py` and
`verifier/gemm_calibration.py`'s.

Exit code: 0 when every verdict was the expected one, 1 when a case was judged otherwise or an
honest answer was judged a cheat. With `--gemm-audits N` an honest answer judged a cheat by the
GEMM audit counts too, and so does a cheat case that neither the GEMM audit nor TOPLOC caught.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engy_node.errors import EngyError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `calibrate` and its flags to the sub-command parsers."""
    calibrate = sub.add_parser(
        "calibrate",
        help="measure TOPLOC/token-check separation of honest serving and known cheats",
        description="Serve prompts honestly and through known cheats on this machine, verify them as a "
        "validator would, and print the statistics behind each verdict as a Markdown table.",
    )
    calibrate.add_argument("--model", default="smollm2-135m")
    calibrate.add_argument("--checkpoint", default="")
    calibrate.add_argument("--prompts", type=int, default=5, help="how many of the built-in prompts to use (1-5)")
    calibrate.add_argument("--max-new-tokens", type=int, default=96)
    calibrate.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the honest and cheating miners serve"
    )
    calibrate.add_argument(
        "--recompute-device", choices=("cpu", "cuda"), help="where the verifier recomputes (default: --device)"
    )
    calibrate.add_argument(
        "--sampled-requests",
        type=int,
        default=0,
        metavar="N",
        help="also serve N honest sampled requests and count how many each check judges a cheat",
    )
    calibrate.add_argument(
        "--sampled-answer-tokens", type=int, default=32, metavar="N", help="answer length of those requests"
    )
    calibrate.add_argument(
        "--sampled-only", action="store_true", help="skip the cases; only count false positives over --sampled-requests"
    )
    calibrate.add_argument(
        "--sampled-recompute",
        default="bfloat16",
        metavar="DTYPE[,DTYPE]",
        help="recompute precisions for those requests (float32, bfloat16)",
    )
    calibrate.add_argument(
        "--drift-prompts",
        type=int,
        default=0,
        metavar="N",
        help="measure honest numeric drift instead: serve N buyer-like prompts greedily (bf16) and "
        "recompute each answer on every verifier path, printing the gap distribution per path pair",
    )
    calibrate.add_argument(
        "--seeded-drift-prompts",
        type=int,
        default=0,
        metavar="N",
        help="measure honest seeded-replay drift instead: serve N buyer-like prompts at every sampled setting "
        "(bf16, seeded) and replay each draw on the verifier paths",
    )
    calibrate.add_argument("--drift-out", default="", metavar="FILE", help="also write every measured gap there (JSON)")
    calibrate.add_argument(
        "--cheat-answers",
        type=int,
        default=0,
        metavar="N",
        help="also serve N buyer-like prompts through each sampling cheat (greedy claimed as sampled, a "
        "narrower nucleus or top-k, a lower temperature, the prefill attack) and report how often seeded "
        "replay catches them within the first n tokens",
    )
    calibrate.add_argument(
        "--cheat-tokens", type=int, default=256, metavar="N", help="answer length of those (ignore_eos)"
    )
    calibrate.add_argument(
        "--cheat-out", default="", metavar="FILE", help="also write every cheat answer's replay gaps there (JSON)"
    )
    calibrate.add_argument(
        "--cheat-cases",
        default="",
        metavar="CASE[,CASE]",
        help="only these sampling cheats (names as the table prints them, e.g. 'T 0.8 for 1'); default: all",
    )
    calibrate.add_argument(
        "--no-commitment-answers",
        type=int,
        default=0,
        metavar="N",
        help="also judge N answers per setting sent without a commitment (a TEE miner's), honest and by a "
        "4-bit copy, on the delivered tokens alone",
    )
    calibrate.add_argument(
        "--gemm-audits",
        type=int,
        default=0,
        metavar="N",
        help="also serve the prompts greedily with the activation capture on, honestly and through each "
        "cheat and detection-power case, GEMM-audit every answer N times and print the catch rates beside "
        "TOPLOC's verdicts on the same answers",
    )
    calibrate.add_argument(
        "--gemm-cases",
        default="",
        metavar="CASE[,CASE]",
        help="only these cases in the GEMM-audit pass (honest, quantised-4bit, noise-1%%, ...); default: all",
    )
    calibrate.add_argument(
        "--all",
        action="store_true",
        help="every measurement docs/verification.md publishes, at its documented size (hours on a CPU): "
        "the cases, greedy and seeded drift, the sampling cheats, answers without a commitment, and "
        "1,000 honest sampled requests",
    )


def run(config, args: argparse.Namespace) -> int:
    """Run the measurements `args` asks for and print their tables; the exit code (module docstring)."""
    from engy_node.calibration import (
        DEFAULT_PROMPTS,
        format_soundness,
        format_table,
        run_calibration,
        run_sampled_soundness,
        unexpected,
    )
    from engy_node.models import get_model
    from engy_node.serve.checkpoint import resolve_checkpoint

    if not 1 <= args.prompts <= len(DEFAULT_PROMPTS):
        raise EngyError(f"--prompts must be 1..{len(DEFAULT_PROMPTS)}")
    dtypes = tuple(d.strip() for d in args.sampled_recompute.split(",") if d.strip())
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        raise EngyError(f"--sampled-recompute takes float32 and/or bfloat16, got {args.sampled_recompute!r}")
    spec = get_model(args.model)
    path = resolve_checkpoint(
        model_id=args.model,
        checkpoint=args.checkpoint,
        models_dir=config.paths.models_dir,
        cache_dir=config.paths.model_cache_dir,
    )
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.all:
        args.drift_prompts, args.seeded_drift_prompts = args.drift_prompts or 500, args.seeded_drift_prompts or 200
        args.cheat_answers, args.no_commitment_answers = args.cheat_answers or 50, args.no_commitment_answers or 50
        args.sampled_requests = args.sampled_requests or 1000
    if args.gemm_audits > 0:
        _gemm_cases(args)
    if args.sampled_only and args.sampled_requests <= 0:
        raise EngyError("--sampled-only needs --sampled-requests N (N > 0)")
    # Each measurement flag alone runs just that measurement; the cases run by default and with --all.
    measured_only = not args.all and (
        args.drift_prompts > 0
        or args.seeded_drift_prompts > 0
        or args.cheat_answers > 0
        or args.no_commitment_answers > 0
        or args.gemm_audits > 0
    )
    results = (
        []
        if args.sampled_only or measured_only
        else run_calibration(
            path,
            model=spec,
            prompts=DEFAULT_PROMPTS[: args.prompts],
            max_new_tokens=args.max_new_tokens,
            device=args.device,
            recompute_device=args.recompute_device,
            progress=say,
        )
    )
    if results:
        print(format_table(results))
    wrong = unexpected(results)
    for result in wrong:
        say(
            f"UNEXPECTED: {result.case} ({result.sampling}, {result.check}) prompt {result.prompt} ({result.recompute_dtype}) "
            f"judged {result.verdict.kind}/{result.verdict.reason}, expected {result.expected}"
        )
    if args.drift_prompts > 0 or args.seeded_drift_prompts > 0:
        from engy_node import drift

        samples = (
            drift.run_greedy_drift(path, prompts=args.drift_prompts, progress=say) if args.drift_prompts > 0 else []
        )
        if args.seeded_drift_prompts > 0:
            samples += drift.run_seeded_drift(path, model=spec, prompts=args.seeded_drift_prompts, progress=say)
        if args.drift_out:
            drift.save_samples(samples, Path(args.drift_out))
        _section("Honest numeric drift", drift.format_drift(drift.summarise(samples)))
    false_positives = 0
    if args.cheat_answers > 0 or args.no_commitment_answers > 0:
        from engy_node import strictness
        from engy_node.drift import drift_conversations

        if args.cheat_answers > 0:
            chosen = {name.strip() for name in args.cheat_cases.split(",") if name.strip()}
            unknown = chosen - {case for case, _ in strictness.SAMPLING_CHEATS}
            if unknown:
                raise EngyError(
                    f"--cheat-cases: unknown {', '.join(sorted(unknown))}; the cases are "
                    f"{', '.join(case for case, _ in strictness.SAMPLING_CHEATS)}"
                )
            cases = [(case, knobs) for case, knobs in strictness.SAMPLING_CHEATS if not chosen or case in chosen]
            judged = strictness.run_sampling_cheats(
                path,
                model=spec,
                conversations=drift_conversations(args.cheat_answers),
                answer_tokens=args.cheat_tokens,
                cases=cases,
                progress=say,
            )
            if args.cheat_out:
                Path(args.cheat_out).write_text(
                    json.dumps([{"case": j.case, "answer": j.answer, "gaps": j.gaps} for j in judged])
                )
            _section(
                "Sampling cheats against seeded replay", strictness.format_catch_rates(judged, params=spec.token_check)
            )
            false_positives += sum(
                1 for j in judged if j.case == "honest" and not j.verdict_within(len(j.gaps), spec.token_check).ok
            )
        if args.no_commitment_answers > 0:
            judged_alone = strictness.run_recompute_judged(
                path, model=spec, conversations=drift_conversations(args.no_commitment_answers), progress=say
            )
            _section("Answers without a commitment", strictness.format_recompute_judged(judged_alone))
            false_positives += sum(1 for r in judged_alone if r.served_by == "honest" and r.verdict.kind == "cheat")
    if args.sampled_requests > 0:
        from engy_node.drift import drift_conversations

        soundness = run_sampled_soundness(
            path,
            model=spec,
            requests=args.sampled_requests,
            answer_tokens=args.sampled_answer_tokens,
            prompts=drift_conversations(SOUNDNESS_CONVERSATIONS),
            recompute_dtypes=dtypes,
            progress=say,
        )
        _section("Honest sampled requests", format_soundness(soundness))
        false_positives += sum(1 for r in soundness if r.verdict.kind == "cheat")
    gemm_wrong = _gemm_audits(path, spec, args, say) if args.gemm_audits > 0 else []
    return 1 if wrong or false_positives or gemm_wrong else 0


SOUNDNESS_CONVERSATIONS = 250
"""Buyer-like conversations the honest sampled requests cycle through (each at every setting):
the five built-in prompts alone missed an edge case that 200 of these found."""


def _gemm_audits(path: Path, spec, args: argparse.Namespace, say) -> list[str]:
    """The GEMM-audit pass (`verifier.gemm_calibration`): its table, and what it found wrong."""
    from engy_node.calibration import DEFAULT_PROMPTS
    from engy_node.verifier.gemm_calibration import format_gemm_table, gemm_unexpected, run_gemm_calibration

    results = run_gemm_calibration(
        path,
        model=spec,
        prompts=DEFAULT_PROMPTS[: args.prompts],
        max_new_tokens=args.max_new_tokens,
        audits=args.gemm_audits,
        cases=_gemm_cases(args) or None,
        device=args.device,
        recompute_device=args.recompute_device,
        progress=say,
    )
    _section(f"GEMM audits beside TOPLOC ({args.gemm_audits} audits per answer)", format_gemm_table(results))
    wrong = gemm_unexpected(results)
    for line in wrong:
        say(f"UNEXPECTED (GEMM audits): {line}")
    return wrong


def _gemm_cases(args: argparse.Namespace) -> list[str]:
    """The cases `--gemm-cases` names (none: all), checked before anything is served."""
    from engy_node.verifier.gemm_calibration import gemm_case_names

    chosen = [name.strip() for name in args.gemm_cases.split(",") if name.strip()]
    unknown = set(chosen) - set(gemm_case_names())
    if unknown:
        raise EngyError(
            f"--gemm-cases: unknown {', '.join(sorted(unknown))}; the cases are {', '.join(gemm_case_names())}"
        )
    return chosen


def _section(title: str, table: str) -> None:
    print(f"\n## {title}\n\n{table}")
