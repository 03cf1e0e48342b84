"""The packages import one way: core <- kernels <- model, kv, offload <- engine <- server <- cli."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tinyserve"

# Which tinyserve packages each package may import (log and envs are open to all).
ALLOWED = {
    "core": set(),
    "kernels": {"core"},
    "model": {"core", "kernels"},
    "kv": {"core", "kernels"},
    "offload": {"core", "kernels", "model", "kv"},
    "testing": {"core", "kernels", "model"},
    "engine": {"core", "kernels", "model", "kv", "offload", "testing"},
    "server": {"core", "kernels", "model", "kv", "offload", "engine", "testing"},
    "cli": {"core", "kernels", "model", "kv", "offload", "engine", "server", "testing"},
    "__init__": {"core", "engine"},
    "__main__": {"cli"},
    "log": {"envs"},
    "envs": set(),
}
OPEN = {"log", "envs"}


def _package_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: use absolute imports (from tinyserve.x import y)")
        for name in names:
            parts = name.split(".")
            if parts[0] == "tinyserve" and len(parts) > 1:
                found.add(parts[1])
    return found


FILES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_import_direction(path: Path) -> None:
    pkg = _package_of(path)
    assert pkg in ALLOWED, f"new top-level module {pkg!r}: add it to ALLOWED in {__file__}"
    bad = {p for p in _imported_packages(path) if p != pkg and p not in OPEN} - ALLOWED[pkg]
    assert not bad, f"{path.relative_to(PKG)} ({pkg}) imports {sorted(bad)} against the direction"


def test_import_without_gpu_tools() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tinyserve, tinyserve.core, tinyserve.kernels\n"
        "assert 'triton' not in sys.modules, 'importing tinyserve loaded triton'\n"
        "assert 'fastapi' not in sys.modules, 'importing tinyserve loaded fastapi'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
