"""Expert-cache hit rate against cache size for every policy, on routing traces (CPU only).

Traces (Qwen3.5-35B-A3B geometry: 40 layers x 256 experts, top-8), `--steps` decode steps
after `--warmup` (the hit rate counts the steps after the warm-up):
- realistic_b1 / realistic_b4: the routing of the full-size checkpoint written with
  `--routing realistic` (bench.routing; computed from its embedding and routers, which is
  what the model routes), one sequence, or four decoding together (different points of
  the text);
- uniform_b1: uniform random routing, what the random checkpoint's router does.

Per trace and cache size (5 %-50 % of the 10,240 experts, one pool shared by the layers):
- host: `bench.cache_sim` policies (exact bookkeeping, one decision per layer): the
  engine's `ExpertCachePolicy` as "lru" (freq_weight 0), "lru-f2" (2, the default), "lru-f16"
  (16) and "lfu"; the candidates "lru-layer" (per-layer quotas), "slru" (segmented LRU),
  "lru2" (LRU-2); "belady" (clairvoyant optimum, an upper bound);
- device: the engine's decode path itself, `DeviceExpertCache` in mode "device" (the torch
  references on the CPU, small expert rows): victim lists two steps behind the lookups
  (`begin_step(defer=True)`, lookups, `after_launch()`), for the engine policies, at
  `--device-fractions`.
Writes bench/results/cache_policies.json.

    python bench/cache_policies.py [--steps 600] [--warmup 100] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_sim import (  # noqa: E402
    ENGINE_WEIGHTS,
    POLICIES,
    batch_trace,
    hit_curve,
    uniform_trace,
)
from bench.common import Recorder, run_meta  # noqa: E402
from bench.routing import REALISTIC, RealisticRouting  # noqa: E402
from tinyserve.model.config import ModelConfig  # noqa: E402
from tinyserve.offload.cache import ExpertCachePolicy  # noqa: E402
from tinyserve.offload.gpu_cache import DeviceExpertCache  # noqa: E402
from tinyserve.offload.store import HostExpertStore  # noqa: E402
from tinyserve.testing.tokenizer import special_token_ids  # noqa: E402

RESULT = ROOT / "bench" / "results" / "cache_policies.json"
FRACTIONS = (0.05, 0.066, 0.1, 0.15, 0.2, 0.25, 0.33, 0.4, 0.5)
DEVICE_FRACTIONS = (0.066, 0.1, 0.15, 0.2, 0.33)
C = ModelConfig()
L, E, K = C.num_layers, C.num_experts, C.num_experts_per_tok


def realistic_trace(steps: int, batch: int, seed: int) -> np.ndarray:
    """The computed routing [steps, L, batch x K] of `batch` sequences, each starting at its
    own point of the full-size realistic checkpoint's text (seed `seed`)."""
    d = RealisticRouting(hidden=C.hidden_size, num_experts=E, top_k=K, vocab_size=1024,
                         text_tokens=range(min(special_token_ids().values())), seed=seed)
    routers = [d.router(la) for la in range(L)]
    starts = np.random.default_rng(seed).choice(d.cycle, size=batch, replace=False)
    return batch_trace([d.expected_topk(d.text(int(s), steps), routers) for s in starts])


def device_hit_rate(trace: np.ndarray, slots: int, freq_weight: float, warmup: int) -> float:
    """Hit rate of the engine's device-driven decode path (module docstring) over `trace`
    [steps, layers, ids] with `slots` slots, from step `warmup` on."""
    return device_hit_rates(trace, slots, freq_weight, (warmup,))[0]


def device_hit_rates(trace: np.ndarray, slots: int, freq_weight: float,
                     warmups: tuple[int, ...]) -> list[float]:
    """`device_hit_rate` from each of `warmups`, in one pass."""
    layers = trace.shape[1]
    store = HostExpertStore(layers, E, 64, 32, fp4=True, pin=False)
    cache = DeviceExpertCache(store, slots, device="cpu",
                              policy=ExpertCachePolicy(slots, freq_weight=freq_weight))
    ids = torch.from_numpy(trace.astype(np.int64))
    marks: dict[int, tuple[int, int]] = {}
    for step in range(trace.shape[0]):
        if step in warmups:
            marks[step] = (cache.stats.hits, cache.stats.misses)
        cache.begin_step(defer=True)
        for layer in range(layers):
            cache.lookup(layer, ids[step, layer].view(1, -1))
        cache.after_launch()
    cache.begin_step()
    out = []
    for w in warmups:
        hits, misses = marks.get(w, (cache.stats.hits, cache.stats.misses))
        hits, misses = cache.stats.hits - hits, cache.stats.misses - misses
        out.append(hits / max(hits + misses, 1))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--device-policies", nargs="+", default=["lru", "lru-f2", "lru-f16"])
    p.add_argument("--device-fractions", type=float, nargs="+", default=list(DEVICE_FRACTIONS))
    p.add_argument("--traces", nargs="+", default=["realistic_b1", "realistic_b4", "uniform_b1"])
    p.add_argument("--quick", action="store_true", help="200 steps after 50, no device runs")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.device_policies = 200, 50, []
    torch.set_num_threads(1)
    rec = Recorder(args.out, run_meta(
        "cache_policies", command="python bench/cache_policies.py " + " ".join(sys.argv[1:]),
        layers=L, experts=E, top_k=K, steps=args.steps, warmup=args.warmup, seed=args.seed,
        profile=REALISTIC.__dict__, fractions=FRACTIONS, engine_weights=ENGINE_WEIGHTS))
    n = args.steps + args.warmup
    makers = {"realistic_b1": lambda: realistic_trace(n, 1, args.seed),
              "realistic_b4": lambda: realistic_trace(n, 4, args.seed),
              "uniform_b1": lambda: uniform_trace(n, L, E, K, args.seed)}
    for name in args.traces:
        trace = makers[name]()

        def case(trace: np.ndarray = trace, name: str = name) -> dict:
            t0 = time.perf_counter()
            host = hit_curve(trace, E, FRACTIONS, args.policies, warmup=args.warmup)
            out = {"host": {pol: {str(f): round(v, 4) for f, v in c.items()}
                            for pol, c in host.items()},
                   "host_s": round(time.perf_counter() - t0, 1), "device": {}}
            for pol in args.device_policies if name.startswith("realistic") else ():
                out["device"][pol] = {
                    str(f): round(device_hit_rate(trace, round(f * L * E), ENGINE_WEIGHTS[pol],
                                                  args.warmup), 4)
                    for f in args.device_fractions}
            return out

        rec.run(name, case)
    rec.save()
    for name, case in rec.data["cases"].items():
        print(f"\n{name}  (hit rate, host-driven)")
        print(f"{'policy':10s}" + "".join(f"{f:>7.1%}" for f in FRACTIONS))
        for pol, c in case["host"].items():
            print(f"{pol:10s}" + "".join(f"{c[str(f)]:7.3f}" for f in FRACTIONS))
        for pol, c in case["device"].items():
            print(f"{pol + '@dev':10s}" + "".join(
                f"{c[str(f)]:7.3f}" if str(f) in c else f"{'':7s}" for f in FRACTIONS))
    return 0 if not rec.data["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
