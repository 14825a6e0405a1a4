"""What verifying a TOPLOC commitment costs, against what the work it checks costs, in one run.

    .venv/bin/python bench/verifier.py [--quick] [--dtype float32,bfloat16] [--threads N] [--repeats 5]

On the embedded SmolLM2-135M-Instruct checkpoint, on the CPU:

1. The check beyond the forward pass, µs per output token. Given the recomputed hidden rows and
   logits of one typical request (a ~200-token chat prompt, 128 output tokens), the parts of
   `proof.verify_commitment` that are not the recompute: the shape checks (base64 of every
   proof), `proof.verify_chunks` (TOPLOC's chunk comparison) and the token check
   (`logit_stats.token_stats` + `token_evidence.token_check`) as a greedy answer, and as sampled answers
   judged statistically and by seeded replay (T 0.7 top_p 1, T 1 top_p 0.9: the two settings
   the calibration test uses). Target: ≤ 10 µs per token.
2. The recompute against a plain forward pass: `ModelRunner.prefill(ids)` (what the verifier
   runs: a KV cache, hidden rows, float32 logits at every position) and
   `runner.model(input_ids=ids, use_cache=False).logits` under `torch.inference_mode`, on the
   same runner (dtype, threads), at several lengths, alternating. Target: ≤ 1.1×.
3. Verifying against generating, one thread (`--verify-threads`, a core's worth): the whole
   `proof.verify_commitment` of the typical request (recompute + checks; greedy, and the sampled
   answers both ways) against the same runner generating its 128 tokens greedily as a miner does
   (`calibration.greedy_generation`: prefill, then one token per step with the KV cache, hidden
   states kept), alternating. Every row compares with the greedy generation; a seeded sampled
   generation costs a little more per step (its draw sorts the vocabulary), so the sampled rows'
   ratios are slightly conservative. Prints verifications per second per core and
   generate time ÷ verify time. Target: ≥ 50×.

Each answer is served by the runner of the dtype being measured (so generation and verification
use the same runner) with `ignore_eos`, so every answer is exactly the requested length; every
verification is asserted to pass. Times are `time.perf_counter` medians over `--repeats` after one
warm-up, with min–max. Nothing is downloaded: the checkpoint is the embedded model's local
conversion (the model cache, as `engy-node checkpoint` finds it) or `--checkpoint DIR`.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

from engy_node import logit_stats, proof, token_evidence  # noqa: E402
from engy_node.calibration import chat_ids, greedy_generation  # noqa: E402
from engy_node.models import get_model, model_root  # noqa: E402
from engy_node.protocol.miner import SEEDED_TOP_K  # noqa: E402
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion  # noqa: E402
from engy_node.serve.sampling import parse_sampling_params  # noqa: E402
from engy_node.served_model import end_token_ids_of  # noqa: E402

MODEL = get_model("smollm2-135m")
SAMPLED = ((0.7, 1.0), (1.0, 0.9))
"""(temperature, top_p) of the sampled answers (the calibration test's two settings)."""
SEED = 20261201
CONTEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. Heat "
    "from the sun evaporates water from seas, lakes and rivers; plants release more through their "
    "leaves. The vapour rises, cools and condenses into clouds, and when droplets grow heavy "
    "enough they fall as rain, snow or hail. Some of it runs off into streams and back to the sea, "
    "some soaks into the ground and feeds aquifers and springs, and some is stored for centuries "
    "in glaciers and ice sheets. "
)
QUESTION = "Using the passage above, explain the water cycle step by step, in detail, for a student."
LONG_TEXT = CONTEXT * 200


