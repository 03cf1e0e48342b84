"""`tinyserve quantize SRC DST`: a bf16 Qwen3.5-MoE checkpoint to NVFP4 (specs/nvfp4.md §3.3).

Weight-only; which linears, per recipe: `weight_format`; vision / MTP tensors are copied
unchanged. Output: safetensors shards (+ index), config.json with the format's
`quantization_config`, hf_quant_config.json for ModelOpt, the tokenizer and generation files.
The global scale is an fp32 value whose reciprocal round-trips, so both formats dequantize to
the same weights.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tinyserve.core import FP8Weight, NVFP4Weight
from tinyserve.kernels.nvfp4.ref import quantize_fp8, quantize_nvfp4
from tinyserve.log import get_logger
from tinyserve.model.config import load_config
from tinyserve.model.loader import INDEX_FILE, CheckpointReader, strip_prefix
from tinyserve.model.loader_plan import plan_weights

FORMATS = ("modelopt", "compressed-tensors")
RECIPES = ("nvfp4", "mixed")
_EXPERTS = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj$")
_SHARED = re.compile(r"mlp\.shared_expert\.(gate|up|down)_proj$")
_ATTN = re.compile(r"self_attn\.[qkvo]_proj$")
_GDN_BIG = re.compile(r"linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$")
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                 "added_tokens.json", "preprocessor_config.json")
log = get_logger(__name__)


class CheckpointWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes` (model.safetensors,
    or model-0000i-of-0000n.safetensors and an index). Raises ValueError when `path` already
    holds safetensors files, unless `overwrite` (then they and the index go first).
    """

    def __init__(self, path: str | Path, max_shard_bytes: int = 4 << 30, *,
                 overwrite: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        old = sorted(self.path.glob("*.safetensors")) + sorted(self.path.glob(INDEX_FILE))
        if old and not overwrite:
            raise ValueError(f"{self.path}: already holds a checkpoint ({old[0].name}); "
                             f"use an empty output directory")
        for f in old:
            f.unlink()
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = self.path / f"model-{len(self._shards) + 1:05d}.safetensors.tmp"
        save_file(self._pending, str(file), metadata={"format": "pt"})
        self._shards.append((file, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write what is pending, name the shards, write the index; returns the shard files."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        files, weight_map = [], {}
        for i, (tmp, names) in enumerate(self._shards, 1):
            final = self.path / ("model.safetensors" if n == 1
                                 else f"model-{i:05d}-of-{n:05d}.safetensors")
            tmp.replace(final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        if n > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
            (self.path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()


def weight_format(name: str, *, recipe: str = "nvfp4",
                  quantize_gdn: bool = False) -> str | None:
    """How the canonical linear `name` is stored under `recipe`: "nvfp4", "fp8" or None (bf16).
    "nvfp4": experts (routed, shared), self_attn q/k/v/o (+ GDN in_proj_qkv / in_proj_z /
    out_proj with `quantize_gdn`). "mixed" (ModelOpt MIXED_PRECISION, as
    nvidia/Qwen3.6-35B-A3B-NVFP4): experts and lm_head NVFP4, self_attn q/k/v/o and those GDN
    linears FP8 per-tensor.
    """
    if _EXPERTS.search(name) or _SHARED.search(name):
        return "nvfp4"
    if recipe == "mixed":
        if name == "lm_head":
            return "nvfp4"
        return "fp8" if _ATTN.search(name) or _GDN_BIG.search(name) else None
    if _ATTN.search(name) or (quantize_gdn and _GDN_BIG.search(name)):
        return "nvfp4"
    return None


def nvfp4_tensors(w: NVFP4Weight, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (param suffix -> tensor) of one NVFP4 linear in format `fmt`."""
    block = w.block_scale.view(torch.float8_e4m3fn)
    if fmt == "modelopt":
        return {"weight": w.packed, "weight_scale": block,
                "weight_scale_2": torch.tensor(w.global_scale, dtype=torch.float32)}
    inv = torch.tensor(1.0 / w.global_scale, dtype=torch.float32)
    return {"weight_packed": w.packed, "weight_scale": block,
            "weight_global_scale": inv.reshape(1)}


def fp8_tensors(w: FP8Weight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one per-tensor FP8 linear (ModelOpt names)."""
    return {"weight": w.weight.view(torch.float8_e4m3fn),
            "weight_scale": w.scale.to(torch.float32).reshape(())}


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str = "modelopt", *,
                        recipe: str = "nvfp4", quantize_gdn: bool = False,
                        max_shard_bytes: int = 4 << 30, device: str = "cpu",
                        overwrite: bool = False) -> Path:
    """Quantize the bf16 checkpoint `src` into `dst` (returned) in format `fmt` under `recipe`
    ("mixed": ModelOpt only), one tensor at a time; fused 3-D experts come out per expert.
    `device`: where the quantizer runs (bit-identical results). Raises ValueError for an
    unknown format or recipe or a quantized source, ConfigError / CheckpointError for a bad one.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (expected {' or '.join(FORMATS)})")
    if recipe not in RECIPES or (recipe == "mixed" and fmt != "modelopt"):
        raise ValueError(f"unknown recipe {recipe!r} for {fmt} (expected nvfp4"
                         f"{' or mixed' if fmt == 'modelopt' else ''})")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst}: the output directory must differ from the source")
    config = load_config(src)
    if config.quant.is_quantized:
        raise ValueError(f"{src / 'config.json'}: the source is already quantized "
                         f"({config.quant.method})")
    done: dict[str, str] = {}  # module -> "nvfp4" | "fp8"

    def add(module: str, name: str, w: torch.Tensor, writer: CheckpointWriter) -> bool:
        kind = weight_format(name, recipe=recipe, quantize_gdn=quantize_gdn)
        if kind is None:
            return False
        w = w.to(device)
        tensors = (nvfp4_tensors(quantize_nvfp4(w), fmt) if kind == "nvfp4"
                   else fp8_tensors(quantize_fp8(w)))
        for param, t in tensors.items():
            writer.add(f"{module}.{param}", t)
        done[module] = kind
        return True

    with (CheckpointReader(src) as reader,
          CheckpointWriter(dst, max_shard_bytes, overwrite=overwrite) as writer):
        every = plan_weights(reader, config)
        # a tied lm_head reads the embedding's tensor, which stays in the model dtype
        embed = next((p.raw["weight"] for p in every if p.name == "embed_tokens"), None)
        plans = {p.raw["weight"]: p for p in every
                 if p.kind in ("linear", "fused_gate_up", "fused_down")
                 and p.raw["weight"] != embed}
        for raw in reader.names():
            plan = plans.get(raw)  # every planned tensor has a prefix and a `.weight` name
            if plan is not None and plan.kind != "linear":
                # Fused 3-D experts [E, 2F, H] / [E, H, F] are written per expert.
                prefix = raw.removesuffix(strip_prefix(raw))
                dtype = reader.tensor_info(raw)[0]
                for name, w in plan.load(reader, dtype, torch.device("cpu")):
                    add(prefix + name, name, w.weight, writer)
                continue
            if plan is not None and add(raw.removesuffix(".weight"), plan.name, reader.get(raw),
                                        writer):
                continue
            t = reader.get(raw)
            if reader.info(raw).dtype == "F8_E4M3":
                t = t.view(torch.float8_e4m3fn)
            writer.add(raw, t)
    _write_configs(src, dst, fmt, recipe, done, quantize_gdn, config.layer_types)
    log.info("quantized %d linear layers of %s to %s (%s, %s)", len(done), src, dst, fmt, recipe)
    return dst


def _write_configs(src: Path, dst: Path, fmt: str, recipe: str, done: dict[str, str],
                   quantize_gdn: bool, layer_types: tuple[str, ...]) -> None:
    cfg: dict[str, Any] = json.loads((src / "config.json").read_text())
    nested = isinstance(cfg.get("text_config"), dict)
    lm = "model.language_model." if nested else "model."
    if fmt == "compressed-tensors":
        ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
                  "re:.*linear_attn.in_proj_[ab]$" if quantize_gdn else "re:.*linear_attn.*",
                  "re:.*embed_tokens$", "re:.*visual.*", "re:mtp.*"]
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                   "strategy": "tensor_group", "dynamic": False,
                   "scale_dtype": "torch.float8_e4m3fn"}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None, "format": None}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
        }
    else:
        exclude = [f"{lm}embed_tokens", "model.visual*", "mtp*"]
        exclude += [] if "lm_head" in done else ["lm_head"]
        for layer, kind in enumerate(layer_types):
            p = f"{lm}layers.{layer}."
            exclude += [f"{p}mlp.gate", f"{p}mlp.shared_expert_gate"]
            if kind == "linear_attention":
                quantized = quantize_gdn or recipe == "mixed"
                exclude += ([f"{p}linear_attn.in_proj_a", f"{p}linear_attn.in_proj_b",
                             f"{p}linear_attn.conv1d"] if quantized else [f"{p}linear_attn*"])
        producer = {"name": "modelopt", "version": "tinyserve"}
        if recipe == "mixed":
            layers = {re.sub(r"\.experts\.\d+\.(gate|up|down)_proj$", ".experts", module):
                      {"quant_algo": "FP8"} if kind == "fp8"
                      else {"quant_algo": "W4A16_NVFP4", "group_size": 16}
                      for module, kind in done.items()}
            algo, extra = "MIXED_PRECISION", {"quantized_layers": layers}
            quant: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None, **extra}
        else:
            group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
            algo = "NVFP4"
            extra = {"config_groups": {"group_0": {"weights": group, "targets": ["Linear"]}}}
            quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16}
        quant["exclude_modules"] = exclude
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo,
                                      "producer": producer, **extra, "ignore": exclude,
                                      "kv_cache_scheme": None}
        hf = {"producer": producer, "quantization": quant}
        (dst / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in _COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def quantize_command(args: Any) -> int:
    """CLI handler: `tinyserve quantize SRC DST --format FMT`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # bit-identical, much faster
    dst = quantize_checkpoint(args.src, args.dst, args.format, device=device)
    print(f"wrote {args.format} NVFP4 checkpoint to {dst}")
    return 0
