"""The README's and the docs' text as the tests that check their claims read it: headings,
tables, fenced code blocks, backtick spans and links, each with the line it is on, so a
failure names the file and line of the claim. Read afresh by every test, so the checks
follow the pages as they are edited."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The pages whose claims the tests check: the README, every page of docs/, and the
#: deployment guide the README links to.
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")), "deploy/README.md")

SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class Table:
    """A Markdown table: its header cells and rows of cells, each row with its line."""

    line: int
    header: list[str]
    rows: list[tuple[int, list[str]]]
    heading: str


@dataclass
class CodeBlock:
    line: int  # of the first line inside the fence
    language: str
    lines: list[str]
    heading: str


@dataclass
class Heading:
    line: int
    level: int
    text: str

    @property
    def slug(self) -> str:
        """GitHub's anchor of the heading."""
        text = self.text.replace("`", "").strip().lower()
        return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def split_cells(row: str) -> list[str]:
    """A table row's cells; a `|` inside a backtick span is text."""
    cells, current, in_code = [], [], False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    cells.append("".join(current).strip())
    return cells


def spans(text: str) -> list[str]:
    """The backtick spans of a piece of text (a table cell, a line)."""
    return [s.replace("\n", " ") for s in SPAN.findall(text)]


@dataclass
class Page:
    """One Markdown file of the repository, by its path relative to the root."""

    path: str
    text: str = field(repr=False)

    @classmethod
    def read(cls, path: str) -> Page:
        return cls(path, (ROOT / path).read_text())

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"

    @cached_property
    def _parsed(self) -> tuple[list[Heading], list[Table], list[CodeBlock], str]:
        headings: list[Heading] = []
        tables: list[Table] = []
        blocks: list[CodeBlock] = []
        prose: list[str] = []  # the text outside code blocks, code lines blanked (same line numbers)
        fence: CodeBlock | None = None
        table: Table | None = None
        heading = ""
        for number, line in enumerate(self.lines, start=1):
            stripped = line.strip()
            if fence is not None:
                if stripped.startswith("```"):
                    blocks.append(fence)
                    fence = None
                else:
                    fence.lines.append(line)
                prose.append("")
                continue
            if stripped.startswith("```"):
                fence = CodeBlock(number + 1, stripped[3:].strip(), [], heading)
                table = None
                prose.append("")
                continue
            prose.append(line)
            if stripped.startswith("|"):
                cells = split_cells(stripped)
                if table is None:
                    table = Table(number, cells, [], heading)
                    tables.append(table)
                elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
                    table.rows.append((number, cells))
                continue
            table = None
            found = re.match(r"(#{1,6})\s+(.*)", line)
            if found:
                headings.append(Heading(number, len(found.group(1)), found.group(2).strip()))
                heading = found.group(2).strip()
        return headings, tables, blocks, "\n".join(prose)

    @property
    def headings(self) -> list[Heading]:
        return self._parsed[0]

    @property
    def tables(self) -> list[Table]:
        return self._parsed[1]

    @property
    def code_blocks(self) -> list[CodeBlock]:
        return self._parsed[2]

    @property
    def prose(self) -> str:
        """The page outside its code blocks (their lines blank, so offsets keep their lines)."""
        return self._parsed[3]

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1

    def spans(self) -> Iterator[tuple[int, str]]:
        """Every backtick span outside code blocks, with its line (a span may wrap once)."""
        for found in SPAN.finditer(self.prose):
            yield self.line_of(found.start()), found.group(1).replace("\n", " ")

    def links(self) -> Iterator[tuple[int, str]]:
        for found in LINK.finditer(self.prose):
            yield self.line_of(found.start()), found.group(1)

    def section(self, title: str) -> tuple[int, int]:
        """The lines (first, last) under the heading ``title`` up to the next heading of
        its level or above."""
        for index, heading in enumerate(self.headings):
            if heading.text == title:
                end = next((h.line - 1 for h in self.headings[index + 1:] if h.level <= heading.level), len(self.lines))
                return heading.line, end
        raise AssertionError(f"{self.path} has no heading {title!r}: {[h.text for h in self.headings]}")


def pages() -> list[Page]:
    return [Page.read(path) for path in PAGES]
