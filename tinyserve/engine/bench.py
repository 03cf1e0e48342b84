"""`tinyserve bench MODEL`: prefill and decode speed of the whole engine.

`--batch` requests of `--prompt-len` random tokens generate `--gen-len` tokens each (greedy,
EOS ignored) after a warm-up of the same shape. With offloaded experts the run's cache counters
and hit rates are reported: overall, decode only, and warm decode (after `WARM_TOKENS`).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from tinyserve.core import SamplingParams
from tinyserve.engine.build import build_engine
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.graph import capacity_pages
from tinyserve.engine.loop import Engine, EngineStats
from tinyserve.engine.stream import RequestHandle
from tinyserve.testing.provenance import current_commit

WARM_TOKENS = 64  # decode tokens per request before the warm expert hit rate counts


def bench_command(args: Any) -> int:
    """Run the benchmark of CLI `args`; print the memory plan and a summary (or JSON).
    Raises ValueError when a request of the asked lengths does not fit the plan's context."""
    if args.bandwidth:
        return bandwidth_command(args)
    config = bench_config(args)
    engine = build_engine(config).start()
    try:
        need = args.prompt_len + args.gen_len
        if need > engine.max_context:
            raise ValueError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} = "
                             f"{need} tokens, but the plan holds {engine.max_context} per "
                             f"sequence: lower them or raise --max-context")
        result = run_bench(engine, prompt_len=args.prompt_len, gen_len=args.gen_len,
                           batch=args.batch)
    finally:
        engine.shutdown()
    plan = engine.memory_plan
    result["config"] = {"model": config.model, "kv": plan.kv_format, "device": plan.device,
                        "max_seqs": plan.max_seqs, "max_context": engine.max_context}
    result["memory_plan"] = plan.as_dict()
    experts_plan = engine.runner.model.experts.hybrid_plan
    if experts_plan is not None:
        result["experts"] = experts_plan.as_dict()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{plan.format()}\n{format_result(result)}")
    return 0


def bench_config(args: Any) -> EngineConfig:
    """The config `tinyserve run` makes with the same flags, with room for `--batch` sequences."""
    if min(args.prompt_len, args.gen_len, args.batch) < 1:
        raise ValueError("--prompt-len, --gen-len and --batch must be >= 1")
    overrides: dict[str, Any] = {}
    if args.batch > 1:
        overrides["max_seqs"] = max(args.batch, args.max_seqs or 0)
    return EngineConfig.from_args(args, **overrides)


def bandwidth_command(args: Any) -> int:
    """`tinyserve bench MODEL --bandwidth`: the start-up probe of `offload.bandwidth` on a
    random store of the model's expert geometry (at most 4 GiB; pinned on CUDA), and the
    plan each mode gets from it; the checkpoint's config alone is read."""
    from tinyserve.model.config import load_config
    from tinyserve.model.loader import resolve_model_path
    from tinyserve.offload import bandwidth, hybrid
    from tinyserve.offload.gpu_cache import DeviceExpertCache

    mcfg = load_config(resolve_model_path(args.model))
    store = bandwidth.synthetic_store(mcfg)
    cache = None
    device = EngineConfig.from_args(args).resolved_device
    if device.startswith("cuda"):
        cache = DeviceExpertCache(store, mcfg.num_experts, device=device)
    top_k = mcfg.num_experts_per_tok
    runner = hybrid.CpuExperts(store, device=device)
    bw = bandwidth.probe(store, top_k, cache=cache, runner=runner)
    modes = {m: hybrid.plan_split(bw, m, top_k) for m in (None, "gpu", "cpu", "hybrid")
             if bw.h2d is not None or m != "hybrid"}
    result = {"bandwidths": bw.as_dict(), "store_bytes": store.nbytes,
              "plans": {str(m or "auto"): p.as_dict() for m, p in modes.items()},
              "device": torch.cuda.get_device_name() if cache is not None else "cpu",
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "commit": current_commit()}
    print(json.dumps(result, indent=2) if args.json else modes[None].format())
    return 0


