"""What committing an answer's activations costs the reference server on SmolLM2 (issue 32 part 2).

    .venv/bin/python bench/gemm_capture.py [--tokens 64] [--prompt-repeats 4] [--repeats 5]

Greedy generations of `--tokens` tokens after a prompt, run alternately without and with the
capture (`engy_node.serve.capture`: the hooks, the copies, the leaf hashing per forward call and
the tree at the end), on the calling thread as the engine runs them. Reports the process's CPU
seconds per generation (median of `--repeats`, min–max: CPU time is what the capture adds, and it
is steadier than wall time on a shared machine), the overhead in %, the record's bytes per
answer, and the JSON bytes of one opening of each group width with its Merkle path. No
thresholds: the figures go to docs/verification.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-repeats", type=int, default=4, help="copies of a 10-token sentence")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from engy_node.config import load_config
    from engy_node.gemm.activations import llama_layout
    from engy_node.serve.capture import ActivationCapture, SharedOpenings
    from engy_node.serve.checkpoint import embedded_checkpoint
    from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
    from engy_node.serve.sampling import parse_sampling_params

    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(home=Path(tempfile.mkdtemp()), env=env)
    checkpoint = embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
    runner = ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")
    layout = llama_layout(runner.model.config.to_dict(), "bfloat16")
    prompt = list(runner.tokenizer("The capital city of France is a place where " * args.prompt_repeats)["input_ids"])
    openings = SharedOpenings()
    params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}

    def generate(capture: bool) -> tuple[float, Generation]:
        generation = Generation(rid="bench", input_ids=prompt, params=parse_sampling_params(params))
        if capture:
            generation.capture = ActivationCapture(layout, openings, weights_root="", arithmetic="bfloat16")
        start = time.process_time()
        run_to_completion(runner, generation)
        return time.process_time() - start, generation

    generate(False), generate(True)
    plain, captured = [], []
    for _ in range(args.repeats):
        plain.append(generate(False)[0])
        seconds, generation = generate(True)
        captured.append(seconds)
    base, with_capture = statistics.median(plain), statistics.median(captured)
    commitment = generation.gemm_commitment or {}
    opened = openings.open("bench", [(0, 0, group) for group, _ in layout.groups])
    assert opened is not None
    record, picks = opened
    sizes = {o.group: len(json.dumps(o.to_wire(layout.dtype, layout.width(o.group)))) for o in picks}
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, prompt {len(prompt)} + {args.tokens} tokens")
    print(f"plain     {base:.3f} s CPU (min {min(plain):.3f}, max {max(plain):.3f})")
    print(f"captured  {with_capture:.3f} s CPU (min {min(captured):.3f}, max {max(captured):.3f})")
    print(f"overhead  {100 * (with_capture - base) / base:.1f} %")
    positions = commitment.get("positions", 0)
    print(
        f"record    {record.nbytes} bytes for {positions} positions ({record.nbytes // max(positions, 1)} per position)"
    )
    print(f"opening   JSON bytes by group width: { {layout.width(g): n for g, n in sizes.items()} }")


if __name__ == "__main__":
    main()
