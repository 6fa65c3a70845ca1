# Entry points: `make run` (quickstart), `make test` (what CI runs), `make check` (the quick loop)
# and `make docs` (the documentation site, built strictly).
# All create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Byte-compiled files kept (__pycache__/, ignored by git) even where the environment turns them
# off: the suite starts hundreds of processes that import the same modules, and pytest compiles
# its rewritten test modules again at every start without them (6 s of a 12 s collection).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup run test check docs bench durations clean

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

# The fast tier as `make check` runs it, the slow tier in two processes as well (its runs mostly
# wait: on each other, on timeouts, on shaped links), then the slow tests marked serial alone:
# they hold a run's measured times to a fit of them, which a run beside them would disturb.
test: setup
	$(BIN)/mypy
	$(MAKE) --no-print-directory docs
	$(BIN)/pytest -q -m "not slow" -n 2 --dist worksteal
	$(BIN)/pytest -q -m "slow and not serial" -n 2 --dist worksteal
	$(BIN)/pytest -q -m "slow and serial"

# mypy and the fast tier: every test not marked slow, in two processes (pytest-xdist; each takes
# the other's queued tests when its own run out); under 90 s on 2 cores.
check: setup
	$(BIN)/mypy
	$(BIN)/pytest -q -m "not slow" -n 2 --dist worksteal

# The docs site (mkdocs.yml): a broken link or anchor, a missing page or a page left out of the
# nav fails the build. Neither -q nor -v: in mkdocs 1.6 either keeps --strict from counting the
# warnings (mkdocs issues 4126, 3991), and the build passes whatever they say.
docs: setup
	$(BIN)/mkdocs build --strict -d build/site

# The whole suite in one process, each test's time recorded in tests/durations.json
# (tests/test_marks.py: a test over 5 s there must be marked slow).
durations: setup
	$(BIN)/pytest -q -p no:cacheprovider --junitxml=build/durations.xml
	$(BIN)/python tests/durations.py build/durations.xml

bench: setup
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_runtime.py

clean:
	rm -rf runs .pytest_cache
