"""Realistic routing for random test checkpoints: skewed, temporally local expert choices.

A random router spreads tokens uniformly over the experts (the expert cache's worst case).
`RealisticRouting` builds the few tensors that make a random Qwen3.5-MoE checkpoint route like
a real one while it stays an ordinary checkpoint (calibration and design: docs/ROUTING.md).
The last R hidden channels are reserved (`ChannelLayout`): the embedding writes them (a
constant popularity carrier, the token's topic vector, its ±1 identity code), no layer writes
them (zero rows of o_proj, out_proj and every down_proj), the norms in front of the routers
weigh them 1 + 0, and each router reads only them:
    logit[e] = popularity * pop[l, e] + topic * <u[l, e], T> + token * <w[l, e], code>
so the routing is a function of the token sequence alone (`expected_topk`). The lm_head maps
each code to the next token of a fixed cycle, along which the topics are a smooth periodic
Gaussian process: greedy decoding walks the cycle, with a real model's locality.
`make_realistic_tiny_checkpoint` writes a tiny checkpoint that routes this way; `bench.fullsize`
a full-size one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinyserve.testing.tiny import make_tiny_checkpoint, tiny_text_config
from tinyserve.testing.tokenizer import special_token_ids

ROUTINGS = ("uniform", "realistic")  # the full-size checkpoint's `routing=` choices
ROUTING_FILE = "tinyserve_routing.json"  # written beside a checkpoint that routes this way
EMBED_SCALE = 0.02  # magnitude of the reserved embedding channels (the random ones' std)


@dataclass(frozen=True)
class RoutingProfile:
    """The statistics of the realistic router (docs/ROUTING.md for the calibration).

    Args:
        popularity: weight of the per-layer expert popularity (log-normal, sigma 1).
        topic: weight of the topic term (smooth along the generated text).
        token: weight of the per-token term (the token's identity code).
        slow_corr, fast_corr: token-to-token correlation of the topic's slow and fast parts.
        slow_share: variance share of the slow part.
    """

    popularity: float = 0.5
    topic: float = 1.8
    token: float = 1.0
    slow_corr: float = 0.96
    fast_corr: float = 0.5
    slow_share: float = 0.65

    def kernel(self, distance: np.ndarray) -> np.ndarray:
        """Topic correlation at a distance of `distance` tokens along the text."""
        return (self.slow_share * self.slow_corr ** distance
                + (1.0 - self.slow_share) * self.fast_corr ** distance)


REALISTIC = RoutingProfile()


@dataclass(frozen=True)
class ChannelLayout:
    """The reserved channels [hidden - reserved, hidden): `const`, then `topic`, then `token`."""

    hidden: int
    token_dims: int

    @property
    def reserved(self) -> slice:
        return slice(self.hidden - 2 * self.token_dims, self.hidden)

    @property
    def const(self) -> int:
        return self.hidden - 2 * self.token_dims

    @property
    def topic(self) -> slice:
        return slice(self.const + 1, self.hidden - self.token_dims)

    @property
    def token(self) -> slice:
        return slice(self.hidden - self.token_dims, self.hidden)


def channel_layout(hidden: int) -> ChannelLayout:
    """64 token channels (and 63 topic channels) for hidden >= 512, hidden / 8 below."""
    dims = 64 if hidden >= 512 else hidden // 8
    if dims < 4 or dims % 4:
        raise ValueError(f"hidden size {hidden} is too small for realistic routing")
    return ChannelLayout(hidden, dims)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 (as written), kept in float32."""
    return t.to(torch.bfloat16).to(torch.float32)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed, 0x5E7A, *key])


