"""Graph and eager decode give the same greedy tokens on the full-size random Qwen3.5-35B-A3B
NVFP4 checkpoint (`bench.fullsize`, at $TINYSERVE_FULLSIZE_DIR), built as `tinyserve run`
builds it (`engine.build.build_parts`): --kv iso3 and bf16, experts resident and under
--gpu-memory 6GiB, each case in a fresh process (the allocator cap of a budget counts every
byte the process still holds).

Two sequences (state slots 0 and 1, their own KV pages) get the same random prompt. B decodes
greedily through the runner's CUDA graphs; A decodes eagerly, teacher-forced on B's inputs,
so a difference at one step cannot change the later inputs. At every step the eager argmax
must be the graph token; a flip passes only at a near-tie of the eager logits (top-1 minus
the graph token's logit within twice the step's largest logit difference) and is recorded
with its gap. With TINYSERVE_WRITE_RESULTS=1 every case goes to bench/results/fullsize_graph.json.

On CPU the same comparison runs on the tiny checkpoint through the static decode path
(`DecodeGraphs` without capture), and the judging of the steps on hand-made records.

    TINYSERVE_FULLSIZE_DIR=/tmp/tinyserve-fullsize python -m pytest -m slow \
        tests/engine/test_fullsize_graph.py
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the child process: run from a checkout
    sys.path.insert(0, str(ROOT))

from tinyserve import envs  # noqa: E402
from tinyserve.core import PENDING_TOKEN, Batch, SamplingParams, ScheduledSeq  # noqa: E402
from tinyserve.engine.build import build_parts  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402
from tinyserve.engine.graph import DecodeGraphs  # noqa: E402
from tinyserve.testing.provenance import current_commit  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
PROMPT_LEN, STEPS = 300, 16
REL_TOL = 0.05  # largest |graph - eager| logit over the largest |eager| logit, per step
RESULT = ROOT / "bench" / "results" / "fullsize_graph.json"


def compare_graph_eager(runner: Any, prompt: list[int], steps: int, *,
                        pages: tuple[list[int], list[int]], slots: tuple[int, int] = (0, 1),
                        chunk: int = 2048) -> dict:
    """Prefill `prompt` eagerly into two sequences (A: `slots[0]`, `pages[0]`; B: the second),
    then `steps` greedy decode steps: B through `runner.graphs`, A eagerly on B's input token.
    B's first half of the steps is synchronous (each launched after the last one's token is
    read); from the middle on, when the runner can chain, each B step is launched before the
    previous one's token is read, with its input token taken on the device (the engine's
    decode loop), while A follows on the host.

    Returns {"prefill_tokens": [A, B], "steps": [per-step record], "graphs_captured",
    "graphs_failed"}; a step record holds the input token, the graph and eager tokens, the
    largest |graph - eager| logit ("max_diff"), the largest |eager| logit ("max_abs"), the
    eager logit gap top-1 minus the graph token ("gap"), whether the graph logits are all
    finite and whether B's step was chained. Raises ValueError when the runner has no decode
    graphs.
    """
    graphs = runner.graphs
    if graphs is None:
        raise ValueError("the runner decodes eagerly only (no decode graphs)")

    def step(seq: ScheduledSeq, eager: bool) -> tuple[int | None, torch.Tensor | None]:
        runner.graphs = None if eager else graphs
        try:
            out = runner.forward(Batch([seq]))
        finally:
            runner.graphs = graphs
        if not seq.sample:
            return None, None
        return out.next_tokens[0], out.logits[0].float().cpu()

    first = []
    for name, page_ids, slot in zip("ab", pages, slots, strict=True):
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            seq = ScheduledSeq(name, part, start, page_ids, slot,
                               sample=start + len(part) == len(prompt), params=GREEDY)
            token, _ = step(seq, eager=True)
        first.append(token)
    def b_seq(token: int, pos: int) -> ScheduledSeq:
        return ScheduledSeq("b", [token], pos, pages[1], slots[1], sample=True, params=GREEDY)

    token, records, pending = first[1], [], None
    for i in range(steps):
        pos = len(prompt) + i
        chained = pending is not None  # launched during the last step
        nxt = Batch([b_seq(PENDING_TOKEN, pos + 1)])
        chain_next = steps // 2 <= i + 1 < steps and runner.can_chain(nxt)
        if pending is None:
            if chain_next:  # a chain starts from a launched step
                pending = runner.launch(Batch([b_seq(token, pos)]))
            else:
                got, got_logits = step(b_seq(token, pos), eager=False)
        if pending is not None:
            following = runner.launch(nxt, after=pending) if chain_next else None
            out = pending.result()
            got, got_logits = out.next_tokens[0], out.logits[0].float().cpu()
            pending = following
        want, ref = step(ScheduledSeq("a", [token], pos, pages[0], slots[0], sample=True,
                                      params=GREEDY), eager=True)
        records.append({
            "input": token, "graph": got, "eager": want,
            "max_diff": (got_logits - ref).abs().max().item(),
            "max_abs": ref.abs().max().item(),
            "gap": (ref.max() - ref[got]).item(),
            "finite": bool(torch.isfinite(got_logits).all()),
            "chained": chained,
        })
        token = got
    return {"prefill_tokens": first, "steps": records, "graphs_captured": graphs.num_graphs,
            "graphs_failed": graphs.failed}


def judge(steps: list[dict], rel_tol: float = REL_TOL) -> tuple[list[str], list[dict]]:
    """(problems, flips) of `compare_graph_eager`'s step records. A problem: non-finite graph
    logits, a logit difference over `rel_tol` of the largest eager logit, or a token flip that
    is not a near-tie (eager gap > 2 x the step's largest logit difference). Flips: every step
    whose tokens differ, with its gap."""
    problems, flips = [], []
    for i, s in enumerate(steps):
        if not s["finite"]:
            problems.append(f"step {i}: non-finite graph logits")
        if s["max_diff"] > rel_tol * s["max_abs"]:
            problems.append(f"step {i}: logits differ by {s['max_diff']:.4g} "
                            f"(largest eager logit {s['max_abs']:.4g})")
        if s["graph"] != s["eager"]:
            flips.append({"step": i, "graph": s["graph"], "eager": s["eager"], "gap": s["gap"],
                          "max_diff": s["max_diff"]})
            if s["gap"] > 2 * s["max_diff"]:
                problems.append(f"step {i}: graph token {s['graph']} != eager {s['eager']}, "
                                f"eager logit gap {s['gap']:.4g} is not a near-tie (largest "
                                f"logit difference {s['max_diff']:.4g})")
    return problems, flips


def run_case(config: EngineConfig, prompt_len: int, steps: int, *, capture: bool = True,
             seed: int = 0) -> dict:
    """Build the engine's parts for `config`, then `compare_graph_eager` over a random prompt.

    `capture=False` runs the static decode path without CUDA graphs (CPU); it takes state slot
    `max_seqs - 1` for padded rows, so `config.max_seqs` must be >= 3 then.
    """
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    parts = build_parts(config)
    build_s = time.perf_counter() - t0
    runner = parts.runner
    runner.keep_logits = True  # compared below
    if not capture:
        if config.max_seqs < 3:
            raise ValueError("capture=False needs max_seqs >= 3 (a spare state slot)")
        runner.graphs = DecodeGraphs(runner.model, page_size=config.page_size,
                                     pad_state_slot=config.max_seqs - 1, capture=False)
    ps = config.page_size
    per = -(-(prompt_len + steps + 1) // ps)
    if 2 * per > parts.num_kv_pages:
        raise ValueError(f"{2 * per} KV pages needed, the pool has {parts.num_kv_pages}")
    vocab = min(parts.model_config.vocab_size, len(parts.tokenizer))
    prompt = torch.randint(0, vocab, (prompt_len,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    t0 = time.perf_counter()
    out = compare_graph_eager(runner, prompt, steps,
                              pages=(list(range(per)), list(range(per, 2 * per))),
                              chunk=config.max_num_batched_tokens)
    plan = parts.memory_plan
    out.update({
        "kv": config.kv, "budget": config.gpu_memory or "none", "prompt_len": prompt_len,
        "layers": parts.model_config.num_layers, "build_s": round(build_s, 1),
        "compare_s": round(time.perf_counter() - t0, 1),
        "experts_offloaded": plan is not None and plan.experts_offloaded,
        "embed_device": runner.model.embed_tokens.device.type,
    })
    if torch.cuda.is_available():
        out["max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return out


# --------------------------------------------------------------------------------------------
# CPU: the comparison on the tiny checkpoint (static decode path), the judging on records


def test_compare_on_tiny_checkpoint_cpu(tiny_checkpoint) -> None:
    config = EngineConfig(model=str(tiny_checkpoint("modelopt")), device="cpu", max_seqs=3,
                          max_num_batched_tokens=16, max_context=64, prefix_cache=False)
    res = run_case(config, prompt_len=37, steps=4, capture=False)
    assert res["prefill_tokens"][0] == res["prefill_tokens"][1]
    assert len(res["steps"]) == 4 and res["graphs_captured"] == 0 and not res["graphs_failed"]
    assert res["steps"][0]["input"] == res["prefill_tokens"][1]
    for prev, s in zip(res["steps"], res["steps"][1:], strict=False):
        assert s["input"] == prev["graph"]  # B runs free, A follows B's inputs
    assert [s["chained"] for s in res["steps"]] == [False, False, True, True]
    problems, flips = judge(res["steps"])
    assert problems == [] and flips == []
    assert max(s["max_diff"] for s in res["steps"]) < 1e-4
    assert all(s["gap"] == 0.0 for s in res["steps"])
    assert not res["experts_offloaded"] and res["embed_device"] == "cpu"
    json.dumps(res)  # what the child prints


def _rec(graph: int, eager: int, diff: float, gap: float, finite: bool = True) -> dict:
    return {"input": 1, "graph": graph, "eager": eager, "max_diff": diff, "max_abs": 10.0,
            "gap": gap, "finite": finite}


def test_judge_accepts_only_near_ties() -> None:
    assert judge([_rec(5, 5, 0.01, 0.0)] * 3) == ([], [])
    problems, flips = judge([_rec(5, 5, 0.01, 0.0), _rec(5, 6, 0.02, 0.03)])
    assert problems == [] and flips == [{"step": 1, "graph": 5, "eager": 6, "gap": 0.03,
                                         "max_diff": 0.02}]
    problems, flips = judge([_rec(5, 6, 0.02, 0.5)])
    assert len(flips) == 1 and "not a near-tie" in problems[0]
    assert "differ by" in judge([_rec(5, 5, 0.6, 0.0)])[0][0]
    assert "non-finite" in judge([_rec(5, 5, 0.0, 0.0, finite=False)])[0][0]


def test_fullsize_dir_reason(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TINYSERVE_FULLSIZE_DIR", raising=False)
    assert "TINYSERVE_FULLSIZE_DIR is not set" in _fullsize_missing()
    monkeypatch.setenv("TINYSERVE_FULLSIZE_DIR", str(tmp_path))
    assert "holds no checkpoint" in _fullsize_missing()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert _fullsize_missing() is None


# --------------------------------------------------------------------------------------------
# CUDA: the full-size checkpoint, one fresh process per case


def _fullsize_missing() -> str | None:
    """Why the full-size checkpoint cannot be used (None: it is there)."""
    raw = envs.FULLSIZE_DIR.get().strip()
    if not raw:
        return ("TINYSERVE_FULLSIZE_DIR is not set (write the ~21 GB checkpoint with "
                "`python -m bench.fullsize DIR` and point the variable at it)")
    path = Path(raw).expanduser()
    if not (path / "config.json").is_file() or not (
            path / "model.safetensors.index.json").is_file():
        return (f"TINYSERVE_FULLSIZE_DIR={raw} holds no checkpoint (write it with "
                f"`python -m bench.fullsize {raw}`)")
    return None


@pytest.fixture(scope="module")
def fullsize_dir() -> Path:
    reason = _fullsize_missing()
    if reason is not None:
        pytest.skip(reason)
    return Path(envs.FULLSIZE_DIR.get().strip()).expanduser()


def run_child(config: dict, prompt_len: int, steps: int, *, capture: bool = True,
              timeout: int = 900) -> dict:
    """`run_case` in a fresh Python process (this file as a script); returns its result."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    arg = json.dumps({"config": config, "prompt_len": prompt_len, "steps": steps,
                      "capture": capture})
    res = subprocess.run([sys.executable, __file__, arg], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (res.returncode, res.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def _record(name: str, result: dict) -> None:
    """Merge one case into bench/results/fullsize_graph.json (TINYSERVE_WRITE_RESULTS=1)."""
    if not envs.WRITE_RESULTS.get():
        return
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULT.with_suffix(".lock"), "w") as lock:  # several sessions may run at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        cases: dict = {}  # other cases of earlier runs stay; notes about them do not
        if RESULT.exists():
            try:
                cases = json.loads(RESULT.read_text()).get("cases", {})
            except ValueError:
                cases = {}
        commit = current_commit()
        cases[name] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "commit": commit, **result}
        data = {"name": "fullsize_graph", "torch": torch.__version__, "commit": commit,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "test": "tests/engine/test_fullsize_graph.py", "prompt_len": PROMPT_LEN,
                "steps": STEPS, "rel_tol": REL_TOL, "cases": cases}
        RESULT.write_text(json.dumps(data, indent=1) + "\n")


