"""Decode speed with penalties, chained steps vs synchronous ones -> results/penalty_decode.json.

Penalised rows read device-side token counts (`engine/sampler.py`), so their decode steps
chain like greedy ones. One engine on the full-size checkpoint (`tinyserve bench`'s
measurement, `engine.bench.run_bench`), three runs of --batch requests of --prompt-len random
tokens generating --gen-len tokens each:

- greedy: the reference (chained, as the engine runs it);
- penalties, chained: presence 1.5 (the value Qwen's model cards suggest against repetition),
  frequency 0.2, repetition 1.05, greedy;
- penalties, synchronous: the same with `loop.PIPELINE_DECODE = False` (every step waits for
  the host's tokens: how penalised rows decoded before).

Reported per run: decode tok/s, median step (ms), and the ratios to greedy.

    python bench/penalty_decode.py CKPT [--kv iso3] [--gpu-memory 6GiB] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import run_meta  # noqa: E402
from tinyserve.core import SamplingParams  # noqa: E402
from tinyserve.engine import loop  # noqa: E402
from tinyserve.engine.bench import run_bench  # noqa: E402
from tinyserve.engine.build import build_engine  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402

PENALTIES = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.2,
                           repetition_penalty=1.05)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv", default="iso3")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench/results/penalty_decode.json"))
    args = ap.parse_args()
    args.device, args.max_seqs, args.max_context = None, args.batch, None
    config = EngineConfig.from_args(args, max_seqs=args.batch,
                                    max_context=args.prompt_len + args.gen_len)
    engine = build_engine(config).start()
    shape = dict(prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch)
    runs = {}
    try:
        runs["greedy"] = run_bench(engine, **shape)
        runs["penalties_chained"] = run_bench(engine, **shape, sampling=PENALTIES)
        loop.PIPELINE_DECODE = False
        runs["penalties_synchronous"] = run_bench(engine, **shape, sampling=PENALTIES)
    finally:
        loop.PIPELINE_DECODE = True
        engine.shutdown()
    keys = ("decode_tok_s", "decode_step_ms", "steps")
    out = run_meta("penalty_decode", model=args.model, kv=args.kv, gpu_memory=args.gpu_memory,
                   **shape, penalties=str(PENALTIES))
    out["runs"] = {name: {k: r[k] for k in keys} for name, r in runs.items()}
    base = runs["greedy"]["decode_tok_s"]
    for name, r in out["runs"].items():
        r["vs_greedy"] = r["decode_tok_s"] / base if base and r["decode_tok_s"] else None
        print(f"{name:24s} {r['decode_tok_s']:8.1f} tok/s  step {r['decode_step_ms']:.3f} ms "
              f"({r['vs_greedy']:.3f} of greedy)")
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
