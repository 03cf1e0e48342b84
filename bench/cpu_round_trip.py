"""Where a CPU expert call's time goes between the decode graph and the kernel (offload.hybrid).

One token's call of 0 (an empty request: no pair on the CPU), 1 and top_k experts of a random
store, on each thread count the probe tries, timed four ways:

    kernel   `moe_pooled` called from Python on numpy inputs (wall clock; `moe_cpu`'s pool)
    worker   the HostWorker's native loop, requested and awaited by Python polling its flags
    graph    the decode layer's round trip (`CpuExperts.start` / `join` in a CUDA graph: the
             request written, its flag, the wait for the answer, the answer added), one replay
             timed between events, as the start-up probe times it
    chain    R such round trips in one graph, each after a GPU spin of `gap` us (a decode
             layer's other work), timed together and divided by R

plus the length of the worker's spin-wait before it sleeps.

    python bench/cpu_round_trip.py [--store-gib 2] [--out bench/results/cpu_round_trip.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from numba import njit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import expert_store, run_meta  # noqa: E402

from tinyserve.kernels.moe import cpu as nvfp4_cpu  # noqa: E402
from tinyserve.kernels.moe import cpu_numba as K  # noqa: E402
from tinyserve.offload import bandwidth  # noqa: E402
from tinyserve.offload.hybrid import CpuExperts  # noqa: E402


@njit(nogil=True)
def _pauses(n):
    for _ in range(n):
        K._pause()


def pause_ns() -> float:
    _pauses(10)
    t = time.perf_counter()
    _pauses(1_000_000)
    return (time.perf_counter() - t) * 1e3


def gpu_spin_cycles(us: float) -> int:
    """`torch.cuda._sleep` cycles of about `us` microseconds (timed once)."""
    cycles = 1_000_000
    torch.cuda._sleep(cycles)
    t = bandwidth.device_seconds(lambda: torch.cuda._sleep(cycles))
    return max(1, int(cycles * us * 1e-6 / t))


def one_case(c: SimpleNamespace, threads: int, n: int) -> dict[str, float]:
    """The four timings (module docstring) of one token's call of n experts on `threads`."""
    runner, worker, k, h, total, dev, g = (c.runner, c.runner._worker, c.k, c.h, c.total,
                                           c.dev, c.g)
    x, reps, chain_len = c.x, c.args.reps, c.args.chain
    case: dict[str, float] = {}
    kk = max(n, 1)
    w = np.full((1, kk), 1.0 / kk, np.float32)

    def kernel_call() -> float:
        r = c.rng.permutation(total)[:kk].reshape(1, kk) if n else np.full((1, kk), -1)
        t = time.perf_counter()
        k.moe_pooled(x, r.astype(np.int64), w, *c.slots, c.out, threads,
                     nvfp4_cpu._python_pool().address)
        return (time.perf_counter() - t) * 1e6

    # the worker and the graph: expert ids of layer 0's rows (store rows of any layer)
    ids = [torch.zeros(1, kk, dtype=torch.int32, device=dev) for _ in range(chain_len)]
    slot = torch.full((1, kk), -1 if n else 0, dtype=torch.int32, device=dev)
    xd = torch.from_numpy(x).to(dev)
    wd = torch.from_numpy(w).to(dev)
    base = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)  # the GPU part's output

    def new_rows() -> None:  # distinct experts per call of a chain: none read from the cache
        rows = torch.randperm(total, generator=g)[:kk * chain_len].view(chain_len, 1, kk)
        for dst, src in zip(ids, rows, strict=True):
            dst.copy_(src)

    runner.start(0, xd, ids[0], slot, wd)  # the entry made, the first call run
    runner.join(base)
    torch.cuda.synchronize()
    entry = runner._entries[(0, 1, kk)]

    def worker_call() -> float:
        rel = torch.randperm(total, generator=g)[:kk].to(torch.int32) if n else \
            torch.full((kk,), -1, dtype=torch.int32)
        entry.stage[0, h:h + kk] = rel.view(torch.float32)
        t = time.perf_counter()
        worker.flags[worker.GO] = entry.number
        while int(worker.flags[worker.DONE]) != entry.number:
            pass
        wall = (time.perf_counter() - t) * 1e6
        worker.flags[worker.DONE] = 0
        return wall

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.start(0, xd, ids[0], slot, wd)
        runner.join(base)

    def graph_call() -> float:
        new_rows()
        return bandwidth.device_seconds(graph.replay) * 1e6

    for name, fn in (("kernel", kernel_call), ("worker", worker_call),
                     ("graph", graph_call)):
        fn()
        case[name] = statistics.median(fn() for _ in range(reps))
    for gap, cyc in ((0, 0), (300, c.spin_300us)):
        chain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(chain):
            for i in range(chain_len):
                if cyc:
                    torch.cuda._sleep(cyc)
                runner.start(0, xd, ids[i], slot, wd)
                runner.join(base)
        spin_only = 0.0
        if cyc:
            only = torch.cuda.CUDAGraph()
            with torch.cuda.graph(only):
                for _ in range(chain_len):
                    torch.cuda._sleep(cyc)
            only.replay()
            spin_only = statistics.median(bandwidth.device_seconds(only.replay)
                                          for _ in range(5))
        chain.replay()
        times = []
        for _ in range(max(3, reps // 8)):
            new_rows()
            times.append(bandwidth.device_seconds(chain.replay))
        case[f"chain_gap{gap}"] = (statistics.median(times) - spin_only) * 1e6 / chain_len
    return {key: round(v, 1) for key, v in case.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store-gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--spin", type=float, default=None,
                   help="seconds the worker spins idle before it sleeps (default: its own)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_round_trip.json"))
    args = p.parse_args()
    store = expert_store(args.store_gib)
    k = nvfp4_cpu._kernels()
    slots = [t.numpy() for t in store.slots.buffers]
    h = store.slots.hidden_size
    total = store.num_layers * store.num_experts
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    x = rng.standard_normal((1, h)).astype(np.float32)
    dev = torch.device("cuda")
    runner = CpuExperts(store, device=dev)
    hz = nvfp4_cpu._tsc_hz()
    if args.spin is not None:  # the loop reads it on every poll
        runner._worker.helpers.pool[nvfp4_cpu.P_SPIN] = int(args.spin * hz)
    spin_ms = int(runner._worker.helpers.pool[nvfp4_cpu.P_SPIN]) / hz * 1e3
    result = {**run_meta("cpu_round_trip", threads_max=nvfp4_cpu.max_threads(),
                         pause_ns=pause_ns(), worker_spin_ms=spin_ms), "cases": {}}
    print({key: result[key] for key in ("pause_ns", "worker_spin_ms")})
    ctx = SimpleNamespace(args=args, runner=runner, k=k, h=h, total=total, dev=dev, g=g, rng=rng,
                          x=x, out=np.empty((1, h), np.float32), slots=slots,
                          spin_300us=gpu_spin_cycles(300))
    for threads in bandwidth.thread_counts(nvfp4_cpu.max_threads()):
        runner.set_threads(threads)
        for n in (0, 1, args.top_k):
            case = one_case(ctx, threads, n)
            result["cases"][f"threads={threads} experts={n}"] = case
            print(f"threads={threads:2d} experts={n}", case, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
