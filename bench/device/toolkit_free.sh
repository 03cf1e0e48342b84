#!/usr/bin/env bash
# The GPU suite as a laptop user's machine has it: no CUDA toolkit (nvcc) and no C++ compiler on
# PATH, empty kernel caches. Runs, side by side on the one GPU: the CUDA suite natively (sm_90
# cubins from NVRTC), and the CUDA-kernel tests in each older generation's mode
# (TINYSERVE_CUDA_ARCH=sm_80 / sm_86 / sm_89: PTX for that generation, its code paths).
# With GRAPH=1, beside them, one case at a time (two resident full-size engines do not fit an
# 80 GB card beside the suites): the full-size checkpoint written to $TINYSERVE_FULLSIZE_DIR
# unless it is there, then the full-size graph == eager test natively (iso3 at 6 GiB first,
# then the other three cases) and in each generation's mode (iso3, then bf16; experts
# resident), every case into bench/results/fullsize_graph.json.
#   OUT=dir [GRAPH=1] [LIMIT=s] [ARCHS="sm_86 sm_80 sm_89"] bash bench/device/toolkit_free.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinyserve-out}
mkdir -p "$OUT" /tmp/hidden
export PYTHONUNBUFFERED=1
export TINYSERVE_FULLSIZE_DIR=${TINYSERVE_FULLSIZE_DIR:-/tmp/tinyserve-fullsize}
CKPT=$TINYSERVE_FULLSIZE_DIR
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
T0=$SECONDS
SEL=(-m "requires_cuda or gpu_shapes" -q -rfEs --tb=short -p no:cacheprovider)
env -u TINYSERVE_FULLSIZE_DIR timeout -s INT -k 20 "$LIMIT" python3 -m pytest "${SEL[@]}" \
    -n "${WORKERS:-8}" tests/kernels tests/kv tests/model tests/engine tests/offload \
    tests/server tests/reliability > "$OUT/suite_native.log" 2>&1 &
ARCHS=${ARCHS-sm_86 sm_80 sm_89}  # ARCHS="": the native suite alone (an 80 GB card)
for arch in $ARCHS; do
    TINYSERVE_CUDA_ARCH=$arch timeout -s INT -k 20 "$LIMIT" python3 -m pytest "${SEL[@]}" -n 2 \
        -k "iso or nvfp4 or moe or cuda" tests/kernels tests/kv tests/model/test_cuda_model.py \
        > "$OUT/suite_$arch.log" 2>&1 &
done

graph() {  # log name, then pytest arguments: the full-size graph == eager cases
    local name=$1; shift
    local left=$((LIMIT - (SECONDS - T0)))
    if ((left < 60)); then echo "== $name: not started (time limit)" >> "$OUT/graph.txt"; return; fi
    TINYSERVE_WRITE_RESULTS=1 timeout -s INT -k 20 "$left" python3 -m pytest -q -rfEsx \
        --tb=short -p no:cacheprovider -m "requires_cuda and slow" "$@" \
        tests/engine/test_fullsize_graph.py > "$OUT/graph_$name.log" 2>&1
    echo "== $name ($((SECONDS - T0)) s): $(tail -n 1 "$OUT/graph_$name.log")" >> "$OUT/graph.txt"
}
if [[ ${GRAPH:-0} == 1 ]]; then
    if [[ ! -f $CKPT/config.json ]]; then
        python3 -m bench.fullsize "$CKPT.partial" > "$OUT/checkpoint.log" 2>&1 \
            && mv "$CKPT.partial" "$CKPT"
        echo "checkpoint written at $((SECONDS - T0)) s" >> "$OUT/graph.txt"
    fi
    (
        graph native_iso3_6GiB -k "iso3 and 6GiB"
        graph native -k "not (iso3 and 6GiB)"
        for kv in iso3 bf16; do
            for arch in $ARCHS; do
                TINYSERVE_CUDA_ARCH=$arch graph "${kv}_$arch" -k "$kv and resident"
            done
        done
    ) &
fi
wait
for f in "$OUT"/suite_*.log; do echo "== $f"; tail -n 25 "$f"; done
[[ -f $OUT/graph.txt ]] && cat "$OUT/graph.txt"
cp bench/results/fullsize_graph.json "$OUT/" 2>/dev/null
true
