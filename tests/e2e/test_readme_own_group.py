"""The README's "Serve your own worker group" curl lines, on a service with that section's
``counters`` deployment: the second application of the session's cluster
(tests/e2e/conftest.py) serves ``OWN_DEPLOYMENT``, the same ``Counter`` worker declared as
the README declares it (``init_kwargs: {start: 5}``, a pool of 2, ``read_only: [get,
scale]``, the ``scaler`` model). Each curl line runs as a user of that service would copy
it: ``localhost:8000`` replaced by the application's address under its route prefix
(``/second``), and its bearer token in the ``.curlrc``. Its answer is compared with the
one the README shows.

The answers are a fresh start's: this module runs first among those on the second
application (``fresh_start``), and resets the groups it changed afterwards.
"""

from __future__ import annotations

import pytest

from tests.doc_pages import Page
from tests.e2e.conftest import OWN_DEPLOYMENT, TOKEN
from tests.readme_answers import changed_groups, journals, reset, run, steps

pytestmark = pytest.mark.fresh_start

SECTION = "Serve your own worker group"


@pytest.fixture(scope="module")
def own_group(client):
    found = steps(Page.read("README.md"), SECTION)
    changed = changed_groups(found, [OWN_DEPLOYMENT])
    assert changed == ["counter"], changed
    yield found, changed
    reset(client, changed)


def test_the_readme_own_group_answers_what_the_readme_shows(limited, client, own_group):
    found, changed = own_group
    before = journals(client, changed)
    assert all(n == 0 for n in before.values()), (
        f"the README's answers are a fresh start's, but a module before this one changed {before}")
    wrong = run(found, limited.url.removeprefix("http://"), {"Authorization": f"Bearer {TOKEN}"})
    assert not wrong, f"{len(wrong)} of {len(found)} curl lines of README.md's {SECTION!r}:\n" + "\n".join(wrong)
