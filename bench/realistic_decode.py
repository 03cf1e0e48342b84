"""Decode under realistic routing at `--gpu-memory 6GiB` (GPU): tokens/s and expert-cache hit
rates, against `--max-context` and against the cache size, beside uniform routing.

Checkpoints: the full-size one written with realistic routing (`--ckpt`; written when it is
missing: ~21 GB, `python -m bench.fullsize DIR --routing realistic`) and, for the
side-by-side, the random one with uniform routing (`--uniform-ckpt`, optional). Every case is
`tinyserve bench CKPT --kv iso3 --prompt-len 1024 --gen-len 512 --experts gpu --json ...`
(every miss copied: the cache's own hit rates) in a fresh process (a budgeted engine caps its
process's allocator), batch 1:

- `realistic_6GiB`, `uniform_6GiB`: `--gpu-memory 6GiB` (max context = prompt + output);
- `context_<N>`: `--gpu-memory 6GiB --max-context N`: a smaller KV pool leaves more slots;
- `slots_<f>`: no budget, `--expert-cache-slots round(f x 10,240)` (f = 0.066, 0.33): the
  engine's own decode-path hit rate at the fractions the published curve gives.

Per case: decode tok/s, median step, the decode and warm (after 64 tokens) expert hit rates,
the plan's expert slots and context tokens. `--predict` (CPU only, afterwards, on the JSON;
the checkpoint is not needed) adds the simulator's prediction for the same decode text
(bench/cache_policies.py's device-driven emulation from an empty cache; the engine starts
from the warm-up's cache).
Writes bench/results/realistic_decode.json.

    python bench/realistic_decode.py --ckpt /tmp/tinyserve-fullsize-realistic \\
        [--uniform-ckpt /tmp/tinyserve-fullsize] [--cases realistic_6GiB context_131072 ...]
    python bench/realistic_decode.py --predict   # adds predictions to the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Recorder, run_meta  # noqa: E402

RESULT = ROOT / "bench" / "results" / "realistic_decode.json"
CONTEXTS = (8192, 32768, 131072)
SLOT_FRACTIONS = (0.066, 0.33)
ROUTED_EXPERTS = 40 * 256
PROMPT_LEN, GEN_LEN = 1024, 512


def cases(args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """name -> (checkpoint, extra `tinyserve bench` arguments)."""
    budget = ["--gpu-memory", "6GiB"]
    out = {"realistic_6GiB": (args.ckpt, budget)}
    if args.uniform_ckpt:
        out["uniform_6GiB"] = (args.uniform_ckpt, budget)
    for n in CONTEXTS:
        out[f"context_{n}"] = (args.ckpt, [*budget, "--max-context", str(n)])
    for f in SLOT_FRACTIONS:
        out[f"slots_{f}"] = (args.ckpt, ["--expert-cache-slots",
                                         str(round(f * ROUTED_EXPERTS))])
    return out


def run_case(ckpt: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tinyserve", "bench", ckpt, "--kv", "iso3", "--prompt-len",
           str(PROMPT_LEN), "--gen-len", str(GEN_LEN), "--experts", "gpu", "--json", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    r = json.loads(done.stdout)
    plan = r.get("memory_plan") or {}
    return {"command": "tinyserve bench " + " ".join(cmd[4:]),
            "decode_tok_s": r["decode_tok_s"], "decode_step_ms": r["decode_step_ms"],
            "prefill_tok_s": r["prefill_tok_s"], "expert_hit_rate": r["expert_hit_rate"],
            "decode_expert_hit_rate": r.get("decode_expert_hit_rate"),
            "warm_expert_hit_rate": r.get("warm_expert_hit_rate"),
            "expert_slots": plan.get("expert_slots"),
            "context_tokens": plan.get("context_tokens"),
            "peak_memory_bytes": r["peak_memory_bytes"], "commit": r.get("commit"),
            "device": r["device"], "bench": r}


def design(ckpt: str | None):
    """The checkpoint's routing design (seed from its manifest; seed 0 without one: what
    `--routing realistic` writes by default), full-size geometry."""
    from bench.routing import ROUTING_FILE, RealisticRouting
    from tinyserve.model.config import ModelConfig
    from tinyserve.testing.tokenizer import special_token_ids

    manifest = Path(ckpt or "") / ROUTING_FILE
    seed = json.loads(manifest.read_text())["seed"] if ckpt and manifest.is_file() else 0
    c = ModelConfig()
    return RealisticRouting(hidden=c.hidden_size, num_experts=c.num_experts,
                            top_k=c.num_experts_per_tok, vocab_size=c.vocab_size,
                            text_tokens=range(min(special_token_ids().values())), seed=seed)


def decode_text(d) -> list[int]:
    """The tokens `tinyserve bench` decodes (batch 1, seed 0): the design's greedy text after
    its measured prompt, drawn after the warm-up prompt from the same generator."""
    from tinyserve.testing.tokenizer import TINY_VOCAB_SIZE

    gen = torch.Generator().manual_seed(0)
    torch.randint(0, TINY_VOCAB_SIZE, (PROMPT_LEN,), generator=gen)  # the warm-up prompt
    last = int(torch.randint(0, TINY_VOCAB_SIZE, (PROMPT_LEN,), generator=gen)[-1])
    return d.text(last, GEN_LEN)


def predict(result: dict) -> None:
    """Add the simulator's decode and warm hit rates to every realistic case of `result`
    (CPU; the checkpoint is not needed: the routing is computed from the design)."""
    from bench.cache_policies import device_hit_rates
    from tinyserve.engine.bench import WARM_TOKENS
    from tinyserve.offload.cache import DEFAULT_FREQ_WEIGHT

    d = design(result["checkpoints"]["realistic"])
    trace = d.expected_topk(decode_text(d)[:-1], [d.router(la) for la in range(40)])
    for name, case in result["cases"].items():
        if name.startswith("uniform"):
            continue
        slots = (round(float(name.removeprefix("slots_")) * ROUTED_EXPERTS)
                 if name.startswith("slots_") else case["expert_slots"])
        decode, warm = device_hit_rates(trace, slots, DEFAULT_FREQ_WEIGHT, (0, WARM_TOKENS))
        case["predicted"] = {"slots": slots, "freq_weight": DEFAULT_FREQ_WEIGHT,
                             "decode_hit_rate": round(decode, 4),
                             "warm_hit_rate": round(warm, 4)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default="/tmp/tinyserve-fullsize-realistic")
    p.add_argument("--uniform-ckpt", default=None)
    p.add_argument("--cases", nargs="+", default=None, help="names (default: all)")
    p.add_argument("--predict", action="store_true",
                   help="CPU only: add the simulator's predictions to --out")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args()
    if args.predict:
        result = json.loads(args.out.read_text())
        predict(result)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if not (Path(args.ckpt) / "config.json").is_file():
        from bench.fullsize import write_fullsize_checkpoint

        write_fullsize_checkpoint(args.ckpt, routing="realistic")
    rec = Recorder(args.out, run_meta(
        "realistic_decode", command="python bench/realistic_decode.py " + " ".join(sys.argv[1:]),
        prompt_len=PROMPT_LEN, gen_len=GEN_LEN))
    rec.data["checkpoints"] = {"realistic": args.ckpt, "uniform": args.uniform_ckpt}
    for name, (ckpt, extra) in cases(args).items():
        if args.cases is None or name in args.cases:
            rec.run(name, run_case, ckpt, extra)
    rec.save()
    print(f"{'case':18s} {'tok/s':>7s} {'step ms':>8s} {'slots':>6s} {'context':>8s} "
          f"{'decode hit':>10s} {'warm hit':>8s}")
    for name, c in rec.data["cases"].items():
        print(f"{name:18s} {c['decode_tok_s']:7.1f} {c['decode_step_ms']:8.2f} "
              f"{c['expert_slots'] or '-':>6} {c['context_tokens'] or '-':>8} "
              f"{c['decode_expert_hit_rate'] or 0:10.3f} {c['warm_expert_hit_rate'] or 0:8.3f}")
    return 0 if not rec.data["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
