# The two commands a new user needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.mmdispatch-installed
DEMO_DIR ?= demo-data

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU wheel, pinned: an open torch range would pull multi-GB CUDA builds.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[trainer,test]'
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

clean:
	rm -rf $(VENV) $(DEMO_DIR) reports .pytest_cache
