# Two entry points, each self-sufficient on a fresh machine:
#   make demo   build the demo checkpoint once, then materialize it with the CLI
#   make test   run the test suite's quick tier (make test-all: both tiers; docs/testing.md)
#   make docs-api  rewrite docs/api.md, the API reference, from the docstrings (tools/apiref.py)
#   make bench  compare loaders on a 1.9 GB checkpoint (bench/results/)
#   make bench-strided  experts saved transposed or interleaved, 1 GB
#   make bench-dcp  the 1.9 GB checkpoint as a dcp.save training save, against dcp.load
#   make bench-deferred  the bench models made from scratch: deferred_init + materialize against eager construction;
#                        then the recording against eager construction over a sample of the zoo's models
#   make bench-sharded  the 1.9 GB checkpoint into an FSDP2 model on 2 ranks, against set_model_state_dict;
#                       then into torchtitan's 2-D layout on 4 ranks, against dcp.load; then 4 replicas of
#                       the whole model, group= against every rank reading and rank 0 reading + broadcasting
#   make bench-many  a mixture-of-experts checkpoint of 100,000 small tensors (2.5 GB) as one safetensors file,
#                    sharded safetensors and a torch zip, into a model built on meta and one from deferred_init,
#                    against safetensors and torch.load + load_state_dict(assign=True), under FSDP2 on 2 ranks,
#                    and materialize inspect; each load's phases timed apart; the model's build alone
#                    (meta_init, accelerate's init_empty_weights, torch.device("meta"), deferred_init)
#   make bench-remote  the 1.9 GB checkpoint streamed from nginx (http://) and a moto S3 server (s3://) on loopback,
#                      against the local file and Run:ai's Model Streamer (needs nginx: apt-get install nginx-light)
#   make zoo    every transformers class of the auto mappings (tiny configs), timm family, torchvision builder,
#               diffusers model, peft tuner, torch.nn/torch.ao.nn class (flags, parametrizations), torch.linalg
#               function in a constructor and kind of load code
#               under the deferred and load oracles, one worker process per ZOO_WORKERS (default 1), each case
#               under ZOO_CASE_SECONDS; resumable (data/zoo/results.jsonl); writes docs/zoo.md and adds what
#               failed to tests/zoo_failed.txt, which make test runs beside a sample (ZOO_SEED, ZOO_SAMPLE)
#   make fuzz   fuzz the header, index, zip and pickle readers (FUZZ_SECONDS, default 600; each input under
#               FUZZ_INPUT_SECONDS + FUZZ_INPUT_SECONDS_PER_MB per MB of it, FUZZ_MEMORY_MB of address space,
#               FUZZ_INPUT_MEMORY_MB + FUZZ_INPUT_MEMORY_MB_PER_MB per MB of peak growth); the cx_* targets make
#               inputs expensive rather than malformed (fuzz/run.py's docstring); FUZZ_TARGETS picks some
#               (e.g. FUZZ_TARGETS="cx_torch_pickle cx_safetensors"; default all)
#
# The environment is locked: every package of test, demo and bench is installed at the exact version
# requirements-lock.txt names, so an upstream release changes nothing here until it is taken on purpose.
#   make lock         resolve requirements-*.txt and pyproject.toml afresh (newest releases) into the lock
#   make test-latest  the suite in .venv-latest, on the newest releases of every dependency but torch
#   make test-oldest  the suite in .venv-oldest, on the oldest versions pyproject.toml accepts (requirements-oldest.txt)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR := data/demo
LOCK := requirements-lock.txt
PIP := -m pip install --quiet --disable-pip-version-check
VERSIONS := grep -iE '^(torch|transformers|accelerate|huggingface.hub|safetensors|click|tqdm|tokenizers|pytest|hypothesis)=='

BENCH_STAMP := $(VENV)/.bench-installed
CONFIG ?= configs/bench-llama-1b.toml

ZOO_WORKERS ?= 1
ZOO_CASE_SECONDS ?= 300

FUZZ_SECONDS ?= 600
FUZZ_INPUT_SECONDS ?= 10
FUZZ_MEMORY_MB ?= 3072
FUZZ_INPUT_MEMORY_MB ?= 1024
FUZZ_INPUT_SECONDS_PER_MB ?= 4
FUZZ_INPUT_MEMORY_MB_PER_MB ?= 64
FUZZ_TARGETS ?=

.PHONY: demo test test-all test-long test-long-slice docs-api bench bench-strided bench-dcp bench-deferred bench-sharded bench-many bench-remote zoo fuzz venv clean lock test-latest test-oldest

# A fresh venv each time an input changes, so nothing of an earlier lock stays behind. The editable install
# is built without isolation, by the locked setuptools, so no build step fetches a floating one.
$(STAMP): pyproject.toml requirements-dev.txt requirements-fuzz.txt requirements-vision.txt $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) -c $(LOCK) -r requirements-dev.txt
	$(PY) $(PIP) -c $(LOCK) --no-build-isolation -e .
	$(PY) -m pip check
	$(PY) $(PIP) -c $(LOCK) --no-deps --target $(VENV)/vision -r requirements-vision.txt
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.writer configs/demo.toml $(DEMO_DIR)
	$(VENV)/bin/materialize $(DEMO_DIR) --model configs/demo.toml

# The suite's tiers (docs/testing.md, tests/tiers.py): make test the quick tier, make test-all both, make test-long the
# long tier (SLICE=K/N: the K-th of N slices of it, as CI runs one). Every core runs tests (TEST_WORKERS=0: one process).
# Each run writes its times to data/test-times-TARGET.xml (python -m tools.testtimes data/test-times-test.xml: the
# table by kind). The quick tier forks its CLI and rank processes from one that imported torch (tests/preforked.py);
# make test-all runs every process as a real one (PREFORKED=0), the way a user's shell starts it.
TEST_WORKERS ?= auto
LONG_SLICES ?= 4
PYTEST = mkdir -p data && MATERIALIZE_LOCK=$(LOCK) $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=40 \
	--junitxml=data/test-times-$@.xml

