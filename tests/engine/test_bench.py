from __future__ import annotations

import json

import pytest

from tinyserve.cli import main


def test_bench_command_on_the_tiny_checkpoint(tiny_checkpoint, capsys) -> None:
    ckpt = tiny_checkpoint()
    assert main(["bench", str(ckpt), "--device", "cpu", "--prompt-len", "12", "--gen-len", "5",
                 "--batch", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["batch"] == 3 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    assert r["ttft_s"]["max"] >= r["ttft_s"]["mean"] > 0
    # the plan `tinyserve run` makes with these flags: the model's whole context
    assert r["config"]["max_context"] == 512 and r["peak_memory_bytes"] is None
    assert r["config"]["max_seqs"] == 3 and r["memory_plan"]["max_seqs"] == 3
    assert r["decode_step_ms"] > 0 and r["graphs_captured"] == 0 and r["steps"] >= 4
    assert r["date"].endswith("Z") and "commit" in r  # the checkout's, None outside one
    assert main(["bench", str(ckpt), "--device", "cpu", "--prompt-len", "4", "--gen-len",
                 "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan for the CPU") and "decode" in out
    assert main(["bench", str(ckpt), "--device", "cpu", "--batch", "0"]) == 2
    assert main(["bench", str(ckpt), "--device", "cpu", "--max-context", "64"]) == 2
    assert "the plan holds 64" in capsys.readouterr().err


def test_bench_reports_the_measured_runs_expert_cache(tiny_checkpoint, capsys) -> None:
    # experts offloaded behind a cache of one layer's experts: the hit rate is the measured
    # run's (its hits and misses), not the engine's since start with the warm-up in it
    ckpt = tiny_checkpoint()
    assert main(["bench", str(ckpt), "--device", "cpu", "--prompt-len", "8", "--gen-len", "4",
                 "--expert-cache-slots", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    cache = r["expert_cache"]
    assert cache["misses"] > 0 and cache["h2d_bytes"] > 0
    assert r["expert_hit_rate"] == pytest.approx(
        cache["hits"] / (cache["hits"] + cache["misses"]))


@pytest.mark.requires_cuda
def test_bench_on_cuda_captures_no_graph_in_the_measured_run(tiny_checkpoint, capsys) -> None:
    # positions 250 .. 257 cross the 256-token graph capacity: the warm-up decodes through it
    ckpt = tiny_checkpoint()
    assert main(["bench", str(ckpt), "--device", "cuda", "--prompt-len", "250", "--gen-len",
                 "8", "--batch", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["graphs_captured"] == 0 and r["decode_step_ms"] > 0 and r["decode_tok_s"] > 0
