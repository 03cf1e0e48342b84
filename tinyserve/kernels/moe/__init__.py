"""Mixture-of-experts kernels: the router (`router`), the fused expert kernels over expert
slots (`fused`, which picks the path by `choose_path`: the NVFP4 decode of `decode`, a GEMV or
a tensor-core dot), the CPU expert kernel (`cpu`, numba) and the host-row copies of offloaded
experts (`host_rows`)."""

from tinyserve.kernels.moe.fused import (
    ExpertSlots,
    allocate_expert_slots,
    choose_path,
    describe,
    fused_moe,
    fused_moe_ref,
)

__all__ = ["ExpertSlots", "allocate_expert_slots", "choose_path", "describe", "fused_moe",
           "fused_moe_ref"]