class RealisticRouting:
    """The routing design of one checkpoint (module docstring). Deterministic in `seed`.

    Args:
        hidden, num_experts, top_k, vocab_size: the model's sizes.
        text_tokens: the token ids greedy decoding may walk through (the tokenizer's regular
            tokens); the cycle takes all of them (random codes) when there are 32 token
            channels or more, else `token_dims` of them (orthogonal codes).
        profile: the statistics; seed: everything random.
    """

    def __init__(self, *, hidden: int, num_experts: int, top_k: int, vocab_size: int,
                 text_tokens: range | list[int], profile: RoutingProfile = REALISTIC,
                 seed: int = 0) -> None:
        self.layout = lay = channel_layout(hidden)
        self.num_experts, self.top_k, self.vocab_size = num_experts, top_k, vocab_size
        self.profile, self.seed = profile, seed
        # NOTE: one generator per part, so that the text, the codes and the topics do not
        # depend on the vocabulary size (tests shrink it) or on the number of layers.
        text = np.array(list(text_tokens), dtype=np.int64)
        D = lay.token_dims
        if D >= 32:  # random codes, checked below
            self.cycle = _rng(seed, 1).permutation(text)
            codes = _rng(seed, 2).choice(np.array([-1.0, 1.0]), size=(len(text), D))
        else:  # few channels: D tokens with orthogonal (Hadamard) codes
            self.cycle = _rng(seed, 1).permutation(text)[:D]
            codes = _hadamard(D)[_rng(seed, 2).permutation(D)]
        n = len(self.cycle)
        gram = codes @ codes.T
        np.fill_diagonal(gram, -np.inf)
        if gram.max() > 3 * D / 4 or n < 2:
            raise ValueError(f"cannot build a token cycle of {n} tokens on {D} channels")
        self.next_token = {int(a): int(b) for a, b in zip(self.cycle, np.roll(self.cycle, -1),
                                                          strict=True)}
        # The reserved embedding channels of every vocabulary row: a token off the cycle
        # borrows the code of a cycle token (so its greedy successor is unique) and draws its
        # topic from the stationary distribution.
        off = _rng(seed, 3)
        block = np.zeros((vocab_size, 2 * D), dtype=np.float32)
        block[:, 0] = 1.0
        code_of = off.integers(0, n, size=vocab_size)
        code_of[self.cycle] = np.arange(n)
        block[:, D:] = codes[code_of]
        block[:, 1:D] = off.standard_normal((vocab_size, D - 1), dtype=np.float32)
        block[self.cycle, 1:D] = _periodic_process(n, D - 1, profile, _rng(seed, 4))
        self.codes = codes  # [n, D], row p = code of cycle[p]
        self.embed_block = _bf16(torch.from_numpy(block * EMBED_SCALE))  # [V, R]

    # tensors to write
    @property
    def reserved(self) -> slice:
        return self.layout.reserved

    def router(self, layer: int) -> torch.Tensor:
        """`mlp.gate.weight` [E, H] float32 (bf16 values) of `layer`: reserved channels only."""
        lay, p, E = self.layout, self.profile, self.num_experts
        D = lay.token_dims
        rng = _rng(self.seed, 100 + layer)
        w = np.zeros((E, lay.hidden))
        w[:, lay.const] = p.popularity * rng.standard_normal(E)
        w[:, lay.topic] = p.topic * rng.standard_normal((E, D - 1)) / np.sqrt(D - 1)
        w[:, lay.token] = p.token * rng.standard_normal((E, D)) / np.sqrt(D)
        # NOTE: the logits are the profile's times EMBED_SCALE / rms(hidden) (<= ~1: the
        # random channels are as large as these), small enough that the fp32 softmax in front
        # of the top-k never underflows to ties.
        return _bf16(torch.from_numpy(w).float())

    def embedding(self, content: torch.Tensor) -> torch.Tensor:
        """The embedding table [V, H]: `content` (random, any float dtype) with the reserved
        channels replaced; a new tensor in content's dtype."""
        out = content.clone()
        out[:, self.reserved] = self.embed_block.to(out.dtype)
        return out

    def lm_head(self, rows: int) -> torch.Tensor:
        """The first `rows` rows [rows, H] float32 of lm_head: row next(t) holds t's code on
        the token channels, every other entry 0 (the rest of the vocabulary: zero rows)."""
        lay = self.layout
        out = torch.zeros(rows, lay.hidden)
        src = torch.from_numpy(self.codes).float()
        nxt = np.roll(self.cycle, -1)
        out[torch.from_numpy(nxt), lay.token] = src * EMBED_SCALE
        return out

    def manifest(self) -> dict:
        """What `ROUTING_FILE` records: the profile, the seed, the layout and the cycle."""
        lay = self.layout
        return {"routing": "realistic", "seed": self.seed, "profile": asdict(self.profile),
                "reserved_channels": [lay.reserved.start, lay.reserved.stop],
                "token_dims": lay.token_dims, "cycle": self.cycle.tolist()}

    # what the model does
    def text(self, start: int, n: int) -> list[int]:
        """The `n` tokens greedy decoding produces after token `start`."""
        first = self.next_token.get(start)
        if first is None:  # off the cycle: the successor of the code it borrows
            code = self.embed_block[start, self.layout.token_dims:].numpy()
            first = int(np.roll(self.cycle, -1)[int(np.argmax(self.codes @ code))])
        out = [first]
        while len(out) < n:
            out.append(self.next_token[out[-1]])
        return out

    def expected_topk(self, tokens: list[int] | np.ndarray, routers: list[torch.Tensor]
                      ) -> np.ndarray:
        """The experts [T, L, k] (descending logit) that `routers` (one [E, H] per layer)
        choose for `tokens` [T]."""
        return expected_topk(self.embed_block[np.asarray(tokens)], routers, self.reserved,
                             self.top_k)


