#!/usr/bin/env bash
# One unattended GPU session: the CUDA tests, the kernel benchmarks and the full-size
# end-to-end checks, every log and result kept in ONE file.
#
#   bash bench/gpu_suite.sh [PART|STEP ...]        (default: all)
#   DRY=1 bash bench/gpu_suite.sh all              print the steps and their limits only
#
# Output: $OUT/gpu_suite.tar.gz (default OUT=/tmp/tinyserve-out) holding env.txt,
# summary.txt (one line per step: exit code, seconds), logs/<step>.log, results/*.json (every
# bench/results JSON after the run) and cli/*.json; rewritten after every step, so a run cut
# short still returns what finished. Each step runs under `timeout -s INT` (Python prints its
# summary / writes its JSON on the interrupt); the whole run stops starting steps once
# SUITE_LIMIT seconds (default 570: under a 10-minute command limit) are nearly spent.
#
# Parts -> steps, with the expected wall time on one H200 (first run of a fresh machine:
# Triton and NVRTC builds included; the checkpoint in page cache after its first read):
#   tests    gpu_tests        ~4 min    pytest -m "requires_cuda or gpu_shapes",
#                                       $TEST_WORKERS (6) workers (742 passed and xfailed
#                                       in 3:42 with 10 workers on 2026-11-30)
#   kernels  bench_iso_attention, bench_nvfp4, bench_gdn      ~1-2 min each (150 s cap)
#            bench_kv_decode  (not in the default list: KERNEL_BENCHES="kv_decode" or the step
#                             name) bf16 paged / bf16 SDPA / iso3 decode attention
#   e2e      checkpoint       ~1-3 min  write the full-size random 35B-A3B checkpoint (~21 GB)
#                                       to $TINYSERVE_FULLSIZE_DIR unless it is there
#            fullsize_graph   ~4-5 min  tests/engine/test_fullsize_graph.py: graph vs eager
#                                       tokens, iso3/bf16 x resident/6GiB, 4 fresh processes
#                                       -> results/fullsize_graph.json
#            memory_budget    ~4-6 min  bench/memory_budget.py CKPT: the process's device
#                                       memory (NVML) through load, a 100k-token prompt and
#                                       decode at 6 and 4 GiB -> results/memory_budget.json
#            step_profile     ~2.5 min  bench/step_profile.py CKPT --gpu-memory none 6GiB
#            cli_bench        ~2 min    tinyserve bench CKPT --kv iso3 1024/64, without and
#                                       with --gpu-memory 6GiB -> cli/bench_{none,6GiB}.json
#            e2e_offload      ~1.5 min  bench/e2e_offload.py
#            decode_modes     ~3 min    bench/decode_modes.py CKPT --kv iso3, resident and at
#                                       --gpu-memory 6GiB (chained vs synchronous, greedy and
#                                       penalised) -> results/decode_modes[_6GiB].json
#            decode_overhead  ~1.5 min  bench/decode_overhead.py (8 layers, bf16/iso3 x b1/b8)
#   kv_formats_1k, kv_formats_32k (not in `all`): bench/kv_formats.py CKPT, tinyserve bench with
#            iso3 / bf16 side by side at 1k (2 rounds, ~6 min) and 32k (1 round,
#            merged into the same results/kv_formats.json); run each in its own command
#   realistic
#            checkpoint_realistic ~1-3 min  the same checkpoint with realistic routing
#                                       (bench.routing) in $TINYSERVE_FULLSIZE_DIR-realistic
#            realistic_decode ~5-6 min  bench/realistic_decode.py: decode at 6 GiB under
#                                       realistic routing (and uniform, when the random
#                                       checkpoint is there), against --max-context and at
#                                       6.6 % / 33 % of the experts cached
#                                       -> results/realistic_decode.json
#   all = tests kernels e2e (~25 min: split it over several commands of < 10 min, e.g.
#   `tests`, then `checkpoint fullsize_graph`, then `step_profile cli_bench e2e_offload
#   decode_overhead`; steps that need the checkpoint write it first when it is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/tinyserve-out}
DRY=${DRY:-0}
SUITE_LIMIT=${SUITE_LIMIT:-570}
TAR="$OUT/gpu_suite.tar.gz"
STAGE=$(mktemp -d /tmp/tinyserve-suite.XXXXXX)
mkdir -p "$OUT" "$STAGE/logs" "$STAGE/cli" bench/results
export PYTHONUNBUFFERED=1 TINYSERVE_CACHE_DIR=${TINYSERVE_CACHE_DIR:-/tmp/tinyserve-cache}
export TINYSERVE_FULLSIZE_DIR=${TINYSERVE_FULLSIZE_DIR:-/tmp/tinyserve-fullsize}
CKPT=$TINYSERVE_FULLSIZE_DIR
RCKPT=$TINYSERVE_FULLSIZE_DIR-realistic
START=$SECONDS

