"""The client distribution's own tests against a live service
(``hybridflow-client/tests/test_service.py``: the tutorial's numbers through the blocking
and async clients and the CLI), run against the session's service as a user would run
them against theirs, with ``HYBRIDFLOW_URL``. The rest of the client's tests need no
service and run in the unit layer."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.serve_process import ROOT


def test_the_clients_service_tests_pass_against_the_service(service, http):
    env = {**os.environ, "HYBRIDFLOW_URL": service.url}
    env.pop("HYBRIDFLOW_TOKEN", None)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_service.py"],
                           cwd=ROOT / "hybridflow-client", env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "HYBRIDFLOW_URL is not set" not in tests.stdout, tests.stdout[-2000:]
