"""CUDA graphs of the decode step, captured per (padded batch size, context capacity).

A step packs its inputs into a pinned host buffer, copies it to the device once and replays
the graph: logits [B, V] float32 and their argmax [B] in static buffers. B sequences run in
the smallest bucket >= B; a padded row (token 0, KV slot -1, spare state slot) cannot change a
real one. A host embedding table the device cannot read is gathered on the host into the same
buffer. Without capture (CPU) the same static context runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tinyserve.core import ForwardContext, ScheduledSeq
from tinyserve.kernels.launch import host_event
from tinyserve.log import get_logger

log = get_logger(__name__)

BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, *range(16, 257, 8))
MIN_CAPACITY = 256


def batch_bucket(n: int) -> int | None:
    """The padded batch size of a decode step of `n` sequences (None: too many to capture)."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def capacity_pages(max_seq_len: int, page_size: int) -> int:
    """Page-table width of the graph serving sequences of at most `max_seq_len` tokens."""
    tokens = max(MIN_CAPACITY, 1 << max(max_seq_len - 1, 0).bit_length())
    return -(-tokens // page_size)


def _is_decode(seqs: Sequence[ScheduledSeq]) -> bool:
    """One new token after a cached prefix each, at most the largest bucket of sequences."""
    return (0 < len(seqs) <= BATCH_BUCKETS[-1]
            and all(s.num_tokens == 1 and s.start_pos > 0 for s in seqs))


@dataclass
class _Entry:
    """Static buffers (and the graph) of one (batch bucket, pages) pair."""

    batch: int
    pages: int
    host: torch.Tensor  # [W] int64, pinned on CUDA: the packed inputs
    device_buf: torch.Tensor  # [W] int64 on the device, the graph's inputs are views of it
    ctx: ForwardContext
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [batch, V] float32, the graph's output
    tokens: torch.Tensor | None = None  # [batch] int64, argmax of `logits` (graph output)
    copied: Any = None  # torch.cuda.Event after the last host-to-device copy
    # Host embedding only: [batch, H] model-dtype views of `host` / `device_buf` (graph input).
    host_hidden: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class DecodeGraphs:
    """Decode forwards of `model` (a `Qwen35Model`) over static buffers, captured on first use.

    `pad_state_slot`: a GDN state slot no sequence uses (padded rows write it). `capture`: False
    runs the static context eagerly. `host_embedding` defaults to `model.embed_needs_host_ids`.
    Raises ValueError on a bad `pad_state_slot` or a host embedding not in host RAM.
    """

    def __init__(self, model: Any, *, page_size: int, pad_state_slot: int,
                 capture: bool = True, host_embedding: bool | None = None) -> None:
        num_slots = model.states.num_slots
        if not 0 <= pad_state_slot < num_slots:
            raise ValueError(f"pad_state_slot {pad_state_slot} is not a slot of the GDN state "
                             f"pool (0 .. {num_slots - 1})")
        self.model = model
        self.page_size = page_size
        self.pad_state_slot = pad_state_slot
        self.device = torch.device(model.device)
        self.capture = capture and self.device.type == "cuda"
        self.host_embedding = (model.embed_needs_host_ids if host_embedding is None
                               else host_embedding)
        if self.host_embedding and model.embed_tokens.device.type != "cpu":
            raise ValueError("host_embedding needs the model's embedding table in host RAM")
        self.failed = False  # a capture failed (logged); graphs are off from then on
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._pool: Any = None

    @property
    def num_graphs(self) -> int:
        return sum(e.graph is not None for e in self._entries.values())

    def supports(self, seqs: Sequence[ScheduledSeq]) -> bool:
        """Whether `seqs` is a decode step these graphs run (False for good once a capture
        failed: the caller decodes eagerly then)."""
        return not self.failed and _is_decode(seqs)

    @torch.inference_mode()
    def run(self, seqs: Sequence[ScheduledSeq], *, input_tokens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, V] float32, argmax [B] int64) of one decode step, views of static
        buffers valid until the next `run`. `input_tokens` ([B] int64 on the device) replaces the
        token ids. Raises ValueError when a sequence's pages do not cover its tokens."""
        if not _is_decode(seqs):
            raise ValueError(f"not a decode step of 1 .. {BATCH_BUCKETS[-1]} sequences")
        if input_tokens is not None and (self.host_embedding
                                         or input_tokens.shape != (len(seqs),)):
            raise ValueError("input_tokens must be [B] with the token ids on the device")
        bucket = batch_bucket(len(seqs))
        pages = capacity_pages(max(s.start_pos + 1 for s in seqs), self.page_size)
        entry = self._entries.get((bucket, pages)) or self._build(bucket, pages)
        if entry.copied is not None and not entry.copied.query():
            entry.copied.synchronize()  # the last copy out of `host` must finish first
        self._fill(entry, seqs, device_ids=input_tokens is not None)
        self._upload(entry)
        if input_tokens is not None:
            entry.ctx.input_ids[:len(seqs)].copy_(input_tokens)
        if entry.graph is not None:
            # a provider's per-step host work (the expert-cache policy) waits for the
            # runner's `after_launch()`, after the replay
            self.model.experts.begin_step(defer=True)
            entry.graph.replay()
            logits, tokens = entry.logits, entry.tokens
        else:
            logits, tokens = self._forward(entry)
        return logits[:len(seqs)], tokens[:len(seqs)]

    def _forward(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.forward(entry.ctx, hidden=entry.hidden)
        return logits, logits.argmax(dim=-1)

    def _upload(self, entry: _Entry) -> None:
        entry.device_buf.copy_(entry.host, non_blocking=True)
        if entry.copied is not None:
            entry.copied.record()

    def _build(self, bucket: int, pages: int) -> _Entry:
        B, P, dev = bucket, pages, self.device
        n64, n32 = 4 * B, 2 * B + B * P
        words = n64 + (n32 + 1) // 2
        hidden_bytes = 0
        if self.host_embedding:
            dtype, H = self.model.dtype, self.model.config.hidden_size
            hidden_bytes = B * H * dtype.itemsize
        device_buf = torch.zeros(words + -(-hidden_bytes // 8), dtype=torch.int64, device=dev)
        host = torch.zeros(device_buf.numel(), dtype=torch.int64, pin_memory=dev.type == "cuda")
        d32 = device_buf[n64:words].view(torch.int32)
        ctx = ForwardContext(
            input_ids=device_buf[0:B], positions=device_buf[B:2 * B],
            slot_mapping=device_buf[2 * B:3 * B], state_slots=device_buf[3 * B:4 * B],
            cu_seqlens=torch.arange(B + 1, dtype=torch.int32, device=dev),
            prefix_lens=d32[0:B], seq_lens=d32[B:2 * B],
            page_table=d32[2 * B:2 * B + B * P].view(B, P),
            logits_indices=torch.arange(B, dtype=torch.int64, device=dev),
            page_size=self.page_size, q_lens_cpu=[1] * B,
            prefix_lens_cpu=[P * self.page_size - 1] * B, max_seq_len=P * self.page_size)
        entry = _Entry(B, P, host, device_buf, ctx,
                       copied=host_event(dev))
        if self.host_embedding:  # [B, H] model dtype, word-aligned after the int inputs

            def tail(buf: torch.Tensor) -> torch.Tensor:
                return buf[words:].view(torch.uint8)[:hidden_bytes].view(dtype).view(B, H)

            entry.host_hidden, entry.hidden = tail(host), tail(device_buf)
        self._fill(entry, [])  # every row padded: warm-up and capture touch no sequence
        self._upload(entry)
        if self.capture:
            try:
                self._capture(entry)
            except Exception as exc:  # noqa: BLE001 - eager decode still works
                log.warning("CUDA graph capture of a %d-sequence decode failed (%s: %s); "
                            "decoding eagerly from now on", B, type(exc).__name__, exc)
                self.capture, self.failed = False, True
                entry.graph = entry.logits = entry.tokens = None
        self._entries[(B, P)] = entry
        return entry

    def _capture(self, entry: _Entry) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and autotune kernels, create library handles
                self._forward(entry)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, tokens = self._forward(entry)
        entry.graph, entry.logits, entry.tokens = graph, logits, tokens
        log.info("captured the decode graph of %d sequences x %d pages", entry.batch,
                 entry.pages)

    def _fill(self, entry: _Entry, seqs: Sequence[ScheduledSeq], *,
              device_ids: bool = False) -> None:
        """Write the inputs of `seqs`, then padding, into the host buffer (token ids 0 with
        `device_ids`: they come later, on the device)."""
        B, P, ps, n = entry.batch, entry.pages, self.page_size, len(seqs)
        h64 = entry.host[:4 * B].numpy().reshape(4, B)  # ids, positions, KV slots, states
        h32 = entry.host[4 * B:].view(torch.int32).numpy()
        prefix, lens = h32[0:B], h32[B:2 * B]
        table = h32[2 * B:2 * B + B * P].reshape(B, P)
        table[:] = 0
        for b, s in enumerate(seqs):
            pos = s.start_pos
            used = pos // ps + 1
            if len(s.page_ids) < used:
                raise ValueError(f"sequence {s.request_id}: {len(s.page_ids)} pages of {ps} "
                                 f"cannot hold {pos + 1} tokens")
            if s.state_slot == self.pad_state_slot:
                raise ValueError(f"sequence {s.request_id} holds the padding state slot "
                                 f"{self.pad_state_slot}")
            table[b, :used] = s.page_ids[:used]
            h64[:, b] = (0 if device_ids else s.token_ids[0], pos,
                         s.page_ids[pos // ps] * ps + pos % ps, s.state_slot)
        h64[:, n:] = [[0], [0], [-1], [self.pad_state_slot]]
        prefix[:n] = [s.start_pos for s in seqs]
        lens[:n] = [s.start_pos + 1 for s in seqs]
        prefix[n:] = 1
        lens[n:] = 1
        if entry.host_hidden is not None:  # the rows of the tokens written above
            self.model.embed_host(entry.host[:n], out=entry.host_hidden[:n])
            entry.host_hidden[n:] = 0
