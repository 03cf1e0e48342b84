"""The tiny model with the decode-layer glue kernels forced on (norms, norm + RoPE, attention
gate, router, shared-expert glue and concatenated weights; the Triton interpreter on the CPU)
against the same model with the glue on the torch references: the wiring of every call site.

fp32, so the two agree to fp32 rounding: logits within 1e-4 of the logit scale. Prefill in one
chunk, in chunks of 3 (a prefix in the KV pages and GDN states) and token by token (the decode
path of GDN and attention; slow in the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_norm import interpreter_ok, run_in_interpreter_child  # noqa: F401
from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.model import attention, moe, norm, rope

pytestmark = pytest.mark.gpu_shapes

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GLUE_MODULES = (norm, moe, rope, attention)


def _force(monkeypatch, on: bool) -> None:
    # only the glue switches; on a GPU the other kernels (GDN, NVFP4, fused MoE) stay on
    for mod in GLUE_MODULES:
        monkeypatch.setattr(mod, "kernels_enabled", lambda device, on=on: on)


def test_kernels_in_interpreter_child() -> None:
    run_in_interpreter_child(__file__)


@pytest.mark.usefixtures("interpreter_ok")
@pytest.mark.parametrize("geometry,chunk", [
    ("tiny", None), ("hd128", 3),
    pytest.param("tiny", 1, marks=pytest.mark.slow),
    pytest.param("hd128", None, marks=pytest.mark.slow)],
    ids=["tiny-prefill", "hd128-chunks3", "tiny-token_by_token", "hd128-prefill"])
def test_glue_kernels_match_torch(geometry: str, chunk: int | None, monkeypatch) -> None:
    pytest.importorskip("triton")
    cfg, w = checkpoint("bf16", geometry)
    ids = torch.randint(0, 500, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    _force(monkeypatch, False)
    ref = build_runner(cfg, w, device=DEV).logits(ids, chunk_size=chunk)
    _force(monkeypatch, True)
    runner = build_runner(cfg, w, device=DEV)
    mlp = runner.model.layers[0].mlp
    assert mlp.gate_up is not None and mlp.router_gate is not None
    got = runner.logits(ids, chunk_size=chunk)
    assert torch.isfinite(got).all()
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * scale
