"""The scheduler's per-request records: `Request` (bookkeeping of one request), `StepEvent`
(one sampled token handed back), `RequestRejected` (a request that can never fit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.core import SamplingParams, TokenLogprobs
from tinyserve.kv.prefix_cache import RadixNode


class RequestRejected(ValueError):
    """The request can never fit, whatever else is running. The numbers are attributes."""

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


@dataclass
class Request:
    """A request's bookkeeping. `tokens` = prompt + output; the KV cache and GDN state hold
    the first `num_computed` of them."""

    request_id: str
    prompt_len: int
    params: SamplingParams
    arrival: int
    tokens: list[int]
    group: str = ""  # requests of one group (an API request's choices) share seats fairly
    last_step: int = 0  # when it last took part in a step (the scheduler's counter)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    running: bool = False
    # after a failed shared step: run alone until this many tokens are computed (the end of
    # the failed step's chunk), so a request that breaks a step meets it alone and fails alone
    solo_until: int = 0
    num_preemptions: int = 0
    num_cached: int = 0  # prompt tokens reused from the prefix cache at the first admission
    snapshot_node: RadixNode | None = None  # this request's latest replaceable snapshot

    @property
    def solo(self) -> bool:
        return self.num_computed < self.solo_until

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def is_decode(self) -> bool:
        return self.num_computed > 0 and len(self.tokens) - self.num_computed == 1


@dataclass(frozen=True)
class StepEvent:
    """One sampled token of one request; `finish_reason` is set when it ended the request."""

    request_id: str
    token_id: int
    finish_reason: str | None
    cached_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # when the request asks for them
