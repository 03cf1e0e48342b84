"""The session report is written to bench/results only when TINYSERVE_WRITE_RESULTS asks."""

from __future__ import annotations

import json

import pytest

from tests.reliability import report


def test_not_written_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    target = tmp_path / "results" / "reliability_cpu.json"
    monkeypatch.setattr(report, "RESULT", target)
    monkeypatch.delenv("TINYSERVE_WRITE_RESULTS", raising=False)
    assert report.write() is None and not target.exists()
    assert "not written (TINYSERVE_WRITE_RESULTS=1" in report.lines(report.summary(), None)[-1]
    monkeypatch.setenv("TINYSERVE_WRITE_RESULTS", "1")
    assert report.write() == target
    data = json.loads(target.read_text())
    assert data["name"] == "reliability_cpu" and set(report.FIGURES) <= set(data["figures"])
    assert report.lines(data, target)[-1] == f"written to {target}"
