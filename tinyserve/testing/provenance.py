"""Which code a measurement ran: the commit recorded in bench results."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tinyserve import envs

_CHECKOUT = Path(__file__).resolve().parents[2]


def current_commit() -> str | None:
    """TINYSERVE_BENCH_COMMIT when set (a copied tree whose .git is not its own), else the
    short git HEAD of the checkout holding this package; None outside a checkout."""
    if envs.BENCH_COMMIT.get():
        return envs.BENCH_COMMIT.get()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_CHECKOUT,
                              check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
