"""The sglang GEMM capture on a real GPU (issue 32 item 2): run it where a GPU and sglang are.

    .venv/bin/python scripts/sglang_gemm_check.py [--python PY] [--checkpoint DIR] [--tokens 16]

Starts sglang on the embedded SmolLM2 checkpoint with the capture armed, exactly as the miner
would (`command.sglang_launch(gemm_capture_port=…)`: the `capture_site` shim on PYTHONPATH,
``--disable-cuda-graph --disable-radix-cache``), asks the capture what it commits
(``GET /gemm/info``, what the miner reads), sends a request that asks (rid ``engy-gemm-…``)
in the same moment as one that does not, asks the capture for the commitment
(prompt + output − 1 positions), opens every group of three layers at three positions, verifies
each opening against the root, and holds every projection's opened rows to `gemm_check.row_check`
against the checkpoint's own weights (honest: worst ≤ 1). Then the same request again, to say
whether deterministic inference gives the same root, and the plain request's wall time with the
capture on and off (informative, not a threshold). Prints one JSON line per step; exits 1 when a
check fails. Needs sglang installed for `--python` (default: this interpreter).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = [1, 504, 3575, 282, 4649, 314]
LAYERS = (0, 14, 29)
START_TIMEOUT_S = 420


def say(step: str, **fields: object) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def main() -> int:
    import httpx
    import numpy as np
    from safetensors import safe_open

    from engy_node.gemm.activations import GEMMS, Commitment, Opening, group_values, verify_opening
    from engy_node.miner.sglang.command import sglang_launch
    from engy_node.verifier import gemm_check as gc

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=31000)
    parser.add_argument("--capture-port", type=int, default=31001)
    options = parser.parse_args()
    checkpoint = options.checkpoint
    if checkpoint is None:
        from engy_node.config import load_config
        from engy_node.serve.checkpoint import embedded_checkpoint

        paths = load_config(home=Path(os.environ.get("ENGY_HOME", "/tmp/engy-gemm-check"))).paths
        checkpoint = embedded_checkpoint(models_dir=paths.models_dir, cache_dir=paths.model_cache_dir)
    spec = sglang_launch(
        python=options.python,
        checkpoint=checkpoint,
        served_model_name="SmolLM2",
        port=options.port,
        mem_fraction_static=0.3,
        gemm_capture_port=options.capture_port,
    )
    say("launch", argv=list(spec.argv), env=dict(spec.env))
    child = subprocess.Popen(spec.argv, env={**os.environ, **dict(spec.env)}, start_new_session=True)
    failures = 0
    try:
        with httpx.Client(base_url=spec.base_url, timeout=120) as server:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    if server.get("/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if child.poll() is not None or time.monotonic() > deadline:
                    say("start", ok=False, exit=child.poll())
                    return 1
                time.sleep(2)
            say("start", ok=True)
            info = httpx.get(f"http://127.0.0.1:{options.capture_port}/gemm/info", timeout=30)
            say("info", status=info.status_code, body=info.json())
            failures += info.status_code != 200

            def generate(rid: str) -> tuple[dict, float]:
                body = {
                    "input_ids": PROMPT,
                    "rid": rid,
                    "sampling_params": {"temperature": 0, "max_new_tokens": options.tokens, "ignore_eos": True},
                }
                began = time.perf_counter()
                answer = server.post("/generate", json=body).raise_for_status().json()
                return answer, time.perf_counter() - began

            rid = f"engy-gemm-{uuid.uuid4().hex}"
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                asked = pool.submit(generate, rid)
                plain = pool.submit(generate, f"plain-{uuid.uuid4().hex}")
                (answer, asked_s), (_, plain_s) = asked.result(), plain.result()
            meta = answer["meta_info"]
            positions = meta["prompt_tokens"] + meta["completion_tokens"] - 1
            capture = httpx.Client(base_url=f"http://127.0.0.1:{options.capture_port}", timeout=120)
            reply = capture.get(f"/gemm/commitment/{rid}", params={"positions": positions})
            say("commitment", status=reply.status_code, body=reply.json())
            if reply.status_code != 200:
                return 1
            commitment = Commitment.from_wire(reply.json())
            layout = commitment.layout
            groups = sorted({g for pair in GEMMS.values() for g in pair} | {"residual_in"})
            picks = [
                {"position": p, "layer": leaf_layer, "group": leaf}
                for p in (0, len(PROMPT), positions - 1)
                for layer in LAYERS
                for leaf_layer, leaf in dict.fromkeys(layout.canonical(layer, g) for g in groups)
            ]
            opened = capture.post("/gemm/openings", json={"rid": rid, "picks": picks}).raise_for_status().json()
            openings = [Opening.from_wire(o) for o in opened["openings"]]
            bad_paths = sum(not verify_opening(commitment, o) for o in openings)
            failures += bad_paths
            say("openings", count=len(openings), bad_paths=bad_paths)
            leaves = {(o.position, o.layer, o.group): o for o in openings}

            def values(p: int, layer: int, group: str) -> np.ndarray:
                return group_values(layout, leaves[(p, *layout.canonical(layer, group))], layer, group)

            weights = safe_open(str(checkpoint / "model.safetensors"), framework="pt")
            arithmetic = gc.ARITHMETIC[commitment.layout.dtype]
            for layer in LAYERS:
                for name, (x_group, y_group) in GEMMS.items():
                    part = "self_attn" if name[0] in "qkvo" else "mlp"
                    w = weights.get_tensor(f"model.layers.{layer}.{part}.{name}.weight").double().numpy()
                    ps = (0, len(PROMPT), positions - 1)
                    x = np.stack([values(p, layer, x_group) for p in ps])
                    y = np.stack([values(p, layer, y_group) for p in ps])
                    check = gc.row_check(w, x, y, arithmetic)
                    failures += check.worst > 1
                    say("row_check", layer=layer, gemm=name, worst=check.worst)
            again = f"engy-gemm-{uuid.uuid4().hex}"
            generate(again)
            second = capture.get(f"/gemm/commitment/{again}", params={"positions": positions}).json()
            say("repeat", same_root=second.get("activations_root") == commitment.root.hex(), second=second)
            say("wall_s", asking=asked_s, plain_beside_it=plain_s, plain_alone=generate("plain-after")[1])
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
    say("done", failures=failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
