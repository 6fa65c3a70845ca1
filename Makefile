# Entry points: `make run` (quickstart), `make test` (what CI runs), `make check` (the quick loop)
# and `make docs` (the documentation site, built strictly).
# All create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup run test check docs bench clean

setup: $(VENV)/.installed

# torch first, pinned: 2.13.0 is a CPU build that lies on this disk; other releases download gigabytes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,hf,tensorboard]'
	touch $@

run: setup
	$(BIN)/pd train recipes/quickstart.yaml

test: setup
	$(BIN)/mypy
	$(MAKE) --no-print-directory docs
	$(BIN)/pytest -q

# mypy and the fast tier: every test not marked slow (under 90 s on 2 cores).
check: setup
	$(BIN)/mypy
	$(BIN)/pytest -q -m "not slow"

# The docs site (mkdocs.yml): a broken link or anchor, a missing page or a page left out of the
# nav fails the build. Neither -q nor -v: in mkdocs 1.6 either keeps --strict from counting the
# warnings (mkdocs issues 4126, 3991), and the build passes whatever they say.
docs: setup
	$(BIN)/mkdocs build --strict -d build/site

bench: setup
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_runtime.py

clean:
	rm -rf runs .pytest_cache
