"""Hybrid expert execution (`--experts gpu|cpu|hybrid`): decode tok/s of each mode in one run.

One engine is built on the full-size random Qwen3.5-35B-A3B-shaped NVFP4 checkpoint
(bench.fullsize; written unless it is there; `--routing realistic`: routed with a real
model's skew and locality, bench.routing, instead of uniformly) with `--gpu-memory 6GiB
--kv iso3`; the pinned store is loaded once and each case switches the experts' plan and
recaptures the decode graphs. Writes bench/results/hybrid_experts.json after every case.

Cases:
- kernel: the CPU expert kernel against the host read bandwidth measured in the same run
  (every thread reading 4 GiB of the store), for 1..top_k experts of one token and for
  top_k experts of a batch of 8 tokens, one token's top_k experts, one and none on 1, 2, 4,
  8 and the probe's thread counts (the kernel's own function, as the engine's worker calls
  it; an empty call through `moe_cpu` beside them: its Python), the same top_k experts again
  and again on each thread count (cached: the arithmetic's rate per core), and the torch reference
  (dequantize + matmul) on the same experts: the measurement behind choosing numba.
- probe: the start-up probe and the plan of every mode.
- gpu, cpu, hybrid: `engine.bench.run_bench` (prompt 1024, 256 generated, batch 1): decode
  tok/s, the median step, hits / misses / experts computed on the CPU, the greedy tokens of
  one fixed prompt (the summary counts how many agree with gpu-only's), and the top-20
  logprobs of 16 decode steps teacher-forced on gpu-only's tokens (the summary compares them
  with gpu-only's: the CPU path's effect on the logits of the full-size model).
- auto: `--experts auto`: the probe's choice, settled by decoding (`engine.expert_mode`), then
  decoded as the others.
- split_sweep (--sweep): decode tok/s with the CPU taking c = 0..top_k / 2 of a layer's
  misses on each of the probe's thread counts, against the probe's choice.
- fair (`--cases fair`, alone: its engine decodes without CUDA graphs): first fair_layers,
  each layer's experts replayed on the MoE inputs of one gpu-only decode step with every
  routed expert a miss, under gpu, hybrid and cpu, as the engine runs them and rounded as
  below: each layer's output against gpu-only's on the same input. Then gpu-only and hybrid
  with the GPU's routed experts in decode through the torch reference rounded as the CPU
  kernel rounds (`OffloadedExperts.round_like_cpu`): the greedy tokens and teacher-forced
  logprobs then differ by the CPU part's summation order alone, the check the random
  model's flat logits leave to it; and gpu-only again with each token's routed experts summed
  in two halves, the second added to the first in fp32 (gpu_split: a hybrid's order with no
  CPU): how far that order alone moves this model's tokens; and gpu-only once more
  (gpu_again): how far the reference moves from one pass to the next. Its engine keeps no
  prefix cache, so no pass starts from another's state.
- laptop_gpu, laptop_hybrid: the miss copies throttled to `--h2d-gbps` (12 GB/s: an RTX 4060
  laptop's PCIe 4.0 x8) by the cache's debug throttle (kernels.throttle), the probe run
  again under it (the plan moves work to the CPU), then gpu-only and auto.
A summary compares hybrid with gpu and cpu, and the laptop hybrid with the laptop gpu.
`--cases` runs some of them (the probe always runs).

    python bench/hybrid_experts.py [--ckpt DIR] [--gpu-memory 6GiB] [--h2d-gbps 12]
                                   [--cases gpu,cpu,laptop]
    python bench/hybrid_experts.py --kernel-only   # no GPU needed: the kernel case alone
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import Recorder, expert_store, run_meta  # noqa: E402  (bench/ is on sys.path as a script)

from tinyserve.kernels.moe import cpu as nvfp4_cpu  # noqa: E402
from tinyserve.offload import bandwidth, hybrid  # noqa: E402

RESULT = ROOT / "bench" / "results" / "hybrid_experts.json"


def _median_s(fn, args: list, reps: int) -> float:
    """Median seconds of fn(*args[i]) over reps calls (args[0] warms up)."""
    fn(*args[0])
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn(*args[1 + i % (len(args) - 1)])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _native(calls: list, threads: int) -> list:
    """`moe_cpu` calls' arguments (x, rows, weights, slots) as the kernel's own function takes
    them (`cpu_numba.moe_pooled`, on `threads` threads of `moe_cpu`'s pool): timed straight,
    without `moe_cpu`'s checks and conversions (as the engine's worker runs it, with no Python)."""
    pool = nvfp4_cpu._python_pool()
    out = torch.empty(calls[0][0].shape).numpy()
    return [(x.numpy(), rows.numpy(), w.numpy(), *(b.numpy() for b in slots.buffers), out,
             threads, pool.address) for x, rows, w, slots in calls]


def _numba_target() -> str:
    """The CPU numba builds the kernel for: this one's, unless NUMBA_CPU_NAME names another."""
    import os

    from llvmlite import binding

    return os.environ.get("NUMBA_CPU_NAME") or binding.get_host_cpu_name()


