"""docs/http-api.md's statuses against the routes. The rule, both ways:

- what a route can answer is declared: every status the route's own code raises as
  ``ApiError(<status>, ...)`` (its endpoint, its dependencies and the route helpers they
  call by name) is in its ``responses=`` (read from the app's OpenAPI schema, built over a
  stand-in backend), and a route that unwraps a backend answer (``found(...)``) declares
  503 and 504: a controller or jobs replica that is restarting, or that does not answer in
  time (``hybridflow/serve/backend.py``'s ``within_deadline``);
- what a route declares is documented: the page's table of errors by route lists exactly
  the error statuses (4xx, 5xx) each route of the schema declares (FastAPI's automatic 422
  for parameters counts only where a parameter is not a plain string, so that it can
  fail); its successes are in the route tables and the text;
- what the page says a route answers is declared: every status a row of the page's route
  tables names is declared by each route of the row;
- the conventions table holds exactly the error statuses the service answers: those the
  routes declare, ``STATUS_OF``'s, and 500 (``install_error_handlers``' answer to a fault);
- every route of the app, in the schema or not (the pages, login), is named in the page.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from http import HTTPStatus
from pathlib import Path

from fastapi.routing import iter_route_contexts

from hybridflow.http.app import create_app
from hybridflow.http.errors import STATUS_OF
from tests.doc_pages import ROOT, Page, Table, spans

PAGE = "docs/http-api.md"
#: A route helper that unwraps a backend's answer, and what a backend behind Serve adds.
UNWRAPS_BACKEND = "found"
BACKEND_STATUSES = {503: "a replica restarting", 504: "a replica not answering in time"}
#: What the error handler answers to an exception no route expected.
FAULT = 500
HTTP_SOURCES = [*sorted((ROOT / "hybridflow/http").glob("*.py")), *sorted((ROOT / "hybridflow/http/routes").glob("*.py"))]


@cache
def app_schema() -> tuple[list[tuple[str, str, list[str], bool]], dict]:
    """Each route as (method, path, the names of its endpoint and dependencies, in the
    schema), and the OpenAPI schema; over a stand-in backend, which building the schema
    never calls."""
    app = create_app(object(), {})
    routes = [
        (method, route.path, [route.endpoint.__name__, *(d.dependency.__name__ for d in route.dependencies)],
         route.include_in_schema)
        for route in iter_route_contexts(app.routes) for method in sorted(route.methods or ())
    ]
    return routes, app.openapi()


def declared(method: str, path: str) -> set[int]:
    operation = app_schema()[1]["paths"][path][method.lower()]
    statuses = {int(code) for code in operation["responses"]}
    automatic = operation["responses"].get("422", {}).get("description") == "Validation Error"
    if automatic and all(p.get("schema", {}).get("type") == "string" for p in operation.get("parameters", [])):
        statuses.discard(422)  # FastAPI's, for parameters that cannot fail to parse
    return statuses


@cache
def functions() -> dict[str, list[tuple[str, ast.AST]]]:
    found: dict[str, list[tuple[str, ast.AST]]] = {}
    for path in HTTP_SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append((str(path.relative_to(ROOT)), node))
    return found


def _only_for_other_methods(test: ast.AST, method: str) -> bool:
    """Whether a branch's test requires ``request.method == "<another method>"`` (alone or
    with ``and``)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_only_for_other_methods(value, method) for value in test.values)
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and test.left.attr == "method"
            and all(isinstance(op, ast.Eq) for op in test.ops)
            and any(isinstance(c, ast.Constant) and c.value != method for c in test.comparators))


def raised(name: str, method: str, seen: set[str] | None = None) -> dict[int, str]:
    """The statuses function ``name`` answers by itself or through the route helpers it
    calls by name, each with where: ``ApiError(<literal>, ...)`` (a literal anywhere in the
    status expression, as in ``job["status_code"] or 410``), and the backend's statuses
    where it unwraps a backend answer. A branch only for another HTTP method is skipped."""
    seen = {name} if seen is None else seen
    statuses: dict[int, str] = {}

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.If) and _only_for_other_methods(node.test, method):
            for child in node.orelse:
                visit(child, where)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called = node.func.id
            if called == "ApiError" and node.args:
                for leaf in ast.walk(node.args[0]):
                    if isinstance(leaf, ast.Constant) and type(leaf.value) is int:
                        statuses.setdefault(leaf.value, f"ApiError({leaf.value}) at {where}:{node.lineno}")
            elif called == UNWRAPS_BACKEND:
                for status, why in BACKEND_STATUSES.items():
                    statuses.setdefault(status, f"{UNWRAPS_BACKEND}() at {where}:{node.lineno} ({why})")
            elif called in functions() and called not in seen:
                seen.add(called)
                for status, why in raised(called, method, seen).items():
                    statuses.setdefault(status, why)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    for where, node in functions().get(name, []):
        for statement in node.body:
            visit(statement, where)
    return statuses


