"""Same-input linears run as one: `concat_rows` over every storage, the model with fused
in_proj_qkvz / in_proj_ba / qkv_proj against the separate projections (prefill and a batched
decode), and the loader fusing on the host (the fused names for dense, FP8 and NVFP4
storages, the parts where `concat_rows` refuses).

Each output row of a fused linear is its own dot product, but the CPU BLAS may pick another
kernel (another summation order) for the wider matrix: the fused model's fp32 logits agree
with the separate one's to 1e-5 of the logit scale (measured: 2e-7, fp32 rounding; bit for
bit where only the GDN projections fuse)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.core import Batch, DenseWeight, FP8Weight, NVFP4Weight, SamplingParams, ScheduledSeq
from tinyserve.kernels.nvfp4.ref import quantize_fp8, quantize_nvfp4
from tinyserve.model import linear as linear_mod
from tinyserve.model.config import load_config
from tinyserve.model.linear import concat_rows, linear
from tinyserve.model.loader import load_weights
from tinyserve.model.loader_plan import FUSED_LINEARS, expected_weights, fused_group

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _w(o: int, i: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(o, i, generator=g) / i**0.5


_MAKE = {
    "dense": lambda w, _: DenseWeight(w),
    "nvfp4": lambda w, _: quantize_nvfp4(w),
    "fp8": lambda w, _: quantize_fp8(w),
    "fp8_one_scale": lambda w, _: quantize_fp8(w),
    "fp8_channel": lambda w, _: quantize_fp8(w, per_channel=True),
    "fp8_mixed": lambda w, i: quantize_fp8(w, per_channel=i == 1),
}


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("kind", list(_MAKE))
def test_concat_rows_every_storage(kind: str, parts: int) -> None:
    ws = [_MAKE[kind](_w(rows, 64, i), i) for i, rows in enumerate((24, 8, 16)[:parts])]
    if kind == "nvfp4":  # one global scale: what makes NVFP4 parts fusable
        for w in ws[1:]:
            w.global_scale = ws[0].global_scale
    if kind == "fp8_one_scale":
        for w in ws[1:]:
            w.scale = ws[0].scale.clone()
    fused = concat_rows(*ws)
    assert fused is not None and type(fused) is type(ws[0])
    assert fused.shape == (sum(w.shape[0] for w in ws), 64)
    if kind.startswith("fp8"):  # equal per-tensor scales stay one, else one per row
        assert fused.scale.shape == (() if kind == "fp8_one_scale" else (fused.shape[0], 1))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(linear(x, fused), torch.cat([linear(x, w) for w in ws], -1),
                               rtol=1e-6, atol=1e-6)


def test_concat_rows_refuses_mismatches() -> None:
    a, b = _w(8, 64, 1), _w(8, 64, 2)
    na, nb = quantize_nvfp4(a), quantize_nvfp4(b)
    nb.global_scale = na.global_scale * 2
    assert concat_rows(na, nb) is None
    assert concat_rows(na, quantize_nvfp4(a), nb) is None
    assert concat_rows(DenseWeight(a), na) is None
    assert concat_rows(DenseWeight(a), DenseWeight(_w(8, 32, 3))) is None
    assert concat_rows(DenseWeight(a), DenseWeight(b.bfloat16())) is None
    assert concat_rows(DenseWeight(a)) is None
    assert concat_rows() is None


def test_fused_group() -> None:
    assert fused_group("layers.3.self_attn.k_proj") == (
        "layers.3.self_attn.qkv_proj",
        ("layers.3.self_attn.q_proj", "layers.3.self_attn.k_proj", "layers.3.self_attn.v_proj"))
    assert fused_group("layers.12.linear_attn.in_proj_a") == (
        "layers.12.linear_attn.in_proj_ba",
        ("layers.12.linear_attn.in_proj_b", "layers.12.linear_attn.in_proj_a"))
    for name in ("layers.0.linear_attn.out_proj", "layers.3.self_attn.o_proj", "lm_head",
                 "layers.0.mlp.shared_expert.up_proj", "embed_tokens"):
        assert fused_group(name) is None


# --------------------------------------------------------------------------------------------
# The model: fused vs separate projections


def _run(cfg, w, **kwargs) -> torch.Tensor:
    """Logits of two prompts prefilled together, then three batched decode steps."""
    runner = build_runner(cfg, w, **kwargs)
    prompts = [[5, 17, 301, 42, 8, 99, 7], [11, 250, 3, 64, 129]]
    pages, slots = [[0, 1, 2, 3], [4, 5, 6, 7]], [0, 1]
    seqs = [ScheduledSeq(f"r{i}", p, 0, pages[i], slots[i], True, GREEDY)
            for i, p in enumerate(prompts)]
    out = [runner.forward(Batch(seqs)).logits]
    pos = [len(p) for p in prompts]
    for t in range(3):
        step = [ScheduledSeq(f"r{i}", [20 + 7 * t + i], pos[i] + t, pages[i], slots[i], True,
                             GREEDY) for i in range(2)]
        out.append(runner.forward(Batch(step)).logits)
    return torch.cat(out).float().cpu()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(got).all() and got.shape == ref.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("fmt", ["bf16", "modelopt", "modelopt-mixed"])
def test_fused_model_equals_separate(fmt: str, monkeypatch) -> None:
    """bf16: every projection fused; modelopt: the GDN ones (q/k/v are NVFP4 with their own
    global scales: separate); modelopt-mixed: FP8 parts with per-tensor scales, fused with a
    per-row scale."""
    cfg, w = checkpoint(fmt)
    fused = _run(cfg, w)
    runner = build_runner(cfg, w)
    layers = runner.model.layers
    assert all(layer.mixer.in_proj_qkvz.fused is not None
               and layer.mixer.in_proj_ba.fused is not None
               for layer in layers if not layer.is_attention)
    attn = [layer.mixer for layer in layers if layer.is_attention]
    assert all((m.qkv_proj.fused is None) == (fmt == "modelopt") for m in attn)
    monkeypatch.setattr(linear_mod, "concat_rows", lambda *ws: None)  # the separate ones
    runner = build_runner(cfg, w)
    assert all(layer.mixer.in_proj_qkvz.fused is None if not layer.is_attention
               else layer.mixer.qkv_proj.fused is None for layer in runner.model.layers)
    _close(fused, _run(cfg, w))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("fmt", ["bf16", "modelopt-mixed"])
def test_fused_model_on_cuda(fmt: str, monkeypatch) -> None:
    """bf16 with the kernels on (FP8 / dense GEMVs, Triton GDN, norms, KV store reading the
    row-strided views): the fused model repeats its bits run to run and stays within the
    kernels-vs-references bound of tests/model/test_cuda_model.py of the separate one (the
    wider GEMV may split its sums otherwise)."""
    from tests.model.test_cuda_model import _similar

    cfg, w = checkpoint(fmt)
    fused = _run(cfg, w, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fused, _run(cfg, w, device="cuda", dtype=torch.bfloat16))
    monkeypatch.setattr(linear_mod, "concat_rows", lambda *ws: None)  # the separate ones
    _similar(fused, _run(cfg, w, device="cuda", dtype=torch.bfloat16), rel=0.02, agree=0.85)


def test_model_takes_the_loaders_fused_weights(tiny_checkpoint) -> None:
    path = tiny_checkpoint("modelopt-mixed")
    cfg = load_config(path)
    fused = load_weights(path, cfg, dtype=torch.float32)
    assert "layers.0.linear_attn.in_proj_qkvz" in fused
    # the same concatenated weights, whether the loader or the model built them
    assert torch.equal(_run(cfg, fused), _run(cfg, load_weights(path, cfg, dtype=torch.float32,
                                                                fuse=False)))


def test_unfused_the_loader_yields_the_parts(tiny_checkpoint) -> None:
    path = tiny_checkpoint("bf16")
    cfg = load_config(path)
    assert set(load_weights(path, cfg, fuse=False)) == set(expected_weights(cfg))
    assert set(load_weights(path, cfg)) == _fused_names(cfg)


# --------------------------------------------------------------------------------------------
# The loader


def _fused_names(cfg, refused: set[str] = frozenset()) -> set[str]:
    """expected_weights with each fused group's parts replaced by its name (but `refused`)."""
    names = set(expected_weights(cfg))
    for name in list(names):
        group = fused_group(name)
        if group is not None and group[0] not in refused:
            names.discard(name)
            names.add(group[0])
    return names


