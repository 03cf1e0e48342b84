"""The "fused" path of `fused_moe` (NVFP4 decode) vs the per-slot torch loop: the CUDA decode
(`nvfp4.cuda.moe_decode`, two launches, deterministic) where it takes the call, else the dot
path with the shared expert as a second, one-expert call.

Without CUDA the dot path runs in the Triton interpreter over a small grid (H 64-256 incl. 80
and 208, F 32-128 incl. 48 and 80, 6-16 experts in random slots, top 2-8 incl. 3 and 5, 1, 3,
4 and 8 tokens, with and without the shared expert); the 35B-A3B layer (H 2048, F 512, 256
experts, top 8, + shared) runs on a GPU (bf16 x: the CUDA decode; fp32 x: dot): accuracy at
1, 4 and 8 tokens, a CUDA-graph replay with new inputs, 30 launches with identical bits, a
CUDA-graph replay equal to eager bitwise over a 40-layer chain. Outputs come from a
NaN-poisoned torch.empty (the intermediate too). Bounds (relative Frobenius): fp32 x 2e-3,
bf16 x 1e-2. The CUDA decode's own tests: test_nvfp4_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_nvfp4 import rand_nvfp4, rel_err
from tinyserve.kernels.moe.fused import (
    allocate_expert_slots,
    fused_moe,
    fused_moe_ref,
    single_expert_slots,
    write_slot,
)
from tinyserve.kernels.nvfp4.ref import dequantize_nvfp4
from tinyserve.model.moe import gated_add_ref

pytest.importorskip("triton")
pytestmark = [pytest.mark.usefixtures("poison"), pytest.mark.gpu_shapes]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
CPU_ONLY = pytest.mark.skipif(DEV == "cuda", reason="GPU time: covered by the 35B-A3B tests")


def _expert(h: int, f: int, gen: torch.Generator | None = None) -> tuple:
    return (rand_nvfp4(f, h, DEV, gen), rand_nvfp4(f, h, DEV, gen), rand_nvfp4(h, f, DEV, gen))


def _layer(h: int, f: int, e: int, spare: int = 3):
    """e experts written to random slots of an (e + spare)-slot buffer (as the expert cache
    holds them), their slot of each expert id, and a shared expert in its own slots."""
    slots = allocate_expert_slots(e + spare, h, f, fp4=True, device=DEV)
    slot_of = torch.randperm(e + spare, device=DEV)[:e]
    for i in range(e):
        write_slot(slots, int(slot_of[i]), *_expert(h, f))
    return slots, slot_of, single_expert_slots(*_expert(h, f))


def _routing(n: int, e: int, k: int, slot_of: torch.Tensor):
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, device=DEV), dim=-1).to(DT)
    return slot_of[ids], weights


# (H, F, experts, top-k, tokens): every size of the grid appears at least once
SMALL = [(64, 32, 8, 2, 1), (128, 64, 16, 8, 1), (80, 48, 8, 3, 3), (256, 128, 8, 4, 4),
         (208, 80, 6, 5, 8), (64, 128, 16, 4, 4)]


def _id(case) -> str:
    h, f, e, k, n = case
    return f"H{h}-F{f}-E{e}-k{k}-N{n}"


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("case", SMALL if DEV == "cpu" else [], ids=_id)
def test_fused_decode_small(case, shared: bool) -> None:
    h, f, e, k, n = case
    slots, slot_of, sh = _layer(h, f, e)
    ids, weights = _routing(n, e, k, slot_of)
    x = torch.randn(n, h, device=DEV).to(DT)
    kw = {}
    if shared:
        # a column of a wider projection, as SparseMoE hands it over (row stride E + 1)
        kw = {"shared_slots": sh, "shared_logit": torch.randn(n, e + 1, device=DEV)[:, e:]}
    ref = fused_moe_ref(x, ids, weights, slots, **kw)
    y = fused_moe(x, ids, weights, slots, path="fused", **kw)
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.isnan(y).any()
    assert rel_err(y, ref.float()) < 2e-3, rel_err(y, ref)


def test_fused_decode_repeats_and_padded_rows() -> None:
    # 4 tokens over 3 experts (every expert repeated across tokens); two rows are like padded
    # graph rows (the same routing, all-zero input): they are exactly zero and leave the
    # real rows as they are alone (on a GPU the CUDA decode, one program per token: bitwise)
    h, f = (2048, 512) if DEV == "cuda" else (64, 32)
    slots, slot_of, sh = _layer(h, f, 3, spare=0)
    ids, weights = _routing(4, 3, 2, slot_of)
    ids[2:] = ids[0]
    x = torch.randn(4, h, device=DEV).to(DT)
    x[2:] = 0
    logit = torch.randn(4, 1, device=DEV)
    y = fused_moe(x, ids, weights, slots, path="fused", shared_slots=sh, shared_logit=logit)
    alone = fused_moe(x[:2], ids[:2], weights[:2], slots, path="fused", shared_slots=sh,
                      shared_logit=logit[:2])
    assert torch.equal(y[2:], torch.zeros_like(y[2:]))
    if DEV == "cuda":
        assert torch.equal(y[:2], alone)
    else:
        torch.testing.assert_close(y[:2], alone)
    ref = fused_moe_ref(x, ids, weights, slots, shared_slots=sh, shared_logit=logit)
    assert rel_err(y, ref.float()) < (2e-3 if DT == torch.float32 else 1e-2)


def test_fused_decode_shared_equals_gated_add() -> None:
    # routed + sigmoid(logit) * shared in the launch == gated_add(routed, logit, shared)
    h, f, e, k, n = 64, 32, 8, 2, 3
    slots, slot_of, _ = _layer(h, f, e)
    gate, up, down = _expert(h, f)
    sh = single_expert_slots(gate, up, down)
    ids, weights = _routing(n, e, k, slot_of)
    x = torch.randn(n, h, device=DEV).to(DT)
    logit = torch.randn(n, 1, device=DEV).to(DT)
    g, u, d = (dequantize_nvfp4(w).to(DEV) for w in (gate, up, down))
    xf = x.float()
    shared = (torch.nn.functional.silu(xf @ g.T) * (xf @ u.T)) @ d.T
    routed = fused_moe_ref(x, ids, weights, slots)
    want = gated_add_ref(routed.float(), logit.float(), shared)
    y = fused_moe(x, ids, weights, slots, shared_slots=sh, shared_logit=logit, path="fused")
    assert rel_err(y, want) < (2e-3 if DT == torch.float32 else 1e-2), rel_err(y, want)


@CPU_ONLY
def test_shared_expert_beside_the_dot_path() -> None:
    # outside the CUDA decode the shared expert runs as a one-expert MoE of its own, summed
    # after
    h, f, e, k, n = 64, 64, 6, 2, 2
    slots, slot_of, sh = _layer(h, f, e)
    ids, weights = _routing(n, e, k, slot_of)
    x = torch.randn(n, h, device=DEV).to(DT)
    kw = {"shared_slots": sh, "shared_logit": torch.randn(n, 1, device=DEV)}
    ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
    y = fused_moe(x, ids, weights, slots, path="dot", **kw)
    assert rel_err(y, ref) < 2e-3


def test_fused_decode_errors() -> None:
    h, f = 64, 32
    slots, slot_of, sh = _layer(h, f, 4)
    dense = allocate_expert_slots(4, h, f, fp4=False, device=DEV, dtype=DT)
    ids, weights = _routing(1, 4, 2, slot_of)
    x = torch.randn(1, h, device=DEV).to(DT)
    with pytest.raises(ValueError):  # dense slots
        fused_moe(x, ids, weights, dense, path="fused")
    with pytest.raises(ValueError):  # an unknown path (the two-launch decode is "fused")
        fused_moe(x, ids, weights, slots, path="fused2")
    with pytest.raises(ValueError):  # a shared expert needs its logit
        fused_moe(x, ids, weights, slots, shared_slots=sh)
    with pytest.raises(ValueError):  # logit [N, 1]
        fused_moe(x, ids, weights, slots, shared_slots=sh, shared_logit=torch.zeros(1, 2))
    with pytest.raises(ValueError):
        single_expert_slots(*_expert(h, f)[:2], rand_nvfp4(h, 2 * f, DEV))


# --- Qwen3.5-35B-A3B layer on a GPU ------------------------------------------------------

@pytest.mark.requires_cuda
@pytest.mark.parametrize("n", [1, 4, 8], ids=lambda n: f"N{n}")
def test_fused_decode_gpu(n: int) -> None:
    # bf16 x (the CUDA decode) and fp32 x (dot), with and without the shared expert
    slots, slot_of, sh = _gpu_layer()
    ids, weights = _routing(n, 256, 8, slot_of)
    x = torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16)
    logit = torch.randn(n, 257, device=DEV, dtype=torch.bfloat16)[:, 256:]
    kw = {"shared_slots": sh, "shared_logit": logit}
    ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
    ref_routed = fused_moe_ref(x, ids, weights, slots).float()
    for dt in (torch.bfloat16, torch.float32):
        y = fused_moe(x.to(dt), ids, weights, slots, path="fused", **kw)
        assert not torch.isnan(y).any() and rel_err(y, ref) < 1e-2, (dt, rel_err(y, ref))
        y = fused_moe(x.to(dt), ids, weights, slots, path="fused")
        assert rel_err(y, ref_routed) < 1e-2, (dt, rel_err(y, ref_routed))


@pytest.mark.requires_cuda
def test_fused_decode_gpu_graph() -> None:
    """The default path in a CUDA graph of 3 "layers", replayed with new
    routing, inputs and gate: every output matches the reference."""
    slots, slot_of, sh = _gpu_layer()
    ids, weights = _routing(2, 256, 8, slot_of)
    x = torch.randn(2, 2048, device=DEV, dtype=torch.bfloat16)
    logit = torch.randn(2, 1, device=DEV, dtype=torch.bfloat16)
    kw = {"shared_slots": sh, "shared_logit": logit}
    fused_moe(x, ids, weights, slots, **kw)  # warm-up (compiles)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = [fused_moe(x, ids, weights, slots, **kw) for _ in range(3)]
    for _ in range(2):  # new routing, inputs and gate, same graph
        ids.copy_(_routing(2, 256, 8, slot_of)[0])
        x.normal_()
        logit.normal_()
        g.replay()
        torch.cuda.synchronize()
        ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
        for y in ys:
            assert rel_err(y, ref) < 1e-2


@pytest.mark.requires_cuda
def test_fused_decode_gpu_repeatable() -> None:
    """30 launches on the same inputs (35B-A3B layer, 1 and 8 tokens + shared) give the same
    bits; prints us per launch (20 launches in a graph)."""
    slots, slot_of, sh = _gpu_layer()
    for n in (1, 8):
        ids, weights = _routing(n, 256, 8, slot_of)
        x = torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16)
        kw = {"shared_slots": sh,
              "shared_logit": torch.randn(n, 1, device=DEV, dtype=torch.bfloat16)}
        ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
        ys = [fused_moe(x, ids, weights, slots, path="fused", **kw) for _ in range(30)]
        assert rel_err(ys[0], ref) < 1e-2, rel_err(ys[0], ref)
        differ = sum(not torch.equal(y, ys[0]) for y in ys)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                fused_moe(x, ids, weights, slots, path="fused", **kw)
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"\nfused N={n}: {differ} of 30 launches differ from the first; "
              f"{start.elapsed_time(end) * 1e3 / 100:.1f} us per launch (L2-warm)")
        assert differ == 0, f"fused decode not reproducible ({differ} of 30)"


@pytest.mark.requires_cuda
def test_fused_decode_gpu_graph_equals_eager_chain() -> None:
    """40 chained "layers" (x <- rms(x + moe_l(x)), each with its own routing), eager vs a
    CUDA-graph replay of the same chain, as the model runs it: the same bits."""
    slots, slot_of, sh = _gpu_layer()
    layers = [_routing(1, 256, 8, slot_of) for _ in range(40)]
    logit = torch.randn(40, 1, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        x = x0
        for i, (ids, w) in enumerate(layers):
            y = fused_moe(x, ids, w, slots, shared_slots=sh, shared_logit=logit[i:i + 1],
                          path="fused")
            s = x.float() + y.float()
            x = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x0.dtype)
        return x

    eager = chain()  # also the warm-up (compiles)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain()
    results = []
    for _ in range(3):
        g.replay()
        results.append(out.clone())
        results.append(chain())  # eager again, between the replays
    torch.cuda.synchronize()
    diff = max((r.float() - eager.float()).abs().max().item() for r in results)
    print(f"\nfused: graph / eager chain of 40, largest difference {diff:.3g}")
    assert diff == 0.0, f"fused: graph and eager differ by {diff}"


_GPU_LAYER: list = []


def _gpu_layer():
    if not _GPU_LAYER:
        gen = torch.Generator(device=DEV).manual_seed(0)
        slots = allocate_expert_slots(256, 2048, 512, fp4=True, device=DEV)
        for i in range(256):
            write_slot(slots, i, *_expert(2048, 512, gen))
        slot_of = torch.randperm(256, device=DEV)  # expert i lives in slot slot_of[i]
        _GPU_LAYER.extend([slots, slot_of, single_expert_slots(*_expert(2048, 512, gen))])
    return tuple(_GPU_LAYER)
