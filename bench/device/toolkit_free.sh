#!/usr/bin/env bash
# The GPU suite as a laptop user's machine has it: no CUDA toolkit (nvcc) and no C++ compiler on
# PATH, empty kernel caches. Runs, side by side on the one GPU: the CUDA suite natively (sm_90
# cubins from NVRTC), and the CUDA-kernel tests in each older generation's mode
# (TINYSERVE_CUDA_ARCH=sm_80 / sm_86 / sm_89: PTX for that generation, its code paths).
#   OUT=dir bash bench/device/toolkit_free.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinyserve-out}
mkdir -p "$OUT" /tmp/hidden
export PYTHONUNBUFFERED=1
for tool in nvcc g++ c++ clang++; do
    while p=$(command -v "$tool"); do mv "$p" "/tmp/hidden/$(echo "$p" | tr / _)" || break; done
done
export TINYSERVE_CACHE_DIR=$(mktemp -d /tmp/ts-cache.XXXX) TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cache.XXXX)
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    git rev-parse HEAD 2>/dev/null; git status --short | head -5
    for t in nvcc g++ c++ gcc; do echo "$t: $(command -v $t || echo 'not on PATH')"; done
    python3 -c 'from tinyserve.kernels import cuda_build as c; print("nvrtc", c.nvrtc(), c.nvrtc_version())'
} 2>&1 | tee "$OUT/env.txt"
LIMIT=${LIMIT:-480}
SEL=(-m "requires_cuda or gpu_shapes" -q -rfEs --tb=short -p no:cacheprovider)
timeout -s INT -k 20 "$LIMIT" python3 -m pytest "${SEL[@]}" -n "${WORKERS:-8}" \
    tests/kernels tests/kv tests/model tests/engine tests/offload > "$OUT/suite_native.log" 2>&1 &
for arch in sm_86 sm_80 sm_89; do
    TINYSERVE_CUDA_ARCH=$arch timeout -s INT -k 20 "$LIMIT" python3 -m pytest "${SEL[@]}" -n 2 \
        -k "iso or nvfp4 or moe or cuda" tests/kernels tests/kv tests/model/test_cuda_model.py \
        > "$OUT/suite_$arch.log" 2>&1 &
done
wait
for f in "$OUT"/suite_*.log; do echo "== $f"; tail -n 25 "$f"; done
