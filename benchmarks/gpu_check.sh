#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (bare machine, no network): build the CUDA ops
# (JIT), run every CUDA test in tests/, reduce_scatter_hook on NCCL, then the CUDA kernel
# benchmarks. Everything is tee'd under $OUT (gpu_check.log = all of it; build.log,
# tests.log, nccl_hook_check.*, bench_cuda.md, sanitizer.log); a failed step is logged and the script goes on. Every step's timeout is
# cut to what is left of a 540 s budget, so the whole script ends in about 9 minutes at
# worst (normally 3-5).
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
set -x
set -o pipefail
OUT=${OUT:-/tmp/zero_ext_gpu_check}
mkdir -p "$OUT"
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

elapsed "environment"
git log --oneline -1 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" || true
which nvcc ninja; nvcc --version | tail -2
$PY -c "import ninja" 2>/dev/null || which ninja || echo "WARNING: no ninja: the JIT build will fail (carry a ninja wheel)"
$PY -c "import pytest, pytest_timeout; print('pytest', pytest.__version__)" || echo "WARNING: pytest/pytest-timeout missing"

BUILD_PY='
import sys, time
t = time.time()
from zero_ext.kernels import _loader
_loader.jit_build(True, verbose=True)
print("CUDA build OK in %.0f s" % (time.time() - t))
'
run 270 "full JIT build of csrc/ (CPU + CUDA sources)" \
  bash -c "$PY -c '$BUILD_PY' 2>&1 | tee $OUT/build.log"
if [ $? != 0 ]; then
  # a colleague's half-finished file must not hide the fused AdamW results
  export ZERO_EXT_JIT_SOURCES=fused_adamw_cpu.cpp,fused_adamw.cu
  export ZERO_EXT_JIT_NAME=zero_ext_adamw_only_cuda
  run 150 "fallback build: fused AdamW sources only" \
    bash -c "$PY -c '$BUILD_PY' 2>&1 | tee -a $OUT/build.log"
fi
grep -iE "warning|error" "$OUT/build.log" | head -40

run 90 "every CUDA test in tests/ (-k cuda)" \
  bash -c "$PY -m pytest tests -k cuda -v -rs -p faulthandler --timeout 60 -p no:cacheprovider 2>&1 | tee $OUT/tests.log"
# (-v and faulthandler: a test that crashes the process is named in the log)
run 80 "kernel test files in full (CPU + CUDA, masters included)" \
  bash -c "$PY -m pytest tests/test_fused_adamw.py tests/test_fused_adamw_masters.py -v -rs -p faulthandler --timeout 50 -p no:cacheprovider 2>&1 | tee -a $OUT/tests.log"

# reduce_scatter_hook on NCCL, one rank per GPU (world 1 on a one-GPU machine: every code
# path, nothing moved between GPUs): parity with DDP + AdamW, then ms/iter and peak memory
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); [ "$NGPU" -ge 1 ] || NGPU=1
run 120 "reduce_scatter_hook on NCCL, world $NGPU (benchmarks/nccl_hook_check.py)" \
  bash -c "$PY -m torch.distributed.run --nproc-per-node=$NGPU --rdzv-backend=c10d --rdzv-endpoint=localhost:0 benchmarks/nccl_hook_check.py --out $OUT 2>&1 | tee $OUT/nccl_hook_check.log"

run 110 "bench_adamw --device cuda" \
  $PY benchmarks/bench_adamw.py --device cuda --reps 20 --max-seconds 3 --out "$OUT/bench_cuda.md"
run 60 "bench_adamw --mode masters --device cuda (bf16 + fp32 masters vs a same-bytes copy)" \
  bash -c "$PY benchmarks/bench_adamw.py --mode masters --device cuda 2>&1 | tee -a $OUT/bench_cuda.md"
for b in benchmarks/bench_flatten.py; do  # colleagues' kernel benchmarks that take --device
  [ -f "$b" ] && grep -q -- "--device" "$b" && \
    run 45 "$b --device cuda" bash -c "$PY $b --device cuda 2>&1 | tee -a $OUT/bench_cuda.md"
done

if which compute-sanitizer >/dev/null 2>&1; then
  run 75 "compute-sanitizer memcheck: CUDA fused AdamW tests" \
    bash -c "compute-sanitizer --tool memcheck --print-limit 20 $PY -m pytest tests/test_fused_adamw.py -q -p no:cacheprovider -k 'cuda and (misaligned or many_segments or matches_reference)' 2>&1 | tail -40 | tee $OUT/sanitizer.log"
fi
elapsed "done"
sleep 1  # let tee flush the log before $OUT is collected
