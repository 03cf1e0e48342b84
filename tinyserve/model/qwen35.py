"""The Qwen3.5-MoE text model over canonical weights, batched over varlen sequences.

`forward(ctx)`: embedding -> layers [GDN | gated attention] + MoE -> final norm -> lm_head for
the rows `ctx.logits_indices`, prefill chunks and decode tokens mixed. The embedding is a
separate first stage (`embed`): a captured decode graph starts after it when the table lives
on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import DenseWeight, ForwardContext, LinearWeight
from tinyserve.kernels.moe.host_rows import gather_rows, register_mapped
from tinyserve.model.attention import GatedAttention
from tinyserve.model.experts_api import ExpertsProvider
from tinyserve.model.gdn import GatedDeltaNet
from tinyserve.model.linear import linear, to_device
from tinyserve.model.moe import ResidentExperts, SparseMoE
from tinyserve.model.norm import add_rms_norm, rms_norm
from tinyserve.model.rope import PartialRoPE

# Tensors kept in fp32 whatever the model dtype (GDN decay parameters; spec loader rule 5).
_FP32_SUFFIXES = (".linear_attn.A_log", ".linear_attn.dt_bias", ".linear_attn.norm")


class Qwen35Model:
    """Qwen3.5-MoE forward over canonical weights (name -> Tensor or LinearWeight; routed
    experts may be absent when an `experts` provider is given, default `ResidentExperts`).
    `kv`: the KV backend (`kv.base.KVBackend`); `states`: the GDN state pool. `embed_device`:
    where `embed_tokens` lives (default `device`; ignored when tied); "cpu" keeps it in host
    RAM, registered with CUDA when it can be (`embed_mapped`).
    """

    def __init__(self, config: Any, weights: dict[str, Any], *, kv: Any, states: Any,
                 experts: ExpertsProvider | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32,
                 embed_device: torch.device | str | None = None) -> None:
        self.config, self.kv, self.states, self.dtype = config, kv, states, dtype
        self.device = torch.device(device)
        self.embed_device = torch.device(
            embed_device if embed_device is not None and not config.tie_word_embeddings
            else self.device)
        # NOTE: with an experts provider given, routed-expert weights stay where they are (an
        # offloaded provider keeps them in host memory); only the rest moves to the device.
        w = {name: self._place(name, t) for name, t in weights.items()
             if name != "embed_tokens" and (experts is None or ".mlp.experts." not in name)}
        w["embed_tokens"] = weights["embed_tokens"].to(device=self.embed_device, dtype=dtype)
        self.embed_tokens: torch.Tensor = w["embed_tokens"]
        self.embed_mapped = False  # the host table is device-addressable (zero-copy gather)
        if self.embed_on_host and self.device.type == "cuda":
            # NOTE: its own memory (a loaded tensor may map the checkpoint file)
            self.embed_tokens = self.embed_tokens.clone(memory_format=torch.contiguous_format)
            self.embed_mapped = register_mapped(self.embed_tokens, "embedding table")
        self.norm: torch.Tensor = w["norm"]
        self.lm_head: LinearWeight = w.get("lm_head") or DenseWeight(self.embed_tokens)
        if experts is None:
            experts = ResidentExperts(w, config, range(config.num_layers))
        self.experts = experts
        self.rope = PartialRoPE(config.head_dim, config.rotary_dim, config.rope_theta,
                                self.device)
        self.layers = [_Layer(L, config, w, self.rope, experts)
                       for L in range(config.num_layers)]

    def _place(self, name: str, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            dtype = torch.float32 if name.endswith(_FP32_SUFFIXES) else self.dtype
            return t.to(device=self.device, dtype=dtype)
        return to_device(t, self.device, self.dtype)

    @property
    def embed_on_host(self) -> bool:  # in host RAM while the model runs on a device
        return self.embed_device.type == "cpu" and self.device.type != "cpu"

    @property
    def embed_needs_host_ids(self) -> bool:
        """A host table the device cannot read: a decode step cannot start from ids there."""
        return self.embed_on_host and not self.embed_mapped

    def embed_host(self, input_ids: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Rows [N, H] (model dtype) of the embedding table on its own device, gathered into
        `out` when given (e.g. a pinned staging buffer). `input_ids` [N] int64 on that device."""
        return torch.index_select(self.embed_tokens, 0, input_ids, out=out)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [N, H] on the model's device for token ids [N] int64. A host table
        is read by a device kernel when `embed_mapped`, else gathered on the host into pinned
        memory (ids on the device cost a synchronisation first)."""
        if not self.embed_on_host:
            return self.embed_tokens[input_ids.to(self.device, non_blocking=True)]
        if self.embed_mapped:
            return gather_rows(self.embed_tokens, input_ids.to(self.device, non_blocking=True))
        ids = input_ids.to(self.embed_device)
        rows = torch.empty((ids.shape[0], self.embed_tokens.shape[1]), dtype=self.dtype,
                           pin_memory=self.device.type == "cuda")
        # NOTE: the pinned block goes back to torch's host allocator, which reuses it only
        # after the copy below has finished.
        return self.embed_host(ids, out=rows).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, V] float32 for the rows `ctx.logits_indices` of the N new tokens.
        `hidden` [N, H]: the embedded tokens (read only); None embeds `ctx.input_ids`."""
        if hidden is None:
            host_ids = ctx.input_ids_cpu if self.embed_needs_host_ids else None
            hidden = self.embed(host_ids if host_ids is not None else ctx.input_ids)
        x, h = hidden, None  # the residual stream [N, H] and the pending MoE output
        cos_sin = self.rope.cos_sin(ctx.positions, self.dtype)
        for layer in self.layers:
            x, h = layer.forward(x, h, ctx, self.kv, self.states, cos_sin)
        rows = ctx.logits_indices  # [S]
        x, _ = add_rms_norm(h[rows], x[rows], self.norm, self.config.rms_norm_eps)
        return linear(x, self.lm_head).float()


class _Layer:
    """Decoder layer: x += Mixer(norm(x)); x += MoE(norm(x)) (the second add is fused into the
    next norm, see `forward`)."""

    def __init__(self, L: int, config: Any, w: dict[str, Any], rope: PartialRoPE,
                 experts: ExpertsProvider) -> None:
        p = f"layers.{L}."
        self.eps = config.rms_norm_eps
        self.input_layernorm = w[p + "input_layernorm"]
        self.post_attention_layernorm = w[p + "post_attention_layernorm"]
        self.is_attention = config.layer_types[L] == "full_attention"
        if self.is_attention:
            self.mixer: Any = GatedAttention(L, config, _sub(w, p + "self_attn."), rope)
        else:
            self.mixer = GatedDeltaNet(L, config, _sub(w, p + "linear_attn."))
        self.mlp = SparseMoE(L, config, _sub(w, p + "mlp."), experts)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, ctx: ForwardContext,
                kv: Any, states: Any, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MoE output): the caller adds the MoE output to
        the stream in the next layer's fused add + norm (`pending` is the previous layer's,
        None for the first layer)."""
        if pending is None:
            h = rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, x = add_rms_norm(pending, x, self.input_layernorm, self.eps)
        if self.is_attention:
            h = self.mixer.forward(h, ctx, kv, cos_sin)
        else:
            h = self.mixer.forward(h, ctx, states)
        h, x = add_rms_norm(h, x, self.post_attention_layernorm, self.eps)
        return x, self.mlp.forward(h)


def _sub(w: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under `prefix`, with the prefix stripped (experts excluded)."""
    return {k[len(prefix):]: v for k, v in w.items()
            if k.startswith(prefix) and ".experts." not in k}
