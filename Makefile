# Two commands: `make run` (the default experiment) and `make test` (the test suite).
# Each creates .venv with the pinned dependencies when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run lint test docs clean

$(BIN)/.installed: requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install -q -e . --no-deps
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python raysim/run.py $(ARGS)

# mypy sees methods/ and privacy/ where they are installed (raysim.methods, raysim.privacy) through a link tree
TYPECHECK := build/typecheck

# import-linter (contracts in pyproject.toml) reads the installed graph the same way: a link tree where methods/,
# privacy/ and attacks/ sit at raysim.methods, raysim.privacy, raysim.attacks (run from the repository root it would
# see raysim/ alone); imports inside functions count
IMPORTGRAPH := build/importgraph

lint: setup
	$(BIN)/ruff check raysim methods privacy attacks benchmarks tests
	rm -rf $(IMPORTGRAPH) && mkdir -p $(IMPORTGRAPH)/raysim
	for e in raysim/*; do ln -s "$(CURDIR)/$$e" $(IMPORTGRAPH)/raysim/; done
	for p in methods privacy attacks; do ln -s "$(CURDIR)/$$p" $(IMPORTGRAPH)/raysim/$$p; done
	cd $(IMPORTGRAPH) && $(CURDIR)/$(BIN)/lint-imports --no-cache $(CURDIR)/pyproject.toml
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/raysim
	for e in raysim/*; do ln -s "$(CURDIR)/$$e" $(TYPECHECK)/raysim/; done
	ln -s "$(CURDIR)/methods" $(TYPECHECK)/raysim/methods && ln -s "$(CURDIR)/privacy" $(TYPECHECK)/raysim/privacy
	cd $(TYPECHECK) && $(CURDIR)/$(BIN)/mypy -p raysim --ignore-missing-imports --follow-imports=silent

test: setup lint
	$(BIN)/python -m pytest tests

# the documentation site (docs/, mkdocs.yml); the reference pages are generated from the code
docs: setup
	$(BIN)/mkdocs build --strict -d build/site

clean:
	rm -rf $(VENV) build *.egg-info