def spread(samples: Sequence[float], scale: float = 1.0, fmt: str = "{:,.1f}") -> str:
    """median (min–max), each times `scale`."""
    return f"{fmt.format(statistics.median(samples) * scale)} ({fmt.format(min(samples) * scale)}–{fmt.format(max(samples) * scale)})"


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def timed_pair(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Both, alternating (a then b each round, after one warm-up of each), so drift hits both."""
    a(), b()
    first, second = [], []
    for _ in range(repeats):
        for fn, samples in ((a, first), (b, second)):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    return first, second


def prompt_of(runner: ModelRunner, tokens: int) -> list[int]:
    """A chat prompt of at most `tokens` tokens (the longest the context allows): the passage,
    then the question."""
    words = (CONTEXT * (1 + tokens // 60)).split()
    low, high = 1, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if len(chat_ids(runner, " ".join(words[:middle]) + "\n\n" + QUESTION)) <= tokens:
            low = middle
        else:
            high = middle - 1
    return chat_ids(runner, " ".join(words[:low]) + "\n\n" + QUESTION)


def seeded_answer(
    runner: ModelRunner, prompt_ids: Sequence[int], tokens: int, temperature: float, top_p: float
) -> Generation:
    generation = Generation(
        rid="bench",
        input_ids=list(prompt_ids),
        return_hidden_states=True,
        params=parse_sampling_params(
            {
                "temperature": temperature,
                "top_p": top_p,
                "top_k": SEEDED_TOP_K,
                "min_p": 0.0,
                "sampling_seed": SEED,
                "max_new_tokens": tokens,
                "ignore_eos": True,
            }
        ),
    )
    return run_to_completion(runner, generation)


class Request:
    """One served answer and everything a verifier is handed about it."""

    def __init__(
        self,
        runner: ModelRunner,
        root: str,
        prompt_ids: list[int],
        served: Generation,
        sampling: logit_stats.SamplingTerms | None,
        end_tokens: frozenset[int],
    ) -> None:
        self.prompt_ids = prompt_ids
        self.output_ids = list(served.output_ids)
        self.commitment = proof.build_commitment(
            model_root=root,
            prompt_ids=prompt_ids,
            output_ids=self.output_ids,
            rows=served.proof_rows(),
            params=MODEL.proof,
        )
        self.delivery = proof.Delivery(
            relayed_output_ids=tuple(self.output_ids), ended_at_stop=False, max_tokens=len(self.output_ids)
        )
        # `ignore_eos` may run an answer on past an end token, which the verifier rightly calls
        # a cheat before any arithmetic; the end tokens are then left out so the work is timed.
        self.end_tokens = frozenset() if end_tokens & set(self.output_ids[:-1]) else end_tokens
        self.sampling = sampling
        self.root = root

    def verify(self, recompute, sampling: logit_stats.SamplingTerms | None) -> proof.Verdict:
        return proof.verify_commitment(
            self.commitment,
            model=MODEL,
            canonical_root=self.root,
            expected_prompt_ids=self.prompt_ids,
            recompute=recompute,
            greedy=sampling is None,
            delivery=self.delivery,
            end_token_ids=self.end_tokens,
            sampling=sampling,
        )


def label_of(sampling: logit_stats.SamplingTerms | None) -> str:
    if sampling is None:
        return "greedy"
    check = "replay" if sampling.seed is not None else "statistical"
    return f"{check}, T {sampling.temperature:g} top_p {sampling.top_p:g}"


def checks(
    runner: ModelRunner, requests: dict[str, tuple[Request, logit_stats.SamplingTerms | None]], repeats: int
) -> list[dict]:
    """Part 1: per judged answer, µs per output token of each check beyond the recompute."""
    rows = []
    for label, (request, sampling) in requests.items():
        first = len(request.prompt_ids) - 1
        hidden_rows, row_logits = runner.prefill(request.prompt_ids + request.output_ids[:-1], start=first)
        n = len(request.output_ids)
        tc = MODEL.token_check

        def shape() -> None:
            assert (
                proof.check_shape(
                    request.commitment,
                    params=MODEL.proof,
                    canonical_root=request.root,
                    expected_prompt_ids=request.prompt_ids,
                    delivery=request.delivery,
                    end_token_ids=request.end_tokens,
                )
                is None
            )

        def chunks() -> None:
            assert all(c.passes(MODEL.proof) for c in proof.verify_chunks(request.commitment, hidden_rows, MODEL.proof))

        def tokens() -> None:
            stats = logit_stats.token_stats(
                row_logits,
                request.output_ids,
                sampling=sampling,
                nucleus_margin=tc.nucleus_margin,
                first_position=first,
                edge_band=tc.nucleus_edge_band,
            )
            assert token_evidence.token_check(stats, greedy=sampling is None, params=tc).ok, label

        parts = {
            name: [s / n for s in timed(fn, repeats)]
            for name, fn in (("shape", shape), ("chunks", chunks), ("tokens", tokens))
        }
        total = [sum(values) for values in zip(*parts.values())]
        rows.append({"label": label, "n": n, **parts, "total": total})
    return rows


def recompute_vs_forward(runner: ModelRunner, lengths: Sequence[int], repeats: int) -> list[dict]:
    """Part 2: the verifier's prefill against a plain forward pass over the same ids."""
    import torch

    stream = runner.tokenizer(LONG_TEXT)["input_ids"]
    rows = []
    for length in lengths:
        ids = list(stream[:length])
        assert len(ids) == length, f"the text has only {len(stream)} tokens"

        def plain() -> None:
            with torch.inference_mode():
                logits = runner.model(
                    input_ids=torch.tensor([ids], dtype=torch.long, device=runner.device), use_cache=False
                ).logits
            assert logits.shape[1] == length

        def prefill() -> None:
            hidden, logits = runner.prefill(ids)
            assert logits.shape[0] == length

        recompute_s, plain_s = timed_pair(prefill, plain, repeats)
        rows.append({"length": length, "prefill": recompute_s, "plain": plain_s})
    return rows


def verify_vs_generate(
    runner: ModelRunner,
    requests: dict[str, tuple[Request, logit_stats.SamplingTerms | None]],
    prompt_ids: list[int],
    output_tokens: int,
    repeats: int,
) -> dict:
    """Part 3: generating the greedy answer against verifying each judged answer (whole
    `verify_commitment`, a fresh recompute each time)."""
    decode_s: list[float] = []

    def generate() -> None:
        served = greedy_generation(runner, prompt_ids, output_tokens, ignore_eos=True)
        assert len(served.output_ids) == output_tokens
        decode_s.append(served.finished_perf - served.first_token_perf)

    result: dict = {"verify": {}}
    greedy_request, _ = requests["greedy"]
    generate_s, verify_s = timed_pair(generate, lambda: _verified(greedy_request, runner, None), repeats)
    result["generate"] = generate_s
    result["decode"] = decode_s[-repeats:]
    result["verify"]["greedy"] = verify_s
    for label, (request, sampling) in requests.items():
        if label != "greedy":
            result["verify"][label] = timed(lambda: _verified(request, runner, sampling), repeats)
    return result


def _verified(request: Request, runner: ModelRunner, sampling: logit_stats.SamplingTerms | None) -> None:
    verdict = request.verify(runner.prefill, sampling)
    assert verdict.kind == "pass", verdict


def checkpoint_path(explicit: str) -> Path:
    """`--checkpoint DIR`, or the embedded model's conversion in the shared model cache
    (`ENGY_MODEL_CACHE` or the user cache; converted from the installed package once per machine)."""
    from engy_node.config import resolve_paths
    from engy_node.serve.checkpoint import cached_conversion, embedded_gguf_path

    if explicit:
        directory = Path(explicit).expanduser()
        if not (directory / "config.json").is_file():
            raise SystemExit(f"--checkpoint {directory}: no config.json there")
        return directory
    return cached_conversion(resolve_paths(None, os.environ).model_cache_dir, embedded_gguf_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny run: short request, two lengths, 2 repeats")
    parser.add_argument(
        "--dtype", default="float32,bfloat16", help="recompute (and generation) dtypes, comma-separated"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for parts 1 and 2 (default: torch's, one per core)"
    )
    parser.add_argument("--verify-threads", type=int, default=1, help="torch threads for part 3 (per-core figures)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--lengths", default="128,512,1024", help="part 2's sequence lengths")
    parser.add_argument("--checkpoint", default="", help="checkpoint directory (default: the embedded model)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.prompt_tokens, args.output_tokens, args.lengths = 2, 48, 32, "64,128"

    import torch
    import transformers

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    threads = args.threads or torch.get_num_threads()
    checkpoint = checkpoint_path(args.checkpoint)
    root = model_root(checkpoint)
    try:
        from importlib.metadata import version

        toploc_version = version("toploc")
    except Exception:  # noqa: BLE001 - informational only
        toploc_version = "?"
    print(
        f"verifier benchmark: {MODEL.display_name} on CPU; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"toploc {toploc_version}; Python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
        f"parts 1-2 at {threads} thread(s), part 3 at {args.verify_threads}; median (min–max) of {args.repeats} after a warm-up\n"
    )

    results = {}
    for dtype in dtypes:
        torch.set_num_threads(threads)
        runner = ModelRunner.load(checkpoint, device="cpu", dtype=dtype)
        end_tokens = end_token_ids_of(checkpoint, runner.tokenizer)
        prompt_ids = prompt_of(runner, args.prompt_tokens)
        served = greedy_generation(runner, prompt_ids, args.output_tokens, ignore_eos=True)
        requests: dict[str, tuple[Request, logit_stats.SamplingTerms | None]] = {
            "greedy": (Request(runner, root, prompt_ids, served, None, end_tokens), None)
        }
        for temperature, top_p in SAMPLED:
            answer = seeded_answer(runner, prompt_ids, args.output_tokens, temperature, top_p)
            request = Request(runner, root, prompt_ids, answer, None, end_tokens)
            for terms in (
                logit_stats.SamplingTerms(temperature, top_p),
                logit_stats.SamplingTerms(temperature, top_p, seed=SEED),
            ):
                requests[label_of(terms)] = (request, terms)
        part1 = checks(runner, requests, args.repeats)
        part2 = recompute_vs_forward(runner, lengths, args.repeats)
        torch.set_num_threads(args.verify_threads)
        part3 = verify_vs_generate(runner, requests, prompt_ids, args.output_tokens, args.repeats)
        results[dtype] = (len(prompt_ids), part1, part2, part3)
        del runner

    prompt_len = next(iter(results.values()))[0]
    print(
        f"## 1. The check beyond the recompute, µs per output token ({prompt_len}-token prompt, {args.output_tokens} output "
        f"tokens, {threads} thread(s)); target ≤ 10\n"
    )
    print(
        "| recompute dtype | answer judged as | shape checks | verify_chunks | token check (token_stats + token_check) "
        "| total | target ≤ 10 µs |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for dtype, (_, part1, _, _) in results.items():
        for row in part1:
            total = statistics.median(row["total"])
            print(
                f"| {dtype} | {row['label']} | {spread(row['shape'], 1e6)} | {spread(row['chunks'], 1e6)} | "
                f"{spread(row['tokens'], 1e6)} | {spread(row['total'], 1e6)} | {'met' if total <= 10e-6 else 'not met'} |"
            )
    for dtype, (_, part1, _, _) in results.items():
        by_label = {row["label"]: statistics.median(row["tokens"]) * 1e6 for row in part1}
        greedy = by_label["greedy"]
        extras = ", ".join(f"{label}: +{value - greedy:,.1f}" for label, value in by_label.items() if label != "greedy")
        print(f"\n{dtype}: token check over greedy's (the sampled extras), µs/token: {extras}")

    print(
        f"\n## 2. Recompute (`ModelRunner.prefill`) vs a plain forward pass, ms ({threads} thread(s)); target ≤ 1.1×\n"
    )
    print("| dtype | tokens | prefill | plain forward | ratio (medians) | target ≤ 1.1× |")
    print("|---|---:|---:|---:|---:|---|")
    for dtype, (_, _, part2, _) in results.items():
        for row in part2:
            ratio = statistics.median(row["prefill"]) / statistics.median(row["plain"])
            print(
                f"| {dtype} | {row['length']:,} | {spread(row['prefill'], 1e3)} | {spread(row['plain'], 1e3)} | "
                f"{ratio:.3f}× | {'met' if ratio <= 1.1 else 'not met'} |"
            )

    print(
        f"\n## 3. Verifying vs generating, {prompt_len}-token prompt + {args.output_tokens} output tokens, "
        f"{args.verify_threads} thread(s); target generate ÷ verify ≥ 50×\n"
    )
    print(
        "| dtype | answer judged as | generate (greedy, s) | of which decode (s) | verify_commitment (s) | "
        "verifications/s per core | generate ÷ verify | target ≥ 50× |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for dtype, (_, _, _, part3) in results.items():
        generate = statistics.median(part3["generate"])
        for label, verify_s in part3["verify"].items():
            verify = statistics.median(verify_s)
            ratio = generate / verify
            per_core = 1 / verify / args.verify_threads
            print(
                f"| {dtype} | {label} | {spread(part3['generate'], 1, '{:.2f}')} | {spread(part3['decode'], 1, '{:.2f}')} | "
                f"{spread(verify_s, 1, '{:.3f}')} | {per_core:.2f} | {ratio:.1f}× | {'met' if ratio >= 50 else 'not met'} |"
            )


if __name__ == "__main__":
    main()
