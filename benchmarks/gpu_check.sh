#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (bare machine, no network), in sections run in this
# order (see "main" at the end; a new check is one more section_* function and one line there):
#   env           versions, GPU, tools
#   build         the full JIT build of csrc/ (CPU + CUDA sources)
#   tests         every test file with CUDA tests, EACH IN ITS OWN PROCESS (a crash costs that
#                 file only): the kernel files in full (their CPU error paths run with the CUDA
#                 library loaded), the others with -k cuda; one summary line per file, in
#                 $OUT/tests_summary.txt and again at the end of the log
#   bench_adamw   FusedAdamW vs torch on CUDA, and the masters kernel
#   bench_flatten flatten / unflatten vs torch.cat / copy_ on CUDA
#   gpt2_host     GPT-2 small (bf16 autocast, 8 x 1024 tokens, NCCL, world 1): ms per
#                 iteration for DDP + AdamW(fused), DDP + torch's Python allreduce_hook,
#                 zero_ext even, + reduce_scatter_hook, + hook + overlap_param_gather, as
#                 ratios to DDP in the same run (benchmarks/bench_host_cost.py --gpt2-cuda)
#   offload       offload_optimizer (issue 46): GPT-2 small and medium, world 1, ms per
#                 iteration and peak device memory without the option, with it (whole share,
#                 0.5, 0.25; the hook's per-bucket copies; without the hook), against DDP +
#                 AdamW, parity, pinned buffers (benchmarks/offload_gpu_check.py); then the
#                 host step and the device-host copies against a plain copy_
#                 (benchmarks/bench_offload.py --device cuda); and the offload tests' CUDA
#                 cases (tests/test_offload_cuda.py)
#   nccl          reduce_scatter_hook on NCCL (benchmarks/nccl_hook_check.py)
#   sanitizer     compute-sanitizer memcheck of the CUDA kernel tests (fused AdamW op and
#                 plan, flatten)
# Everything is tee'd under $OUT: gpu_check.log (all of it), build.log, tests/<file>.log,
# tests_summary.txt, nccl_hook_check.*, bench_cuda.md, offload.md, sanitizer.log.
# GPU_CHECK_SECTIONS="env build offload" runs only those sections (in the order below). A failed step is logged
# and the script goes on. Every step's timeout is cut to what is left of a 540 s budget, so
# the whole script ends in about 9 minutes at worst (expected 7-9: see "main" at the end).
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
set -x
set -o pipefail
OUT=${OUT:-/tmp/zero_ext_gpu_check}
mkdir -p "$OUT/tests"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MAX_JOBS=16
export ZERO_EXT_BUILD_CUDA=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/zero_ext_torch_extensions}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
elapsed() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
# limit WANTED: print min(WANTED, budget left - 5), or 0 when less than 15 s are left
limit() { local left=$(( BUDGET - ($(date +%s) - T0) - 5 )); local w=$1
          [ "$left" -lt 15 ] && { echo 0; return; }; [ "$w" -lt "$left" ] && echo "$w" || echo "$left"; }
run() { # run WANTED_SECONDS LABEL CMD...: bounded, logged, never fatal
  local t; t=$(limit "$1"); local label=$2; shift 2
  if [ "$t" = 0 ]; then elapsed "SKIPPED (no time left): $label"; return 1; fi
  elapsed "START ($t s max): $label"
  timeout "$t" "$@"; local rc=$?
  [ $rc = 0 ] && elapsed "OK: $label" || elapsed "FAILED rc=$rc: $label"
  return $rc
}

section_env() {
  elapsed "environment"
  git log --oneline -1 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
  $PY -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" || true
  which nvcc ninja; nvcc --version | tail -2; c++ --version | head -1
  $PY -c "import ninja" 2>/dev/null || which ninja || echo "WARNING: no ninja: the JIT build will fail (carry a ninja wheel)"
  $PY -c "import pytest, pytest_timeout; print('pytest', pytest.__version__)" || echo "WARNING: pytest/pytest-timeout missing"
}

