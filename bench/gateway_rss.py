"""How much memory each gateway process holds, this checkout beside a baseline, in one run.

    .venv/bin/python bench/gateway_rss.py [--baseline REV|DIR] [--workers 2] [--idle-seconds 10] [--cold]

Issue 14: a gateway worker tokenises with the checkpoint's tokenizer and chat template, and
importing transformers' tokenizer stack for that pulled torch in (~375 MiB a worker). The
target: a worker that never imports torch and stays ≤ 150 MB (150·10⁶ bytes = 143.1 MiB).

Each gateway is `python -m engy_node --home HOME --role gateway` with `gateway.workers` worker
processes, serving the embedded SmolLM2 model, from this venv with its code tree first on
PYTHONPATH (`--baseline REV`: a commit of this repository exported with `git archive`;
`--baseline DIR`: a tree on disk). Once the log says it is ready, every process of its tree is
sampled from `/proc/<pid>/status` every 0.5 s for `--idle-seconds`: steady = median VmRSS,
peak = VmHWM (the kernel's high-water mark, which catches the load itself), private = RssAnon;
and its `/proc/<pid>/maps` is read for torch's libraries. No traffic: the tokenizer is what
differs, and it is loaded before the gateway says it is ready. `--cold` gives the gateways an
empty user cache (`XDG_CACHE_HOME`; the converted model stays where it is), so this
checkout's first process takes the tokenizer snapshot in a child (timed to ready).

Exits 1 if a worker process of this checkout maps torch or peaks over 150 MB. Prints a JSON
summary and a Markdown table with the ratio ours / baseline per process. Everything binds
127.0.0.1 in temporary homes; every process started here is stopped here.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READY = re.compile(r"gateway ready: buyer API http://127\.0\.0\.1:\d+")
TARGET_BYTES = 150 * 10**6
SAMPLE_S = 0.5
START_TIMEOUT_S = 300


def status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon"):
            fields[name] = int(value.split()[0])
    return fields


def maps_torch(pid: int) -> bool:
    return any("libtorch" in line or "/torch/" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def tree_of(baseline: str, parent: Path) -> Path:
    if Path(baseline).is_dir():
        return Path(baseline).resolve()
    exported = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", f"{baseline}^{{commit}}"], capture_output=True, check=False
    )
    if exported.returncode != 0:
        raise SystemExit(f"--baseline {baseline}: neither a directory nor a commit of {ROOT}")
    tree = parent / "baseline"
    with tarfile.open(fileobj=io.BytesIO(exported.stdout)) as archive:
        archive.extractall(tree, filter="data")
    return tree


def measure(label: str, root: Path, *, workers: int, idle_s: float, cache_home: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"engy-rss-{label}-") as home:
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "PYTHONUNBUFFERED": "1",
            "ENGY_GATEWAY__PORT": "0",
            "ENGY_GATEWAY__MINER_PORT": "0",
            "ENGY_GATEWAY__PROVIDER_PORT": "0",
            "ENGY_GATEWAY__QUALIFICATION": "false",
            "ENGY_GATEWAY__WORKERS": str(workers),
        }
        if cache_home is not None:
            from engy_node.config import load_config

            # The converted embedded model stays in the current cache; only the rest moves.
            env["ENGY_MODEL_CACHE"] = str(
                load_config(
                    home=home, env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
                ).paths.model_cache_dir
            )
            env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix=f"{label}-", dir=cache_home)
        log_path = Path(home) / "gateway.log"
        started = time.monotonic()
        with log_path.open("w") as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "engy_node", "--home", home, "--role", "gateway"],
                cwd=root,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            while not READY.search(log_path.read_text()):
                if gateway.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    raise SystemExit(f"the {label} gateway did not start; its log:\n{log_path.read_text()}")
                time.sleep(0.1)
            ready_s = time.monotonic() - started
            pids = {"first": gateway.pid}
            pids.update({f"worker {index + 1}": pid for index, pid in enumerate(sorted(children(gateway.pid)))})
            samples: dict[str, list[int]] = {name: [] for name in pids}
            deadline = time.monotonic() + idle_s
            while time.monotonic() < deadline:
                for name, pid in pids.items():
                    samples[name].append(status(pid)["VmRSS"])
                time.sleep(SAMPLE_S)
            processes = {}
            for name, pid in pids.items():
                last = status(pid)
                processes[name] = {
                    "steady_mib": statistics.median(samples[name]) / 1024,
                    "peak_mib": last["VmHWM"] / 1024,
                    "private_mib": last["RssAnon"] / 1024,
                    "maps_torch": maps_torch(pid),
                }
        finally:
            gateway.send_signal(signal.SIGTERM)
            try:
                gateway.wait(60)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait(10)
    return {"label": label, "tree": str(root), "ready_s": ready_s, "processes": processes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REV|DIR", help="measure that code's gateway beside this checkout's")
    parser.add_argument("--workers", type=int, default=2, help="gateway.workers (processes: the first and the others)")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--cold", action="store_true", help="start each gateway with an empty user cache")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="engy-rss-") as scratch:
        trees = [("ours", ROOT)] + ([("baseline", tree_of(args.baseline, Path(scratch)))] if args.baseline else [])
        runs = [
            measure(
                label, root, workers=args.workers, idle_s=args.idle_seconds, cache_home=scratch if args.cold else None
            )
            for label, root in trees
        ]
    print(json.dumps(runs, indent=2))
    by_label = {run["label"]: run for run in runs}
    print(
        "\n| process | "
        + " | ".join(f"{run['label']} steady / peak / private" for run in runs)
        + (" | ours ÷ baseline (peak) |" if "baseline" in by_label else " |")
    )
    print("|---|" + "---|" * len(runs) + ("---|" if "baseline" in by_label else ""))
    for name in by_label["ours"]["processes"]:
        cells = []
        for run in runs:
            figures = run["processes"].get(name)
            cells.append(
                "—"
                if figures is None
                else f"{figures['steady_mib']:.1f} / {figures['peak_mib']:.1f} / "
                f"{figures['private_mib']:.1f} MiB{' (torch mapped)' if figures['maps_torch'] else ''}"
            )
        ratio = ""
        if "baseline" in by_label and name in by_label["baseline"]["processes"]:
            ratio = f" | {by_label['ours']['processes'][name]['peak_mib'] / by_label['baseline']['processes'][name]['peak_mib']:.2f}×"
        print(f"| {name} | " + " | ".join(cells) + ratio + " |")
    print("\nready after: " + ", ".join(f"{run['label']} {run['ready_s']:.1f} s" for run in runs))
    failures = []
    for name, figures in by_label["ours"]["processes"].items():
        if name != "first" and figures["maps_torch"]:
            failures.append(f"{name} maps torch")
        if name != "first" and figures["peak_mib"] * 2**20 > TARGET_BYTES:
            failures.append(f"{name} peaks at {figures['peak_mib']:.1f} MiB")
    if failures:
        print("target missed (worker ≤ 150 MB, no torch): " + "; ".join(failures))
        return 1
    print("target met: every worker process of this checkout peaks ≤ 150 MB (143.1 MiB) and maps no torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
