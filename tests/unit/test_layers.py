"""The package's shape, checked from its source: layers that only point down, no import cycles (between modules
and between packages), no file of code over 800 lines anywhere in the repository, and nothing in it that names
a file outside the repository.

Imports are read with ``ast`` from every module of ``src/cryosleep``: module-level, function-level and
``if TYPE_CHECKING:`` imports all count (a cycle hidden behind a function-level or type-only import is still
a cycle a reader has to hold in their head). ``from cryosleep.x import y`` counts as an import of
``cryosleep.x.y`` when that is a module, else of ``cryosleep.x`` (its ``__init__``).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PACKAGE = "cryosleep"
MAX_LINES = 800

# Lowest first. A module may import its own layer and the layers below it, never a layer above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("low", ("cryosleep", "cryosleep.core", "cryosleep.errors", "cryosleep.paths", "cryosleep.timing")),
    ("mechanisms", ("cryosleep.capture", "cryosleep.cut", "cryosleep.store", "cryosleep.net", "cryosleep.metrics")),
    ("roles", ("cryosleep.agent", "cryosleep.coordinator")),
    ("triggers", ("cryosleep.triggers",)),
    ("cli", ("cryosleep.cli", "cryosleep.workloads")),
]


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imported(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    raw: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            raw.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for a in node.names:  # a submodule by name, else a name of the module (its package's __init__)
                raw.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod)
    out: set[str] = set()
    for m in raw:
        while m and m not in MODULES:
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


GRAPH = {name: _imported(name, path) for name, path in MODULES.items()}


def _package_of(module: str) -> str:
    """``cryosleep.capture.criu`` -> ``cryosleep.capture``; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one node (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best[1]


def test_every_module_is_in_a_layer() -> None:
    for m in MODULES:
        _layer_of(m)


def test_no_module_cycle() -> None:
    assert _cycles(GRAPH) == []


def test_no_package_cycle() -> None:
    packages: dict[str, set[str]] = {}
    for a, targets in GRAPH.items():
        pa = _package_of(a)
        packages.setdefault(pa, set()).update(pb for b in targets if (pb := _package_of(b)) != pa)
    assert _cycles(packages) == []


def test_imports_only_point_down() -> None:
    upward = [f"{a} imports {b} ({LAYERS[_layer_of(b)][0]} is above {LAYERS[_layer_of(a)][0]})"
              for a, targets in GRAPH.items() for b in sorted(targets) if _layer_of(b) > _layer_of(a)]
    assert upward == []


def _repo_files() -> list[Path]:
    """Every file git tracks (or would: untracked files that are not ignored), the test itself aside; outside a
    git checkout, every file but hidden folders (.ci aside) and build output."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, check=True).stdout.decode()
        names = [REPO / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "_native", "__pycache__", "node_modules"}
        names = [p for p in REPO.rglob("*") if not any(
            part in skip or (part.startswith(".") and part != ".ci") for part in p.relative_to(REPO).parts[:-1])]
    return sorted({p for p in names if p.is_file() and p != Path(__file__)})


FILES = _repo_files()
# Code, wherever it is (the package, tests, tools, benchmarks, the C shim, scripts): what the 800 lines bound.
CODE = (".py", ".c", ".h", ".sh")


def _is_code(p: Path) -> bool:
    return p.suffix in CODE or p.name == "Makefile" or p.parent.name == ".ci"


def test_files_are_small() -> None:
    big = {str(p.relative_to(REPO)): n for p in FILES if _is_code(p)
           and (n := len(p.read_text(errors="replace").splitlines())) > MAX_LINES}
    assert big == {}


def _text(p: Path) -> str | None:
    data = p.read_bytes()
    return None if b"\0" in data[:4096] else data.decode(errors="replace")


# What a pointer out of the repository looks like: the notes file kept beside the project during its
# development, a path that climbs into a sibling checkout, or a path into the machine it was written on.
OUTSIDE = re.compile(r"FACTS\.md|\.\./shared\b|/work/|/tmp/bash_jobs")


def test_names_no_file_outside_the_repo() -> None:
    """Every text file the repository holds (code, docs, CI, deployment files)."""
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in FILES if (text := _text(p)) is not None
            for i, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []


def test_the_checks_can_fail() -> None:
    """The graph code finds a cycle and an upward import when there is one (guards against a test that
    passes because it reads nothing)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert len(GRAPH) > 50 and GRAPH["cryosleep.capture.snapshot"]
    assert OUTSIDE.search("as seen (FACTS.md)") and OUTSIDE.search("../shared/x") and OUTSIDE.search("/work/main")
    assert not OUTSIDE.search("docs/facts.md")
    assert any(p.suffix == ".c" for p in FILES) and any(p.name == "run" and p.parent.name == ".ci" for p in FILES)
    assert all(_is_code(REPO / f) for f in ("src/cryosleep/cli/main.py", "native/Makefile", "tests/unit/x.py"))
    assert _layer_of("cryosleep.cli.main") > _layer_of("cryosleep.agent.agent") > _layer_of("cryosleep.core.job")