def kernel_case(store: Any, top_k: int, reps: int) -> dict[str, Any]:
    """The CPU kernel's read rate of expert bytes vs the host read bandwidth (same run)."""
    host, nbytes = bandwidth.host_read_bandwidth(store)
    g = torch.Generator().manual_seed(0)
    rows_total = store.num_layers * store.num_experts
    h = store.slots.hidden_size
    threads = nvfp4_cpu.max_threads()
    kernel = nvfp4_cpu._kernels().moe_pooled
    out: dict[str, Any] = {"host_read_gbps": host / 1e9, "host_read_bytes": nbytes,
                           "threads": threads, "store_bytes": store.nbytes,
                           "built_for": _numba_target(), "calls": {}}
    args: dict[tuple[int, int], list] = {}  # (tokens, experts) -> the calls' arguments
    for n, k in ((1, 1), (1, 2), (1, 4), (1, top_k), (8, top_k)):
        calls = args[n, k] = [(torch.randn(n, h, generator=g),
                  torch.stack([torch.randperm(rows_total, generator=g)[:k] for _ in range(n)]),
                  torch.rand(n, k, generator=g), store.slots) for _ in range(reps + 1)]
        t = _median_s(kernel, _native(calls, threads), reps)
        nbytes = min(n * k, rows_total) * store.bytes_per_expert  # distinct experts (about)
        out["calls"][f"{n}tok_{k}exp"] = {"ms": t * 1e3, "gbps": nbytes / t / 1e9,
                                          "fraction_of_host_read": nbytes / t / host}
    # the kernel's arithmetic alone: one call's experts again and again (they stay in the
    # last-level cache where it holds them), then 4 tokens on the same experts (a batch)
    x, rows, w, slots = args[1, top_k][0]
    for name, call in ((f"1tok_{top_k}exp_cached", (x, rows, w, slots)),
                       ("1tok_1exp_cached", args[1, 1][0]),
                       (f"4tok_{top_k}exp_shared", (torch.randn(4, h, generator=g),
                                                     rows.expand(4, -1).contiguous(),
                                                     torch.rand(4, top_k, generator=g), slots))):
        t = _median_s(kernel, _native([call], threads) * (reps + 1), reps)
        out["calls"][name] = {"ms": t * 1e3, "gbps": call[1].shape[1] * store.bytes_per_expert
                              / t / 1e9}
    # by threads, top_k experts, one and none (every row -1: a call's fixed cost), and one
    # call's top_k experts again and again (the arithmetic, where the cache holds them)
    args[1, 0] = [(x, torch.full_like(rows, -1), w, slots) for x, rows, w, slots in args[1, 1]]
    sweeps = (("threads_sweep", top_k, args[1, top_k]), ("threads_sweep_1exp", 1, args[1, 1]),
              ("threads_sweep_empty", 0, args[1, 0]),
              ("threads_sweep_cached", top_k, [args[1, top_k][0]] * (reps + 1)))
    for key, k, calls in sweeps:
        out[key] = {}
        for used in sorted({t for t in (1, 2, 4, 8, threads, *bandwidth.thread_counts(threads))
                            if t <= threads}):
            t = _median_s(kernel, _native(calls, used), reps)
            out[key][used] = {"ms": t * 1e3, "gbps": k * store.bytes_per_expert / t / 1e9}
        sweep = ", ".join(f"{t}: {v['ms'] * 1e3:.0f} us ({v['gbps']:.1f} GB/s)"
                          for t, v in out[key].items())
        print(f"  {key}, 1 token x {k} experts by threads: {sweep}", flush=True)
    # what `moe_cpu` adds around the kernel (its checks, conversions and numba's dispatch)
    out["moe_cpu_empty_us"] = _median_s(nvfp4_cpu.moe_cpu, args[1, 0], reps) * 1e6
    print(f"  an empty call through moe_cpu: {out['moe_cpu_empty_us']:.0f} us", flush=True)
    x = torch.randn(1, h, generator=g)
    rows = torch.randperm(rows_total, generator=g)[:top_k].view(1, top_k)
    w = torch.rand(1, top_k, generator=g)
    t = _median_s(nvfp4_cpu.moe_cpu_ref, [(x, rows, w, store.slots)] * 2, max(2, reps // 4))
    out["torch_reference"] = {"ms": t * 1e3,
                              "gbps": top_k * store.bytes_per_expert / t / 1e9,
                              "what": "dequantize each expert to fp32, then matmul (torch "
                                      "CPU ops: the alternative to numba)"}
    one = out["calls"][f"1tok_{top_k}exp"]
    out["fraction_of_host_read"] = one["fraction_of_host_read"]
    out["summary"] = (f"CPU kernel {one['gbps']:.1f} GB/s = {one['fraction_of_host_read']:.0%} "
                      f"of the host read bandwidth {host / 1e9:.1f} GB/s ({out['threads']} "
                      f"threads, 1 token x {top_k} experts); torch dequantize + matmul "
                      f"{out['torch_reference']['gbps']:.2f} GB/s")
    print(out["summary"], flush=True)
    return out


def _set_mode(engine: Any, plan: hybrid.HybridPlan, runner: hybrid.CpuExperts) -> None:
    engine.set_expert_plan(plan, None if plan.mode == "gpu" else runner)
    torch.cuda.synchronize()


def auto_case(engine: Any, plan: hybrid.HybridPlan, runner: hybrid.CpuExperts,
              args: argparse.Namespace) -> dict[str, Any]:
    """`--experts auto`: the probe's choice `plan`, settled by decoding where it is hybrid
    (`engine.expert_mode`), then decoded as the other cases."""
    from tinyserve.engine.expert_mode import settle_expert_mode

    engine.set_expert_plan(plan, runner)
    settled = settle_expert_mode(engine) or plan
    return decode_case(engine, settled, runner, args)


def decode_case(engine: Any, plan: hybrid.HybridPlan, runner: hybrid.CpuExperts,
                args: argparse.Namespace, forced_on: list[int] | None = None) -> dict[str, Any]:
    """One mode's decode; `forced_on`: the tokens to teacher-force its logprobs on (None:
    its own greedy tokens)."""
    from tinyserve.engine.bench import run_bench

    _set_mode(engine, plan, runner)
    r = run_bench(engine, prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch)
    r["experts"] = plan.as_dict()
    r["greedy_tokens"] = _greedy_tokens(engine, args.prompt_len, TOKEN_CHECK)
    if forced_on is not None or plan.mode == "gpu":
        r["forced_top_logprobs"] = _forced_logprobs(
            engine, args.prompt_len, (forced_on or r["greedy_tokens"])[:FORCED])
    print(f"  {plan.mode}: decode {r['decode_tok_s']:.1f} tok/s, step {r['decode_step_ms']:.2f} "
          f"(p90 {r['decode_step_ms_p90']:.2f}, max {r['decode_step_ms_max']:.2f}) ms, "
          f"{r['expert_cache']}", flush=True)
    return r


def _split_pairs(xf: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots: Any,
                 rnd: Any = None, *, whole: Any) -> torch.Tensor:
    """`whole` (`fused.moe_pairs_ref`) with the second half of each token's pairs summed apart
    and added to the first half's sum: a hybrid's summation order (the GPU part's sum, then
    the CPU part's added in fp32) with no CPU (the fair case's noise floor)."""
    half = ids.shape[1] // 2
    if half == 0:  # the shared expert
        return whole(xf, ids, weights, slots, rnd)
    col = torch.arange(ids.shape[1], device=ids.device)
    first = whole(xf, torch.where(col < half, ids, -1), weights, slots, rnd)
    return first + whole(xf, torch.where(col < half, -1, ids), weights, slots, rnd)


# name: plan, in the order run (gpu_again: the reference's own spread from one pass to the next)
FAIR_PASSES = {"gpu": "gpu", "hybrid": "hybrid", "gpu_split": "gpu", "gpu_again": "gpu"}


@contextlib.contextmanager
def _rounded_like_cpu(engine: Any, split: bool = False) -> Iterator[None]:
    """The GPU's routed experts of decode through the reference rounded as the CPU kernel
    rounds (`round_like_cpu`); `split`: each token's pairs summed in two halves
    (`_split_pairs`)."""
    from tinyserve.kernels.moe import fused

    experts = engine.runner.model.experts
    engine.call(lambda: setattr(experts, "round_like_cpu", True))
    whole = fused.moe_pairs_ref
    if split:
        fused.moe_pairs_ref = functools.partial(_split_pairs, whole=whole)
    try:
        yield
    finally:
        fused.moe_pairs_ref = whole
        engine.call(lambda: setattr(experts, "round_like_cpu", False))


def fair_pass(engine: Any, plan: hybrid.HybridPlan, runner: hybrid.CpuExperts,
              args: argparse.Namespace, name: str, ref_tokens: list[int] | None
              ) -> dict[str, Any]:
    """One pass of the fair case (module docstring): `plan` with the routed experts of decode
    through the rounded reference (`_split_pairs` in place of its sum for gpu_split), its
    greedy tokens and its logprobs teacher-forced on `ref_tokens` (None: its own)."""
    with _rounded_like_cpu(engine, split=name == "gpu_split"):
        _set_mode(engine, plan, runner)
        tokens = _greedy_tokens(engine, args.prompt_len, FAIR_TOKENS)
        return {"greedy_tokens": tokens, "forced_top_logprobs": _forced_logprobs(
            engine, args.prompt_len, (ref_tokens or tokens)[:FAIR_FORCED])}


def fair_layers(engine: Any, plans: dict[str, hybrid.HybridPlan], runner: hybrid.CpuExperts,
                args: argparse.Namespace) -> dict[str, Any]:
    """Every layer's experts on the same inputs: the MoE inputs of one decode step recorded
    under gpu-only, then each layer's call replayed under each plan with every routed expert
    a miss (the cache emptied first), as the engine runs it and through the rounded
    reference: how far each layer's output lies from gpu-only's on the full-size model,
    without the 40 layers' amplification that the token comparison carries."""
    experts = engine.runner.model.experts
    calls: list[tuple] = []
    forward = experts.forward

    def record(layer_id: int, x: torch.Tensor, *tensors: torch.Tensor, **kw: Any) -> Any:
        if x.shape[0] == 1 and len(calls) < experts.cache.num_layers:
            calls.append((layer_id, x.clone(), *(t.clone() for t in tensors),
                          {k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in kw.items()}))
        return forward(layer_id, x, *tensors, **kw)

    _set_mode(engine, plans["gpu"], runner)
    engine.call(lambda: setattr(experts, "forward", record))
    try:
        _greedy_tokens(engine, args.prompt_len, 2)  # the prefill's token, then one decode step
    finally:
        engine.call(lambda: delattr(experts, "forward"))

    def replay(mode: str) -> torch.Tensor:
        def run() -> torch.Tensor:
            experts.begin_step()
            experts.cache.evict_slots(0, experts.cache.num_slots)
            return torch.stack([experts.forward(layer, x, ids, w, **kw).float()
                                for layer, x, ids, w, kw in calls])

        _set_mode(engine, plans[mode], runner)
        computed = runner.computed
        out = engine.call(run)
        torch.cuda.synchronize()
        if mode != "gpu" and runner.computed == computed:
            raise RuntimeError(f"the {mode} replay computed no expert on the CPU")
        return out

    outs = {mode: replay(mode) for mode in ("gpu", "hybrid", "cpu")}
    for name, mode in (("gpu", "gpu"), ("gpu_split", "gpu"), ("hybrid", "hybrid"),
                       ("cpu", "cpu")):
        with _rounded_like_cpu(engine, split=name == "gpu_split"):
            outs[f"{name}_rounded"] = replay(mode)
    out = {"layers": len(calls), "plans": {m: plans[m].as_dict() for m in ("hybrid", "cpu")}}
    for name, ref in (("gpu_rounded", "gpu"), ("hybrid", "gpu"), ("cpu", "gpu"),
                      ("gpu_split_rounded", "gpu_rounded"), ("hybrid_rounded", "gpu_rounded"),
                      ("cpu_rounded", "gpu_rounded")):
        out[f"{name}_vs_{ref}"] = _layer_diff(outs[name], outs[ref])
        print(f"  layers {name} vs {ref}: {out[f'{name}_vs_{ref}']}", flush=True)
    return out


def _layer_diff(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """`got` against `ref` ([L, N, H] bf16 values held in fp32): per layer the largest
    difference over the largest |ref| and the L2 ratio (their max and median over layers),
    the share of values that differ and the largest difference in bf16 units in the last
    place of the ref value."""
    d = (got - ref).abs()
    rel_max = (d.amax((1, 2)) / ref.abs().amax((1, 2))).tolist()
    rel_l2 = (d.norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).tolist()
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -126))) - 7)
    return {"rel_max": max(rel_max), "rel_max_median": statistics.median(rel_max),
            "rel_l2": max(rel_l2), "rel_l2_median": statistics.median(rel_l2),
            "values_differing": float((d > 0).float().mean()),
            "max_ulps": float((d / ulp).amax())}


