"""GDN state pool: shapes and dtypes, per-layer views, slot bookkeeping and its errors."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.model.config import ModelConfig


def _pool(slots: int = 3) -> GDNStatePool:
    return GDNStatePool(layer_ids=[0, 1, 2, 4], num_slots=slots, conv_dim=12, conv_kernel=4,
                        num_v_heads=4, k_head_dim=3, v_head_dim=2, device="cpu",
                        dtype=torch.bfloat16)


def test_shapes_and_views() -> None:
    pool = _pool()
    assert pool.conv.shape == (4, 3, 12, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.recurrent.shape == (4, 3, 4, 3, 2) and pool.recurrent.dtype == torch.float32
    pool.recurrent_state(4)[1].fill_(7.0)
    pool.conv_state(1)[2].fill_(3.0)
    assert (pool.recurrent[3, 1] == 7).all() and (pool.conv[1, 2] == 3).all()
    with pytest.raises(KeyError):
        pool.conv_state(3)  # not a GDN layer


def test_alloc_free_reset() -> None:
    pool = _pool()
    got = {pool.alloc() for _ in range(3)}
    assert got == {0, 1, 2} and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.alloc()
    pool.free(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free(1)
    for bad in (-1, 3, 1.0):
        with pytest.raises(ValueError):
            pool.free(bad)  # type: ignore[arg-type]
    assert pool.alloc() == 1


def test_copy_slot() -> None:
    pool = _pool()
    pool.conv.normal_()
    pool.recurrent.normal_()
    before = pool.conv[:, 1].clone(), pool.recurrent[:, 1].clone()
    pool.copy_slot(2, 0)
    assert torch.equal(pool.conv[:, 0], pool.conv[:, 2])
    assert torch.equal(pool.recurrent[:, 0], pool.recurrent[:, 2])
    assert torch.equal(pool.conv[:, 1], before[0]) and torch.equal(pool.recurrent[:, 1], before[1])
    pool.copy_slot(1, 1)
    with pytest.raises(ValueError):
        pool.copy_slot(0, 3)


def test_for_config_35b_sizes() -> None:
    cfg = ModelConfig()
    assert GDNStatePool.bytes_per_slot(cfg) == 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    small = ModelConfig(vocab_size=256, hidden_size=64, num_layers=4,
                        layer_types=("linear_attention",) * 3 + ("full_attention",),
                        num_attention_heads=4, num_kv_heads=2, head_dim=32,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32,
                        eos_token_ids=(0,))
    pool = GDNStatePool.for_config(small, 2, device="cpu", dtype=torch.float32)
    assert pool.conv.shape == (3, 2, 128, 3) and pool.recurrent.shape == (3, 2, 4, 16, 16)
