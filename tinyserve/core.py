"""Plain data shared by every layer of tinyserve: the contracts between the packages.

`SamplingParams` (a request's sampling), `ScheduledSeq` / `Batch` / `ForwardOutput`
(scheduler <-> runner), `ForwardContext` (the per-forward tensors every layer reads) and
`DenseWeight` / `NVFP4Weight` / `FP8Weight` (how one linear layer's weight is stored).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's logprob and the `top` most likely (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (temperature 0: greedy). Raises ParamError
    naming the field when a value is out of range."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    # token id -> a bias in [-100, 100] added to its logit before sampling (after the
    # penalties): -100 bans a token, +100 all but forces it. Kept as sorted (id, bias) pairs.
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    # None: no log-probabilities; k in 0..20: each sampled token's log-probability under the
    # model (its logits before penalties, bias and temperature) and the k most likely tokens'
    logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop or ()
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias or ()
        pairs = list(bias.items() if isinstance(bias, Mapping) else bias)
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t, _ in pairs), "logit_bias", "keys must be token ids (integers >= 0)")
        _check(all(isinstance(b, int | float) and not isinstance(b, bool)
                   and -100.0 <= b <= 100.0 for _, b in pairs),
               "logit_bias", "values must be numbers in [-100, 100]")
        _check(len({t for t, _ in pairs}) == len(pairs), "logit_bias",
               "lists a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
               "logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               "must be an integer >= 1")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               "must be an integer >= 0 (0 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
               "must be in (0, 10]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class ParamError(ValueError):
    """A request parameter is out of range. `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


PENDING_TOKEN = -1  # a decode input still on the device (see ScheduledSeq)


@dataclass
class ScheduledSeq:
    """One sequence's share of a forward step: `token_ids` (a prefill chunk or the last
    sampled token) after the `start_pos` tokens the KV cache and GDN state hold; `page_ids`
    cover them all. `sample`: sample a token after this chunk. `history`: prompt + output so
    far (penalties). `[PENDING_TOKEN]`: a chained decode whose input the runner reads from the
    previous step's output on the device (`Scheduler.schedule_next`).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    state_slot: int
    sample: bool
    params: SamplingParams = field(default_factory=SamplingParams)
    history: list[int] = field(default_factory=list)
    num_generated: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Batch:
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_decode(self) -> bool:
        return all(s.num_tokens == 1 and s.start_pos > 0 for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class ForwardOutput:
    """One sampled token per sequence in batch order (None where `sample` is False);
    `logits` for tests and LLM.logits."""

    next_tokens: list[int | None]
    logits: torch.Tensor | None = None
    # per sequence, for those whose params ask for logprobs (else None); None: nobody did
    logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class ForwardContext:
    """One forward over B sequences and N new tokens: index tensors on the model's device,
    host copies (`*_cpu`) for host loops without a synchronisation."""

    input_ids: torch.Tensor  # [N] int64, new tokens of all sequences, batch order
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    cu_seqlens: torch.Tensor  # [B+1] int32, offsets of each sequence's tokens in [N]
    prefix_lens: torch.Tensor  # [B] int32, tokens cached before this forward
    seq_lens: torch.Tensor  # [B] int32, prefix + new
    page_table: torch.Tensor  # [B, max_pages] int32, page ids of each sequence (0-padded)
    slot_mapping: torch.Tensor  # [N] int64, KV slot (page * page_size + offset) per new token
    state_slots: torch.Tensor  # [B] int64, GDN state slot per sequence
    logits_indices: torch.Tensor  # [S] int64, rows of [N] whose logits are wanted
    page_size: int
    q_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    # Host upper bound of seq_lens that decode attention sizes its work by. None: exact, from
    # the host lists. A captured decode graph sets its capacity here, and its host lists are
    # placeholders then (decode kernels read only the tensors and this bound).
    max_seq_len: int | None = None
    # [N] int64 host copy of input_ids (None: none kept): a host embedding table gathers its
    # rows from it without a device -> host synchronisation.
    input_ids_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def seq_len_bound(self) -> int:
        """`max_seq_len`, or max(prefix + new) over the sequences when it is None."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return max((p + q for p, q in zip(self.prefix_lens_cpu, self.q_lens_cpu, strict=True)),
                   default=0)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_cpu) and all(p > 0 for p in self.prefix_lens_cpu)


# Weights of one linear layer (y = x @ W.T, W is [out, in])
@dataclass
class DenseWeight:
    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]


@dataclass
class NVFP4Weight:
    """NVFP4: `packed` uint8 [out, in/2] E2M1 codes (low nibble = even input), `block_scale`
    uint8 [out, in/16] raw E4M3 bits, `global_scale` a float in the ModelOpt (multiply)
    convention: W = E2M1[code] * e4m3(block_scale) * global_scale (compressed-tensors is
    folded to it at load: 1 / weight_global_scale).
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: float

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)


@dataclass
class FP8Weight:
    """FP8 E4M3 weight [out, in] (uint8 bits) with a per-tensor scalar or per-row [out, 1] scale."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]


LinearWeight = DenseWeight | NVFP4Weight | FP8Weight
