"""docs/configuration.md's and docs/limits.md's tables against the config's models
(``hybridflow/config/``): every field of every model reachable from ``ServiceConfig`` has
a row in the table under its heading (``## The service``, ``### `state```, ``##
Deployments``, ...; a small model without a table is listed in its parent's row as
``{a, b, c}``), with the same default; no row names a field the config lacks; every value
a field's ``Literal`` accepts is named in its row; and each bound of limits.md that names
a field states that field's default. Sizes are read as the pages write them: ``1 GiB``,
``256 MiB``, ``1,048,576``, ``2^40``, ``null``, `` `auto` ``, `` `[]` ``. A default said
in words (``see below``, ``the service's``) stands for a field whose default is null (it
falls back to something else) or a nested model (whose own table is checked)."""

from __future__ import annotations

import ipaddress
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hybridflow.config.service import ServiceConfig
from tests.doc_pages import Page, Table, spans

SIZES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
#: What a default cell says when it is not a value.
REQUIRED, WORDS, EMPTY = "<required>", "<words>", "<empty>"


def documented_value(text: str) -> Any:
    """A default cell's value: a number, a size, a literal or a backticked JSON value or
    name; REQUIRED, EMPTY, or WORDS for a default said in words."""
    text = text.strip()
    if not text:
        return EMPTY
    if text == "required":
        return REQUIRED
    if found := re.fullmatch(r"`([^`]*)`", text):
        try:
            return json.loads(found.group(1))
        except ValueError:
            pass
        if found.group(1).startswith("{"):  # a YAML flow mapping: a nested model's fields
            return yaml.safe_load(found.group(1))
        return found.group(1)
    if text in ("null", "true", "false"):
        return json.loads(text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+|-?\d+", text):
        return int(text.replace(",", ""))
    if re.fullmatch(r"-?\d+\.\d+", text):
        return float(text)
    if found := re.fullmatch(r"(\d+) (KiB|MiB|GiB|TiB)", text):
        return int(found.group(1)) * SIZES[found.group(2)]
    if found := re.fullmatch(r"(\d+)\^(\d+)", text):
        return int(found.group(1)) ** int(found.group(2))
    return WORDS


def split_defaults(text: str, count: int) -> list[str]:
    """A cell holding the defaults of ``count`` fields (``100, 1 GiB``, `` `[]`, `{}` ``):
    split at the commas outside backticks and brackets followed by a space; one default for
    all when it does not split in as many."""
    parts, depth, in_code, current = [], 0, False, ""
    for index, char in enumerate(text):
        in_code ^= char == "`"
        depth += (char in "[{(") - (char in "]})") if not in_code else 0
        if char == "," and not in_code and depth == 0 and text[index + 1:index + 2] == " ":
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts] if count > 1 and len(parts) == count else [text] * count