test: $(STAMP)
	$(PYTEST) -m "not long"

test-all: $(STAMP)
	export PREFORKED=0; $(PYTEST)

# pytest's exit 5 (no test selected: a slice can hold none) is a pass here
test-long: $(STAMP)
	$(PYTEST) -m long $(if $(SLICE),--slice $(SLICE)); status=$$?; [ $$status -eq 5 ] || exit $$status

# CI's slice of the long tier: chosen by the commit, so every long test runs within LONG_SLICES submissions
test-long-slice: $(STAMP)
	@slice=$$(( 0x$$(git rev-parse --short=8 HEAD) % $(LONG_SLICES) ))/$(LONG_SLICES); \
	echo "Long tier: slice $$slice for commit $$(git rev-parse --short=8 HEAD) (make test-long SLICE=$$slice runs it again)"; \
	$(MAKE) --no-print-directory test-long SLICE=$$slice

# Resolved in a throwaway venv from the requirement files alone, then frozen: pip itself is the venv's own.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python $(PIP) -r requirements-dev.txt -r requirements-bench.txt -r requirements-vision.txt
	.venv-lock/bin/python $(PIP) --no-build-isolation -e .
	{ echo "# Generated by make lock with $$(.venv-lock/bin/python -V) on $$(uname -m); do not edit by hand."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip=='; } > $(LOCK)
	rm -rf .venv-lock

test-latest:
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python $(PIP) -r requirements-dev.txt setuptools
	.venv-latest/bin/python $(PIP) --no-build-isolation -e .
	.venv-latest/bin/python $(PIP) --no-deps --target .venv-latest/vision -r requirements-vision.txt
	.venv-latest/bin/python -m pip freeze --exclude-editable | $(VERSIONS)
	.venv-latest/bin/python -m pytest -q -p no:cacheprovider

# Two runs: the core at its floors on the oldest Python (the HF tests skip, no transformers), then, on this
# Python (transformers 5.22 needs 3.11), the same floors with the hf extra's and what it needs added.
OLDEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) python3.10)
OLDEST_TORCH := $$(grep -oE '^torch==[^ ]+' requirements-oldest.txt)
test-oldest:
	rm -rf .venv-oldest .venv-oldest-hf
	$(OLDEST_PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python $(PIP) -r requirements-oldest.txt
	.venv-oldest/bin/python $(PIP) --no-build-isolation --no-deps -e .
	.venv-oldest/bin/python -m pip check
	.venv-oldest/bin/python -V; .venv-oldest/bin/python -m pip freeze --exclude-editable | $(VERSIONS)
	.venv-oldest/bin/python -m pytest -q -p no:cacheprovider
	$(PYTHON) -m venv .venv-oldest-hf
	.venv-oldest-hf/bin/python $(PIP) -r requirements-oldest.txt
	.venv-oldest-hf/bin/python $(PIP) -r requirements-oldest-hf.txt $(OLDEST_TORCH)
	.venv-oldest-hf/bin/python $(PIP) --no-build-isolation --no-deps -e .
	.venv-oldest-hf/bin/python -m pip check
	.venv-oldest-hf/bin/python -V; .venv-oldest-hf/bin/python -m pip freeze --exclude-editable | $(VERSIONS)
	.venv-oldest-hf/bin/python -m pytest -q -p no:cacheprovider tests/test_hub.py $$(grep -l transformers tests/*.py)

docs-api: $(STAMP)
	$(PY) -m tools.apiref

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) $(PIP) -c $(LOCK) -r requirements-dev.txt -r requirements-bench.txt
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench.run --config $(CONFIG)

bench-strided: $(BENCH_STAMP)
	$(PY) -m bench.strided

bench-dcp: $(BENCH_STAMP)
	$(PY) -m bench.dcp --config $(CONFIG)

bench-deferred: $(BENCH_STAMP)
	$(PY) -m bench.deferred
	$(PY) -m bench.deferred_zoo --sample 240

bench-sharded: $(BENCH_STAMP)
	$(PY) -m bench.sharded --config $(CONFIG)
	$(PY) -m bench.sharded --config $(CONFIG) --layout 2d
	$(PY) -m bench.sharded --config $(CONFIG) --layout replicas
	$(PY) -m bench.sharded --config $(CONFIG) --layout replicas --source s3

bench-many: $(BENCH_STAMP)
	$(PY) -m bench.many

bench-remote: $(BENCH_STAMP)
	$(PY) -m bench.remote --config $(CONFIG)

zoo: $(STAMP)
	$(PY) -m zoo.run --workers $(ZOO_WORKERS) --case-seconds $(ZOO_CASE_SECONDS)

fuzz: $(STAMP)
	$(PY) -m fuzz.run --seconds $(FUZZ_SECONDS) --input-seconds $(FUZZ_INPUT_SECONDS) --memory-mb $(FUZZ_MEMORY_MB) \
		--input-memory-mb $(FUZZ_INPUT_MEMORY_MB) --input-seconds-per-mb $(FUZZ_INPUT_SECONDS_PER_MB) \
		--input-memory-mb-per-mb $(FUZZ_INPUT_MEMORY_MB_PER_MB) $(foreach target,$(FUZZ_TARGETS),--target $(target))

clean:
	rm -rf $(VENV) .venv-lock .venv-latest .venv-oldest .venv-oldest-hf data .pytest_cache
