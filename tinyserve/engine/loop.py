"""The engine: a background thread stepping the scheduler and the model runner.

A step: `schedule -> runner.launch -> advance -> pending.result() -> record -> emit`. Other
threads reach the loop through an inbox; a failing step fails its one request, or is retried
one request at a time. With an asynchronous runner a step's outputs are emitted while the next
step computes (`overlap_hook`), and a decode step whose batch cannot change is chained: launched
with its input tokens on the device before this step's tokens are read.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyserve.core import Batch, ForwardOutput, ParamError, SamplingParams
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.detokenizer import IncrementalDetokenizer
from tinyserve.engine.expert_mode import settle_expert_mode
from tinyserve.engine.memory_plan import MemoryPlan
from tinyserve.engine.runner_api import PendingStep, Runner
from tinyserve.engine.scheduler import Scheduler, StepEvent
from tinyserve.engine.stream import RequestHandle, RequestOutput
from tinyserve.kv.allocator import PageAllocator
from tinyserve.kv.prefix_cache import PrefixCache
from tinyserve.log import get_logger

log = get_logger(__name__)
_SAMPLES = 2048  # latency samples kept for stats()


@dataclass
class EngineParts:
    """What `engine.build` assembles. `max_context` is min(model, KV pool, --max-context).
    `state_pool` and `snapshot_slots` (its slots beyond the sequences') enable the prefix cache."""

    runner: Runner
    tokenizer: Any
    model_config: Any
    num_kv_pages: int
    num_state_slots: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    state_pool: Any = None
    snapshot_slots: tuple[int, ...] = ()
    memory_plan: MemoryPlan | None = None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    page_size: int
    state_slots_used: int
    state_slots_total: int
    max_context: int
    requests_submitted: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions: int
    steps: int
    ttft_seconds: tuple[float, ...]  # recent time-to-first-token samples
    itl_seconds: tuple[float, ...]  # recent inter-token latency samples
    # prefix cache (kv_pages_used above leaves out the pages only the cache holds)
    prefix_cache_pages: int = 0  # KV pages the prefix cache holds
    prefix_cache_snapshots: int = 0  # GDN state snapshots it holds
    prefix_cache_snapshot_slots: int = 0  # snapshot slots in all (0: the cache is off)
    prefix_cache_queries: int = 0  # admissions that looked it up
    prefix_cache_hits: int = 0  # ... and reused a cached prefix
    prefix_cached_tokens: int = 0  # prompt tokens served from it
    # GPU expert cache (None when the experts are resident without a cache)
    expert_cache_hit_rate: float | None = None
    expert_cache_hits: int | None = None  # routed-expert lookups found in a GPU slot
    expert_cache_misses: int | None = None  # ... copied in from the host store
    expert_cache_h2d_bytes: int | None = None  # bytes copied host -> device for misses
    expert_cpu_computed: int | None = None  # misses computed on the CPU (hybrid experts)


@dataclass
class _Live:
    """Loop-thread state of one request."""

    handle: RequestHandle
    detok: IncrementalDetokenizer
    submitted: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    completion_tokens: int = 0


class Engine:
    """Thread-safe front of the scheduler + runner. `start()` launches the loop thread."""

    def __init__(self, parts: EngineParts, config: EngineConfig) -> None:
        self.config = config
        self.runner = parts.runner
        self.tokenizer = parts.tokenizer
        self.model_config = parts.model_config
        self.max_context = parts.max_context
        self.memory_plan = parts.memory_plan
        pages = PageAllocator(parts.num_kv_pages)
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache and parts.state_pool is not None and parts.snapshot_slots:
            self.prefix_cache = PrefixCache(
                pages, page_size=config.page_size, states=parts.state_pool,
                snapshot_slots=parts.snapshot_slots,
                snapshot_interval=config.prefix_snapshot_interval)
        self.scheduler = Scheduler(
            pages=pages, slots=PageAllocator(parts.num_state_slots),
            page_size=config.page_size, max_context=parts.max_context,
            max_seqs=parts.num_state_slots, max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=parts.eos_token_ids, prefix_cache=self.prefix_cache)
        self._vocab: int = parts.model_config.vocab_size
        self._inbox: list[tuple] = []
        self._cond = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self._counts = dict.fromkeys(("submitted", "finished", "aborted", "failed",
                                      "prompt_tokens", "generation_tokens", "steps"), 0)
        self._ttft: deque[float] = deque(maxlen=_SAMPLES)
        self._itl: deque[float] = deque(maxlen=_SAMPLES)
        self._outputs: list[StepEvent] = []  # the last step's, not emitted yet
        self._ahead: tuple[Batch, PendingStep] | None = None  # chained, not recorded
        # NOTE: a runner whose launch computes the step (the CPU) would only delay outputs
        self._overlap = self.runner.asynchronous
        if self._overlap:
            self.runner.overlap_hook = self._flush

    # ---------------------------------------------------------------- the loop (its thread)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._inbox or self._stopping
                                    or self.scheduler.has_work)
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            try:
                if inbox:  # an abort or a call sees every token sampled so far emitted
                    self._flush()
                for item in inbox:
                    self._apply(item)
                if self.scheduler.has_work:
                    self.step()
            except Exception:  # a bug outside any one request: keep serving
                log.exception("engine step failed")
                time.sleep(0.01)
        self._flush()

    def step(self) -> None:
        """One engine step (see the module docstring)."""
        batch, pending = self._take_chained() or self._launch(self.scheduler.schedule())
        output = self._wait(batch, pending)  # chains the next decode step before the wait
        self._flush()  # the previous step's outputs, unless the runner's hook sent them
        if output is not None:
            self._outputs = self.scheduler.record(batch, output)
        if not (self._overlap and self.scheduler.has_work and not self._inbox):
            self._flush()  # else the next step's launch emits them (the overlap hook)

    def _take_chained(self) -> tuple[Batch, PendingStep] | None:
        """The step chained during the last one, unless none of its requests still runs
        (then its tokens are read and dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        batch, pending = ahead
        if any(s.request_id in self.scheduler.requests for s in batch.seqs):
            self._counts["steps"] += 1
            return ahead
        pending.result()
        return None

    def _launch(self, batch: Batch) -> tuple[Batch, PendingStep | None]:
        if not batch.seqs:
            return batch, None
        self._counts["steps"] += 1
        try:
            return batch, self.runner.launch(batch)
        except Exception as exc:
            self._step_failed(batch, exc)
            return batch, None

    def _wait(self, batch: Batch, pending: PendingStep | None) -> ForwardOutput | None:
        """Advance the scheduler past `batch`, chain the next decode step, then wait for
        `batch`'s tokens (None when nothing ran or the step failed)."""
        if pending is None:
            return None
        try:
            self.scheduler.advance(batch)
            self._ahead = self._chain(batch, pending)
            return pending.result()
        except Exception as exc:
            self._ahead = None
            self._step_failed(batch, exc)
            return None

    def _chain(self, batch: Batch, pending: PendingStep) -> tuple[Batch, PendingStep] | None:
        """Launch the decode step after `batch` with its input tokens read from `pending` on
        the device, when nothing can change the batch before then."""
        if (self._inbox or self._stopping or pending.device_tokens is None
                or not self.runner.can_chain(batch)):
            return None
        nxt = self.scheduler.schedule_next(batch)
        if nxt is None or not self.runner.can_chain(nxt):
            return None
        try:
            return nxt, self.runner.launch(nxt, after=pending)
        except Exception:  # this step stands; the next one is scheduled as usual
            log.exception("launching a chained decode step failed")
            return None

    def _step_failed(self, batch: Batch, exc: Exception) -> None:
        """A step's launch or result raised: fail its one request, or rerun each alone."""
        if len(batch) == 1:
            log.error("request %s failed", batch.seqs[0].request_id, exc_info=exc)
            self._end(batch.seqs[0].request_id, "error", error=f"{type(exc).__name__}: {exc}")
        else:  # which request broke it? rerun each alone, from scratch
            log.warning("a step of %d requests failed (%s); retrying them one at a time",
                        len(batch), exc)
            for seq in batch.seqs:  # each alone until past the failed chunk
                if seq.request_id in self.scheduler.requests:
                    self.scheduler.preempt(seq.request_id,
                                           solo_until=seq.start_pos + seq.num_tokens)

    # ---------------------------------------------------------------- any thread

    def start(self) -> Engine:
        """Start the loop thread; the first start settles `--experts auto` by decoding a few
        tokens each way (`engine.expert_mode`), leaving no trace but the expert counters."""
        with self._cond:
            if self._thread is not None:
                return self
            self._thread = threading.Thread(target=self._loop, name="tinyserve-engine",
                                            daemon=True)
            self._thread.start()
        if settle_expert_mode(self) is not None:
            self.clear_prefix_cache()
            self.call(self._reset_counts)
        return self

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread; unfinished requests end with finish_reason "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "add":
                self._live[item[1]] = item[4]
            elif item[0] == "call":
                item[2].set_exception(RuntimeError("the engine shut down"))
        for rid in list(self._live):
            self._end(rid, "abort", error="the engine shut down")

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, group: str | None = None) -> RequestHandle:
        """Queue a request; returns its stream at once. Requests of one `group` share the
        engine fairly with other groups. Raises RequestRejected when it can never fit, ValueError on
        token ids outside the vocabulary (ParamError for `logit_bias` keys), RuntimeError after
        shutdown."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.scheduler.check(len(prompt), params)
        if any(not 0 <= t < self._vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self._vocab})")
        if any(t >= self._vocab for t, _ in params.logit_bias):
            raise ParamError("logit_bias", f"keys must be token ids in [0, {self._vocab})")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        handle = RequestHandle(rid, len(prompt), self.abort)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        self._post(("add", rid, prompt, params, _Live(handle, detok), group))
        return handle

    def abort(self, request_id: str) -> None:
        """End a request (finish_reason "abort") and free its pages and state slot before the
        next step. Unknown or finished ids are ignored."""
        self._post(("abort", request_id))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the loop thread between steps and return its result (or raise)."""
        if (self._thread is None or not self._thread.is_alive()
                or self._thread is threading.current_thread()):
            return fn()
        fut: Future = Future()
        self._post(("call", fn, fut))
        return fut.result()

    def _post(self, item: tuple) -> None:
        with self._cond:
            if self._stopping and item[0] == "add":
                raise RuntimeError("the engine is shut down")
            self._inbox.append(item)
            self._cond.notify_all()

    def set_expert_plan(self, plan: Any, cpu_runner: Any = None) -> None:
        """Serve decode misses by `plan` (an `offload.hybrid.HybridPlan`) from the next step."""
        self.call(lambda: self.runner.set_expert_plan(plan, cpu_runner))

    def set_logits_hook(self, fn: Callable | None) -> None:
        """`fn(logits [S, V] float32, seqs) -> logits`, run before sampling (tests)."""
        self.runner.sampler.logits_hook = fn

    def logits(self, token_ids: Sequence[int]) -> Any:
        """Teacher-forced logits [T, V] float32 of one sequence, on the engine's pools. Raises
        RequestRejected when it cannot fit, RuntimeError when the pools are busy."""
        ids = [int(t) for t in token_ids]
        self.scheduler.check(len(ids), SamplingParams(max_tokens=1))
        return self.call(lambda: self._logits(ids))

    def warm_up(self) -> float:
        """Run one throwaway greedy request (two and a half chunks by default: every
        extend-attention path) so that the first real one pays no one-time costs; returns
        seconds. It leaves no trace but the expert-cache counters. Raises RuntimeError if it
        fails."""
        chunk = self.config.max_num_batched_tokens
        n = min(2 * chunk + chunk // 2, self.max_context - 2)
        if n < 1:
            return 0.0
        prompt = self.random_prompt(n, torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        handle = self.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                    ignore_eos=True), request_id="warm-up")
        errors = [out.error for out in handle if out.error]
        if errors:
            raise RuntimeError(f"the warm-up request failed: {errors[0]}")
        self.clear_prefix_cache()
        self.call(self._reset_counts)
        return time.perf_counter() - t0

    def random_prompt(self, length: int, generator: torch.Generator) -> list[int]:
        """`length` random token ids that both the model and the tokenizer know."""
        vocab = min(v for v in (self._vocab, len(self.tokenizer)) if v)
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    def _reset_counts(self) -> None:
        self._counts = dict.fromkeys(self._counts, 0)
        self._ttft.clear()
        self._itl.clear()

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (its idle pages and snapshot slots go back to the pools)."""
        if self.prefix_cache is not None:
            self.call(self.prefix_cache.clear)

    def stats(self) -> EngineStats:
        s, c, pc = self.scheduler, self._counts, self.prefix_cache
        cache = {} if pc is None else dict(
            prefix_cache_pages=pc.num_pages, prefix_cache_snapshots=pc.num_snapshots,
            prefix_cache_snapshot_slots=len(pc.snapshot_slots), prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits, prefix_cached_tokens=pc.hit_tokens)
        cache.update(self.runner.expert_stats())
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting) + sum(item[0] == "add" for item in list(self._inbox)),
            kv_pages_used=s.pages.num_used - (0 if pc is None else pc.num_idle_pages),
            kv_pages_total=s.pages.num_pages,
            page_size=s.page_size, state_slots_used=s.slots.num_used,
            state_slots_total=s.slots.num_pages, max_context=self.max_context,
            requests_submitted=c["submitted"], requests_finished=c["finished"],
            requests_aborted=c["aborted"], requests_failed=c["failed"],
            prompt_tokens_total=c["prompt_tokens"],
            generation_tokens_total=c["generation_tokens"], preemptions=s.num_preemptions,
            steps=c["steps"], ttft_seconds=tuple(self._ttft), itl_seconds=tuple(self._itl),
            **cache)

    # ---------------------------------------------------------------- outputs, inbox (loop thread)

    def _flush(self) -> None:
        """Emit the last step's outputs (once)."""
        events, self._outputs = self._outputs, []
        if events:
            self._emit(events)

    def _apply(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            _, rid, prompt, params, live, group = item
            try:
                self.scheduler.add(rid, prompt, params, group=group)
            except ValueError as exc:
                live.handle.put(RequestOutput(rid, finished=True, finish_reason="error",
                                              error=str(exc), prompt_tokens=len(prompt)))
                return
            self._live[rid] = live
            self._counts["submitted"] += 1
            self._counts["prompt_tokens"] += len(prompt)
        elif kind == "abort":
            self._end(item[1], "abort")
        elif kind == "call":
            _, fn, fut = item
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _emit(self, events: list[StepEvent]) -> None:
        now = time.perf_counter()
        for ev in events:
            live = self._live.get(ev.request_id)
            if live is None:
                continue
            try:
                self._emit_one(live, ev, now)
            except Exception as exc:
                log.exception("output of request %s failed", ev.request_id)
                self._end(ev.request_id, "error", error=f"{type(exc).__name__}: {exc}")

    def _emit_one(self, live: _Live, ev: StepEvent, now: float) -> None:
        if live.last_token is None:
            self._ttft.append(now - live.submitted)
        else:
            self._itl.append(now - live.last_token)
        live.last_token = now
        live.completion_tokens += 1
        self._counts["generation_tokens"] += 1
        reason = ev.finish_reason
        if reason == "stop":  # an EOS or stop token: it has no text
            text = live.detok.finish()
        else:
            text = live.detok.add([ev.token_id])
            if live.detok.stopped:
                reason = "stop"
                self.scheduler.finish(ev.request_id)
            elif reason is not None:
                text += live.detok.finish()
        live.handle.put(RequestOutput(
            ev.request_id, [ev.token_id], text, reason is not None, reason, None,
            live.handle.prompt_tokens, live.completion_tokens, ev.cached_tokens,
            [ev.logprobs] if ev.logprobs is not None else [], live.detok.matched))
        if reason is not None:
            del self._live[ev.request_id]
            self._counts["finished"] += 1

    def _end(self, rid: str, reason: str, *, error: str | None = None) -> None:
        """Finish a request outside the token path (abort, error, shutdown)."""
        self.scheduler.finish(rid)
        live = self._live.pop(rid, None)
        if live is None:
            return
        self._counts["aborted" if reason == "abort" else "failed"] += 1
        live.handle.put(RequestOutput(rid, [], "", True, reason, error,
                                      live.handle.prompt_tokens, live.completion_tokens))

    def _logits(self, ids: list[int]) -> Any:
        s = self.scheduler
        pages = s.alloc_pages(s.pages_for(len(ids)))
        slot = s.slots.alloc(1)
        try:
            if pages is None or slot is None:
                raise RuntimeError("no free KV pages or state slot for logits(); retry when "
                                   "the engine is idle")
            return self.runner.logits(ids, page_ids=pages, state_slot=slot[0],
                                      chunk_size=self.config.max_num_batched_tokens)
        finally:
            if pages:
                s.pages.free(pages)
            if slot:
                s.slots.free(slot)
