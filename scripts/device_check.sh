#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one short script (run it on a GPU machine from the repo
# root with the project's .venv, or any environment where `pip install -e .` and toploc work):
#   1. NVML detection on real hardware (what `engy-node plan` sees);
#   2. the reference server on CUDA answering a real prompt;
#   3. TOPLOC and token-check margins across numeric paths: serve on CUDA, recompute on CPU
#      (what a validator without the miner's GPU does), and CUDA on CUDA.
# Output goes to stdout and, when $OUT is set, to files under it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
HOME_DIR=$(mktemp -d)

echo "== 1. NVML"
$PY -m engy_node --home "$HOME_DIR" plan | tee "$OUT/plan.txt"

echo "== 2. reference server on CUDA"
$PY -m engy_node --home "$HOME_DIR" serve --device cuda --port 0 > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    URL=$(grep -o "ready to roll! ([^ ]* on http://127.0.0.1:[0-9]*" "$OUT/serve.log" | grep -o "http://.*" || true)
    [ -n "$URL" ] && break
    sleep 1
done
[ -n "$URL" ] || { echo "server did not start"; cat "$OUT/serve.log"; exit 1; }
curl -s "$URL/generate" -d '{"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}' | tee "$OUT/generate.json"
echo
curl -s "$URL/server_info" | tee "$OUT/server_info.json" | head -c 600
echo
kill $SERVER; wait $SERVER 2>/dev/null || true

echo "== 3. calibration: served on CUDA, recomputed on CPU"
$PY -m engy_node --home "$HOME_DIR" calibrate --device cuda --recompute-device cpu --prompts 3 | tee "$OUT/calibration-cuda-cpu.md"
echo "== 3b. calibration: served and recomputed on CUDA"
$PY -m engy_node --home "$HOME_DIR" calibrate --device cuda --prompts 3 | tee "$OUT/calibration-cuda.md"
