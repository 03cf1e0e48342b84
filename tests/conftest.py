"""Shared fixtures and markers.

`requires_cuda` tests skip themselves on machines without a CUDA GPU. Data files come from
`../shared` beside the project root (never read by the shipped package).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TINYSERVE_SHARED", ROOT.parent / "shared"))

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in the interpreter. Set here, before any test module
    # is imported: `triton.jit` reads it when a kernel module is first imported (by whichever
    # test imports one first), not when the kernel runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is missing")
    return SHARED


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: `tiny_checkpoint(fmt="bf16", routing="uniform", **overrides) -> Path` of a tiny
    random checkpoint (tinyserve.testing.tiny.make_tiny_checkpoint; `routing="realistic"`:
    bench.routing.make_realistic_tiny_checkpoint), built once per arguments per session.
    Treat the directory as read-only."""
    import json

    from tinyserve.testing.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    cache: dict[str, Path] = {}

    def make(fmt: str = "bf16", routing: str = "uniform", **overrides) -> Path:
        key = json.dumps([fmt, routing, overrides], sort_keys=True, default=str)
        if key not in cache:
            maker = make_tiny_checkpoint
            if routing == "realistic":
                from bench.routing import make_realistic_tiny_checkpoint as maker
            cache[key] = maker(root / f"ckpt{len(cache)}-{fmt}", fmt=fmt, **overrides)
        return cache[key]

    return make
