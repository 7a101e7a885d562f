# Two entry points, each self-sufficient on a fresh machine:
#   make demo   build the demo checkpoint once, then materialize it with the CLI
#   make test   run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR := data/demo

.PHONY: demo test venv clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m materialize.fixtures configs/demo.toml $(DEMO_DIR)
	$(VENV)/bin/materialize $(DEMO_DIR) --model configs/demo.toml

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) data .pytest_cache
