from __future__ import annotations

import pytest
import torch

from tinyserve.core import ParamError, SamplingParams, ScheduledSeq
from tinyserve.engine.sampler import Sampler, token_logprobs


def seq(params: SamplingParams, history=(), num_generated=0, rid="r") -> ScheduledSeq:
    return ScheduledSeq(rid, [1], max(len(history) - 1, 0), [0], 0, True, params,
                        list(history), num_generated)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(4)]
    seqs.append(seq(SamplingParams(temperature=0.7, top_k=1)))
    assert torch.equal(Sampler()(logits, seqs), logits.argmax(-1))


def test_draws_follow_the_distribution() -> None:
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = p.log().expand(n, 4).clone()
    tokens = Sampler()(logits, [seq(SamplingParams())] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, p, atol=0.015), freq


def test_temperature_sharpens() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0]]).expand(5000, 2).clone()
    hot = Sampler()(logits, [seq(SamplingParams(temperature=2.0))] * 5000)
    cold = Sampler()(logits, [seq(SamplingParams(temperature=0.2))] * 5000)
    assert (cold == 0).float().mean() > 0.99 > (hot == 0).float().mean() > 0.55


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),  # 0.4 + 0.3 reaches 0.7
    (SamplingParams(top_p=0.75), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),  # floor 0.2
    (SamplingParams(top_k=3, top_p=0.5), {0, 1}),
], ids=["top_k", "top_p_exact", "top_p", "min_p", "top_k_top_p"])
def test_filters_never_draw_outside(params: SamplingParams, allowed: set[int]) -> None:
    torch.manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = p.log().expand(4000, 5).clone()
    tokens = Sampler()(logits, [seq(params)] * 4000)
    assert set(tokens.tolist()) == allowed


def test_seed_reproduces_independent_of_batch() -> None:
    logits = torch.randn(1, 100)
    params = SamplingParams(seed=1234)
    alone = [Sampler()(logits, [seq(params, num_generated=k)]).item() for k in range(20)]
    others = torch.randn(3, 100)
    batched = []
    for k in range(20):
        batch = torch.cat([others, logits])
        seqs = [seq(SamplingParams(seed=k + 7)), seq(SamplingParams()),
                seq(SamplingParams(temperature=0.0)), seq(params, num_generated=k)]
        batched.append(Sampler()(batch, seqs)[3].item())
    assert alone == batched
    assert len(set(alone)) > 5  # it does sample, not repeat one token
    other_seed = [Sampler()(logits, [seq(SamplingParams(seed=99), num_generated=k)]).item()
                  for k in range(20)]
    assert other_seed != alone


def test_repetition_penalty() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler()(logits, [seq(params, history=[0, 3])]).item() == 1
    # negative logits are multiplied: token 2 falls below token 3 once seen
    logits = torch.tensor([[-5.0, -5.0, -1.0, -1.1]])
    assert Sampler()(logits, [seq(params, history=[2])]).item() == 3


def test_presence_and_frequency_apply_to_output_only() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    # prompt token 0 is not penalised by presence / frequency
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert Sampler()(logits, [seq(p, history=[0, 0], num_generated=0)]).item() == 0
    assert Sampler()(logits, [seq(p, history=[2, 0], num_generated=1)]).item() == 1
    f = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert Sampler()(logits, [seq(f, history=[2, 0], num_generated=1)]).item() == 0
    assert Sampler()(logits, [seq(f, history=[2, 0, 0], num_generated=2)]).item() == 1


PENALISED = [SamplingParams(temperature=0.0, repetition_penalty=1.4),
             SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.6),
             SamplingParams(temperature=0.9, seed=2, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.5)]


def test_chained_penalties_count_on_the_device() -> None:
    """A chained call (the host's history one token behind) samples what an unchained call
    with the full history samples: the counts the previous call advanced on the device equal
    counts rebuilt from the history, step after step."""
    torch.manual_seed(3)
    prompt = [1, 2, 3, 2]
    chained, serial = Sampler(), Sampler()
    hist = [list(prompt) for _ in PENALISED]
    steps = [torch.randn(len(PENALISED), 6) * 0.3 for _ in range(12)]
    for gen, logits in enumerate(steps):
        rows = list(enumerate(zip(PENALISED, hist, strict=True)))
        full = [seq(p, h, gen, f"r{j}") for j, (p, h) in rows]
        # the chained sampler sees the history of the step before (first call: unchained);
        # the step count is known ahead (`Scheduler.schedule_next`)
        stale = [seq(p, h[:-1] if gen else h, gen, f"r{j}") for j, (p, h) in rows]
        want = serial(logits, full)
        got = chained(logits, stale, chained=gen > 0)
        assert torch.equal(got, want), gen
        for h, t in zip(hist, want.tolist(), strict=True):
            h.append(t)
    assert len({tuple(h[len(prompt):]) for h in hist}) > 1  # the penalties did something
    # counts of requests missing from a call are dropped; chaining them is an error
    chained(steps[0][:1], [seq(PENALISED[0], hist[0], len(steps), "r0")])
    with pytest.raises(RuntimeError, match="r1"):
        chained(steps[0][1:2], [seq(PENALISED[1], hist[1], len(steps), "r1")], chained=True)


