"""The one-launch NVFP4 MoE decode ("fused1") vs the torch reference and, bitwise, vs the
two-launch decode ("fused") with the same tiles (down programs with the gate_up warp count).

Without CUDA the kernel runs in the Triton interpreter (programs one after the other in id
order: every gate_up program before any down program, so the counters, the wait and the
reset run, not the concurrency) over small shapes: H 48-128, F 32-80, top 2-8, 1-8 tokens,
with and without the shared expert, "f32" and "h2"; 30 launches in a row leave the counters
at zero and give the same bits. On a GPU (35B-A3B layer: H 2048, F 512, 256 experts, top 8,
+ shared): bitwise == two-launch at 1, 4 and 8 tokens, 30 launches identical, a CUDA graph
replayed with new routing, a CUDA graph of a 40-layer chain == eager bitwise. Outputs and
the intermediate come from a NaN-poisoned torch.empty.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.sm90_build import (  # noqa: E402
    compile_sm90,
    rerun_without_interpreter,
    resource_usage,
    usage_field,
)
from tests.kernels.test_fused_moe_decode import (  # noqa: E402
    _TYPES,
    _cfg,
    _gpu_layer,
    _layer,
    _routing,
)
from tests.kernels.test_nvfp4 import rel_err  # noqa: E402
from tinyserve.kernels import fused_moe as fm  # noqa: E402
from tinyserve.kernels import fused_moe_decode as fmd  # noqa: E402
from tinyserve.kernels import fused_moe_decode1 as fmd1  # noqa: E402
from tinyserve.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from tinyserve.kernels.fused_moe_decode import MoEFusedConfig  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("poison")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32


def _two_launch_twin(cfg: MoEFusedConfig) -> MoEFusedConfig:
    # the two-launch tiles whose bits "fused1" with `cfg` reproduces
    return dataclasses.replace(cfg, down_warps=cfg.num_warps)


def _counters_zero() -> bool:
    return not fmd1.fused1_counters(torch.device(DEV)).any().item()


# (H, F, experts, top-k, tokens)
SMALL = [(64, 32, 8, 2, 1), (80, 48, 8, 3, 3), (128, 64, 16, 8, 1), (96, 80, 6, 5, 8)]


@pytest.mark.parametrize(("shared", "decode"), [(True, "h2"), (False, "f32"), (True, "f32")],
                         ids=["shared-h2", "routed-f32", "shared-f32"])
@pytest.mark.parametrize("case", SMALL if DEV == "cpu" else [],
                         ids=lambda c: "H{}-F{}-E{}-k{}-N{}".format(*c))
def test_fused1_small(case, shared: bool, decode: str) -> None:
    h, f, e, k, n = case
    slots, slot_of, sh = _layer(h, f, e)
    ids, weights = _routing(n, e, k, slot_of)
    x = torch.randn(n, h, device=DEV).to(DT)
    kw = {}
    if shared:
        kw = {"shared_slots": sh, "shared_logit": torch.randn(n, e + 1, device=DEV)[:, e:]}
    cfg = _cfg(h, decode, block_f=8, block_h=16)
    ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
    y = fused_moe(x, ids, weights, slots, path="fused1", fused_config=cfg, **kw)
    two = fused_moe(x, ids, weights, slots, path="fused", fused_config=_two_launch_twin(cfg),
                    **kw)
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.isnan(y).any()
    assert rel_err(y, ref) < (1e-5 if decode == "f32" else 2e-3), rel_err(y, ref)
    assert torch.equal(y, two)
    assert _counters_zero()


def test_fused1_30_launches_reset_the_counters() -> None:
    # a row block that does not divide H (the last down program is partly masked), several
    # gate_up chunks per pair; counters back at zero after every launch
    h, f, e, k, n = 48, 32, 6, 2, 2
    slots, slot_of, sh = _layer(h, f, e)
    cfg = MoEFusedConfig(8, 4, 4, 32, 4, "h2")
    for _ in range(3):  # three inputs, ten launches each
        ids, weights = _routing(n, e, k, slot_of)
        x = torch.randn(n, h, device=DEV).to(DT)
        kw = {"shared_slots": sh, "shared_logit": torch.randn(n, 1, device=DEV)}
        ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
        first = None
        for i in range(10):
            y = fused_moe(x, ids, weights, slots, path="fused1", fused_config=cfg, **kw)
            assert _counters_zero(), i
            first = y if first is None else first
            assert torch.equal(y, first), i
        assert rel_err(first, ref) < (2e-3 if DT == torch.float32 else 1e-2)


def test_fused1_is_the_default_when_switched(monkeypatch) -> None:
    calls = []
    real = fm.moe_fused1_decode
    monkeypatch.setattr(fm, "moe_fused1_decode", lambda *a: calls.append(a[7]) or real(*a))
    monkeypatch.setattr(fmd, "MOE_FUSED_DECODE", True)
    h, f, e = 64, 32, 8
    slots, slot_of, sh = _layer(h, f, e)
    ids, weights = _routing(1, e, 2, slot_of)
    x = torch.randn(1, h, device=DEV).to(DT)
    logit = torch.randn(1, 1, device=DEV)
    kw = {"shared_slots": sh, "shared_logit": logit}
    cfg = _cfg(h, "h2")
    monkeypatch.setitem(fmd.MOE_FUSED_TILES, (h, f), cfg)
    monkeypatch.setitem(fmd1.MOE_FUSED1_TILES, (h, f), cfg)
    two = fused_moe(x, ids, weights, slots, **kw)  # MOE_FUSED_PATH = "fused" by default
    assert fmd.MOE_FUSED_PATH == "fused" and not calls
    monkeypatch.setattr(fmd, "MOE_FUSED_PATH", "fused1")
    one = fused_moe(x, ids, weights, slots, **kw)
    assert calls == [cfg] and torch.equal(one, two)  # table tiles, same bits
    assert fmd1.default_moe_fused1_config(h, f) is cfg
    assert fmd1.default_moe_fused1_config(2048, 512) == MoEFusedConfig(4, 128, 4, 2, 4, "h2")


def test_fused1_errors() -> None:
    h, f = 64, 32
    slots, slot_of, _ = _layer(h, f, 4)
    ids, weights = _routing(1, 4, 2, slot_of)
    n = fmd.MOE_FUSED_MAX_TOKENS + 1
    with pytest.raises(ValueError):  # too many tokens for the counters
        fused_moe(torch.randn(n, h, device=DEV).to(DT), ids.expand(n, 2),
                  weights.expand(n, 2), slots, path="fused1")
    dense = fm.allocate_expert_slots(4, h, f, fp4=False, device=DEV, dtype=DT)
    with pytest.raises(ValueError):
        fused_moe(torch.randn(1, h, device=DEV).to(DT), ids, weights, dense, path="fused1")


# --- Qwen3.5-35B-A3B layer on a GPU ------------------------------------------------------

# the table's tiles, a candidate with 8-feature gate_up and 4-row down programs, the f32 decode
GPU_CONFIGS = [fmd1.MOE_FUSED1_TILES[(2048, 512)], MoEFusedConfig(8, 128, 4, 4, 4, "h2"),
               MoEFusedConfig(4, 128, 4, 2, 4, "f32")]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("n", [1, 4, 8], ids=lambda n: f"N{n}")
def test_fused1_gpu_bitwise(n: int) -> None:
    """Table tiles, a candidate and the f32 decode: == the two-launch twin bitwise,
    with and without the shared expert; close to the reference; counters zero after."""
    slots, slot_of, sh = _gpu_layer()
    ids, weights = _routing(n, 256, 8, slot_of)
    x = torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16)
    logit = torch.randn(n, 257, device=DEV, dtype=torch.bfloat16)[:, 256:]
    kw = {"shared_slots": sh, "shared_logit": logit}
    ref = fused_moe_ref(x, ids, weights, slots, **kw).float()
    for cfg in GPU_CONFIGS if n == 1 else GPU_CONFIGS[:1]:
        twin = _two_launch_twin(cfg)
        y = fused_moe(x, ids, weights, slots, path="fused1", fused_config=cfg, **kw)
        two = fused_moe(x, ids, weights, slots, path="fused", fused_config=twin, **kw)
        assert rel_err(y, ref) < 1e-2, (cfg, rel_err(y, ref))
        assert torch.equal(y, two), (cfg, (y.float() - two.float()).abs().max().item())
        y = fused_moe(x, ids, weights, slots, path="fused1", fused_config=cfg)
        two = fused_moe(x, ids, weights, slots, path="fused", fused_config=twin)
        assert torch.equal(y, two), cfg
        torch.cuda.synchronize()
        assert _counters_zero(), cfg


@pytest.mark.requires_cuda
def test_fused1_gpu_repeatable_and_graph() -> None:
    """30 launches on the same inputs give the same bits (1 and 8 tokens + shared); a CUDA
    graph of 3 layers replayed 20 times with new routing, inputs and gate matches the
    two-launch decode bitwise; prints us per launch of both (L2-warm, 20 per graph)."""
    slots, slot_of, sh = _gpu_layer()
    cfg = fmd1.MOE_FUSED1_TILES[(2048, 512)]
    twin = _two_launch_twin(cfg)
    for n in (1, 8):
        ids, weights = _routing(n, 256, 8, slot_of)
        x = torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16)
        logit = torch.randn(n, 1, device=DEV, dtype=torch.bfloat16)
        kw = {"shared_slots": sh, "shared_logit": logit}
        ys = [fused_moe(x, ids, weights, slots, path="fused1", **kw) for _ in range(30)]
        differ = sum(not torch.equal(y, ys[0]) for y in ys)
        assert differ == 0, f"fused1 not reproducible ({differ} of 30)"
        times = {}
        for path, c in (("fused1", cfg), ("fused", twin), ("fused", None)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    fused_moe(x, ids, weights, slots, path=path, fused_config=c, **kw)
            g.replay()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            times[f"{path}{'' if c is None else '-twin'}"] = start.elapsed_time(end) * 10
        print(f"\nN={n}: us per launch (L2-warm) " + ", ".join(
            f"{kk} {v:.1f}" for kk, v in times.items()))
        assert _counters_zero()
    # graph replay loop with new inputs
    ids, weights = _routing(2, 256, 8, slot_of)
    x = torch.randn(2, 2048, device=DEV, dtype=torch.bfloat16)
    logit = torch.randn(2, 1, device=DEV, dtype=torch.bfloat16)
    kw = {"shared_slots": sh, "shared_logit": logit}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = [fused_moe(x, ids, weights, slots, path="fused1", **kw) for _ in range(3)]
    for _ in range(20):
        ids.copy_(_routing(2, 256, 8, slot_of)[0])
        x.normal_()
        logit.normal_()
        g.replay()
        want = fused_moe(x, ids, weights, slots, path="fused", fused_config=twin, **kw)
        assert all(torch.equal(y, want) for y in ys)
    torch.cuda.synchronize()
    assert _counters_zero()


@pytest.mark.requires_cuda
def test_fused1_gpu_graph_equals_eager_chain() -> None:
    """40 chained "layers" (x <- rms(x + moe_l(x)), each with its own routing): a CUDA graph
    replay == eager == the two-launch twin, bitwise."""
    slots, slot_of, sh = _gpu_layer()
    layers = [_routing(1, 256, 8, slot_of) for _ in range(40)]
    logit = torch.randn(40, 1, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)
    twin = _two_launch_twin(fmd1.MOE_FUSED1_TILES[(2048, 512)])

    def chain(path: str = "fused1", cfg: MoEFusedConfig | None = None) -> torch.Tensor:
        x = x0
        for i, (ids, w) in enumerate(layers):
            y = fused_moe(x, ids, w, slots, shared_slots=sh, shared_logit=logit[i:i + 1],
                          path=path, fused_config=cfg)
            s = x.float() + y.float()
            x = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x0.dtype)
        return x

    eager = chain()  # also the warm-up (compiles, makes the counters)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain()
    results = [chain("fused", twin)]
    for _ in range(3):
        g.replay()
        results.append(out.clone())
        results.append(chain())
    torch.cuda.synchronize()
    diff = max((r.float() - eager.float()).abs().max().item() for r in results)
    print(f"\nfused1: graph / eager / two-launch chain of 40, largest difference {diff:.3g}")
    assert diff == 0.0
    assert _counters_zero()


@pytest.mark.requires_cuda
def test_fused1_counters_not_made_in_a_capture(monkeypatch) -> None:
    monkeypatch.setattr(fmd1, "_COUNTERS", {})
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError), torch.cuda.graph(g):
        fmd1.fused1_counters(torch.device(DEV))


@pytest.mark.slow
def test_fused1_builds_for_sm90() -> None:
    """Ahead-of-time sm_90 build (35B-A3B shapes, shared expert; the table's tiles and the
    candidates, both spin variants): no spills; the release add and the acquire polls are
    in the PTX (registers printed)."""
    if rerun_without_interpreter(__file__, "builds_for_sm90"):
        return
    from tinyserve.kernels import fused_moe_decode1_triton as kt

    types = {**_TYPES, "arrive_ptr": "*i32", "done_ptr": "*i32", "N": "i32"}
    jf = kt.moe_fused1_kernel
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(jf.arg_names)
             if nm.endswith("_ptr")}
    cfgs = dict.fromkeys((*fmd1.MOE_FUSED1_TILES.values(), *fmd1.MOE_FUSED1_CANDIDATES))
    for spin_asm in (True, False):
        for cfg in cfgs if spin_asm else list(cfgs)[:1]:
            consts = dict(H=2048, F=512, TOPK=8, KPAD=8, FBP=32, HAS_SHARED=True,
                          BLOCK_F=cfg.block_f, BLOCK_B=cfg.block_b, BLOCK_H=cfg.block_h,
                          IS_H2=cfg.decode == "h2", USE_ASM=True, SPIN_ASM=spin_asm,
                          MAX_SPIN=fmd1.MOE_FUSED1_MAX_SPIN)
            sig = {nm: "constexpr" if nm in consts else types[nm] for nm in jf.arg_names}
            kernel = compile_sm90(jf, sig, consts, attrs, num_warps=cfg.num_warps)
            ptx = kernel.asm["ptx"]
            assert "red.global.gpu.release.add" in ptx or "atom.global.gpu.release" in ptx
            assert ("ld.acquire.gpu" in ptx) == spin_asm
            usage = resource_usage(kernel, "fused1")
            if usage is not None:
                print(f"\nfused1 {cfg} spin_asm={spin_asm}: "
                      f"{usage.strip().splitlines()[-1].strip()}")
                assert not usage_field(usage, "STACK"), usage
