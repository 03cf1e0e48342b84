"""Decode speed of greedy and penalised requests on one engine.

One engine on the full-size checkpoint (`tinyserve bench`'s measurement,
`engine.bench.run_bench`), two runs of --batch requests of --prompt-len random tokens
generating --gen-len tokens each, both with chained decode steps as the engine runs them:

- greedy: the reference;
- penalties: presence 1.5 (the value Qwen's model cards suggest against repetition),
  frequency 0.2, repetition 1.05, greedy (the penalties count tokens on the device).

`--gpu-memory 6GiB` puts the embedding table in host RAM, registered with CUDA; the decode
graph reads its rows on the device.

Reported per run: decode tok/s, median step (ms), the ratio to greedy.

    python bench/decode_modes.py CKPT [--kv iso3] [--gpu-memory 6GiB] [--batch 1]
        -> bench/results/decode_modes[_6GiB].json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import engine_arguments, run_meta, write_json  # noqa: E402
from tinyserve.core import SamplingParams  # noqa: E402
from tinyserve.engine.bench import run_bench  # noqa: E402
from tinyserve.engine.build import build_engine  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402

PENALTIES = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.2,
                           repetition_penalty=1.05)


def main() -> int:
    ap = argparse.ArgumentParser()
    engine_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tag = f"_{args.gpu_memory}" if args.gpu_memory else ""
    args.out = args.out or str(ROOT / f"bench/results/decode_modes{tag}.json")
    config = EngineConfig.from_args(args, max_seqs=args.batch,
                                    max_context=args.prompt_len + args.gen_len)
    engine = build_engine(config).start()
    shape = dict(prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch)
    runs = {}
    try:
        runs["greedy"] = run_bench(engine, **shape)
        runs["penalties"] = run_bench(engine, **shape, sampling=PENALTIES)
    finally:
        engine.shutdown()
    keys = ("decode_tok_s", "decode_step_ms", "steps", "expert_hit_rate")
    model = engine.runner.model
    out = run_meta("decode_modes", model=args.model, kv=args.kv, gpu_memory=args.gpu_memory,
                   **shape, penalties=str(PENALTIES), embed_on_host=model.embed_on_host,
                   embed_mapped=model.embed_mapped)
    out["runs"] = {name: {k: r[k] for k in keys} for name, r in runs.items()}
    base = runs["greedy"]["decode_tok_s"]
    for name, r in out["runs"].items():
        r["vs_greedy"] = r["decode_tok_s"] / base if base and r["decode_tok_s"] else None
        print(f"{name:24s} {r['decode_tok_s']:8.1f} tok/s  step {r['decode_step_ms']:.3f} ms "
              f"({r['vs_greedy']:.3f} of greedy)")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
