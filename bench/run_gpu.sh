#!/usr/bin/env bash
# GPU runs in one device call: build, then the named steps, logs and results under $OUT.
#
#   bash bench/run_gpu.sh tests norm            # build, GPU test suite, norm benchmark
#   bash bench/run_gpu.sh tests:functional      # one part of the suite (tests/functional)
#   bash bench/run_gpu.sh activation mlp demo   # ...
#
# Steps: tests, tests:<part>, demo, linear, overhead, norm, activation, mlp, grouped, fp8, ops
# (`all`: the default list, in that order; split them over calls to stay inside the 10-minute limit of
# one call); fp8_loss (train_gpt 300 steps per FP8 recipe), fp8_loss_seeds (the FP8 loss
# criterion over three seeds); the diagnostics of bench/diag/: loss_diag, diag_host,
# diag_grouped_gemm, diag_grouped_delayed, diag_delayed_traced, diag_eager_host, diag_eager_pieces,
# diag_norm_host, diag_kernels, diag_hf_step, diag_sdpa_choice, diag_launch,
# diag_amax_passes, compile_time, tune_norm, tune_rotary, tune_quantize[:part], tune_group_columns;
# rope (bench_rope) and moe (bench_moe, MoE token routing), not in the default list;
# moe_layer (examples/moe_layer.py under FP8) and hf_llama (the converted Llama's FP8 speed).
# Each step writes one log under $OUT (a bench step also its .md/.json, --no-chart), packed into
# $OUT/results.tgz. long_runs: tests/test_long_run.py's GPU test (the demo 2,000 steps per native
# FP8 recipe against bf16; minutes). Carry `.whl` (expecttest, liger-kernel, torchao, pytest-xdist + execnet: not
# on the GPU image; bench/README.md). Not in the default list: block (bench_block, the
# transformer block step; one size per call, BENCH_ARGS="--size h1024", or the
# te.TransformerLayer stack: BENCH_ARGS="--arch layer --size l4096"), tp (bench_tp, needs 2
# GPUs; TP_ARGS="--mesh 1x1 4x1 2x2 --recipe none current" for more), tp_fp8 (FP8 current scaling
# on 1 GPU, all GPUs, and a TP x FSDP2 mesh), nccl_tests (tests/distributed -k nccl on 2 GPUs and
# on all GPUs at once).
set -uo pipefail
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
# No step named: nothing runs (the default list outlasts one 10-minute device call); `all` names
# the default list.
if [ ${#steps[@]} -eq 0 ]; then
  echo "bench/run_gpu.sh: name the steps to run (see the header of this file), or 'all'" >&2
  exit 2
fi
# At most 8 files come back from a device call: on exit (also when stopped by `timeout`) the
# logs and results are packed into one archive, results.tgz.
pack() { (cd "$OUT" && ls && tar czf results.tgz --remove-files --exclude results.tgz -- *.*); }
trap pack EXIT
trap 'exit 124' TERM INT
[ "${steps[*]}" != all ] || steps=(tests demo linear overhead norm activation mlp grouped fp8 ops)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The image's CC/CXX (/opt/gcc wrappers) build an extension whose C++ exceptions crash the
# process (seen 2026-11-22); the system gcc builds a working one.
CC=gcc CXX=g++ python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
# pytest-xdist (carried in .whl) spreads the suite over 8 workers sharing the GPU: the Triton
# compiles of the many kernel specialisations are host-bound. -rf lists failures by name.
PYTEST=(python3 -m pytest -q -rf -p no:cacheprovider)
python3 -c "import xdist" 2>/dev/null && PYTEST+=(-n 8)
for step in "${steps[@]}"; do
  echo "=== $step"
  case $step in
    tests) "${PYTEST[@]}" tests 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    tests:*)  # a part of the suite, e.g. tests:functional or tests:kernels (the whole suite with
              # every Triton specialisation compiling can outlast one 10-minute call)
      part=${step#tests:}
      "${PYTEST[@]}" "tests/$part" 2>&1 \
        | tee "$OUT/tests_${part//\//_}.log" | tail -25 ;;
    demo) timeout 240 python3 examples/train_gpt.py 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
            | tee "$OUT/demo.log" | tail -12 ;;
    long_runs)  # the GPU test of tests/test_long_run.py: the demo 2,000 steps per native recipe
                # next to bf16, one process each (no xdist: -s shows the losses)
      python3 -m pytest -q -rf -s -p no:cacheprovider tests/test_long_run.py --long-runs -k gpu 2>&1 \
        | tee "$OUT/long_runs.log" | tail -25 ;;
    fp8_loss)  # examples/train_gpt.py 300 steps per native recipe, run side by side,
               # with bf16 parameters and with fp32 master weights + bf16 autocast ("amp")
      runs=()
      for r in none current delayed block; do
        python3 examples/train_gpt.py --steps 300 --recipe $r --sample-chars 0 \
          > "$OUT/fp8_loss_$r.log" 2>&1 &
        python3 examples/train_gpt.py --steps 300 --recipe $r --sample-chars 0 \
          --dtype float32 --autocast bfloat16 > "$OUT/fp8_loss_amp_$r.log" 2>&1 &
        runs+=("$r" "amp_$r")
      done
      wait
      for r in "${runs[@]}"; do
        echo "$r: $(grep -E '^(final val loss|graph breaks)' "$OUT/fp8_loss_$r.log" | tr -s ' ' \
          | paste -sd ';')"
      done | tee "$OUT/fp8_loss.log" ;;
    fp8_loss_seeds)  # the FP8 loss criterion over seeds (fp32 master weights + bf16 autocast):
                     # every native recipe and none for three seeds (LOSS_RECIPES to choose),
                     # side by side on one GPU; LOSS_ARGS goes to every run (default: the
                     # criterion's config, 128 sequences a step at a peak lr of 5e-4; set it
                     # to "" for train_gpt's defaults)
      amp=(examples/train_gpt.py --steps 300 --sample-chars 0 --dtype float32 --autocast bfloat16)
      runs=()
      # An entry of LOSS_RECIPES may carry flags for its runs: "delayed:--fp8-margin=1".
      for seed in 1337 1 2; do
        for v in ${LOSS_RECIPES:-none current delayed block}; do
          r=${v%%:*}; extra=""; [ "$r" != "$v" ] && extra=${v#*:}
          name=$(echo "${v}" | tr -c 'A-Za-z0-9_\n' '_')
          python3 "${amp[@]}" --recipe $r --seed $seed ${extra//,/ } ${LOSS_ARGS---batch-size 128 --lr 5e-4} \
            > "$OUT/fp8_seed_${name}_$seed.log" 2>&1 &
          runs+=("${name}_$seed")
        done
      done
      wait
      for r in "${runs[@]}"; do
        echo "$r: $(grep -E '^(final val loss|graph breaks)' "$OUT/fp8_seed_$r.log" \
          | tr -s ' ' | paste -sd ';')"
      done | tee "$OUT/fp8_loss_seeds.log" ;;
    loss_diag)  # is a loss gap a gradient error: per-parameter gradient errors against float64,
                # then 300-step runs of train_gpt in variants side by side (one GPU)
      python3 -m bench.diag.diag_gpt_grads --out "$OUT" 2>&1 | tail -12
      tg=(examples/train_gpt.py --steps 300 --sample-chars 0)
      declare -A variants=(
        [bf16]="" [fp32]="--dtype float32" [current]="--recipe current"
        [current_fp32]="--recipe current --dtype float32" [bf16_eager]="--no-compile"
      )
      for v in "${!variants[@]}"; do
        python3 "${tg[@]}" ${variants[$v]} > "$OUT/loss_diag_$v.log" 2>&1 &
      done
      python3 -c "import runpy, sys, torch
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
sys.argv = ['train_gpt.py', *sys.argv[1:]]
runpy.run_path('examples/train_gpt.py', run_name='__main__')" "${tg[@]:1}" \
        > "$OUT/loss_diag_bf16_no_reduced_precision.log" 2>&1 &
      wait
      for f in "$OUT"/loss_diag_*.log; do
        echo "$(basename "$f" .log): $(grep -E '^(final val loss|graph breaks)' "$f" \
          | tr -s ' ' | paste -sd ';')"
      done | tee "$OUT/loss_diag.log" ;;
    diag_grouped_gemm)  # the GEMM ceiling of the FP8 GroupedLinear (bench/diag/diag_grouped_gemm.py)
      python3 -m bench.diag.diag_grouped_gemm 2>&1 | tee "$OUT/diag_grouped_gemm.log" ;;
    diag_grouped_delayed)  # the spread of the FP8 GroupedLinear's delayed row (bench/diag/diag_grouped_delayed.py)
      python3 -m bench.diag.diag_grouped_delayed ${DIAG_ARGS:-} 2>&1 | tee "$OUT/diag_grouped_delayed.log" ;;
    diag_eager_host)  # cProfile of a module's eager fwd+bwd per recipe (bench/diag/diag_eager_host.py)
      python3 -m bench.diag.diag_eager_host ${DIAG_ARGS:-} 2>&1 | tee "$OUT/diag_eager_host.log" \
        | grep "^===" ;;
    diag_eager_pieces)  # wall time per piece of te.Linear's eager call, no profiler (bench/diag/diag_eager_pieces.py)
      python3 -m bench.diag.diag_eager_pieces ${DIAG_ARGS:-} 2>&1 | tee "$OUT/diag_eager_pieces.log" ;;
    diag_norm_host)  # an eager norm's host time by layer, both autograd threadings (bench/diag/diag_norm_host.py)
      python3 -m bench.diag.diag_norm_host ${DIAG_ARGS:-} 2>&1 | tee "$OUT/diag_norm_host.log" ;;
    diag_delayed_traced)  # DelayedScaling's GEMM ops traced through on CUDA: misaligned
                          # _scaled_mm arguments, Inductor's reuses, errors against eager
      python3 -m bench.diag.diag_delayed_traced ${DIAG_ARGS:-} 2>&1 \
        | tee "$OUT/diag_delayed_traced.log" | tail -40 ;;
    compile_time)  # the first compiled step's phases (bench/diag/diag_compile_time.py), with
                   # the static launcher (te's default), then with Triton's (the variable at 0);
                   # DIAG_ARGS default: h1024, torch bf16 and te FP8 current / delayed (more
                   # than 100 s a launcher on an H200). Each row prints as it ends.
      ct=(python3 -m bench.diag.diag_compile_time --device cuda
          ${DIAG_ARGS:---size h1024 --rows torch-bf16 te-current te-delayed})
      "${ct[@]}" 2>&1 | tee "$OUT/compile_time_static.log" | grep "^|"
      TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=0 "${ct[@]}" 2>&1 \
        | tee "$OUT/compile_time_triton.log" | grep "^|" ;;
    diag_host)  # where the FP8 MLP step's time goes beyond its kernels (bench/diag/diag_host.py)
      python3 -m bench.diag.diag_host 2>&1 | tee "$OUT/diag_host.log" ;;
    tune_norm) python3 -m bench.diag.tune_norm 2>&1 | tee "$OUT/tune_norm.log" ;;
    tune_rotary)  # the RoPE kernel's launch parameters (bench/diag/tune_rotary.py)
      python3 -m bench.diag.tune_rotary 2>&1 | tee "$OUT/tune_rotary.log" ;;
    diag_launch)  # eager launch host time: direct against through Triton (bench/diag/diag_launch.py)
      python3 -m bench.diag.diag_launch 2>&1 | tee "$OUT/diag_launch.log" ;;
    diag_kernels)  # every kernel of eager vs compiled steps (bench/diag/diag_kernels.py)
      python3 -m bench.diag.diag_kernels 2>&1 | tee "$OUT/diag_kernels.log" ;;
    diag_hf_step)  # the HF Llama's compiled step against its conversion: wall vs kernel time
      python3 -m bench.diag.diag_hf_step 2>&1 | tee "$OUT/diag_hf_step.log" ;;
    diag_sdpa_choice)  # SDPA's kernel choice per layout, real and fake (bench/diag/diag_sdpa_choice.py)
      python3 -m bench.diag.diag_sdpa_choice 2>&1 | tee "$OUT/diag_sdpa_choice.log" ;;
    diag_amax_passes)  # one layer's per-tensor casts kernel by kernel, us and GB/s (bench/diag/diag_amax_passes.py)
      python3 -m bench.diag.diag_amax_passes 2>&1 | tee "$OUT/diag_amax_passes.log" ;;
    tune_group_columns)  # launches of the grouped FP8 wgrad's column cast (bench/diag/tune_group_columns.py)
      python3 -m bench.diag.tune_group_columns 2>&1 | tee "$OUT/tune_group_columns.log" ;;
    tune_quantize) python3 -m bench.diag.tune_quantize 2>&1 | tee "$OUT/tune_quantize.log" ;;
    tune_quantize:*)  # one part of the sweep: tune_quantize:pertensor or tune_quantize:block
      python3 -m bench.diag.tune_quantize "${step#tune_quantize:}" 2>&1 \
        | tee "$OUT/tune_quantize_${step#tune_quantize:}.log" ;;
    linear|overhead|norm|activation|rope|moe|mlp|grouped|fp8|ops)
      python3 -m "bench.bench_$step" --out "$OUT" --no-chart ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_$step.log" \
        | grep -v "^  \[" | tail -60 ;;
    block)  # Llama-style stack fwd+bwd + compile time (bench/bench_block.py); all three sizes
            # outlast one call: BENCH_ARGS="--size h1024" (or --modes / --precisions) per call;
            # the te.TransformerLayer stack (GQA, RoPE): BENCH_ARGS="--arch layer --size l4096"
      python3 -m bench.bench_block --out "$OUT" --no-chart ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_block.log" \
        | grep -v "^  \[" | tail -60 ;;
    moe_layer)  # examples/moe_layer.py (64 experts, top-2, hidden 4096) in bf16 and under FP8
                # current (split and fast backward accumulation) and delayed scaling, against
                # the plain-PyTorch bf16 layer; with FP8 expert weights too (--fp8-weights)
      python3 examples/moe_layer.py --recipe current current_fast delayed --fp8-weights 2>&1 \
        | grep -v Warn \
        | tee "$OUT/moe_layer.log" | tail -10 ;;
    hf_llama)  # examples/convert_hf_llama.py at issue 41's size (hidden 2048, 8 layers, 32 / 8
               # heads, ffn 8192, 4 x 2048 tokens), FP8 current and delayed against transformers
      python3 examples/convert_hf_llama.py --hidden 2048 --layers 8 --heads 32 --kv-heads 8 \
        --ffn 8192 --batch 4 --seq 2048 --steps 1 --iters 20 --recipes ${HF_RECIPES:-current delayed} \
        2>&1 | grep -v Warn | tee "$OUT/convert_hf_llama.log" | tail -12 ;;
    tp)  # TP=1 vs TP=2 (+SP) through examples/tensor_parallel.py under torchrun: needs 2 GPUs
      python3 -m bench.bench_tp --out "$OUT" ${TP_ARGS:-} 2>&1 | tee "$OUT/bench_tp.log" | tail -30 ;;
    tp_fp8)  # FP8 (current scaling) on 1 GPU, TP=all GPUs and a TP x FSDP2 mesh
      n=$(nvidia-smi -L | wc -l)
      python3 -m bench.bench_tp --out "$OUT" --tag fp8 --recipe current --no-sequence-parallel \
        --mesh 1x1 "${n}x1" $([ "$n" -ge 4 ] && echo "$((n / 2))x2") 2>&1 \
        | tee "$OUT/bench_tp_fp8.log" | tail -30 ;;
    nccl_tests)  # tests/distributed with NCCL on 2 GPUs and, at the same time, on all of them
      n=$(nvidia-smi -L | wc -l)
      nccl=(python3 -m pytest -q -rf -p no:cacheprovider -k "nccl or example" tests/distributed)
      CUDA_VISIBLE_DEVICES=0,1 TE_COMPILE_TEST_WORLD=2 "${nccl[@]}" \
        > "$OUT/tests_nccl_2gpus.log" 2>&1 &
      if [ "$n" -gt 2 ]; then
        TE_COMPILE_TEST_WORLD=$n "${nccl[@]}" > "$OUT/tests_nccl_${n}gpus.log" 2>&1
      fi
      wait
      tail -n 4 "$OUT"/tests_nccl_*.log ;;
    *) echo "unknown step $step" ;;
  esac
done
