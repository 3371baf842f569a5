# The single-controller service on Ray Serve, CPU build.
#
#   docker build -t hybridflow-serve .
#   docker run --rm -p 8000:8000 --shm-size=2g hybridflow-serve
#   curl http://127.0.0.1:8000/readyz
#
# Ray keeps its object store in /dev/shm: give the container more than Docker's 64 MiB
# default (--shm-size). Set SC_AUTH_TOKEN to require a bearer token on every route but
# the health checks.

# A pinned Ray release whose Python (3.11) megatron-core 0.16 supports.
FROM rayproject/ray:2.60.0-py311-cpu

LABEL org.opencontainers.image.title="hybridflow-serve" \
      org.opencontainers.image.description="verl-style worker groups (HybridFlow single controller) served over HTTP on Ray Serve"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /home/ray/app

# torch first, pinned, from the CPU wheel index, so nothing later resolves a CUDA build.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY --chown=ray:users pyproject.toml constraints.txt README.md ./
COPY --chown=ray:users single_controller ./single_controller
COPY --chown=ray:users wire ./wire
COPY --chown=ray:users app ./app
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users clients ./clients
RUN pip install --no-cache-dir -c constraints.txt '.[server]'

COPY --chown=ray:users serve_config.yaml ./

EXPOSE 8000

# Liveness of the HTTP ingress; the groups take a while to start (readiness is /readyz).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

CMD ["serve", "run", "serve_config.yaml"]