# -- the page ---------------------------------------------------------------------------
def route_names(cell: str) -> list[tuple[str, str]]:
    """The routes a table cell names: `GET /a`, `/b` (the method before), `.../c` (the
    path before with its last segment replaced); `[?query]` suffixes dropped."""
    named: list[tuple[str, str]] = []
    method = ""
    for span in spans(cell):
        found = re.fullmatch(r"(?:(GET|POST|PUT|DELETE|PATCH) )?(\S+?)(?:\[\?[^\]]*\])?", span.strip())
        if not found or not found.group(2).startswith(("/", ".../")):
            continue
        method = found.group(1) or method
        path = found.group(2)
        if path.startswith(".../") and named:
            path = named[-1][1].rsplit("/", 1)[0] + path[3:]
        named.append((method, path))
    return named


def statuses_in(text: str) -> set[int]:
    numbers = re.findall(r"(?<![\w./-])([1-5]\d\d)(?![\w./-]|\s*(?:KiB|MiB|GiB|ms|s\b|bytes|values))", text)
    return {int(n) for n in numbers if int(n) in HTTPStatus._value2member_map_}


def matching_route(method: str, documented: str) -> tuple[str, str] | None:
    """The app's route a documented ``METHOD /path`` is: its parameters may be named
    otherwise (`{id}` for `{job_id}`) or given a value (`versions/1`); a literal segment
    wins over a parameter (`/v2/models/stats`)."""
    path = re.sub(r"\{[^}]*\}", "{}", documented)
    candidates = []
    for route_method, route_path, _, _ in app_schema()[0]:
        pattern = "".join("[^/]+" if part.startswith("{") else re.escape(part)
                          for part in re.split(r"(\{[^}]*\})", route_path))
        if route_method == method and (re.fullmatch(pattern, path) or re.sub(r"\{[^}]*\}", "{}", route_path) == path):
            candidates.append((route_path.count("{"), route_path))
    return (method, min(candidates)[1]) if candidates else None


def tables(page: Page, first: str, second: str | None = None) -> list[Table]:
    return [t for t in page.tables if t.header[0] == first and (second is None or t.header[1:2] == [second])]


def errors_table(page: Page) -> Table:
    found = tables(page, "route", "errors")
    assert len(found) == 1, f"{PAGE} needs one table of errors by route (| route | errors |), found {len(found)}"
    return found[0]


def declared_errors(method: str, path: str) -> set[int]:
    return {status for status in declared(method, path) if status >= 400}


# -- the checks -------------------------------------------------------------------------
def test_every_status_a_route_raises_is_declared():
    routes, _ = app_schema()
    wrong = []
    for method, path, names, in_schema in routes:
        if not in_schema:
            continue
        answers: dict[int, str] = {}
        for name in names:
            for status, why in raised(name, method).items():
                answers.setdefault(status, why)
        wrong += [f"{method} {path} answers {status} ({why}), but its responses= do not declare it"
                  for status, why in sorted(answers.items()) if status not in declared(method, path)]
    assert not wrong, "\n".join(wrong)


def test_the_table_of_errors_lists_exactly_what_each_route_declares():
    page = Page.read(PAGE)
    table = errors_table(page)
    wrong = []
    listed: dict[tuple[str, str], int] = {}
    for line, cells in table.rows:
        named = route_names(cells[0])
        if not named:
            wrong.append(f"{page.where(line)}: the row names no route: {cells[0]!r}")
        for method, documented in named:
            route = matching_route(method, documented)
            if route is None or route not in {(m, p) for m, p, _, s in app_schema()[0] if s}:
                wrong.append(f"{page.where(line)}: {method} {documented} is no route of the schema")
                continue
            listed[route] = line
            says, declares = statuses_in(cells[1]), declared_errors(*route)
            wrong += [f"{page.where(line)}: {method} {documented}: the page lists {s}, which the route does not "
                      f"declare" for s in sorted(says - declares)]
            wrong += [f"{page.where(line)}: {method} {documented}: the route declares {s}, which the page does not "
                      f"list" for s in sorted(declares - says)]
    wrong += [f"{page.path}:{table.line}: {method} {path} (declares {sorted(declared_errors(method, path))}) has no row"
              for method, path, _, in_schema in app_schema()[0] if in_schema and (method, path) not in listed]
    assert not wrong, "\n".join(wrong)


