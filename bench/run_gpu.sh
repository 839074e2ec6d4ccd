#!/usr/bin/env bash
# One device call: build, full test suite, the demo, and the benchmarks; logs and results
# under $OUT (at most 8 files come back: tests.log, demo.log and the bench md/json files).
# Carry `.whl` (expecttest, not on the GPU image): see bench/README.md.
set -uo pipefail
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The image's CC/CXX (/opt/gcc wrappers) build an extension whose C++ exceptions crash the
# process (seen 2026-11-22); the system gcc builds a working one.
CC=gcc CXX=g++ python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" | tail -25
[ -n "${SKIP_DEMO:-}" ] || timeout 240 python3 examples/train_gpt.py 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tee "$OUT/demo.log" | tail -12
[ -n "${SKIP_LINEAR:-}" ] || python3 -m bench.bench_linear --out "$OUT" --no-chart 2>&1 | tail -25
python3 -m bench.bench_overhead --out "$OUT" --no-chart 2>&1 | tail -45
ls -la "$OUT"
