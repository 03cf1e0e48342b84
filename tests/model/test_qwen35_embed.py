"""The embedding as the model's first stage: `forward(ctx)` equals `forward(ctx, hidden)` from
`embed(ids)` (hidden never written), and a host table gathers from `ctx.input_ids_cpu`, not
from the device ids (which would cost a device -> host synchronisation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.core import ScheduledSeq
from tinyserve.model.qwen35 import Qwen35Model


@pytest.fixture(scope="module")
def runner():
    return build_runner(*checkpoint("bf16", "tiny"), page_size=4)


def _prefill_ctx(runner, n: int, seed: int):
    """A fresh prefill of `n` random tokens from position 0 (reads no cached state, so it
    can run again with the same result)."""
    ids = torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    seq = ScheduledSeq("e", ids, 0, list(range(-(-n // 4))), 0, sample=True)
    return runner.prepare([seq], all_logits=True)


def _forward(model, ctx, hidden=None) -> torch.Tensor:
    return model.forward(ctx, hidden)


def test_forward_from_hidden_equals_forward(runner) -> None:
    model = runner.model
    ctx = _prefill_ctx(runner, 11, seed=0)
    assert torch.equal(ctx.input_ids_cpu, ctx.input_ids.cpu())
    want = _forward(model, ctx)
    hidden = model.embed(ctx.input_ids)
    assert hidden.shape == (11, model.config.hidden_size) and hidden.dtype == model.dtype
    assert torch.equal(hidden, model.embed_tokens[ctx.input_ids])
    kept = hidden.clone()
    assert torch.equal(_forward(model, ctx, hidden), want)
    assert torch.equal(hidden, kept)
    assert torch.equal(model.embed_host(ctx.input_ids_cpu), kept)


def test_host_table_gathers_from_host_ids(runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the table on the host, the forward embeds `input_ids_cpu` (here different from
    the poisoned device ids), through a buffer it gathers into; without host ids it falls
    back to the device ids."""
    model = runner.model
    ctx = _prefill_ctx(runner, 9, seed=1)
    want = _forward(model, ctx)
    poisoned = dataclasses.replace(ctx, input_ids=(ctx.input_ids + 7) % 500)
    monkeypatch.setattr(Qwen35Model, "embed_on_host", property(lambda self: True))
    seen = []
    real = model.embed_host

    def embed_host(ids, out=None):
        seen.append((ids.tolist(), out is not None))
        return real(ids, out=out)

    monkeypatch.setattr(model, "embed_host", embed_host)
    assert torch.equal(_forward(model, poisoned), want)
    assert seen == [(ctx.input_ids_cpu.tolist(), True)]
    fallback = dataclasses.replace(poisoned, input_ids_cpu=None)
    assert not torch.equal(_forward(model, fallback), want)
    assert seen[-1] == (poisoned.input_ids.tolist(), True)


def test_embed_on_host_compares_device_kinds_not_names(runner) -> None:
    # "cpu:0" is host RAM as much as "cpu"; only a host table under a device model gathers
    # on the host (on CUDA, "cuda:0" vs "cuda" would gather a device table into host memory).
    cfg, w = checkpoint("bf16", "tiny")
    assert not cfg.tie_word_embeddings
    m = runner.model
    for embed_device in (None, "cpu", "cpu:0"):
        model = Qwen35Model(cfg, w, kv=m.kv, states=m.states, device="cpu",
                            dtype=torch.float32, embed_device=embed_device)
        assert not model.embed_on_host, embed_device
