# The single-controller service on Ray Serve (CPU build by default).
#
#   docker build -t hybridflow-serve .
#   docker run --rm --init -p 8000:8000 --shm-size=2g hybridflow-serve
#   curl http://127.0.0.1:8000/readyz
#
# Ray keeps its object store in /dev/shm: give the container more than Docker's 64 MiB
# default (--shm-size). Set HYBRIDFLOW_TOKEN to require a bearer token on every route but
# the health checks.
#
# Build args (GPU variant and offline builds: deploy/README.md):
#   BASE_IMAGE       an image with Python 3.11 and its venv module: the official
#                    python:3.11-slim-bookworm, or Debian bookworm with python3 and
#                    python3-venv installed.
#   TORCH_INDEX_URL  the package index torch==2.13.0, and nothing else, is installed from.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# --- deps: a virtual environment with torch and the app's dependencies -------------------
FROM ${BASE_IMAGE} AS deps

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# PATH spelled out: a base imported without an image config has no PATH to extend.
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, pinned, alone from TORCH_INDEX_URL: without its dependencies, which come
# from PyPI with everything else, so no index but this one can supply a torch build.
RUN python3 -m venv /opt/venv \
    && pip install --no-deps --index-url "${TORCH_INDEX_URL}" torch==2.13.0

WORKDIR /src
# The base list plus the `server` extra where pyproject.toml has one, less this project's
# own distributions (hybridflow-client, the wire formats, is built from ./hybridflow-client
# below); this stage (the bulk of the image) is rebuilt only when pyproject.toml or the
# constraints change.
COPY pyproject.toml constraints.txt ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
reqs = p['dependencies'] + p.get('optional-dependencies', {}).get('server', []); \
print('\n'.join(r for r in reqs if not r.startswith((p['name'], 'hybridflow-client'))))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt

# --- app: the app as a wheel, checked against the dependencies ---------------------------
FROM deps AS app

COPY . .
# The app and the client distribution it depends on (its wire formats) as wheels.
# pyproject.toml is the authority on what the app needs; pip check fails the build if
# anything is missing.
RUN pip wheel --no-deps --wheel-dir /wheels ./hybridflow-client . \
    && pip install -c constraints.txt /wheels/*.whl \
    && pip check

# --- the image: the virtual environment, the app and the config, run unprivileged --------
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="hybridflow-serve" \
      org.opencontainers.image.description="verl-style worker groups (HybridFlow single controller) served over HTTP on Ray Serve"

ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# wget: KubeRay's default pod probes run `wget ... | grep success` (deploy/rayservice.yaml).
# .hybridflow: where the controllers keep durable state (the serve config's `state.path`);
# a volume mounted there keeps it across containers (deploy/cluster.sh shares one).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --user-group --shell /bin/bash hybridflow \
    && mkdir -p /home/hybridflow/app/.hybridflow \
    && chown -R hybridflow:hybridflow /home/hybridflow/app

COPY --from=deps /opt/venv /opt/venv
COPY --from=app /wheels /tmp/wheels
RUN PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 pip install --no-deps --no-index /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && pip check

WORKDIR /home/hybridflow/app
COPY --chown=hybridflow:hybridflow serve_config.yaml ./
# By number: Kubernetes' runAsNonRoot can only verify a numeric user.
USER 1000:1000

# 8000: HTTP; 9000: the Open Inference Protocol over gRPC. A cluster from this image
# (deploy/cluster.sh) also uses 6379 (GCS) and 8265 (dashboard, where `serve deploy` sends
# the config).
EXPOSE 8000 9000 6379 8265

# Liveness of the HTTP ingress; the groups take a while to start (readiness is /readyz).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

CMD ["serve", "run", "serve_config.yaml"]
