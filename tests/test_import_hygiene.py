"""The headless core never imports Textual or rich, and importing it loads nothing heavy:
torch, transformers and bittensor load inside the functions that need them. Only a fresh
interpreter proves a deferred import really defers, so each check runs in a subprocess.

httpx imports rich for its own command-line entry point whenever rich is installed (textual
brings it); that is the HTTP library's doing, so what `import httpx` loads by itself is the
baseline, and only what engy_node adds beyond it counts. Textual is never allowed."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import engy_node

FORBIDDEN = ("textual", "rich", "torch", "transformers", "bittensor", "toploc")


def engy_node_modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(engy_node.__path__, prefix="engy_node.")
        if not m.name.endswith("__main__")
    )


def test_every_engy_node_module_imports_without_textual_rich_or_heavy_libraries():
    modules = engy_node_modules()
    assert "engy_node.proof" in modules and "engy_node.serve.app" in modules
    script = (
        "import importlib, sys\n"
        "import httpx\n"
        "baseline = {m.split('.')[0] for m in sys.modules}\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "added = {m.split('.')[0] for m in sys.modules} - baseline\n"
        f"loaded = sorted((added & set({FORBIDDEN!r})) | ({{'textual'}} & {{m.split('.')[0] for m in sys.modules}}))\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing engy_node loaded {result.stdout.strip()}"
