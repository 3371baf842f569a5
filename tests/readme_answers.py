"""The README's curl lines and the answers it shows under them, read from a section's shell
blocks, and the matcher that compares an answer with what the README shows.

A block's lines: shell assignments (``J='Content-Type: application/json'``) that the
commands after them use; ``curl`` commands (continued over lines ending in ``\\``); under a
command, its answer as ``#   `` comment lines (a line indented further continues the one
before: the pieces join without a space); other comments are the README's own.

The commands run as a user would copy them (``run``): with ``curl`` in ``bash``, only
``localhost:8000`` replaced by the service's address, and the headers a user of that
service would keep in their ``.curlrc`` (a token).

An answer is shown in one of two forms:

- JSON, possibly with ``...`` for "anything here": without ``...`` both are parsed and must
  be equal; with it, the answer's bytes must read as the shown text with each ``...``
  standing for any run of characters (the service's JSON is compact, as shown);
- a part of the answer, items separated by ``, ``: ``"key":value`` (the answer's top-level
  key has that JSON value), numbers (the output's values in order, a tensor's data
  flattened; ``...`` stands for any run of them), and a closing ``(N ranks)`` (the answer's
  ``world_size``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.doc_pages import Page

ELLIPSIS = "..."


@dataclass
class Step:
    """One curl command of the README, with the assignments before it and its answer."""

    line: int
    command: str
    prelude: list[str]
    shown: str | None = None  # the answer the README shows, joined
    shown_line: int | None = None

    def script(self, address: str) -> str:
        """The lines to run in a shell, ``localhost:8000`` replaced by ``address``."""
        return "\n".join([*self.prelude, self.command.replace("localhost:8000", address)])


def steps(page: Page, section: str) -> list[Step]:
    """Every curl command of the section's shell blocks, in order."""
    first, last = page.section(section)
    found: list[Step] = []
    for block in page.code_blocks:
        if not first <= block.line <= last or block.language not in ("bash", "sh", "shell"):
            continue
        prelude: list[str] = []
        previous = ""  # what the line before was: "command", "continued", "answer" or ""
        for offset, raw in enumerate(block.lines):
            number, text = block.line + offset, raw.strip()
            answer = re.match(r"#( {3,})(.*)", text)
            if previous == "continued":
                found[-1].command += "\n" + text
                previous = "continued" if text.endswith("\\") else "command"
            elif text.startswith("curl "):
                found.append(Step(number, text, list(prelude)))
                previous = "continued" if text.endswith("\\") else "command"
            elif answer and previous == "command":
                found[-1].shown, found[-1].shown_line = answer.group(2).strip(), number
                previous = "answer"
            elif answer and previous == "answer" and len(answer.group(1)) > 3:
                found[-1].shown += answer.group(2).strip()  # continues the line before
            elif answer:
                raise AssertionError(f"{page.where(number)}: an answer under no curl command: {text!r}")
            else:
                if text and not text.startswith("#"):
                    prelude.append(text)
                previous = ""
    return found


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ELLIPSIS  # not JSON: no value can equal it


def _glob(pattern: list[Any], values: list[Any]) -> bool:
    """Whether ``values`` match ``pattern``, whose ELLIPSIS items match any run of values."""
    if not pattern:
        return not values
    if pattern[0] == ELLIPSIS:
        return any(_glob(pattern[1:], values[cut:]) for cut in range(len(values) + 1))
    return bool(values) and _same(pattern[0], values[0]) and _glob(pattern[1:], values[1:])


def _same(shown: Any, value: Any) -> bool:
    """Equal JSON values; a number equals a number of the other kind (10 and 10.0), never a
    boolean."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (shown, value))
    return (numbers or type(shown) is type(value)) and shown == value


def output_values(output: Any) -> list[Any]:
    """An output's values in order: a tensor object's data, a list's items flattened."""
    if isinstance(output, dict) and {"datatype", "shape", "data"} <= set(output):
        return list(output["data"])
    if isinstance(output, list):
        return [v for item in output for v in output_values(item)]
    return [output]


def _items(text: str) -> list[str]:
    """A part-answer's items: split at ``, `` outside quotes and brackets."""
    items, depth, quoted, current = [], 0, False, ""
    for index, char in enumerate(text):
        quoted ^= char == '"'
        depth += 0 if quoted else (char in "[{(") - (char in "]})")
        if char == "," and depth == 0 and not quoted and text[index + 1:index + 2] == " ":
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [*items, current.strip()]


def mismatch(shown: str, body: str) -> str | None:
    """Why ``body`` is not the answer ``shown``; None when it is."""
    answer = _json(body)
    if answer == ELLIPSIS:
        return f"the answer is not JSON: {body[:300]!r}"
    if shown.startswith(("{", "[")):
        if ELLIPSIS not in shown:
            expected = _json(shown)
            if expected == ELLIPSIS:
                return f"the README's answer is not JSON: {shown!r}"
            return None if expected == answer else f"the answer is {body.strip()!r}"
        return _text_mismatch(shown, body.strip())
    return _part_mismatch(shown, answer)


