"""The CPU expert worker against Python threads that hold the GIL (kernels.moe.cpu.HostWorker).

The worker and its helpers are native threads that never take the GIL. numba's parallel
regions, which the kernel ran on before d5a146c, each took it for a moment when they started
(numba's parallel wrapper: PyGILState_Ensure, then PyEval_SaveThread), so a Python thread
running bytecode, which keeps the GIL until the switch interval forces it off, held every call
up (`bench/results/cpu_worker_gil.json` holds both). One token's call of 1 and top_k experts of
a random store, requested and awaited without the GIL (a native wait that sleeps, timed by the
time-stamp counter), with the GIL free and with one Python thread counting in a loop, at the
default switch interval and at `--interval`.

    python bench/cpu_worker_gil.py [--threads 1] [--out bench/results/cpu_worker_gil.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from numba import njit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import expert_store, run_meta  # noqa: E402

from tinyserve.kernels.moe import cpu as nvfp4_cpu  # noqa: E402
from tinyserve.kernels.moe import cpu_numba as K  # noqa: E402


@njit(nogil=True)
def _request(flags_addr, number, usleep):
    """Request call `number` and sleep-poll (20 us) for its answer without the GIL: the
    time-stamp counter at the request and at the answer."""
    start = K._tsc()
    K._store_release_i32(flags_addr, number)  # flags[GO]
    while K._load_acquire_i32(flags_addr + 4) != number:  # flags[DONE]
        K._call_i32(usleep, 20)
    return start, K._tsc()


class Counter:
    """A Python thread that counts in a loop (holds the GIL but at the switch interval)."""

    def __init__(self) -> None:
        self.stop, self.count = False, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop:
            n += 1
        self.count = n

    def close(self) -> int:
        self.stop = True
        self.thread.join()
        return self.count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store-gib", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1, help="the kernel's threads")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--interval", type=float, default=0.0005,
                   help="the second switch interval tried (seconds)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_worker_gil.json"))
    args = p.parse_args()
    store = expert_store(args.store_gib)
    h = store.slots.hidden_size
    total = store.num_layers * store.num_experts
    hz = nvfp4_cpu._tsc_hz()
    usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
    worker = nvfp4_cpu.HostWorker(spin=1.0)
    flags = worker.flags.data_ptr()
    rng = np.random.default_rng(0)
    buffers, numbers = [], {}
    for k in (1, args.top_k):
        stage, out = torch.zeros(1, h + 2 * k), torch.zeros(1, h)
        stage[0, :h] = torch.randn(h)
        stage[0, h + k:] = 1.0 / k
        buffers.append((stage, out))
        numbers[k] = worker.add(nvfp4_cpu.host_descriptor(store.slots, stage, out, k, 0,
                                                          args.threads))

    def calls(k: int) -> list[float]:
        stage = buffers[0 if k == 1 else 1][0]
        times = []
        for _ in range(args.calls + 3):
            rows = torch.from_numpy(rng.permutation(total)[:k].astype(np.int32))
            stage[0, h:h + k] = rows.view(torch.float32)
            start, end = _request(flags, numbers[k], usleep)
            worker.flags[worker.DONE] = 0
            times.append((end - start) / hz * 1e6)
        return times[3:]

    default_interval = sys.getswitchinterval()
    result = {**run_meta("cpu_worker_gil", threads=args.threads, calls=args.calls), "cases": {}}
    for interval in (default_interval, args.interval):
        sys.setswitchinterval(interval)
        for load in ("gil free", "a python thread counting"):
            for k in (1, args.top_k):
                counter = Counter() if load != "gil free" else None
                times = calls(k)
                count = counter.close() if counter else None
                ts = sorted(times)
                case = {"median_us": round(statistics.median(ts), 1),
                        "p90_us": round(ts[int(0.9 * len(ts))], 1),
                        "max_us": round(ts[-1], 1), "mean_us": round(statistics.mean(ts), 1)}
                if count is not None:
                    case["counter_iterations"] = count
                name = f"interval={interval * 1e3:g}ms {load} experts={k}"
                result["cases"][name] = case
                print(name, case, flush=True)
    sys.setswitchinterval(default_interval)
    worker.close()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
