"""`tinyserve run` / `tinyserve demo` as a user runs them: a subprocess on an ephemeral port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


@pytest.mark.parametrize("argv,env", [
    (["--api-key", ","], {}), (["--api-key", ""], {}), (["--api-key", " , "], {}),
    ([], {"TINYSERVE_API_KEY": ","}), ([], {"TINYSERVE_API_KEY": "  "})],
    ids=["comma", "empty", "blanks", "env-comma", "env-blank"])
def test_an_empty_key_list_refuses_to_start(tmp_path, argv, env):
    """A key list that holds no key must not turn authentication off: one line, exit 2,
    before anything loads."""
    proc = _start("run", str(tmp_path / "never-loaded"), "--port", str(free_port()), *argv,
                  env=env)
    code, out, err = _stop_after_exit(proc)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinyserve: error:"), err
    assert "holds no API key" in err and "Traceback" not in err


def test_server_config_refuses_an_empty_key_list(monkeypatch):
    from tinyserve.server.state import ServerConfig

    for key in (",", "", " ,, "):
        with pytest.raises(ValueError, match="holds no key"):
            ServerConfig(api_key=key)
    monkeypatch.setenv("TINYSERVE_API_KEY", "")  # set but empty: as unset
    assert server_config(build_parser().parse_args(["demo"]), "d").api_keys == ()
    monkeypatch.setenv("TINYSERVE_API_KEY", " , ")
    with pytest.raises(ValueError, match="TINYSERVE_API_KEY"):
        server_config(build_parser().parse_args(["demo"]), "d")


def _stream_lines(url: str, body: dict, out: list, started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


def test_sigterm_drains_then_ends_the_rest_with_an_error_and_done(tiny_checkpoint):
    """SIGTERM: new requests and /health get 503 at once; a request that finishes within the
    grace period finishes; one that does not ends with an error event and [DONE]; exit 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start("run", str(tiny_checkpoint(max_position_embeddings=2048)), "--port",
                  str(port), "--device", "cpu", "--served-model-name", "tiny", "--max-seqs",
                  "4", "--drain-timeout", "3")
    try:
        _wait_ok(url, proc)
        body = {"model": "tiny", "prompt": "Hello", "ignore_eos": True, "stream": True}
        long_, short = [], []
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream_lines, args=(
            url, {**body, "max_tokens": 2000}, long_, started[0])),
            threading.Thread(target=_stream_lines, args=(
                url, {**body, "max_tokens": 24}, short, started[1]))]
        threads[0].start()
        assert started[0].wait(30)
        threads[1].start()
        assert started[1].wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        r = httpx.post(url + "/v1/completions", timeout=5,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(30)
        assert time.monotonic() - t0 < 3 + 10
        code, _, err = _stop_after_exit(proc)
    finally:
        if proc.poll() is None:
            _stop(proc)
    assert code == 0, err
    assert short[0] == 200 and short[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in short[-2]  # finished within the grace period
    assert long_[0] == 200 and long_[-1] == "data: [DONE]"
    error = json.loads(long_[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "shut down" in error["message"]
