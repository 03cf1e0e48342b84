"""Decode-step overhead on one CUDA GPU: the wall time of one decode step (`runner.forward`:
inputs -> forward -> greedy sampling -> tokens on the host) eagerly and as a replayed CUDA
graph, against the sum of the step's GPU kernel times from torch.profiler, measured in the
same run on the same model.

Qwen3.5-35B-A3B geometry with random weights (`_weights` below: hidden 2048,
256 NVFP4 experts top-8 resident on the GPU, GDN 16/32 heads, attention 16/2 x 256, the real
vocabulary), `--layers` layers (default 8: 6 GDN + 2 attention), every sequence at a 1023-token
context. Cases: KV bf16 and iso3 x batch 1 and 8. Target: decode step <= 1.3x the kernel sum.
Two graph steps are timed: the synchronous one (`graph_step_ms`: the step starts after the
last one's tokens reached the host) and the chained one the engine runs while a batch does
not change (`chained_step_ms`: step N + 1 launched with its input tokens on the device before
step N's tokens are read, `runner.launch(batch, after=pending)`; the mean over a run of
back-to-back steps); the target is judged on the chained step, the engine's decode loop.
Each case records its own failure; the rest go on. Each graph case also records where the
step's time goes besides its kernels (`graph_timeline_us`: host time before the first GPU
work, gaps between kernels inside the GPU span and the pairs of kernels around the largest,
host time after the last), measured under the profiler, and without the profiler the graph's
GPU time replayed back to back (`graph_gpu_ms`) against the step (`step_minus_graph_gpu_ms`:
the part the host adds).

Offloaded cases (`--offload-slots`, default 46 slots per layer: the 6 GiB plan's share; 0
skips them): the routed experts in a pinned host store behind a GPU expert cache (random
routing), KV bf16, batch 1 and 8. Same model, same run; the graph step's gap to its kernel
sum is the host time the step still waits for.

`--dry` runs every case on the CPU instead, on a small model of the same layer pattern in fp32,
the graph runner over the static decode path without capture (no profiler sum, no ratios):
a check that the script still drives today's model, runner and KV backends.

    python bench/decode_overhead.py [--layers 8] [--offload-slots 46]
        -> bench/results/decode_overhead.json
    python bench/decode_overhead.py --dry          -> a JSON in the temp directory
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, run_meta  # noqa: E402

from tinyserve.core import Batch, DenseWeight, NVFP4Weight, SamplingParams, ScheduledSeq  # noqa: E402
from tinyserve.engine.graph import DecodeGraphs  # noqa: E402
from tinyserve.engine.runner import ModelRunner  # noqa: E402
from tinyserve.kv.registry import create_kv_backend  # noqa: E402
from tinyserve.kv.state_pool import GDNStatePool  # noqa: E402
from tinyserve.model.config import ModelConfig  # noqa: E402
from tinyserve.model.qwen35 import Qwen35Model  # noqa: E402
from tinyserve.offload.provider import OffloadedExperts  # noqa: E402
from tinyserve.offload.store import HostExpertStore  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "decode_overhead.json"
PAGE = 16
CONTEXT = 1023  # cached tokens: with the new one 1024, the graphs' capacity exactly
MAX_BATCH = 8
TARGET = 1.3


def _config(layers: int) -> ModelConfig:
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                  for i in range(layers))
    return ModelConfig(num_layers=layers, layer_types=types)


def _weights(cfg: ModelConfig, dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)

    def dense(o: int, i: int) -> DenseWeight:
        return DenseWeight((torch.randn(o, i, generator=g, device=dev) * 0.02).bfloat16())

    def fp4(o: int, i: int) -> NVFP4Weight:
        packed = torch.randint(0, 256, (o, i // 2), generator=g, device=dev, dtype=torch.uint8)
        # E4M3 bits 0x30..0x3F: block scales 0.5 .. 1.875
        scale = torch.randint(0x30, 0x40, (o, i // 16), generator=g, device=dev,
                              dtype=torch.uint8)
        return NVFP4Weight(packed, scale, 0.004)

    def vec(n: int, base: float = 0.0) -> torch.Tensor:
        return base + 0.1 * torch.randn(n, generator=g, device=dev)

    H, F = cfg.hidden_size, cfg.moe_intermediate_size
    w: dict = {"embed_tokens": torch.randn(cfg.vocab_size, H, generator=g, device=dev)
               .bfloat16() * 0.02, "lm_head": dense(cfg.vocab_size, H), "norm": vec(H)}
    for L, kind in enumerate(cfg.layer_types):
        p = f"layers.{L}."
        w[p + "input_layernorm"], w[p + "post_attention_layernorm"] = vec(H), vec(H)
        if kind == "linear_attention":
            a = p + "linear_attn."
            hv = cfg.linear_num_value_heads
            w[a + "in_proj_qkv"] = dense(cfg.linear_conv_dim, H)
            w[a + "in_proj_z"] = dense(cfg.linear_value_dim, H)
            w[a + "in_proj_b"], w[a + "in_proj_a"] = dense(hv, H), dense(hv, H)
            w[a + "out_proj"] = dense(H, cfg.linear_value_dim)
            w[a + "conv1d"] = torch.randn(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim,
                                          generator=g, device=dev) * 0.3
            w[a + "A_log"] = torch.rand(hv, generator=g, device=dev).mul(2.7).log1p()
            w[a + "dt_bias"], w[a + "norm"] = vec(hv), vec(cfg.linear_value_head_dim, 1.0)
        else:
            a = p + "self_attn."
            D = cfg.head_dim
            w[a + "q_proj"] = dense(2 * cfg.num_attention_heads * D, H)
            w[a + "k_proj"], w[a + "v_proj"] = dense(cfg.num_kv_heads * D, H), dense(
                cfg.num_kv_heads * D, H)
            w[a + "o_proj"] = dense(H, cfg.num_attention_heads * D)
            w[a + "q_norm"], w[a + "k_norm"] = vec(D), vec(D)
        m = p + "mlp."
        w[m + "gate"] = dense(cfg.num_experts, H)
        S = cfg.shared_expert_intermediate_size
        w[m + "shared_expert.gate_proj"], w[m + "shared_expert.up_proj"] = fp4(S, H), fp4(S, H)
        w[m + "shared_expert.down_proj"] = fp4(H, S)
        w[m + "shared_expert_gate"] = dense(1, H)
        for e in range(cfg.num_experts):
            w[f"{m}experts.{e}.gate_proj"], w[f"{m}experts.{e}.up_proj"] = fp4(F, H), fp4(F, H)
            w[f"{m}experts.{e}.down_proj"] = fp4(H, F)
    return w


def model_meta(cfg: ModelConfig, **extra: object) -> dict:
    """The JSON description of the `_config` / `_weights` model (with `extra` keys)."""
    return {"layers": cfg.num_layers, "layer_types": list(cfg.layer_types),
            "geometry": "Qwen3.5-35B-A3B", "experts": "NVFP4 (random codes)",
            "other_linears": "bf16 (shared expert NVFP4)", "page_size": PAGE, **extra}


def _dry_config(layers: int):
    """A small model of `_config(layers)`'s layer pattern (head_dim 128 for ISO) for --dry."""
    return dataclasses.replace(
        _config(layers), vocab_size=512, hidden_size=128, num_attention_heads=4,
        num_kv_heads=2, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, eos_token_ids=())


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _model(cfg, w: dict, kv_name: str, dev: str = "cuda", experts=None) -> Qwen35Model:
    per = CONTEXT // PAGE + 2
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    kv = create_kv_backend(kv_name, layer_ids=list(cfg.full_attention_layers),
                           num_kv_heads=cfg.num_kv_heads,
                           num_q_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                           num_pages=MAX_BATCH * per, page_size=PAGE, device=dev, dtype=dtype)
    slots = torch.arange(MAX_BATCH * per * PAGE, device=dev)
    for L in cfg.full_attention_layers:  # real K/V in every slot (ISO: quantized on store)
        k = torch.randn(slots.numel(), cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dtype)
        if kv_name == "bf16":
            kv.write(L, k, torch.randn_like(k), slots)
        else:
            kv.store(L, k, torch.randn_like(k), slots)
    states = GDNStatePool.for_config(cfg, MAX_BATCH + 1, device=dev, dtype=dtype)
    states.conv.normal_(0, 0.5)
    states.recurrent.normal_(0, 0.05)
    if experts is not None:  # the model must not need the expert weights
        w = {k: v for k, v in w.items() if ".mlp.experts." not in k}
    return Qwen35Model(cfg, w, kv=kv, states=states, experts=experts, device=dev, dtype=dtype)


