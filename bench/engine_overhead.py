"""Host time the engine adds to one decode step, split by phase.

Runs the real `Engine` (its thread, scheduler, sampler, detokenizer, streams, one reader
thread per request as `tinyserve bench` has) and times every phase of each engine step with
wrappers installed from outside (nothing in the engine changes):

    loop       between steps: the inbox drain and the lock
    schedule   Scheduler.schedule
    prepare    runner input preparation (ModelRunner.prepare, or DecodeGraphs._fill/_upload)
    model      the model forward (a stand-in below: queues --gpu-ms of emulated GPU work)
    sample     the Sampler call (on CPU this is also its device work)
    forward    the rest of runner.forward (logit row pick, the token copy to the host)
    update     Scheduler.update
    detok      IncrementalDetokenizer.add / finish
    put        RequestHandle.put (the stream hand-off)
    emit       the rest of the engine's output path
    untimed    the rest of the step (engine.step and the runner around the phases above)

`host` = the sum of the phases that are host work on any device (all but model, sample and
forward, which on CPU also do what the GPU does: the full-vocab argmax, the logits copy).

Cases (each at batch 1 and 8, greedy, EOS ignored, decode steps only):

- `standin`: the real ModelRunner over a stand-in model whose forward returns [B, 248320]
  float32 logits (the Qwen3.5 vocabulary; a bigram table picks a token of the tiny tokenizer)
  at once and emulates an asynchronous GPU: the step's `--gpu-ms` run from its launch (after
  the previous step's), and the runner's token-copy event waits until they are over, so the
  host work between launch and wait overlaps them as on a GPU (the CPU sampler's argmax is
  host time here, device time on a GPU). The decode path goes through DecodeGraphs without
  capture (the graph path's host work: pinned-buffer fill and one upload). Tokenizer: the
  real tiny byte-level BPE tokenizer of tinyserve.testing.
- `tiny`: the real tiny random model on CPU (sanity number).
- `ckpt` (with `--ckpt`, on CUDA): the real checkpoint, CUDA graphs on (`--gpu-memory`: a
  budget, e.g. 6GiB, that offloads experts), each batch size on the same engine; the
  baseline in the same run is the runner alone replaying the same
  decode step (`runner.forward` in a loop, as bench/step_profile.py measures it).

    python bench/engine_overhead.py [--gpu-ms 0 3.5 13.3] [--steps 200]
        -> bench/results/engine_overhead_cpu.json
    python bench/engine_overhead.py --ckpt /tmp/tinyserve-fullsize --kv iso3 --context 1024 \
        [--gpu-memory 6GiB]
        -> bench/results/engine_overhead.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, run_meta, sync  # noqa: E402

from tinyserve.core import Batch, ForwardContext, SamplingParams, ScheduledSeq  # noqa: E402
from tinyserve.engine import detokenizer, stream  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402
from tinyserve.engine.graph import DecodeGraphs  # noqa: E402
from tinyserve.engine.loop import Engine, EngineParts  # noqa: E402
from tinyserve.engine.runner import ModelRunner  # noqa: E402
from tinyserve.engine.sampler import Sampler  # noqa: E402

V = 248_320  # Qwen3.5 vocabulary
RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("loop", "schedule", "prepare", "model", "sample", "forward", "update", "detok",
          "put", "emit")
HOST_PHASES = ("loop", "schedule", "prepare", "update", "detok", "put", "emit", "untimed")


# ------------------------------------------------------------------------------ phase timers


class Phases:
    """Per-step phase times. `timed(fn, name)` wraps a callable; nested phases are subtracted
    from their parents so every phase is exclusive."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # child time accumulated under each open frame
        self._last_end: float | None = None

    def timed(self, fn, name: str):
        def wrapper(*args, **kwargs):
            if threading.current_thread().name != "tinyserve-engine":
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                child = self._stack.pop()
                self.cur[name] += dt - child
                if self._stack:
                    self._stack[-1] += dt
        return wrapper

    def step(self, fn):
        def wrapper():
            t0 = time.perf_counter()
            if self._last_end is not None:
                self.cur["loop"] += t0 - self._last_end
            self._stack.append(0.0)
            try:
                return fn()
            finally:
                t1 = time.perf_counter()
                child = self._stack.pop()
                self.cur["step"] = t1 - t0 + self.cur["loop"]
                self.cur["untimed"] = t1 - t0 - child
                self.steps.append(dict(self.cur))
                self.cur = defaultdict(float)
                self._last_end = t1
        return wrapper

    def summary(self, skip: int = 2) -> dict:
        """Median microseconds per decode step of each phase (the first `skip` dropped)."""
        rows = [s for s in self.steps if s.get("decode")][skip:]
        if not rows:
            return {"decode_steps": 0}
        med = {k: round(1e6 * statistics.median(r.get(k, 0.0) for r in rows), 1)
               for k in (*PHASES, "untimed", "step")}
        # NOTE: on CPU `model`, `sample` and `forward` also do the work a GPU would do (the
        # full-vocab argmax, the logits copy); `host` sums the phases that are host work
        # anywhere.
        med["host"] = round(sum(med[k] for k in HOST_PHASES), 1)
        mean_step = statistics.fmean(r["step"] for r in rows)
        return {"decode_steps": len(rows), "us_per_step": med,
                "mean_step_us": round(1e6 * mean_step, 1)}


