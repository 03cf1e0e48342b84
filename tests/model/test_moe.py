"""SparseMoE with its fused weights and glue kernels against the plain torch block.

The whole block with the kernels forced on (the Triton interpreter on the CPU, tiny sizes) and
on a GPU at the 35B-A3B sizes (H 2048, 256 experts, top-8, F 512) against the same block with
the kernels off. (`concat_rows`, which the block uses, is tested in test_fused_linears.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.test_norm import interpreter_ok, run_in_interpreter_child  # noqa: F401
from tinyserve.core import DenseWeight
from tinyserve.kernels.nvfp4.ref import quantize_nvfp4
from tinyserve.model import moe
from tinyserve.model.experts_api import ExpertsProvider

pytestmark = pytest.mark.gpu_shapes

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _w(o: int, i: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(o, i, generator=g) / i**0.5).to(device)


class _TorchExperts(ExpertsProvider):
    """Routed experts as the plain torch loop (the provider interface)."""

    def __init__(self, experts) -> None:
        self.experts = experts

    def forward(self, layer_id, x, ids, weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                g, u, d = self.experts[int(ids[t, j])]
                y = moe.swiglu_mlp(x[t:t + 1], g, u, d)
                out[t:t + 1] += (y * weights[t, j]).to(x.dtype)
        return out


def _block(h: int, f: int, e: int, k: int, dtype: torch.dtype, fuse: bool, monkeypatch):
    cfg = SimpleNamespace(num_experts_per_tok=k, num_experts=e)
    dense = lambda o, i, s: DenseWeight(_w(o, i, s, DEV).to(dtype))  # noqa: E731
    w = {"gate": dense(e, h, 10), "shared_expert_gate": dense(1, h, 11),
         "shared_expert.gate_proj": dense(f, h, 12), "shared_expert.up_proj": dense(f, h, 13),
         "shared_expert.down_proj": dense(h, f, 14)}
    experts = _TorchExperts([(dense(f, h, 100 + i), dense(f, h, 200 + i), dense(h, f, 300 + i))
                             for i in range(e)])
    # the glue only (on the CPU the interpreter runs the kernels)
    monkeypatch.setattr(moe, "kernels_enabled", lambda device: fuse)
    return moe.SparseMoE(0, cfg, w, experts)


def _run(block, x, fuse: bool, monkeypatch):
    monkeypatch.setattr(moe, "kernels_enabled", lambda device: fuse)
    return block.forward(x)


def test_kernels_in_interpreter_child() -> None:
    run_in_interpreter_child(__file__)


@pytest.mark.usefixtures("interpreter_ok")
@pytest.mark.parametrize("n", [1, 3], ids=lambda n: f"N{n}")
def test_sparse_moe_fused_matches_torch_fp32(n: int, monkeypatch) -> None:
    pytest.importorskip("triton")
    h, f, e, k = (64, 32, 8, 2) if DEV == "cpu" else (2048, 512, 256, 8)
    fused = _block(h, f, e, k, torch.float32, True, monkeypatch)
    assert fused.gate_up.fused is not None and fused.router_gate.fused is not None
    plain = _block(h, f, e, k, torch.float32, False, monkeypatch)
    assert plain.gate_up.fused is None and plain.router_gate.fused is None
    x = torch.randn(n, h, device=DEV)
    ref = _run(plain, x, False, monkeypatch)
    got = _run(fused, x, True, monkeypatch)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("n", [8], ids=lambda n: f"N{n}")
def test_sparse_moe_fused_matches_torch_bf16_cuda(n: int, monkeypatch) -> None:
    # bf16 logits may tie or flip near the 8th expert: median per-token error only
    fused = _block(2048, 512, 256, 8, torch.bfloat16, True, monkeypatch)
    plain = _block(2048, 512, 256, 8, torch.bfloat16, False, monkeypatch)
    x = torch.randn(n, 2048, device=DEV).bfloat16()
    ref = _run(plain, x, False, monkeypatch).float()
    got = _run(fused, x, True, monkeypatch).float()
    assert torch.isfinite(got).all()
    per_token = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_token.median().item() < 2e-2, per_token.tolist()


# --- the NVFP4 shared expert in the CUDA MoE decode ---------------------------------------


def _nvfp4_block(h: int, f: int, e: int, k: int, dtype: torch.dtype, fuse: bool, tied: bool,
                 monkeypatch):
    """SparseMoE with NVFP4 routed and shared experts: fused = kernels on and the resident
    provider's fused MoE (the shared expert rides along); plain = the torch block. `tied`:
    the shared gate and up share one global scale (one gate_up GEMV outside the launch)."""
    cfg = SimpleNamespace(num_experts_per_tok=k, num_experts=e)
    q = lambda o, i, s: quantize_nvfp4(_w(o, i, s, DEV))  # noqa: E731
    w = {"gate": DenseWeight(_w(e, h, 10, DEV).to(dtype)),
         "shared_expert_gate": DenseWeight(_w(1, h, 11, DEV).to(dtype)),
         "shared_expert.gate_proj": q(f, h, 12), "shared_expert.up_proj": q(f, h, 13),
         "shared_expert.down_proj": q(h, f, 14)}
    if tied:
        w["shared_expert.up_proj"].global_scale = w["shared_expert.gate_proj"].global_scale
    routed = [(q(f, h, 100 + i), q(f, h, 200 + i), q(h, f, 300 + i)) for i in range(e)]
    monkeypatch.setattr(moe, "kernels_enabled", lambda device: fuse)
    if fuse:
        names = {f"layers.0.mlp.experts.{i}.{p}_proj": wt for i, ex in enumerate(routed)
                 for p, wt in zip(("gate", "up", "down"), ex, strict=True)}
        experts = moe.ResidentExperts(names, SimpleNamespace(num_experts=e), [0],
                                      use_kernel=True)
    else:
        experts = _TorchExperts(routed)
    return moe.SparseMoE(0, cfg, w, experts)


@pytest.mark.usefixtures("interpreter_ok")
@pytest.mark.parametrize(("n", "tied"), [(1, True), (3, False)], ids=["N1-tied", "N3"])
def test_sparse_moe_shared_in_fused_launch(n: int, tied: bool, monkeypatch) -> None:
    pytest.importorskip("triton")
    from tinyserve.kernels.moe import fused as fm

    h, f, e, k = (64, 32, 8, 2) if DEV == "cpu" else (2048, 512, 256, 8)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    fused = _nvfp4_block(h, f, e, k, dtype, True, tied, monkeypatch)
    assert fused.shared_slots is not None and (fused.gate_up.fused is not None) == tied
    plain = _nvfp4_block(h, f, e, k, dtype, False, tied, monkeypatch)
    assert plain.shared_slots is None
    n = n if DEV == "cpu" else 8  # GPU: a full decode bucket (the median token is checked)
    x = torch.randn(n, h, device=DEV).to(dtype)
    ref = _run(plain, x, False, monkeypatch).float()
    launches = []  # the shared slots each CUDA decode call got (its 6th argument)
    decode = fm.nvfp4_cuda.moe_decode
    if DEV == "cpu":  # the CUDA decode's contract, through the reference
        monkeypatch.setattr(fm.nvfp4_cuda, "moe_takes", lambda *a: True)

        def decode(x, ids, wts, topk, slots, shared, logit, out_dtype):
            return fm.fused_moe_ref(x, ids.view(-1, topk), wts.view(-1, topk), slots,
                                    shared_slots=shared, shared_logit=logit,
                                    out_dtype=out_dtype)

    monkeypatch.setattr(fm.nvfp4_cuda, "moe_decode",
                        lambda *a: launches.append(a[5]) or decode(*a))
    got = _run(fused, x, True, monkeypatch).float()
    assert launches == [fused.shared_slots]  # routed + shared: one CUDA decode
    # more tokens than the CUDA decode takes: separate shared GEMVs over the slot's bytes
    xs = torch.randn(fm.FUSED_MAX_TOKENS + 1, h, device=DEV).to(dtype)
    unfused = _run(fused, xs, True, monkeypatch).float()
    assert len(launches) == 1
    ref_xs = _run(plain, xs, False, monkeypatch).float()
    for y, want in ((got, ref), (unfused, ref_xs)):
        assert torch.isfinite(y).all()
        per_token = (y - want).norm(dim=-1) / want.norm(dim=-1)
        # NOTE: on the GPU bf16 router logits (one [E + 1, H] GEMM vs two) may flip an 8th
        # expert: the median token only
        worst = per_token.max() if DEV == "cpu" else per_token.median()
        assert worst.item() < (2e-3 if DEV == "cpu" else 2e-2), per_token.tolist()