BUILD_PY='
import sys, time
t = time.time()
from zero_ext.kernels import _loader
print("LIBRARY", _loader.jit_build(True, verbose=True))
print("CUDA build OK in %.0f s" % (time.time() - t))
'
section_build() {
  run 270 "full JIT build of csrc/ (CPU + CUDA sources)" \
    bash -o pipefail -c "$PY -c '$BUILD_PY' 2>&1 | tee $OUT/build.log"
  if [ $? != 0 ]; then
    # a colleague's half-finished file must not hide the fused AdamW results
    export ZERO_EXT_JIT_SOURCES=fused_adamw_cpu.cpp,fused_adamw.cu
    export ZERO_EXT_JIT_NAME=zero_ext_adamw_only_cuda
    run 150 "fallback build: fused AdamW sources only" \
      bash -o pipefail -c "$PY -c '$BUILD_PY' 2>&1 | tee -a $OUT/build.log"
  fi
  grep -iE "warning|error" "$OUT/build.log" | head -40
  # what the library exports (should be nothing: docs/build.md, "What the library exports")
  local lib; lib=$(awk '/^LIBRARY/ {print $2}' "$OUT/build.log" | tail -1)
  [ -n "$lib" ] && echo "exported symbols of $lib: $(nm -D --defined-only "$lib" | wc -l)"
}

# test_file SECONDS FILE [PYTEST ARGS...]: one test file in its own process, bounded; its
# output in $OUT/tests/<name>.log; one summary line (pytest's own, or how it ended and the
# test it was running) in the log and in $OUT/tests_summary.txt
test_file() {
  local t=$1 f=$2; shift 2
  local log; log="$OUT/tests/$(basename "$f" .py).log"
  rm -f "$log"
  run "$t" "$f $*" bash -c "$PY -m pytest $f $* -v -rs -p no:cacheprovider --timeout 120 > $log 2>&1"
  local rc=$? sum how ended=1
  if [ ! -f "$log" ]; then
    printf '%-48s %s\n' "$f${*:+ $*}" "SKIPPED (no time left)" | tee -a "$OUT/tests_summary.txt"; return
  fi
  sum=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | xargs)
  case $rc in 0|1|5) [ -n "$sum" ] && ended=0 ;; esac  # pytest's own ends: pass, fail, none
  if [ $ended = 1 ]; then  # killed (a crash: signal), timed out, or pytest could not run
    how="pytest error"; [ "$rc" -gt 128 ] && how="signal $(( rc - 128 ))"
    [ "$rc" = 124 ] && how="timed out"
    local at; at=$(grep -oE '^tests/[^ ]+::[^ ]+' "$log" | tail -1)
    sum="ENDED rc=$rc ($how), last test started: ${at:-none}"
    tail -25 "$log"; echo
  elif [ "$rc" = 1 ]; then
    grep -E "^(FAILED|ERROR) " "$log" | head -20
  fi
  printf '%-48s %s\n' "$f${*:+ $*}" "$sum" | tee -a "$OUT/tests_summary.txt"
}

# The kernel test files run in full: their CPU tests (bad-input messages included) run with
# the CUDA library loaded, where the crash of issue 38 was seen.
KERNEL_FILES="tests/test_flatten.py tests/test_fused_adamw.py tests/test_fused_adamw_masters.py tests/test_fused_adamw_plan.py tests/test_native_status.py tests/test_cuda_build.py"
section_tests() {
  : > "$OUT/tests_summary.txt"
  local f candidates cuda_files
  for f in $KERNEL_FILES; do test_file 75 "$f"; done
  # every other file with tests selected by -k cuda (collected among the files that name
  # CUDA at all: fewer imports than collecting the whole suite)
  candidates=$(grep -l -i cuda tests/test_*.py | tr '\n' ' ')
  cuda_files=""
  [ "$(limit 60)" != 0 ] && cuda_files=$(timeout "$(limit 60)" $PY -m pytest --collect-only -q \
      -k cuda $candidates -p no:cacheprovider 2>/dev/null | grep '::' | cut -d: -f1 | sort -u)
  [ -n "$cuda_files" ] || cuda_files="tests/test_zero_cuda.py tests/test_checkpoint.py tests/test_mutation_gaps.py"
  for f in $cuda_files; do
    case " $KERNEL_FILES " in *" $f "*) continue ;; esac
    test_file 60 "$f" -k cuda
  done
  elapsed "test files, one process each:"
  cat "$OUT/tests_summary.txt"
}

