"""The Triton ISO decode kernel (kernels/iso/triton.py) against `decode_attention_ref`.

Without CUDA the kernels run in the Triton interpreter at small sizes (the same code path as
the GPU, minus the compiler). Outputs and partial buffers are poisoned with NaN first.
Bound: fp16 operands with fp32 accumulation, so |out - ref| <= 2e-3 * max|ref| (fp32 q).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.sm90_build import (
    compile_sm90,
    rerun_without_interpreter,
    resource_usage,
    usage_field,
)
from tinyserve.kernels import iso
from tinyserve.kernels.iso import triton as it

pytestmark = pytest.mark.gpu_shapes

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # fmt, hq, hkv, d, page_size, lens, split_tokens, q dtype
    ("iso3", 16, 2, 256, 16, [1, 70], 64, torch.float32),
    ("iso4", 16, 2, 256, 16, [1, 70], None, torch.float32),
    ("iso3", 8, 4, 128, 4, [5, 100], 64, torch.float32),
    ("iso4", 16, 1, 128, 1, [33], 64, torch.bfloat16),
    ("iso4", 4, 2, 256, 8, [200, 3], 128, torch.float32),
    ("iso3", 32, 2, 256, 16, [40, 3], 32, torch.bfloat16),  # 122B/397B: GQA group 16
]


def _cache(fmt, hkv, d, ps, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    pages_per = [math.ceil(n / ps) for n in lens]
    num_pages = sum(pages_per) + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(pages_per) + 2, dtype=torch.int32)
    table[:, -2:] = 10_000_000  # entries past a sequence's pages must never be read
    at = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[at:at + p].int()
        at += p
    k = torch.randn(num_pages * ps, hkv, d, generator=gen)
    k[:, :, 3] *= 20  # an outlier channel
    kc = iso.quantize_ref(k, fmt)
    vc = iso.quantize_ref(torch.randn(num_pages * ps, hkv, d, generator=gen), fmt)
    return kc, vc, table


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-ps{c[4]}-"
                                             f"len{max(c[5])}x{len(c[5])}" for c in CASES])
def test_triton_decode_matches_reference(case) -> None:
    fmt, hq, hkv, d, ps, lens, split_tokens, dtype = case
    kc, vc, table = _cache(fmt, hkv, d, ps, lens, seed=len(lens) * d + hq)
    torch.manual_seed(hq + d)
    q = torch.randn(len(lens), hq, d).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype, device=DEV)
    got = it.iso_decode_attention_triton(q.to(DEV), kc.to(DEV), vc.to(DEV), table.to(DEV),
                                         seq.to(DEV), ps, fmt, d ** -0.5, out=out,
                                         split_tokens=split_tokens)
    assert got is out
    ref = iso.decode_attention_ref(q, kc, vc, table, seq, ps, fmt, d ** -0.5)
    err = (out.float().cpu() - ref).abs().max().item() / ref.abs().max().item()
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    assert err < tol, f"relative error {err:.2e}"


def test_rotation_tables_are_the_quaternions() -> None:
    cent, rot = it._tables(torch.device("cpu"), "iso4")
    x = torch.randn(5, 256)
    fwd = torch.einsum("gck,rbgk->rbgc", rot[0].double(), x.double().reshape(5, 2, 32, 4))
    torch.testing.assert_close(fwd.float().reshape(5, 256), iso.rotate_ref(x), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(rot[1] @ rot[0], torch.eye(4).expand(32, 4, 4), atol=1e-6,
                               rtol=0)
    assert torch.equal(cent.float(), iso.centroid_table("iso4").half().float())


def test_plan_splits_keeps_the_gpu_busy() -> None:
    # batch 8, 2 kv heads, 32k on 132 SMs: >= 2 waves of programs, >= 128 tokens per split
    from tinyserve.kernels.attention.split import plan_splits

    def plan(batch: int, max_seq_len: int) -> tuple[int, int]:  # this kernel's settings
        return plan_splits(batch, 2, max_seq_len, 132, min_tokens=it.MIN_SPLIT_TOKENS,
                           ctas_per_sm=it.CTAS_PER_SM, tile=it.BLOCK_T)

    chunk, splits = plan(8, 32768)
    assert splits * 16 >= 2 * 132 and chunk >= 128 and chunk % it.BLOCK_T == 0
    assert chunk * splits >= 32768 and chunk * (splits - 1) < 32768
    chunk, splits = plan(1, 32768)
    assert chunk >= 128 and splits * 2 >= 2 * 132
    assert plan(1, 1) == (it.BLOCK_T, 1)


def test_rejects_bad_shapes() -> None:
    kc = torch.zeros(16, 2, 100, dtype=torch.uint8)
    q = torch.zeros(1, 5, 256)
    t, s = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="GQA"):
        it.iso_decode_attention_triton(q, kc, kc, t, s, 16, "iso3", 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        it.iso_decode_attention_triton(torch.zeros(1, 4, 256), kc, kc, t, s, 16, "iso4", 1.0)


_TYPES = {"q_ptr": "*bf16", "k_ptr": "*u8", "v_ptr": "*u8", "pt_ptr": "*i32", "lens_ptr": "*i32",
          "cent_ptr": "*fp16", "rot_ptr": "*fp32", "part_acc_ptr": "*fp32",
          "part_ml_ptr": "*fp32", "scale_log2": "fp32", "out_ptr": "*bf16"}


@pytest.mark.slow
@pytest.mark.parametrize("bits", [3, 4])
def test_kernels_build_for_sm90(bits: int) -> None:
    """Ahead-of-time build for sm_90 without a GPU (35B-A3B shapes, default settings): the
    kernels compile and fit in shared memory; the resource usage is printed (the default
    register cap spills a little by design; the merge must not spill). Under the
    interpreter the check runs in a child process with the compiler."""
    if rerun_without_interpreter(__file__, f"build_for_sm90 and {bits}"):
        return
    shape = dict(HKV=2, G=8, BLOCK_H=16, NB=2, BITS=bits, BB=iso.BLOCK_BYTES[f"iso{bits}"],
                 BLOCK_T=it.BLOCK_T)
    cases = [(it.iso_decode_partial_kernel, shape, it.NUM_WARPS),
             (it.decode_merge_kernel, dict(HQ=16, D=256, BLOCK_S=16, IS_ROTATED=True), 4)]
    for jf, consts, warps in cases:
        sig = {n: "constexpr" if n in consts else _TYPES.get(n, "i32") for n in jf.arg_names}
        opts = {"num_warps": warps}
        if jf is not it.decode_merge_kernel and it.MAXNREG:
            opts["maxnreg"] = it.MAXNREG
        k = compile_sm90(jf, sig, consts, **opts)
        assert k.metadata.shared <= 227 * 1024
        usage = resource_usage(k, f"iso_{jf.fn.__name__}_{bits}")
        if usage is not None:
            print(f"\n{jf.fn.__name__} iso{bits}: {usage.strip().splitlines()[-1].strip()}")
            if jf is it.decode_merge_kernel:
                assert not usage_field(usage, "STACK"), usage
