#!/usr/bin/env bash
# The hybrid expert path on a GPU machine in one go: numba from a carried site directory
# (.whl/site.tar.xz: the numba and llvmlite wheels unpacked, where the machine has no
# numba), the CPU kernel, hybrid and offloaded-engine tests, then bench/hybrid_experts.py on
# the full-size random checkpoint (which it writes unless it is there), after
# bench/cpu_round_trip.py (with the worker's own idle spin and with none); ~420 s. The fair
# case runs in a call of its own (`python3 bench/hybrid_experts.py --cases fair`, ~350 s).
# Logs and the result JSONs in $OUT. TINYSERVE_BENCH_COMMIT names the commit in the results
# where the copied tree's .git may lag behind it.
#   OUT=dir [CKPT=dir] [TINYSERVE_BENCH_COMMIT=sha] bash bench/device/hybrid.sh [arguments of
#   bench/hybrid_experts.py]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinyserve-out}; CKPT=${CKPT:-/tmp/tinyserve-fullsize}
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
if ! python3 -c "import numba" 2>/dev/null && [[ -f .whl/site.tar.xz ]]; then
    mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; python3 -V
  python3 -c "import numba, torch; print(numba.__version__, torch.__version__)"; } \
    > "$OUT/env.txt" 2>&1
t0=$SECONDS
timeout -s INT 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nvfp4_cpu.py \
    tests/kernels/test_cpu_exchange.py \
    tests/offload/test_hybrid.py tests/offload/test_hybrid_cuda.py \
    tests/engine/test_offload_engine.py tests/engine/test_offload_engine_cuda.py \
    > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/tests.log"
t0=$SECONDS
timeout -s INT 90 python3 bench/cpu_round_trip.py --out "$OUT/cpu_round_trip.json" \
    > "$OUT/cpu_round_trip.log" 2>&1
timeout -s INT 90 python3 bench/cpu_round_trip.py --spin 0 --out "$OUT/cpu_round_trip_nospin.json" \
    >> "$OUT/cpu_round_trip.log" 2>&1
echo "round trip rc=$? in $((SECONDS - t0)) s"; cat "$OUT"/cpu_round_trip*.log | grep -v Warn
t0=$SECONDS
timeout -s INT 350 python3 bench/hybrid_experts.py --ckpt "$CKPT" --out "$OUT/hybrid_experts.json" \
    "$@" > "$OUT/hybrid_experts.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"; tail -30 "$OUT/hybrid_experts.log"
