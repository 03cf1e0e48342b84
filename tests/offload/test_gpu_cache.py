"""The offloaded provider on a GPU: the output of all-resident slots, and no host
synchronisation inside a step (torch's sync debug mode turns any into an error)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tinyserve.kernels.fused_moe import fused_moe, pack_expert_slots
from tinyserve.kernels.nvfp4_ref import quantize_nvfp4
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore

pytestmark = pytest.mark.requires_cuda


def _experts(L: int, E: int, H: int, F: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = {}
    for layer in range(L):
        for e in range(E):
            p = f"layers.{layer}.mlp.experts.{e}"
            w[f"{p}.gate_proj"] = quantize_nvfp4(torch.randn(F, H, generator=g) * 0.05)
            w[f"{p}.up_proj"] = quantize_nvfp4(torch.randn(F, H, generator=g) * 0.05)
            w[f"{p}.down_proj"] = quantize_nvfp4(torch.randn(H, F, generator=g) * 0.05)
    return w


@pytest.mark.parametrize("tokens", [1, 4, 64], ids=lambda n: f"N{n}")
def test_offloaded_equals_resident_without_host_sync(tokens: int) -> None:
    L, E, H, F, k = 4, 16, 256, 128, 4
    cfg = SimpleNamespace(num_layers=L, num_experts=E, hidden_size=H, moe_intermediate_size=F)
    w = _experts(L, E, H, F)
    store = HostExpertStore.from_weights(w, cfg)
    assert store.pinned
    resident = [pack_expert_slots([(w[f"layers.{la}.mlp.experts.{e}.gate_proj"],
                                    w[f"layers.{la}.mlp.experts.{e}.up_proj"],
                                    w[f"layers.{la}.mlp.experts.{e}.down_proj"])
                                   for e in range(E)], "cuda") for la in range(L)]
    experts = OffloadedExperts.create(store, E + 3, device="cuda", max_ids=64 * k)
    assert experts.cache.mode == "device" and experts.cache.use_triton
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(6):
        experts.begin_step()
        xs = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(L)]
        ids = [torch.rand(tokens, E, device="cuda", generator=g).topk(k).indices
               for _ in range(L)]
        wts = [torch.rand(tokens, k, device="cuda", generator=g) for _ in range(L)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [experts.forward(la, xs[la], ids[la], wts[la]) for la in range(L)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for la in range(L):
            ref = fused_moe(xs[la], ids[la], wts[la], resident[la]).float()
            # Same weights, same kernel; only the slot numbering (and so the tiling of the
            # prefill path) differs, so allow bf16 rounding.
            torch.testing.assert_close(outs[la].float(), ref, rtol=1e-2,
                                       atol=1e-2 * ref.abs().max().item())
    experts.begin_step()
    assert experts.stats.misses > E  # evictions happened
    assert experts.cache.policy.resident() == experts.cache.resident()
