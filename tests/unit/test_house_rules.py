"""The repository's structure, checked: the import layers of the service namespace (the
client distribution's wire package lowest), no import circle between files (imports
inside functions count), the client importing nothing of the server and the server only
the client's wire package, module sizes, and no development history in tracked text."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Lowest first: a module may import its own layer or a lower one, never a higher one. A
#: tuple is one layer of sibling packages, which may not import each other. The client
#: distribution is the lowest: the server imports its wire formats, and it imports nothing
#: of the server.
LAYERS: tuple[str | tuple[str, ...], ...] = (
    "hybridflow_client",
    "single_controller",
    "hybridflow.wire",
    "hybridflow.state",
    "hybridflow.config",
    "hybridflow.control",
    ("hybridflow.http", "hybridflow.oip_grpc"),
    "hybridflow.serve",
)
#: Packages whose files the import rules cover (the client distribution's too).
SOURCES = {"single_controller": ROOT, "hybridflow": ROOT, "hybridflow_client": ROOT / "hybridflow-client"}
MAX_MODULE_LINES = 500


def module_files() -> dict[str, Path]:
    files = {}
    for package, base in SOURCES.items():
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it (top level, functions,
    TYPE_CHECKING blocks alike), each resolved to the longest known module name."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for target in targets:
        parts = target.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and ".".join(parts) != name:
            resolved.add(".".join(parts))
    return resolved


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def package_of(module: str) -> str | None:
    """The LAYERS package a module belongs to."""
    for entry in LAYERS:
        for prefix in (entry,) if isinstance(entry, str) else entry:
            if module == prefix or module.startswith(prefix + "."):
                return prefix
    return None


def layer_of(module: str) -> int | None:
    package = package_of(module)
    for rank, entry in enumerate(LAYERS):
        if package is not None and package in ((entry,) if isinstance(entry, str) else entry):
            return rank
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_circle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("hybridflow.serve.ingress") > layer_of("hybridflow.http.app") > layer_of("hybridflow.wire.split")
    assert layer_of("hybridflow.wire.split") > layer_of("single_controller.ray") > layer_of("hybridflow_client.wire.limits")
    assert layer_of("hybridflow_client.core") == 0 and layer_of("tests.unit") is None
    assert layer_of("hybridflow.oip_grpc.service") == layer_of("hybridflow.http.app")
    assert package_of("hybridflow.oip_grpc.service") != package_of("hybridflow.http.app")


def test_no_import_circle_between_files():
    assert cycles(import_graph()) == []


def test_no_module_imports_from_a_higher_layer():
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(module) is not None and layer_of(target) is not None and layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_module_imports_a_sibling_package_of_its_layer():
    sideways = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(module) is not None and layer_of(target) == layer_of(module)
        and package_of(target) != package_of(module)
    ]
    assert sideways == []


def test_the_client_imports_nothing_of_the_server():
    graph = import_graph()
    reached = sorted({t for m, ts in graph.items() if m.startswith("hybridflow_client") for t in ts
                      if not t.startswith("hybridflow_client")})
    assert reached == []


def test_the_server_imports_only_the_clients_wire_package():
    graph = import_graph()
    reached = sorted({t for m, ts in graph.items() if not m.startswith("hybridflow_client") for t in ts
                      if t.startswith("hybridflow_client") and not t.startswith("hybridflow_client.wire")})
    assert reached == []


def test_only_the_library_and_the_service_namespace_are_packages_at_the_root():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"tests", "bench", "examples"} == {"single_controller", "hybridflow"}


def test_no_module_is_over_the_size_limit():
    long = {name: n for name, path in module_files().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_bench_or_example_module_is_over_the_size_limit():
    files = [*(ROOT / "bench").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


#: Development history has no place in the repository's text: the commit log holds it.
HISTORY = re.compile(
    r"\b(this|previous|last|next) (round|session)\b|\bsessions? ago\b|\bissue #?\d+", re.IGNORECASE
)


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    files = []
    for name in listed:
        path = ROOT / name
        if path.is_file() and path.suffix not in {".png", ".jpg", ".whl", ".db"}:
            files.append(path)
    return files


def test_no_development_history_in_tracked_text():
    hits = []
    for path in tracked_text_files():
        if path == Path(__file__):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
                 for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    assert hits == []


@pytest.mark.parametrize("line", ["as measured this round", "two sessions ago", "see issue 13", "Issue #4 says"])
def test_the_history_check_catches_its_phrases(line):
    assert HISTORY.search(line)


def test_readme_is_a_users_page_and_the_benchmarks_have_theirs():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 450
    assert (ROOT / "docs" / "benchmarks.md").is_file()
