"""Where one call of the CPU expert kernel spends its time (kernels.moe.cpu).

A copy of `cpu_numba.moe_pooled`'s call (numba's threads in place of the helper pool) with
time-stamp-counter stamps: the call's entry, its setup (pairs grouped, inputs quantized), both
parallel regions' ends, and every work item's start and end with the thread that ran it. From
them: the setup, each region's launch (region start to the first item), its work (items' own
time, summed per thread), its tail (last item end to region end) and the stragglers (threads
that took their first item late). One token, 1 and top_k experts of a random store, each thread
count, back to back and after a 300 us idle gap (as a decode layer calls it).

    python bench/cpu_call_phases.py [--store-gib 4] [--out bench/results/cpu_call_phases.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import expert_store, run_meta  # noqa: E402

from tinyserve.kernels.moe import cpu as nvfp4_cpu  # noqa: E402
from tinyserve.kernels.moe import cpu_numba as K  # noqa: E402
from tinyserve.offload import bandwidth  # noqa: E402


@njit(parallel=True, fastmath=True, nogil=True, error_model="numpy")
def moe_stamped(x, rows, wts, w13, s13, g13, w2, s2, g2, out, threads, st, it):
    """`cpu_numba.moe_pooled` (its setup and its schedule of the same work items, on numba's
    threads) with stamps: st [5] (entry, setup done, region 1 end, region 2 end, exit), it
    [items, 3] (start, end, thread) per work item of both regions."""
    st[0] = K._tsc()
    n, topk = rows.shape
    h = x.shape[1]
    f = w2.shape[2] * 2
    flat, pairs, starts, groups, xq, xs, xc, hid, hq, hs, hc = K._prepare(x, rows, f)
    items = K._items(1, groups, f, h)
    shares = np.empty((threads, 8), np.int64)
    K._open_shares(shares, 1, items, threads)
    st[1] = K._tsc()
    for tid in prange(threads):
        for v in range(threads):
            share = (tid + v) % threads
            item = K._claim(shares.ctypes.data, share, 1)
            while item >= 0:
                it[item, 0] = K._tsc()
                K.gate_up_item(item, flat, pairs, starts, topk, w13, s13, g13, xq, xs, xc, hid,
                               hq, hs, hc)
                it[item, 1] = K._tsc()
                it[item, 2] = tid
                item = K._claim(shares.ctypes.data, share, 1)
    st[2] = K._tsc()
    K._open_shares(shares, 2, K._items(2, groups, f, h), threads)
    for tid in prange(threads):
        acc = np.empty((K.RB, n), np.float32)
        for v in range(threads):
            share = (tid + v) % threads
            item = K._claim(shares.ctypes.data, share, 2)
            while item >= 0:
                it[items + item, 0] = K._tsc()
                K.down_item(item, flat, pairs, starts, groups, topk, wts, w2, s2, g2, hq, hs, hc,
                            out, acc)
                it[items + item, 1] = K._tsc()
                it[items + item, 2] = tid
                item = K._claim(shares.ctypes.data, share, 2)
    st[3] = K._tsc()
    st[4] = K._tsc()
    return groups


def phases(st: np.ndarray, it: np.ndarray, items1: int, hz: float) -> dict[str, float]:
    us = 1e6 / hz
    out = {"setup": (st[1] - st[0]) * us}
    for name, lo, hi, begin, end in (("r1", 0, items1, st[1], st[2]),
                                     ("r2", items1, len(it), st[2], st[3])):
        rows = it[lo:hi]
        firsts = {}
        for s, _, th in rows:
            firsts[th] = min(firsts.get(th, s), s)
        busy = {}
        for s, e, th in rows:
            busy[th] = busy.get(th, 0) + (e - s)
        out[f"{name}_total"] = (end - begin) * us
        out[f"{name}_launch"] = (rows[:, 0].min() - begin) * us  # region start to first item
        out[f"{name}_last_start"] = (max(firsts.values()) - begin) * us  # latest thread's start
        out[f"{name}_busy_max"] = max(busy.values()) * us  # the busiest thread's item time
        out[f"{name}_tail"] = (end - rows[:, 1].max()) * us  # last item end to region end
        out[f"{name}_threads"] = len(firsts)
    out["total"] = (st[4] - st[0]) * us
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store-gib", type=float, default=4.0)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_call_phases.json"))
    args = p.parse_args()
    store = expert_store(args.store_gib)
    nvfp4_cpu._kernels()  # compiled before the timed calls
    slots = [t.numpy() for t in store.slots.buffers]
    h, f = store.slots.hidden_size, store.slots.intermediate_size
    total = store.num_layers * store.num_experts
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, h)).astype(np.float32)
    out = np.empty((1, h), np.float32)
    hz = nvfp4_cpu._tsc_hz()
    result = {**run_meta("cpu_call_phases", tsc_ghz=hz / 1e9, threads_max=nvfp4_cpu.max_threads()),
              "cases": {}}
    most = nvfp4_cpu.max_threads()
    for threads in sorted({t for t in (1, 2, 4, 8, *bandwidth.thread_counts(most), most)
                           if t <= most}):
        numba.set_num_threads(threads)
        for n in (1, 8):
            for gap_us in (0, 300):
                samples = []
                for rep in range(args.reps + 5):
                    rows = rng.permutation(total)[:n].reshape(1, n).astype(np.int64)
                    w = np.full((1, n), 1.0 / n, np.float32)
                    items1 = K._items(1, n, f, h)
                    st = np.zeros(5, np.int64)
                    it = np.zeros((items1 + K._items(2, n, f, h), 3), np.int64)
                    if gap_us:
                        end = time.perf_counter() + gap_us * 1e-6
                        while time.perf_counter() < end:
                            pass
                    t = time.perf_counter()
                    moe_stamped(x, rows, w, *slots, out, threads, st, it)
                    wall = (time.perf_counter() - t) * 1e6
                    if rep >= 5:
                        samples.append({**phases(st, it, items1, hz), "wall": wall})
                med = {key: round(float(statistics.median(s[key] for s in samples)), 1)
                       for key in samples[0]}
                result["cases"][f"threads={threads} experts={n} gap={gap_us}us"] = med
                print(f"threads={threads:2d} experts={n} gap={gap_us:3d}us", med, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