expand() {  # part or step names -> steps
    local a
    for a in "$@"; do
        case $a in
            all) expand tests kernels e2e ;;
            tests) echo gpu_tests ;;
            kernels) for b in ${KERNEL_BENCHES:-iso_attention nvfp4 gdn}; do
                         echo "bench_$b"; done ;;
            e2e) echo checkpoint fullsize_graph memory_budget step_profile cli_bench \
                      e2e_offload decode_modes decode_overhead ;;
            realistic) echo checkpoint_realistic realistic_decode ;;
            gpu_tests|bench_*|checkpoint|fullsize_graph|memory_budget|step_profile|\
cli_bench|e2e_offload|decode_modes|decode_overhead|kv_formats_1k|kv_formats_32k|\
checkpoint_realistic|realistic_decode) echo "$a" ;;
            *) echo "unknown part or step: $a" >&2; exit 2 ;;
        esac
    done
}
STEPS=$(expand "${@:-all}") || exit 2

pack() {  # everything into the one tar file (results as they are now)
    [[ $DRY == 1 ]] && return
    mkdir -p "$STAGE/results"
    cp -f bench/results/*.json "$STAGE/results/" 2>/dev/null
    tar czf "$TAR.tmp" -C "$STAGE" . && mv -f "$TAR.tmp" "$TAR"
}
trap 'pack; rm -rf "$STAGE"' EXIT
trap 'echo "interrupted"; exit 130' INT TERM

note() { echo "$*" | tee -a "$STAGE/summary.txt"; }

run_step() {  # name, limit seconds, command...: log to logs/<name>.log, one summary line
    local name=$1 limit=$2; shift 2
    local left=$((SUITE_LIMIT - (SECONDS - START) - 15))
    if ((left < 30)); then note "$name SKIPPED (suite time limit)"; return 1; fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s): $*"
    if [[ $DRY == 1 ]]; then return 0; fi
    local t0=$SECONDS rc
    timeout -s INT -k 30 "$limit" "$@" > "$STAGE/logs/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL:-30}" "$STAGE/logs/$name.log"
    note "$name exit $rc $((SECONDS - t0))s$( ((rc == 124)) && echo ' (timed out)')"
    pack
    return $rc
}

have_ckpt() { [[ -f $CKPT/config.json && -f $CKPT/model.safetensors.index.json ]]; }

ensure_ckpt() {  # write into a side directory, then move it in: no half-written checkpoint
    have_ckpt && return 0
    rm -rf "$CKPT.partial"
    run_step checkpoint 420 python3 -m bench.fullsize "$CKPT.partial" &&
        { [[ $DRY == 1 ]] || { rm -rf "$CKPT" && mv "$CKPT.partial" "$CKPT"; }; }
}

need_ckpt() {
    ensure_ckpt || { note "$1 SKIPPED (no full-size checkpoint)"; return 1; }
}

ensure_realistic() {  # the checkpoint with realistic routing, written the same way
    [[ -f $RCKPT/config.json && -f $RCKPT/model.safetensors.index.json ]] && return 0
    rm -rf "$RCKPT.partial"
    run_step checkpoint_realistic 420 python3 -m bench.fullsize "$RCKPT.partial" \
        --routing realistic &&
        { [[ $DRY == 1 ]] || { rm -rf "$RCKPT" && mv "$RCKPT.partial" "$RCKPT"; }; }
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
    git rev-parse HEAD 2>/dev/null || true
    git status --short 2>/dev/null | head -20
    echo "steps: $(echo $STEPS)"
} > "$STAGE/env.txt" 2>&1
cat "$STAGE/env.txt"

for step in $STEPS; do
    case $step in
        gpu_tests)
            # Parallel workers share the one GPU; Triton and NVRTC builds dominate the wall time.
            # The full-size test runs in its own step (its checkpoint is unset here: it skips).
            run_step gpu_tests "${TESTS_TIMEOUT:-420}" env -u TINYSERVE_FULLSIZE_DIR \
                python3 -m pytest -m "requires_cuda or gpu_shapes" -q -rfEs --tb=short -p no:cacheprovider \
                -n "${TEST_WORKERS:-6}" \
                ${TESTS:-tests/kernels tests/kv tests/model tests/engine tests/offload} ;;
        bench_*)
            b=${step#bench_}
            [[ -f bench/$b.py ]] && run_step "$step" "${BENCH_TIMEOUT:-150}" python3 "bench/$b.py" ;;
        checkpoint)
            ensure_ckpt || true
            have_ckpt && note "checkpoint at $CKPT ($(du -sh "$CKPT" 2>/dev/null | cut -f1))" ;;
        fullsize_graph)
            need_ckpt fullsize_graph &&
                run_step fullsize_graph 480 env TINYSERVE_WRITE_RESULTS=1 python3 -m pytest \
                    -m "requires_cuda and slow" -q -rfEsx --tb=short -p no:cacheprovider \
                    tests/engine/test_fullsize_graph.py
            [[ $DRY == 1 ]] || python3 - <<'EOF' 2>&1 | tee -a "$STAGE/summary.txt"
import json
from pathlib import Path

p = Path("bench/results/fullsize_graph.json")
for name, c in (json.loads(p.read_text())["cases"] if p.exists() else {}).items():
    diff = max((s["max_diff"] for s in c["steps"]), default=float("nan"))
    print(f"  {name}: {c['identical']}/{len(c['steps'])} tokens identical, max logit diff "
          f"{diff:.3g}, flips {c['flips']}, problems {c['problems']}")
EOF
            ;;
        memory_budget)
            need_ckpt memory_budget &&
                run_step memory_budget 540 python3 bench/memory_budget.py "$CKPT" \
                    --budgets 6GiB 4GiB ;;
        step_profile)
            need_ckpt step_profile &&
                run_step step_profile 300 python3 bench/step_profile.py "$CKPT" --kv iso3 \
                    --gpu-memory none 6GiB ;;
        cli_bench)
            if need_ckpt cli_bench; then
                for budget in none 6GiB; do
                    extra=(); [[ $budget != none ]] && extra=(--gpu-memory "$budget")
                    run_step "cli_bench_$budget" 180 bash -c \
                        'python3 -m tinyserve.cli bench "$@" > "'"$STAGE/cli/bench_$budget.json"'"' \
                        _ "$CKPT" --kv iso3 --prompt-len 1024 --gen-len 64 --json "${extra[@]}"
                    [[ $DRY == 1 ]] || head -c 800 "$STAGE/cli/bench_$budget.json"; echo
                done
            fi ;;
        e2e_offload)
            need_ckpt e2e_offload &&
                run_step e2e_offload 300 python3 bench/e2e_offload.py --ckpt "$CKPT" ;;
        decode_modes)
            if need_ckpt decode_modes; then
                run_step decode_modes_resident 180 python3 bench/decode_modes.py "$CKPT" \
                    --kv iso3
                run_step decode_modes_6GiB 180 python3 bench/decode_modes.py "$CKPT" \
                    --kv iso3 --gpu-memory 6GiB
            fi ;;
        decode_overhead)
            run_step decode_overhead 240 python3 bench/decode_overhead.py ;;
        kv_formats_1k)
            need_ckpt kv_formats_1k &&
                run_step kv_formats_1k 540 python3 bench/kv_formats.py "$CKPT" \
                    --prompt-lens 1024 --repeats 2 ;;
        kv_formats_32k)
            need_ckpt kv_formats_32k &&
                run_step kv_formats_32k 540 python3 bench/kv_formats.py "$CKPT" \
                    --prompt-lens 32704 --repeats 1 --merge ;;
        checkpoint_realistic)
            ensure_realistic || true ;;
        realistic_decode)
            if ensure_realistic; then
                uniform=(); have_ckpt && uniform=(--uniform-ckpt "$CKPT")
                run_step realistic_decode 540 python3 bench/realistic_decode.py \
                    --ckpt "$RCKPT" "${uniform[@]}"
            else
                note "realistic_decode SKIPPED (no realistic checkpoint)"
            fi ;;
    esac
done
note "done in $((SECONDS - START))s -> $TAR"
