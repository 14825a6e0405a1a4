"""The GEMM audit verifier's CPU per audited answer, by step, this tree beside another revision
on the same openings (issue 32's target: ≤ 2 ms, model load and key precompute excluded).

    .venv/bin/python bench/gemm_judge.py --baseline 20925c7
    .venv/bin/python bench/gemm_judge.py --answers 8 --noisy 4 --audits 3 --rounds 3 --baseline REV

Answers are served once, in this process, on the reference server's engine (bf16 on the CPU,
the activation capture on, as `bench/gemm_audit.py` serves them): `--answers` honest ones and
`--noisy` with 1e-2 relative weight noise (which the row check catches), each audited
`--audits` times with a fresh 256-bit secret: the picks (`draw_picks`), the openings the
server's ``POST /gemm/openings`` writes, as one ``gemm_openings`` frame. Then each revision
judges exactly those frames in a process of its own (`--worker`), against a `GemmModel` of a
float32 runner built with one verifier secret for both, so they draw the same rows and keys:
`--rounds` times in turn (this tree, the baseline, this tree, ...), so load on the machine
falls on both alike. A revision's tree is `git archive REV engy_node` unpacked in a temporary
directory, imported in place of this one.

A worker times, in CPU seconds of its own thread (torch and BLAS on one thread), each audit's
`draw_picks` + `judge_openings` over the decoded frame (what `bench/gemm_audit.py` reports),
best of its passes; then once more each right after 128 MB are written (its caches cold, as a
verifier's are after a TOPLOC replay); then once more with the steps timed apart by wrapping
whichever of these functions the revision has: the openings' parsing and Merkle paths (`_verified_rows`), Freivalds
(`freivalds` per projection, or `freivalds_ratios` per audit), the row check (`draw_rows` and
`row_check` per projection, or `_recomputed_rows` per audit: the draw, reading the rows and
recomputing them), the replay (`replay_layer` or `replay_ratios`); the rest (the
commitment, stacking the rows, the verdict) is "other". A revision with `draw_row_sets` also
times, each alone, the parts judging must do in any Python-level arrangement ("floor": the
frame's base64 values and hex paths decoded, the rows and the nodes `verify_all` hashed run
through sha256, the row check's drawn weight rows read), so the
table shows how much of a step is arithmetic and memory rather than calls. It prints the
verdicts of every audit, which must be the same in both revisions: the run says so, and exits 1
when they differ. Each answer is served once in every format this tree commits
(`activations.FORMATS`), and each revision judges the audits of the format its own servers
commit: a revision before ``engy-activations-v2`` judges v1 openings of the same answers (other
picks, so only the verdicts' kinds are compared then).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

REPO = Path(__file__).resolve().parents[1]
STEPS = {
    "openings: parse + Merkle paths": ("gemm_audit._verified_rows",),
    "freivalds": ("gemm_check.freivalds", "gemm_check.freivalds_ratios"),
    "row check (ROWS_CHECKED rows per projection)": (
        "gemm_audit.draw_rows",
        "gemm_check.row_check",
        "gemm_audit._recomputed_rows",
    ),
    "replay": ("gemm_check.replay_layer", "gemm_check.replay_ratios"),
}
"""Each step's functions, as either revision names them; a call inside another timed one is
counted once, in the outer."""


def serve(args: argparse.Namespace, folder: Path, say: Callable[[str], None]) -> Path:
    """Serve and open the audits; their frames and the checkpoint's path go to one JSON file."""
    import orjson
    import torch

    from engy_node.calibration import add_weight_noise, chat_ids
    from engy_node.config import load_config
    from engy_node.drift import drift_conversations
    from engy_node.gemm.activations import FORMATS, llama_layout
    from engy_node.models import get_model
    from engy_node.protocol.gemm import GemmOpenings
    from engy_node.serve.capture import SharedOpenings
    from engy_node.serve.checkpoint import embedded_checkpoint
    from engy_node.serve.engine import ModelRunner
    from engy_node.verifier import gemm_audit
    from engy_node.verifier.gemm_calibration import Serving

    torch.set_num_threads(1)
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(home=folder / "home", env=env)
    checkpoint = embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
    honest = ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")
    config_fields = honest.model.config.to_dict()
    store = SharedOpenings(max_bytes=512 * 1024**2)
    weights_root = get_model("smollm2-135m").weights_root
    conversations = [chat_ids(honest, c) for c in drift_conversations(max(args.answers, args.noisy))]
    audits = []
    for case, count in (("honest", args.answers), ("noise-1e-2", args.noisy)):
        if not count:
            continue
        runner = honest if case == "honest" else add_weight_noise(ModelRunner.load(checkpoint, device="cpu"), 1e-2)
        servings = [
            Serving(runner, llama_layout(config_fields, "bfloat16", f), store, weights_root, args.tokens)
            for f in FORMATS
        ]
        for serving, answer in itertools.product(servings, range(count)):
            served = serving.serve(answer, conversations[answer], None)
            rid = served.gemm_commitment["rid"]
            for audit in range(args.audits):
                secret = secrets.token_bytes(32)
                prompt = len(served.prompt_ids)
                picks = gemm_audit.draw_picks(secret, served.gemm_commitment, prompt_positions=prompt)
                opened = store.open(rid, [(p.position, p.layer, p.group) for p in picks])
                if opened is None:
                    raise RuntimeError(f"the record of {rid} left the openings store; give it more bytes")
                record, openings = opened
                wires = tuple(o.to_wire(record.layout.dtype, record.layout.width(o.group)) for o in openings)
                audits.append(
                    {
                        "case": case,
                        "format": serving.layout.format,
                        "commitment": served.gemm_commitment,
                        "secret": secret.hex(),
                        "prompt": prompt,
                        "expected": prompt + len(served.output_ids) - 1,
                        "frame": orjson.dumps(GemmOpenings(f"c{audit}", wires).to_wire()).decode(),
                    }
                )
        say(
            f"{case}: {count} answers served in each of {', '.join(FORMATS)}, {count * args.audits} audits opened of each"
        )
    path = folder / "audits.json"
    path.write_text(json.dumps({"checkpoint": str(checkpoint), "audits": audits}))
    return path


