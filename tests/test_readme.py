"""Every command in the README runs.

The `tinyserve run` line starts a real server on a tiny checkpoint (named like the real one, on
the CPU); the curl lines and the OpenAI SDK snippet are then run verbatim against it, with only
the port changed. The set-up lines are what CI itself runs (`.ci/run`), the demo has its own
test (tests/server/test_launch.py), and the Docker lines are covered by tests/test_docker.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.fakes import free_port
from tests.server.test_launch import _start, _stop, _wait_ok

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CKPT_NAME = "Qwen3.5-35B-A3B-NVFP4"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_readme_names_only_real_subcommands_and_flags() -> None:
    from tinyserve.cli import build_parser

    parser = build_parser()
    for line in re.findall(r"`(tinyserve [a-z]+[^`]*)`", README):
        argv = shlex.split(line)[1:]
        argv = [a for a in argv if a not in ("MODEL", "SRC", "DST")]
        sub = argv[0]
        positional = {"run": ["m"], "plan": ["m"], "bench": ["m"], "quantize": ["s", "d"]}
        parser.parse_args([sub, *positional.get(sub, []), *argv[1:]])
    for flag in re.findall(r"^\| `(--[a-z-]+)", README, re.M):
        assert flag in parser._subparsers._group_actions[0].choices["run"].format_help(), flag


def test_readme_server_commands_work(tiny_checkpoint, tmp_path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    ckpt = tmp_path / CKPT_NAME
    from tinyserve.testing import TINY_CONFIG_HD128

    shutil.copytree(tiny_checkpoint("modelopt", max_position_embeddings=4096, **TINY_CONFIG_HD128),
                    ckpt)  # iso3 needs head_dim 128; tools make a long prompt
    (run_line,) = [c for b in _blocks("bash") for c in _commands(b)
                   if c.startswith("tinyserve run ./")]
    port = free_port()
    argv = shlex.split(run_line)[1:]
    argv[1] = str(ckpt)
    proc = _start(*argv, "--port", str(port), "--device", "cpu", "--max-context", "2048")
    try:
        _wait_ok(f"http://127.0.0.1:{port}", proc, timeout=180)
        curls = [c for b in _blocks("bash") for c in _commands(b) if c.startswith("curl ")]
        assert len(curls) == 3
        for line in curls:
            line = line.replace("localhost:8000", f"127.0.0.1:{port}")
            out = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert '"error"' not in out.stdout, out.stdout
            assert CKPT_NAME in out.stdout or "data: [DONE]" in out.stdout, out.stdout[:500]
        (snippet,) = _blocks("python")
        snippet = snippet.replace("localhost:8000", f"127.0.0.1:{port}")
        out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
    finally:
        _stop(proc)
