"""Greedy tokens and decode speed of one engine configuration, for comparing kernel build paths
on the same checkpoint: with and without a CUDA toolkit on PATH, and each GPU generation's code
(TINYSERVE_CUDA_ARCH=sm_80 / sm_86 / sm_89 builds the CUDA kernels as PTX for that generation
and takes its paths). Uses only the engine API, so an older checkout of the package runs it
too (PYTHONPATH=that checkout).

    python bench/kernel_paths.py CKPT --kv iso3 [--gpu-memory 6GiB] [--label NAME] \
        [--out bench/results/kernel_paths.jsonl]

Prints one JSON line (and appends it to --out): the environment (toolkit and compiler on
PATH, TINYSERVE_CUDA_ARCH, versions), the greedy tokens of a fixed random prompt and the
`tinyserve bench` numbers of one request (prompt 1024, 64 generated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

# appended, not prepended: a checkout on PYTHONPATH (an older version) takes precedence
sys.path.append(str(Path(__file__).resolve().parents[1]))

from tinyserve.core import SamplingParams  # noqa: E402
from tinyserve.engine.bench import run_bench  # noqa: E402
from tinyserve.engine.build import build_engine  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402


def greedy_tokens(engine, prompt_len: int, n: int, seed: int) -> list[int]:
    prompt = engine.random_prompt(prompt_len, torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t for out in engine.submit(prompt, params) for t in out.token_ids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--kv", default="iso3")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # misses copied, as every build path runs them (older checkouts have no `experts`)
    gpu = {"experts": "gpu"} if "experts" in EngineConfig.__dataclass_fields__ else {}
    config = EngineConfig(model=args.ckpt, kv=args.kv, gpu_memory=args.gpu_memory,
                          max_context=1024 + 64, max_seqs=1, **gpu)
    t0 = time.perf_counter()
    engine = build_engine(config).start()
    startup = time.perf_counter() - t0
    try:
        first = time.perf_counter()
        tokens = greedy_tokens(engine, 512, args.tokens, seed=1)
        first_request = time.perf_counter() - first
        speed = run_bench(engine, prompt_len=1024, gen_len=64, batch=1)
    finally:
        engine.shutdown()
    import tinyserve

    row = {
        "label": args.label, "kv": args.kv, "gpu_memory": args.gpu_memory,
        "cuda_arch_env": os.environ.get("TINYSERVE_CUDA_ARCH", ""),
        "on_path": {tool: shutil.which(tool) for tool in ("nvcc", "g++", "gcc")},
        "package": str(Path(tinyserve.__file__).parent),
        "startup_s": startup, "first_request_s": first_request,
        "greedy_tokens": tokens,
        "decode_tok_s": speed["decode_tok_s"], "decode_step_ms": speed["decode_step_ms"],
        "prefill_tok_s": speed["prefill_tok_s"], "expert_hit_rate": speed["expert_hit_rate"],
        "device": speed["device"], "torch": speed["torch"], "date": speed["date"],
        "commit": speed["commit"],
    }
    line = json.dumps(row)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
