#!/usr/bin/env bash
# Greedy tokens and decode speed of the full-size random checkpoint along every kernel build
# path (bench/kernel_paths.py, one JSON line each into $OUT/kernel_paths.jsonl):
#   1. $OLD (a checkout of the previous release, nvcc build) with the toolkit on PATH;
#   2. this checkout with nvcc and g++ moved out of reach and empty kernel caches: iso3 and
#      bf16, all experts resident and at --gpu-memory 6GiB (one at a time: their speeds are
#      compared; runs that pin the 17 GiB expert store at once ran past their limits);
#   3. each older generation's code (TINYSERVE_CUDA_ARCH=sm_80 / sm_86 / sm_89), experts
#      resident, side by side (their tokens are compared; their speeds, taken together on one
#      GPU, are not).
#   OUT=dir [OLD=dir] [CKPT=dir] bash bench/device/fullsize_paths.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinyserve-out}; CKPT=${CKPT:-/tmp/tinyserve-fullsize}
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
ROWS=$OUT/kernel_paths.jsonl
if [[ ! -f $CKPT/config.json ]]; then
    t0=$SECONDS
    python3 -m bench.fullsize "$CKPT.partial" > "$OUT/checkpoint.log" 2>&1 \
        && mv "$CKPT.partial" "$CKPT"
    echo "checkpoint written in $((SECONDS - t0)) s"
fi
paths() {  # label, then kernel_paths.py arguments
    local label=$1; shift
    timeout -s INT 240 python3 bench/kernel_paths.py "$CKPT" --label "$label" --out "$ROWS" "$@" \
        > "$OUT/paths_${label// /_}.log" 2>&1 || echo "FAILED: $label (log paths_${label// /_}.log)"
}
if [[ -n ${OLD:-} ]]; then
    PYTHONPATH=$OLD TINYSERVE_CACHE_DIR=$(mktemp -d) paths "nvcc previous" --kv iso3
    PYTHONPATH=$OLD TINYSERVE_CACHE_DIR=$(mktemp -d) paths "nvcc previous 6GiB" --kv iso3 \
        --gpu-memory 6GiB
fi
mkdir -p /tmp/hidden
for tool in nvcc g++ c++ clang++; do
    while p=$(command -v "$tool"); do mv "$p" "/tmp/hidden/$(echo "$p" | tr / _)" || break; done
done
export TINYSERVE_CACHE_DIR=$(mktemp -d /tmp/ts-cache.XXXX) TRITON_CACHE_DIR=$(mktemp -d /tmp/tr.XXXX)
paths "nvrtc iso3" --kv iso3
paths "nvrtc bf16" --kv bf16
paths "nvrtc iso3 6GiB" --kv iso3 --gpu-memory 6GiB
paths "nvrtc bf16 6GiB" --kv bf16 --gpu-memory 6GiB
for arch in sm_80 sm_86 sm_89; do
    TINYSERVE_CUDA_ARCH=$arch paths "$arch iso3" --kv iso3 &
done
wait
python3 - "$ROWS" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ref = {}
for r in rows:
    key = (r["kv"], r["gpu_memory"])
    ref.setdefault(key, r["greedy_tokens"])
    same = r["greedy_tokens"] == ref[key]
    print(f"{r['label']:<18} {r['kv']:<5} {str(r['gpu_memory']):<5} decode "
          f"{r['decode_tok_s'] or 0:7.1f} tok/s, step {r['decode_step_ms'] or 0:6.2f} ms, "
          f"startup {r['startup_s']:5.1f} s, tokens {'same' if same else 'DIFFERENT'} "
          f"{r['greedy_tokens'][:8]}")
PY