def fair_compare(cases: dict[str, Any]) -> dict[str, Any]:
    """The other passes against gpu, all rounded as the CPU kernel rounds."""
    gpu = cases["fair_gpu"]
    out = {}
    for name in [n for n in FAIR_PASSES if n != "gpu"]:
        got = cases.get(f"fair_{name}")
        if got is None:
            continue
        out[name] = {"leading_greedy_tokens_equal": next(
            (i for i, (a, b) in enumerate(zip(gpu["greedy_tokens"], got["greedy_tokens"],
                                              strict=True)) if a != b), FAIR_TOKENS),
            "forced_logprobs": _compare_logprobs(gpu["forced_top_logprobs"],
                                                 got["forced_top_logprobs"])}
        print(f"  fair {name}: {out[name]['leading_greedy_tokens_equal']} of {FAIR_TOKENS} "
              f"greedy tokens equal to gpu-only's, {out[name]['forced_logprobs']}", flush=True)
    return out


CASES = ("kernel", "gpu", "cpu", "hybrid", "auto", "laptop", "fair")
TOKEN_CHECK = 32  # greedy tokens each mode decodes from one fixed prompt
FORCED = 16  # decode steps each mode's logprobs are compared on, teacher-forced
FAIR_TOKENS, FAIR_FORCED = 16, 8  # the same for the fair case's passes (eager, through the
# torch reference: several times slower)


