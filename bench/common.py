"""Helpers shared by the benchmark scripts (run as `python bench/<name>.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from tinyserve.testing.provenance import current_commit


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of fn(), synchronising the GPU around each call.

    For slow calls (Python loops per token) where CUDA events or graphs buy nothing."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def engine_arguments(ap) -> None:
    """The arguments of the scripts that measure the full model like `tinyserve bench`: the
    checkpoint, --kv, --gpu-memory, --batch, --prompt-len, --gen-len (1024 + 64 tokens)."""
    ap.add_argument("model")
    ap.add_argument("--kv", default="iso3")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=64)


def run_meta(name: str, **extra: object) -> dict:
    """The JSON header of a result file: what ran, where, with which versions, when."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    meta: dict = {"name": name, "date": now.isoformat(timespec="seconds"),
                  "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
        meta["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        meta["cuda"] = torch.version.cuda
    else:
        meta["device"] = "cpu"
    commit = current_commit()
    if commit:
        meta["commit"] = commit
    return {**meta, **extra}


def expert_store(gib: float):
    """A random host expert store of Qwen3.5-35B-A3B's expert geometry, `gib` GiB at most
    (whole layers; `offload.bandwidth.synthetic_store`): what the CPU expert benches read."""
    from types import SimpleNamespace

    from tinyserve.offload.bandwidth import synthetic_store

    geometry = SimpleNamespace(num_layers=40, num_experts=256, hidden_size=2048,
                               moe_intermediate_size=512)
    return synthetic_store(geometry, int(gib * (1 << 30)))


def write_json(path, data: dict) -> None:
    """Write a result file (its folder made first) and say where."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path}")


def sync() -> None:
    """torch.cuda.synchronize() when there is a GPU (CPU dry runs: nothing)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Recorder:
    """Collects named cases into one JSON file, rewritten after every case; a failing case
    records its traceback and the next one still runs (an interrupt is recorded, then
    re-raised, so a `timeout -s INT` leaves the JSON complete up to that case)."""

    def __init__(self, path, meta: dict) -> None:
        self.path = path
        self.data: dict = {**meta, "cases": {}, "errors": {}}

    def run(self, name: str, fn: Callable[..., object], *args: object) -> object:
        """fn(*args) returns the case's record (a dict; returned) or (record, value): the
        record is stored and `value` returned. None when the case failed."""
        import json
        import traceback

        t0 = time.perf_counter()
        try:
            out = fn(*args)
            record, value = out if isinstance(out, tuple) else (out, out)
            self.data["cases"][name] = {"seconds": round(time.perf_counter() - t0, 2),
                                        **(record or {})}
            print(f"[{name}] {json.dumps(self.data['cases'][name])[:3000]}", flush=True)
            return value
        except BaseException as exc:  # record and go on (OOM included)
            self.data["errors"][name] = traceback.format_exc()[-4000:]
            print(f"[{name}] FAILED: {exc!r}\n{self.data['errors'][name]}", flush=True)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
                raise
            return None
        finally:
            self.save()

    def save(self) -> None:
        """Write the JSON now (after adding summary fields to `data`)."""
        import json

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


ROTATE_BYTES = 256 << 20  # cycle weight copies until this many bytes (> L2)


def time_graph(fns: list, reps: int = 10, stat=statistics.median) -> float:
    """Median (or `stat`) microseconds per call of the calls in `fns`, replayed in one CUDA
    graph (launch overhead amortised; the calls run back to back)."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return stat(times)


def graph_us(fn: Callable[[], object], calls_per_run: int = 1) -> tuple[float, str]:
    """Microseconds of one of the `calls_per_run` calls fn() makes: the median of 15 replays
    of a CUDA graph of 10 fn() (triton's do_bench where the calls cannot be captured), and
    which of the two timed it."""
    try:
        return time_graph([fn] * 10, reps=15) / calls_per_run, "cuda_graph"
    except Exception:  # noqa: BLE001
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200) * 1000 / calls_per_run, "do_bench"


def bandwidth(dev: str) -> dict:
    """The bandwidth references: 20 copies of 1 GiB per graph replay (best replay; read +
    written bytes) and a bf16 cuBLAS GEMV over a 1 GiB weight (read bytes); `GBps` is the
    larger."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy = time_graph([lambda: b.copy_(a)] * 20, reps=5, stat=min)
    w = a.view(torch.bfloat16).view(1 << 15, 1 << 14)
    v = torch.randn(1 << 14, 1, device=dev, dtype=torch.bfloat16)
    read = time_graph([lambda: w @ v] * 20, reps=5, stat=min)
    out = {"copy_GBps": 2 * n / copy / 1e3, "gemv_read_GBps": n / read / 1e3}
    out["GBps"] = max(out["copy_GBps"], out["gemv_read_GBps"])
    return out


def copies(nbytes: int, smoke: bool = False) -> int:
    """How many copies of a weight of `nbytes` a timed graph cycles through to miss L2."""
    return 1 if smoke else max(1, min(32, -(-ROTATE_BYTES // nbytes)))


def errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative Frobenius and max errors of y against an fp32 reference."""
    d = y.float() - ref
    return {"rel_err": float(d.norm() / ref.norm()),
            "max_rel_err": float(d.abs().max() / ref.abs().max())}


def nvfp4_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] NVFP4 weight: the codes and the E4M3 block scales."""
    return n * k // 2 + n * k // 16


class StreamError(Exception):
    """A streamed request that failed: an HTTP error status or an error event."""


async def stream_chunks(client, url: str, body: dict, headers: dict | None = None):
    """The parsed `data:` events of one streamed chat request to `url` (an httpx.AsyncClient),
    up to `[DONE]`; StreamError on an HTTP error status or an error event."""
    import json

    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise StreamError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(chunk["error"]["message"][:200])
            yield chunk


def rand_nvfp4(n: int, k: int, dev: str):
    """A random [n, k] NVFP4Weight: every code, block scales around 1 (E4M3 0x30..0x47),
    global scale 0.5 / sqrt(k) (outputs of order 1 for unit activations)."""
    from tinyserve.core import NVFP4Weight

    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.randint(0x30, 0x48, (n, k // 16), dtype=torch.uint8, device=dev)
    return NVFP4Weight(packed, scale, 0.5 / k**0.5)
