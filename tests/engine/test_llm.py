"""The offline LLM API end to end on the tiny random checkpoint (CPU, fp32)."""

from __future__ import annotations

import time

import pytest
import torch

from tinyserve.core import SamplingParams
from tinyserve.engine.llm import LLM
from tinyserve.engine.scheduler import RequestRejected

PROMPTS = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 3, "42"]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint()


@pytest.fixture(scope="module")
def llm(ckpt):
    # A small step budget so that prefill is chunked and mixed with decodes.
    with LLM(str(ckpt), device="cpu", max_context=128, max_seqs=4,
             max_num_batched_tokens=16) as llm:
        yield llm


def assert_idle(llm: LLM) -> None:
    s = llm.engine.stats()
    assert (s.running, s.waiting, s.kv_pages_used, s.state_slots_used) == (0, 0, 0, 0)


def test_batched_equals_alone(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in together)
    assert together[0].prompt_token_ids == llm.encode(PROMPTS[0])
    assert_idle(llm)


def test_seeds_reproduce(llm: LLM) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)
    first = llm.generate(PROMPTS[0], p)[0].token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(max_tokens=16, seed=3), p, SamplingParams()])
    assert mixed[1].token_ids == first
    other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, seed=12, ignore_eos=True))
    assert other[0].token_ids != first


def _force(llm: LLM, text: str):
    script = llm.encode(text)

    def hook(logits, seqs):
        out = torch.full_like(logits, -1e9)
        for i, s in enumerate(seqs):
            out[i, script[min(s.num_generated, len(script) - 1)]] = 0.0
        return out

    return hook


def test_stop_strings_and_lengths(llm: LLM) -> None:
    llm.engine.set_logits_hook(_force(llm, "Hello world. The weather is sunny today."))
    try:
        c = llm.generate("x", SamplingParams(max_tokens=40, stop=["sunny", "Paris"]))[0]
        assert (c.text, c.finish_reason) == ("Hello world. The weather is ", "stop")
        c = llm.generate("x", SamplingParams(max_tokens=3))[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 3
        assert c.text == llm.tokenizer.decode(c.token_ids)
    finally:
        llm.engine.set_logits_hook(None)
    assert_idle(llm)


def test_eos_stops(llm: LLM) -> None:
    eos = llm.engine.scheduler.eos_token_ids
    llm.engine.set_logits_hook(_force(llm, "Hi<|im_end|>"))
    try:
        c = llm.generate("x", SamplingParams(max_tokens=40))[0]
    finally:
        llm.engine.set_logits_hook(None)
    assert c.finish_reason == "stop" and c.token_ids[-1] in eos and c.text == "Hi"


def test_abort_frees_everything(llm: LLM) -> None:
    h = llm.engine.submit(llm.encode(PROMPTS[1]), SamplingParams(max_tokens=70, ignore_eos=True))
    h.get(timeout=30)
    h.abort()
    assert h.result(timeout=30).finish_reason == "abort"
    time.sleep(0.05)
    assert_idle(llm)


def test_rejects_what_cannot_fit(llm: LLM) -> None:
    with pytest.raises(RequestRejected, match="context limit of 128"):
        llm.generate(["short", "long " * 200], SamplingParams(max_tokens=8))
    assert_idle(llm)


def test_logits_match_transformers(llm: LLM, ckpt) -> None:
    from transformers import Qwen3_5MoeForCausalLM

    hf = Qwen3_5MoeForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = llm.encode(PROMPTS[1])[:40]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    got = llm.logits(ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()

    # The same through generate(): prefill of one token, then forced decode steps.
    rows = []

    def capture(logits, seqs):
        rows.append(logits[0].clone())
        out = torch.full_like(logits, -1e9)
        out[0, ids[min(seqs[0].num_generated + 1, len(ids) - 1)]] = 0.0
        return out

    llm.engine.set_logits_hook(capture)
    try:
        llm.generate([ids[:1]], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    finally:
        llm.engine.set_logits_hook(None)
    decoded = torch.stack(rows).cpu()
    assert (decoded - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.requires_cuda
def test_cuda_generate_logits_and_abort(ckpt) -> None:
    with LLM(str(ckpt), device="cuda", max_context=256, max_seqs=4) as gpu:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = gpu.generate(PROMPTS, params)
        assert all(c.finish_reason == "length" and len(c.token_ids) == 16 for c in outs)
        p = SamplingParams(max_tokens=16, seed=5, ignore_eos=True)
        assert gpu.generate(PROMPTS[0], p)[0].token_ids == gpu.generate(PROMPTS[0], p)[0].token_ids
        ids = gpu.encode(PROMPTS[1])[:40]
        got = gpu.logits(ids)
        with LLM(str(ckpt), device="cpu", max_context=128, max_seqs=1) as cpu:
            ref = cpu.logits(ids)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert cos.min() > 0.99, cos.min()
        h = gpu.engine.submit(ids, SamplingParams(max_tokens=200, ignore_eos=True))
        h.get(timeout=60)
        h.abort()
        assert h.result(timeout=60).finish_reason == "abort"
        time.sleep(0.1)
        assert_idle(gpu)


def test_preemption_recomputes_exactly(llm: LLM, ckpt) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [p[:60] for p in PROMPTS]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    with LLM(str(ckpt), device="cpu", max_context=96, max_seqs=3, num_kv_pages=7,
             max_num_batched_tokens=32) as small:
        got = small.generate(prompts, params)
        assert small.engine.stats().preemptions > 0
        assert_idle(small)
    assert [c.token_ids for c in got] == alone


def test_logit_bias_bans_and_forces_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = llm.generate(PROMPTS[0], greedy)[0].token_ids
    banned = {t: -100.0 for t in set(plain)}
    other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True, logit_bias=banned))[0]
    assert not set(other.token_ids) & set(plain)
    forced = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.9, seed=1,
                                                     ignore_eos=True, logit_bias={7: 100}))[0]
    assert forced.token_ids == [7] * 6
    vocab = llm.engine._vocab
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPTS[2], SamplingParams(logit_bias={vocab: 1.0}))
    assert_idle(llm)


def test_logprobs_are_the_models(llm: LLM) -> None:
    # each token's log-probability and its top 3 are the teacher-forced logits' log-softmax
    # (the model's distribution: temperature and penalties do not change them)
    prompt = llm.encode(PROMPTS[0])
    for params in (SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
                   SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True,
                                  repetition_penalty=1.3, logprobs=0)):
        out = llm.generate(prompt, params)[0]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        ref = torch.log_softmax(llm.logits(prompt + out.token_ids[:-1])[len(prompt) - 1:], -1)
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - ref[step, lp.token_id].item()) < 1e-4
            assert len(lp.top) == params.logprobs
            top = ref[step].topk(params.logprobs) if params.logprobs else None
            if top is not None:
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert max(abs(a - b) for (_, a), b in zip(lp.top, top.values.tolist(),
                                                          strict=True)) < 1e-4
        if params.temperature == 0.0:  # greedy: the sampled token is the most likely one
            assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)
    assert llm.generate(prompt, SamplingParams(max_tokens=2))[0].logprobs == []
    assert_idle(llm)
