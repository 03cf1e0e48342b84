"""Qwen3.5-MoE model configuration: `ModelConfig` (defaults: Qwen3.5-35B-A3B) and
`load_config(path)`, which reads config.json (nested `text_config` or flat),
generation_config.json (extra EOS ids) and, for ModelOpt, hf_quant_config.json. Every problem
raises `ConfigError` with one sentence naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyserve.log import get_logger

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")
QUANT_METHODS = ("none", "modelopt", "compressed-tensors")
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "MIXED_PRECISION")
CT_FORMATS = ("nvfp4-pack-quantized", "float-quantized", "naive-quantized", "mixed-precision")

log = get_logger(__name__)


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """transformers' rule without `layer_types`: every `interval`-th layer is full attention."""
    return tuple("linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(num_layers))


class ConfigError(ValueError):
    """A checkpoint's configuration is missing, unsupported or impossible."""


@dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint says of its quantization (the loader trusts the tensors): `method`
    one of QUANT_METHODS, `algo` the ModelOpt quant_algo or compressed-tensors format."""

    method: str = "none"
    algo: str | None = None

    @property
    def is_quantized(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class ModelConfig:
    """Text-model hyperparameters of a Qwen3.5-MoE checkpoint (defaults: Qwen3.5-35B-A3B)."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_layers: int = 40
    layer_types: tuple[str, ...] = default_layer_types(40)
    num_attention_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (248044, 248046)
    model_type: str = "qwen3_5_moe_text"
    quant: QuantConfig = field(default_factory=QuantConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

        def fail(name: str, why: str) -> None:
            raise ConfigError(f"ModelConfig: field {name!r} {why}")

        for name in _INT_FIELDS:
            if getattr(self, name) < 1:
                fail(_HF_NAMES.get(name, name), f"must be >= 1, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries for "
                                f"num_hidden_layers={self.num_layers}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            fail("layer_types", f"has unknown layer type {bad[0]!r}")
        if self.num_attention_heads % self.num_kv_heads:
            fail("num_key_value_heads", f"({self.num_kv_heads}) must divide num_attention_heads "
                                        f"({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            fail("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple of "
                                           f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_experts_per_tok > self.num_experts:
            fail("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds num_experts "
                                        f"({self.num_experts})")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            fail("partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            fail("partial_rotary_factor", f"gives an odd or empty rotary dim {self.rotary_dim}")
        if self.rope_theta <= 0:
            fail("rope_theta", f"must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            fail("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            fail("eos_token_id", f"{list(self.eos_token_ids)} is outside the vocabulary "
                                 f"(vocab_size {self.vocab_size})")
        if self.quant.method not in QUANT_METHODS:
            fail("quant_method", f"{self.quant.method!r} is not supported")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN causal conv: q | k | v."""
        return 2 * self.linear_key_dim + self.linear_value_dim


# Integer fields of ModelConfig, read from config.json under the name in _HF_NAMES (or their
# own); those in _INT_DEFAULTS may be missing.
_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
               "head_dim", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "max_position_embeddings")
_INT_DEFAULTS = {"linear_conv_kernel_dim": 4, "max_position_embeddings": 262144}
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_kv_heads": "num_key_value_heads"}


def load_config(path: str | Path) -> ModelConfig:
    """A checkpoint directory's (or config.json file's) text-model configuration. Raises
    ConfigError for a missing or unreadable file, an unsupported model_type, a missing field or
    an impossible value."""
    path = Path(path)
    cfg_file = path if path.is_file() else path / "config.json"
    root = _read_json(cfg_file, required=True)
    text = root.get("text_config")
    where = f"{cfg_file}: text_config" if isinstance(text, dict) else str(cfg_file)
    if not isinstance(text, dict):
        text = root
    model_type = root.get("model_type", text.get("model_type"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{cfg_file}: model_type {model_type!r} is not supported "
                          f"(expected one of {', '.join(SUPPORTED_MODEL_TYPES)})")

    def get(name: str, default: Any = ...) -> Any:
        value = text.get(name, root.get(name, default))
        if value is ...:
            raise ConfigError(f"{where}: field {name!r} is missing")
        return value

    def number(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: field {name!r} must be a number, got {value!r}")
        return float(value)

    ints: dict[str, int] = {}
    for field_name in _INT_FIELDS:
        heads = ints.get("num_attention_heads")
        derived = {"num_kv_heads": heads, "head_dim": heads and ints["hidden_size"] // heads}
        name = _HF_NAMES.get(field_name, field_name)
        value = get(name, derived.get(field_name, _INT_DEFAULTS.get(field_name, ...)))
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: field {name!r} must be an integer, got {value!r}")
        ints[field_name] = value

    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = get("full_attention_interval", 4)
        if interval < 1:
            raise ConfigError(f"{where}: field 'full_attention_interval' must be >= 1")
        layer_types = list(default_layer_types(ints["num_layers"], interval))
    if not isinstance(layer_types, list):
        raise ConfigError(f"{where}: field 'layer_types' must be a list")

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: field 'rope_parameters' must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        log.warning("%s: rope_type %r is not supported; using default RoPE (exact within "
                    "max_position_embeddings)", where, rope_type)
    try:
        return ModelConfig(
            **ints, layer_types=tuple(layer_types),
            rope_theta=number("rope_theta", rope.get("rope_theta", get("rope_theta", 10000.0))),
            partial_rotary_factor=number("partial_rotary_factor", rope.get(
                "partial_rotary_factor", get("partial_rotary_factor", 0.25))),
            rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(root.get("tie_word_embeddings",
                                              text.get("tie_word_embeddings", False))),
            eos_token_ids=_eos_ids(cfg_file, root, text),
            model_type=str(text.get("model_type", model_type)),
            quant=_quant_config(cfg_file, root.get("quantization_config")
                                or text.get("quantization_config")))
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("ModelConfig:", f"{where}:", 1)) from None


def _read_json(file: Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ConfigError(f"{file}: file not found")
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a JSON object")
    return data


def _eos_ids(cfg_file: Path, root: dict[str, Any], text: dict[str, Any]) -> tuple[int, ...]:
    """The union, in order, of the text config's, the top level's and generation_config.json's."""
    gen_file = cfg_file.parent / "generation_config.json"
    found = [(cfg_file, text.get("eos_token_id")),
             (cfg_file, root.get("eos_token_id") if text is not root else None),
             (gen_file, _read_json(gen_file, required=False).get("eos_token_id"))]
    ids: list[int] = []
    for file, value in found:
        value = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ConfigError(f"{file}: field 'eos_token_id' must be an integer or a list of "
                              f"integers")
        ids += value
    return tuple(dict.fromkeys(ids))


def _quant_config(cfg_file: Path, q: dict[str, Any] | None) -> QuantConfig:
    if not q:
        return QuantConfig()
    method = q.get("quant_method")
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt is not None and fmt not in CT_FORMATS:
            raise ConfigError(f"{cfg_file}: quantization_config.format {fmt!r} is not supported "
                              f"(expected one of {', '.join(CT_FORMATS)})")
        return QuantConfig(method=method, algo=fmt)
    if method != "modelopt":
        raise ConfigError(f"{cfg_file}: quantization_config.quant_method {method!r} is not "
                          f"supported (expected modelopt or compressed-tensors)")
    hf_file = cfg_file.parent / "hf_quant_config.json"
    hf = _read_json(hf_file, required=False).get("quantization") or {}
    algo = hf.get("quant_algo", q.get("quant_algo"))
    if algo is not None and algo not in MODELOPT_ALGOS:  # None: the tensors will tell
        src = hf_file if "quant_algo" in hf else cfg_file
        raise ConfigError(f"{src}: quant_algo {algo!r} is not supported "
                          f"(expected one of {', '.join(MODELOPT_ALGOS)})")
    return QuantConfig(method=method, algo=algo)
