# Two entry points, each self-sufficient on a fresh machine:
#   make demo   build the demo checkpoint once, then materialize it with the CLI
#   make test   run the test suite
#   make bench  compare loaders on a 1.9 GB checkpoint (bench/results/)
#   make bench-strided  experts saved transposed or interleaved, 1 GB
#   make bench-dcp  the 1.9 GB checkpoint as a dcp.save training save, against dcp.load
#   make bench-sharded  the 1.9 GB checkpoint into an FSDP2 model on 2 ranks, against set_model_state_dict
#   make fuzz   fuzz the header, index and zip readers (FUZZ_SECONDS, default 600)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR := data/demo

BENCH_STAMP := $(VENV)/.bench-installed
CONFIG ?= configs/bench-llama-1b.toml

FUZZ_SECONDS ?= 600

.PHONY: demo test bench bench-strided bench-dcp bench-sharded fuzz venv clean

$(STAMP): pyproject.toml requirements-dev.txt requirements-fuzz.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m materialize.fixtures configs/demo.toml $(DEMO_DIR)
	$(VENV)/bin/materialize $(DEMO_DIR) --model configs/demo.toml

test: $(STAMP)
	$(PY) -m pytest -q

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -r requirements-bench.txt
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench.run --config $(CONFIG)

bench-strided: $(BENCH_STAMP)
	$(PY) -m bench.strided

bench-dcp: $(BENCH_STAMP)
	$(PY) -m bench.dcp --config $(CONFIG)

bench-sharded: $(BENCH_STAMP)
	$(PY) -m bench.sharded --config $(CONFIG)

fuzz: $(STAMP)
	$(PY) -m fuzz.run --seconds $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) data .pytest_cache
