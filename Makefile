# Two commands: `make run` (the default experiment) and `make test` (the test suite).
# Each creates .venv with the pinned dependencies when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup run lint test docs mutation mutation-stepper clean

$(BIN)/.installed: requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install -q -e . --no-deps
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python raysim/run.py $(ARGS)

# import-linter (contracts in pyproject.toml) and mypy read the installed layout: a link tree where methods/,
# privacy/ and attacks/ sit at raysim.methods, raysim.privacy, raysim.attacks (run from the repository root they
# would see raysim/ alone); imports inside functions count
LINKTREE := build/linktree

lint: setup
	$(BIN)/ruff check raysim methods privacy attacks benchmarks tests docs
	rm -rf $(LINKTREE) && mkdir -p $(LINKTREE)/raysim
	for e in raysim/*; do ln -s "$(CURDIR)/$$e" $(LINKTREE)/raysim/; done
	for p in methods privacy attacks; do ln -s "$(CURDIR)/$$p" $(LINKTREE)/raysim/$$p; done
	cd $(LINKTREE) && $(CURDIR)/$(BIN)/lint-imports --no-cache $(CURDIR)/pyproject.toml
	cd $(LINKTREE) && $(CURDIR)/$(BIN)/mypy -p raysim --ignore-missing-imports --follow-imports=silent --check-untyped-defs

# lint (ruff, import contracts, mypy), the docs site, then the test suite on PYTEST_WORKERS processes
# (pytest-xdist; each runs its share of the tests that start or join Ray on one local cluster of its own): what CI runs
PYTEST_WORKERS ?= 2
test: setup lint docs
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist load tests

# the documentation site (docs/, mkdocs.yml); the reference pages are generated from the code
docs: setup
	$(BIN)/mkdocs build --strict -d build/site

# mutation testing (mutmut, pinned; scope and tests in pyproject's [tool.mutmut]); not in CI: about 90 minutes on 2 cores.
# benchmarks/mutation/mutation.py builds the flat tree mutmut runs in (build/mutation) and reports per-file scores
MUTMUT := mutmut==3.8.1
MUTATION_WORKERS ?= 2
mutation: setup
	$(BIN)/python -m pip install -q $(MUTMUT)
	$(BIN)/python benchmarks/mutation/mutation.py prepare
	benchmarks/mutation/watchdog.sh 150 build/mutation/watchdog.log & \
	cd build/mutation && RAYSIM_TESTS_WITHOUT_RAY=1 $(CURDIR)/$(BIN)/mutmut run --max-children $(MUTATION_WORKERS) > mutmut-run.log 2>&1
	$(BIN)/python benchmarks/mutation/mutation.py report | tee build/mutation/score.md

# the second scope, [tool.raysim.mutation.stepper] in pyproject: privacy/dpsgd.py and privacy/host.py against the fast
# tests that reach them (about 50 minutes on 2 cores); its own tree, build/mutation-stepper
mutation-stepper: setup
	$(BIN)/python -m pip install -q $(MUTMUT)
	$(BIN)/python benchmarks/mutation/mutation.py prepare --scope stepper --tree build/mutation-stepper
	benchmarks/mutation/watchdog.sh 150 build/mutation-stepper/watchdog.log & \
	cd build/mutation-stepper && RAYSIM_TESTS_WITHOUT_RAY=1 $(CURDIR)/$(BIN)/mutmut run --max-children $(MUTATION_WORKERS) > mutmut-run.log 2>&1
	$(BIN)/python benchmarks/mutation/mutation.py report --tree build/mutation-stepper | tee build/mutation-stepper/score.md

clean:
	rm -rf $(VENV) build *.egg-info
