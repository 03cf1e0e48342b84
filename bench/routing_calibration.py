"""Calibration of the realistic routing (`bench.routing`) against published expert-cache
hit rates of real Qwen MoE models, on the CPU.

1. model: writes the full-size checkpoint with `--routing realistic` and `--layers` layers
   (the real shapes: hidden 2048, 256 experts, top-8; vocabulary 1,024), runs the reference
   model (tinyserve.model on the CPU) greedily for `--tokens` decode tokens after a random
   prompt, records every layer's routed experts and checks that the tokens walk the design's
   cycle and that the routing equals the one computed from the written embedding and routers
   (`bench.cache_sim.trace_from_checkpoint`).
2. curves: plain-LRU hit rate at 5-50 % of the experts resident (warm: after `--warmup`
   steps), global pool (the engine's `ExpertCachePolicy` with freq_weight 0) and per-layer
   pools, from the recorded trace and from the computed routing of all 40 layers over
   `--steps` tokens (the routing is a function of the token sequence only, so the computed
   trace is what the full-size model routes: the GPU run confirms it), against the
   published curve. Also: the share of a token's experts its predecessor used, the share
   used within the 8 tokens before, the experts covering 90 % of a layer's selections.

Writes bench/results/routing_calibration.json. The model part takes minutes on an idle core
(`--layers 0` skips it).

    python bench/routing_calibration.py [--layers 2] [--tokens 200] [--steps 600]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cache_sim import hit_curve, trace_from_checkpoint  # noqa: E402
from bench.common import Recorder, run_meta  # noqa: E402
from bench.routing import (  # noqa: E402
    REALISTIC,
    RealisticRouting,
)
from tinyserve.core import DenseWeight, FP8Weight, SamplingParams  # noqa: E402
from tinyserve.model.config import ModelConfig  # noqa: E402
from tinyserve.testing.tokenizer import special_token_ids  # noqa: E402

RESULT = ROOT / "bench" / "results" / "routing_calibration.json"
FRACTIONS = (0.05, 0.066, 0.1, 0.15, 0.2, 0.25, 0.33, 0.4, 0.5)
# Published warm hit rates with plain LRU (docs/ROUTING.md): fraction resident -> (low, high).
PUBLISHED = {0.066: (0.41, 0.41), 0.33: (0.74, 0.83)}
TOLERANCE = 0.05
QWEN3_30B_AT_40 = (0.90, 0.95)  # Qwen3-30B-A3B (128 experts), LRU at 40 % resident


def design(seed: int) -> RealisticRouting:
    c = ModelConfig()
    return RealisticRouting(hidden=c.hidden_size, num_experts=c.num_experts,
                            top_k=c.num_experts_per_tok, vocab_size=1024,
                            text_tokens=range(min(special_token_ids().values())), seed=seed)


def model_run(layers: int, tokens: int, prompt_len: int, seed: int) -> tuple[dict, np.ndarray]:
    """Decode on the CPU reference model; (checks, recorded decode trace [T, layers, k])."""
    from bench.fullsize import write_fullsize_checkpoint
    from tinyserve.engine.llm import LLM
    from tinyserve.kernels.nvfp4.ref import dequantize
    from tinyserve.model.linear import SplitLinear

    with tempfile.TemporaryDirectory(prefix="routing-cal-") as tmp:
        t0 = time.perf_counter()
        path = write_fullsize_checkpoint(Path(tmp) / "ck", layers=layers, vocab_size=1024,
                                         routing="realistic", seed=seed)
        write_s = time.perf_counter() - t0
        llm = LLM(str(path), device="cpu", max_context=prompt_len + tokens + 16, max_seqs=1)
        model = llm.engine.runner.model
        # NOTE: the CPU reference dequantizes a quantized weight at every call; FP8 to float
        # is slow on the CPU, so the mixers' FP8 weights are dequantized once here (the same
        # numbers: dequantize, then matmul).
        def dense(w):
            return DenseWeight(dequantize(w, torch.float32)) if isinstance(w, FP8Weight) else w

        for layer in model.layers:
            for obj in (layer.mixer, layer.mlp):
                for name, w in list(vars(obj).items()):
                    if isinstance(w, SplitLinear):
                        w.parts = tuple(dense(p) for p in w.parts)
                    elif isinstance(w, FP8Weight):
                        setattr(obj, name, dense(w))
        calls: list[tuple[int, torch.Tensor]] = []
        forward = model.experts.forward

        def recording(layer_id, x, ids, weights, **kw):
            calls.append((layer_id, ids.clone()))
            return forward(layer_id, x, ids, weights, **kw)

        model.experts.forward = recording
        prompt = np.random.default_rng(seed).integers(0, 491, prompt_len).tolist()
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens,
                                                    ignore_eos=True))[0]
        decode_s = time.perf_counter() - t0
        llm.engine.shutdown()
        toks = out.token_ids
        d = design(seed)
        follows = toks == d.text(prompt[-1], len(toks))
        steps = [ids[0].tolist() for _, ids in calls if ids.shape[0] == 1]
        recorded = np.array(steps).reshape(len(toks) - 1, layers, -1)
        computed = trace_from_checkpoint(path, toks[:-1])
        same = float(np.mean([set(a) == set(b) for a, b in
                              zip(recorded.reshape(-1, recorded.shape[2]).tolist(),
                                  computed.reshape(-1, computed.shape[2]).tolist(),
                                  strict=True)]))
    checks = {"layers": layers, "decode_tokens": len(toks), "prompt_len": prompt_len,
              "tokens_follow_cycle": bool(follows),
              "routing_equals_computed": same, "write_s": round(write_s, 1),
              "decode_s": round(decode_s, 1)}
    return checks, recorded


def locality(trace: np.ndarray, num_experts: int) -> dict:
    """Repeat shares and popularity concentration of a trace [T, L, k]."""
    T, L, k = trace.shape
    rep1 = np.mean([len(set(trace[t, la]) & set(trace[t - 1, la])) / k
                    for t in range(1, T) for la in range(L)])
    rep8 = np.mean([len(set(trace[t, la]) & set(trace[t - 8:t, la].ravel())) / k
                    for t in range(8, T) for la in range(L)])
    cover = []
    for la in range(L):
        counts = np.sort(np.bincount(trace[:, la].ravel(), minlength=num_experts))[::-1]
        cover.append((np.searchsorted(np.cumsum(counts) / counts.sum(), 0.9) + 1) / num_experts)
    return {"next_token_repeat": round(float(rep1), 3), "repeat_within_8": round(float(rep8), 3),
            "experts_for_90pct": round(float(np.mean(cover)), 3)}


def curves(trace: np.ndarray, warmup: int, num_experts: int) -> dict:
    c = hit_curve(trace, num_experts, FRACTIONS, ("lru", "lru-layer"), warmup=warmup)
    out = {name: {str(f): round(v, 4) for f, v in curve.items()} for name, curve in c.items()}
    out["published_check"] = {
        name: {str(f): {"published": list(PUBLISHED[f]), "ours": round(c[name][f], 4),
                        "within_5_points": PUBLISHED[f][0] - TOLERANCE <= c[name][f]
                        <= PUBLISHED[f][1] + TOLERANCE} for f in PUBLISHED}
        for name in c}
    out["locality"] = locality(trace, num_experts)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2, help="model run layers (0: skip it)")
    p.add_argument("--tokens", type=int, default=200, help="model run decode tokens")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=600, help="computed trace tokens")
    p.add_argument("--warmup", type=int, default=100, help="computed trace warm-up tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args()
    torch.set_num_threads(1)
    c = ModelConfig()
    rec = Recorder(args.out, run_meta(
        "routing_calibration", command="python bench/routing_calibration.py " +
        " ".join(sys.argv[1:]), profile=REALISTIC.__dict__, seed=args.seed,
        published={"qwen3.6-35b-a3b_lru": {str(f): v for f, v in PUBLISHED.items()},
                   "qwen3-30b-a3b_lru_at_0.4": QWEN3_30B_AT_40},
        fractions=FRACTIONS))

    def computed() -> dict:
        d = design(args.seed)
        text = d.text(int(d.cycle[0]), args.steps)
        trace = d.expected_topk(text, [d.router(la) for la in range(c.num_layers)])
        return {"layers": c.num_layers, "steps": args.steps, "warmup": args.warmup,
                **curves(trace, args.warmup, c.num_experts)}

    rec.run("computed_40_layers", computed)
    if args.layers:
        def model() -> dict:
            checks, trace = model_run(args.layers, args.tokens, args.prompt_len, args.seed)
            warm = min(args.warmup, trace.shape[0] // 4)
            return {**checks, "warmup": warm, **curves(trace, warm, c.num_experts)}

        rec.run("model_cpu", model)
    rec.save()
    for name, case in rec.data["cases"].items():
        check = case.get("published_check", {})
        print(name, {pol: {f: (v["ours"], v["within_5_points"]) for f, v in fs.items()}
                     for pol, fs in check.items()})
    return 0 if not rec.data["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