def test_every_status_a_route_table_names_is_declared_by_its_routes():
    page = Page.read(PAGE)
    wrong = []
    checked = 0
    for table in tables(page, "route"):
        if table.header[1:2] == ["errors"]:
            continue
        for line, cells in table.rows:
            for method, documented in route_names(cells[0]):
                route = matching_route(method, documented)
                if route is None:
                    wrong.append(f"{page.where(line)}: {method} {documented} is no route of the app")
                    continue
                if not any(s for m, p, _, s in app_schema()[0] if (m, p) == route):
                    continue  # a page outside the schema: it declares nothing
                for status in sorted(statuses_in(" ".join(cells[1:]))):
                    checked += 1
                    if status not in declared(*route):
                        wrong.append(f"{page.where(line)}: the row says {method} {documented} answers {status}, "
                                     f"but the route declares {sorted(declared(*route))}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 8, checked


def test_the_conventions_table_holds_exactly_the_error_statuses_the_service_answers():
    page = Page.read(PAGE)
    (table,) = tables(page, "status", "when")
    documented = {int(cells[0]): line for line, cells in table.rows}
    answered: dict[int, str] = {status: "STATUS_OF (hybridflow/http/errors.py)" for status in STATUS_OF.values()}
    answered.setdefault(FAULT, "install_error_handlers' answer to an unexpected error")
    for method, path, _, in_schema in app_schema()[0]:
        for status in declared(method, path) if in_schema else ():
            if status >= 400:
                answered.setdefault(status, f"declared by {method} {path}")
    wrong = [f"{page.path}:{table.line}: {status} ({why}) has no row" for status, why in sorted(answered.items())
             if status not in documented]
    wrong += [f"{page.where(line)}: {status} is answered by no route and is not in STATUS_OF"
              for status, line in sorted(documented.items()) if status not in answered]
    assert not wrong, "\n".join(wrong)


def test_every_route_of_the_app_is_named_in_the_page():
    page = Page.read(PAGE)
    named = {matching_route(m, p) for table in tables(page, "route") for _, cells in table.rows
             for m, p in route_names(cells[0])}
    named |= {matching_route(m, p) for _, span in page.spans() for m, p in route_names(f"`{span}`") if m}
    missing = [f"{method} {path}" for method, path, _, _ in app_schema()[0] if (method, path) not in named]
    assert not missing, f"{PAGE} names no route {missing}"


# -- the checks' own parts ---------------------------------------------------------------
def test_the_route_names_of_a_cell_are_read_as_the_page_writes_them():
    cell = "`GET /v2/models/stats`, `/v2/models/{model}/stats`, `POST /v2/repository/models/{model}/load`, `.../unload`"
    assert route_names(cell) == [("GET", "/v2/models/stats"), ("GET", "/v2/models/{model}/stats"),
                                 ("POST", "/v2/repository/models/{model}/load"),
                                 ("POST", "/v2/repository/models/{model}/unload")]
    assert route_names("`POST /v1/jobs/{group}/{method}[?split=N]`") == [("POST", "/v1/jobs/{group}/{method}")]
    assert matching_route("GET", "/v2/models/stats") == ("GET", "/v2/models/stats")
    assert matching_route("GET", "/v1/jobs/{id}") == ("GET", "/v1/jobs/{job_id}")
    assert matching_route("GET", "/v2/models/{model}/versions/1/stats") == (
        "GET", "/v2/models/{model}/versions/{version}/stats")
    assert statuses_in("200 when ready, else 503; 4096 bytes, 256 MiB, `Retry-After: 5`, 0..1, 410") == {200, 503, 410}


def test_the_derivation_finds_a_literal_status_a_helper_and_a_branch_for_another_method():
    assert set(raised("job_result", "GET")) >= {404, 409, 410, 503, 504}  # via _job, found() and `or 410`
    assert 415 in raised("require_token", "POST") and 415 not in raised("require_token", "GET")
    assert raised("healthz", "GET") == {}
    assert Path(ROOT / PAGE).is_file()
