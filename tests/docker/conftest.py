"""The container image and a two-node cluster from it, tested against a real Docker
engine (`make image-test`, `make cluster-test`). Collected only when
HYBRIDFLOW_DOCKER_TESTS=1, which those targets set: `make test` must not need Docker."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("HYBRIDFLOW_DOCKER_TESTS") == "1" else ["test_*.py"]
