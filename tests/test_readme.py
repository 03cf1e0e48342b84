"""Every command in the README runs as written.

`tinyserve demo` is started as the README says (on a free port); the curl lines and the OpenAI
SDK snippet are then run verbatim against it (only the port changed), and so are `tinyserve
plan demo` and `tinyserve bench demo`. The `tinyserve run` line starts a real server on a tiny
checkpoint named like the real one (on the CPU) and answers to that name. The CPU-only install
is the one `.ci/run` performs, and resolving it pulls no CUDA wheel. The Docker lines are
covered by tests/test_docker.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.server.fakes import free_port
from tests.server.test_launch import _start, _stop, _wait_ok

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CKPT_NAME = "Qwen3.5-35B-A3B-NVFP4"
DEMO_NAME = "tinyserve-demo"
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def _bash() -> list[str]:
    return [c for b in _blocks("bash") for c in _commands(b)]


def test_readme_names_only_real_subcommands_and_flags() -> None:
    from tinyserve.cli import build_parser

    parser = build_parser()
    lines = re.findall(r"`(tinyserve [a-z]+[^`]*)`", README)
    lines += [c for c in _bash() if c.startswith("tinyserve ")]
    for line in lines:
        argv = shlex.split(line)[1:]
        argv = [a for a in argv if a not in ("MODEL", "SRC", "DST")]
        sub = argv[0]
        positional = {"run": ["m"], "plan": ["m"], "bench": ["m"], "quantize": ["s", "d"]}
        if sub in positional and len(argv) > 1 and not argv[1].startswith("-"):
            positional[sub] = []  # the line names its model
        parser.parse_args([sub, *positional.get(sub, []), *argv[1:]])
    for flag in re.findall(r"^\| `(--[a-z-]+)", README, re.M):
        assert flag in parser._subparsers._group_actions[0].choices["run"].format_help(), flag


def test_cpu_install_is_stated_and_is_what_ci_runs() -> None:
    assert CPU_TORCH in _bash()
    assert _bash()[_bash().index(CPU_TORCH) + 1] == "pip install -e ."
    ci = (ROOT / ".ci" / "run").read_text()
    # CI runs the same command with the version pinned (a mirror may hold a newer CUDA build)
    torch_line = next(line for line in ci.splitlines()
                      if line.startswith("python -m pip install") and "torch" in line)
    assert CPU_TORCH.split()[-1] in torch_line and "--index-url" in torch_line
    assert ci.index(torch_line) < ci.index('-e ".[test]"')
    assert "nvidia" in ci and "exit 1" in ci  # CI fails when a CUDA wheel came along


@pytest.mark.slow
def test_cpu_install_pulls_no_cuda_wheel(tmp_path: Path) -> None:
    """With the CPU torch installed, resolving `pip install -e .` (and `.[test]`) installs
    nothing of CUDA's: a fresh virtual environment that sees this one's packages."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this environment has the CUDA build of torch")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for target in (".", ".[test]"):
        report = tmp_path / "report.json"
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--dry-run",
                        "--report", str(report), "-e", target], check=True, cwd=ROOT,
                       timeout=600)
        names = [i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]]
        cuda = [n for n in names if n == "torch" or n.startswith(("nvidia", "cuda"))]
        assert not cuda, (target, cuda)


def _run_lines(port: int, lines: list[str], name: str) -> None:
    for line in lines:
        line = line.replace("localhost:8000", f"127.0.0.1:{port}")
        out = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert '"error"' not in out.stdout, out.stdout
        assert name in out.stdout or "data: [DONE]" in out.stdout, out.stdout[:500]


def test_readme_examples_against_the_demo(tmp_path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    env = {"TINYSERVE_CACHE_DIR": str(tmp_path)}
    assert "tinyserve demo" in _bash()
    port = free_port()
    proc = _start("demo", "--port", str(port), env=env)
    try:
        _wait_ok(f"http://127.0.0.1:{port}", proc, timeout=180)
        curls = [c for c in _bash() if c.startswith("curl ")]
        assert len(curls) == 3 and all(DEMO_NAME in c for c in curls[:2])
        _run_lines(port, curls, DEMO_NAME)
        (snippet,) = _blocks("python")
        assert f'model="{DEMO_NAME}"' in snippet
        snippet = snippet.replace("localhost:8000", f"127.0.0.1:{port}")
        out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
    finally:
        _stop(proc)
    for line in ("tinyserve plan demo", "tinyserve bench demo"):
        assert line in _bash()
        out = subprocess.run([sys.executable, "-m", "tinyserve", *shlex.split(line)[1:]],
                             capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith("memory plan for the CPU"), out.stdout[:300]
    assert "decode" in out.stdout and "512 tokens, 128 generated" in out.stdout


def test_readme_run_line_serves_the_checkpoint_by_its_name(tiny_checkpoint, tmp_path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    ckpt = tmp_path / CKPT_NAME
    from tinyserve.testing.tiny import TINY_CONFIG_HD128

    shutil.copytree(tiny_checkpoint("modelopt", max_position_embeddings=4096, **TINY_CONFIG_HD128),
                    ckpt)  # iso3 needs head_dim 128
    (run_line,) = [c for c in _bash() if c.startswith("tinyserve run ./")]
    assert f'"model": "{CKPT_NAME}"' in README  # the README says to name it so
    port = free_port()
    argv = shlex.split(run_line)[1:]
    argv[1] = str(ckpt)
    proc = _start(*argv, "--port", str(port), "--device", "cpu", "--max-context", "2048")
    try:
        _wait_ok(f"http://127.0.0.1:{port}", proc, timeout=180)
        curls = [c for c in _bash() if c.startswith("curl ")]
        _run_lines(port, [curls[0].replace(DEMO_NAME, CKPT_NAME), curls[2]], CKPT_NAME)
    finally:
        _stop(proc)
