"""How the end-to-end check of the README's curl lines (tests/e2e/test_readme_answers.py)
reads them: every curl line of the tutorial's sections is found with the answer shown
under it, and the matcher accepts the service's answers in each form the README shows and
refuses a changed one."""

from __future__ import annotations

import json

import pytest

from tests.doc_pages import Page
from tests.readme_answers import mismatch, steps

SECTIONS = ("The tutorial over HTTP", "Serve your own worker group")


def tensors(*values: float) -> list[dict]:
    return [{"datatype": "FP32", "shape": [1], "data": [float(v)]} for v in values]


def answer(**fields) -> str:
    """A call's answer as the service writes it: compact JSON, its keys in its order."""
    body = {"group": "g", "method": "m", "dispatch_mode": "EXECUTE_ALL", "execute_mode": "ALL", "world_size": 4,
            "output": None, **fields}
    return json.dumps(body, separators=(",", ":"))


@pytest.mark.parametrize("section", SECTIONS)
def test_every_curl_line_of_the_sections_is_read_with_the_answer_shown_under_it(section):
    found = steps(Page.read("README.md"), section)
    assert len(found) >= 3, found
    unanswered = [f"README.md:{s.line}: {s.command!r} shows no answer (`#   ...` under it)" for s in found if not s.shown]
    assert not unanswered, "\n".join(unanswered)
    assert all("localhost:8000" in s.command for s in found)


def test_a_command_continued_over_lines_and_the_assignments_before_it_are_kept():
    page = Page("x.md", "## S\n\n```bash\nA=1\ncurl -s localhost:8000/x \\\n     -d '{}'\n#   {\"a\":1,\n"
                        "#    \"b\":2}\n# a remark\ncurl -s localhost:8000/y\n#   {...}\n```\n")
    first, second = steps(page, "S")
    assert first.command == "curl -s localhost:8000/x \\\n-d '{}'" and first.prelude == ["A=1"]
    assert first.shown == '{"a":1,"b":2}' and first.shown_line == 7
    assert first.script("127.0.0.1:5") == "A=1\ncurl -s 127.0.0.1:5/x \\\n-d '{}'"
    assert second.shown == "{...}" and second.line == 10


def test_an_answer_under_no_command_is_an_error():
    with pytest.raises(AssertionError, match="x.md:4: an answer under no curl command"):
        steps(Page("x.md", "## S\n```bash\n# a remark\n#   {\"a\":1}\n```\n"), "S")


@pytest.mark.parametrize(("shown", "body"), [
    ('{"group":"g","method":"m","dispatch_mode":"EXECUTE_ALL","execute_mode":"ALL","world_size":4,"output":null}',
     answer()),
    ("{...,\"output\":10}", answer(output=10)),
    ('{...,"execute_mode":"ALL",...,"output":5}', answer(output=5)),
    ('{"group":"g",...,"output":[{"datatype":"FP32","shape":[1],"data":[1.0]},{...[2.0]}]}', answer(output=tensors(1, 2))),
    ("2.0, 3.0, 4.0, 5.0", answer(output=tensors(2, 3, 4, 5))),
    ("3.0, 4.0, ..., 10.0 (8 ranks)", answer(world_size=8, output=tensors(*range(3, 11)))),
    ('"dispatch_mode":"ONE_TO_ALL", 10.0, 11.0, ..., 17.0', answer(dispatch_mode="ONE_TO_ALL", output=tensors(*range(10, 18)))),
    ('{"model_name":"c","outputs":[{"data":[6.5]}]}', '{"outputs":[{"data":[6.5]}],"model_name":"c"}'),  # parsed: any order
])
def test_the_matcher_accepts_the_answer_the_readme_shows(shown, body):
    assert mismatch(shown, body) is None


@pytest.mark.parametrize(("shown", "body", "why"), [
    ("{...,\"output\":10}", answer(output=11), "does not end with"),
    ('{...,"execute_mode":"RANK_ZERO",...,"output":5}', answer(output=5), '"execute_mode":"RANK_ZERO",\' is not in'),
    ('{"group":"h",...}', answer(), "does not begin with"),
    ("2.0, 3.0, 4.0, 5.0", answer(output=tensors(2, 3, 4, 6)), "the output's values are [2.0, 3.0, 4.0, 6.0]"),
    ("2.0, 3.0, 4.0, 5.0", answer(output=tensors(2, 3, 4, 5, 6)), "not '2.0, 3.0, 4.0, 5.0'"),
    ("3.0, 4.0, ..., 10.0 (8 ranks)", answer(output=tensors(*range(3, 11))), "world_size is 4, not 8"),
    ('"dispatch_mode":"ONE_TO_ALL", 10.0', answer(output=tensors(10)), "dispatch_mode is 'EXECUTE_ALL'"),
    ('{"model_name":"c","outputs":[{"data":[6.5]}]}', '{"model_name":"c","outputs":[{"data":[6.4]}]}', "the answer is"),
    ("{...,\"output\":10}", "Internal Server Error", "not JSON"),
    ("2.0, three", answer(output=tensors(2)), "'three' is no part"),
    ('{...,"output":true}', answer(output=1), "does not end with"),
])
def test_the_matcher_refuses_another_answer_and_says_why(shown, body, why):
    found = mismatch(shown, body)
    assert found is not None and why in found, found
