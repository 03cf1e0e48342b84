"""The one-launch NVFP4 MoE decode ("fused" path of `kernels/fused_moe.py`): tiles, the
switch, the self-clearing workspace and the launcher of `fused_moe_decode_triton.py`; the
switch also selects the deterministic two-launch decode ("fused2", `fused_moe_decode2.py`),
and `moe_fused_decode` launches either (by the type of its config).

One launch runs every (token, expert) pair of a layer, the shared expert included as one
more pair: programs per (pair, feature chunk) compute their chunk's gate_up, silu * up and
down columns and add the [H] partial into a per-token fp32 row with atomics; the last
program of a token writes the output row and clears the workspace (details in the Triton
module). `MOE_FUSED_DECODE = False` switches the path off (fused_moe then takes the gemv
path and the model its separate shared-expert GEMVs, as before the path existed).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyserve.kernels.fused_moe_decode2 import (
    MoEFused2Config,
    default_moe_fused2_config,
    moe_fused2_decode,
)

if TYPE_CHECKING:
    from tinyserve.kernels.fused_moe import ExpertSlots

# NOTE: the switch of the fused decode (MOE_FUSED_PATH); False = the gemv path (two launches
# + a sum, the shared expert through the model's separate gemvs). The one-launch "fused" path
# sums with fp32 atomics in a different order on every launch: on the random full-size model
# that flips top-k routing and even two eager runs disagree (5 of 8 tokens); "fused2" sums in a
# fixed order (graph == eager bit for bit, bench/graph_vs_eager.py).
MOE_FUSED_DECODE = True
# the decode path the switch enables: "fused2" (two launches, no atomics: the same bits on
# every run) or "fused" (one launch, atomics; `MoEFusedConfig.accum`)
MOE_FUSED_PATH = "fused2"
FUSED_PATHS = ("fused", "fused2")
MOE_FUSED_MAX_TOKENS = 8  # the most tokens the one-launch decode takes (its workspace rows)
# fused_moe picks MOE_FUSED_PATH by itself up to this many tokens: on the H200 "fused" won at
# 1 token (18.6 vs 27.6 us per 35B-A3B layer with the shared expert) and lost at 4 and 8 with
# untuned tiles (77 vs 71, 134 vs 109 us); "fused2" won at 1, 4 and 8 (15.4 / 55.7 / 98.5 us
# vs 24.7 / 71.4 / 109.2 for gemv; `bench/nvfp4.py --only moe`, nvfp4_moe.json)
MOE_FUSED_AUTO_TOKENS = 8
# accumulators of the partial sums (MoEFusedConfig.accum) and their workspace dtypes
MOE_FUSED_ACCUMS = ("f32", "fixed")
_ACC_DTYPES = {"f32": torch.float32, "fixed": torch.int64}


@dataclass(frozen=True)
class MoEFusedConfig:
    """Tiles of the one-launch decode: `block_f` features of one expert per program (a
    multiple of 16: one int64 code word per down row), `block_b` blocks of 16 inputs per
    gate_up K step, `block_h` down rows per step, `num_warps`, the gate_up `decode`
    ("f32" / "h2", as in `nvfp4_tiles`; the down product is fp32), and the `accum` of the
    partial sums: "f32" (fp32 atomics, sum order not fixed: the output can differ in its
    last bit between runs) or "fixed" (int64 atomics in units of 2^-32, |row| < 2^31: the
    same bits on every run).

    NOTE: defaults not measured yet (no spills at sm_90 with Triton 3.9: 102 registers; 144
    programs of 8 warps for one 35B-A3B token + shared expert, one wave at 2 per SM).
    """

    block_f: int = 32
    block_b: int = 128
    block_h: int = 1024
    num_warps: int = 8
    decode: str = "h2"
    accum: str = "f32"

    def __post_init__(self) -> None:
        sizes = (self.block_f, self.block_b, self.block_h, self.num_warps)
        if self.decode not in ("f32", "h2"):
            raise ValueError(f"unknown NVFP4 decode {self.decode!r}")
        if self.accum not in MOE_FUSED_ACCUMS:
            raise ValueError(f"unknown fused MoE accumulator {self.accum!r}; choose from "
                             f"{MOE_FUSED_ACCUMS}")
        if self.block_f < 16 or any(v < 1 or v & (v - 1) for v in sizes):
            raise ValueError(f"fused MoE tiles must be powers of two (block_f >= 16), "
                             f"got {sizes}")


# (H, F) -> tiles of the one-launch decode (bench/nvfp4.py prints entries); other shapes get
# MoEFusedConfig().
MOE_FUSED_TILES: dict[tuple[int, int], MoEFusedConfig] = {
    (2048, 512): MoEFusedConfig(16, 64, 512, 4, "f32"),  # H200: 18.6 us per layer, 1 token
}


def default_moe_fused_config(hidden_size: int, intermediate_size: int) -> MoEFusedConfig:
    """The `MOE_FUSED_TILES` entry, else `MoEFusedConfig()`."""
    return MOE_FUSED_TILES.get((hidden_size, intermediate_size), MoEFusedConfig())


def fuses_shared_expert(num_tokens: int) -> bool:
    """Whether `fused_moe` runs `num_tokens` tokens (NVFP4 slots) in the decode path of
    `MOE_FUSED_PATH`, which takes a shared expert in its launches (the model then hands it
    over)."""
    return MOE_FUSED_DECODE and 0 < num_tokens <= MOE_FUSED_AUTO_TOKENS


def fused_decode_config(path: str, hidden_size: int, intermediate_size: int,
                        cfg: MoEFusedConfig | MoEFused2Config | None = None
                        ) -> MoEFusedConfig | MoEFused2Config:
    """`cfg`, or the table's tiles of `path` ("fused" / "fused2") when None.

    Raises:
        ValueError: an unknown path, or a config of the other path.
    """
    kinds = {"fused": (MoEFusedConfig, default_moe_fused_config),
             "fused2": (MoEFused2Config, default_moe_fused2_config)}
    if path not in kinds:
        raise ValueError(f"unknown fused decode path {path!r}; choose from {FUSED_PATHS}")
    kind, default = kinds[path]
    if cfg is None:
        return default(hidden_size, intermediate_size)
    if not isinstance(cfg, kind):
        raise ValueError(f"path {path!r} takes a {kind.__name__}, got {type(cfg).__name__}")
    return cfg


@functools.cache
def _kernels():
    from tinyserve.kernels import fused_moe_decode_triton

    return fused_moe_decode_triton


def decode_workspace(device: torch.device | str, hidden_size: int, rows: int,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed accumulator [rows, H] (`dtype`: float32, or int64 fixed point) and int32
    arrival counters [rows] of `device`.

    NOTE: one per (device, H, rows, dtype), shared by every layer and call: each launch
    leaves it zero again (the last program of a token clears its row). Launches on two
    streams at once would share it: one stream only.
    Raises RuntimeError when it does not exist yet and the current stream is capturing a
    CUDA graph: a tensor made during a capture is not zeroed until the graph first replays
    (its `torch.zeros` is a node of the graph), so an eager launch before that replay would
    add into garbage. Run the forward once eagerly before capturing (`DecodeGraphs` warms up).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" share one workspace
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (dev, hidden_size, rows, dtype)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the fused MoE decode workspace cannot be created during a "
                               "CUDA graph capture; run the forward eagerly once first")
        ws = (torch.zeros(rows, hidden_size, dtype=dtype, device=dev),
              torch.zeros(rows, dtype=torch.int32, device=dev))
        _WORKSPACES[key] = ws
    return ws


_WORKSPACES: dict[tuple[torch.device, int, int, torch.dtype],
                  tuple[torch.Tensor, torch.Tensor]] = {}


def moe_fused_decode(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
                     slots: ExpertSlots, shared: ExpertSlots | None,
                     logit: torch.Tensor | None,
                     cfg: MoEFusedConfig | MoEFused2Config) -> torch.Tensor:
    """sum_j wts[t, j] * expert_{ids[t, j]}(x_t) (+ sigmoid(logit[t]) * shared(x_t)).

    x [N, H] contiguous (N <= MOE_FUSED_MAX_TOKENS), ids / wts flat [N * topk], NVFP4 `slots`
    and `shared` (slot 0, same H and F) checked by `fused_moe`; logit [N, 1] with `shared`.
    Returns [N, H] in x.dtype. A MoEFused2Config runs the two-launch "fused2" decode
    (`moe_fused2_decode`), a MoEFusedConfig the one-launch "fused" one. No host
    synchronisation.
    """
    if isinstance(cfg, MoEFused2Config):
        return moe_fused2_decode(x, ids, wts, topk, slots, shared, logit, cfg)
    n, h, f = x.shape[0], slots.hidden_size, slots.intermediate_size
    block_f = cfg.block_f
    while f % block_f:  # NOTE: F is a multiple of 16 (slot layout)
        block_f //= 2
    acc, cnt = decode_workspace(x.device, h, MOE_FUSED_MAX_TOKENS, _ACC_DTYPES[cfg.accum])
    # [N, H]: every row is written by its token's last program
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sh = shared if shared is not None else slots
    assert slots.w13_scale is not None and sh.w13_scale is not None
    kp = topk + (shared is not None)
    _kernels().moe_fused_decode_kernel[(n * kp, f // block_f)](
        x, ids, wts, logit if logit is not None else wts,
        slots.w13.view(torch.int64), slots.w13_scale, slots.w13_global,
        slots.w2.view(torch.int64), slots.w2_scale, slots.w2_global,
        sh.w13.view(torch.int64), sh.w13_scale, sh.w13_global,
        sh.w2.view(torch.int64), sh.w2_scale, sh.w2_global,
        acc, cnt, out, x.stride(0), logit.stride(0) if logit is not None else 0,
        H=h, F=f, TOPK=topk, HAS_SHARED=shared is not None, BLOCK_F=block_f,
        BLOCK_B=min(cfg.block_b, _next_pow2(h // 16)), BLOCK_H=min(cfg.block_h, _next_pow2(h)),
        IS_H2=cfg.decode == "h2", USE_ASM=x.device.type == "cuda",
        FINISH_BLOCK=min(1024, _next_pow2(h)), IS_FIXED=cfg.accum == "fixed",
        num_warps=cfg.num_warps)
    return out


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()
