"""The benchmark suite (bench/run.py): every script is in one suite (or runnable by name), the
suites' commands resolve, and every script still imports against today's package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))

from bench import run  # noqa: E402

HELPERS = {"cache_sim", "common", "fullsize", "routing", "run"}


def test_every_script_has_one_place() -> None:
    listed = [s.name for suite in run.SUITES.values() for s in suite] + list(run.TOOLS)
    scripts = {p.stem for p in BENCH.glob("*.py")} - HELPERS
    assert sorted(listed) == sorted(scripts)


def test_dry_run_lists_every_suite_command(capsys) -> None:
    assert run.main([*run.SUITES, "--dry", "--ckpt", "/ckpt"]) == 0
    out = capsys.readouterr().out
    for suite, scripts in run.SUITES.items():
        for s in scripts:
            assert f"== {suite}/{s.name}: python bench/{s.name}.py" in out
    assert "python bench/step_profile.py /ckpt --kv iso3" in out
    assert "--ckpt /ckpt-realistic --uniform-ckpt /ckpt" in out


def test_unknown_suite_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "nope"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown suite or script" in proc.stderr


def test_every_script_imports() -> None:
    """Importing runs no benchmark (each has a main guard) but resolves every name a script
    takes from tinyserve, so a renamed or deleted function fails here rather than on a GPU."""
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    code = ("import importlib, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/bench']\n"
            "for n in sys.argv[2:]: importlib.import_module(n)")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
