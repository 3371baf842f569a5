#!/usr/bin/env bash
# `make image`: build the Dockerfile into IMAGE (default hybridflow-serve).
#
# Where the base image and PyTorch's wheel index are reachable this is exactly
#   docker build -t hybridflow-serve .
# (BASE_IMAGE and TORCH_INDEX_URL from the environment become the build args of the same
# name). Where they are not (the development machines reach PyPI but no image registry
# and no PyTorch index), two stand-ins are used, neither of which touches the Dockerfile:
#   - no registry: the base is deploy/standin-base.sh's Debian bookworm with python3 and
#     python3-venv (built once, then reused);
#   - no PyTorch index: the torch wheel from pip's find-links folder (`pip config list`)
#     is served as an index on loopback (python -m http.server) and the build runs with
#     --network host to reach it.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-hybridflow-serve}
# Stand-ins replace the defaults only; a base or index given explicitly is used as given.
base_given=${BASE_IMAGE:+yes}
index_given=${TORCH_INDEX_URL:+yes}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim-bookworm}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_WHEEL_PORT=${TORCH_WHEEL_PORT:-18463}   # fixed, so cached layers stay valid
export DOCKER_BUILDKIT=0                      # the classic builder: no buildx here

build_args=()
network=()
server_pid=""
wheel_dir=""
cleanup() {
    if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; fi
    if [[ -n "$wheel_dir" ]]; then rm -rf "$wheel_dir"; fi
}
trap cleanup EXIT

if [[ -n "$base_given" ]] || docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
    || docker pull "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "build-image: base $BASE_IMAGE"
else
    echo "build-image: $BASE_IMAGE cannot be pulled; using a stand-in Debian bookworm base"
    BASE_IMAGE=$(deploy/standin-base.sh)
fi
build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")

reachable() {  # an index answers for torch
    python3 - "$1/torch/" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10)
except Exception:
    sys.exit(1)
EOF
}

if [[ -n "$index_given" ]] || reachable "$TORCH_INDEX_URL"; then
    echo "build-image: torch from $TORCH_INDEX_URL"
else
    find_links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
    wheel=""
    for folder in $find_links; do
        folder=${folder#file://}
        candidate=$(find "$folder" -maxdepth 1 -name 'torch-2.13.0+cpu-cp311-*.whl' 2>/dev/null | head -n 1)
        if [[ -n "$candidate" ]]; then wheel=$candidate; break; fi
    done
    if [[ -z "$wheel" ]]; then
        echo "build-image: $TORCH_INDEX_URL is unreachable and no torch 2.13.0 CPU wheel (cp311) is in pip's find-links ($find_links)" >&2
        exit 1
    fi
    # An index is a folder per project: <url>/torch/ lists the wheel.
    wheel_dir=$(mktemp -d /tmp/hybridflow-torch-index.XXXXXX)
    mkdir "$wheel_dir/torch"
    ln -s "$wheel" "$wheel_dir/torch/"
    if python3 -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$TORCH_WHEEL_PORT" 2>/dev/null; then
        port=$TORCH_WHEEL_PORT
    else  # taken: any free port (the torch layer is then rebuilt)
        port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    fi
    python3 -m http.server --bind 127.0.0.1 --directory "$wheel_dir" "$port" >/dev/null 2>&1 &
    server_pid=$!
    TORCH_INDEX_URL="http://127.0.0.1:$port"
    for _ in $(seq 50); do reachable "$TORCH_INDEX_URL" && break; sleep 0.2; done
    echo "build-image: $wheel served as $TORCH_INDEX_URL (build on the host network)"
    network=(--network host)
fi
build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

previous=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
docker build --force-rm "${network[@]}" "${build_args[@]}" -t "$IMAGE" "$@" .
# The image this tag named before, now untagged, goes (unless a container still uses it).
if [[ -n "$previous" && "$previous" != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
