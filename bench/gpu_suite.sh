#!/usr/bin/env bash
# The whole GPU test suite in two device calls, each under the 10-minute limit of one call:
#
#   bash bench/gpu_suite.sh 1   # tests/functional, kernels, quantization, modules, ops and
#                               # the op registry's samples (tests/test_registry.py), less the
#                               # CPU cases of tests that also have a CUDA case and the files
#                               # that never name CUDA (CI runs those)
#   bash bench/gpu_suite.sh 2   # tests/distributed (NCCL on every GPU of the machine), fuzz,
#                               # the other top-level tests; the long runs (--long-runs) beside
#
# Part 2's long runs, started first, on cores left free by the suite: tests/test_long_run.py
# (the demo 2,000 steps per native FP8 recipe next to bf16, one process each, spread over the
# GPUs), the --long-runs cases of the FSDP2 FP8 primary weights and of the pipeline schedule.
# The other --long-runs cases are CPU compiles (every bad value compiled, Inductor on every CPU
# registry sample): `make test` covers their paths, `pytest --long-runs` on any machine runs them.
# Each part writes under $OUT its log, a JUnit XML and summary_<part>.md (counts, every failure
# with the first lines of its message, the 30 slowest tests) and durations_<part>.tsv (every
# test's seconds), packed into results.tgz. Run it whenever a change touches CUDA paths and
# record the summaries in bench/results/<date>/; a full part 1's durations_1.tsv replaces
# bench/gpu_durations.tsv.
set -uo pipefail
part=${1:?usage: bash bench/gpu_suite.sh 1|2}
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
pack() { (cd "$OUT" && tar czf results.tgz --remove-files --exclude results.tgz -- *.*); }
trap pack EXIT
trap 'exit 124' TERM INT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi -L | tee "$OUT/gpu_$part.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu_$part.txt"
CC=gcc CXX=g++ python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
# Workers on all cores but a few (Triton's compiles are host-bound), spread over the GPUs in
# part 1; part 2 leaves more for the long runs' training processes and their compiles.
workers=$(( $(nproc) - (part == 1 ? 4 : 10) ))
PYTEST=(python3 -m pytest -q -rfE -p no:cacheprovider --durations=30)
SERIAL=("${PYTEST[@]}")
# worksteal: idle workers take queued tests from busy ones (a few CUDA registry samples compile
# for minutes each).
python3 -c "import xdist" 2>/dev/null && PYTEST+=(-n "$workers" --dist worksteal)
export TE_COMPILE_TEST_WORLD=$(python3 -c "import torch; print(max(2, torch.cuda.device_count()))")
# SUITE_TIMEOUT: seconds for the whole part, the build included: at most the device call's limit
# (590 for a call of 600 s). The pytest runs stop 60 s before it: an interrupted xdist run takes
# up to the 30 s grace below to shut down, then the summary and results.tgz must still be written
# inside the call (a call killed at its limit returns neither, and leaves its workers running on
# the machine, which then measures nothing reliably).
budget=$(( ${SUITE_TIMEOUT:-590} - 60 ))
run() {  # name, pytest arguments... (PYTEST, or the array named by $RUNNER)
  local name=$1; shift
  local -n cmd=${RUNNER:-PYTEST}
  local left=$(( budget - SECONDS ))
  if [ "$left" -lt 30 ]; then echo "=== $name: not run, no time left" | tee "$OUT/$name.log"; return; fi
  echo "=== $name (timeout ${left}s)"
  # SIGINT: pytest stops as on Ctrl-C and still writes its XML and the slowest tests.
  timeout -s INT -k 30 "$left" "${cmd[@]}" --junitxml="$OUT/$name.xml" "$@" 2>&1 | tee "$OUT/$name.log" | tail -8
}
case $part in
  1) # The CPU cases of tests that also have a CUDA case are CI's (marker cpu_case), and so are
     # the files that never name CUDA (cpu_only: tests/conftest.py), about 14% of this part.
     # --balance-by: each worker starts on an equal share of the seconds the last run measured,
     # longest first (the registry's CUDA samples and the module compiles take minutes each);
     # collection order would queue them all on the first workers. The workers spread over the
     # GPUs (tests/conftest.py): none of part 1 needs two.
     export TE_COMPILE_TEST_SPREAD_GPUS=$(nvidia-smi -L | wc -l)
     run part1 -m "not cpu_case and not cpu_only" --balance-by bench/gpu_durations.tsv \
       tests/test_registry.py tests/modules tests/functional tests/kernels tests/quantization \
       tests/ops ;;
  2) # The long runs beside the suite: the part takes the longest of the three, not their sum.
     RUNNER=SERIAL run long_runs -s --long-runs tests/test_long_run.py -k gpu > /dev/null &
     RUNNER=SERIAL run long_cases --long-runs tests/distributed/test_fsdp_fp8_primary.py \
       tests/modules/test_pipeline_schedule.py > /dev/null &
     run part2 tests/distributed tests/fuzz tests/test_*.py --deselect tests/test_long_run.py \
       --deselect tests/test_registry.py --deselect tests/distributed/test_fsdp_fp8_primary.py
     wait ;;
  *) echo "part must be 1 or 2"; exit 2 ;;
esac
python3 bench/suite_summary.py "$OUT" "$part" | tee "$OUT/summary_$part.md"
