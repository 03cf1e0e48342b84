"""The benchmarks' debug throttle (`kernels.throttle`): `hold` keeps the stream until the
listed rows' time has passed since the last `stamp` on the same GPU, however it is named."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels import throttle


def test_hold_checks_its_rows() -> None:
    with pytest.raises(ValueError, match="int32 on a CUDA device"):
        throttle.hold(torch.zeros(3, dtype=torch.int32), 1e-3)
    with pytest.raises(ValueError, match="int32 on a CUDA device"):
        throttle.hold(torch.zeros(3, 2, dtype=torch.int32), 1e-3)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("named", ["cuda", "cuda:0"])
def test_hold_waits_for_the_listed_rows(named: str) -> None:
    rows = torch.tensor([4, -1, 0, 7, -1], dtype=torch.int32, device="cuda:0")  # 3 listed
    per_row = 2e-3
    throttle.stamp(named)  # compile both kernels outside the timing
    throttle.hold(rows, 0.0)
    assert throttle._clock(named) is throttle._clock(rows.device)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        throttle.stamp(named)
        throttle.hold(rows, per_row)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    assert min(times) >= 0.95 * 3 * per_row, times
    assert max(times) < 3 * 3 * per_row, times
