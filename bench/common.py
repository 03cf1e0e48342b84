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


def rand_nvfp4(n: int, k: int, dev: str):
    """A random [n, k] NVFP4Weight: every code, block scales around 1 (E4M3 0x30..0x47),
    global scale 0.5 / sqrt(k) (outputs of order 1 for unit activations)."""
    from tinyserve.core import NVFP4Weight

    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.randint(0x30, 0x48, (n, k // 16), dtype=torch.uint8, device=dev)
    return NVFP4Weight(packed, scale, 0.5 / k**0.5)
