"""The loading plan: which checkpoint tensors make each canonical weight, and how.

`plan_weights(reader, config)` matches the headers against the names and shapes the config
implies (specs/qwen35_moe.md §3-§4), takes each linear's storage from the tensors that exist
(`_layouts`) and returns one entry per canonical weight in file order. Any missing, extra,
misshapen or mistyped tensor raises CheckpointError.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyserve.core import DenseWeight, FP8Weight, LinearWeight, NVFP4Weight
from tinyserve.model.config import ModelConfig
from tinyserve.model.loader import (
    FLOAT_DTYPES,
    CheckpointError,
    CheckpointReader,
    parse_expert_name,
    strip_prefix,
)

_SCALAR = ((), (1,))
_E4M3_BITS = ("F8_E4M3", "U8")


def _layouts(out: int, inp: int) -> dict[str, dict[str, tuple[tuple, tuple[str, ...]]]]:
    """Storage of a linear [out, in] -> its checkpoint tensors -> (accepted shapes, dtypes)."""
    return {
        "dense": {"weight": (((out, inp),), FLOAT_DTYPES)},
        "fp8": {"weight": (((out, inp),), ("F8_E4M3",)),
                "weight_scale": ((*_SCALAR, (out, 1), (out,)), FLOAT_DTYPES)},
        "modelopt": {"weight": (((out, inp // 2),), ("U8",)),
                     "weight_scale": (((out, inp // 16),), _E4M3_BITS),
                     "weight_scale_2": (_SCALAR, FLOAT_DTYPES)},
        "compressed-tensors": {"weight_packed": (((out, inp // 2),), ("U8",)),
                               "weight_scale": (((out, inp // 16),), _E4M3_BITS),
                               "weight_global_scale": (_SCALAR, FLOAT_DTYPES)},
    }


_LINEAR_PARAMS = tuple(dict.fromkeys(p for layout in _layouts(1, 1).values() for p in layout))
_IGNORED_PARAMS = ("input_scale", "input_global_scale")
# Dropped silently: KV-cache quantization scales (own KV formats) and saved rotary tables.
_DROPPED = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", "rotary_emb.inv_freq")
# Same-input linears of a layer yielded as one (`model.linear.concat_rows`): fused name -> the
# canonical parts whose output rows it stacks, in this order.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
}
_FUSED_OF = {part: fused for fused, parts in FUSED_LINEARS.items() for part in parts}
_LAYER_RE = re.compile(r"^(layers\.\d+\.)(.+)$")


@dataclass
class WeightPlan:
    """One canonical weight (or a fused experts tensor yielding E of them)."""

    name: str
    kind: str  # "tensor" | "fp32" | "conv" | "linear" | "fused_gate_up" | "fused_down"
    raw: dict[str, str]  # param -> checkpoint tensor name
    shape: tuple[int, ...]  # [out, in] for linears, [2F, H] / [H, F] per expert when fused
    storage: str = "dense"  # "dense" | "modelopt" | "compressed-tensors" | "fp8"
    nbytes: int = 0  # bytes on disk, every tensor of the entry (ignored input scales too)
    order: tuple[int, int] = (0, 0)
    is_expert: bool = False
    num_experts: int = 0  # fused entries only

    def load(self, reader: CheckpointReader, dtype: torch.dtype,
             device: torch.device) -> Iterator[tuple[str, torch.Tensor | LinearWeight]]:
        if self.kind == "linear":
            yield self.name, _load_linear(reader, self.raw, self.storage, dtype, device)
        elif self.kind == "fused_gate_up":
            f = self.shape[0] // 2
            for e in range(self.num_experts):
                w = reader.get(self.raw["weight"], e)  # [2F, H]
                yield f"{self.name}.{e}.gate_proj", _dense(w[:f], dtype, device)
                yield f"{self.name}.{e}.up_proj", _dense(w[f:], dtype, device)
        elif self.kind == "fused_down":
            for e in range(self.num_experts):
                w = reader.get(self.raw["weight"], e)  # [H, F]
                yield f"{self.name}.{e}.down_proj", _dense(w, dtype, device)
        else:
            t = reader.get(self.raw["weight"])
            if self.kind == "conv":
                t = t.reshape(self.shape)
            yield self.name, t.to(device=device,
                                  dtype=torch.float32 if self.kind == "fp32" else dtype)


def _dense(w: torch.Tensor, dtype: torch.dtype, device: torch.device) -> DenseWeight:
    return DenseWeight(w.to(device=device, dtype=dtype).contiguous())


def _scalar(t: torch.Tensor) -> float:
    return float(t.to(torch.float32).reshape(-1)[0])


def _load_linear(reader: CheckpointReader, raw: dict[str, str], storage: str,
                 dtype: torch.dtype, device: torch.device) -> LinearWeight:
    if storage == "dense":
        return _dense(reader.get(raw["weight"]), dtype, device)
    if storage == "fp8":
        weight = reader.get(raw["weight"]).to(device)
        scale = reader.get(raw["weight_scale"]).to(device=device, dtype=torch.float32)
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
        return FP8Weight(weight=weight, scale=scale)
    if storage == "modelopt":
        packed, glob = reader.get(raw["weight"]), _scalar(reader.get(raw["weight_scale_2"]))
    else:  # compressed-tensors: W = E2M1 * block / weight_global_scale
        packed = reader.get(raw["weight_packed"])
        inv = _scalar(reader.get(raw["weight_global_scale"]))
        glob = float(torch.tensor(1.0 / inv, dtype=torch.float32)) if inv else 0.0
    block = reader.get(raw["weight_scale"])
    return NVFP4Weight(packed=packed.to(device), block_scale=block.to(device).view(torch.uint8),
                       global_scale=glob)


def fused_group(name: str) -> tuple[str, tuple[str, ...]] | None:
    """'layers.3.self_attn.k_proj' -> ('layers.3.self_attn.qkv_proj', its parts' names); None
    for a weight that no fused linear takes."""
    m = _LAYER_RE.match(name)
    fused = _FUSED_OF.get(m.group(2)) if m else None
    if fused is None:
        return None
    prefix = m.group(1)
    return prefix + fused, tuple(prefix + p for p in FUSED_LINEARS[fused])


def expected_weights(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical name -> (kind, shape) of every weight the config implies, per-expert names;
    kind: "tensor" (model dtype), "fp32", "conv" ([C, K]) or "linear" ([out, in])."""
    c, h = config, config.hidden_size
    out: dict[str, tuple[str, tuple[int, ...]]] = {"embed_tokens": ("tensor", (c.vocab_size, h))}
    for layer, kind in enumerate(c.layer_types):
        p = f"layers.{layer}."
        out[p + "input_layernorm"] = ("tensor", (h,))
        if kind == "linear_attention":
            a, hv, vd = p + "linear_attn.", c.linear_num_value_heads, c.linear_value_dim
            out[a + "in_proj_qkv"] = ("linear", (c.linear_conv_dim, h))
            out[a + "in_proj_z"] = ("linear", (vd, h))
            out[a + "in_proj_b"] = ("linear", (hv, h))
            out[a + "in_proj_a"] = ("linear", (hv, h))
            out[a + "conv1d"] = ("conv", (c.linear_conv_dim, c.linear_conv_kernel_dim))
            out[a + "A_log"] = ("fp32", (hv,))
            out[a + "dt_bias"] = ("fp32", (hv,))
            out[a + "norm"] = ("fp32", (c.linear_value_head_dim,))
            out[a + "out_proj"] = ("linear", (h, vd))
        else:
            a, qd = p + "self_attn.", c.num_attention_heads * c.head_dim
            out[a + "q_proj"] = ("linear", (2 * qd, h))
            out[a + "k_proj"] = ("linear", (c.num_kv_heads * c.head_dim, h))
            out[a + "v_proj"] = ("linear", (c.num_kv_heads * c.head_dim, h))
            out[a + "o_proj"] = ("linear", (h, qd))
            out[a + "q_norm"] = ("tensor", (c.head_dim,))
            out[a + "k_norm"] = ("tensor", (c.head_dim,))
        out[p + "post_attention_layernorm"] = ("tensor", (h,))
        m, f, fs = p + "mlp.", c.moe_intermediate_size, c.shared_expert_intermediate_size
        out[m + "gate"] = ("linear", (c.num_experts, h))
        for e in range(c.num_experts):
            out[f"{m}experts.{e}.gate_proj"] = ("linear", (f, h))
            out[f"{m}experts.{e}.up_proj"] = ("linear", (f, h))
            out[f"{m}experts.{e}.down_proj"] = ("linear", (h, f))
        out[m + "shared_expert.gate_proj"] = ("linear", (fs, h))
        out[m + "shared_expert.up_proj"] = ("linear", (fs, h))
        out[m + "shared_expert.down_proj"] = ("linear", (h, fs))
        out[m + "shared_expert_gate"] = ("linear", (1, h))
    out["norm"] = ("tensor", (h,))
    out["lm_head"] = ("linear", (c.vocab_size, h))
    return out


def plan_weights(reader: CheckpointReader, config: ModelConfig) -> list[WeightPlan]:
    """Match every checkpoint tensor to a canonical weight; entries in file order. Fused
    experts give two entries per layer (fused_gate_up, fused_down). Raises CheckpointError."""
    keys: dict[str, str] = {}  # name without prefix -> checkpoint name
    for raw in reader.names():
        key = strip_prefix(raw)
        if key is None or key.endswith(_DROPPED):
            continue
        if key in keys:
            raise CheckpointError(f"{reader.info(raw).file}: tensor '{raw}' duplicates "
                                  f"'{keys[key]}'")
        keys[key] = raw
    m = _Matcher(reader, keys, config)
    plans = m.match()
    if keys:
        raw = min(keys.values(), key=lambda r: (reader.info(r).file_index, reader.info(r).offset))
        raise CheckpointError(f"{reader.info(raw).file}: unexpected tensor '{raw}'")
    return sorted(plans, key=lambda p: p.order)


class _Matcher:
    def __init__(self, reader: CheckpointReader, keys: dict[str, str],
                 config: ModelConfig) -> None:
        self.reader, self.keys, self.config = reader, keys, config
        self.prefix = next((raw[: len(raw) - len(k)] for k, raw in keys.items()
                            if not k.startswith("lm_head.") and raw.endswith(k)), "model.")

    def match(self) -> list[WeightPlan]:
        c = self.config
        fused = {layer for layer in range(c.num_layers)
                 if f"layers.{layer}.mlp.experts.gate_up_proj" in self.keys
                 or f"layers.{layer}.mlp.experts.down_proj" in self.keys}
        plans = []
        for name, (kind, shape) in expected_weights(c).items():
            expert = parse_expert_name(name)
            if expert is not None and expert[0] in fused:
                continue
            if name == "lm_head" and c.tie_word_embeddings and "lm_head.weight" not in self.keys:
                embed = next(p for p in plans if p.name == "embed_tokens")
                plans.append(WeightPlan("lm_head", "linear", dict(embed.raw), shape,
                                        order=embed.order))
                continue
            plan = self._linear(name, shape) if kind == "linear" else self._tensor(name, kind,
                                                                                  shape)
            plan.is_expert = expert is not None
            plans.append(plan)
        f, h = c.moe_intermediate_size, c.hidden_size
        for layer in sorted(fused):
            base = f"layers.{layer}.mlp.experts"
            for kind, shape in (("fused_gate_up", (c.num_experts, 2 * f, h)),
                                ("fused_down", (c.num_experts, h, f))):
                key = f"{base}.{'gate_up_proj' if kind == 'fused_gate_up' else 'down_proj'}"
                raw = self._take(key)
                self._check(raw, (shape,), FLOAT_DTYPES)
                plans.append(WeightPlan(base, kind, {"weight": raw}, shape[1:], "dense",
                                        self._nbytes([raw]), self._order([raw]), True,
                                        c.num_experts))
        return plans

    def _take(self, key: str) -> str:
        raw = self.keys.pop(key, None)
        if raw is None:
            raise self._missing(key)
        return raw

    def _missing(self, key: str) -> CheckpointError:
        prefix = "" if key.startswith("lm_head.") else self.prefix
        return CheckpointError(f"{self.reader.path}: missing tensor '{prefix}{key}'")

    def _order(self, raws: list[str]) -> tuple[int, int]:
        return min((self.reader.info(r).file_index, self.reader.info(r).offset) for r in raws)

    def _nbytes(self, raws: list[str]) -> int:
        return sum(self.reader.info(r).nbytes for r in raws)

    def _check(self, raw: str, shapes: tuple[tuple[int, ...], ...],
               dtypes: tuple[str, ...]) -> None:
        """The tensor `raw` has one of `shapes` (the first is named when not) and `dtypes`."""
        t = self.reader.info(raw)
        if t.dtype not in dtypes:
            raise CheckpointError(f"{t.file}: tensor '{raw}' has dtype {t.dtype}, expected "
                                  f"{' or '.join(dtypes)}")
        if t.shape not in shapes:
            raise CheckpointError(f"{t.file}: tensor '{raw}' has shape {list(t.shape)}, "
                                  f"expected {list(shapes[0])}")

    def _tensor(self, name: str, kind: str, shape: tuple[int, ...]) -> WeightPlan:
        bare = name.endswith(("A_log", "dt_bias"))
        raw = self._take(name if bare else name + ".weight")
        shapes = (shape, (shape[0], 1, shape[1])) if kind == "conv" else (shape,)
        self._check(raw, shapes, FLOAT_DTYPES)
        return WeightPlan(name, kind, {"weight": raw}, shape, "dense", self._nbytes([raw]),
                          self._order([raw]))

    def _linear(self, name: str, shape: tuple[int, ...]) -> WeightPlan:
        params = {p: self.keys.pop(f"{name}.{p}") for p in _LINEAR_PARAMS + _IGNORED_PARAMS
                  if f"{name}.{p}" in self.keys}
        ignored = {p: params.pop(p) for p in _IGNORED_PARAMS if p in params}
        out, inp = shape
        if "weight_packed" in params:
            storage = "compressed-tensors"
        elif "weight" not in params:
            raise self._missing(name + ".weight")
        else:
            t = self.reader.info(params["weight"])
            storage = {"U8": "modelopt", "F8_E4M3": "fp8"}.get(
                t.dtype, "dense" if t.dtype in FLOAT_DTYPES else "")
            if not storage:
                raise CheckpointError(f"{t.file}: tensor '{params['weight']}' has dtype "
                                      f"{t.dtype}, expected BF16, F16 or F32 (dense), U8 "
                                      f"(NVFP4) or F8_E4M3 (FP8)")
        layout = _layouts(out, inp)[storage]
        for p in layout:
            if p not in params:
                raise self._missing(f"{name}.{p}")
        for p, raw in params.items():
            if p not in layout:
                raise CheckpointError(f"{self.reader.info(raw).file}: unexpected tensor "
                                      f"'{raw}' beside a {storage} weight")
        if storage in ("modelopt", "compressed-tensors") and inp % 16:
            raise CheckpointError(f"{self.reader.info(params['weight_scale']).file}: "
                                  f"NVFP4 tensor '{params['weight_scale']}' needs an input "
                                  f"dim divisible by 16, got {inp}")
        for p, (shapes, dtypes) in layout.items():
            self._check(params[p], shapes, dtypes)
        raws = list(params.values()) + list(ignored.values())
        return WeightPlan(name, "linear", params, shape, storage, self._nbytes(raws),
                          self._order(raws))
