# Quick start: `make demo` runs the demo on the embedded SQLite default, `make test` runs the tests.
# Both create .venv and install what they need by themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick lint docs docs-build bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	@$(PY) -m examples.order_service.demo $(DEMO_ARGS)

# Test modules run on TEST_WORKERS pytest-xdist workers at once (most tests wait on databases, servers and
# subprocesses, not on a core); each module stays on one worker. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(MKDOCS) build --strict --quiet
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

# The inner loop: unit and integration tests on SQLite only (no MariaDB/PostgreSQL, no browser, no slow
# seeds), stopping at the first failure. `make test` before you push runs everything.
QUICK_MARKS := not mariadb and not postgres and not slow
test-quick: $(STAMP)
	ORBIT_TEST_DATABASES=sqlite $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -q -x -p no:cacheprovider \
		tests/unit tests/integration \
		-m "$(QUICK_MARKS)" --deselect tests/integration/test_console_browser.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The documentation site (docs/, mkdocs.yml): `make docs` serves it at http://127.0.0.1:8000 with live reload,
# from this machine alone (system fonts, no CDN). `make test` builds it with --strict: a broken link, an unknown
# anchor or a missing Python reference fails the build (a few seconds).
MKDOCS := NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs

docs: $(STAMP)
	$(MKDOCS) serve --dev-addr 127.0.0.1:8000

docs-build: $(STAMP)
	$(MKDOCS) build --strict

bench: $(STAMP)
	$(PY) -m bench.submit
	$(PY) -m bench.relay
	$(PY) -m bench.workers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .demo site