section_nccl() {
  # reduce_scatter_hook on NCCL, one rank per GPU (world 1 on a one-GPU machine: every code
  # path, nothing moved between GPUs): parity with DDP + AdamW, then ms/iter and peak memory
  local ngpu; ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); [ "$ngpu" -ge 1 ] || ngpu=1
  run 120 "reduce_scatter_hook on NCCL, world $ngpu (benchmarks/nccl_hook_check.py)" \
    bash -o pipefail -c "$PY -m torch.distributed.run --nproc-per-node=$ngpu --rdzv-backend=c10d --rdzv-endpoint=localhost:0 benchmarks/nccl_hook_check.py --out $OUT 2>&1 | tee $OUT/nccl_hook_check.log"
}

section_bench_adamw() {
  run 110 "bench_adamw --device cuda" \
    $PY benchmarks/bench_adamw.py --device cuda --reps 20 --max-seconds 3 --out "$OUT/bench_cuda.md"
  run 45 "bench_adamw --mode masters --device cuda (bf16 + fp32 masters vs a same-bytes copy)" \
    bash -o pipefail -c "$PY benchmarks/bench_adamw.py --mode masters --device cuda 2>&1 | tee -a $OUT/bench_cuda.md"
}

section_bench_flatten() {
  run 45 "bench_flatten --device cuda" \
    bash -o pipefail -c "$PY benchmarks/bench_flatten.py --device cuda 2>&1 | tee -a $OUT/bench_cuda.md"
}

section_gpt2_host() {
  run 100 "GPT-2 small host cost, world 1 (bench_host_cost.py --gpt2-cuda)" \
    bash -o pipefail -c "$PY benchmarks/bench_host_cost.py --gpt2-cuda --rounds 3 --iters 10 2>&1 | tee $OUT/gpt2_host.md"
}

section_offload() {
  run 150 "offload_optimizer: GPT-2 small and medium, world 1 (offload_gpu_check.py)" \
    bash -o pipefail -c "$PY benchmarks/offload_gpu_check.py --models small,medium --out $OUT 2>&1 | tee $OUT/offload.md"
  run 90 "offload_optimizer: host step and device-host copies (bench_offload.py --device cuda)" \
    bash -o pipefail -c "$PY benchmarks/bench_offload.py --device cuda --threads $(nproc) --reps 5 --max-seconds 5 2>&1 | tee -a $OUT/offload.md"
  test_file 90 tests/test_offload_cuda.py
}

section_sanitizer() {
  which compute-sanitizer >/dev/null 2>&1 || { elapsed "no compute-sanitizer: skipped"; return; }
  run 75 "compute-sanitizer memcheck: CUDA fused AdamW (op and plan) and flatten tests" \
    bash -o pipefail -c "compute-sanitizer --tool memcheck --print-limit 20 $PY -m pytest tests/test_fused_adamw.py tests/test_fused_adamw_plan.py tests/test_flatten.py -q -p no:cacheprovider -k 'cuda and (misaligned or many_segments or matches_reference or plan or large_tensors)' 2>&1 | tail -40 | tee $OUT/sanitizer.log"
}

# main: the sections in order; a section that finds too little of the budget left is skipped
# (logged), so the ones that matter most come first. Expected seconds on the H200 (not all
# measured yet): env 5, build 35-45, tests 180-240 (ten processes), bench_adamw 60-100,
# bench_flatten 20-30, gpt2_host 40-70, offload 120-240 (not measured yet), nccl 40-60,
# sanitizer 40-75.
for s in env build tests bench_adamw bench_flatten gpt2_host offload nccl sanitizer; do
  case " ${GPU_CHECK_SECTIONS:-$s} " in *" $s "*) "section_$s" ;; esac
done
elapsed "done"
echo "test files, one process each:"; cat "$OUT/tests_summary.txt"
sleep 1  # let tee flush the log before $OUT is collected
