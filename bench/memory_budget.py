"""The whole process inside `--gpu-memory`: its device memory, as the driver counts it, through
loading, a long prompt and decoding, on the full-size random Qwen3.5-35B-A3B-shaped checkpoint.

Each budget runs in a fresh process (as `tinyserve run` would: plan -> build -> warm-up ->
requests) while a second thread samples the process's device memory every 10 ms
(`engine.device_memory.DeviceMemoryProbe`: NVML's per-process figure, else NVML's device
figure less the baseline taken before the CUDA context, else torch.cuda.mem_get_info), and
torch's allocator peaks are read at the end of each phase:
- start: after the CUDA context and cuBLAS are up (the plan's start-up measurement);
- mapping: a 2 GiB host buffer registered with the driver, then freed (the device page tables
  of registered host memory, per GiB);
- load: the engine built from the plan (weights, pinned expert store, KV, states, cache);
- warm_up: the throwaway request `tinyserve run` makes (kernel builds, graph capture);
- prompt: one request of --prompt-len random tokens (100k by default), until its first token;
- decode: its next --gen-len - 1 tokens (CUDA graphs on).
The prompt asks for --prompt-len + --gen-len tokens of context; a budget whose plan refuses
that records the refusal (one line, with the numbers) and runs with the context its default
plan holds, the prompt shortened to fit.

Recorded per budget: the plan, every phase's peak device memory of the process, the
allocator's peak reserved and allocated bytes (their difference: fragmentation), what lived
outside the allocator (the process's memory less torch's reserved bytes), the load stages'
seconds, TTFT and decode tok/s; `within_budget` (peak <= budget). `calibration` gathers what
`engine/device_memory.py` takes from here: the start-up figure of this GPU (H200_STARTUP), the
growth outside the allocator after start-up less the mappings (LATE_GROWTH must be at least
it), the mapping cost per GiB (MAPPING_PER_GIB), and the fragmentation (the planner's
allocator slack must cover it). Exit status 1 when a peak passed its budget.

    TINYSERVE_FULLSIZE_DIR=/tmp/tinyserve-fullsize python bench/memory_budget.py \\
        [CKPT] [--budgets 6GiB 4GiB] [--prompt-len 102400] [--gen-len 64] [--kv iso3]

Writes bench/results/memory_budget.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
RESULT = ROOT / "bench" / "results" / "memory_budget.json"


class Sampler:
    """Samples the process's device memory from a second thread; `mark(phase)` closes the
    current phase (its peak, torch's allocator peaks, the memory outside the allocator)."""

    def __init__(self, probe: Any, interval: float = 0.01) -> None:
        import torch

        self.torch, self.probe, self.interval = torch, probe, interval
        self.phases: dict[str, dict[str, float]] = {}
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> int:
        used = self.probe.process_used()
        with self._lock:
            self._peak = max(self._peak, used)
        return used

    def mark(self, phase: str) -> dict[str, float]:
        torch = self.torch
        torch.cuda.synchronize()
        used = self.sample()
        reserved = torch.cuda.memory_reserved()
        with self._lock:
            peak, self._peak = self._peak, used
        rec = {"peak_mib": peak / MiB, "end_mib": used / MiB,
               "reserved_peak_mib": torch.cuda.max_memory_reserved() / MiB,
               "allocated_peak_mib": torch.cuda.max_memory_allocated() / MiB,
               "outside_allocator_mib": (used - reserved) / MiB}
        self.phases[phase] = {k: round(v, 1) for k, v in rec.items()}
        torch.cuda.reset_peak_memory_stats()
        print(f"  [{phase}] {json.dumps(self.phases[phase])}", flush=True)
        return self.phases[phase]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _mapping_cost(sampler: Sampler) -> float:
    """MiB of device memory per GiB of host memory registered with the driver."""
    import torch

    from tinyserve.kernels.moe.host_rows import register_mapped

    before = sampler.sample()
    buf = torch.empty(2 << 30, dtype=torch.uint8)
    if not register_mapped(buf, "mapping probe"):
        return float("nan")
    torch.cuda.synchronize()
    after = sampler.sample()
    del buf
    return (after - before) / MiB / 2


def child(budget: str, args: argparse.Namespace) -> dict[str, Any]:
    """One budget, in this (fresh) process."""
    import torch

    from tinyserve.core import SamplingParams
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig
    from tinyserve.engine.device_memory import device_memory_report, probe_for
    from tinyserve.engine.memory_plan import PlanError
    from tinyserve.engine.planner import plan_engine
    from tinyserve.engine.progress import WARM_UP, LoadProgress

    probe = probe_for(0)  # before the CUDA context: NVML's baseline
    out: dict[str, Any] = {"budget": budget}
    want = args.prompt_len + args.gen_len
    config = EngineConfig(model=args.model, kv=args.kv, gpu_memory=budget, max_context=want)
    try:
        plan = plan_engine(config)
    except PlanError as exc:
        out["refused"] = {"max_context": want, "message": str(exc)}
        config = EngineConfig(model=args.model, kv=args.kv, gpu_memory=budget)
        plan = plan_engine(config)
    sampler = Sampler(probe)
    out["probe"] = probe.source
    sampler.mark("start")
    out["mapping_mib_per_gib"] = round(_mapping_cost(sampler), 2)
    sampler.mark("mapping")
    out["plan"] = plan.as_dict()
    print(plan.format(), flush=True)
    progress = LoadProgress()
    progress.expect(WARM_UP, 1)
    engine = build_engine(config, plan=plan, progress=progress)
    sampler.mark("load")
    engine.start()
    try:
        progress.begin(WARM_UP)
        engine.warm_up()
        progress.complete(WARM_UP)
        out["report"], _ = device_memory_report(plan, plan.device)
        sampler.mark("warm_up")
        out["load_stages_s"] = progress.timings()
        prompt_len = min(args.prompt_len, engine.max_context - args.gen_len)
        out["prompt_len"] = prompt_len
        prompt = engine.random_prompt(prompt_len, torch.Generator().manual_seed(0))
        params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        handle = engine.submit(prompt, params)
        times: list[float] = []
        for item in handle:
            if item.error:
                raise RuntimeError(item.error)
            if item.token_ids and not times:
                sampler.mark("prompt")
            times.extend([time.perf_counter()] * len(item.token_ids))
        sampler.mark("decode")
        out["ttft_s"] = round(times[0] - t0, 2)
        if len(times) > 1:
            out["decode_tok_s"] = round((len(times) - 1) / (times[-1] - times[0]), 1)
    finally:
        engine.shutdown()
        sampler.close()
    out["phases"] = sampler.phases
    gpu_memory = plan.gpu_memory or 0
    peak = max(p["peak_mib"] for p in sampler.phases.values())
    out.update({"budget_mib": gpu_memory / MiB, "peak_mib": peak,
                "headroom_mib": round(gpu_memory / MiB - peak, 1),
                "within_budget": peak <= gpu_memory / MiB})
    phases = sampler.phases
    outside = {k: v["outside_allocator_mib"] for k, v in phases.items() if k != "mapping"}
    mapped = plan.host_expert_bytes + (plan.embed_bytes if plan.embed_device == "cpu" else 0)
    out["calibration"] = {
        "startup_mib": phases["start"]["outside_allocator_mib"],
        "late_growth_mib": round(max(outside.values()) - phases["start"]["outside_allocator_mib"]
                                 - out["mapping_mib_per_gib"] * mapped / (1 << 30), 1),
        "mapping_mib_per_gib": out["mapping_mib_per_gib"],
        "fragmentation_mib": max(p["reserved_peak_mib"] - p["allocated_peak_mib"]
                                 for k, p in phases.items() if k not in ("start", "mapping")),
        "planned_outside_mib": round(plan.outside_allocator_bytes / MiB, 1),
        "planned_slack_mib": round(dict(plan.workspace).get("allocator slack", 0) / MiB, 1),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=os.environ.get("TINYSERVE_FULLSIZE_DIR"))
    ap.add_argument("--budgets", nargs="+", default=["6GiB", "4GiB"])
    ap.add_argument("--prompt-len", type=int, default=102400)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--kv", default="iso3")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("give the checkpoint (or set TINYSERVE_FULLSIZE_DIR)")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return 0
    from bench.common import run_meta

    data = run_meta("memory_budget", model=args.model, kv=args.kv, prompt_len=args.prompt_len,
                    gen_len=args.gen_len, cases={}, errors={})
    out = Path(args.out)
    ok = True
    for budget in args.budgets:
        cmd = [sys.executable, __file__, args.model, "--child", budget, "--kv", args.kv,
               "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
        print(f"[{budget}] {' '.join(cmd)}", flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        sys.stdout.write(res.stdout)
        lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode or not lines:
            data["errors"][budget] = res.stderr[-4000:]
            ok = False
            print(res.stderr[-4000:], file=sys.stderr)
        else:
            case = json.loads(lines[-1][len("RESULT "):])
            data["cases"][budget] = case
            ok = ok and case["within_budget"]
            print(f"[{budget}] peak {case['peak_mib']:.0f} MiB of {case['budget_mib']:.0f} MiB "
                  f"(headroom {case['headroom_mib']:.0f}); calibration "
                  f"{json.dumps(case['calibration'])}", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