def test_hook_forces_tokens_through_the_sampler() -> None:
    def force(logits, seqs):
        out = torch.full_like(logits, float("-inf"))
        out[:, 7] = 0.0
        return out

    logits = torch.randn(3, 20)
    seqs = [seq(SamplingParams()), seq(SamplingParams(temperature=0.0)),
            seq(SamplingParams(top_p=0.1, seed=3))]
    assert Sampler(force)(logits, seqs).tolist() == [7, 7, 7]


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 logit rows for 1"):
        Sampler()(torch.randn(2, 4), [seq(SamplingParams())])


@pytest.mark.requires_cuda
def test_cuda_matches_cpu_greedy_and_seeded_is_stable() -> None:
    logits = torch.randn(4, 248320)
    seqs = [seq(SamplingParams(temperature=0.0)), seq(SamplingParams(top_k=50, seed=5)),
            seq(SamplingParams(top_p=0.9, seed=6)), seq(SamplingParams(min_p=0.1))]
    gpu = Sampler()(logits.cuda(), seqs)
    assert gpu.device.type == "cuda"
    assert gpu[0].item() == logits[0].argmax().item()
    again = Sampler()(logits.cuda(), seqs)
    assert gpu[1:3].tolist() == again[1:3].tolist()


def test_logit_bias_bans_and_forces() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    top = logits.argmax(-1)
    seqs = [seq(SamplingParams(temperature=0.0, logit_bias={int(top[0]): -100})),
            seq(SamplingParams(temperature=0.0, logit_bias={7: 100, 8: -1.5})),
            seq(SamplingParams(temperature=0.0))]
    sampler = Sampler()
    assert not sampler.argmax_only(seqs) and sampler.chainable
    out = sampler(logits, seqs)
    assert out[0] != top[0] and out[1] == 7 and out[2] == top[2]
    # sampled rows never draw a banned token; the logits passed in are not modified
    before = logits.clone()
    many = [seq(SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100}))] * 3000
    drawn = sampler(torch.zeros(3000, 4), many)
    assert set(drawn.tolist()) == {2, 3} and torch.equal(logits, before)


def test_logit_bias_comes_after_the_penalties() -> None:
    # token 3 was seen: repetition 2 halves its logit 4 to 2, then the bias adds 4 -> 6 > 5
    # (biased first, (4 + 4) / 2 = 4 would lose to token 5)
    logits = torch.zeros(1, 8)
    logits[0, 3], logits[0, 5] = 4.0, 5.0
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 4.0})
    assert Sampler()(logits, [seq(p, history=[3, 1])]).item() == 3


def test_logit_bias_beyond_the_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler()(torch.zeros(1, 8), [seq(SamplingParams(logit_bias={8: 1.0}))])


def test_logit_bias_params_are_checked_and_normalised() -> None:
    p = SamplingParams(logit_bias={9: 1, 2: -100.0})
    assert p.logit_bias == ((2, -100.0), (9, 1.0)) and SamplingParams().logit_bias == ()
    assert SamplingParams(logit_bias=[(9, 1), (2, -100)]) == p
    for bad in ({"9": 1}, {-1: 1}, {True: 1}, {9: 100.5}, {9: "up"}, [(9, 1), (9, 2)]):
        with pytest.raises(ParamError) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.param == "logit_bias"


def test_token_logprobs_of_the_rows_that_ask() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=2)), seq(SamplingParams()),
            seq(SamplingParams(temperature=0.0, logprobs=0))]
    assert not Sampler().argmax_only([seqs[0]]) and Sampler().argmax_only([seqs[2]]) is False
    tokens = torch.tensor([4, 9, 17])
    rows, ks, chosen, ids, lps = token_logprobs(logits, seqs, tokens)
    ref = torch.log_softmax(logits, -1)
    assert rows == [0, 2] and ks == [2, 0]
    assert torch.allclose(chosen, ref[[0, 2], [4, 17]])
    assert ids.shape == (2, 2) and torch.equal(ids[0], ref[0].topk(2).indices)
    assert token_logprobs(logits, [seqs[1]] * 3, tokens) is None
