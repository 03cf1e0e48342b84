"""Load progress counts the real work: bytes read, bytes pinned (in pieces), the warm-up."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from tinyserve.engine.build import build_engine
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.progress import EXPERTS, PINNING, WARM_UP, WEIGHTS, LoadProgress
from tinyserve.kernels.moe import host_rows


def test_fraction_weighs_the_stages_by_their_cost() -> None:
    seen = []
    p = LoadProgress(on_change=lambda f, s: seen.append((round(f, 4), s)))
    p.expect(WEIGHTS, 100)
    p.expect(PINNING, 400)  # a quarter of a read byte each: 100
    p.expect(EXPERTS, 200)
    p.expect(WARM_UP, 1)  # 5 % of the whole
    p.advance(WEIGHTS, 100)
    assert p.fraction == pytest.approx(0.95 * 100 / 400)
    p.advance(PINNING, 400)
    p.advance(EXPERTS, 100)
    assert p.fraction == pytest.approx(0.95 * 300 / 400)
    p.complete(EXPERTS)
    assert p.fraction == pytest.approx(0.95) and p.stage == EXPERTS
    p.begin(WARM_UP)
    p.complete(WARM_UP)
    assert p.fraction == 1.0
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions)
    assert [s for _, s in seen][-1] == WARM_UP
    assert set(p.timings()) == {WEIGHTS, PINNING, EXPERTS, WARM_UP}


def test_building_an_engine_reports_every_byte(tiny_checkpoint) -> None:
    """Weights, then the experts read into the host store: the bar moves with the bytes and
    ends at 100 %, not at 99 % with the experts still to load."""
    from tinyserve.model.loader import CheckpointReader
    from tinyserve.model.loader_plan import plan_weights

    ckpt = tiny_checkpoint("modelopt")
    seen: list[tuple[float, str]] = []
    progress = LoadProgress(on_change=lambda f, s: seen.append((f, s)))
    config = EngineConfig(model=str(ckpt), device="cpu", max_context=64, expert_cache_slots=10)
    engine = build_engine(config, progress=progress)
    engine.shutdown()
    from tinyserve.model.config import load_config

    with CheckpointReader(ckpt) as reader:
        entries = plan_weights(reader, load_config(ckpt))
    experts = sum(e.nbytes for e in entries if e.is_expert)
    total = sum(e.nbytes for e in entries)
    assert progress.fraction == 1.0
    stages = [s for _, s in seen]
    assert stages.index(EXPERTS) > stages.index(WEIGHTS) and PINNING not in stages
    at_experts = seen[stages.index(EXPERTS)][0]  # when the experts started
    assert at_experts == pytest.approx((total - experts) / total)
    assert [f for f, _ in seen] == sorted(f for f, _ in seen)


class _FakeCudart:
    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 2
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_registration_is_one_range(monkeypatch) -> None:
    # one registration of the whole tensor (a copy spanning two is refused by the driver),
    # its bytes reported when done, unregistered when the tensor goes
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = torch.empty(10 * mmap.PAGESIZE + 100, dtype=torch.uint8)[7:]  # an unaligned start
    done: list[int] = []
    assert host_rows.register_mapped(t, "test", done.append)
    assert fake.registered == [(t.data_ptr(), t.numel())] and done == [t.numel()]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert fake.unregistered == [ptr]


def test_registration_failure_leaves_memory_pageable(monkeypatch) -> None:
    fake = _FakeCudart(fail_at=0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    assert not host_rows.register_mapped(torch.empty(9 * mmap.PAGESIZE, dtype=torch.uint8),
                                         "test")
    assert fake.registered == [] and fake.unregistered == []
