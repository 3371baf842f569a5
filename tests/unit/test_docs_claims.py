"""The README's and the docs' checkable claims about the repository, read from the pages
as they are now: every `make` target they name is a Makefile target; every `python -m`
module, repository path, `module:attribute` and link (with its anchor) they name exists;
every `HYBRIDFLOW_*` variable they name is read by the code, and every variable the
service renames is named in them; the versions they say were tested are the pinned ones;
the pytest markers they name are registered. A failure names the page, the line and the
claim."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path

import pytest

from hybridflow.config.environment import RENAMED
from tests.doc_pages import ROOT, Page, pages

#: Spans that look like repository paths but name another repository's (what a page says
#: about them is not about this one).
OTHER_REPOSITORIES = {("docs/verl.md", "tests/single_controller"): "verl's own test directory"}


@cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return tuple(out.split())


@cache
def top_level() -> frozenset[str]:
    return frozenset(path.split("/", 1)[0] for path in tracked())


@cache
def makefile_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.MULTILINE))


def make_mentions(page: Page) -> list[tuple[int, str, str]]:
    """``(line, target, claim)`` for every `make <target>` of a page: in a backtick span,
    with the bare `target` spans joined to it by ``/`` (``make test-unit` / `test-ray``),
    and on the lines of its shell code blocks."""
    found = []
    pattern = re.compile(r"`make\s+((?:[\w-]+=\S*\s+)*)([\w-]+)[^`]*`((?:\s*/\s*`[\w-]+`)*)")
    for match in pattern.finditer(page.prose):
        line = page.line_of(match.start())
        found.append((line, match.group(2), match.group(0)))
        found += [(line, extra, match.group(0)) for extra in re.findall(r"`([\w-]+)`", match.group(3))]
    for block in page.code_blocks:
        for offset, text in enumerate(block.lines):
            command = re.match(r"\s*(?:[A-Z_]+=\S+\s+)*make\s+((?:[\w-]+=\S*\s+)*)([\w-]+)", text)
            if command and block.language in ("", "bash", "sh", "shell", "console"):
                found.append((block.line + offset, command.group(2), text.strip()))
    return found


def python_modules(page: Page) -> list[tuple[int, str]]:
    found = [(line, m) for line, span in page.spans() for m in re.findall(r"python3? -m ([\w.]+)", span)]
    for block in page.code_blocks:
        for offset, text in enumerate(block.lines):
            found += [(block.line + offset, m) for m in re.findall(r"python3? -m ([\w.]+)", text)]
    return found


def module_file(name: str) -> Path | None:
    """The repository file of module ``name`` (the client distribution's included)."""
    for base in (ROOT, ROOT / "hybridflow-client"):
        path = base.joinpath(*name.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


#: The packages of the repository a dotted name in a page may start with.
REPOSITORY_PACKAGES = ("hybridflow", "hybridflow_client", "single_controller", "bench", "examples", "tests")


def dotted_name_problem(name: str) -> str | None:
    """Why ``module.path[:attribute]`` (or ``module.path.attribute``) names nothing of the
    repository; None when it does."""
    module, _, attribute = name.partition(":")
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            rest = parts[cut:] + (attribute.split(".")[:1] if attribute else [])
            if not rest:
                return None
            if len(rest) > 1 and cut < len(parts):
                return f"{'.'.join(parts[:cut])} has no submodule {parts[cut]!r}"
            names = top_level_names(path)
            if rest[0] in names:
                return None
            if "__getattr__" in names:  # names made on first use: ask the module itself
                if hasattr(importlib.import_module(".".join(parts[:cut])), rest[0]):
                    return None
            return f"{path.relative_to(ROOT)} defines no {rest[0]!r}"
    return f"no module {parts[0]!r} in the repository"


def test_every_make_target_the_pages_name_is_in_the_makefile():
    wrong = [
        f"{page.where(line)}: {claim!r} names target {target!r}, which the Makefile lacks"
        for page in pages() for line, target, claim in make_mentions(page) if target not in makefile_targets()
    ]
    assert not wrong, "\n".join(wrong) + f"\nMakefile targets: {sorted(makefile_targets())}"


def test_the_readme_names_the_two_commands_a_new_machine_needs():
    readme = Page.read("README.md")
    named = {target for _, target, _ in make_mentions(readme)}
    assert {"test", "serve", "serve-fresh"} <= named, named


def test_every_python_module_the_pages_run_exists():
    wrong = []
    for page in pages():
        for line, module in python_modules(page):
            if module.split(".")[0] in REPOSITORY_PACKAGES or module_file(module) is not None:
                runnable = module_file(module)
                main = module_file(module + ".__main__")
                if runnable is None or (runnable.name == "__init__.py" and main is None):
                    wrong.append(f"{page.where(line)}: `python -m {module}`: no such module to run")
            elif importlib.util.find_spec(module) is None:
                wrong.append(f"{page.where(line)}: `python -m {module}`: not importable")
    assert not wrong, "\n".join(wrong)


def test_every_repository_path_the_pages_name_exists():
    wrong = []
    for page in pages():
        for line, span in page.spans():
            path = span.strip()
            if not re.fullmatch(r"\.?[\w.-]+(/[\w.-]+)+/?", path) or path.split("/", 1)[0] not in top_level():
                continue
            if (page.path, path.rstrip("/")) in OTHER_REPOSITORIES:
                continue
            if not (ROOT / path).exists():
                wrong.append(f"{page.where(line)}: `{path}` does not exist in the repository")
    assert not wrong, "\n".join(wrong)


def test_every_module_and_attribute_the_pages_name_exists():
    wrong = []
    pattern = re.compile(rf"(?:{'|'.join(REPOSITORY_PACKAGES)})(?:\.\w+)+(?::[\w.]+)?|(?:{'|'.join(REPOSITORY_PACKAGES)}):\w+")
    for page in pages():
        for line, span in page.spans():
            if pattern.fullmatch(span.strip()) and (problem := dotted_name_problem(span.strip())):
                wrong.append(f"{page.where(line)}: `{span}`: {problem}")
    assert not wrong, "\n".join(wrong)


def anchors(path: Path) -> set[str]:
    return {h.slug for h in Page.read(str(path.relative_to(ROOT))).headings}


def test_every_link_between_the_pages_resolves_with_its_anchor():
    wrong = []
    for page in pages():
        for line, target in page.links():
            if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (ROOT / page.path).parent / file if file else ROOT / page.path
            if not path.exists():
                wrong.append(f"{page.where(line)}: link to {target!r}: {file} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.resolve()):
                wrong.append(f"{page.where(line)}: link to {target!r}: {file or page.path} has no heading "
                             f"with the anchor #{anchor}")
    assert not wrong, "\n".join(wrong)


def code_strings(path: Path) -> set[str]:
    """The string constants of a Python file that are values, not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


@cache
def variables_read() -> dict[str, list[str]]:
    """Each ``HYBRIDFLOW_*`` name (and each earlier ``SC_*`` one) used as a value in a Python file that is not a test
    module, with those files (what reads it: the service, the client, the build's and the
    tests' helpers)."""
    read: dict[str, list[str]] = {}
    for name in tracked():
        if name.endswith(".py") and not Path(name).name.startswith("test_"):
            for value in code_strings(ROOT / name):
                for variable in re.findall(r"\b(?:HYBRIDFLOW|SC)_[A-Z0-9_]*[A-Z0-9]\b", value):
                    read.setdefault(variable, []).append(name)
    return read


def test_every_environment_variable_the_pages_name_is_read_by_the_code():
    wrong = []
    for page in pages():
        for number, text in enumerate(page.lines, start=1):
            for variable in re.findall(r"\bHYBRIDFLOW_[A-Z0-9_]*[A-Z0-9]\b", text):
                if variable not in variables_read():
                    wrong.append(f"{page.where(number)}: {variable} is read nowhere in the code")
    assert not wrong, "\n".join(wrong)


def test_every_renamed_variable_is_documented_with_its_earlier_name():
    text = Page.read("docs/configuration.md").text
    everything = "\n".join(page.text for page in pages())
    missing = [f"{new} (read by {', '.join(variables_read().get(new, ['nothing']))}) is named in no page"
               for new in RENAMED if new not in everything]
    missing += [f"docs/configuration.md does not list {old}, the earlier name of {new}"
                for new, old in RENAMED.items() if f"`{old}`" not in text]
    listed = set(re.findall(r"`(SC_[A-Z_]+)`", text))
    missing += [f"docs/configuration.md lists {old} as an earlier name still read, but no code reads it"
                for old in sorted(listed) if old not in variables_read()]
    assert not missing, "\n".join(missing)


@cache
def pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([\w-]+)(?:\[[\w,]+\])?==([\w.]+)", requirement.replace(" ", ""))
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def version_claims(text: str) -> list[tuple[str, str]]:
    """``(distribution, version)`` for each pinned distribution a text names with a
    version; a version with a local build tag (torch 2.11.0+cu130) is what a recorded run
    had, not a claim about the pins."""
    names = "|".join(re.escape(name) for name in sorted(pins(), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w-])({names}) (\d+\.\d+(?:\.\d+)*)\b(?!\+|\.\d)", re.IGNORECASE)
    return pattern.findall(text)


def test_the_versions_the_pages_name_are_the_pinned_ones():
    wrong = [
        f"{page.where(number)}: {name} {version}, but pyproject.toml pins {name.lower()}=={pins()[name.lower()]}"
        for page in pages() for number, text in enumerate(page.lines, start=1)
        for name, version in version_claims(text) if pins()[name.lower()] != version
    ]
    assert not wrong, "\n".join(wrong)


def test_the_version_check_reads_a_sentence_as_the_readme_writes_it():
    assert version_claims("Tested with torch 2.13.0, Ray 2.60.0 and tensordict 0.15.3. On torch 2.11.0+cu130") == [
        ("torch", "2.13.0"), ("Ray", "2.60.0"), ("tensordict", "0.15.3")]


def test_the_python_the_readme_names_is_one_the_project_accepts():
    from packaging.specifiers import SpecifierSet

    accepted = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    readme = Page.read("README.md")
    named = [(n, v) for n, line in enumerate(readme.lines, 1) for v in re.findall(r"\bPython (\d+\.\d+)\b", line)]
    assert named, "README.md names no Python version"
    wrong = [f"README.md:{n}: Python {v} is outside requires-python {accepted}" for n, v in named if v not in accepted]
    assert not wrong, "\n".join(wrong)


@cache
def registered_markers() -> set[str]:
    text = (ROOT / "tests" / "conftest.py").read_text()
    return set(re.findall(r'"markers",\s*"(\w+):', text)) | {"parametrize", "skipif", "skip", "xfail"}


def test_every_pytest_marker_the_pages_name_is_registered():
    wrong = [
        f"{page.where(page.line_of(m.start()))}: tests marked `{m.group(1)}`, a marker tests/conftest.py does not "
        f"register ({sorted(registered_markers())})"
        for page in pages() for m in re.finditer(r"marked\s+`(\w+)`", page.prose)
        if m.group(1) not in registered_markers()
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("name", "problem"), [
    ("hybridflow.serve.application:build", None),
    ("hybridflow.http.errors.STATUS_OF", None),
    ("single_controller.models.tutorial_workers:Accumulator", None),
    ("hybridflow.serve.application:nothing_here", "defines no 'nothing_here'"),
    ("hybridflow.nowhere", "hybridflow/__init__.py defines no 'nowhere'"),
    ("single_controller.weights.sync_weights", None),  # a name its package makes on first use
    ("single_controller.weights.sync_everything", "defines no 'sync_everything'"),
])
def test_the_name_check_tells_a_name_that_exists_from_one_that_does_not(name, problem):
    found = dotted_name_problem(name)
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_the_make_check_reads_the_forms_the_pages_use():
    page = Page("x.md", "a `make test-unit` / `test-ray` / `test-e2e` b `make bench BENCH_ARGS=--quick`\n"
                        "`make lint`, `make nothing`\n```bash\nmake serve    # note\n```\n")
    assert [(line, target) for line, target, _ in make_mentions(page)] == [
        (1, "test-unit"), (1, "test-ray"), (1, "test-e2e"), (1, "bench"), (2, "lint"), (2, "nothing"), (4, "serve")]
