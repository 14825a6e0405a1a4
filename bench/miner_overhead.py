"""What the miner adds on top of generation, measured side by side in one run.

    .venv/bin/python bench/miner_overhead.py [--rounds 3] [--max-tokens 64]

1. End to end: the same prompts, greedy, sent straight to the reference server's /generate
   (tokenised the same way, hidden states on — what any miner must ask for) and through the miner
   (websocket from a protocol-level gateway, chat template, generation, TOPLOC commitment,
   response frame), alternating so drift hits both equally. Reports the median per request and the
   ratio of totals.
2. Proof build time per token: `proof.build_proofs` on bf16 rows of SmolLM2's width (576) and
   Qwen3.6's (2048).
3. SSE parse throughput on one large hidden-state event: ours (`SseParser` + orjson) against a
   naive parser that re-splits its whole buffer on every read.

Everything runs on loopback; the reference server is started and stopped by this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engy_node import proof  # noqa: E402
from engy_node.miner.link import GatewayLink, Identity, LinkSettings  # noqa: E402
from engy_node.miner.serving import RequestHandler  # noqa: E402
from engy_node.models import SMOLLM2_135M, ProofParams  # noqa: E402
from engy_node.protocol.miner import Capacity, Message, ServeRequest  # noqa: E402
from engy_node.serve.client import ServeClient, SseParser  # noqa: E402
from engy_node.served_model import load_served_model  # noqa: E402
from engy_node.testing.gateway import GatewayHarness  # noqa: E402

PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about the sea.",
    "What are three benefits of regular exercise?",
    "Give me a simple recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet.",
    "What is the capital of France?",
)
READY = re.compile(r"ready to roll! \(\S+ on (http://127\.0\.0\.1:\d+)\)")


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    log = (home / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "engy_node", "--home", str(home), "serve", "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = READY.search((home / "server.log").read_text())
        if match:
            return process, match.group(1)
        if process.poll() is not None:
            raise SystemExit((home / "server.log").read_text())
        time.sleep(0.1)
    raise SystemExit("reference server did not start")


async def end_to_end(url: str, checkpoint: Path, rounds: int, max_tokens: int) -> dict:
    served = load_served_model(SMOLLM2_135M, checkpoint)
    harness = GatewayHarness(workers=1)
    direct_s, miner_s, proof_s, tokens = [], [], [], []
    async with httpx.AsyncClient(timeout=300) as http, trio.open_nursery() as nursery:
        await nursery.start(harness.run)
        outcomes = []
        handler = RequestHandler(model=served, serve=lambda: ServeClient(url, http), on_outcome=outcomes.append)
        link = GatewayLink(
            gateway_url=harness.url,
            identity=Identity(miner_key="bench"),
            http=http,
            handler=handler,
            settings=LinkSettings(),
            limits=Capacity(
                0, 1, SMOLLM2_135M.max_input_tokens, SMOLLM2_135M.max_output_tokens, SMOLLM2_135M.max_request_s
            ),
            hello={
                "model": SMOLLM2_135M.id,
                "model_root": served.model_root,
                "hw": {},
                "versions": {},
                "worker_name": "bench",
                "worker_id": uuid.uuid4().hex,
            },
        )
        nursery.start_soon(link.run)
        await harness.wait_for(lambda: 0 in harness.legs, timeout=60)
        serve = ServeClient(url, http)
        for _ in range(rounds):
            for text in PROMPTS:
                request = ServeRequest(
                    messages=(Message("user", text),), max_tokens=max_tokens, engy_request_id=uuid.uuid4().hex
                )
                ids = served.render_prompt(request)
                started = time.perf_counter()
                direct = await serve.generate(ids, {"temperature": 0.0}, max_new_tokens=max_tokens)
                direct_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                record = await harness.result(await harness.serve(request))
                miner_s.append(time.perf_counter() - started)
                assert record.response.error is None, record.response.error
                served_ids = record.response.commitment["output_token_ids"]
                assert served_ids == direct.output_ids, "miner and direct call generated different tokens"
                proof_s.append(outcomes[-1].proof_s)
                tokens.append(len(served_ids))
        nursery.cancel_scope.cancel()
    return {
        "requests": len(direct_s),
        "tokens_per_request_mean": statistics.mean(tokens),
        "direct_median_s": statistics.median(direct_s),
        "miner_median_s": statistics.median(miner_s),
        "ratio_of_totals": sum(miner_s) / sum(direct_s),
        "added_median_ms": (statistics.median(m - d for m, d in zip(miner_s, direct_s))) * 1000,
        "proof_us_per_token_in_miner": sum(proof_s) / sum(tokens) * 1e6,
    }


def proof_build(width: int, tokens: int = 4096, repeats: int = 5) -> float:
    import torch

    rows = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        proof.build_proofs(rows, ProofParams())
        times.append(time.perf_counter() - started)
    return statistics.median(times) / tokens * 1e6


def naive_parse(data: bytes, piece: int) -> bytes:
    buffer = b""
    latest = b""
    for start in range(0, len(data), piece):
        buffer += data[start : start + piece]
        *complete, buffer = buffer.split(b"\n\n")
        for event in complete:
            if event.startswith(b"data: "):
                latest = event[6:]
    return latest


def ours_parse(data: bytes, piece: int) -> bytes:
    parser = SseParser()
    latest = b""
    for start in range(0, len(data), piece):
        events = parser.feed(data[start : start + piece])
        if events:
            latest = events[-1]
    return latest


def sse_throughput(rows: int, width: int = 2048, piece: int = 65536) -> dict:
    import numpy as np

    hidden = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32).astype(np.float64)
    event = (
        b"data: "
        + orjson.dumps({"text": "x", "meta_info": {"hidden_states": hidden}}, option=orjson.OPT_SERIALIZE_NUMPY)
        + b"\n\n"
    )
    result = {"event_mb": len(event) / 1e6}
    for name, parse in (("ours", ours_parse), ("naive", naive_parse)):
        started = time.perf_counter()
        payload = parse(event, piece)
        orjson.loads(payload)
        elapsed = time.perf_counter() - started
        result[f"{name}_mb_per_s"] = len(event) / 1e6 / elapsed
    result["speedup"] = result["ours_mb_per_s"] / result["naive_mb_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sse-rows", type=int, default=1500, help="hidden-state rows in the SSE event (x 2048 floats)")
    args = parser.parse_args()

    from engy_node.config import load_config
    from engy_node.serve.checkpoint import embedded_checkpoint

    with tempfile.TemporaryDirectory(prefix="engy-bench-") as home:
        config = load_config(home=home, env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"})
        checkpoint = embedded_checkpoint(models_dir=config.paths.models_dir, cache_dir=config.paths.model_cache_dir)
        process, url = start_server(Path(home))
        try:
            e2e = trio.run(end_to_end, url, checkpoint, args.rounds, args.max_tokens)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    report = {
        "end_to_end": e2e,
        "proof_build_us_per_token": {"hidden_576": proof_build(576), "hidden_2048": proof_build(2048)},
        "sse_parse": sse_throughput(args.sse_rows),
    }
    print(json.dumps(report, indent=2))
    print(
        f"\nminer vs direct /generate: {e2e['ratio_of_totals']:.3f}x total time "
        f"(median {e2e['miner_median_s'] * 1000:.0f} ms vs {e2e['direct_median_s'] * 1000:.0f} ms, "
        f"+{e2e['added_median_ms']:.1f} ms per request)"
    )
    print(
        f"proof build: {report['proof_build_us_per_token']['hidden_576']:.1f} µs/token (H=576), "
        f"{report['proof_build_us_per_token']['hidden_2048']:.1f} µs/token (H=2048); "
        f"in the miner {e2e['proof_us_per_token_in_miner']:.1f} µs/token"
    )
    sse = report["sse_parse"]
    print(
        f"SSE parse, {sse['event_mb']:.0f} MB event: ours {sse['ours_mb_per_s']:.0f} MB/s, "
        f"naive {sse['naive_mb_per_s']:.0f} MB/s ({sse['speedup']:.1f}x)"
    )


if __name__ == "__main__":
    main()