def _greedy_tokens(engine: Any, prompt_len: int, n: int) -> list[int]:
    from tinyserve.core import SamplingParams

    prompt = engine.random_prompt(prompt_len, torch.Generator().manual_seed(1234))
    handle = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                  ignore_eos=True))
    return [t for out in handle for t in out.token_ids]


def _forced_logprobs(engine: Any, prompt_len: int, tokens: list[int]) -> list[list]:
    """Top-20 (id, logprob) of one decode step after the fixed prompt + tokens[:i], for each
    i: that context is prefilled (always on the GPU) and two tokens generated; the first comes
    from the prefill, the second from a decode step, whose logprobs these are."""
    from tinyserve.core import MAX_TOP_LOGPROBS, SamplingParams

    prompt = engine.random_prompt(prompt_len, torch.Generator().manual_seed(1234))
    steps = []
    for i in range(len(tokens)):
        handle = engine.submit(prompt + tokens[:i], SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=MAX_TOP_LOGPROBS))
        logprobs = [lp for out in handle for lp in out.logprobs]
        steps.append([list(t) for t in logprobs[1].top])
    return steps


def _compare_logprobs(ref: list[list], got: list[list]) -> dict[str, Any]:
    """Per step: the largest |logprob difference| over the ids both top-20s hold (steps
    whose top-20s share none are counted, not compared: a random-weight model's logits are
    near-uniform, its top-20 within ~0.4 nats), the difference of the top logprobs, and
    whether the top id agrees."""
    diffs, tops, top1, disjoint = [], [], 0, 0
    for a, b in zip(ref, got, strict=True):
        da, db = dict((int(i), v) for i, v in a), dict((int(i), v) for i, v in b)
        shared = da.keys() & db.keys()
        if shared:
            diffs.append(max(abs(da[i] - db[i]) for i in shared))
        else:
            disjoint += 1
        tops.append(abs(a[0][1] - b[0][1]))
        top1 += a[0][0] == b[0][0]
    return {"max_abs_logprob_diff": max(diffs, default=None),
            "median_max_abs_logprob_diff": statistics.median(diffs) if diffs else None,
            "max_top_logprob_diff": max(tops), "steps_sharing_no_top20_id": disjoint,
            "top1_equal": top1, "steps": len(ref)}


