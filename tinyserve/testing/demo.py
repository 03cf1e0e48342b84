"""The demo's checkpoint: a tiny random model (`tinyserve demo`, MODEL `demo` of the CLI)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tinyserve import envs
from tinyserve.testing.tiny import TINY_CONFIG_HD128, make_tiny_checkpoint

# Long enough for the README's examples (a tool call's prompt with its schema) and for
# `tinyserve bench demo` at its default lengths; head_dim 128, so `--kv iso3` runs too.
DEMO_CONTEXT = 8192
DEMO_CONFIG = {**TINY_CONFIG_HD128, "max_position_embeddings": DEMO_CONTEXT}
DEMO_NAME = "tinyserve-demo"  # the model id the demo serves


def _is_current(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(config.get(k) == v for k, v in DEMO_CONFIG.items())


def demo_checkpoint() -> Path:
    """The demo's checkpoint in TINYSERVE_CACHE_DIR, made on first use (and remade when an
    older tinyserve left one of another shape)."""
    path = envs.CACHE_DIR.get() / "demo-checkpoint"
    if _is_current(path):
        return path
    tmp = path.with_name(f"demo-checkpoint.tmp{os.getpid()}-{int(time.time())}")
    make_tiny_checkpoint(tmp, fmt="bf16", **DEMO_CONFIG)
    if path.exists() and not _is_current(path):
        old = path.with_name(f"demo-checkpoint.old{os.getpid()}-{int(time.time())}")
        try:
            path.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        except OSError:  # replaced by another process meanwhile
            pass
    try:
        tmp.rename(path)
    except OSError:  # made by another process meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return path