def instrument(engine: Engine, ph: Phases) -> None:
    """Wrap the engine's phases (instance attributes; the two stream classes for everyone)."""
    s, r = engine.scheduler, engine.runner
    schedule = s.schedule

    def sched():
        batch = schedule()
        ph.cur["decode"] = float(bool(batch.seqs) and batch.is_decode)
        return batch

    s.schedule = ph.timed(sched, "schedule")
    s.update = ph.timed(s.update, "update")
    engine._forward = ph.timed(engine._forward, "forward")
    engine._emit = ph.timed(engine._emit, "emit")
    engine.step = ph.step(engine.step)
    r.prepare = ph.timed(r.prepare, "prepare")
    r.run = ph.timed(r.run, "model")
    if r.graphs is not None:
        g = r.graphs
        g._fill = ph.timed(g._fill, "prepare")
        g._upload = ph.timed(g._upload, "prepare")
        g._forward = ph.timed(g._forward, "model")
        # NOTE: with captured graphs the replay is asynchronous: the GPU time shows up in
        # `forward` (the token copy), not in `model`.
    hook = r.sampler.logits_hook
    r.sampler = TimedSampler(ph.timed(Sampler.__call__, "sample"))
    r.sampler.logits_hook = hook
    if not hasattr(detokenizer.IncrementalDetokenizer, "_untimed_add"):
        cls = detokenizer.IncrementalDetokenizer
        cls._untimed_add, cls._untimed_finish = cls.add, cls.finish
        stream.RequestHandle._untimed_put = stream.RequestHandle.put
    cls = detokenizer.IncrementalDetokenizer
    cls.add = ph.timed(cls._untimed_add, "detok")
    cls.finish = ph.timed(cls._untimed_finish, "detok")
    stream.RequestHandle.put = ph.timed(stream.RequestHandle._untimed_put, "put")


class TimedSampler(Sampler):
    def __init__(self, call) -> None:
        super().__init__()
        self._call = call

    def __call__(self, logits, seqs, **kw):
        return self._call(self, logits, seqs, **kw)


# ------------------------------------------------------------------------------ stand-in model


