# `make test` and `make serve` are the only two commands a new machine needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-unit test-ray test-e2e lint serve bench clean image image-test cluster-test

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned, so nothing resolves a newer CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[server,dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The three layers of the suite: no Ray (seconds), one Ray cluster, `serve run` end to end.
test-unit: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

test-ray: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/ray $(PYTEST_ARGS)

test-e2e: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/e2e $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/serve run serve_config.yaml

# Benchmarks: bench/results/latest.json and latest.png (BENCH_ARGS=--quick for a short run).
bench: $(STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)

# The container image (tag $(IMAGE)); where no registry or PyTorch index is reachable the
# build uses stand-ins for them (deploy/build-image.sh). The image and cluster tests run
# against a real Docker engine and remove what they start.
IMAGE ?= hybridflow-serve
DOCKER_PYTEST := HYBRIDFLOW_DOCKER_TESTS=1 IMAGE=$(IMAGE) $(PY) -m pytest -q -s -p no:cacheprovider --timeout=1800

image:
	IMAGE=$(IMAGE) deploy/build-image.sh

image-test: $(STAMP) image
	$(DOCKER_PYTEST) tests/docker/test_image.py $(PYTEST_ARGS)

cluster-test: $(STAMP) image
	$(DOCKER_PYTEST) tests/docker/test_cluster.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
