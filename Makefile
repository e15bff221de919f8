# Two entry points: `make demo` and `make test`. Each creates .venv when missing and
# (re)installs when pyproject.toml or constraints.txt changed. pyproject.toml declares the ranges
# torchcls supports; constraints.txt holds the exact tested set, so every run installs the same.
VENV   ?= .venv
PYTHON ?= python3.11
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
FASHION_MNIST := /usr/share/datasets/fashion-mnist

.PHONY: demo test test-lowest fashion-mnist chromium clean

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
# The suite runs in one pytest worker per CPU this process may use (at most 4; `make test TEST_WORKERS=1`
# for one), each taking whole test files (module fixtures built once): much of a test's time is a
# subprocess importing torch or a server waiting on a client, one core's work, so two workers on 2 cores
# took 16 min where one took 22-27.
TEST_WORKERS ?= $(shell $(PY) -c 'import os; n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(); print(min(4, n or 1))')
test: $(VENV)/.installed-test fashion-mnist chromium
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) --no-print-directory test-lowest

# The lowest torch torchcls supports (pyproject: torch>=2.11), in a second venv set up the way a user who
# already has torch gets torchcls: torch and its torchvision installed FIRST, then torchcls on top as
# `pip install` gives it (a wheel, not editable; core dependencies + the export extra), which must keep
# that torch: a range or a new dependency that asks for a newer one fails here, not on a user's machine.
# The rest of the set is constraints.txt without the torch stack (torch pins its own CUDA libraries exactly),
# so the run is reproducible and follows constraints.txt's upgrades. Set up once, again when pyproject.toml,
# constraints.txt or this file change; torchcls itself is reinstalled from the working tree on every run.
LOWEST       ?= .venv-lowest
LOWEST_PY    := $(LOWEST)/bin/python
LOWEST_TORCH := torch==2.11.0 torchvision==0.26.0
TORCH_STACK  := ^(torch|torchvision|triton|cuda-toolkit|nvidia-[a-z0-9-]+)==
# What runs against it (about a minute of CPU): every module imports without the optional extras and the
# console script reports this torch (test_install); train -> predict -> evaluate -> ONNX export -> load
# through the public API (test_api); exact resume and the run dir (test_train); checkpoint files
# (test_checkpoint); data sources and loaders (test_data); the image decoder (test_images); evaluate and
# predict (test_evaluate_predict); the timm/torchvision model factory (test_models); typed config (test_config).
LOWEST_TESTS := tests/test_install.py tests/test_api.py tests/test_train.py tests/test_checkpoint.py \
	tests/test_data.py tests/test_images.py tests/test_evaluate_predict.py tests/test_models.py tests/test_config.py

$(LOWEST_PY):
	$(PYTHON) -m venv $(LOWEST)

$(LOWEST)/.installed: pyproject.toml constraints.txt Makefile | $(LOWEST_PY)
	grep -vE '$(TORCH_STACK)' constraints.txt > $(LOWEST)/constraints.txt
	$(LOWEST_PY) -m pip install -c $(LOWEST)/constraints.txt $(LOWEST_TORCH)
	$(LOWEST_PY) -m pip install -c $(LOWEST)/constraints.txt '.[export]' pytest pytest-timeout
	@frozen="$$($(LOWEST_PY) -m pip freeze)"; for req in $(LOWEST_TORCH); do echo "$$frozen" | grep -qxF "$$req" \
		|| { echo "pip replaced the $$req installed first: torchcls must install on top of it"; exit 1; }; done
	touch $@

test-lowest: $(LOWEST)/.installed
	rm -rf build  # setuptools' build/lib keeps modules deleted from src, and the wheel would carry them
	$(LOWEST_PY) -m pip install -q --no-deps --force-reinstall .
	$(LOWEST_PY) -m pytest $(LOWEST_TESTS)

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
