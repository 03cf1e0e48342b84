"""`Engine.warm_up`: one throwaway request through the loop that leaves no trace."""

from __future__ import annotations

import pytest

from tinyserve.core import SamplingParams
from tinyserve.engine.build import build_engine
from tinyserve.engine.config import EngineConfig


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_warm_up_leaves_no_trace(tiny_checkpoint, device) -> None:
    """On CUDA with the engine's defaults: kernels, decode graphs."""
    common = dict(model=str(tiny_checkpoint()), device=device, max_context=160, max_seqs=2,
                  max_num_batched_tokens=64, page_size=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 43))
    with build_engine(EngineConfig(**common)).start() as cold:
        expected = cold.submit(prompt, params).result(timeout=120).token_ids
    with build_engine(EngineConfig(**common)).start() as engine:
        seen = []
        launch = engine.runner.launch

        def counting(batch, **kw):
            seen.extend((s.request_id, s.start_pos, s.num_tokens) for s in batch.seqs)
            return launch(batch, **kw)

        engine.runner.launch = counting
        assert engine.warm_up() > 0
        # 2.5 chunks of 64 within the context (158 tokens): a chunk without a prefix, one as
        # long as its prefix, then shorter ones (the scheduler may split at snapshot points)
        prefill = [x for x in seen if x[2] > 1]
        assert prefill[:2] == [("warm-up", 0, 64), ("warm-up", 64, 64)]
        assert sum(x[2] for x in prefill) == 158 and all(x[2] < x[1] for x in prefill[2:])
        assert sum(x[2] == 1 for x in seen) == 1  # the second token comes from the last one
        s = engine.stats()
        assert (s.running, s.kv_pages_used, s.state_slots_used) == (0, 0, 0)
        assert (s.requests_submitted, s.requests_finished, s.prompt_tokens_total) == (0, 0, 0)
        assert s.ttft_seconds == () and s.itl_seconds == () and s.steps == 0
        assert s.prefix_cache_pages == 0 and s.prefix_cache_snapshots == 0
        assert engine.submit(prompt, params).result(timeout=120).token_ids == expected
        assert engine.stats().requests_finished == 1
