"""Where the time of one full-model decode step goes, on the engine's own build.

Builds the engine's runner from a checkpoint exactly as `tinyserve run` does (`engine.build`:
memory plan, offload, KV pool, graphs), prefills one sequence of `--context` random tokens,
then measures decode at batch 1: eager steps, graph replays (when the build captures graphs),
and one profiled eager step whose GPU kernels are grouped by name (top `--top`), with the sum
of all kernel times. Then one prefill chunk of `--prefill-tokens` (a second sequence from
position 0, after one warm-up chunk of the same shape): its wall time, and its kernels
grouped the same way. Each `--gpu-memory` budget runs in a fresh process (the allocator cap of
a budget counts every byte the process still holds).

    python bench/step_profile.py CKPT [--kv iso3] [--gpu-memory none 6GiB] [--context 1024]
        [--prefill-tokens 2048] [--out PATH] -> bench/results/step_profile.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, run_meta  # noqa: E402

from tinyserve.core import Batch, SamplingParams, ScheduledSeq  # noqa: E402
from tinyserve.engine.build import build_parts  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "step_profile.json"
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def decode_seq(runner, token: int, pos: int, pages: list[int]) -> Batch:
    return Batch([ScheduledSeq("p", [token], start_pos=pos, page_ids=pages, state_slot=0,
                               sample=True, params=GREEDY)])


def kernel_table(prof, top: int) -> tuple[float, list[dict]]:
    """(sum of GPU kernel microseconds, the `top` kernel names by total time)."""
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(ev.name, [0.0, 0])
            t[0] += ev.device_time
            t[1] += 1
    total = sum(t[0] for t in totals.values())
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return total, [{"kernel": k[:120], "us": round(v[0], 1), "calls": v[1],
                    "share": round(v[0] / max(total, 1e-9), 3)} for k, v in rows]


def profile_prefill(runner, ids: list[int], pages: list[int], top: int) -> dict:
    """Wall time and kernels of one prefill chunk of `ids` from position 0 (after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    def chunk() -> None:
        seq = ScheduledSeq("q", ids, start_pos=0, page_ids=pages, state_slot=0, sample=True,
                           params=GREEDY)
        runner.forward(Batch([seq]))

    chunk()
    torch.cuda.synchronize()
    t = time.perf_counter()
    chunk()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        chunk()
    total_us, rows = kernel_table(prof, top)
    return {"tokens": len(ids), "wall_ms": round(1e3 * wall, 1),
            "tok_s": round(len(ids) / wall, 1), "kernel_sum_ms": round(total_us / 1e3, 1),
            "top_kernels": rows}


def measure(ckpt: str, kv: str, budget: str | None, context: int, steps: int, top: int,
            prefill_tokens: int = 0) -> dict:
    tokens = max(context + 4 * steps + 8, prefill_tokens)
    config = EngineConfig(model=ckpt, kv=kv, gpu_memory=budget, max_seqs=1,
                          max_context=tokens + 56, prefix_cache=False, experts="gpu")
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    parts = build_parts(config)
    build_s = time.perf_counter() - t0
    runner = parts.runner
    ps = config.page_size
    pages = list(range(-(-tokens // ps)))
    vocab = min(parts.model_config.vocab_size, len(parts.tokenizer))
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    chunk = config.max_num_batched_tokens
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    token = None
    for start in range(0, context, chunk):
        part = ids[start:start + chunk]
        seq = ScheduledSeq("p", part, start_pos=start, page_ids=pages, state_slot=0,
                           sample=start + len(part) == context, params=GREEDY)
        token = runner.forward(Batch([seq])).next_tokens[0]
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    pos = context
    graphs = runner.graphs

    def run_steps(n: int, eager: bool) -> float:
        nonlocal token, pos
        runner.graphs = None if eager else graphs
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            token = runner.forward(decode_seq(runner, token, pos, pages)).next_tokens[0]
            pos += 1
        torch.cuda.synchronize()
        runner.graphs = graphs
        return (time.perf_counter() - t) / n

    out: dict = {"budget": budget or "none", "kv": kv, "context": context,
                 "build_s": round(build_s, 1), "prefill_tok_s": round(context / prefill_s, 1),
                 "graphs": graphs is not None,
                 "experts_offloaded": parts.memory_plan is not None
                 and parts.memory_plan.experts_offloaded}
    run_steps(2, eager=True)
    out["eager_step_ms"] = round(1e3 * run_steps(steps, eager=True), 2)
    if graphs is not None:
        run_steps(2, eager=False)
        out["graph_step_ms"] = round(1e3 * run_steps(steps, eager=False), 2)
    best = out.get("graph_step_ms", out["eager_step_ms"])
    out["decode_tok_s"] = round(1e3 / best, 2)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(1, eager=True)
    total_us, rows = kernel_table(prof, top)
    out["eager_kernel_sum_ms"] = round(total_us / 1e3, 2)
    out["top_kernels"] = rows
    if prefill_tokens:
        runner.graphs = None  # the prefill chunk runs eagerly anyway
        more = torch.randint(0, vocab, (prefill_tokens,),
                             generator=torch.Generator().manual_seed(1)).tolist()
        out["prefill_chunk"] = profile_prefill(runner, more, pages, top)
        runner.graphs = graphs
    out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    free, total = torch.cuda.mem_get_info()
    out["device_used_gib"] = round((total - free) / 2**30, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--kv", default="iso3")
    p.add_argument("--gpu-memory", nargs="+", default=["none", "6GiB"])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--prefill-tokens", type=int, default=2048,
                   help="tokens of the profiled prefill chunk (0: none)")
    p.add_argument("--out", type=Path, default=OUT, help="result file (default %(default)s)")
    p.add_argument("--case-json", help=argparse.SUPPRESS)  # child mode: one budget -> this file
    args = p.parse_args()
    if args.case_json:  # a fresh process per budget: the allocator cap counts what is left over
        b = args.gpu_memory[0]
        out = measure(args.ckpt, args.kv, None if b == "none" else b, args.context, args.steps,
                      args.top, args.prefill_tokens)
        Path(args.case_json).write_text(json.dumps(out))
        return 0
    rec = Recorder(args.out, run_meta("step_profile", args=vars(args)))
    for budget in args.gpu_memory:
        rec.run(f"{args.kv}_{budget}", child, args, budget)
    return 0


def child(args: argparse.Namespace, budget: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "case.json"
        cmd = [sys.executable, __file__, args.ckpt, "--kv", args.kv, "--gpu-memory", budget,
               "--context", str(args.context), "--steps", str(args.steps), "--top",
               str(args.top), "--prefill-tokens", str(args.prefill_tokens),
               "--case-json", str(path)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not path.exists():
            raise RuntimeError(f"exit {res.returncode}: {res.stderr[-3000:]}")
        return json.loads(path.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
