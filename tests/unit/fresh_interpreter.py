"""Running a snippet in a new interpreter, for checks of what an import loads."""

from __future__ import annotations

import subprocess
import sys


def assert_fresh_python_prints_ok(code: str) -> None:
    """Runs ``code`` in a new interpreter (nothing imported yet) and expects it to print ok."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