def _offloaded(store: HostExpertStore, slots: int, dev: str) -> OffloadedExperts:
    """A fresh expert cache of `slots` slots over `store` (torch references on the CPU for
    --dry)."""
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    return OffloadedExperts.create(store, slots, device=dev, dtype=dtype,
                                   max_ids=MAX_BATCH * 8)


def _batch(n: int) -> Batch:
    per = CONTEXT // PAGE + 2
    greedy = SamplingParams(temperature=0.0)
    return Batch([ScheduledSeq(f"s{i}", [7 + i], CONTEXT, list(range(i * per, (i + 1) * per)),
                               i, sample=True, params=greedy) for i in range(n)])


class _HitRates:
    """The expert cache's hit rate over each timed mode (stats deltas; nothing without a
    cache)."""

    def __init__(self, experts) -> None:
        self.stats = None if experts is None else experts.stats
        self.rates: dict[str, float] = {}
        self._last = self._now()

    def _now(self) -> tuple[int, int]:
        return (0, 0) if self.stats is None else (self.stats.hits, self.stats.misses)

    def mark(self, mode: str) -> None:
        now = self._now()
        hits, misses = now[0] - self._last[0], now[1] - self._last[1]
        if hits + misses:
            self.rates[mode] = round(hits / (hits + misses), 4)
        self._last = now


