"""Host expert store: exact size, the slot layout of `write_slot`, filled from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyserve.kernels.moe.fused import pack_expert_slots
from tinyserve.model.config import load_config
from tinyserve.model.loader import load_weights
from tinyserve.offload.store import HostExpertStore, slot_fields


@pytest.fixture(scope="module")
def tiny_nvfp4(tmp_path_factory) -> Path:
    from tinyserve.testing.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    make_tiny_checkpoint(path, fmt="modelopt", seed=3)
    return path


def test_store_matches_packed_slots(tiny_nvfp4: Path) -> None:
    config = load_config(tiny_nvfp4)
    weights = load_weights(tiny_nvfp4, config)
    store = HostExpertStore.from_checkpoint(tiny_nvfp4, config)
    assert store.complete and store.pinned == torch.cuda.is_available()  # pinned where it helps
    e = config.num_experts
    for layer in range(config.num_layers):
        p = f"layers.{layer}.mlp.experts"
        ref = pack_expert_slots([(weights[f"{p}.{i}.gate_proj"], weights[f"{p}.{i}.up_proj"],
                                  weights[f"{p}.{i}.down_proj"]) for i in range(e)], "cpu")
        for name in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"):
            got = getattr(store.slots, name)[layer * e:(layer + 1) * e]
            assert torch.equal(got, getattr(ref, name)), (layer, name)
    again = HostExpertStore.from_weights(weights, config)
    for name in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"):
        assert torch.equal(getattr(again.slots, name), getattr(store.slots, name))


def test_store_is_one_exact_buffer() -> None:
    store = HostExpertStore(3, 4, 64, 32, fp4=True)
    fields = slot_fields(12, 64, 32, fp4=True, dtype=torch.bfloat16)
    payload = sum(torch.Size(s).numel() * dt.itemsize for _, s, dt in fields)
    assert payload <= store.nbytes < payload + 4096 * len(fields)
    assert store.buffer.numel() == store.nbytes
    assert store.bytes_per_expert == 3 * 32 * 64 // 2 + 3 * 32 * 64 // 16 + 12
    for name, _, _ in fields:  # every field is a view into the one buffer
        t = getattr(store.slots, name)
        assert t.untyped_storage().data_ptr() == store.buffer.untyped_storage().data_ptr()
    assert not store.complete
    with pytest.raises(ValueError, match="layer 0 expert 0 is missing"):
        store.check_complete()


def test_dense_store(tiny_nvfp4: Path) -> None:
    store = HostExpertStore(2, 3, 64, 32, fp4=False, dtype=torch.float32)
    assert store.slots.w13.shape == (6, 64, 64) and store.slots.w13_scale is None
    assert not store.add("layers.0.mlp.gate", None)


@pytest.mark.requires_cuda
def test_store_is_pinned_on_cuda() -> None:
    store = HostExpertStore(2, 8, 256, 128, fp4=True)
    assert store.pinned
    # Registered memory: a device copy from it runs asynchronously.
    dst = torch.empty_like(store.slots.w13[0], device="cuda")
    dst.copy_(store.slots.w13[3], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), store.slots.w13[3])
