"""End-to-end expert offload on the full-size random Qwen3.5-35B-A3B-shaped NVFP4 checkpoint.

Runs unattended on one CUDA GPU (~21 GB of local disk, ~20 GB of host RAM for the pinned
store) and writes bench/results/e2e_offload.json after every case; a failing case is recorded
and the rest still run. Measured at the model level (Qwen35Model + ModelRunner + the
OffloadedExperts provider), so that the copy kernels and prefill streaming are timed on their
own; the engine at `--gpu-memory 6GiB` is measured by bench/memory_budget.py and
bench/realistic_decode.py.

Cases:
- checkpoint: write it (bench.fullsize) unless it is already there.
- store: load the routed experts into the registered host store.
- h2d: plain pinned-memory copy (the baseline), cudaMemcpy from the registered store, the
  zero-copy copy kernel over 256 random experts (block sweep) and over 8 (a decode layer),
  one whole layer's experts as prefill streaming copies them (6 row ranges, async copies on
  a side stream), and the latency of the lookup kernel.
- offload: the plan for `--gpu-memory 6GiB --kv iso3 --max-context 131072` (embedding on
  the GPU: this bench's model has no CPU row gather), the allocator capped at the plan's
  cap; prefill tok/s at 8k and 30k (prefill streaming on: the default), decode tok/s at 1k
  and 32k context, hit rates, miss bytes per decode token, peak memory
  (after an untimed warm-up sequence of three chunks).
- prefill_stream: the same runner prefilling 8k tokens with prefill streaming off (the cache
  path: lookup + miss copy kernel, then the MoE) and on (offload.prefetch: whole layers
  copied on a side stream while the previous layer computes), each after a warm-up chunk:
  tok/s, ms per chunk, the H2D bytes and the achieved H2D GB/s over the prefill (vs the
  pinned copy of `h2d`), and the copy-bound floor (every expert of a chunk at the pinned
  copy rate).
- skewed: decode with a synthetic skewed router (below) under the same plan, with the
  default policy (LRU + frequency term, weight 16) and with plain LRU (weight 0).
- offload_cuda_graphs: the offloaded decode at 1k replaying CUDA graphs (lookup and miss
  copies inside the graph; the host policy runs between replays).
- resident: every expert in GPU slots (no budget), the same measurements (and the decode of
  offload_cuda_graphs): the upper bound.

Skewed synthetic router: a random-weight model routes almost uniformly, which no cache policy
can exploit. The skewed runs replace each layer's top-k ids by k distinct draws from a fixed
per-layer Zipf(1.0) popularity over a random order of the experts (torch.multinomial on the
device), keeping the model's routing weights.

    python bench/e2e_offload.py [--ckpt DIR] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Recorder, run_meta, sync  # noqa: E402
from tinyserve.core import Batch, SamplingParams, ScheduledSeq  # noqa: E402
from tinyserve.engine.config import EngineConfig, parse_size  # noqa: E402
from tinyserve.engine.device_memory import DeviceMemory  # noqa: E402
from tinyserve.engine.planner import plan_checkpoint  # noqa: E402
from tinyserve.engine.runner import ModelRunner  # noqa: E402
from tinyserve.kv.registry import create_kv_backend  # noqa: E402
from tinyserve.kv.state_pool import GDNStatePool  # noqa: E402
from tinyserve.model.config import load_config  # noqa: E402
from tinyserve.model.loader import iter_weights  # noqa: E402
from tinyserve.model.qwen35 import Qwen35Model  # noqa: E402
from tinyserve.offload.cache import ExpertCachePolicy  # noqa: E402
from tinyserve.offload.provider import OffloadedExperts  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
from tinyserve.offload.store import HostExpertStore  # noqa: E402

RESULT = ROOT / "bench" / "results" / "e2e_offload.json"
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def cuda_time(fn, reps: int = 5) -> float:
    """Best of `reps` timings of fn() in seconds (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def mem_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


# ------------------------------------------------------------------------------------ cases


def case_checkpoint(ckpt: Path, layers: int | None) -> dict:
    if (ckpt / "config.json").is_file():
        return {"path": str(ckpt), "written": False}
    from bench.fullsize import write_fullsize_checkpoint

    write_fullsize_checkpoint(ckpt, layers=layers)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    return {"path": str(ckpt), "written": True, "gb": round(size / 1e9, 2)}


def case_store(ckpt: Path, config: Any) -> tuple[dict, HostExpertStore]:
    store = HostExpertStore.from_checkpoint(ckpt, config)
    return {"gib": round(store.nbytes / GiB, 3), "pinned": store.pinned,
            "bytes_per_expert": store.bytes_per_expert}, store


def case_h2d(store: HostExpertStore, config: Any) -> dict:
    from tinyserve.kernels.moe.fused import allocate_expert_slots
    from tinyserve.offload import lookup as lk

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    out["pinned_copy_gbps"] = n / cuda_time(lambda: dst.copy_(src, non_blocking=True)) / 1e9
    region = store.buffer[: min(n, store.nbytes)]
    out["store_memcpy_gbps"] = region.numel() / cuda_time(
        lambda: dst[: region.numel()].copy_(region, non_blocking=True)) / 1e9
    dst = None
    rows_total = store.num_layers * store.num_experts
    slots = allocate_expert_slots(256, config.hidden_size, config.moe_intermediate_size,
                                  fp4=store.slots.is_fp4, device="cuda")
    g = torch.Generator().manual_seed(0)
    for count in (256, 8):
        rows = torch.randperm(rows_total, generator=g)[:count].int().cuda()
        sl = torch.arange(count, dtype=torch.int32, device="cuda")
        nbytes = count * store.bytes_per_expert
        sweep = {}
        for block in (1024, 2048, 4096, 8192):
            try:
                t = cuda_time(lambda b=block, r=rows, s=sl: lk.copy_rows(store.slots, slots, r, s,
                                                                        block=b))
                sweep[block] = round(nbytes / t / 1e9, 2)
            except Exception as exc:
                sweep[block] = f"error: {exc!r}"[:300]
        out[f"copy_kernel_{count}_experts_gbps"] = sweep
        ok = [v for v in sweep.values() if isinstance(v, float)]
        if ok:
            out[f"copy_kernel_{count}_vs_pinned"] = round(max(ok) / out["pinned_copy_gbps"], 3)
    # One layer as prefill streaming copies it: 6 contiguous row ranges, side stream.
    side = torch.cuda.Stream()
    E = store.num_experts
    layer_rows = slice(E, 2 * E)  # layer 1

    def layer_copy() -> None:
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            for f in lk.FIELDS:
                a = getattr(store.slots, f)
                if a is not None:
                    getattr(slots, f)[:E].copy_(a[layer_rows], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    out["store_is_pinned_for_torch"] = bool(store.buffer.is_pinned())
    out["layer_copy_gbps"] = round(E * store.bytes_per_expert / cuda_time(layer_copy) / 1e9, 2)
    # Check the copy, then time the lookup kernel at decode size.
    rows = torch.randperm(rows_total, generator=g)[:8].int()
    lk.copy_rows(store.slots, slots, rows.cuda(), torch.arange(8, dtype=torch.int32).cuda())
    torch.cuda.synchronize()
    out["copy_exact"] = all(torch.equal(getattr(slots, f)[:8].cpu().view(torch.uint8),
                                        getattr(store.slots, f)[rows.long()].view(torch.uint8))
                            for f in ("w13", "w2_scale"))
    L, E, S = store.num_layers, store.num_experts, 1024
    table = torch.full((L * E + 1,), -1, dtype=torch.int32, device="cuda")
    owner = torch.full((S + 1,), -1, dtype=torch.int32, device="cuda")
    victims = torch.randperm(S, generator=g)[:256].int().cuda()
    ids = torch.randint(0, E, (1, 8), device="cuda")
    out["lookup_us"] = 1e6 * cuda_time(lambda: lk.expert_lookup(ids, 0, table, owner, victims, E))
    out["pinned_copy_gbps"] = round(out["pinned_copy_gbps"], 2)
    out["store_memcpy_gbps"] = round(out["store_memcpy_gbps"], 2)
    return out


class SkewedRouter:
    """Experts provider wrapper: top-k ids drawn from a per-layer Zipf popularity."""

    def __init__(self, inner: Any, config: Any, zipf: float = 1.0, seed: int = 0) -> None:
        self.inner = inner
        g = torch.Generator().manual_seed(seed)
        E = config.num_experts
        w = torch.arange(1, E + 1, dtype=torch.float32) ** -zipf
        self.probs = torch.stack([w[torch.randperm(E, generator=g)]
                                  for _ in range(config.num_layers)]).cuda()
        self.gen = torch.Generator(device="cuda").manual_seed(seed)

    def forward(self, layer_id, x, topk_ids, topk_weights, **shared):
        n, k = topk_ids.shape
        probs = self.probs[layer_id].expand(n, -1).contiguous()
        ids = torch.multinomial(probs, k, generator=self.gen)
        return self.inner.forward(layer_id, x, ids, topk_weights, **shared)

    def __getattr__(self, name: str) -> Any:
        # stats, begin_step, after_launch (the deferred policy), capturable: the provider's
        return getattr(self.inner, name)


def set_experts(runner: ModelRunner, experts: Any) -> None:
    runner.model.experts = experts
    for layer in runner.model.layers:
        layer.mlp.experts = experts


def run_seq(runner: ModelRunner, n_prompt: int, n_decode: int, chunk: int, pages: list[int],
            *, prefill_starts: int = 0, warmup: int = 2) -> dict:
    """Prefill n_prompt random tokens in chunks, then decode; tok/s of both."""
    g = torch.Generator().manual_seed(n_prompt)
    ids = torch.randint(0, runner.model.config.vocab_size, (n_prompt,), generator=g).tolist()
    experts = runner.model.experts
    sync()
    t0 = time.perf_counter()
    token = None
    chunk_ms = []  # per chunk (synchronised): flat when attention over the prefix is cheap
    for start in range(0, n_prompt, chunk):
        part = ids[start:start + chunk]
        last = start + len(part) == n_prompt
        seq = ScheduledSeq("b", part, start_pos=start, page_ids=pages, state_slot=0,
                           sample=last, params=GREEDY)
        tc = time.perf_counter()
        token = runner.forward(Batch([seq])).next_tokens[0]
        sync()
        chunk_ms.append(round(1e3 * (time.perf_counter() - tc), 1))
    prefill_s = time.perf_counter() - t0
    s0 = experts.stats.as_dict()
    pos, t_dec, done = n_prompt, 0.0, 0
    for step in range(warmup + n_decode):
        if step == warmup:
            sync()
            t1 = time.perf_counter()
            s0 = experts.stats.as_dict()
        seq = ScheduledSeq("b", [token], start_pos=pos, page_ids=pages, state_slot=0,
                           sample=True, params=GREEDY)
        token = runner.forward(Batch([seq])).next_tokens[0]
        pos += 1
        done += step >= warmup
    sync()
    t_dec = time.perf_counter() - t1 if n_decode else 0.0
    s1 = experts.stats.as_dict()
    hits, misses = s1["hits"] - s0["hits"], s1["misses"] - s0["misses"]
    return {"prompt": n_prompt, "prefill_tok_s": round(n_prompt / prefill_s, 1),
            "prefill_chunk_ms": chunk_ms,
            "decode_tok_s": round(done / t_dec, 2) if done else None,
            "decode_hit_rate": round(hits / max(1, hits + misses), 4),
            "decode_miss_mb_per_token": round((s1["h2d_bytes"] - s0["h2d_bytes"])
                                              / max(1, done) / 1e6, 1)}


def measure(runner: ModelRunner, plan: Any, quick: bool) -> dict:
    page = plan.page_size
    pages = list(range(min(plan.kv_pages, -(-34000 // page))))
    chunk = plan.prefill_chunk
    out: dict[str, Any] = {}
    steps = 16 if quick else 32
    # NOTE: an untimed warm-up sequence of three chunks first (prefix 0, one chunk - flash,
    # two chunks - cuDNN), so the timed rows do not pay first calls (Triton builds, cuDNN
    # plans): without it the 8k row, the first with a prefix, took 1.1-2.4k tok/s against 6k
    # for 30k, and with two chunks its first cuDNN-prefix chunk still took 1.4 s, not 0.34 s
    out["warmup"] = run_seq(runner, 3 * chunk, 2, chunk, pages)
    for name, n_prompt, n_dec in (("ctx1k", 1024, steps), ("prefill8k", 8192, 0),
                                  ("ctx32k", 30720 if not quick else 8192, steps)):
        torch.cuda.reset_peak_memory_stats()
        try:
            out[name] = run_seq(runner, n_prompt, n_dec, chunk, pages)
        except Exception as exc:
            out[name] = {"error": repr(exc)[:500]}
        out[name]["peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MiB, 1)
        out[name]["peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / MiB, 1)
        out[name]["device_used_mib"] = round(mem_used() / MiB, 1)
        out[name]["within_budget"] = mem_used() <= plan.gpu_memory
    out["cache"] = runner.model.experts.stats.as_dict()
    out["cache"]["layer_hit_rate"] = {k: round(v, 3)
                                      for k, v in out["cache"]["layer_hit_rate"].items()}
    return out


def time_prefill(runner: ModelRunner, n_prompt: int, chunk: int, pages: list[int]
                 ) -> tuple[float, int]:
    """(seconds, H2D bytes) of prefilling `n_prompt` random tokens in chunks of `chunk`."""
    g = torch.Generator().manual_seed(n_prompt + 1)
    ids = torch.randint(0, runner.model.config.vocab_size, (n_prompt,), generator=g).tolist()
    stats = runner.model.experts.stats
    sync()
    b0, t0 = stats.h2d_bytes, time.perf_counter()
    for start in range(0, n_prompt, chunk):
        part = ids[start:start + chunk]
        seq = ScheduledSeq("s", part, start_pos=start, page_ids=pages, state_slot=0,
                           sample=start + len(part) == n_prompt, params=GREEDY)
        runner.forward(Batch([seq]))
    sync()
    return time.perf_counter() - t0, stats.h2d_bytes - b0


def prefill_stream(runner: ModelRunner, plan: Any, config: Any, n_prompt: int,
                   pinned_gbps: float | None) -> dict:
    """8k prefill with prefill streaming off and on (same runner, same cache)."""
    experts = runner.model.experts
    streamer = experts.streamer
    chunk = plan.prefill_chunk
    pages = list(range(min(plan.kv_pages, -(-34000 // plan.page_size))))
    out: dict[str, Any] = {"streaming": streamer is not None, "chunk": chunk,
                           "min_pairs": getattr(streamer, "min_pairs", None)}
    chunk_bytes = config.num_layers * config.num_experts * experts.cache.store.bytes_per_expert
    if pinned_gbps:
        out["copy_floor_ms_per_chunk"] = round(1e3 * chunk_bytes / (pinned_gbps * 1e9), 1)
        out["copy_floor_tok_s"] = round(chunk / (chunk_bytes / (pinned_gbps * 1e9)), 1)
    for label, s in (("stream_off", None), ("stream_on", streamer)):
        if label == "stream_on" and s is None:
            continue
        experts.begin_step()  # gives the staging regions back before switching
        experts.streamer = s
        time_prefill(runner, chunk, chunk, pages)  # warm-up: this path's kernels and shapes
        secs, nbytes = time_prefill(runner, n_prompt, chunk, pages)
        out[label] = {"prefill_tok_s": round(n_prompt / secs, 1),
                      "ms_per_chunk": round(1e3 * secs * chunk / n_prompt, 1),
                      "h2d_gb": round(nbytes / 1e9, 2),
                      "h2d_gbps": round(nbytes / secs / 1e9, 2)}
        if pinned_gbps:
            out[label]["h2d_vs_pinned"] = round(nbytes / secs / 1e9 / pinned_gbps, 3)
    experts.begin_step()
    experts.streamer = streamer
    if "stream_on" in out:
        out["speedup"] = round(out["stream_on"]["prefill_tok_s"]
                               / out["stream_off"]["prefill_tok_s"], 3)
    return out


def build_runner(ckpt: Path, config: Any, plan: Any, experts: Any, weights: dict,
                 graphs: bool = False) -> ModelRunner:
    dtype = torch.bfloat16
    kv = create_kv_backend(plan.kv_format, layer_ids=list(config.full_attention_layers),
                           num_kv_heads=config.num_kv_heads,
                           num_q_heads=config.num_attention_heads, head_dim=config.head_dim,
                           num_pages=plan.kv_pages, page_size=plan.page_size, device="cuda",
                           dtype=dtype)
    states = GDNStatePool.for_config(config, plan.state_slots, device="cuda", dtype=dtype)
    model = Qwen35Model(config, weights, kv=kv, states=states, experts=experts, device="cuda",
                        dtype=dtype)
    if graphs:  # decode steps replay CUDA graphs; state slot 1 pads the batch
        return ModelRunner(model, page_size=plan.page_size, cuda_graphs=True, graph_pad_slot=1)
    return ModelRunner(model, page_size=plan.page_size)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default=os.environ.get("TINYSERVE_FULLSIZE_DIR",
                                                    "/tmp/tinyserve-fullsize"))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--gpu-memory", default="6GiB")
    p.add_argument("--kv", default="iso3")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--quick", action="store_true", help="shorter sequences")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("e2e_offload needs a CUDA GPU", file=sys.stderr)
        return 1

    rec = Recorder(RESULT, run_meta("e2e_offload", args=vars(args),
                                    level="model (Qwen35Model + ModelRunner, eager)"))
    ckpt = Path(args.ckpt)
    rec.run("checkpoint", case_checkpoint, ckpt, args.layers)
    config = load_config(ckpt)
    store = rec.run("store", case_store, ckpt, config)
    if store is None:
        return 1
    h2d = rec.run("h2d", case_h2d, store, config)
    pinned_gbps = h2d.get("pinned_copy_gbps") if isinstance(h2d, dict) else None
    budget = parse_size(args.gpu_memory)
    torch.cuda.empty_cache()
    context = mem_used()  # CUDA context (+ nothing else: every case above freed its memory)
    rec.data["device_used_before_model_mib"] = round(context / MiB, 1)
    # The model of this bench keeps the embedding on the GPU: the plan's embedding moves
    # there and takes the expert slots it needs.
    econfig = EngineConfig(model=str(ckpt), kv=args.kv, max_context=args.max_context,
                           gpu_memory=budget, device="cuda", max_seqs=1)
    device = DeviceMemory(device="cuda", budget=budget, budget_source=args.gpu_memory,
                          startup=max(context, 256 * MiB), startup_source="device used")
    plan = plan_checkpoint(econfig, ckpt, device)
    plan = dataclasses.replace(plan, embed_device="cuda", expert_slots=plan.expert_slots
                               - -(-plan.embed_bytes // plan.expert_slot_bytes))
    rec.data["plan"] = plan.as_dict()
    rec.save()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(plan.allocator_cap / total)
    weights = dict(iter_weights(ckpt, config, dtype=torch.bfloat16, device="cuda",
                                include_experts=False))

    def offload_case() -> tuple[dict, ModelRunner]:
        experts = OffloadedExperts.create(store, plan.expert_slots, device="cuda",
                                          max_ids=plan.prefill_chunk * 8)
        runner = build_runner(ckpt, config, plan, experts, weights)
        return {"expert_slots": plan.expert_slots, "context_tokens": plan.context_tokens,
                "triton_lookup": experts.cache.use_triton,
                "prefill_streaming": experts.streamer is not None,
                **measure(runner, plan, args.quick)}, runner

    runner = rec.run("offload", offload_case)
    if runner is not None:
        rec.run("prefill_stream", prefill_stream, runner, plan, config, 8192, pinned_gbps)

    def skewed_case() -> dict:
        out = {}
        for label, w in (("lfru_w16", 16.0), ("lru", 0.0)):
            set_experts(runner, None)  # free the previous cache before the next one
            torch.cuda.empty_cache()
            inner = OffloadedExperts.create(
                store, plan.expert_slots, device="cuda", max_ids=plan.prefill_chunk * 8,
                policy=ExpertCachePolicy(plan.expert_slots, freq_weight=w,
                                         bytes_per_expert=store.bytes_per_expert))
            set_experts(runner, SkewedRouter(inner, config))
            r = run_seq(runner, 1024, 96 if not args.quick else 48, plan.prefill_chunk,
                        list(range(64 + 1024 // plan.page_size)), warmup=16)
            out[label] = {k: r[k] for k in ("decode_tok_s", "decode_hit_rate",
                                            "decode_miss_mb_per_token")}
            out[label]["device_used_mib"] = round(mem_used() / MiB, 1)
            del inner
        return out

    if runner is not None:
        rec.run("skewed", skewed_case)
        set_experts(runner, None)
        del runner
    torch.cuda.empty_cache()

    def graphs_case() -> dict:
        experts = OffloadedExperts.create(store, plan.expert_slots, device="cuda",
                                          max_ids=plan.prefill_chunk * 8)
        runner = build_runner(ckpt, config, plan, experts, weights, graphs=True)
        pages = list(range(64 + 1024 // plan.page_size))
        out = run_seq(runner, 1024, 32, plan.prefill_chunk, pages, warmup=4)
        out["graphs_captured"] = (runner.graphs.num_graphs if runner.graphs is not None
                                  else "graphs off (provider not capturable?)")
        out["device_used_mib"] = round(mem_used() / MiB, 1)
        return out

    rec.run("offload_cuda_graphs", graphs_case)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)

    def resident_case() -> dict:
        rows = config.num_layers * config.num_experts
        experts = OffloadedExperts.create(store, rows, device="cuda",
                                          max_ids=plan.prefill_chunk * 8)
        experts.cache.preload_all()
        runner = build_runner(ckpt, config, plan, experts, weights)
        out = {"expert_slots": rows, **measure(runner, plan, args.quick)}
        del runner
        # the upper bound of offload_cuda_graphs: the same decode, every expert resident
        runner = build_runner(ckpt, config, plan, experts, weights, graphs=True)
        out["cuda_graphs_ctx1k"] = run_seq(runner, 1024, 32, plan.prefill_chunk,
                                           list(range(64 + 1024 // plan.page_size)), warmup=4)
        return out

    rec.run("resident", resident_case)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