def plain(value: Any) -> Any:
    """A config default as the page would write it."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return str(value)
    return value


def default_problem(field: FieldInfo, written: str) -> str | None:
    """Why the page's default ``written`` is not the field's; None when it is."""
    value = documented_value(written)
    if field.is_required():
        return None if value == REQUIRED else f"the page says {written!r}, but the field is required"
    default = field.get_default(call_default_factory=True)
    if value == REQUIRED:
        return f"the page says required, but the default is {plain(default)!r}"
    if isinstance(value, str) and value in (WORDS, EMPTY):
        if default is None or isinstance(default, BaseModel):
            return None
        return f"the page says {written!r} in words, but the default is {plain(default)!r}"
    same = type(value) is bool if isinstance(default, bool) else not isinstance(value, bool) and plain(default) == value
    return None if same else f"the page says {written!r} ({value!r}), but the default is {plain(default)!r}"


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in nested_models(arg)]


def literal_values(annotation: Any) -> list[str]:
    if typing.get_origin(annotation) is Literal:
        return [v for v in typing.get_args(annotation) if isinstance(v, str)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return [v for arg in typing.get_args(annotation) for v in literal_values(arg)]
    return []


@dataclass
class Documented:
    """A model of the config and where configuration.md documents it."""

    model: type[BaseModel]
    path: str  # where it sits in args, for messages: "args", "args.state", "args.deployments[].groups[]"
    heading: str | None  # the heading over its table; None: listed in its parent's row
    parent_row: str = ""


def documented_models() -> Iterator[Documented]:
    """Every model reachable from ServiceConfig, with the heading its table must sit under:
    the field's name in backticks (`` `state` ``), or the field's name capitalised for a
    list of them (``Groups``)."""
    page = Page.read("docs/configuration.md")
    headings = {h.text for h in page.headings}
    seen: set[type[BaseModel]] = set()
    queue = [Documented(ServiceConfig, "args", "The service")]
    while queue:
        item = queue.pop(0)
        if item.model in seen:
            continue
        seen.add(item.model)
        yield item
        for name, field in item.model.model_fields.items():
            for nested in nested_models(field.annotation):
                where = f"{item.path}.{name}" + ("[]" if typing.get_origin(field.annotation) is list else "")
                heading = next((h for h in (f"`{name}`", name.capitalize()) if h in headings), None)
                queue.append(Documented(nested, where, heading, name))


def field_table(page: Page, heading: str) -> Table:
    tables = [t for t in page.tables if t.heading == heading and t.header[0] == "field"]
    assert tables, f"{page.path}: no table of fields under the heading {heading!r}"
    return tables[0]


def table_rows(page: Page, table: Table) -> Iterator[tuple[int, list[str], dict[str, str]]]:
    """Each row's line, the fields its first cell names, and its cells by header."""
    for line, cells in table.rows:
        yield line, spans(cells[0]), dict(zip(table.header, cells, strict=False))


def row_of(page: Page, table: Table, field: str) -> tuple[int, dict[str, str]] | None:
    return next(((line, cells) for line, names, cells in table_rows(page, table) if field in names), None)


def test_every_model_of_the_config_has_its_table_or_its_fields_in_its_parents_row():
    page = Page.read("docs/configuration.md")
    wrong = []
    models = list(documented_models())
    by_model = {item.model: item for item in models}
    for item in models:
        if item.heading is not None:
            continue
        parent = next(p for p in models if item.parent_row in p.model.model_fields and p.heading)
        found = row_of(page, field_table(page, parent.heading), item.parent_row)
        listed = re.findall(r"\{([\w, ]+)\}", " ".join(found[1].values())) if found else []
        fields = set(item.model.model_fields)
        if not any({n.strip() for n in names.split(",")} == fields for names in listed):
            wrong.append(f"{item.path} ({item.model.__name__}) has no table in {page.path} (no heading "
                         f"`{item.parent_row}`) and its parent's row does not list its fields as "
                         f"{{{', '.join(fields)}}}: {listed}")
    assert by_model[ServiceConfig].heading == "The service"
    assert not wrong, "\n".join(wrong)


def test_every_field_is_documented_with_its_default_and_nothing_else_is():
    page = Page.read("docs/configuration.md")
    wrong = []
    checked = 0
    for item in documented_models():
        if item.heading is None:
            continue
        table = field_table(page, item.heading)
        fields = item.model.model_fields
        documented: set[str] = set()
        for line, names, cells in table_rows(page, table):
            for name, written in zip(names, split_defaults(cells.get("default", ""), len(names)), strict=True):
                documented.add(name)
                if name not in fields:
                    wrong.append(f"{page.where(line)}: `{name}` under {item.heading!r}: {item.model.__name__} "
                                 f"({item.path}) has no such field")
                elif problem := default_problem(fields[name], written):
                    wrong.append(f"{page.where(line)}: {item.path}.{name}: {problem}")
                else:
                    checked += 1
        wrong += [f"{page.path}:{table.line}: {item.path}.{name} ({item.model.__name__}) has no row in the table "
                  f"under {item.heading!r}" for name in fields if name not in documented]
    assert not wrong, "\n".join(wrong)
    assert checked >= 60, checked  # the tables were read, not skipped


