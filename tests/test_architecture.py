"""The package's shape, checked: which layer may import which, and no circles.

Three layers in `engy_node`, and the TUI on top (docs/architecture.md draws them):

* the core — `protocol/` (what peers say to each other), `proof`, `models`, `config`, `hub`,
  `serve/`, `hardware/`, … — used by everything and importing no role;
* the roles — `miner/`, `gateway/`, `validator/`, `verifier/` — each using the core but never
  another role: what two roles share lives in the core (the audit job in `protocol/audit.py`,
  the breaker's bars in `protocol/standing.py`), so each role can change, be tested and be
  deployed on its own;
* the node — `cli.py` and `commands/` (its larger sub-commands), `roles.py`, `local/` (the whole
  network on one machine) and `testing/` (harnesses that drive the real roles) — which assembles
  roles and may import any of them.

`engy_node` is headless and never imports `textual` or `engy_tui`; `engy_tui` imports the core
and the node, never a role's internals, and its dashboards (`widgets/`) read the node only through
the snapshot types (`engy_node.snapshots`) and the core's public constants. Every import statement counts, including those inside
functions, and no module imports itself back through others.

And sizes: no module is over 800 lines, and a gateway module over 600 says why in its docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "engy_node"
TUI = PACKAGE.parent / "engy_tui"
ROLES = ("miner", "gateway", "validator", "verifier")
NODE = ("cli", "commands", "roles", "local", "testing", "__main__")
"""Top-level modules and folders of `engy_node` that assemble roles into a node. `commands` is
`cli`'s larger sub-commands, split from it; `gateway …` there opens a gateway's store."""


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


def layer_of(module: str) -> str | None:
    """`core`, `role`, `node` or `tui` for a module of ours; None for anyone else's."""
    parts = module.split(".")
    if parts[0] == "engy_tui":
        return "tui"
    if parts[0] != "engy_node":
        return None
    if len(parts) == 1:
        return "core"
    if parts[1] in ROLES:
        return "role"
    return "node" if parts[1] in NODE else "core"


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(TUI.rglob("*.py"))


def offending_imports(importer_layer: str, forbidden: set[str]) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sources()
        if layer_of(module_name(path)) == importer_layer
        for line, module in imported_modules(path)
        if layer_of(module) in forbidden
    ]


def test_the_checker_sees_relative_and_nested_imports(tmp_path):
    module = tmp_path / "engy_node" / "gateway" / "sneaky.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from . import pool\n\ndef later():\n    from ..miner import link\n    import engy_node.validator.role\n"
    )
    roles = {role_of(name) for _, name in imported_modules(module, root=tmp_path)}
    assert roles == {"gateway", "miner", "validator"}


def test_the_layers_are_read_from_the_path():
    assert layer_of("engy_node.protocol.audit") == layer_of("engy_node.hardware.gpu") == "core"
    assert layer_of("engy_node.verifier.judge") == layer_of("engy_node.gateway") == "role"
    assert layer_of("engy_node.local.up") == layer_of("engy_node.roles") == "node"
    assert layer_of("engy_tui.app") == "tui" and layer_of("trio") is None


@pytest.mark.parametrize("role", ROLES)
def test_no_role_imports_another_role(role):
    folder = PACKAGE / role
    offending = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in imported_modules(path):
            other = role_of(module)
            if other is not None and other != role:
                offending.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not offending, (
        "a role imports another role's folder; move what they share into the core (protocol/):\n" + "\n".join(offending)
    )


def test_the_core_imports_no_role_and_not_the_node():
    offending = offending_imports("core", {"role", "node", "tui"})
    assert not offending, (
        "the core imports a role or the node that assembles them; move the shared part into the core, "
        "or have the node pass it in:\n" + "\n".join(offending)
    )


def test_roles_do_not_import_the_node():
    offending = offending_imports("role", {"node", "tui"})
    assert not offending, "a role imports the node that assembles it:\n" + "\n".join(offending)


def test_the_tui_never_imports_a_role():
    offending = offending_imports("tui", {"role"})
    assert not offending, (
        "the TUI reaches into a role; read the role's state from the hub/control API, or move the "
        "shared figure into the core:\n" + "\n".join(offending)
    )


DASHBOARD_SOURCES = (
    "engy_node.snapshots",
    "engy_node.protocol",
    "engy_node.models",
    "engy_node.config",
    "engy_node.hardware.gpu",
    "engy_node.hardware.monitor",
    "engy_node.money",
    "engy_node.durations",
)
"""What the TUI's dashboards may read of the node: the snapshot types, and the public constants
and pure helpers of the core that say what a figure means (the breaker's bars, the catalog,
settings' defaults, GPU units and temperature bands, exact µUSD amounts, spans of time worded as
everywhere else)."""


def test_the_dashboards_read_the_node_only_through_its_snapshot_types():
    offending = [
        f"{path.relative_to(TUI.parent)}:{line} imports {module}"
        for path in sorted((TUI / "widgets").rglob("*.py"))
        for line, module in imported_modules(path)
        if module.startswith("engy_node")
        and not any(module == source or module.startswith(f"{source}.") for source in DASHBOARD_SOURCES)
    ]
    assert not offending, (
        "a dashboard widget reads the node around its snapshot types (engy_node.snapshots); "
        "publish what it needs in the hub instead:\n" + "\n".join(offending)
    )


def test_the_core_never_imports_the_tui():
    offending = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in ("textual", "engy_tui")
    ]
    assert not offending, "\n".join(offending)


def modules() -> dict[str, Path]:
    """Each of our modules by name (a package by its `__init__`'s path)."""
    return {module_name(path): path for path in sources()}


def import_graph() -> dict[str, set[str]]:
    """Each of our modules and the modules of ours it imports (packages count as their `__init__`)."""
    modules_by_name = modules()
    graph: dict[str, set[str]] = {name: set() for name in modules_by_name}
    for name, path in modules_by_name.items():
        for _, imported in imported_modules(path):
            parts = imported.split(".")
            target = next(
                (".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules_by_name), None
            )
            if target is not None and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    found = circles(import_graph())
    assert not found, "modules that import each other, directly or through others:\n" + "\n".join(
        " ↔ ".join(component) for component in found
    )


MAX_MODULE_LINES = 800
"""No module anywhere is longer: past it a module holds more than one concern."""
MAX_GATEWAY_MODULE_LINES = 600
"""A gateway module past this says why in its docstring ("Why this size: …")."""
SIZE_REASON = "Why this size:"


def test_no_module_is_over_800_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in sources()
        if (count := line_count(path)) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def test_a_gateway_module_over_600_lines_says_why_in_its_docstring():
    unexplained = [
        str(path.relative_to(PACKAGE.parent))
        for path in sorted((PACKAGE / "gateway").rglob("*.py"))
        if line_count(path) > MAX_GATEWAY_MODULE_LINES
        and SIZE_REASON not in (ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert not unexplained, (
        f"gateway modules over {MAX_GATEWAY_MODULE_LINES} lines without '{SIZE_REASON} …': {unexplained}"
    )


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())
