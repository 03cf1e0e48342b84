"""Continuous-batching scheduler (pure Python): which requests run in the next step.

`schedule()`: decode tokens first, then prefill chunks under the token budget; groups share
seats fairly (`engine.fairness`). `update` = `advance` + `record`, called apart to chain decode
steps (`schedule_next`). A prefix cache reuses the longest cached prefix ending at a GDN
snapshot, and chunks end where a snapshot is worth taking.
"""

from __future__ import annotations

import bisect
import itertools

from tinyserve.core import PENDING_TOKEN, Batch, ForwardOutput, SamplingParams, ScheduledSeq
from tinyserve.engine import fairness
from tinyserve.engine.requests import Request, RequestRejected, StepEvent
from tinyserve.kv.allocator import PageAllocator
from tinyserve.kv.prefix_cache import PrefixCache, PrefixMatch

__all__ = ["Request", "RequestRejected", "Scheduler", "StepEvent"]


def _by_arrival(r: Request) -> int:
    return r.arrival


class Scheduler:
    """Waiting and running requests over a page allocator and a state-slot allocator.
    Only the engine loop thread calls it; `check()` reads constants and is thread-safe."""

    def __init__(self, *, pages: PageAllocator, slots: PageAllocator, page_size: int,
                 max_context: int, max_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: tuple[int, ...] = (),
                 prefix_cache: PrefixCache | None = None) -> None:
        if max_num_batched_tokens < max_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_seqs ({max_seqs})")
        self.pages = pages
        self.slots = slots
        self.page_size = page_size
        self.max_context = max_context
        self.max_seqs = max_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache = prefix_cache
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        # sequences scheduled so far (`Request.last_step` orders a rotation)
        self._steps = itertools.count(1)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestRejected when a request can never fit."""
        total = prompt_len + params.max_tokens
        asked = f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens})"
        pages, pool = self.pages_for(total), self.pages.num_pages
        for bad, why, limit in (
                (prompt_len < 1, "the prompt is empty", self.max_context),
                (total > self.max_context, f"{asked} = {total} tokens exceeds the context limit "
                 f"of {self.max_context} tokens", self.max_context),
                (pages > pool, f"{asked} needs {pages} KV pages; the pool has {pool}",
                 pool * self.page_size),
                (self.slots.num_pages < 1, "no GDN state slots", 0)):
            if bad:
                raise RequestRejected(why, prompt_tokens=prompt_len,
                                      max_tokens=params.max_tokens, limit=limit)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
            group: str | None = None) -> Request:
        """Queue a request; `group` (default: its own id) is what it shares seats with."""
        self.check(len(prompt_ids), params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, len(prompt_ids), params, next(self._arrivals), list(prompt_ids),
                      group=group or request_id)
        self.requests[request_id] = req
        self.waiting.append(req)  # newest arrival: stays sorted
        return req

    def finish(self, request_id: str) -> Request | None:
        """Remove a request wherever it is (abort, stop string, error); free its resources."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        (self.running if req.running else self.waiting).remove(req)
        self._release(req)
        return req

    def preempt(self, request_id: str, *, solo_until: int = 0) -> None:
        """Return a running request's pages and slot and re-queue it to recompute; with
        `solo_until` it runs alone until that many of its tokens are computed again."""
        req = self.requests[request_id]
        req.solo_until = max(req.solo_until, solo_until)
        if not req.running:
            return
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.running = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=_by_arrival)

    def _release(self, req: Request) -> None:
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req.slot is not None:
            self.slots.free([req.slot])
            req.slot = None

    def alloc_pages(self, n: int) -> list[int] | None:
        """`n` free pages, evicting idle cached pages when needed; None when they cannot be had."""
        return self.pages.alloc(n) if self._make_room(n) else None

    def _make_room(self, n: int) -> bool:  # evicts idle cached pages when that suffices
        short = n - self.pages.num_free
        if short > 0 and self.cache is not None and self.cache.evictable_pages() >= short:
            self.cache.evict(short)
        return self.pages.can_alloc(n)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> Batch:
        """The next step's batch (empty when there is nothing to run)."""
        solo = next((r for r in self.running if r.solo), None)
        head = self._next_waiting()
        if solo is None and head is not None and head.solo:
            if len(self.running) < self.max_seqs and self._admit(head):
                solo = head
        if solo is not None:
            if solo.is_decode and not self._reserve_decode_page(solo):
                return Batch([])
            return Batch([self._chunk(solo, self.max_num_batched_tokens)])
        self._share_seats()
        seqs: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens

        def take(req: Request) -> None:
            nonlocal budget
            seqs.append(self._chunk(req, budget))
            budget -= seqs[-1].num_tokens

        nxt = self._next_waiting()  # it shares this step already when it has a seat
        joining = [nxt] if nxt is not None and not nxt.solo and self._has_room(nxt) else []
        taking_part = [r for r in fairness.step_share(self.running + joining) if r.running]
        trimmed = {r.group for r in self.running if r not in taking_part}
        # decodes first; a decode's page reservation may preempt a request after it
        for req in sorted(taking_part, key=lambda r: not r.is_decode):
            if req.running and budget > 0 and (not req.is_decode
                                               or self._reserve_decode_page(req)):
                take(req)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            req = self._next_waiting()
            if req.solo or req.group in trimmed or not self._admit(req):
                break  # nobody overtakes the next request in the fair order
            take(req)
        return Batch(seqs)

    def _next_waiting(self) -> Request | None:
        return fairness.next_waiting(self.waiting, fairness.seats(self.running))

    def _share_seats(self) -> None:
        """Preempt for the next waiting request while it finds no seat and another group holds
        at least two more seats than its group (`engine.fairness`)."""
        while self.waiting:
            req = self._next_waiting()
            if req.solo or self._has_room(req):
                return
            victim = fairness.should_yield(self.running, req)
            if victim is None:
                return
            self.preempt(victim.request_id)

    def _has_room(self, req: Request) -> bool:
        """Whether `req` could be admitted now (pages counted without its cached prefix)."""
        if len(self.running) >= self.max_seqs or not self.slots.can_alloc(1):
            return False
        free = self.pages.num_free + (self.cache.evictable_pages() if self.cache else 0)
        return self.pages_for(len(req.tokens)) + len(self.running) <= free

    def _reserve_decode_page(self, req: Request) -> bool:
        """Make room for one more token of `req`, preempting newer requests if needed.
        False when `req` itself had to be preempted."""
        while not self._grow_for_next_token(req):
            victim = fairness.victim(self.running)
            self.preempt(victim.request_id)
            if victim is req:
                return False
        return True

    def _grow_for_next_token(self, req: Request) -> bool:
        """Whether `req` has a page for one more token, taking a free one if needed."""
        if len(req.pages) < self.pages_for(req.num_computed + 1):
            page = self.alloc_pages(1)
            if page is None:
                return False
            req.pages += page
        return True

    def _admit(self, req: Request) -> bool:
        # NOTE: leave one page per running request free, so that admitting a request does
        # not force the preemption of that same request at the next page boundary.
        if not self.slots.can_alloc(1):
            return False
        match = PrefixMatch()
        if self.cache is not None:  # NOTE: at least one token is left to prefill (a logit)
            match = self.cache.match(req.tokens, len(req.tokens) - 1)
            self.pages.incref(match.pages)  # the request's own reference, taken first
        need = self.pages_for(len(req.tokens)) - len(match.pages)
        if not self._make_room(need + len(self.running)):
            self.pages.decref(match.pages)
            return False
        self.waiting.remove(req)
        req.pages = list(match.pages) + self.pages.alloc(need)
        req.slot = self.slots.alloc(1)[0]
        if self.cache is not None:
            self.cache.restore(match, req.slot)
            req.num_computed = match.num_tokens
            if req.num_preemptions == 0:
                req.num_cached = min(match.num_tokens, req.prompt_len)
                self.cache.record(match)
        req.running = True
        bisect.insort(self.running, req, key=_by_arrival)
        return True

    def _chunk(self, req: Request, budget: int) -> ScheduledSeq:
        req.last_step = next(self._steps)
        start = req.num_computed
        end = min(len(req.tokens), start + budget)
        if self.cache is not None:  # end a chunk where a snapshot is worth keeping
            last_page = len(req.tokens) // self.page_size * self.page_size
            if start < last_page < end:
                end = last_page
            every = self.cache.snapshot_interval
            if every and (start // every + 1) * every < end:
                end = (start // every + 1) * every
        # NOTE: page_ids is the request's own list, not a copy (a long context has thousands of
        # pages): it only grows, in place, at a later step's page reservation, and a released
        # request gets a new list. A batch is consumed before the next schedule().
        return ScheduledSeq(
            request_id=req.request_id, token_ids=req.tokens[start:end], start_pos=start,
            page_ids=req.pages, state_slot=req.slot, sample=end == len(req.tokens),
            params=req.params, history=req.tokens, num_generated=req.num_generated)

    def update(self, batch: Batch, output: ForwardOutput) -> list[StepEvent]:
        self.advance(batch)
        return self.record(batch, output)

    def advance(self, batch: Batch) -> None:
        """Count a launched step's tokens as computed and cache the pages and state of a
        request left on a page boundary. Call it once per batch, after the step's device work is
        queued and before any later step's (a snapshot copies the state on the stream)."""
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or not req.running or req.num_computed != seq.start_pos:
                continue  # finished or preempted since it was scheduled
            req.num_computed += seq.num_tokens
            if self.cache is not None and req.num_computed % self.page_size == 0:
                self._snapshot(req)

    def record(self, batch: Batch, output: ForwardOutput) -> list[StepEvent]:
        """Append an advanced step's sampled tokens and apply the stop conditions, freeing
        finished requests. A request ended or preempted since it was scheduled gets nothing."""
        events = []
        logprobs = output.logprobs or [None] * len(batch.seqs)
        for seq, token, lp in zip(batch.seqs, output.next_tokens, logprobs, strict=True):
            req = self.requests.get(seq.request_id)
            if (req is None or not req.running or not seq.sample
                    or req.num_computed != seq.start_pos + seq.num_tokens
                    or len(req.tokens) != seq.start_pos + seq.num_tokens):
                continue
            if token is None:
                raise ValueError(f"no token sampled for {seq.request_id!r}")
            req.tokens.append(token)
            reason = self._stop_reason(req, token)
            events.append(StepEvent(req.request_id, token, reason, req.num_cached, lp))
            if reason is not None:
                self.finish(req.request_id)
        return events

    def schedule_next(self, batch: Batch) -> Batch | None:
        """The decode step after `batch` (advanced, its tokens still on the device), or None
        when its make-up could change (a waiting or solo request, another order, a request reaching
        `max_tokens`, a page that cannot be had without preemption). Its `token_ids` are
        `[PENDING_TOKEN]`; an EOS that `batch` samples is seen one step late (`record` drops it)."""
        if self.waiting or len(batch.seqs) != len(self.running) or not batch.seqs:
            return None
        for seq, req in zip(batch.seqs, self.running, strict=True):
            if (seq.request_id != req.request_id or seq.num_tokens != 1 or not seq.sample
                    or req.num_computed != seq.start_pos + 1 or len(req.tokens) != req.num_computed
                    or req.solo or req.num_generated + 1 >= req.params.max_tokens):
                return None
        seqs = []
        for req in self.running:  # NOTE: a page taken before a refusal is needed next step
            if not self._grow_for_next_token(req):
                return None
            seqs.append(ScheduledSeq(
                request_id=req.request_id, token_ids=[PENDING_TOKEN],
                start_pos=req.num_computed, page_ids=req.pages, state_slot=req.slot,
                sample=True, params=req.params, history=req.tokens,
                num_generated=req.num_generated + 1))
        return Batch(seqs)

    def _snapshot(self, req: Request) -> None:
        # its computed pages and its state sit on a page boundary
        n = req.num_computed
        every = self.cache.snapshot_interval
        keep = n == req.prompt_len // self.page_size * self.page_size or (every and n % every == 0)
        node = self.cache.insert(req.tokens[:n], req.pages[:n // self.page_size], req.slot,
                                 replace=req.snapshot_node)
        req.snapshot_node = None if keep else node

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if req.num_generated >= p.max_tokens:
            return "length"
        return None
