"""Copy serve_config.yaml into deploy/rayservice.yaml's serveConfigV2, keeping the rest.

KubeRay takes the Serve config as a string; keeping it a verbatim copy of the repository's
file (indented under ``serveConfigV2: |``) means one source of truth, which
tests/unit/test_k8s_manifest.py checks. Run ``make rayservice`` after editing
serve_config.yaml.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "rayservice.yaml"
KEY = "  serveConfigV2: |"


def embed(manifest: str, serve_config: str) -> str:
    """Return ``manifest`` with its serveConfigV2 block replaced by ``serve_config``."""
    lines = manifest.splitlines()
    start = lines.index(KEY) + 1
    end = start
    # The block lasts while lines are blank or indented deeper than the key.
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    body = [("    " + line) if line.strip() else "" for line in serve_config.strip("\n").splitlines()]
    return "\n".join(lines[:start] + body + lines[end:]) + "\n"


def main() -> None:
    source = (ROOT / "serve_config.yaml").read_text()
    # The repository file's leading comment stays in the repository.
    body = "\n".join(line for line in source.splitlines() if not line.startswith("#"))
    MANIFEST.write_text(embed(MANIFEST.read_text(), body))


if __name__ == "__main__":
    main()
