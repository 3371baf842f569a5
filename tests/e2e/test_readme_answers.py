"""The README's tutorial over HTTP on the shipped service, as the README says to run it:
`make serve-fresh` (the session's ``service`` is `serve run serve_config.yaml` with fresh
state), wait for `/readyz`, then each curl line in order, copied as a user would (only
``localhost:8000`` replaced by the service's address), its answer compared with the one
the README shows under it (tests/readme_answers.py says how).

The answers are a fresh start's: the groups the tutorial changes are reset first where a
module before this one changed them (``POST /v1/admin/groups/{group}/reset``), so the
module passes in any order; it runs before every other module on the shipped service
(``fresh_start``, tests/e2e/conftest.py's order), where no reset is needed. It leaves the
groups as the tutorial leaves them: no module after it needs them fresh.
"""

from __future__ import annotations

import pytest

from tests.doc_pages import Page
from tests.readme_answers import changed_groups, journals, make_fresh, run, steps
from tests.serve_app import shipped_args

pytestmark = pytest.mark.fresh_start

SECTION = "The tutorial over HTTP"


@pytest.fixture(scope="module")
def tutorial(http):
    found = steps(Page.read("README.md"), SECTION)
    changed = changed_groups(found, shipped_args()["deployments"])
    assert changed, "the tutorial changes no group: nothing to reset"
    make_fresh(http, changed)
    return found, changed


def test_the_readme_tutorial_answers_what_the_readme_shows(service, http, tutorial):
    found, changed = tutorial
    before = journals(http, changed)
    assert all(n == 0 for n in before.values()), f"the groups the tutorial changes are not fresh: {before}"
    wrong = run(found, service.url.removeprefix("http://"))
    assert not wrong, f"{len(wrong)} of {len(found)} curl lines of README.md's {SECTION!r}:\n" + "\n".join(wrong)
