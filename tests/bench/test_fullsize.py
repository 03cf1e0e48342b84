"""The full-size random checkpoint writer (real per-layer shapes, small vocabulary here)."""

from __future__ import annotations

import torch

from bench.fullsize import write_fullsize_checkpoint
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.device_memory import reference_device
from tinyserve.engine.planner import plan_checkpoint
from tinyserve.model.config import load_config
from tinyserve.model.loader import CheckpointReader
from tinyserve.offload.store import HostExpertStore


def test_one_layer_with_the_real_shapes(tmp_path) -> None:
    path = write_fullsize_checkpoint(tmp_path / "ck", layers=1, vocab_size=1024,
                                     max_shard_bytes=1 << 28)
    config = load_config(path)
    assert (config.num_layers, config.num_experts, config.hidden_size) == (1, 256, 2048)
    reader = CheckpointReader(path)
    assert len(reader.files) > 1
    assert reader.tensor_info("model.layers.0.mlp.experts.7.down_proj.weight") == \
        (torch.uint8, (2048, 256))
    assert reader.tensor_info("model.layers.0.linear_attn.in_proj_qkv.weight")[0] == \
        torch.float8_e4m3fn
    scales = reader.get("model.layers.0.mlp.experts.0.gate_proj.weight_scale")
    assert ((scales >= 0x30) & (scales < 0x40)).all()  # E4M3 in [0.5, 1.875]
    engine = EngineConfig(model=str(path), kv="iso3", gpu_memory="2GiB", device="cuda")
    plan = plan_checkpoint(engine, path, reference_device(engine))
    assert plan.expert_slot_bytes == 1_769_484 and plan.num_routed_experts == 256
    store = HostExpertStore.from_checkpoint(path, config, pin=False)
    assert store.complete and store.slots.w13.shape == (256, 1024, 1024)


def test_sparse_checkpoint_has_the_same_headers(tmp_path) -> None:
    """`sparse=True`: the headers of the real checkpoint over holes (for the planner)."""
    kw = dict(layers=1, vocab_size=1024, max_shard_bytes=1 << 28)
    dense = write_fullsize_checkpoint(tmp_path / "dense", **kw)
    sparse = write_fullsize_checkpoint(tmp_path / "sparse", sparse=True, **kw)
    a, b = CheckpointReader(dense), CheckpointReader(sparse)
    assert a.names() == b.names()
    assert all(a.tensor_info(n) == b.tensor_info(n) for n in a.names())
    files = sorted(sparse.glob("*.safetensors"))
    assert [f.stat().st_size for f in files] == \
        [f.stat().st_size for f in sorted(dense.glob("*.safetensors"))]
    assert sum(f.stat().st_blocks * 512 for f in files) < sum(f.stat().st_size for f in files) / 4
    again = write_fullsize_checkpoint(tmp_path / "again", **kw)  # a seed writes one checkpoint
    c = CheckpointReader(again)
    assert all(torch.equal(a.get(n).view(-1).view(torch.uint8), c.get(n).view(-1).view(torch.uint8))
               for n in a.names())


def test_realistic_routing_keeps_the_routing_channels_to_the_router(tmp_path) -> None:
    """`routing="realistic"`: a valid checkpoint whose routers read only the routing channels,
    which no layer writes; its routing is the design's (bench.routing)."""
    import json

    from bench.cache_sim import trace_from_checkpoint
    from bench.routing import ROUTING_FILE

    path = write_fullsize_checkpoint(tmp_path / "ck", layers=1, vocab_size=1024,
                                     max_shard_bytes=1 << 28, routing="realistic")
    manifest = json.loads((path / ROUTING_FILE).read_text())
    lo, hi = manifest["reserved_channels"]
    assert (lo, hi) == (1920, 2048) and len(manifest["cycle"]) == 491
    reader = CheckpointReader(path)
    gate = reader.get("model.layers.0.mlp.gate.weight")
    assert gate.dtype == torch.bfloat16 and not gate[:, :lo].any() and gate[:, lo:].all()
    for name in ("model.layers.0.mlp.experts.9.down_proj.weight",
                 "model.layers.0.mlp.shared_expert.down_proj.weight",
                 "model.layers.0.linear_attn.out_proj.weight"):
        w = reader.get(name).view(torch.uint8)
        assert not w[lo:].any() and w[:lo].any(), name
    for name in ("model.layers.0.post_attention_layernorm.weight", "model.norm.weight"):
        w = reader.get(name)
        assert not w[lo:].any() and w[:lo].any(), name
    head = reader.get("lm_head.weight")
    assert not head[500:].any() and not head[:, :hi // 2 - 32].any()
    tokens = manifest["cycle"][:6]
    trace = trace_from_checkpoint(path, tokens)
    assert trace.shape == (6, 1, 8) and (trace >= 0).all() and (trace < 256).all()
    config = load_config(path)
    store = HostExpertStore.from_checkpoint(path, config, pin=False)
    assert store.complete
