"""Serving benchmark: N concurrent streaming clients against the OpenAI-compatible server.

Without --url it builds the tiny random checkpoint (tinyserve.testing), serves it on CPU (or
--device) and also runs the same workload straight on the engine
(`Engine.submit`, no HTTP) as the baseline, so the numbers show what the HTTP/SSE layer adds.
With --url it drives a running server; the baseline is then the same server at concurrency 1.
The self-started server is `tinyserve run` in a subprocess, so the clients do not share its
interpreter lock; the engine baseline runs afterwards, in this process.
Each case records its own failure and the rest go on.

Per request: TTFT (send -> first streamed token), inter-token latency ((last - first) /
(tokens - 1)), tokens from the usage chunk. Per case: medians / p90 and output tokens/s.

    python bench/serve.py [--url http://127.0.0.1:8000] [--concurrency 1 4 16]
        -> bench/results/serve_cpu.json (or --out)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "serve_cpu.json"

from common import StreamError, run_meta, stream_chunks, write_json  # noqa: E402  (bench/ on sys.path)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _summary(reqs: list[dict], wall: float) -> dict[str, Any]:
    ok = [r for r in reqs if "error" not in r]
    ttft = [r["ttft_s"] for r in ok]
    itl = [r["itl_s"] for r in ok if r["itl_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(reqs), "failed": len(reqs) - len(ok),
            "errors": sorted({r["error"] for r in reqs if "error" in r})[:5],
            "ttft_median_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
            "itl_median_s": _pct(itl, 0.5), "itl_p90_s": _pct(itl, 0.9),
            "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall if wall > 0 else None}


async def _one_http(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                    max_tokens: int, headers: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    try:
        async for chunk in stream_chunks(client, url, body, headers):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                    stamps.append(time.perf_counter())
    except StreamError as exc:
        return {"error": str(exc)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if not stamps:
        return {"error": "no tokens streamed"}
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None
    return {"ttft_s": stamps[0] - t0, "itl_s": itl, "tokens": tokens}


async def _http_case(url: str, model: str, prompts: list[str], max_tokens: int,
                     concurrency: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run(p: str) -> dict:
            async with sem:
                return await _one_http(client, url, model, p, max_tokens, headers)

        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(run(p) for p in prompts))
        return _summary(list(reqs), time.perf_counter() - t0)


def _engine_case(engine: Any, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    """The same workload straight on the engine (no HTTP), `concurrency` requests in flight."""
    from tinyserve.core import SamplingParams

    tok = engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
           for p in prompts]
    ids = [tok.encode(t, add_special_tokens=False) for t in ids]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs: list[dict] = []
    lock = threading.Lock()
    queue = list(ids)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            t0 = time.perf_counter()
            stamps, n = [], 0
            for out in engine.submit(prompt, params):
                if out.token_ids:
                    stamps.append(time.perf_counter())
                    n = out.completion_tokens
            itl = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None
            with lock:
                reqs.append({"ttft_s": stamps[0] - t0, "itl_s": itl, "tokens": n})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary(reqs, time.perf_counter() - t0)


def _prompts(n: int, words: int) -> list[str]:
    return [f"Request {i}: " + " ".join(["tell me about the weather in Paris"] * (words // 7))
            for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--device", default="cpu", help="device of the self-started server")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per case (default: max(8, 2 x concurrency))")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)  # as the server subprocess (see _env)
    result: dict[str, Any] = run_meta(
        "serve", benchmark="serve", python=platform.python_version(),
        host_load_average=os.getloadavg(), cpu_threads=torch.get_num_threads(),
        device=(torch.cuda.get_device_name() if args.device.startswith("cuda")
                else platform.processor() or platform.machine()),
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        cases=[], baseline=[])

    server = None
    engine = None
    url = args.url
    model = args.model
    ckpt = None
    try:
        if url is None:
            ckpt = _tiny_checkpoint()
            result["model"] = "tiny random checkpoint (tinyserve.testing)"
            try:
                url, server = _start_server(ckpt, args.device)
            except Exception as exc:  # e.g. a GPU box without fastapi: engine numbers only
                result["server_error"] = f"cannot start the server: {exc}"
        if url is not None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = model or httpx.get(url + "/v1/models", headers=headers
                                       ).json()["data"][0]["id"]
            result["model_id"] = model
            asyncio.run(_http_case(url, model, _prompts(2, args.prompt_words), 4, 2,
                                   args.api_key))  # warm-up
            for c in args.concurrency:
                _run_case(result["cases"], "http", c, args, lambda p, c=c: asyncio.run(
                    _http_case(url, model, p, args.max_tokens, c, args.api_key)))
            if ckpt is None:  # a server we did not start: its concurrency 1 is the baseline
                for c in args.concurrency:
                    _run_case(result["baseline"], "http, concurrency 1", c, args,
                              lambda p: asyncio.run(_http_case(url, model, p, args.max_tokens,
                                                               1, args.api_key)))
        if server is not None:
            _stop_server(server)
            server = None
        if ckpt is not None:  # the same workload straight on the engine, no HTTP
            engine = _tiny_engine(ckpt, args.device)
            _engine_case(engine, _prompts(2, args.prompt_words), 4, 2)  # warm-up
            for c in args.concurrency:
                _run_case(result["baseline"], "engine", c, args,
                          lambda p, c=c: _engine_case(engine, p, args.max_tokens, c))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if server is not None:
            _stop_server(server)
        if engine is not None:
            engine.shutdown()
    write_json(args.out, result)
    return 0


def _run_case(out: list, path: str, concurrency: int, args: Any, fn: Any) -> None:
    n = args.requests or max(8, 2 * concurrency)
    case: dict[str, Any] = {"concurrency": concurrency, "requests": n, "path": path}
    try:
        case.update(fn(_prompts(n, args.prompt_words)))
    except Exception as exc:
        case["error"] = f"{type(exc).__name__}: {exc}"
        case["traceback"] = traceback.format_exc()[-2000:]
    out.append(case)
    print(json.dumps({k: v for k, v in case.items() if k != "traceback"}), flush=True)


def _tiny_checkpoint() -> Path:
    from tinyserve.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", fmt="bf16",
                                max_position_embeddings=2048)


def _tiny_engine(ckpt: Path, device: str) -> Any:
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    return build_engine(EngineConfig(model=str(ckpt), device=device, max_seqs=16)).start()


def _start_server(ckpt: Path, device: str, *,
                  max_seqs: int = 16) -> tuple[str, subprocess.Popen]:
    """`tinyserve run` in its own process (the clients here must not share its GIL)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve", "run", str(ckpt), "--port",
                             str(port), "--device", device, "--max-seqs", str(max_seqs),
                             "--served-model-name", "tiny"], cwd=ROOT, env=_env(device),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-1000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    _stop_server(proc)
    raise RuntimeError("the server did not become ready in 300 s")


def _env(device: str) -> dict[str, str]:
    # NOTE: one intra-op thread on CPU: on a shared, oversubscribed host OpenMP teams stall
    # for seconds per request, which would hide the server.
    return {**os.environ, **({"OMP_NUM_THREADS": "1"} if device == "cpu" else {})}


def _stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