def _text_mismatch(shown: str, body: str) -> str | None:
    pieces = shown.split(ELLIPSIS)
    if not body.startswith(pieces[0]):
        return f"the answer does not begin with {pieces[0]!r}: {body!r}"
    at = len(pieces[0])
    for piece in pieces[1:-1]:
        found = body.find(piece, at)
        if found < 0:
            return f"{piece!r} is not in the answer after {body[:at]!r}: {body!r}"
        at = found + len(piece)
    if len(pieces) > 1 and not (body.endswith(pieces[-1]) and len(body) - len(pieces[-1]) >= at):
        return f"the answer does not end with {pieces[-1]!r} after {body[:at]!r}: {body!r}"
    return None


def _part_mismatch(shown: str, answer: Any) -> str | None:
    if not isinstance(answer, dict):
        return f"the answer is not an object: {answer!r}"
    items = _items(shown)
    wrong = []
    if ranks := re.fullmatch(r"(.*) \((\d+) ranks\)", items[-1]):
        items[-1] = ranks.group(1)
        if answer.get("world_size") != int(ranks.group(2)):
            wrong.append(f"world_size is {answer.get('world_size')!r}, not {ranks.group(2)}")
    values: list[Any] = []
    for item in items:
        if item == ELLIPSIS:
            values.append(ELLIPSIS)
        elif pair := re.fullmatch(r'"(\w+)":(.+)', item):
            expected = _json(pair.group(2))
            if expected == ELLIPSIS or answer.get(pair.group(1), ELLIPSIS) != expected:
                wrong.append(f"{pair.group(1)} is {answer.get(pair.group(1), '<absent>')!r}, not {pair.group(2)}")
        elif isinstance(_json(item), (int, float)) and not isinstance(_json(item), bool):
            values.append(_json(item))
        else:
            wrong.append(f"{item!r} is no part of an answer the test reads")
    if values and not _glob(values, output_values(answer.get("output"))):
        wrong.append(f"the output's values are {output_values(answer.get('output'))}, not {shown!r}")
    return "; ".join(wrong) or None


# -- running them ----------------------------------------------------------------------
def run(found: list[Step], address: str, headers: dict[str, str] | None = None) -> list[str]:
    """Run the commands in order against ``address`` (``127.0.0.1:8000/prefix``), each
    with the assignments before it and ``headers`` from a ``.curlrc`` of its own (nothing
    of the user's); what differs from the README, each naming its lines."""
    wrong = []
    with tempfile.TemporaryDirectory() as home:
        Path(home, ".curlrc").write_text("".join(f'header = "{k}: {v}"\n' for k, v in (headers or {}).items()))
        env = {**os.environ, "CURL_HOME": home, "XDG_CONFIG_HOME": home}
        for step in found:
            done = subprocess.run(["bash", "-c", step.script(address)], capture_output=True, text=True, env=env,
                                  timeout=600)
            where = f"README.md:{step.line}: {step.command!r}"
            if done.returncode != 0:
                wrong.append(f"{where} exited {done.returncode}: {done.stderr.strip()[-500:]}")
            elif step.shown is not None and (why := mismatch(step.shown, done.stdout)):
                wrong.append(f"{where}\n  answered  {done.stdout.strip()[:1000]}\n"
                             f"  README.md:{step.shown_line} shows {step.shown}\n  {why}")
    return wrong


def changed_groups(found: list[Step], deployments: list[dict[str, Any]]) -> list[str]:
    """The groups the commands change: a group method or a model's method not declared
    read-only."""
    groups = {g["name"]: g for d in deployments for g in d["groups"]}
    models = {m["name"]: m for d in deployments for m in d.get("models", [])}
    changed: list[str] = []
    for step in found:
        if call := re.search(r"/v1/groups/([\w-]+)/([\w-]+)", step.command):
            group, method = call.groups()
        elif infer := re.search(r"/v2/models/([\w-]+)/infer", step.command):
            group, method = models[infer.group(1)]["group"], models[infer.group(1)]["method"]
        else:
            continue
        if method not in groups[group].get("read_only", []) and group not in changed:
            changed.append(group)
    return changed


def journals(client: httpx.Client, groups: list[str]) -> dict[str, int]:
    return {group: client.get(f"/v1/groups/{group}").json()["journal_length"] for group in groups}


def make_fresh(client: httpx.Client, groups: list[str]) -> None:
    """The groups as a fresh start leaves them: those with calls journaled are reset
    (:func:`reset`), the others are left as they are."""
    changed = [group for group, length in journals(client, groups).items() if length]
    if changed:
        reset(client, changed)


def reset(client: httpx.Client, groups: list[str], timeout_s: float = 600) -> dict[str, dict[str, Any]]:
    """``POST /v1/admin/groups/{group}/reset`` for each group, then wait until each is ready
    again with nothing journaled, as a fresh start leaves it; their details."""
    for group in groups:
        answer = client.post(f"/v1/admin/groups/{group}/reset")
        assert answer.status_code == 202, answer.text
    deadline = time.monotonic() + timeout_s
    details: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        details = {group: client.get(f"/v1/groups/{group}").json() for group in groups}
        if all(d["status"] == "ready" and d["journal_length"] == 0 for d in details.values()):
            return details
        time.sleep(1)
    raise AssertionError(f"the reset groups were not ready and fresh within {timeout_s:g} s: "
                         f"{ {g: (d['status'], d['journal_length'], d['last_error']) for g, d in details.items()} }")
