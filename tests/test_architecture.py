"""The package's shape, checked: roles do not import each other, and the core never imports the TUI.

A role folder (`engy_node/miner`, `gateway`, `validator`) may use the shared core (`protocol`,
`serve`, `served_model`, `proof`, …) but not another role's folder: what two roles share lives in
the core, so each role can change, be tested and be deployed on its own. `engy_node` is headless
and never imports `textual` or `engy_tui` (SPEC §2). Every import statement counts, including
those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "engy_node"
ROLES = ("miner", "gateway", "validator")


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the module at `path` under `root`."""
    package_parts = list(path.relative_to(root).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def role_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "engy_node" and parts[1] in ROLES else None


def test_the_checker_sees_relative_and_nested_imports(tmp_path):
    module = tmp_path / "engy_node" / "gateway" / "sneaky.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from . import pool\n\ndef later():\n    from ..miner import link\n    import engy_node.validator.role\n"
    )
    roles = {role_of(name) for _, name in imported_modules(module, root=tmp_path)}
    assert roles == {"gateway", "miner", "validator"}


@pytest.mark.parametrize("role", ROLES)
def test_no_role_imports_another_role(role):
    folder = PACKAGE / role
    offending = []
    for path in sorted(folder.rglob("*.py")) if folder.exists() else []:
        for line, module in imported_modules(path):
            other = role_of(module)
            if other is not None and other != role:
                offending.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not offending, "a role imports another role's folder; move what they share into the core:\n" + "\n".join(
        offending
    )


def test_the_core_never_imports_the_tui():
    offending = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in ("textual", "engy_tui")
    ]
    assert not offending, "\n".join(offending)
