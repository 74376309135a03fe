# make demo: bake the template, train, resume. make test: the template's own test suite.
PYTHON ?= python3
# Installed before everything else so the rest resolves against it. For a CPU-only wheel:
#   make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
# Options for each `pip install` of the set-up (.ci/run: --no-compile).
PIP_OPTIONS ?=
VENV := .venv
# Inside the venv, so deleting the venv also forgets that it was set up.
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test demo screenshot format clean

setup: $(STAMP)

$(STAMP): requirements-dev.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_OPTIONS) $(TORCH)
	$(VENV)/bin/pip install $(PIP_OPTIONS) -r requirements-dev.txt
	touch $@

# Two pytest-xdist workers: the end-to-end test (the bake's suite, on workers of its own) and the
# READMEs' runs, each a chain of commands in order, go on beside each other. The 30 slowest tests
# are printed at the end: where the time goes.
test: setup
	$(VENV)/bin/python -m pytest tests -n 2 --dist worksteal --durations=30

demo: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" scripts/demo.sh

# The README's picture: the MLflow UI on the demo's resumed run (needs Debian's chromium).
screenshot: demo
	$(VENV)/bin/python scripts/screenshot_mlflow.py

# Ruff over the template's Jinja-laden Python, with the generated project's settings.
format: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python scripts/format_template.py

clean:
	rm -rf $(VENV) demo .pytest_cache .ruff_cache
