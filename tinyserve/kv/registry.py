"""KV-backend registry: `--kv` choices come from here."""

from __future__ import annotations

import importlib
from typing import Any

from tinyserve.kv.base import KVBackend

# name -> (module:class, extra constructor kwargs). Modules load on first use.
_BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "bf16": ("tinyserve.kv.bf16:BF16KVBackend", {}),
    "iso3": ("tinyserve.kv.iso_pool:ISOKVBackend", {"fmt": "iso3"}),
    "iso4": ("tinyserve.kv.iso_pool:ISOKVBackend", {"fmt": "iso4"}),
}

KV_BACKEND_NAMES = tuple(_BACKENDS)
# `--kv` choices: a backend, or "auto" (`resolve_kv`)
KV_CHOICES = ("auto", *KV_BACKEND_NAMES)


def resolve_kv(name: str, head_dim: int, on_gpu: bool) -> str:
    """The backend `name` asks for: "auto" is iso3 on a GPU when head_dim is a multiple
    of the ISO block (128), else bf16 (on the CPU the ISO references dequantize every step)."""
    if name != "auto":
        return name
    return "iso3" if on_gpu and head_dim % 128 == 0 else "bf16"


def _backend(name: str) -> tuple[type[KVBackend], dict[str, Any]]:
    """The backend class for `name` and its fixed constructor kwargs."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV format {name!r}; choose one of {', '.join(_BACKENDS)}")
    target, kwargs = _BACKENDS[name]
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name), kwargs


def kv_bytes_per_token(name: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    cls, kwargs = _backend(name)
    return cls.bytes_per_token(num_layers, num_kv_heads, head_dim, **kwargs)


def create_kv_backend(name: str, **kwargs: Any) -> KVBackend:
    cls, fixed = _backend(name)
    return cls(**fixed, **kwargs)
