"""The whole process stays inside `--gpu-memory` (its device memory as the driver counts it,
sampled by bench/memory_budget.py in a fresh process per budget): the tiny checkpoint under
2 GiB, and the full-size random Qwen3.5-35B-A3B-shaped checkpoint through loading, a
100k-token prompt and decoding under 6 GiB and 4 GiB (slow; $TINYSERVE_FULLSIZE_DIR).

    TINYSERVE_FULLSIZE_DIR=/tmp/tinyserve-fullsize python -m pytest -m slow \\
        tests/engine/test_memory_budget_cuda.py

With TINYSERVE_WRITE_RESULTS=1 the full-size run also writes bench/results/memory_budget.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.test_fullsize_graph import fullsize_dir  # noqa: F401  (fixture)
from tinyserve import envs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "memory_budget.py"

pytestmark = pytest.mark.requires_cuda


def _run(model: Path, out: Path, *args: str, timeout: float) -> dict:
    res = subprocess.run([sys.executable, str(SCRIPT), str(model), "--out", str(out), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert out.is_file(), res.stderr[-4000:]
    data = json.loads(out.read_text())
    assert not data["errors"], data["errors"]
    return data


def _check(case: dict) -> None:
    peaks = {k: v["peak_mib"] for k, v in case["phases"].items()}
    assert case["within_budget"], (case["budget"], case["peak_mib"], peaks,
                                   case["calibration"])
    # the allocator never passed its cap (what the budget leaves it)
    cap = case["plan"]["allocator_cap"] / (1 << 20)
    assert max(v["reserved_peak_mib"] for v in case["phases"].values()) <= cap


def test_tiny_checkpoint_process_stays_within_2gib(tiny_checkpoint, tmp_path) -> None:
    ckpt = tiny_checkpoint("modelopt", max_position_embeddings=4096)
    data = _run(ckpt, tmp_path / "tiny.json", "--budgets", "2GiB", "--prompt-len", "1500",
                "--gen-len", "16", "--kv", "bf16", timeout=600)
    case = data["cases"]["2GiB"]
    _check(case)
    assert case["prompt_len"] == 1500 and case["decode_tok_s"] > 0


@pytest.mark.slow
def test_fullsize_process_stays_within_6_and_4_gib(fullsize_dir: Path,  # noqa: F811
                                                   tmp_path) -> None:
    out = (SCRIPT.parent / "results" / "memory_budget.json" if envs.WRITE_RESULTS.get()
           else tmp_path / "memory_budget.json")
    data = _run(fullsize_dir, out, "--budgets", "6GiB", "4GiB", timeout=1200)
    six, four = data["cases"]["6GiB"], data["cases"]["4GiB"]
    for case in (six, four):
        _check(case)
    # 6 GiB holds the 100k-token prompt in its default 128k context
    assert "refused" not in six and six["prompt_len"] == 102400
    assert six["plan"]["max_context"] >= 102400 + 64