def split_sweep(engine: Any, bw: Any, runner: hybrid.CpuExperts, top_k: int,
                args: argparse.Namespace) -> dict[str, Any]:
    """Decode tok/s with the CPU taking c = 0..top_k / 2 of a layer's top_k misses (the
    probe's a, b = a * top_k - c) on each of the probe's thread counts: what the decode itself
    measures against the probe's choice (`split_us`, measured one layer at a time)."""
    from tinyserve.engine.bench import run_bench

    base = hybrid.plan_split(bw, "hybrid", top_k)
    out: dict[str, Any] = {"probe_threads": bw.threads, "probe_c": round(
        base.a * top_k - base.b), "decode_tok_s": {}}
    for threads in bandwidth.thread_counts(nvfp4_cpu.max_threads()):
        runner.set_threads(threads)
        for c in range(top_k // 2 + 1):
            plan = (hybrid.HybridPlan("gpu") if c == 0 else
                    hybrid.HybridPlan("hybrid", base.a, base.a * top_k - c, bw))
            _set_mode(engine, plan, runner)
            r = run_bench(engine, prompt_len=args.prompt_len, gen_len=args.gen_len,
                          batch=args.batch)
            out["decode_tok_s"][f"threads={threads} c={c}"] = r["decode_tok_s"]
            print(f"  threads {threads}, c {c}: {r['decode_tok_s']:.1f} tok/s", flush=True)
    runner.set_threads(bw.threads)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default=os.environ.get("TINYSERVE_FULLSIZE_DIR",
                                                    "/tmp/tinyserve-fullsize"))
    p.add_argument("--routing", choices=("uniform", "realistic"), default="uniform",
                   help="the checkpoint's routing: written so where --ckpt holds none, "
                        "checked where it holds one (realistic: a real model's skew and "
                        "locality, bench.routing)")
    p.add_argument("--gpu-memory", default="6GiB")
    p.add_argument("--kv", default="iso3")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--gen-len", type=int, default=256,
                   help="decode steps per case (64-step runs spread more: hybrid_exchange_ab.json)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--h2d-gbps", type=float, default=12.0,
                   help="the laptop case's miss-copy rate (0: skip the laptop case)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cases", default=",".join(c for c in CASES if c != "fair"),
                   help=f"comma-separated, of {', '.join(CASES)} (default: all but fair; the "
                        "probe always runs; cpu and hybrid compare with gpu where it ran)")
    p.add_argument("--sweep", action="store_true",
                   help="also decode with the CPU taking 0..top_k / 2 misses on each thread "
                        "count (split_sweep)")
    p.add_argument("--kernel-only", action="store_true",
                   help="only the kernel case, on a random store (no GPU, no checkpoint)")
    p.add_argument("--store-gib", type=float, default=4.0,
                   help="--kernel-only: size of the random store (keep it above the LLC)")
    p.add_argument("--out", default=str(RESULT))
    args = p.parse_args()
    cases = set(args.cases.split(","))
    if not cases <= set(CASES):
        p.error(f"--cases: unknown {', '.join(sorted(cases - set(CASES)))}")
    if "fair" in cases and len(cases) > 1:
        p.error("--cases fair runs alone (its engine decodes without CUDA graphs)")
    rec = Recorder(Path(args.out), run_meta("hybrid_experts", args=vars(args)))
    if args.kernel_only:
        store = expert_store(args.store_gib)
        rec.run("kernel", kernel_case, store, 8, args.reps)
        return 0

    from bench.fullsize import write_fullsize_checkpoint
    from bench.routing import ROUTING_FILE
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").is_file():
        write_fullsize_checkpoint(ckpt, routing=args.routing)
    elif (ckpt / ROUTING_FILE).is_file() != (args.routing == "realistic"):
        p.error(f"{ckpt} was not written with --routing {args.routing}")
    config = EngineConfig(model=args.ckpt, kv=args.kv, gpu_memory=args.gpu_memory,
                          max_context=args.max_context, max_seqs=args.batch, experts="gpu",
                          cuda_graphs="fair" not in cases, prefix_cache="fair" not in cases)
    engine = build_engine(config).start()
    try:
        experts = engine.runner.model.experts
        cache, store = experts.cache, experts.cache.store
        top_k = engine.runner.model.config.num_experts_per_tok
        if "kernel" in cases:
            rec.run("kernel", kernel_case, store, top_k, args.reps)
        runner = hybrid.CpuExperts(store, device=cache.device)
        bw = rec.run("probe", lambda: _probe(store, top_k, cache, runner))
        plans = {m: hybrid.plan_split(bw, m, top_k) for m in ("gpu", "cpu", "hybrid")}
        gpu = (rec.run("gpu", decode_case, engine, plans["gpu"], runner, args)
               if "gpu" in cases else None)
        for mode in ("cpu", "hybrid"):
            if mode in cases:
                rec.run(mode, decode_case, engine, plans[mode], runner, args,
                        (gpu or {}).get("greedy_tokens"))
        if "auto" in cases:
            rec.run("auto", auto_case, engine, hybrid.plan_split(bw, None, top_k), runner,
                    args)
        if "laptop" in cases and args.h2d_gbps > 0:
            cache.throttle_bytes_per_s = args.h2d_gbps * 1e9
            slow = rec.run("laptop_probe", lambda: _probe(store, top_k, cache, runner))
            rec.run("laptop_gpu", decode_case, engine, hybrid.plan_split(slow, "gpu", top_k),
                    runner, args)
            rec.run("laptop_hybrid", auto_case, engine, hybrid.plan_split(slow, None, top_k),
                    runner, args)
            cache.throttle_bytes_per_s = 0.0
        if "fair" in cases:
            rec.run("fair_layers", fair_layers, engine, plans, runner, args)
            for name, mode in FAIR_PASSES.items():
                ref = (rec.data["cases"].get("fair_gpu") or {}).get("greedy_tokens")
                rec.run(f"fair_{name}", fair_pass, engine, plans[mode], runner, args, name,
                        ref)
            if "fair_gpu" in rec.data["cases"]:
                rec.run("fair", fair_compare, rec.data["cases"])
        if args.sweep:
            rec.run("split_sweep", split_sweep, engine, bw, runner, top_k, args)
        rec.data["summary"] = _summary(rec.data["cases"])
        rec.save()
        print(rec.data["summary"], flush=True)
    finally:
        engine.shutdown()
    return 0