class StandinModel:
    """Forward over a ForwardContext: [S, V] float32 logits whose argmax follows a bigram table
    over the tokenizer's ids, at once; the emulated GPU is busy `gpu_ms` more from then (or
    from the end of its previous work), until `busy_until`."""

    def __init__(self, vocab_used: int, gpu_ms: float, max_rows: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        self.next_of = torch.randint(0, vocab_used, (vocab_used,), generator=gen).tolist()
        self.buf = torch.randn(max_rows, V, generator=gen)  # |noise| < ~5
        self.hot = [0] * max_rows
        self.gpu_s = gpu_ms / 1e3
        self.busy_until = 0.0
        self.device = torch.device("cpu")
        self.states = SimpleNamespace(num_slots=256)
        self.experts = SimpleNamespace(capturable=False)

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        rows = ctx.logits_indices.tolist()
        ids = ctx.input_ids.tolist()
        for i, row in enumerate(rows):
            self.buf[i, self.hot[i]] = 0.0
            self.hot[i] = self.next_of[ids[row] % len(self.next_of)]
            self.buf[i, self.hot[i]] = 100.0
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.gpu_s
        return self.buf[:len(rows)]


class EmulatedCopyEvent:
    """The runner's token-copy event on the emulated GPU: done when the model's queued work
    is (`synchronize` sleeps until then)."""

    def __init__(self, model: StandinModel) -> None:
        self.model = model
        self.done_at = 0.0

    def record(self, stream=None) -> None:
        self.done_at = self.model.busy_until

    def query(self) -> bool:
        return time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        wait = self.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def tiny_tokenizer(tmp: Path):
    from transformers import AutoTokenizer

    from tinyserve.testing import save_tiny_tokenizer

    save_tiny_tokenizer(tmp / "tok")
    return AutoTokenizer.from_pretrained(str(tmp / "tok"))


def standin_engine(tokenizer, batch: int, gpu_ms: float, context: int) -> Engine:
    page_size = 16
    model = StandinModel(len(tokenizer) - 16, gpu_ms)
    runner = ModelRunner(model, page_size=page_size, device="cpu")
    runner._tokens_copied = EmulatedCopyEvent(model)
    runner.graphs = DecodeGraphs(model, page_size=page_size, pad_state_slot=255, capture=False)
    pages = batch * (-(-context // page_size) + 1)
    parts = EngineParts(runner=runner, tokenizer=tokenizer,
                        model_config=SimpleNamespace(vocab_size=V), num_kv_pages=pages,
                        num_state_slots=batch, max_context=context + 8,
                        eos_token_ids=(tokenizer.eos_token_id,))
    return Engine(parts, EngineConfig(model="standin", max_seqs=batch, prefix_cache=False))


# ------------------------------------------------------------------------------ measurement


def drive(engine: Engine, batch: int, prompt_len: int, gen_len: int, vocab: int,
          seed: int = 0, *, short: int | None = None) -> dict:
    """Submit `batch` greedy requests together, read them on one thread each; returns the
    wall-clock decode rate over the steps after every first token. `short`: every prompt but
    the first has this many tokens (a warm-up that captures the graph of the same batch
    bucket and context capacity for one long prefill)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(0, vocab, (prompt_len if i == 0 or short is None else short,),
                             generator=gen).tolist() for i in range(batch)]
    handles = [engine.submit(p, params) for p in prompts]
    times: list[list[float]] = [[] for _ in handles]

    def read(i: int) -> None:
        for out in handles[i]:
            times[i].extend([time.perf_counter()] * len(out.token_ids))
            if out.error:
                raise RuntimeError(out.error)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = max(t[0] for t in times)
    last = max(t[-1] for t in times)
    n = sum(len(t) - 1 for t in times)
    itl = [b - a for t in times for a, b in zip(t, t[1:], strict=False)]
    return {"decode_tok_s": round(n / (last - first), 1) if last > first else None,
            "itl_median_ms": round(1e3 * statistics.median(itl), 3) if itl else None}


def case_standin(tokenizer, batch: int, gpu_ms: float, steps: int) -> dict:
    prompt_len = 32
    engine = standin_engine(tokenizer, batch, gpu_ms, prompt_len + steps + 8)
    ph = Phases()
    instrument(engine, ph)
    with engine:
        drive(engine, batch, prompt_len, 4, vocab=400, seed=1)  # warm-up
        ph.steps.clear()
        out = drive(engine, batch, prompt_len, steps, vocab=400)
    return {"batch": batch, "gpu_ms": gpu_ms, **out, **ph.summary()}


def case_tiny(ckpt: str, batch: int, steps: int) -> dict:
    from tinyserve.engine.build import build_engine

    cfg = EngineConfig(model=ckpt, device="cpu", max_seqs=batch, max_context=64 + steps,
                       prefix_cache=False)
    engine = build_engine(cfg)
    ph = Phases()
    instrument(engine, ph)
    with engine:
        drive(engine, batch, 32, 4, vocab=400, seed=1)
        ph.steps.clear()
        out = drive(engine, batch, 32, steps, vocab=400)
    return {"batch": batch, **out, **ph.summary()}


def ckpt_engine(ckpt: str, kv: str, max_batch: int, context: int, steps: int,
                gpu_memory: str | None = None) -> Engine:
    from tinyserve.engine.build import build_engine

    return build_engine(EngineConfig(model=ckpt, kv=kv, max_seqs=max_batch,
                                     max_context=context + steps + 48, prefix_cache=False,
                                     gpu_memory=gpu_memory))


def case_ckpt(engine: Engine, batch: int, context: int, steps: int) -> dict:
    """The real checkpoint on CUDA (a started engine): engine decode steps (phases) and, on
    the same runner and graph, the runner alone stepping a decode batch of the same shape."""
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    ph = Phases()
    instrument(engine, ph)
    graphs = engine.runner.graphs
    # warm-up: one long prompt decoding with batch - 1 short ones captures the same graph
    drive(engine, batch, context, 4, vocab, seed=1, short=16)
    captured = 0 if graphs is None else graphs.num_graphs
    ph.steps.clear()
    sync()
    out = drive(engine, batch, context, steps, vocab)
    out.update(ph.summary())
    out["graphs_captured_in_run"] = 0 if graphs is None else graphs.num_graphs - captured
    out["runner_step_ms"] = engine.call(lambda: runner_alone(engine, batch, context, 32))
    step = out["us_per_step"]["step"] / 1e3
    out["engine_over_runner_ms"] = round(step - out["runner_step_ms"], 3)
    return {"batch": batch, "context": context, **out}


def runner_alone(engine: Engine, batch: int, context: int, n: int) -> float:
    """Milliseconds per `runner.forward` of a decode batch of `batch` sequences at position
    `context` (pages and slots taken from the engine's idle pools; runs on the loop thread)."""
    s, r = engine.scheduler, engine.runner
    pages = s.pages.alloc(batch * s.pages_for(context + n + 1))
    slots = s.slots.alloc(batch)
    per = len(pages) // batch
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    try:
        tokens = [1] * batch
        times = []
        for i in range(n + 2):
            seqs = [ScheduledSeq(f"b{b}", [tokens[b]], context + i, pages[b * per:(b + 1) * per],
                                 slots[b], True, greedy) for b in range(batch)]
            sync()
            t0 = time.perf_counter()
            tokens = r.forward(Batch(seqs)).next_tokens
            times.append(time.perf_counter() - t0)
        return round(1e3 * statistics.median(times[2:]), 3)
    finally:
        s.pages.free(pages)
        s.slots.free(slots)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", help="a real checkpoint (CUDA): engine vs runner alone")
    p.add_argument("--kv", default="iso3")
    p.add_argument("--gpu-memory", help="with --ckpt: the engine's GPU budget (e.g. 6GiB)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--gpu-ms", type=float, nargs="+", default=[0.0, 3.5, 13.3])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--label", default="", help="a tag stored with the results (before/after)")
    p.add_argument("--out", help="result file (default by mode)")
    args = p.parse_args()
    name = "engine_overhead" if args.ckpt else "engine_overhead_cpu"
    if not args.ckpt:
        # NOTE: one intra-op thread: on a busy 2-core host a parallel region waits for a
        # descheduled worker (a 4 ms scheduler slice), which no GPU step would see.
        torch.set_num_threads(1)
    out = Path(args.out) if args.out else RESULTS / f"{name}.json"
    rec = Recorder(out, run_meta(name, args=vars(args), threads=torch.get_num_threads(),
                                 loadavg=os.getloadavg()))
    if args.ckpt:
        steps = min(args.steps, 64)
        with ckpt_engine(args.ckpt, args.kv, max(args.batch), args.context, steps,
                         args.gpu_memory) as engine:
            for b in args.batch:
                rec.run(f"ckpt_b{b}", case_ckpt, engine, b, args.context, steps)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tok = tiny_tokenizer(Path(tmp))
            for gpu_ms in args.gpu_ms:
                for b in args.batch:
                    rec.run(f"standin_b{b}_gpu{gpu_ms:g}ms", case_standin, tok, b, gpu_ms,
                            args.steps)
            from tinyserve.testing import make_tiny_checkpoint

            ckpt = str(make_tiny_checkpoint(Path(tmp) / "tiny"))
            for b in args.batch:
                rec.run(f"tiny_b{b}", case_tiny, ckpt, b, min(args.steps, 64))
    print(f"\n{'case':32s} {'tok/s':>8s} {'step us':>8s} {'host us':>8s}  phases (median us)")
    for case, r in rec.data["cases"].items():
        us = r.get("us_per_step", {})
        phases = " ".join(f"{k}={us[k]:.0f}" for k in PHASES if us.get(k))
        print(f"{case:32s} {r.get('decode_tok_s') or 0:8.1f} {us.get('step', 0):8.0f} "
              f"{us.get('host', 0):8.0f}  {phases}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
