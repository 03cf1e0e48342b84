"""Fairness benchmark: a short request's latency while one big request (n choices x many
tokens) runs, against the same short request on an idle server.

It builds the tiny random checkpoint (tinyserve.testing), serves it with `tinyserve run` in a
subprocess on the CPU (or --device), and over HTTP (streaming chat, greedy, ignore_eos):

1. alone: `--short-requests` short requests (`--short-tokens` tokens), one after another;
2. contended: the big request (`--n` choices x `--long-tokens` tokens) starts, and once it
   streams tokens the same short requests are sent, one every `--gap-s` seconds (each on its
   own, so that every one is sent while the big request runs); then the big request is
   dropped (the client hangs up, which aborts it).

Both run `--rounds` times (the machine is shared: noise). Per short request: TTFT and
end-to-end latency (send -> [DONE]). The ratio of the contended median to the alone median is
what fairness is about (target: at most 3).

    python bench/fairness.py [--n 16] [--long-tokens 2000] [--max-seqs 16] [--rounds 3]
        -> bench/results/fairness_cpu.json (or --out)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "fairness_cpu.json"

from common import StreamError, run_meta, stream_chunks, write_json  # noqa: E402  (bench/ on sys.path)
from serve import _start_server, _stop_server  # noqa: E402


async def _stream(client: httpx.AsyncClient, url: str, body: dict, *,
                  started: asyncio.Event | None = None, after: int = 1) -> dict:
    """One streamed chat request: TTFT, latency, tokens; `started` is set once `after`
    content events arrived."""
    t0 = time.perf_counter()
    first = None
    events = 0
    usage = None
    error = None
    try:
        async for chunk in stream_chunks(client, url, body):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = first or time.perf_counter()
                events += 1
                if started is not None and events >= after:
                    started.set()
    except StreamError as exc:
        error = str(exc)
    out = {"latency_s": time.perf_counter() - t0, "ttft_s": (first or time.perf_counter()) - t0,
           "completion_tokens": (usage or {}).get("completion_tokens")}
    if error:
        out["error"] = error
    return out


def _body(max_tokens: int, n: int = 1, text: str = "Hello there, how are you?") -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "n": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}


async def _shorts(client: httpx.AsyncClient, url: str, args: Any,
                  big: asyncio.Task | None = None) -> list[dict]:
    """The short requests, one every `gap_s` seconds (sequential when `big` is None)."""
    async def one(i: int) -> dict:
        await asyncio.sleep(i * args.gap_s)
        out = await _stream(client, url, _body(args.short_tokens, text=f"Short {i}?"))
        if big is not None:
            out["big_still_running"] = not big.done()
        return out

    if big is None:
        return [await one(0) for _ in range(args.short_requests)]
    return list(await asyncio.gather(*(one(i) for i in range(args.short_requests))))


async def _run(url: str, args: Any) -> dict[str, Any]:
    rounds = [await _round(url, args) for _ in range(args.rounds)]
    out: dict[str, Any] = {"alone": [r for x in rounds for r in x.pop("alone")],
                           "contended": [r for x in rounds for r in x.pop("contended")]}
    return {**out, "rounds": rounds}


async def _round(url: str, args: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=args.timeout_s) as client:
        await _stream(client, url, _body(4))  # warm-up
        alone = await _shorts(client, url, args)
        started = asyncio.Event()
        t0 = time.perf_counter()
        big = asyncio.create_task(_stream(client, url, _body(args.long_tokens, n=args.n,
                                                             text="Tell me a long story."),
                                          started=started, after=args.n * 8))
        await asyncio.wait_for(started.wait(), args.timeout_s)
        big_start_s = time.perf_counter() - t0
        contended = await _shorts(client, url, args, big)
        big_done = big.done()
        big.cancel()  # the client hangs up: the server aborts the big request
        try:
            big_result = await big
        except asyncio.CancelledError:
            big_result = None
    return {"alone": alone, "contended": contended, "big_started_after_s": big_start_s,
            "big_finished_before_the_last_short": big_done, "big": big_result}


def _median(reqs: list[dict], key: str) -> float | None:
    values = [r[key] for r in reqs if "error" not in r]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=16, help="choices of the big request")
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--short-tokens", type=int, default=4)
    ap.add_argument("--short-requests", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=0.5, help="time between short requests")
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="alone + contended, this many times")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--label", default="", help="recorded with the result (e.g. before/after)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from tinyserve.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", fmt="bf16",
                                max_position_embeddings=4096)
    result: dict[str, Any] = run_meta(
        "fairness", benchmark="fairness", label=args.label, python=platform.python_version(),
        host_load_average=os.getloadavg(), command=" ".join(["python", *sys.argv]),
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        model="tiny random checkpoint (tinyserve.testing), max_position_embeddings 4096")
    server = _start_server(ckpt, args.device, max_seqs=args.max_seqs)
    try:
        result.update(asyncio.run(_run(server[0], args)))
    finally:
        _stop_server(server[1])
    alone = _median(result["alone"], "latency_s")
    contended = _median(result["contended"], "latency_s")
    result["summary"] = {
        "alone_latency_median_s": alone, "contended_latency_median_s": contended,
        "alone_ttft_median_s": _median(result["alone"], "ttft_s"),
        "contended_ttft_median_s": _median(result["contended"], "ttft_s"),
        "contended_over_alone": contended / alone if alone and contended else None}
    print(json.dumps(result["summary"], indent=1))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