def expected_topk(block: torch.Tensor, routers: list[torch.Tensor], reserved: slice,
                  top_k: int) -> np.ndarray:
    """Top-k experts [T, L, k] (descending logit) of the reserved embedding channels `block`
    [T, R] under `routers` ([E, H] each), computed in float64."""
    x = block.double()
    out = [torch.topk(x @ w[:, reserved].double().T, top_k, dim=-1).indices for w in routers]
    return torch.stack(out, dim=1).numpy()


def _periodic_process(n: int, dims: int, profile: RoutingProfile,
                      rng: np.random.Generator) -> np.ndarray:
    """`dims` independent stationary Gaussian processes [n, dims] on a ring of n points,
    unit variance, correlation `profile.kernel(ring distance)` (circulant embedding)."""
    d = np.arange(n)
    c = profile.kernel(np.minimum(d, n - d).astype(np.float64))
    lam = np.clip(np.fft.fft(c).real, 0.0, None)
    z = rng.standard_normal((dims, n))
    x = np.fft.ifft(np.sqrt(lam) * np.fft.fft(z, axis=1), axis=1).real
    return x.T / np.sqrt(c[0])


def _hadamard(n: int) -> np.ndarray:
    if n & (n - 1):
        raise ValueError(f"orthogonal codes need a power-of-two channel count, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def make_realistic_tiny_checkpoint(path: str | Path, *, fmt: str = "bf16", seed: int = 0,
                                   **config_overrides: Any) -> Path:
    """`make_tiny_checkpoint` with realistic routing: the routing is a function of the token
    sequence and greedy decoding walks a fixed cycle of tokens; the design's manifest is
    written to `ROUTING_FILE`. Raises ValueError for a tied lm_head."""
    text = tiny_text_config(**config_overrides)
    if text["tie_word_embeddings"]:
        raise ValueError("realistic routing needs an untied lm_head")
    design = _routing_design(text, seed)
    path = make_tiny_checkpoint(path, fmt=fmt, seed=seed, **config_overrides,
                                transform=lambda state: route_state_dict(state, design))
    (path / ROUTING_FILE).write_text(json.dumps(design.manifest()) + "\n")
    return path


def _routing_design(text: dict[str, Any], seed: int) -> RealisticRouting:
    return RealisticRouting(hidden=text["hidden_size"], num_experts=text["num_experts"],
                            top_k=text["num_experts_per_tok"], vocab_size=text["vocab_size"],
                            text_tokens=range(min(special_token_ids().values())), seed=seed)


# Tensors that write the residual stream (their rows at the routing channels become 0) and
# the norms in front of the routers and the lm_head (weight 0 there: a factor 1 + 0).
_WRITERS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight",
            "mlp.shared_expert.down_proj.weight")
_ROUTED_NORMS = ("post_attention_layernorm.weight", "model.norm.weight")


def route_state_dict(state: dict[str, torch.Tensor],
                     design: RealisticRouting) -> dict[str, torch.Tensor]:
    """`state` (HF names, fused experts) routing as `design` says."""
    res = design.reserved
    out = dict(state)
    for name, t in state.items():
        if name == "model.embed_tokens.weight":
            t = design.embedding(t)
        elif name.endswith("mlp.gate.weight"):
            t = design.router(int(name.split(".")[2])).to(t.dtype)
        elif name == "lm_head.weight":
            t = design.lm_head(len(t)).to(t.dtype)
        elif name.endswith(_WRITERS) or name.endswith(_ROUTED_NORMS):
            t = t.clone()
            t[res] = 0
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, F]
            t = t.clone()
            t[:, res] = 0
        out[name] = t
    return out
