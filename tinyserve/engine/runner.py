"""Model runner: turns a scheduler `Batch` into a `ForwardContext`, runs the model and samples.

`launch` queues the device work (forward, sampling, the tokens' copy into pinned memory), then
runs the overlapping host work (`experts.after_launch()`, `overlap_hook`); `result()` is the
step's one host synchronisation. `launch(next, after=pending)` chains a decode step on
`pending`'s tokens still on the device. Pure-decode batches replay CUDA graphs (`engine.graph`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tinyserve.core import (
    Batch,
    ForwardContext,
    ForwardOutput,
    ScheduledSeq,
    TokenLogprobs,
)
from tinyserve.engine.graph import DecodeGraphs
from tinyserve.engine.runner_api import PendingStep, Runner
from tinyserve.engine.sampler import Sampler, token_logprobs
from tinyserve.kernels.launch import host_event
from tinyserve.model.linear import kernels_enabled


class PendingOutput:
    """A launched step; `result()` waits for its tokens and returns (always the same)
    `ForwardOutput`. `device_tokens` ([S] int64 on the device, valid until the next launch) is
    set when every sequence sampled a token."""

    def __init__(self, sample_rows: list[int], num_seqs: int, logits: torch.Tensor | None,
                 host: torch.Tensor | None, copied: Any,
                 device_tokens: torch.Tensor | None = None, logprobs: Any = None) -> None:
        self._rows = sample_rows
        self._num_seqs = num_seqs
        self._logits = logits
        self._host = host  # [len(sample_rows)] int64 view of one of the runner's pinned buffers
        self._copied = copied
        self.device_tokens = device_tokens
        self._logprobs = logprobs  # `token_logprobs` of the sampled rows (host copies) or None
        self._output: ForwardOutput | None = None

    @property
    def done(self) -> bool:
        return self._output is not None

    def result(self) -> ForwardOutput:
        if self._output is None:
            tokens: list[int] = []
            if self._host is not None:
                if self._copied is not None:
                    self._copied.synchronize()  # the copy into the pinned buffer is done
                tokens = self._host.tolist()
            next_tokens: list[int | None] = [None] * self._num_seqs
            for i, t in zip(self._rows, tokens, strict=True):
                next_tokens[i] = t
            self._output = ForwardOutput(next_tokens=next_tokens, logits=self._logits,
                                         logprobs=self._read_logprobs(next_tokens))
            self._host = None  # the buffer is the runner's again
        return self._output

    def _read_logprobs(self, next_tokens: list[int | None]) -> list[TokenLogprobs | None] | None:
        if self._logprobs is None:
            return None
        rows, ks, chosen, top_ids, top_lps = self._logprobs
        out: list[TokenLogprobs | None] = [None] * self._num_seqs
        chosen, top_ids, top_lps = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
        for j, (r, k) in enumerate(zip(rows, ks, strict=True)):
            i = self._rows[r]  # the batch index of sampled row r
            token = next_tokens[i]
            assert token is not None
            out[i] = TokenLogprobs(token, chosen[j],
                                   tuple(zip(top_ids[j][:k], top_lps[j][:k], strict=True)))
        return out


class _TokenBuffer:
    """Pinned host memory for one step's sampled tokens (and logprobs), the event of the
    copies into it and the step that owns it until its tokens are read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # the tokens, then the logprob arrays (chosen, top ids, top logprobs); grown as needed
        self.pinned: list[torch.Tensor | None] = [None, None, None, None]
        self.copied = host_event(device)
        self.owner: PendingOutput | None = None

    def stage(self, tokens: torch.Tensor, logprobs: Any = None) -> tuple[torch.Tensor, Any]:
        """Start copying `tokens` [S] (and `token_logprobs`'s arrays) here and record the
        event; the host views. The last owner is read out first: the memory is never
        rewritten before its tokens are read."""
        if self.owner is not None:
            self.owner.result()
        host = self._copy(0, tokens)
        if logprobs is not None:
            rows, ks, *arrays = logprobs
            logprobs = (rows, ks, *(self._copy(i, a) for i, a in enumerate(arrays, start=1)))
        if self.copied is not None:
            cuda = self.device.type == "cuda"
            self.copied.record(torch.cuda.current_stream(self.device) if cuda else None)
        return host, logprobs

    def _copy(self, slot: int, src: torch.Tensor) -> torch.Tensor:
        n = src.numel()
        held = self.pinned[slot]
        if held is None or held.numel() < n or held.dtype != src.dtype:
            held = self.pinned[slot] = torch.empty(max(n, 256), dtype=src.dtype,
                                                   pin_memory=self.device.type == "cuda")
        host = held[:n].view(src.shape)
        host.copy_(src, non_blocking=True)
        return host


