# attnserve: `make test` and `make serve` are the two commands a newcomer needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test serve lint typecheck unit venv clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check attnserve tests
	$(VENV)/bin/ruff format --check attnserve tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy attnserve

unit: $(STAMP)
	$(PY) -m pytest -q

test: lint typecheck unit

serve: $(STAMP)
	$(VENV)/bin/attnserve serve

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