def _fed(batch: Batch, tokens: list[int]) -> Batch:
    """`batch` with each sequence's input token replaced by its last sampled one (positions
    unchanged): every mode decodes the tokens it generates, as the engine does, so the
    experts it routes to (and an expert cache's misses) are those of real decoding."""
    return Batch([dataclasses.replace(s, token_ids=[t])
                  for s, t in zip(batch.seqs, tokens, strict=True)])


def _step_ms(runner: ModelRunner, batch: Batch, reps: int) -> float:
    for _ in range(3):  # warm-up (and capture)
        batch = _fed(batch, runner.forward(batch).next_tokens)
    times = []
    for _ in range(reps):
        _sync(runner.device.type)
        t0 = time.perf_counter()
        out = runner.forward(batch)  # ends with the host copy of the tokens
        times.append((time.perf_counter() - t0) * 1e3)
        batch = _fed(batch, out.next_tokens)
    return statistics.median(times)


def _chained_step_ms(runner: ModelRunner, batch: Batch, steps: int) -> float:
    """Mean time of one decode step in a run of chained steps (each launched before the
    previous one's tokens are read, its input tokens taken on the device), the median over
    three runs of `steps` steps; every step's tokens are read on the host, as the engine
    reads them."""
    if not runner.can_chain(batch):
        raise RuntimeError("the batch cannot chain (graphs off, a host embedding table, "
                           "or penalties)")
    runs = []
    for _ in range(4):  # the first run warms up
        _sync(runner.device.type)
        t0 = time.perf_counter()
        pending = runner.launch(batch)
        for _ in range(steps - 1):
            following = runner.launch(batch, after=pending)
            pending.result()
            pending = following
        pending.result()
        runs.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(runs[1:])


def _graph_gpu_split(runner: ModelRunner, batch: Batch, step_ms: float, reps: int) -> dict:
    """The graph step's GPU time without the host: its graph replayed back to back (CUDA
    events, no profiler), and what the step adds to it (inputs, launch, sampling's token copy,
    the wait: the host-exposed part)."""
    entries = list(runner.graphs._entries.values())
    if len(entries) != 1 or entries[0].graph is None:
        return {}
    graph = entries[0].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end) / reps
    return {"graph_gpu_ms": gpu_ms, "step_minus_graph_gpu_ms": step_ms - gpu_ms}


