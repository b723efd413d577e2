# The two commands a new user needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.mmdispatch-installed
DEMO_DIR ?= demo-data
# torch for the trainer extra and the tests: TORCH_SPEC is the requirement, TORCH_INDEX the wheel
# index (empty: pip's configured one, where torch==2.13.0 is this machine's local CPU wheel).
#   CPU-only machine: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   CUDA 12.4:        make test TORCH_INDEX=https://download.pytorch.org/whl/cu124
# An ordinary index without TORCH_INDEX gives the multi-GB CUDA build on Linux.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install test demo bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	$(PIP) install -q -e '.[trainer,test]'
	$(PY) -m dispatcher_server.planner.warm  # the planner's kernels into numba's cache
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/mmdispatch demo --data $(DEMO_DIR)

bench: install
	$(PY) -m bench.counting
	$(PY) -m bench.planner
	$(PY) -m bench.exchange
	$(PY) -m bench.stream

# Regenerate docs/configuration.md (from the command parsers) and docs/benchmarks.md (from the
# benches' JSON in docs/bench/); tests/test_readme.py fails when either is stale.
docs: install
	$(PY) -m mmdispatch.docgen
	$(PY) -m bench.planner_doc docs/bench/planner.json > docs/planner.md

clean:
	rm -rf $(VENV) $(DEMO_DIR) reports .pytest_cache
