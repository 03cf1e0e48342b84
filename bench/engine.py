"""Engine overheads on one CUDA GPU.

1. Sampler at the Qwen3.5 vocabulary (248,320) for batch 1 / 8 / 32: greedy, top-k + top-p,
   min-p, seeded rows, penalties. Baseline in the same run: `argmax` and
   `multinomial(softmax(logits / T))` on the same logits.
2. Engine step on the tiny random checkpoint (bf16, CUDA): the time of one full decode
   `engine.step()` (schedule + prepare + forward + sample + detokenize) against the bare model
   forward `runner.run(ctx)` on the same batch, i.e. the host overhead per step; plus
   `run_bench` prefill / decode tokens/s.

Each case records its own failure and the rest go on.

    python bench/engine.py [--quick]      -> bench/results/engine.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import median_ms, run_meta  # noqa: E402  (bench/ is on sys.path as a script)

from tinyserve.core import SamplingParams, ScheduledSeq  # noqa: E402
from tinyserve.engine.sampler import Sampler  # noqa: E402

V = 248320
OUT = Path(__file__).resolve().parent / "results" / "engine.json"





def _seqs(batch: int, params: SamplingParams) -> list[ScheduledSeq]:
    history = list(range(1000, 1512))
    return [ScheduledSeq(f"r{i}", [1], 511, [0], 0, True, params, history, 64)
            for i in range(batch)]


SAMPLER_CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "penalties": SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5,
                                repetition_penalty=1.1),
}


def bench_sampler(batches: list[int]) -> list[dict]:
    rows = []
    sampler = Sampler()
    for B in batches:
        logits = torch.randn(B, V, device="cuda") * 4
        base_greedy = median_ms(lambda logits=logits: logits.argmax(-1).tolist(), 50, warmup=3)
        base_multi = median_ms(lambda logits=logits: torch.multinomial(
            torch.softmax(logits / 0.8, -1), 1).tolist(), 50, warmup=3)
        for name, params in SAMPLER_CASES.items():
            row = {"case": name, "batch": B, "baseline_argmax_ms": base_greedy,
                   "baseline_multinomial_ms": base_multi}
            try:
                seqs = _seqs(B, params)
                row["ms"] = median_ms(
                    lambda logits=logits, seqs=seqs: sampler(logits, seqs).tolist(), 50, warmup=3)
            except Exception:
                row["error"] = traceback.format_exc(limit=3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def bench_engine(quick: bool) -> list[dict]:
    from tinyserve.core import Batch
    from tinyserve.engine.bench import run_bench
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig
    from tinyserve.testing import make_tiny_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny")
        for batch in ([1, 8] if quick else [1, 8, 32]):
            row: dict = {"case": "tiny_engine", "batch": batch}
            try:
                cfg = EngineConfig(model=str(ckpt), device="cuda", max_seqs=batch,
                                   max_context=512)
                engine = build_engine(cfg)
                # decode step vs bare forward, run synchronously on this thread
                for i in range(batch):
                    engine.scheduler.add(f"r{i}", list(range(10, 74)),
                                         SamplingParams(max_tokens=400, ignore_eos=True))
                for i in range(batch):  # queue them as the loop would
                    engine._live[f"r{i}"] = _dummy_live(engine, f"r{i}")
                engine.step()  # prefill
                row["engine_step_ms"] = median_ms(engine.step, 100, warmup=3)
                batch_now: Batch = engine.scheduler.schedule()
                ctx = engine.runner.prepare(batch_now)
                run = engine.runner.run
                row["baseline_forward_ms"] = median_ms(lambda ctx=ctx, run=run: run(ctx), 100,
                                                          warmup=3)
                row["host_overhead_ms"] = row["engine_step_ms"] - row["baseline_forward_ms"]
                engine.shutdown()
                engine = build_engine(cfg).start()
                row.update({k: v for k, v in run_bench(engine, prompt_len=256, gen_len=64,
                                                       batch=batch).items()
                            if k in ("prefill_tok_s", "decode_tok_s", "ttft_s",
                                     "peak_memory_bytes")})
                engine.shutdown()
            except Exception:
                row["error"] = traceback.format_exc(limit=5)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _dummy_live(engine, rid: str):
    from tinyserve.engine.detokenizer import IncrementalDetokenizer
    from tinyserve.engine.loop import _Live
    from tinyserve.engine.stream import RequestHandle

    return _Live(RequestHandle(rid, 64, engine.abort), IncrementalDetokenizer(engine.tokenizer))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    result = run_meta("engine", baseline="sampler: argmax / multinomial(softmax) on the same "
                      "logits; engine: bare runner.run(ctx) on the same decode batch")
    for name, fn in (("sampler", lambda: bench_sampler([1, 8] if args.quick else [1, 8, 32])),
                     ("engine", lambda: bench_engine(args.quick))):
        try:
            result[name] = fn()
        except Exception:
            result[name] = {"error": traceback.format_exc(limit=5)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
