"""The Dockerfile, read without Docker: lint-clean under hadolint, and what it promises a
user (the build args, torch first from its own index, a venv, a non-root final stage).
`make image-test` builds and runs it for real (tests/docker)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    # The image's Dockerfile and the GPU variant's CUDA base.
    for dockerfile in (ROOT / "Dockerfile", ROOT / "deploy" / "cuda-base.Dockerfile"):
        result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{dockerfile.name}: {result.stdout}{result.stderr}"


def test_exactly_two_build_args_with_pinned_defaults():
    args = dict(rest.split("=", 1) for keyword, rest in instructions() if keyword == "ARG")
    assert args == {
        "BASE_IMAGE": "python:3.11-slim-bookworm",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
    }


def test_multi_stage_from_the_base_image_arg():
    froms = [rest for keyword, rest in instructions() if keyword == "FROM"]
    assert len(froms) >= 2
    assert froms[0].startswith("${BASE_IMAGE}") and froms[-1] == "${BASE_IMAGE}"


def test_torch_alone_from_its_index_into_a_venv_before_anything_else():
    runs = [rest for keyword, rest in instructions() if keyword == "RUN"]
    installs = [run for run in runs if "pip install" in run]
    assert "python3 -m venv /opt/venv" in runs[0]
    first = installs[0]
    assert '--index-url "${TORCH_INDEX_URL}"' in first and "torch==2.13.0" in first and "--no-deps" in first
    assert "-r" not in first.split() and " . " not in first
    assert all("TORCH_INDEX_URL" not in run for run in installs[1:])


def test_final_stage_runs_serve_as_a_numeric_non_root_user():
    final = instructions()
    final = final[max(i for i, (keyword, _) in enumerate(final) if keyword == "FROM"):]
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert ("CMD", '["serve", "run", "serve_config.yaml"]') in final
    assert any(keyword == "HEALTHCHECK" for keyword, _ in final)


def test_nothing_of_the_offline_stand_ins_is_in_the_dockerfile():
    # The stand-in base, its CA bundle and the loopback wheel index belong to
    # deploy/build-image.sh, not to what a user builds.
    for trace in ("127.0.0.1:18", "PIP_CERT", "ca-certificates.crt", "hybridflow-standin", "--network"):
        assert trace not in DOCKERFILE, trace
