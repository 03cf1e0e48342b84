"""What runs the kernels on a GPU: a start-up check that each compiler the kernels need is
there (one line saying what is missing and how to get it, before any weight is loaded), and the
implementation each kernel family takes on this device, which the engine logs once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tinyserve import envs
from tinyserve.kernels import cuda_build, cuda_launch
from tinyserve.kernels.launch import dependent_launch

if TYPE_CHECKING:
    from tinyserve.kv.base import KVBackend


class KernelUnavailable(OSError):
    """A GPU kernel family cannot be built on this machine (the message says why, one line:
    the CLI and the server print it as they print a missing file)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check(device: torch.device) -> None:
    """Raise KernelUnavailable when the project's CUDA kernels (NVRTC and the driver) or
    Triton's (a C compiler for its launcher, at first use) cannot be built for `device`; a
    no-op with TINYSERVE_DISABLE_KERNELS=1 (the torch references run instead)."""
    if device.type != "cuda" or envs.DISABLE_KERNELS.get():
        return
    try:
        be = cuda_launch.backend(device)
        # compiles (or finds cached) and loads one small kernel: NVRTC and the driver work
        be.kernel("iso_store.cu", "iso::dequant_rows_kernel<3, float>")
    except cuda_build.KernelBuildError as exc:
        raise KernelUnavailable(str(exc).splitlines()[0]) from None
    except Exception as exc:  # noqa: BLE001 - anything else from the driver: say it in a line
        raise KernelUnavailable(f"the CUDA kernels cannot load on {device}: "
                                f"{_first_line(exc)}") from None
    try:
        import triton

        triton.runtime.driver.active.utils  # noqa: B018 - builds Triton's launcher once
    except Exception as exc:  # noqa: BLE001
        raise KernelUnavailable(
            f"Triton cannot build its CUDA launcher ({_first_line(exc)}); it needs a C "
            f"compiler at first use: install gcc (apt install gcc), or set "
            f"TINYSERVE_DISABLE_KERNELS=1 to run the slow torch references") from None


def implementations(device: torch.device, kv: KVBackend) -> dict[str, str]:
    """Kernel family -> the implementation it takes on `device` with the KV pool `kv`."""
    if device.type != "cuda" or envs.DISABLE_KERNELS.get():
        return {"all": "torch references"}
    from tinyserve.kernels import fp8, nvfp4
    from tinyserve.kernels.moe import fused as fused_moe

    be = cuda_launch.backend(device)
    major, minor = cuda_build.nvrtc_version()
    cuda = f"CUDA (NVRTC {major}.{minor}, {be.target})"
    return {
        "CUDA kernels": cuda,
        "dependent launches": "on" if dependent_launch(device) else "off (below sm_90)",
        "E4M3 scales": "cvt (sm_89+)" if be.arch >= 89 else "bit arithmetic (below sm_89)",
        "NVFP4 linear": nvfp4.describe(),
        "MoE experts": fused_moe.describe(),
        "FP8 linear": fp8.describe(),
        "GDN, norms": "Triton",
        "KV attention": (f"{kv.name} store {cuda}" if kv.name != "bf16"
                         else "bf16 paged store Triton") + f", decode: {kv.decode_impl}",
    }
