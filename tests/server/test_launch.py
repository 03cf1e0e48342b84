"""`tinyserve run` / `tinyserve demo` as a user runs them: a subprocess on an ephemeral port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.fakes import free_port
from tinyserve.cli import build_parser
from tinyserve.server.launch import server_config

ROOT = Path(__file__).resolve().parents[2]


def _start(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tinyserve", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _stop(proc: subprocess.Popen) -> tuple[int, str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def _wait_ok(url: str, proc: subprocess.Popen, timeout: float = 90) -> list[dict]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            r = httpx.get(url + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        seen.append(r.json())
        if r.status_code == 200:
            return seen
        assert r.status_code == 503 and r.json()["status"] == "loading"
        time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout} s: {seen[-3:]}")


def test_run_serves_a_checkpoint(tiny_checkpoint):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ckpt = tiny_checkpoint(max_position_embeddings=2048)  # the one test_e2e uses
    proc = _start("run", str(ckpt), "--port", str(port), "--device", "cpu",
                  "--served-model-name", "tiny", "--api-key", "secret", "--max-seqs", "2")
    try:
        _wait_ok(url, proc)
        auth = {"Authorization": "Bearer secret"}
        assert httpx.get(url + "/v1/models").status_code == 401
        card = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]
        assert card["id"] == "tiny" and card["context_length"] == 2048
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 3,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        code, out, err = _stop(proc)
    assert code in (0, 130), err  # 130: uvicorn re-raises the SIGINT after a clean shutdown
    assert f"http://127.0.0.1:{port}/v1" in out
    # the plan first (what `tinyserve plan` prints for these flags), then the bar
    assert out.index("memory plan for the CPU") < out.index(f"http://127.0.0.1:{port}/v1")
    assert "context 2,048 tokens per sequence, 2 sequences at a time" in out
    assert "loading weights: 100%" in err


def test_run_bad_model_fails_with_one_line(tmp_path):
    port = free_port()
    proc = _start("run", str(tmp_path / "missing"), "--port", str(port), "--device", "cpu")
    code, out, err = _stop_after_exit(proc)
    assert code == 1
    assert "tinyserve: error:" in err and "Traceback" not in err


def _stop_after_exit(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        return _stop(proc)
    return proc.returncode, out, err


@pytest.mark.slow
def test_demo_makes_and_serves_a_random_model(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start("demo", "--port", str(port), env={"TINYSERVE_CACHE_DIR": str(tmp_path)})
    try:
        _wait_ok(url, proc, timeout=180)
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tinyserve-demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4})
        assert r.status_code == 200
    finally:
        code, out, err = _stop(proc)
    assert code in (0, 130)
    assert "random" in out.lower()
    assert (tmp_path / "demo-checkpoint" / "config.json").is_file()


def test_server_config_from_cli_args(monkeypatch):
    args = build_parser().parse_args(["run", "m", "--api-key", "a,b", "--cors-origin", "x",
                                      "--cors-origin", "y", "--always-include-usage"])
    cfg = server_config(args, "m")
    assert cfg.api_keys == ("a", "b") and cfg.cors_origins == ("x", "y")
    assert cfg.always_include_usage and cfg.served_model_name == "m"
    monkeypatch.setenv("TINYSERVE_API_KEY", "envkey")
    args = build_parser().parse_args(["demo"])
    assert server_config(args, "d").api_keys == ("envkey",)
