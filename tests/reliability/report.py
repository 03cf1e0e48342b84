"""Figures the reliability tests add up over a session (requests served, disconnects, bad
inputs, 5xx responses, leaked pages and slots), printed by the terminal summary hook in
conftest.py whatever the capture mode, and written to bench/results/reliability_cpu.json only
when TINYSERVE_WRITE_RESULTS=1 (so a plain test run leaves the tree clean)."""

from __future__ import annotations

import datetime
import json
import platform
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "reliability_cpu.json"

FIGURES = ("requests_served", "disconnects_injected", "disconnects_in_prefill",
           "disconnects_in_decode", "disconnects_non_streaming", "faults_injected",
           "bad_inputs_tried", "responses_5xx", "leaked_kv_pages", "leaked_state_slots",
           "leaked_prefix_cache_refs", "checkpoint_faults_tried", "preemptions",
           "engine_aborts_injected")

_lock = threading.Lock()
_figures: dict[str, int] = dict.fromkeys(FIGURES, 0)
_tests: dict[str, str] = {}


def add(name: str, n: int = 1) -> None:
    """Add `n` to figure `name` (thread-safe)."""
    with _lock:
        _figures[name] = _figures.get(name, 0) + int(n)


def record_test(nodeid: str, outcome: str) -> None:
    with _lock:
        _tests[nodeid] = outcome


def touched() -> bool:
    return bool(_tests)


def summary() -> dict[str, Any]:
    import torch

    with _lock:
        return {"name": "reliability_cpu", "date": datetime.datetime.now(
                    datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": platform.processor() or platform.machine(),
                "torch": torch.__version__, "figures": dict(_figures), "tests": dict(_tests)}


def write(path: Path | None = None) -> Path | None:
    """Write `summary()` to `path` (default RESULT when TINYSERVE_WRITE_RESULTS is set);
    returns the file written, or None when nothing was asked for."""
    from tinyserve import envs

    if path is None:
        if not envs.WRITE_RESULTS.get():
            return None
        path = RESULT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(), indent=2) + "\n")
    return path


def lines(data: dict[str, Any], written: Path | None) -> list[str]:
    f = data["figures"]
    return [
        f"requests served: {f['requests_served']}",
        f"disconnects injected: {f['disconnects_injected']} (prefill "
        f"{f['disconnects_in_prefill']}, decode {f['disconnects_in_decode']}, non-streaming "
        f"{f['disconnects_non_streaming']})",
        f"engine aborts injected (no HTTP): {f['engine_aborts_injected']}",
        f"engine faults injected: {f['faults_injected']}, preemptions under load: "
        f"{f['preemptions']}",
        f"bad inputs tried: {f['bad_inputs_tried']}",
        f"checkpoint faults tried: {f['checkpoint_faults_tried']}",
        f"5xx responses: {f['responses_5xx']}",
        f"leaked KV pages: {f['leaked_kv_pages']}, leaked state slots: "
        f"{f['leaked_state_slots']}, leaked prefix-cache references: "
        f"{f['leaked_prefix_cache_refs']}",
        f"written to {_shown(written)}" if written else
        f"not written (TINYSERVE_WRITE_RESULTS=1 writes {_shown(RESULT)})",
    ]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
