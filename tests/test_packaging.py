"""What each role installs: `engy-node[validator]` needs none of the model stack or the TUI.

A validator runs on a small VPS; torch alone is gigabytes. The core dependencies plus the
validator's extra must not name the model stack, no module the validator role can reach (its
imports, transitively, counting those inside functions) may import it, and the validator's
entry points import with it missing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib

from packaging.requirements import Requirement

from tests.test_architecture import PACKAGE, import_graph, imported_modules, modules

ROOT = PACKAGE.parent
HEAVY = {"torch", "transformers", "toploc", "safetensors", "numpy", "textual", "gguf", "accelerate", "sglang"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_validator_installs_no_model_stack_and_no_tui():
    meta = project()
    named = {Requirement(line).name for line in meta["dependencies"] + meta["optional-dependencies"]["validator"]}
    assert not named & HEAVY, f"the core or the validator extra names {sorted(named & HEAVY)}"


def test_every_role_has_an_extra_and_all_installs_every_one():
    extras = project()["optional-dependencies"]
    for role in ("miner", "gateway", "validator", "verifier", "tui"):
        assert role in extras, f"no [{role}] extra"
    assert Requirement(extras["all"][0]).extras >= {"miner", "gateway", "validator", "verifier", "tui"}


def test_no_module_the_validator_reaches_imports_the_model_stack():
    graph = import_graph()
    start = [name for name in graph if name.startswith("engy_node.validator")]
    reached, pending = set(start), list(start)
    while pending:
        for imported in graph[pending.pop()]:
            if imported not in reached:
                reached.add(imported)
                pending.append(imported)
    paths = modules()
    offending = [
        f"{name}:{line} imports {module}"
        for name in sorted(reached)
        for line, module in imported_modules(paths[name])
        if module.split(".")[0] in HEAVY
    ]
    assert not offending, "the validator role can reach the model stack:\n" + "\n".join(offending)


def test_the_validator_starts_without_the_model_stack(tmp_path):
    blocked = sorted(HEAVY)
    script = textwrap.dedent(f"""
        import importlib.abc, sys

        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}")

        sys.meta_path.insert(0, Missing())
        import engy_node.cli, engy_node.roles, engy_node.validator.role
        from engy_node.config import load_config
        config = load_config(home=sys.argv[1], env={{}})
        engy_node.roles.role_services(config, engy_node.hub.Hub(), ["validator"], actions=None)
        print("started")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0 and "started" in result.stdout, result.stderr[-3000:]
