"""Batched sampling on the model's device. Per row: hook -> penalties -> logit bias -> argmax
at temperature 0, else temperature, top-k, top-p, min-p and an exponential race (argmax p / q,
q ~ Exp(1)); a seeded request draws from (seed, tokens generated). Penalties read device-side
`TokenCounts` the sampler advances, so a chained step uses the counts the last step left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinyserve.core import ScheduledSeq

LogitsHook = Callable[[torch.Tensor, Sequence[ScheduledSeq]], torch.Tensor]
"""`hook(logits [S, V] float32, seqs) -> logits`, before everything else (tests force
scripted tokens through the real sampler with it)."""

_SEED_STRIDE = 1_000_003


class Sampler:
    """`sampler(logits, seqs) -> tokens`: one token per row, keeping the `TokenCounts` of
    the penalised rows it sampled last."""

    def __init__(self, logits_hook: LogitsHook | None = None) -> None:
        self.logits_hook = logits_hook
        self._counts: dict[str, TokenCounts] = {}

    def argmax_only(self, seqs: Sequence[ScheduledSeq]) -> bool:
        """Whether sampling `seqs` is the plain argmax of their logits."""
        return self.chainable and all(
            s.params.greedy and not s.params.logit_bias and not _has_penalty(s)
            and s.params.logprobs is None for s in seqs)

    @property
    def chainable(self) -> bool:
        """Whether sampling may run before the host has the step's input tokens (a logits
        hook reads them)."""
        return self.logits_hook is None

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], *,
                 chained: bool = False) -> torch.Tensor:
        """Sample one token per row of `logits` [S, V] float32: [S] int64 on the same device.
        `chained`: the sequences' `history` lacks the newest token, so penalised rows use the
        counts the previous call left (RuntimeError if none)."""
        if len(seqs) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows for {len(seqs)} sequences")
        if self.logits_hook is not None:
            logits = self.logits_hook(logits, seqs)
        counts = self._take_counts(seqs, logits.shape[1], logits.device, chained)
        logits = apply_logit_bias(apply_penalties(logits.float(), seqs, counts), seqs)
        tokens = logits.argmax(dim=-1)
        if not all(s.params.greedy for s in seqs):
            probs = filtered_probs(logits, seqs)
            noise = exponential_noise(probs, seqs)
            sampled = (probs / noise).argmax(dim=-1)
            is_greedy = _to_device([s.params.greedy for s in seqs], torch.bool, logits.device)
            tokens = torch.where(is_greedy, tokens, sampled)
        for i, c in counts.items():
            c.add(tokens[i:i + 1])
        return tokens

    def _take_counts(self, seqs: Sequence[ScheduledSeq], vocab: int, device: torch.device,
                     chained: bool) -> dict[int, TokenCounts]:
        counts, kept = {}, {}
        for i, s in enumerate(seqs):
            if not _has_penalty(s):
                continue
            c = self._counts.get(s.request_id) if chained else None
            if c is None:
                if chained:
                    raise RuntimeError(f"request {s.request_id!r} was chained without the "
                                       "token counts of its previous step")
                c = TokenCounts.from_history(s, vocab, device)
            counts[i] = kept[s.request_id] = c
        self._counts = kept
        return counts


@dataclass
class TokenCounts:
    """A penalised sequence's tokens on the device: `seen` [V] bool (repetition penalty),
    `output` [V] float32 counts (presence / frequency), `one` a [1] 1.0 for `add`."""

    seen: torch.Tensor | None
    output: torch.Tensor | None
    one: torch.Tensor | None = None

    @classmethod
    def from_history(cls, seq: ScheduledSeq, vocab: int, device: torch.device) -> TokenCounts:
        p = seq.params
        seen = output = one = None
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if seq.history:  # NOTE: index_fill_, not seen[ids] = True (that synchronises)
                seen.index_fill_(0, _to_device(seq.history, torch.long, device), True)
        if p.presence_penalty or p.frequency_penalty:
            output = torch.zeros(vocab, device=device)
            one = torch.ones(1, device=device)
            if seq.num_generated:
                out = _to_device(seq.history[-seq.num_generated:], torch.long, device)
                output.index_add_(0, out, one.expand(len(out)))
        return cls(seen, output, one)

    def add(self, token: torch.Tensor) -> None:
        """Count one sampled token ([1] int64 on the device) as seen and generated."""
        if self.seen is not None:
            self.seen.index_fill_(0, token, True)
        if self.output is not None:
            self.output.index_add_(0, token, self.one)


def token_logprobs(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], tokens: torch.Tensor
                   ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor,
                              torch.Tensor] | None:
    """(rows asking for logprobs, their k, sampled tokens' logprobs [R], top ids [R, K], top
    logprobs [R, K]) on the device, or None; `logits` [S, V] before penalties, `tokens` [S]."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    ks = [seqs[i].params.logprobs for i in rows]
    index = _to_device(rows, torch.long, logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    top_lps, top_ids = lp.topk(max(ks), dim=-1)
    return rows, ks, chosen, top_ids, top_lps


def apply_penalties(logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
                    counts: dict[int, TokenCounts]) -> torch.Tensor:
    """Repetition (HF: divide positive logits, multiply negative ones), presence and
    frequency (OpenAI) penalties for the rows in `counts`."""
    if not counts:
        return logits
    logits = logits.clone()
    for i, c in counts.items():
        p, row = seqs[i].params, logits[i]
        if c.seen is not None:
            rp = p.repetition_penalty
            row.copy_(torch.where(c.seen, torch.where(row > 0, row / rp, row * rp), row))
        if c.output is not None:
            row -= p.frequency_penalty * c.output + p.presence_penalty * (c.output > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """Add each row's `logit_bias` (one index_put_ over the batch)."""
    entries = [(i, token, bias) for i, s in enumerate(seqs) for token, bias in s.params.logit_bias]
    if not entries:
        return logits
    rows, ids, biases = (list(c) for c in zip(*entries, strict=True))
    V = logits.shape[1]
    if max(ids) >= V:
        raise ValueError(f"logit_bias names token {max(ids)}, the vocabulary has {V}")
    index = _to_device([rows, ids], torch.long, logits.device)
    return logits.index_put((index[0], index[1]), _to_device(biases, logits.dtype,
                                                             logits.device), accumulate=True)


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without synchronising (`torch.tensor(..., device=)` waits)."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


def _has_penalty(s: ScheduledSeq) -> bool:
    p = s.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def filtered_probs(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """Softmax [S, V] at each row's temperature after top-k, top-p and min-p, not renormalised
    (the race does not need it)."""
    V = logits.shape[1]
    # One host-to-device copy: [S, 4] = temperature, top_k (V: off), top_p (2: off), min_p.
    rows = [(max(p.temperature, 1e-5), p.top_k if 0 < p.top_k < V else V,
             p.top_p if p.top_p < 1.0 else 2.0, p.min_p) for p in (s.params for s in seqs)]
    table = _to_device(rows, torch.float32, logits.device)
    temps, top_k, top_p, min_p = table[:, :, None].unbind(1)  # each [S, 1]
    probs = torch.softmax(logits / temps, dim=-1)  # [S, V]
    if any(r[1] < V or r[2] < 1.0 for r in rows):
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, V]
        rank = torch.arange(V, device=logits.device, dtype=torch.float32)[None, :]
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k) | (mass_before >= top_p)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if any(r[3] > 0.0 for r in rows):
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def exponential_noise(probs: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """Exp(1) noise [S, V]; rows of seeded requests from their own (seed, step) generator."""
    noise = torch.empty_like(probs).exponential_()
    for i, s in enumerate(seqs):
        if s.params.seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((s.params.seed * _SEED_STRIDE + s.num_generated) % (2**63))
            noise[i] = torch.empty_like(probs[i]).exponential_(generator=gen)
    # NOTE: a zero draw would divide by zero; probability 0 in practice, clamp anyway.
    return noise.clamp_min_(1e-20)