def run_bench(engine: Engine, *, prompt_len: int, gen_len: int, batch: int,
              sampling: SamplingParams | None = None) -> dict[str, Any]:
    """Measure one batch on a started engine; plain numbers (seconds, tokens/s). `sampling`
    (greedy by default) is the measured requests' (max_tokens = gen_len, EOS ignored)."""
    gen = torch.Generator().manual_seed(0)
    params = replace(sampling or SamplingParams(temperature=0.0), max_tokens=gen_len,
                     ignore_eos=True)
    # NOTE: the warm-up (same shape, other tokens) compiles the prefill kernels and captures
    # the measured run's decode graphs before the clock starts; it decodes through `gen_len`
    # tokens only when the measured run crosses a graph capacity.
    page_size = engine.config.page_size
    crosses = (capacity_pages(prompt_len + 1, page_size)
               != capacity_pages(prompt_len + gen_len - 1, page_size))
    warm = SamplingParams(max_tokens=gen_len if crosses else min(gen_len, 2), temperature=0.0,
                          ignore_eos=True)
    _collect([engine.submit(engine.random_prompt(prompt_len, gen), warm) for _ in range(batch)])
    prompts = [engine.random_prompt(prompt_len, gen) for _ in range(batch)]
    cuda = torch.cuda.is_available() and engine.config.resolved_device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    stats0, graphs0 = engine.stats(), _num_graphs(engine)
    start = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    # NOTE: the device-driven cache folds a step's counts one or two steps late, so a
    # snapshot may miss the last step or two (~0.5 % of a 512-token run).
    marks = {1: None, 1 + WARM_TOKENS: None} if gen_len > 1 + WARM_TOKENS else {1: None}
    timings = _collect(handles, marks, engine.stats)
    end = time.perf_counter()
    first = [t[0] - start for t in timings]
    last_first = max(first)
    decoded = sum(n - 1 for n in (len(t) for t in timings))
    decode_time = end - start - last_first
    itl = [b - a for t in timings for a, b in zip(t, t[1:], strict=False)]
    after = engine.stats()
    return {
        "prompt_len": prompt_len, "gen_len": gen_len, "batch": batch,
        "prefill_tok_s": batch * prompt_len / last_first,
        "decode_tok_s": decoded / decode_time if decode_time > 0 and decoded else None,
        "decode_step_ms": 1e3 * statistics.median(itl) if itl else None,
        "decode_step_ms_p90": 1e3 * _quantile(itl, 0.9) if itl else None,
        "decode_step_ms_max": 1e3 * max(itl) if itl else None,
        "ttft_s": {"mean": statistics.fmean(first), "max": last_first},
        "total_s": end - start,
        "steps": after.steps - stats0.steps,
        "graphs_captured": _num_graphs(engine) - graphs0,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "expert_hit_rate": _hit_rate(stats0, after),
        "decode_expert_hit_rate": _hit_rate(marks.get(1), after),
        "warm_expert_hit_rate": _hit_rate(marks.get(1 + WARM_TOKENS), after),
        "expert_cache": _expert_cache(stats0, after),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": current_commit(),
    }


def _collect(handles: list[RequestHandle], marks: dict[int, Any] | None = None,
             snapshot: Any = None) -> list[list[float]]:
    """Arrival time of every output token of each request (one reader thread each).
    `marks`: token counts n -> filled with `snapshot()` once every request has n tokens."""
    timings: list[list[float]] = [[] for _ in handles]
    errors: list[str] = []
    marks = {} if marks is None else marks
    lock = threading.Lock()
    waiting = dict.fromkeys(marks, len(handles))  # n -> requests without n tokens yet

    def read(i: int) -> None:
        for out in handles[i]:
            before = len(timings[i])
            timings[i].extend([time.perf_counter()] * len(out.token_ids))
            for n in marks:
                if before < n <= len(timings[i]):
                    with lock:
                        waiting[n] -= 1
                        if waiting[n] == 0:
                            marks[n] = snapshot()
            if out.error:
                errors.append(out.error)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or any(not t for t in timings):
        raise RuntimeError(f"a benchmark request failed: {errors[:1] or 'no tokens'}")
    return timings


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _num_graphs(engine: Engine) -> int:
    graphs = engine.runner.graphs
    return 0 if graphs is None else graphs.num_graphs


def _hit_rate(before: EngineStats | None, after: EngineStats) -> float | None:
    """Expert-cache hit rate between two engine stats (None without counters or lookups)."""
    cache = None if before is None else _expert_cache(before, after)
    lookups = cache["hits"] + cache["misses"] if cache else 0
    return cache["hits"] / lookups if lookups else None


def _expert_cache(before: EngineStats, after: EngineStats) -> dict[str, Any] | None:
    """Expert-cache hits, misses and host-to-device bytes during the run (None: no cache)."""
    if after.expert_cache_hits is None:
        return None
    cpu = after.expert_cpu_computed
    return {"hits": after.expert_cache_hits - (before.expert_cache_hits or 0),
            "misses": after.expert_cache_misses - (before.expert_cache_misses or 0),
            "h2d_bytes": after.expert_cache_h2d_bytes - (before.expert_cache_h2d_bytes or 0),
            "cpu_computed": None if cpu is None else cpu - (before.expert_cpu_computed or 0)}


def format_result(r: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    mem, cache = r["peak_memory_bytes"], r["expert_cache"]
    lines = [
        f"device            {r['device']}",
        f"batch x prompt    {r['batch']} x {r['prompt_len']} tokens, {r['gen_len']} generated",
        f"prefill           {num(r['prefill_tok_s'], ',.1f')} tok/s",
        f"decode            {num(r['decode_tok_s'], ',.1f')} tok/s",
        "decode step       " + " / ".join(num(r[f"decode_step_ms{q}"], ",.2f") for q in
                                            ("", "_p90", "_max")) + " ms (median / p90 / max)",
        f"TTFT mean / max   {r['ttft_s']['mean'] * 1e3:,.1f} / {r['ttft_s']['max'] * 1e3:,.1f} ms",
        f"peak GPU memory   {'n/a' if mem is None else f'{mem / 2**30:.2f} GiB'}",
        f"expert hit rate   {num(r['expert_hit_rate'], '.1%')} (decode "
        f"{num(r['decode_expert_hit_rate'], '.1%')}, warm decode "
        f"{num(r['warm_expert_hit_rate'], '.1%')})",
    ]
    if cache:
        lines.append(f"expert misses     {cache['misses']:,} "
                     f"({cache['h2d_bytes'] / 2**30:.2f} GiB host to device)")
        if cache["cpu_computed"] is not None and "experts" in r:
            lines.append(f"experts on CPU    {cache['cpu_computed']:,} ({r['experts']['mode']})")
    lines.append(f"engine steps      {r['steps']} ({r['graphs_captured']} graphs captured)")
    return "\n".join(lines)