def _kernel_ms(runner: ModelRunner, batch: Batch, reps: int) -> tuple[float, int, dict]:
    """(GPU time of kernels and copies per step, launches per step, the step's timeline)
    from torch.profiler; see `_timeline`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    dev = runner.device.type
    batch = _fed(batch, runner.forward(batch).next_tokens)
    _sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            with record_function(STEP):
                out = runner.forward(batch)
            batch = _fed(batch, out.next_tokens)
        _sync(dev)
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name != STEP]
    steps = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.name == STEP]
    total_us = sum(_device_us(e) for e in gpu)
    return total_us / 1e3 / reps, len(gpu) // reps, _timeline(steps, gpu)


STEP = "decode_step"


def _device_us(e) -> float:
    return getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)


def _timeline(steps: list, gpu: list, top: int = 8) -> dict:
    """Where a step's wall time goes besides its kernels (means over the profiled steps, in
    microseconds, under the profiler): `host_lead` from the step's start to its first GPU
    work, `gpu_span` from there to the end of its last GPU work, of which `gaps` is the time
    no kernel or copy runs (the host lead and the gap after the input copy, where the graph
    launches, also hold the profiler's own host work; without it see
    `_graph_gpu_split`), `host_tail` from then to the step's end (sync, token read-out);
    `top_gaps`: the largest gaps by the pair of kernels around them."""
    sums = {"host_lead": 0.0, "gpu_span": 0.0, "gaps": 0.0, "host_tail": 0.0, "nodes": 0}
    pairs: dict[tuple[str, str], list[float]] = {}
    n = 0
    for s in steps:
        t0, t1 = s.time_range.start, s.time_range.end
        ev = sorted((e for e in gpu if t0 <= e.time_range.start <= t1),
                    key=lambda e: e.time_range.start)
        if not ev:
            continue
        n += 1
        end, busy = ev[0].time_range.start, 0.0
        for prev, e in zip([None, *ev[:-1]], ev, strict=True):
            a, b = e.time_range.start, e.time_range.end
            if prev is not None and a > end:
                pairs.setdefault((prev.name[:60], e.name[:60]), []).append(a - end)
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        span = end - ev[0].time_range.start
        sums["host_lead"] += ev[0].time_range.start - t0
        sums["gpu_span"] += span
        sums["gaps"] += span - busy
        sums["host_tail"] += max(0.0, t1 - end)
        sums["nodes"] += len(ev)
    if not n:
        return {}
    out = {k: round(v / n, 1) for k, v in sums.items()}
    out["mean_gap"] = round(sums["gaps"] / max(sums["nodes"] - n, 1), 2)
    worst = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]
    out["top_gaps"] = [{"after": a, "before": b, "us_per_step": round(sum(g) / n, 1),
                        "count_per_step": round(len(g) / n, 1)} for (a, b), g in worst]
    return out


def _case(cfg, w: dict, kv_name: str, n: int, reps: int, dev: str = "cuda",
          experts=None) -> dict:
    model = _model(cfg, w, kv_name, dev, experts)
    # as the engine builds them: the logits are not kept
    eager = ModelRunner(model, page_size=PAGE, keep_logits=False)
    graph = ModelRunner(model, page_size=PAGE, cuda_graphs=True, graph_pad_slot=MAX_BATCH,
                        keep_logits=False)
    if dev != "cuda":  # --dry: the static decode path without capture
        graph.graphs = DecodeGraphs(model, page_size=PAGE, pad_state_slot=MAX_BATCH,
                                    capture=False)
    if graph.graphs is None:
        raise RuntimeError("the runner did not enable CUDA graphs (kernels off?)")
    batch = _batch(n)
    hits = _HitRates(experts)
    eager_ms = _step_ms(eager, batch, reps)
    hits.mark("eager")
    graph_ms = _step_ms(graph, batch, reps)
    hits.mark("graph")
    chained_ms = _chained_step_ms(graph, batch, 10 * reps)
    hits.mark("chained")
    cache = {} if experts is None else {"offload_slots": experts.cache.num_slots,
                                        "expert_hit_rate": round(experts.stats.hit_rate, 4),
                                        "expert_hit_rate_by_mode": hits.rates}
    if dev != "cuda":
        return {"batch": n, "kv": kv_name, "device": dev, "eager_step_ms": eager_ms,
                "static_step_ms": graph_ms, "static_chained_step_ms": chained_ms, **cache}
    if graph.graphs.num_graphs < 1:
        raise RuntimeError("no decode graph was captured (see the log)")
    split = _graph_gpu_split(graph, batch, graph_ms, reps)
    kern_eager, launches, _ = _kernel_ms(eager, batch, 5)
    kern_graph, graph_events, timeline = _kernel_ms(graph, batch, 5)
    # NOTE: older CUPTI may not trace kernels inside graphs; then the eager sum stands in.
    kern = kern_graph if graph_events >= launches // 2 else kern_eager
    return {
        "batch": n, "kv": kv_name,
        "eager_step_ms": eager_ms, "graph_step_ms": graph_ms,
        "kernel_sum_ms": kern, "kernel_sum_eager_ms": kern_eager,
        "kernel_sum_graph_ms": kern_graph, "launches_per_step": launches,
        "graph_events_per_step": graph_events,
        "chained_step_ms": chained_ms,
        "graph_over_kernels": graph_ms / kern, "eager_over_kernels": eager_ms / kern,
        "chained_over_kernels": chained_ms / kern,
        "meets_target": chained_ms <= TARGET * kern,
        "eager_tok_s": n * 1e3 / eager_ms, "graph_tok_s": n * 1e3 / graph_ms,
        "chained_tok_s": n * 1e3 / chained_ms,
        "graph_speedup": eager_ms / graph_ms, **split, "graph_timeline_us": timeline, **cache,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kv", nargs="+", default=["bf16", "iso3"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, MAX_BATCH])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--offload-slots", type=int, default=46,
                    help="expert-cache slots per layer of the offloaded cases (0: none)")
    ap.add_argument("--dry", action="store_true",
                    help="CPU check on a small model (fp32, no capture, no profiler sums)")
    args = ap.parse_args()
    if args.dry:
        dev, cfg, reps = "cpu", _dry_config(args.layers), 2
        out = args.out or Path(tempfile.gettempdir()) / "decode_overhead_dry.json"
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --dry)", file=sys.stderr)
            return 1
        dev, cfg, reps, out = "cuda", _config(args.layers), args.reps, args.out or OUT
    rec = Recorder(out, run_meta(
        "decode_overhead", bench="decode_overhead", dry=args.dry,
        model=model_meta(cfg, experts="NVFP4 (random codes), resident", context=CONTEXT + 1,
                         page_size=PAGE),
        step="runner.forward of a decode batch: host inputs -> forward -> greedy sampling "
             "-> tokens on the host",
        baseline="sum of the step's GPU kernel and copy times (torch.profiler), and the "
                 "eager step (cuda_graphs=False), same model, same run",
        target=f"chained_step_ms <= {TARGET} x kernel_sum_ms (graph_step_ms: the "
               f"synchronous step, recorded beside it)"))
    w = _weights(cfg, dev)
    for kv_name in args.kv:
        for n in args.batch:
            rec.run(f"{kv_name}_b{n}", _case, cfg, w, kv_name, n, reps, dev)
            if dev == "cuda":
                torch.cuda.empty_cache()
    if args.offload_slots:
        store = HostExpertStore.from_weights(w, cfg)
        slots = max(args.offload_slots, cfg.num_experts // cfg.num_layers + 1) * cfg.num_layers
        slots = max(slots, cfg.num_experts)
        for n in args.batch:
            rec.run(f"offload_b{n}", _case, cfg, w, "bf16", n, reps, dev,
                    _offloaded(store, slots, dev))
            if dev == "cuda":
                torch.cuda.empty_cache()
    _summary(rec.data)
    print(f"wrote {out}")
    return 0 if not rec.data["errors"] else 2


def _summary(data: dict) -> None:
    for name, c in data["cases"].items():
        hit = f"  hit rate {c['expert_hit_rate']:.3f}" if "expert_hit_rate" in c else ""
        if "graph_step_ms" in c:
            print(f"{name:20s} eager {c['eager_step_ms']:7.2f} ms ({c['eager_tok_s']:6.1f} tok/s)"
                  f"  graph {c['graph_step_ms']:6.2f} ms ({c['graph_tok_s']:6.1f} tok/s)  "
                  f"kernels {c['kernel_sum_ms']:6.2f} ms  graph/kernels "
                  f"{c['graph_over_kernels']:.2f}{hit}")
            print(f"{'':20s} chained {c['chained_step_ms']:6.3f} ms "
                  f"({c['chained_tok_s']:6.1f} tok/s)  chained/kernels "
                  f"{c['chained_over_kernels']:.2f} (target {TARGET})")
            if "graph_gpu_ms" in c:
                print(f"{'':20s} graph replayed back to back {c['graph_gpu_ms']:.3f} ms on the "
                      f"GPU: the step adds {c['step_minus_graph_gpu_ms']:.3f} ms")
            t = c.get("graph_timeline_us") or {}
            if t:
                print(f"{'':20s} graph step under the profiler, us: host lead {t['host_lead']}"
                      f"  GPU span {t['gpu_span']} (gaps {t['gaps']} over {t['nodes']} nodes)"
                      f"  host tail {t['host_tail']}")
                for g in t["top_gaps"][:4]:
                    print(f"{'':24s}{g['us_per_step']:6.1f} us  {g['after'][:40]} -> "
                          f"{g['before'][:40]} (x{g['count_per_step']})")
        else:
            print(f"{name:20s} eager {c['eager_step_ms']:7.2f} ms  static "
                  f"{c['static_step_ms']:7.2f} ms  ({c['device']}){hit}")
    for name in data["errors"]:
        print(f"{name:20s} FAILED (see the JSON)")


if __name__ == "__main__":
    sys.exit(main())
