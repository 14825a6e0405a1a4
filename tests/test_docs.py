"""The design lives in the repository, and the README's map of it matches the tree.

* No file refers to the design document outside the repository that the project started from:
  what a reference relies on is stated in `docs/` (docs/architecture.md lists the documents).
* README's Layout section names every package and every top-level module of `engy_node`, and
  every module or folder it names under `engy_node/` and `engy_tui/` exists.
* Every relative Markdown link in README.md and docs/*.md points to a file that exists.
* docs/control-api.md lists every hub state's fields as `engy_node/snapshots.py` declares them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engy_node", "engy_tui")
SEARCHED = ("engy_node", "engy_tui", "tests", "bench", "docs")
# Built from parts so that this file does not name what it looks for.
OUTSIDE_DESIGN = ("SPEC" + " " + "\u00a7", "SPEC" + ".md")

NAME = re.compile(r"(?<![\w./-])([A-Za-z_]\w*)(\.py|/)(?![\w.])")
"""A module (`name.py`) or a folder (`name/`) as the Layout section writes them."""
LINK = re.compile(r"\]\(([^)\s]+)\)")
"""The target of a Markdown link or image."""


def searched_files() -> Iterator[Path]:
    yield ROOT / "README.md"
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path


def outside_design_references(text: str) -> list[tuple[int, str]]:
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if any(marker in line for marker in OUTSIDE_DESIGN)
    ]


def layout_block(readme: str) -> list[str]:
    """The lines of the code block in README's `## Layout` section."""
    section = readme.split("\n## Layout", 1)
    assert len(section) == 2, "README.md has no '## Layout' section"
    body = section[1].split("\n## ", 1)[0]
    fence = body.split("```")
    assert len(fence) >= 3, "README's Layout section has no code block"
    return fence[1].splitlines()[1:]


def layout_names(lines: list[str]) -> dict[Path, set[str]]:
    """Folder → the `name.py` and `name/` the Layout names on its lines.

    A line starting in column 0 with `engy_node/` or `engy_tui/` opens that package; one indented
    by two spaces and starting with `name/` opens that folder of it; any other line (a module line
    of the package, or a continuation indented further) belongs to the folder opened last. Lines
    of other top-level folders (tests/, bench/, docs/) are not read."""
    named: dict[Path, set[str]] = {}
    package: Path | None = None
    folder: Path | None = None
    for line in lines:
        rest = line
        if line and not line[0].isspace():
            first, _, rest = line.partition(" ")
            package = ROOT / first.rstrip("/") if first.rstrip("/") in PACKAGES else None
            folder = package
        elif package is not None and line.startswith("  ") and not line[2].isspace():
            first, _, after = line.strip().partition(" ")
            if first.endswith("/"):
                named.setdefault(package, set()).add(first)
                folder, rest = package / first.rstrip("/"), after
            else:
                folder = package
        if folder is None:
            continue
        named.setdefault(folder, set()).update(stem + suffix for stem, suffix in NAME.findall(rest))
    return named


