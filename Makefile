# make setup: .venv with a Python >= 3.12 found on this machine (tools/find_python.sh), project + dev extras.
# make test:  setup when needed, then the suite's first tier (every test not marked slow; tests/README.md).
# make test-slow: the second tier (subprocess servers, mesh workers, notebooks, more runtime configurations).
# make test-all: both tiers in one run. CI (.ci/run) runs make test, then make test-slow.
# make serve: setup when needed, then the OpenAI-compatible server on the built-in nano-austen model
#             (pass flags with ARGS, e.g. make serve ARGS="--model /path/to/checkpoint --port 9000").
# make notebooks: setup when needed, then execute every notebooks/*.ipynb
#             (outputs are not written back; ARGS="--out DIR" saves the executed copies there).
# make strip-notebooks: remove outputs and execution counts from the notebooks before committing them.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup test test-slow test-all serve notebooks strip-notebooks oracle-fixtures clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@interp=$$(PYTHON="$(PYTHON)" sh tools/find_python.sh) || exit 1; \
	echo "creating $(VENV) with $$interp"; \
	"$$interp" -m venv $(VENV) && \
	$(PY) -m pip install -q --upgrade pip && \
	$(PY) -m pip install -q -e '.[dev]' && touch $@

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m slow

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

serve: $(STAMP)
	$(PY) -m serving.server $(ARGS)

notebooks: $(STAMP)
	$(PY) tools/run_notebooks.py $(ARGS)

strip-notebooks: $(STAMP)
	$(PY) tools/strip_notebooks.py

# Regenerate the HF-oracle fixtures; needs a Python with torch 2.13 + transformers 5.24 (see tests/oracle/README.md).
ORACLE_PYTHON ?= .oracle-venv/bin/python
oracle-fixtures:
	$(ORACLE_PYTHON) tests/oracle/make_fixtures.py

clean:
	rm -rf $(VENV)
