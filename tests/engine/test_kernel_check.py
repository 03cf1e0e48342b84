"""The start-up check of the GPU kernels' compilers: one line naming what is missing, before any
weight loads; nothing to check on the CPU or with the references forced."""

from __future__ import annotations

import pytest
import torch

from tinyserve.engine import kernel_check
from tinyserve.kernels import cuda_build, cuda_launch

CUDA = torch.device("cuda", 0)


def test_cpu_and_references_need_nothing(monkeypatch) -> None:
    monkeypatch.setattr(cuda_launch, "backend", lambda d: pytest.fail("checked"))
    kernel_check.check(torch.device("cpu"))
    monkeypatch.setenv("TINYSERVE_DISABLE_KERNELS", "1")
    kernel_check.check(CUDA)
    assert kernel_check.implementations(CUDA, "iso3") == {"all": "torch references"}


def test_missing_nvrtc_is_one_line(monkeypatch) -> None:
    def no_nvrtc(device):
        raise cuda_build.KernelBuildError("the CUDA kernels need NVRTC (libnvrtc.so.12 or .13) "
                                          "and none was found: pip install ...\nmore")

    monkeypatch.setattr(cuda_launch, "backend", no_nvrtc)
    with pytest.raises(kernel_check.KernelUnavailable) as err:
        kernel_check.check(CUDA)
    assert str(err.value).startswith("the CUDA kernels need NVRTC") and "\n" not in str(err.value)
    assert isinstance(err.value, OSError)  # the CLI prints it as one line


def test_a_driver_failure_is_one_line(monkeypatch) -> None:
    class Broken:
        def kernel(self, *a):
            raise RuntimeError("loading x failed: CUDA error 999 (unknown)\ntrace")

    monkeypatch.setattr(cuda_launch, "backend", lambda d: Broken())
    with pytest.raises(kernel_check.KernelUnavailable, match="cannot load on cuda:0") as err:
        kernel_check.check(CUDA)
    assert "\n" not in str(err.value)


def test_triton_without_a_c_compiler_says_so(monkeypatch) -> None:
    triton = pytest.importorskip("triton")

    class Backend:
        def kernel(self, *a):
            return object()

    class Driver:
        @property
        def utils(self):
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment")

    monkeypatch.setattr(cuda_launch, "backend", lambda d: Backend())
    monkeypatch.setattr(triton.runtime.driver, "_active", Driver(), raising=False)
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: Driver()),
                        raising=False)
    with pytest.raises(kernel_check.KernelUnavailable, match="install gcc") as err:
        kernel_check.check(CUDA)
    assert "C compiler" in str(err.value) and "\n" not in str(err.value)
