"""The Dockerfile is lint-clean under hadolint (it cannot be built on these machines)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_pins_its_base_image_and_serves_the_config():
    text = (ROOT / "Dockerfile").read_text()
    base = next(line for line in text.splitlines() if line.startswith("FROM"))
    assert ":" in base and "latest" not in base
    assert "serve_config.yaml" in text and "torch==2.13.0" in text
