#!/usr/bin/env bash
# Tests and the CUDA benchmark on a GPU machine that already has a CUDA torch
# (and safetensors, accelerate, transformers, pytest) but no network, so
# `make test` cannot build its own venv there. Uses that machine's python3.
#
#   bench/gpu_host.sh         all of it: the tests below, then the benchmark's GPU groups
#   bench/gpu_host.sh test    CUDA-facing tests, then the whole suite
#   bench/gpu_host.sh bench [GROUPS]
#                             groups of the benchmark (default: cuda, cuda cast,
#                             cuda cold), merged into the report already in RESULTS,
#                             so a run too long for one call can be split
#
# RESULTS (default bench/results/gpu) receives logs and the table.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/results/gpu}
RUNS=${RUNS:-3}
mkdir -p "$RESULTS"

"$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || echo "editable install failed: CLI tests will not find the materialize command"
nvidia-smi -L
"$PYTHON" -c 'import torch, safetensors, accelerate; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "safetensors", safetensors.__version__, "accelerate", accelerate.__version__)'

run_tests() {
    # The benchmark's fixtures are written meanwhile, ready for a `bench` call.
    "$PYTHON" -c 'from bench.fixtures import ensure; from pathlib import Path; ensure("configs/bench-llama-1b.toml", Path("data/bench"))' \
      >"$RESULTS/fixtures.log" 2>&1 &
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_ring.py tests/test_device_map.py \
      tests/test_staging.py tests/test_peak_memory.py tests/test_failed_loads.py 2>&1 | tee "$RESULTS/test-cuda.log"
    "$PYTHON" -m pytest -q -p no:cacheprovider -n 8 --maxfail=25 2>&1 | tail -60 | tee "$RESULTS/test-all.log"
    wait
}

run_bench() {
    "$PYTHON" -m bench.run --runs "$RUNS" --out "$RESULTS" --merge \
      --groups "${1:-cuda,cuda cast,cuda cold}" 2>&1 | tee -a "$RESULTS/bench-cuda.log"
}

case "${1:-all}" in
  all) run_tests; run_bench ;;
  test) run_tests ;;
  bench) run_bench "${2:-}" ;;
esac
