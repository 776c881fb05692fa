# The two commands a newcomer runs are `make test` and `make demo` (see README.md).
# Everything they need is installed or built here, into .venv/ and into a cache outside
# the checkout ($BATON_CACHE_DIR, default ~/.cache/baton), so a warm run is quick.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export BATON_CACHE_DIR ?= $(HOME)/.cache/baton
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# pytest's own flags can be added: make test PYTEST_ARGS="-k resume"
PYTEST_ARGS ?=

.PHONY: test venv build lint typecheck importlint pytest unit demo clean

## The test command: set up, build, lint, type-check and run the whole suite.
test: build lint typecheck importlint pytest

## .venv/ with the project (editable) and its dev extra; reinstalled when pyproject.toml changes.
venv: $(VENV)/.installed $(VENV)/.test-helpers

$(VENV)/.installed: pyproject.toml
	@echo "==> setting up $(VENV) (torch is large: the first install downloads ~3 GB; pip's cache serves later runs)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	@touch $@

## The test helpers (tests/baton_testing: the local cluster, the S3 server, the demo's driver)
## are importable in .venv/, as pytest's pythonpath makes them for the tests: the demo
## (examples/demo/run.py) uses them. A .pth file names tests/; they are not in the wheel.
$(VENV)/.test-helpers: $(VENV)/.installed
	echo "$(CURDIR)/tests" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/baton-test-helpers.pth"
	@touch $@

## Everything the tests need, set up side by side: .venv/ (the Python packages download and
## install while the Go builds compile), the local Kubernetes cluster, Helm, the versitygw S3
## server and Kueue's controller manager (all built from Go modules, cached by content hash), and
## Debian's Prometheus (server + promtool).
## Each part prints its progress prefixed with its name; one failed part fails the build.
## A warm run does no work: every part checks its cache or stamp and returns at once.
## To add a part: one name in SETUP_PARTS and one setup-NAME line below.
SETUP_PARTS := venv cluster helm versitygw kueue prometheus
setup-venv: ; @tools/setup-part.sh venv $(MAKE) --no-print-directory $(VENV)/.installed $(VENV)/.test-helpers
setup-cluster: ; @tools/setup-part.sh cluster tests/cluster/build.sh
setup-helm: ; @tools/setup-part.sh helm tools/helm/build.sh
setup-versitygw: ; @tools/setup-part.sh versitygw tools/versitygw/build.sh
setup-kueue: ; @tools/setup-part.sh kueue tools/kueue/build.sh
setup-prometheus: ; @tools/setup-part.sh prometheus tools/prometheus.sh

# Not .PHONY on purpose: a name in SETUP_PARTS without its rule then fails ("No rule to make
# target"), where a phony target without a rule would pass silently.
build:
	@echo "==> setting up, side by side: $(SETUP_PARTS)"
	@start=$$SECONDS; \
	$(MAKE) --no-print-directory -j$(words $(SETUP_PARTS)) $(addprefix setup-,$(SETUP_PARTS)); \
	echo "==> set-up complete in $$((SECONDS - start))s"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

importlint: venv
	$(VENV)/bin/lint-imports

## All tests, including the `cluster` and `e2e` markers. pytest's exit 5 (nothing collected) fails.
## --durations=30: every log lists the 30 slowest tests, to see where the suite's time goes.
## Two workers (pytest-xdist): the suite mostly waits (local clusters, trainers that sleep per
## step), so two test files at a time keep 2 cores busy. --dist loadfile runs each file on one
## worker, so module fixtures (a module's shared operator) stay one per module; each worker
## that runs cluster tests starts its own local cluster (distinct ports and pod IPs).
## PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
pytest: build
	@rc=0; $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests (exit 5)"; exit 1; fi; \
	exit $$rc

## Fast feedback: the unit tests only (no local cluster, no end-to-end runs).
unit: venv
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not cluster and not e2e" $(PYTEST_ARGS)

## The main job: the local spot-preemption demo (docs/demo.md). Options go in DEMO_ARGS, e.g.
## make demo DEMO_ARGS="--provider gke --preemptions 2"; the report lands in demo-out/.
DEMO_ARGS ?=
demo: build
	$(PY) examples/demo/run.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
