# Two entry points: `make demo` and `make test`. Each creates .venv when missing and
# (re)installs when pyproject.toml or constraints.txt changed. pyproject.toml declares the ranges
# torchcls supports; constraints.txt holds the exact tested set, so every run installs the same.
VENV   ?= .venv
PYTHON ?= python3.11
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
FASHION_MNIST := /usr/share/datasets/fashion-mnist

.PHONY: demo test fashion-mnist chromium clean

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(VENV)/.installed-demo: pyproject.toml constraints.txt | $(PY)
	$(PIP) install -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt | $(PY)
	$(PIP) install -c constraints.txt -e '.[test]'
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(VENV)/bin/torchcls demo

# ruff first: a lint error (unused/undefined name, import order, an over-long function) fails fast.
test: $(VENV)/.installed-test fashion-mnist chromium
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest

# The real Fashion-MNIST files from Debian, used by tests and benchmarks: installed
# when we are root and apt exists; otherwise the tests that need them say so.
fashion-mnist:
	@if [ ! -d $(FASHION_MNIST) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; fi

# Headless Chromium for tests/test_report_browser.py (report.html measured at a 1280 px viewport):
# installed from Debian when we are root and apt exists; otherwise that test says it was skipped.
chromium:
	@if ! command -v chromium >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi

clean:
	rm -rf runs .pytest_cache build src/*.egg-info
