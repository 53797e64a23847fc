#!/usr/bin/env bash
# The lead's short GPU pass (fits a few minutes of a lent H200): build the CUDA ops, run the
# CUDA tests (kernel and ZeRO), each test file in its own process (a crash costs that file
# only, and is reported with the test it was running), and the CUDA AdamW benchmark; logs
# under $OUT. benchmarks/gpu_check.sh is the longer version (every CUDA test file, the
# kernel files in full, NCCL, sanitizer and flatten benchmarks).
set -x
OUT=${OUT:-/tmp/zero_ext_gpu_quick}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_quick.log") 2>&1
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 MAX_JOBS=16 ZERO_EXT_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/zx_ext PYTHONPATH="$PWD"
[ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
t0=$(date +%s)
timeout 150 python3 -c "
import time; t=time.time()
from zero_ext.kernels import _loader; print('native', _loader.ensure_loaded(), _loader._state['error'])
import torch; print('cuda kernels', _loader.native_available('fused_adamw_', 'cuda'), _loader.native_available('flatten_into', 'cuda'), round(time.time()-t), 's')
" 2>&1 | tail -5 | tee "$OUT/build.log"
echo "build took $(( $(date +%s) - t0 )) s"
: > "$OUT/tests.log"
for f in tests/test_zero_cuda.py tests/test_fused_adamw.py tests/test_flatten.py; do
  timeout 60 python3 -m pytest -v -rs -p no:cacheprovider --timeout 50 "$f" -k cuda \
    > "$OUT/tests_$(basename "$f" .py).log" 2>&1
  rc=$?
  sum=$(grep -E '^=+ .* in [0-9.]+s' "$OUT/tests_$(basename "$f" .py).log" | tail -1 | tr -d '=')
  case $rc in 0|1|5) ;; *) sum="ENDED rc=$rc, last test started: $(grep -oE '^tests/[^ ]+::[^ ]+' "$OUT/tests_$(basename "$f" .py).log" | tail -1)" ;; esac
  echo "$f -k cuda: $sum" | tee -a "$OUT/tests.log"
done
timeout 60 python3 benchmarks/bench_adamw.py --device cuda --groups 3 --reps 10 --max-seconds 2 \
  --out "$OUT/bench_cuda.md" 2>&1 | tail -30
echo "total $(( $(date +%s) - t0 )) s"