def test_no_file_refers_to_the_design_document_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in searched_files()
        for number, line in outside_design_references(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not found, (
        "these refer to a design document that is not in the repository; point them at the doc in docs/ "
        "that holds that part of the design (add what it relies on there if it is missing):\n" + "\n".join(found)
    )


def test_the_checker_finds_a_reference_and_reads_the_layout():
    assert outside_design_references("ok\nsee " + OUTSIDE_DESIGN[0] + "9 for why\n") == [
        (2, "see " + OUTSIDE_DESIGN[0] + "9 for why")
    ]
    block = [
        "engy_node/     the node",
        "  cli.py node.py   entry point, services",
        "  gateway/    role.py pool.py (legs) store/ (ledger.py)",
        "              billing.py",
        "engy_tui/     app.py",
        "tests/        test_x.py",
    ]
    assert layout_names(block) == {
        ROOT / "engy_node": {"cli.py", "node.py", "gateway/"},
        ROOT / "engy_node" / "gateway": {"role.py", "pool.py", "store/", "ledger.py", "billing.py"},
        ROOT / "engy_tui": {"app.py"},
    }


@pytest.fixture(scope="module")
def layout() -> dict[Path, set[str]]:
    return layout_names(layout_block((ROOT / "README.md").read_text(encoding="utf-8")))


def named_in_or_above(layout: dict[Path, set[str]], path: Path) -> bool:
    """Whether the Layout names `path` on the lines of its folder or of a folder above it."""
    name = path.name + ("/" if path.is_dir() else "")
    return any(name in names for folder, names in layout.items() if folder in path.parents)


def test_the_layout_names_every_package_and_every_top_level_module(layout):
    packages = [init.parent for package in PACKAGES for init in sorted((ROOT / package).rglob("__init__.py"))]
    missing = [
        f"{path.relative_to(ROOT)}/" for path in packages if path.parent != ROOT and not named_in_or_above(layout, path)
    ]
    top_level = ROOT / "engy_node"
    missing += [
        str(path.relative_to(ROOT))
        for path in sorted(top_level.glob("*.py"))
        if path.name != "__init__.py" and path.name not in layout.get(top_level, set())
    ]
    assert not missing, "README's Layout section does not name:\n" + "\n".join(missing)


def test_everything_the_layout_names_exists(layout):
    missing = []
    for folder, names in layout.items():
        for name in sorted(names):
            wanted = name.rstrip("/")
            # A package's own lines name its top-level modules and folders; a folder's lines may
            # also name what is in its subfolders (`sglang/ (command.py …)`).
            candidates = [folder / wanted] if folder.name in PACKAGES else [folder / wanted, *folder.rglob(wanted)]
            found = [path for path in candidates if (path.is_dir() if name.endswith("/") else path.is_file())]
            if not found:
                missing.append(f"{name} (on the lines of {folder.relative_to(ROOT)}/)")
    assert not missing, "README's Layout section names what is not in the tree:\n" + "\n".join(missing)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(document):
    broken = []
    for target in LINK.findall(document.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, a mail address or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (document.parent / path).exists():
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)} links to files that do not exist: {broken}"


def state_schema_rows() -> list[str]:
    """The control API's states as docs/control-api.md lists them: each component's snapshot
    type, then the records nested in it, each with its wire keys in declaration order."""
    import dataclasses
    import typing

    from engy_node import snapshots

    roots: list[tuple[str, type]] = [(f"`{name}`", kind) for name, kind in snapshots.SINGLE_COMPONENTS.items()]
    roots[5:5] = [
        ("`miner`, `miner-N`", snapshots.MinerState),
        ("`model_server`, `model_server.<miner>`", snapshots.ModelServerState),
    ]
    seen: set[type] = set()
    rows: list[str] = []

    def nested(kind: type) -> Iterator[type]:
        for hint in typing.get_type_hints(kind).values():
            stack = [hint]
            while stack:
                inner = stack.pop(0)
                if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                    yield inner
                stack.extend(typing.get_args(inner))

    def walk(kind: type, label: str) -> None:
        if kind in seen:
            return
        seen.add(kind)
        fields = ", ".join(snapshots.wire_key(field) for field in dataclasses.fields(kind))
        rows.append(f"| {label} | `{kind.__name__}` | {fields} |")
        for inner in nested(kind):
            walk(inner, "")

    for label, kind in roots:
        walk(kind, label)
    return rows


def test_the_control_api_document_lists_every_state_field_and_the_schema_version():
    from engy_node.snapshots import STATE_SCHEMA

    text = (ROOT / "docs" / "control-api.md").read_text()
    assert f"## States (schema {STATE_SCHEMA})" in text, "docs/control-api.md names another schema version"
    listed = [line for line in text.splitlines() if re.match(r"\| (`[^|]*`)? *\| `\w+` \|", line)]
    expected = state_schema_rows()
    assert listed == expected, "docs/control-api.md's state table differs from engy_node/snapshots.py:\n" + "\n".join(
        expected
    )