def worker(audits_file: Path, verifier_secret: bytes, passes: int) -> dict[str, Any]:
    """Judge every audit of `audits_file` in the format the `engy_node` first on sys.path
    commits (its servers' `activations.FORMAT`) with that tree."""
    import numpy as np
    import orjson
    import torch

    from engy_node.gemm import activations
    from engy_node.serve.engine import ModelRunner
    from engy_node.verifier import gemm_audit, gemm_check

    torch.set_num_threads(1)
    data = json.loads(audits_file.read_text())
    runner = ModelRunner.load(Path(data["checkpoint"]), device="cpu", dtype="float32")
    model = gemm_audit.gemm_model_of(runner, secret=verifier_secret)

    def judge(audit: dict[str, Any]) -> tuple[str, float]:
        relayed = tuple(orjson.loads(audit["frame"])["openings"])
        started = time.process_time()
        picks = gemm_audit.draw_picks(
            bytes.fromhex(audit["secret"]), audit["commitment"], prompt_positions=audit["prompt"]
        )
        evidence = gemm_audit.GemmEvidence(picks=picks, openings=relayed)
        verdict = gemm_audit.judge_openings(
            model, audit["commitment"], evidence, expected_positions=audit["expected"], prompt_positions=audit["prompt"]
        )
        return f"{verdict.kind}/{verdict.reason}", time.process_time() - started

    audits = [audit for audit in data["audits"] if audit["format"] == activations.FORMAT]
    best = [float("inf")] * len(audits)
    verdicts: list[str] = []
    for _ in range(passes):
        verdicts = []
        for index, audit in enumerate(audits):
            verdict, seconds = judge(audit)
            verdicts.append(verdict)
            best[index] = min(best[index], seconds)
    # As after a TOPLOC replay, which streams every weight through the caches: each audit once
    # more, right after 128 MB are written.
    flush = np.ones(16 * 1024 * 1024)
    cold = []
    for audit in audits:
        flush += 1.0
        cold.append(judge(audit)[1])
    spent = {step: [0.0] * len(audits) for step in STEPS}
    current: list[int] = [0]
    depth = [0]

    def timed(step: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[step][current[0]] += time.process_time() - started

        return wrapper

    modules = {"gemm_audit": gemm_audit, "gemm_check": gemm_check}
    for step, names in STEPS.items():
        for name in names:
            module, attribute = name.split(".")
            if hasattr(modules[module], attribute):
                setattr(modules[module], attribute, timed(step, getattr(modules[module], attribute)))
    stepped = []
    for index, audit in enumerate(audits):
        current[0] = index
        stepped.append(judge(audit)[1])
    import engy_node

    result = {
        "tree": engy_node.__file__,
        "format": activations.FORMAT,
        "verdicts": verdicts,
        "best": best,
        "cold": cold,
        "stepped": stepped,
        "steps": spent,
    }
    if hasattr(gemm_audit, "draw_row_sets"):
        result["floor"] = floor(model, audits, passes)
    return result


def floor(model: Any, audits: list[dict[str, Any]], passes: int) -> dict[str, list[float]]:
    """Per audit, the CPU of what judging it must do in any Python-level arrangement, each part
    alone (best of `passes`, each a pass over every audit): decode the frame's base64 values and hex paths, sha256 every
    opened row (the leaf hashes' data) and as many 65-byte nodes as `verify_all` hashed, and
    read the row check's drawn weight rows (gathered and summed in float32: the memory traffic
    of the compiled row check, without its products)."""
    import base64
    import functools
    import hashlib

    import orjson

    from engy_node.gemm import merkle
    from engy_node.gemm.activations import GEMMS, Commitment
    from engy_node.verifier import gemm_audit

    nodes = [0]
    node_hash = merkle.node_hash

    def counted(left: bytes, right: bytes) -> bytes:
        nodes[0] += 1
        return node_hash(left, right)

    def row_draws(audit: dict[str, Any], picks: Any) -> tuple[dict[int, list[int]], dict[tuple[str, int], Any]]:
        audited = gemm_audit.audited_layers(Commitment.from_wire(audit["commitment"]).layout, picks)
        labels = [(name, layer) for name in GEMMS for layer in audited]
        sizes = [model.weights[layer, name].shape[0] for name, layer in labels]
        root = bytes.fromhex(audit["commitment"]["activations_root"])
        drawn = gemm_audit.draw_row_sets(
            model.secret, root, [f"rows/{layer}/{name}" for name, layer in labels], sizes, gemm_audit.ROWS_CHECKED
        )
        return audited, dict(zip(labels, drawn, strict=True))

    def rows_part(audited: dict[int, list[int]], chosen: dict[tuple[str, int], Any]) -> None:
        for name in GEMMS:
            for layer in audited:
                model.weights[layer, name].take(chosen[name, layer], 0).sum()

    from engy_node.gemm import activations

    decoder = getattr(activations, "pybase64", base64)  # the revision's own base64 decoder

    def values_part(openings: list[dict[str, Any]]) -> None:
        for opening in openings:
            decoder.b64decode(opening["values"]["data"], validate=True)

    def paths_part(openings: list[dict[str, Any]]) -> None:
        for opening in openings:
            list(map(bytes.fromhex, opening["path"]))

    def hashes_part(rows: list[bytes], count: int) -> None:
        for row in rows:
            hashlib.sha256(row).digest()
        for _ in range(count):
            hashlib.sha256(bytes(65)).digest()

    timed: list[dict[str, Callable[[], None]]] = []
    for audit in audits:
        openings = orjson.loads(audit["frame"])["openings"]
        picks = gemm_audit.draw_picks(
            bytes.fromhex(audit["secret"]), audit["commitment"], prompt_positions=audit["prompt"]
        )
        nodes[0] = 0
        merkle.node_hash = counted
        try:
            evidence = gemm_audit.GemmEvidence(picks=picks, openings=tuple(openings))
            gemm_audit._verified_rows(Commitment.from_wire(audit["commitment"]), evidence)
        finally:
            merkle.node_hash = node_hash
        audited, chosen = row_draws(audit, picks)
        data = [base64.b64decode(o["values"]["data"]) for o in openings]
        timed.append(
            {
                "base64 values": functools.partial(values_part, openings),
                "hex paths": functools.partial(paths_part, openings),
                "leaf and node sha256": functools.partial(hashes_part, data, nodes[0]),
                "rows": functools.partial(rows_part, audited, chosen),
            }
        )
    # Pass after pass over every audit, as the judge goes, so each audit's weight rows are as
    # cold (or as warm) as when it is judged, not still in cache from its previous pass.
    parts = {part: [float("inf")] * len(audits) for part in timed[0]} if timed else {}
    for _ in range(passes):
        for index, runs in enumerate(timed):
            for part, run in runs.items():
                started = time.process_time()
                run()
                parts[part][index] = min(parts[part][index], time.process_time() - started)
    return parts


def run_worker(tree: Path, audits_file: Path, verifier_secret: bytes, passes: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", str(audits_file), "--tree", str(tree)]
    command += ["--verifier-secret", verifier_secret.hex(), "--passes", str(passes)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        raise RuntimeError(f"the worker on {tree} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    if not result["tree"].startswith(str(tree)):
        raise RuntimeError(f"the worker for {tree} imported {result['tree']}")
    return result


def baseline_tree(revision: str, folder: Path) -> Path:
    tree = folder / f"tree-{revision}"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "engy_node"], capture_output=True, check=True, timeout=120
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=120)
    return tree


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def table(results: dict[str, list[dict[str, Any]]], cases: list[str]) -> str:
    """Per revision: the median over audits (each its best pass, then the median over rounds)
    of the total, and of each step from the stepped pass."""
    names = list(results)
    lines = ["| ms per audited answer (median) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def per_audit(runs: list[dict[str, Any]], key: str, step: str | None = None) -> list[float]:
        if step is None:
            return [statistics.median(run[key][i] for run in runs) for i in range(len(runs[0][key]))]
        return [statistics.median(run["steps"][step][i] for run in runs) for i in range(len(cases))]

    totals = {name: per_audit(runs, "best") for name, runs in results.items()}
    lines.append("| draw_picks + judge_openings | " + " | ".join(f"{median_ms(totals[n]):.2f}" for n in names) + " |")
    for case in sorted(set(cases)):
        picked = [i for i, c in enumerate(cases) if c == case]
        cells = [f"{median_ms([totals[n][i] for i in picked]):.2f}" for n in names]
        lines.append(f"| … {case} audits ({len(picked)}) | " + " | ".join(cells) + " |")
    if all("cold" in run for runs in results.values() for run in runs):
        cold = {name: per_audit(runs, "cold") for name, runs in results.items()}
        cells = " | ".join(f"{median_ms(cold[n]):.2f}" for n in names)
        lines.append(f"| … right after 128 MB written (caches cold, as after a TOPLOC replay) | {cells} |")
    stepped = {name: per_audit(runs, "stepped") for name, runs in results.items()}
    lines.append("| with the steps timed apart | " + " | ".join(f"{median_ms(stepped[n]):.2f}" for n in names) + " |")
    others = {name: list(stepped[name]) for name in names}
    for step in STEPS:
        cells = []
        for name in names:
            values = per_audit(results[name], "steps", step)
            others[name] = [o - v for o, v in zip(others[name], values, strict=True)]
            cells.append(f"{median_ms(values):.2f}")
        lines.append(f"| … {step} | " + " | ".join(cells) + " |")
    lines.append(
        "| … other (commitment, draw_picks, stacking, verdict) | "
        + " | ".join(f"{median_ms(others[n]):.2f}" for n in names)
        + " |"
    )
    floors = [run["floor"] for runs in results.values() for run in runs if "floor" in run]
    for part in floors[0] if floors else ():
        cells = []
        for name in names:
            runs = [run["floor"][part] for run in results[name] if "floor" in run]
            per = [statistics.median(run[i] for run in runs) for i in range(len(cases))] if runs else []
            cells.append(f"{median_ms(per):.2f}" if per else "—")
        lines.append(f"| floor: {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=8, help="honest answers (default 8)")
    parser.add_argument("--noisy", type=int, default=4, help="answers with 1e-2 weight noise (default 4)")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens per answer (default 16)")
    parser.add_argument("--audits", type=int, default=3, help="audits per answer, each a fresh secret (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="worker runs per revision, in turn (default 3)")
    parser.add_argument("--passes", type=int, default=3, help="passes over the audits per worker (default 3)")
    parser.add_argument("--baseline", help="a git revision to judge the same openings beside this tree")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--verifier-secret", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(args.tree))
        print(json.dumps(worker(args.worker, bytes.fromhex(args.verifier_secret), args.passes)))
        return
    if min(args.audits, args.rounds, args.passes, args.tokens) < 1 or args.answers + args.noisy < 1:
        parser.error("--audits, --rounds, --passes and --tokens must be ≥ 1, and some answers served")
    sys.path.insert(0, str(REPO))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="gemm-judge-bench-") as name:
        folder = Path(name)
        audits_file = serve(args, folder, say)
        trees = {"this tree": REPO}
        if args.baseline:
            trees[args.baseline] = baseline_tree(args.baseline, folder)
        verifier_secret = secrets.token_bytes(32)
        results: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
        loads = []
        for round_ in range(args.rounds):
            for label, tree in trees.items():
                loads.append(os.getloadavg()[0])
                results[label].append(run_worker(tree, audits_file, verifier_secret, args.passes))
                say(f"round {round_ + 1}: {label} judged")
        first = results["this tree"][0]["format"]
        cases = [audit["case"] for audit in json.loads(audits_file.read_text())["audits"] if audit["format"] == first]
    verdicts = {label: runs[0]["verdicts"] for label, runs in results.items()}
    formats = {label: runs[0]["format"] for label, runs in results.items()}
    print(
        f"`bench/gemm_judge.py {' '.join(sys.argv[1:])}`: {len(cases)} audits of SmolLM2-135M answers "
        f"(bf16 serve, float32 verifier model), one thread, CPU time; load average "
        f"{min(loads):.1f}–{max(loads):.1f} while judging; "
        + ", ".join(f"{label} judging {fmt} openings" for label, fmt in formats.items())
        + ".\n"
    )
    print(table(results, cases))
    for label, seen in verdicts.items():
        counts: dict[str, int] = {}
        for verdict in seen:
            counts[verdict] = counts.get(verdict, 0) + 1
        print(f"\n{label}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    # Openings of one format are the same frames for every revision: the verdicts must match to
    # the reason. Of two formats they are other picks of the same answers: the kinds must match.
    same_frames = len(set(formats.values())) == 1
    compared = {label: tuple(v if same_frames else v.split("/")[0] for v in seen) for label, seen in verdicts.items()}
    if len(set(compared.values())) > 1:
        print("\nThe revisions' verdicts differ on the same answers.")
        sys.exit(1)
    if len(verdicts) > 1:
        agree = "verdict and reason" if same_frames else "verdict (pass or cheat; the picks differ with the format)"
        print(f"\nEvery audit got the same {agree} from each revision.")


if __name__ == "__main__":
    main()