@pytest.mark.requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, "6GiB"], ids=["resident", "6GiB"])
@pytest.mark.parametrize("kv", ["iso3", "bf16"])
def test_fullsize_graph_equals_eager(fullsize_dir: Path, kv: str, budget: str | None) -> None:
    # Two sequences of PROMPT_LEN + STEPS tokens: under a budget the plan's KV pool holds
    # max_context tokens in all (shared by the sequences), so it must cover both.
    config = {"model": str(fullsize_dir), "kv": kv, "gpu_memory": budget, "max_seqs": 2,
              "max_context": 2 * (PROMPT_LEN + STEPS + 64), "prefix_cache": False}
    res = run_child(config, PROMPT_LEN, STEPS)
    problems, flips = judge(res["steps"])
    res.update({"problems": problems, "flips": flips,
                "identical": sum(s["graph"] == s["eager"] for s in res["steps"])})
    arch = envs.CUDA_ARCH.get().strip()  # an older generation's code paths (cuda_launch)
    _record(f"{kv}_{budget or 'resident'}" + (f"_{arch}" if arch else ""), res)
    if flips:
        warnings.warn(f"{kv}/{budget}: near-tie flips {flips}", stacklevel=1)
    assert res["graphs_captured"] >= 1 and not res["graphs_failed"], "no decode graph ran"
    assert res["experts_offloaded"] == (budget is not None), res["experts_offloaded"]
    assert not problems, (problems, [(s["graph"], s["eager"]) for s in res["steps"]])


if __name__ == "__main__":  # child: argv[1] = JSON {config, prompt_len, steps}
    args = json.loads(sys.argv[1])
    result = run_case(EngineConfig(**args["config"]), args["prompt_len"], args["steps"],
                      capture=args.get("capture", True))
    print("RESULT " + json.dumps(result), flush=True)