class ModelRunner(Runner):
    """Runs `model` (a `Qwen35Model`, whose `kv` and `states` pools the batches index).

    Args:
        cuda_graphs: replay CUDA graphs for pure-decode batches; needs `graph_pad_slot` (a GDN
            state slot no sequence uses), a CUDA device with kernels on and a capturable experts
            provider.
        keep_logits: copy a graph step's logits into its output (False: `logits=None` when the
            tokens are the graph's own argmax).
    """

    def __init__(self, model: Any, *, page_size: int, cuda_graphs: bool = False,
                 graph_pad_slot: int | None = None, keep_logits: bool = True) -> None:
        self.model = model
        self.page_size = page_size
        self.device: torch.device = model.device
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self.keep_logits = keep_logits
        self.overlap_hook: Callable[[], None] | None = None
        self.asynchronous = self.device.type == "cuda"  # on the CPU a launch computes the step
        # NOTE: two token buffers in turn: a chained step stages its tokens while the step
        # before it is still unread
        self._buffers = (_TokenBuffer(self.device), _TokenBuffer(self.device))
        self._next_buffer = 0
        if (cuda_graphs and graph_pad_slot is not None and kernels_enabled(self.device)
                and model.experts.capturable):
            self.graphs = DecodeGraphs(model, page_size=page_size, pad_state_slot=graph_pad_slot)

    def set_expert_plan(self, plan: Any, cpu_runner: Any = None) -> None:
        """Serve the offloaded experts' decode misses by `plan` (`OffloadedExperts.set_hybrid`)
        and drop the decode graphs, which captured the old path."""
        self.model.experts.set_hybrid(plan, cpu_runner)
        old = self.graphs
        if old is not None:
            self.graphs = DecodeGraphs(old.model, page_size=old.page_size,
                                       pad_state_slot=old.pad_state_slot)

    def prepare(self, batch: Batch | Sequence[ScheduledSeq], *,
                all_logits: bool = False) -> ForwardContext:
        """Flatten a batch into forward tensors on the device (and `input_ids_cpu`).
        `logits_indices`: the last row of each sampling sequence, or every row with `all_logits`.
        Raises ValueError when a sequence's pages do not cover its tokens."""
        seqs = batch.seqs if isinstance(batch, Batch) else list(batch)
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        cu = [0]
        max_pages = max((len(s.page_ids) for s in seqs), default=0)
        table = [[0] * max(max_pages, 1) for _ in seqs]
        for b, s in enumerate(seqs):
            n, start = s.num_tokens, s.start_pos
            if len(s.page_ids) * ps < start + n:
                raise ValueError(f"sequence {s.request_id}: {len(s.page_ids)} pages of {ps} "
                                 f"cannot hold {start + n} tokens")
            ids.extend(s.token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(s.page_ids[p // ps] * ps + p % ps for p in pos)
            table[b][:len(s.page_ids)] = s.page_ids
            if all_logits:
                logit_rows.extend(range(cu[-1], cu[-1] + n))
            elif s.sample and n > 0:
                logit_rows.append(cu[-1] + n - 1)
            cu.append(cu[-1] + n)
        q_lens = [s.num_tokens for s in seqs]
        prefix = [s.start_pos for s in seqs]

        def t(data: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

        ids_cpu = torch.tensor(ids, dtype=torch.int64)
        return ForwardContext(
            input_ids=t(ids_cpu, torch.int64), positions=t(positions, torch.int64),
            cu_seqlens=t(cu, torch.int32), prefix_lens=t(prefix, torch.int32),
            seq_lens=t([p + q for p, q in zip(prefix, q_lens, strict=True)], torch.int32),
            page_table=t(table, torch.int32), slot_mapping=t(slots, torch.int64),
            state_slots=t([s.state_slot for s in seqs], torch.int64),
            logits_indices=t(logit_rows, torch.int64), page_size=ps, q_lens_cpu=q_lens,
            prefix_lens_cpu=prefix, input_ids_cpu=ids_cpu)

    def run(self, ctx: ForwardContext) -> torch.Tensor:
        return self.model.forward(ctx)

    def can_chain(self, batch: Batch) -> bool:
        """Whether `batch` may take its input tokens from the previous step on the device:
        a graph decode without a host embedding table, sampling that reads no host history."""
        seqs = batch.seqs
        return (self.graphs is not None and not self.graphs.host_embedding
                and self.graphs.supports(seqs) and all(s.sample for s in seqs)
                and self.sampler.chainable)

    def launch(self, batch: Batch, *, after: PendingStep | None = None) -> PendingOutput:
        """Queue one step, then run the host work that overlaps it. With `after` (a launched
        step with `device_tokens`, one per sequence), the input tokens are read from it on
        the device; `batch` must pass `can_chain` (ValueError otherwise)."""
        seqs = batch.seqs
        inputs = None
        if after is not None:
            inputs = after.device_tokens
            if inputs is None or inputs.numel() != len(seqs) or not self.can_chain(batch):
                raise ValueError("a chained launch needs a graph decode batch whose sampling "
                                 "reads no token history, after a step that sampled one token "
                                 "per row on the device")
        greedy = None  # [S] tokens sampled inside the decode graph
        if self.graphs is not None and self.graphs.supports(seqs):
            logits, argmax = self.graphs.run(seqs, input_tokens=inputs)  # static buffers
            rows = [i for i, s in enumerate(seqs) if s.sample]
            if len(rows) == len(seqs) and self.sampler.argmax_only(seqs):
                greedy = argmax
                logits = logits.clone() if self.keep_logits else None
            else:
                logits = logits.clone() if len(rows) == len(seqs) else logits[rows]
        else:
            logits = self.run(self.prepare(batch))
        rows = [i for i, s in enumerate(seqs) if s.sample and s.num_tokens > 0]
        buffer, host, tokens, logprobs = None, None, None, None
        if rows:
            sampled = [seqs[i] for i in rows]
            tokens = (greedy if greedy is not None
                      else self.sampler(logits, sampled, chained=after is not None))
            if logits is not None:
                logprobs = token_logprobs(logits, sampled, tokens)
            buffer = self._buffers[self._next_buffer]
            self._next_buffer ^= 1
            host, logprobs = buffer.stage(tokens, logprobs)  # [S] int64 on the host
        pending = PendingOutput(rows, len(seqs), logits, host,
                                buffer.copied if buffer is not None else None,
                                device_tokens=tokens if len(rows) == len(seqs) else None,
                                logprobs=logprobs)
        if buffer is not None:
            buffer.owner = pending
        self.model.experts.after_launch()  # e.g. the expert-cache policy of the last step
        if self.overlap_hook is not None:
            self.overlap_hook()
        return pending

    def expert_stats(self) -> dict[str, Any]:
        experts = self.model.experts
        if (s := experts.stats) is None:
            return {}
        return dict(expert_cache_hit_rate=float(s.hit_rate), expert_cache_hits=s.hits,
                    expert_cache_misses=s.misses, expert_cache_h2d_bytes=s.h2d_bytes,
                    expert_cpu_computed=experts.cpu_computed)

    def logits(self, token_ids: Sequence[int], *, page_ids: Sequence[int] | None = None,
               state_slot: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [T, V] float32 of one sequence, prefilled from position 0.
        Without `page_ids` / `state_slot` it takes the first pages and a free slot: only
        while no other sequence lives in the pools. `chunk_size` splits the prefill."""
        T = len(token_ids)
        if page_ids is None:
            need = -(-T // self.page_size)
            if need > self.model.kv.num_pages:
                raise ValueError(f"{T} tokens need {need} KV pages; the pool has "
                                 f"{self.model.kv.num_pages}")
            page_ids = list(range(need))
        own_slot = state_slot is None
        slot = self.model.states.alloc() if own_slot else state_slot
        try:
            step = chunk_size or max(T, 1)
            out = []
            for start in range(0, T, step):
                chunk = list(token_ids[start:start + step])
                seq = ScheduledSeq(request_id="logits", token_ids=chunk, start_pos=start,
                                   page_ids=list(page_ids), state_slot=slot, sample=False)
                out.append(self.run(self.prepare([seq], all_logits=True)))
            return torch.cat(out) if out else torch.empty(0, 0)
        finally:
            if own_slot:
                self.model.states.free(slot)