def _probe(store: Any, top_k: int, cache: Any, runner: Any) -> tuple[dict, Any]:
    bw = bandwidth.probe(store, top_k, cache=cache, runner=runner)
    print("  " + bw.format(), flush=True)
    plans = {str(m or "auto"): hybrid.plan_split(bw, m, top_k).as_dict()
             for m in (None, "gpu", "cpu", "hybrid")}
    h = store.slots.hidden_size
    # the round trip of a call with nothing to compute: the fixed cost of the graph's branch
    empty = statistics.median(
        runner.time_rows(torch.zeros(1, h), torch.full((1, top_k), -1), torch.zeros(1, top_k))
        for _ in range(20))
    return {"bandwidths": bw.as_dict(), "plans": plans, "empty_round_trip_us": empty * 1e6}, bw


def _summary(cases: dict[str, Any]) -> dict[str, Any]:
    tok = {k: (cases.get(k) or {}).get("decode_tok_s") for k in
           ("gpu", "cpu", "hybrid", "laptop_gpu", "laptop_hybrid")}
    out: dict[str, Any] = {"decode_tok_s": tok}
    if tok["gpu"] and tok["hybrid"]:
        out["hybrid_over_gpu"] = tok["hybrid"] / tok["gpu"]
        out["hybrid_over_best_alone"] = tok["hybrid"] / max(tok["gpu"], tok["cpu"] or 0)
    auto = cases.get("auto") or {}
    if auto.get("decode_tok_s") and tok["gpu"]:  # `--experts auto`, settled by decoding
        out["auto_plan"], out["auto_settle_tok_s"] = (auto["experts"]["mode"],
                                                      auto["experts"]["decode_tok_s"])
        out["auto_over_best_alone"] = auto["decode_tok_s"] / max(tok["gpu"], tok["cpu"] or 0)
    if tok["laptop_gpu"] and tok["laptop_hybrid"]:
        out["laptop_hybrid_over_gpu"] = tok["laptop_hybrid"] / tok["laptop_gpu"]
        out["laptop_plan"] = cases["laptop_hybrid"]["experts"]["mode"]
    ref = (cases.get("gpu") or {}).get("greedy_tokens")
    if ref:  # each mode's greedy tokens that agree with gpu-only's before the first that differs
        out["leading_greedy_tokens_equal_to_gpu"] = {
            k: next((i for i, (a, b) in enumerate(zip(ref, c["greedy_tokens"], strict=True))
                     if a != b), len(ref))
            for k, c in cases.items() if isinstance(c, dict) and "greedy_tokens" in c}
    if ref and "forced_top_logprobs" in (cases.get("gpu") or {}):
        out["forced_logprobs_vs_gpu"] = {
            k: _compare_logprobs(cases["gpu"]["forced_top_logprobs"], c["forced_top_logprobs"])
            for k, c in cases.items() if k in ("cpu", "hybrid") and "forced_top_logprobs" in c}
    kernel = cases.get("kernel")
    if kernel:
        out["cpu_kernel_fraction_of_host_read"] = kernel["fraction_of_host_read"]
    fair = cases.get("fair")
    if fair:
        out["fair"] = {k: v for k, v in fair.items() if k != "seconds"}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
