"""A `cuda_launch.Backend` that records launches instead of running them: the launchers' grids,
template arguments and argument lists, checked without compiling anything."""

from __future__ import annotations

from typing import Any


class _Kernel:
    def __init__(self, rec: Recorder, name: str) -> None:
        self._rec, self.name = rec, name

    def launch(self, grid: tuple[int, ...], block: int, args: tuple[Any, ...], *,
               smem: int = 0, stream: int = 0, pdl: bool = False) -> None:
        self._rec.launches.append(dict(name=self.name, grid=grid, block=block, smem=smem, pdl=pdl,
                                       args=[getattr(a, "value", a) for a in args]))

    def global_int(self, name: str) -> int:
        return 0

    def attribute(self, attr: int) -> int:
        return 0

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        pass

    def occupancy(self, block: int, smem: int) -> int:
        return 2


class Recorder:
    """H200-like numbers; `launches`: one dict per launch (name, grid, block, smem, pdl, args
    as plain values)."""

    arch, num_sms, smem_per_sm, reserved_smem_per_block = 90, 132, 233472, 1024

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def kernel(self, source: str, name: str, globals_: tuple[str, ...] = ()) -> _Kernel:
        return _Kernel(self, name)

    def stream(self) -> int:
        return 0