def test_every_value_a_field_accepts_is_named_in_its_row():
    page = Page.read("docs/configuration.md")
    wrong = []
    models = list(documented_models())
    for item in models:
        # a model without a table of its own is described in its parent's row
        owner = item if item.heading else next(p for p in models if item.parent_row in p.model.model_fields and p.heading)
        row_name = None if item.heading else item.parent_row
        for name, field in item.model.model_fields.items():
            values = literal_values(field.annotation)
            found = row_of(page, field_table(page, owner.heading), row_name or name) if values else None
            if values and found is None:
                continue  # the row's absence is the test above's
            text = " ".join(found[1].values()) if found else ""
            missing = [v for v in values if f"`{v}`" not in text]
            if missing:
                wrong.append(f"{page.where(found[0])}: {item.path}.{name} accepts {values}; the row does not name "
                             f"{missing}")
    assert not wrong, "\n".join(wrong)


def config_field(path: str) -> FieldInfo | None:
    """The field at a dotted path from args (``limits.max_tensors``, ``state.weights_kept``)."""
    model: type[BaseModel] = ServiceConfig
    *parents, last = path.split(".")
    for part in parents:
        field = model.model_fields.get(part)
        nested = nested_models(field.annotation) if field else []
        if not nested:
            return None
        model = nested[0]
    return model.model_fields.get(last)


def test_every_bound_of_the_limits_page_that_names_a_field_states_its_default():
    page = Page.read("docs/limits.md")
    wrong = []
    checked = 0
    for table in page.tables:
        if "field" not in table.header or "default" not in table.header:
            continue
        for line, cells in table.rows:
            row = dict(zip(table.header, cells, strict=False))
            names = spans(row["field"])
            for name, written in zip(names, split_defaults(row["default"], len(names)), strict=True):
                field = config_field(name)
                if field is None:
                    wrong.append(f"{page.where(line)}: `{name}` is no field of the config")
                elif problem := default_problem(field, written):
                    wrong.append(f"{page.where(line)}: {name}: {problem}")
                else:
                    checked += 1
    assert not wrong, "\n".join(wrong)
    assert checked >= 20, checked


def test_every_field_the_pages_name_with_its_section_exists():
    wrong = []
    for path in ("README.md", "docs/configuration.md", "docs/limits.md", "docs/http-api.md", "docs/state.md",
                 "docs/operations.md", "docs/weight-sync.md", "docs/grpc.md"):
        page = Page.read(path)
        for found in re.finditer(r"(?<![\w/.-])((?:limits|state)\.(?!md\b|py\b|db\b)[a-z_]+)\b", page.text):
            if config_field(found.group(1)) is None:
                line = page.text.count("\n", 0, found.start()) + 1
                wrong.append(f"{page.where(line)}: {found.group(1)} is no field of the config")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("written", "value"), [
    ("1 GiB", 1 << 30), ("256 MiB", 256 << 20), ("1,048,576", 1048576), ("2^40", 1 << 40), ("null", None),
    ("`auto`", "auto"), ("`[]`", []), ("0.05", 0.05), ("false", False), ("`.hybridflow/state.db`", ".hybridflow/state.db"),
    ('`["127.0.0.1/32", "::1/128"]`', ["127.0.0.1/32", "::1/128"]), ("required", REQUIRED), ("see below", WORDS),
    ("", EMPTY),
])
def test_a_default_is_read_as_the_pages_write_it(written, value):
    assert documented_value(written) == value


def test_a_wrong_default_is_told_from_a_right_one():
    fields = ServiceConfig.model_fields
    assert default_problem(fields["max_body_bytes"], "1 GiB") is None
    assert "default is 1073741824" in default_problem(fields["max_body_bytes"], "256 MiB")
    assert default_problem(fields["request_timeout_s"], "120") is None  # 120.0
    assert "default is False" in default_problem(ServiceConfig.model_fields["state"].annotation.model_fields["fresh"], "0")
    assert "required" in default_problem(fields["deployments"], "`[]`")
    assert split_defaults("100, 1 GiB", 2) == ["100", "1 GiB"] and split_defaults("1,048,576", 1) == ["1,048,576"]
    assert split_defaults('`["a", "b"]`', 1) == ['`["a", "b"]`'] and split_defaults("`[]`, `{}`", 2) == ["`[]`", "`{}`"]