def _assert_equal(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, NVFP4Weight):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.block_scale, b.block_scale)
        assert a.global_scale == b.global_scale
    elif isinstance(a, FP8Weight):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.scale, b.scale)
    else:
        assert torch.equal(a.weight, b.weight) and a.weight.dtype == b.weight.dtype


def _check_loaded(path: Path, storages: dict[str, type], refused: set[str]) -> None:
    cfg = load_config(path)
    fused = load_weights(path, cfg, dtype=torch.bfloat16)
    parts = load_weights(path, cfg, dtype=torch.bfloat16, fuse=False)
    assert set(parts) == set(expected_weights(cfg))
    assert set(fused) == _fused_names(cfg, {f"layers.{L}.{n}" for L in range(cfg.num_layers)
                                            for n in refused})
    for name, w in fused.items():
        group = next((g for g in FUSED_LINEARS if name.endswith("." + g)), None)
        if group is None:
            (_assert_equal if not isinstance(w, torch.Tensor) else torch.equal)(w, parts[name])
            continue
        assert isinstance(w, storages[group]), name
        prefix = name[: -len(group)]
        want = concat_rows(*(parts[prefix + p] for p in FUSED_LINEARS[group]))
        _assert_equal(w, want)


def _edit(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    save_file(fn(load_file(file)), file, metadata={"format": "pt"})
    return dst


def test_loader_fuses_dense_and_fp8(tiny_checkpoint) -> None:
    gdn_ = {"linear_attn.in_proj_qkvz": DenseWeight, "linear_attn.in_proj_ba": DenseWeight}
    _check_loaded(tiny_checkpoint("bf16"), {**gdn_, "self_attn.qkv_proj": DenseWeight}, set())
    _check_loaded(tiny_checkpoint("bf16-official"), {**gdn_, "self_attn.qkv_proj": DenseWeight},
                  set())
    # FP8 qkv | z and q | k | v (per-tensor scales of their own: one per-row scale)
    _check_loaded(tiny_checkpoint("modelopt-mixed"), {
        "linear_attn.in_proj_qkvz": FP8Weight, "linear_attn.in_proj_ba": DenseWeight,
        "self_attn.qkv_proj": FP8Weight}, set())


def test_loader_nvfp4_fuses_one_global_scale_only(tiny_checkpoint, tmp_path) -> None:
    # q/k/v NVFP4 with three global scales: concat_rows refuses, the parts come
    src = tiny_checkpoint("modelopt")
    gdn_ = {"linear_attn.in_proj_qkvz": DenseWeight, "linear_attn.in_proj_ba": DenseWeight}
    _check_loaded(src, gdn_, {"self_attn.qkv_proj"})

    def one_scale(t):  # k and v take q's global scale: one NVFP4 qkv_proj
        p = "model.layers.3.self_attn."
        for proj in ("k_proj", "v_proj"):
            t[f"{p}{proj}.weight_scale_2"] = t[f"{p}q_proj.weight_scale_2"].clone()
        return t

    path = _edit(src, tmp_path / "one-scale", one_scale)
    _check_loaded(path, {**gdn_, "self_attn.qkv_proj": NVFP4Weight}, set())


def test_loader_yields_the_fused_weight_where_its_last_part_was(tiny_checkpoint) -> None:
    from tinyserve.model.loader import iter_weights

    path = tiny_checkpoint("bf16")
    cfg = load_config(path)
    fused = [n for n, _ in iter_weights(path, cfg)]
    parts = [n for n, _ in iter_weights(path, cfg, fuse=False)]
    assert len(fused) == len(set(fused))
    for group, members in FUSED_LINEARS.items():
        for L in range(cfg.num_layers):
            name = f"layers.{L}.{group}"
            if name in fused:
                last = max(parts.index(f"layers.{L}.{p}") for p in members)
                before = [n for n in parts[:last] if fused_group(n) is None]
                assert set(before) <= set(fused[:fused.index(name)])


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.nbytes
    return sum(t.nbytes for t in vars(w).values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("fmt", ["bf16", "modelopt", "modelopt-mixed"])
def test_fused_weights_take_the_bytes_of_their_parts(tiny_checkpoint, fmt: str) -> None:
    """What the memory planner counts (one plan entry per part) is what the fused weights
    take, but for FP8 parts of different per-tensor scales: their fused weight carries an
    fp32 scale per row (4 bytes a row, 49 KB for 35B-A3B's in_proj_qkvz)."""
    path = tiny_checkpoint(fmt)
    cfg = load_config(path)
    fused = load_weights(path, cfg, dtype=torch.bfloat16)
    parts = load_weights(path, cfg, dtype=torch.bfloat16, fuse=False)
    extra = 0
    for name, w in fused.items():
        group = fused_group(name.replace("qkv_proj", "q_proj").replace(
            "in_proj_qkvz", "in_proj_z").replace("in_proj_ba", "in_proj_a"))
        if isinstance(w, FP8Weight) and group is not None and group[0] == name:
            extra += w.scale.nbytes - sum(parts[p].scale.nbytes for p in group[1])
    assert sum(map(_nbytes, fused.values())) == sum(map(_nbytes, parts.values())) + extra
    assert (extra > 0) == (fmt == "modelopt-mixed")
