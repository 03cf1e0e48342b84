"""Prefix cache: time to first token of each turn of a scripted 8-turn conversation, with the
cache and without it (the baseline, measured in the same run on the same checkpoint).

Each turn's prompt is the previous prompt + the previous answer + a new user message, so with
the cache a turn should prefill only the new message (plus the previous answer's tail that
did not fill a page). Per turn: TTFT, tokens run through the model before the first token
(the prefill), cached tokens reported, and whether both engines produced the same tokens.

Runs on CUDA when available (bf16), else on the CPU (fp32), on the tiny random checkpoint
unless --model is given. Each engine configuration is one case; a failing case is recorded
and the rest go on.

    python bench/prefix.py [--model DIR] [--device cpu|cuda] [--quick]
        -> bench/results/prefix_<device>.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import run_meta, write_json  # noqa: E402  (bench/ on sys.path)

from tinyserve.core import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _counting(engine) -> dict[str, int]:
    """Tokens each request runs through the model (wraps the runner's forward)."""
    counts: dict[str, int] = {}
    forward = engine.runner.forward

    def counted(batch):
        for s in batch.seqs:
            counts[s.request_id] = counts.get(s.request_id, 0) + s.num_tokens
        return forward(batch)

    engine.runner.forward = counted
    return counts


def _turn(engine, prompt: list[int], gen: int, rid: str) -> tuple[float, list[int], int]:
    """(TTFT seconds, generated tokens, cached tokens) of one greedy request."""
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    handle = engine.submit(prompt, params, request_id=rid)
    ttft, tokens, cached = None, [], 0
    for out in handle:
        if out.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += out.token_ids
        cached = out.cached_tokens
        if out.finished and out.finish_reason == "error":
            raise RuntimeError(out.error)
    return ttft or float("nan"), tokens, cached


def conversation(engine, script: dict, tag: str) -> list[dict]:
    """Play the conversation `script["reps"]` times (the cache cleared before each); per turn
    the median TTFT and the last repetition's counts."""
    counts = _counting(engine)
    vocab = min(engine.model_config.vocab_size - 32, 100_000)
    warm = random.Random(1)
    # compile / autotune outside the timing
    _turn(engine, [warm.randrange(1, vocab) for _ in range(64)], 4, f"{tag}-warmup")
    ttfts: list[list[float]] = [[] for _ in range(script["turns"])]
    rows: list[dict] = []
    for r in range(script["reps"]):
        rng = random.Random(script["seed"])  # the same conversation every repetition
        if getattr(engine, "prefix_cache", None) is not None:
            engine.clear_prefix_cache()
        prompt = [rng.randrange(1, vocab) for _ in range(script["first"])]
        rows = []
        for turn in range(script["turns"]):
            rid = f"{tag}-rep{r}-turn{turn}"
            ttft, answer, cached = _turn(engine, prompt, script["gen"], rid)
            ttfts[turn].append(ttft)
            rows.append({"turn": turn + 1, "prompt_tokens": len(prompt),
                         "prefill_tokens": counts.get(rid, 0) - (len(answer) - 1),
                         "cached_tokens": cached, "answer": answer})
            prompt = prompt + answer + [rng.randrange(1, vocab) for _ in range(script["user"])]
    for row, samples in zip(rows, ttfts, strict=True):
        row["ttft_s"] = statistics.median(samples)
        row["ttft_samples_s"] = samples
        print(json.dumps({k: v for k, v in row.items() if k != "answer"} | {"case": tag}),
              flush=True)
    return rows


def run_case(model: str, device: str, prefix_cache: bool, script: dict, tag: str) -> dict:
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    total = script["first"] + script["turns"] * (script["gen"] + script["user"]) + 64
    cfg = EngineConfig(model=model, device=device, max_seqs=2, max_context=total,
                       max_num_batched_tokens=script["chunk"], prefix_cache=prefix_cache)
    engine = build_engine(cfg).start()
    try:
        turns = conversation(engine, script, tag)
        stats = engine.stats()
        return {"case": tag, "prefix_cache": prefix_cache, "turns": turns,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "prefix_cached_tokens": stats.prefix_cached_tokens}
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: tiny random one)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3, help="plays of the conversation per case")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        script = {"first": 2048, "user": 256, "gen": 64, "turns": 8, "chunk": 2048, "seed": 0}
        name = torch.cuda.get_device_name()
    else:
        script = {"first": 256, "user": 48, "gen": 24, "turns": 8, "chunk": 512, "seed": 0}
        name = "cpu"
    script["reps"] = args.reps
    if args.quick:
        script.update(first=script["first"] // 4, turns=4, reps=1)
    result = run_meta("prefix", script=script,
                      baseline="the same engine and conversation with prefix_cache=False")
    result["device"] = name
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tinyserve.testing.tiny import make_tiny_checkpoint

            total = script["first"] + script["turns"] * (script["gen"] + script["user"]) + 64
            model = str(make_tiny_checkpoint(Path(tmp) / "tiny",
                                             max_position_embeddings=max(total, 512)))
        result["model"] = args.model or "tiny random checkpoint"
        cases = {}
        for tag, on in (("no_cache", False), ("prefix_cache", True)):
            try:
                cases[tag] = run_case(model, device, on, script, tag)
            except Exception:
                cases[tag] = {"case": tag, "error": traceback.format_exc(limit=6)}
                print(cases[tag]["error"], flush=True)
    result["cases"] = list(cases.values())
    base, pc = cases.get("no_cache", {}), cases.get("prefix_cache", {})
    if "turns" in base and "turns" in pc:
        result["summary"] = [
            {"turn": b["turn"], "prompt_tokens": b["prompt_tokens"],
             "ttft_no_cache_s": b["ttft_s"], "ttft_prefix_cache_s": c["ttft_s"],
             "speedup": b["ttft_s"] / c["ttft_s"] if c["ttft_s"] else None,
             "prefill_tokens_no_cache": b["prefill_tokens"],
             "prefill_tokens_prefix_cache": c["prefill_tokens"],
             "same_tokens": b["answer"] == c["answer"]}
            for b, c in zip(base["turns"], pc["turns"], strict=True)]
        for row in result["summary"]:
            print(json.dumps(row), flush=True)
    for case in result["cases"]:
        for t in case.get("turns", ()):
            t.pop("answer", None)
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    write_json(RESULTS / f"prefix_{slug}.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
