#!/usr/bin/env bash
# One unattended GPU session: the CUDA tests, then the kernel benchmarks.
# Usage: bash bench/gpu_suite.sh [tests|kernels|e2e|all]   (results -> bench/results, logs -> $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tinyserve-out}
mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TINYSERVE_CACHE_DIR=${TINYSERVE_CACHE_DIR:-/tmp/tinyserve-cache}
what=${1:-all}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
    git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $what == tests || $what == all ]]; then
    # Parallel workers share the one GPU; Triton and nvcc builds dominate the wall time.
    timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m requires_cuda -q -rfEs --tb=short \
        -p no:cacheprovider -n "${TEST_WORKERS:-6}" ${TESTS:-tests/kernels tests/kv tests/model tests/engine tests/offload} \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -60
fi

run_bench() {  # name, timeout seconds, args...
    local name=$1 limit=$2; shift 2
    echo "== bench/$name.py $*"
    timeout "$limit" python3 "bench/$name.py" "$@" > "$OUT/bench_$name.log" 2>&1
    echo "exit $?"; tail -25 "$OUT/bench_$name.log"
}
if [[ $what == kernels || $what == all ]]; then
    for b in ${KERNEL_BENCHES:-iso_attention nvfp4 gdn}; do
        [[ -f bench/$b.py ]] && run_bench "$b" "${BENCH_TIMEOUT:-150}"
    done
fi
if [[ $what == e2e || $what == all ]]; then
    [[ -f bench/e2e_offload.py ]] && run_bench e2e_offload 420
    [[ -f bench/decode_overhead.py ]] && run_bench decode_overhead 300
fi
cd bench/results && tar czf "$OUT/results.tgz" *.json 2>/dev/null; ls -la
