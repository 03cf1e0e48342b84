"""Checkpoint faults at load: a truncated safetensors file, a tensor of the wrong dtype, a
missing shard or tensor, a bad config. The engine builder raises one-line errors, and
`tinyserve run` prints one line and exits 1 without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.reliability import report
from tests.server.fakes import free_port

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"


def _truncate(d: Path) -> None:
    f = d / WEIGHTS
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _truncate_header(d: Path) -> None:
    f = d / WEIGHTS
    f.write_bytes(f.read_bytes()[:100])


def _garbage(d: Path) -> None:
    (d / WEIGHTS).write_bytes(b"\xff" * 4096)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / WEIGHTS))


def _wrong_dtype(d: Path) -> None:
    t = _tensors(d)
    name = next(n for n in t if n.endswith("embed_tokens.weight"))
    t[name] = t[name].to(torch.int32)
    save_file(t, str(d / WEIGHTS))


def _wrong_shape(d: Path) -> None:
    t = _tensors(d)
    name = next(n for n in t if n.endswith("input_layernorm.weight"))
    t[name] = t[name][:-1].clone()
    save_file(t, str(d / WEIGHTS))


def _missing_tensor(d: Path) -> None:
    t = _tensors(d)
    del t[next(n for n in t if "self_attn.o_proj" in n)]
    save_file(t, str(d / WEIGHTS))


def _missing_shard(d: Path) -> None:
    t = _tensors(d)
    names = sorted(t)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for fname, ns in shards.items():
        save_file({n: t[n] for n in ns}, str(d / fname))
    weight_map = {n: f for f, ns in shards.items() for n in ns}
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    (d / WEIGHTS).unlink()
    (d / "model-00002-of-00002.safetensors").unlink()


def _config_not_json(d: Path) -> None:
    (d / "config.json").write_text('{"hidden_size": 64,')


def _config_missing_field(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))


def _config_wrong_type(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = "many"
    (d / "config.json").write_text(json.dumps(cfg))


def _config_missing(d: Path) -> None:
    (d / "config.json").unlink()


FAULTS: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate, "truncated-header": _truncate_header, "garbage": _garbage,
    "wrong-dtype": _wrong_dtype, "wrong-shape": _wrong_shape,
    "missing-tensor": _missing_tensor, "missing-shard": _missing_shard,
    "config-not-json": _config_not_json, "config-missing-field": _config_missing_field,
    "config-wrong-type": _config_wrong_type, "config-missing": _config_missing,
}
# what the one-line message must name
MENTIONS = {"truncated": "truncated", "truncated-header": "truncated",
            "missing-shard": "00002", "config-not-json": "config.json",
            "config-missing": "config.json", "wrong-dtype": "embed_tokens",
            "missing-tensor": "o_proj", "config-missing-field": "hidden_size"}
CLI_FAULTS = ("truncated", "wrong-dtype", "missing-shard", "config-not-json")


@pytest.fixture(scope="module")
def broken(rel_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken_checkpoints")
    out = {}
    for name, fault in FAULTS.items():
        d = root / name
        shutil.copytree(rel_ckpt, d)
        fault(d)
        out[name] = d
    return out


@pytest.mark.parametrize("fault", list(FAULTS))
def test_engine_builder_fails_with_one_line(broken, fault: str):
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    report.add("checkpoint_faults_tried")
    with pytest.raises((ValueError, OSError)) as exc:
        build_engine(EngineConfig(model=str(broken[fault]), device="cpu", max_context=64,
                                  max_seqs=1))
    message = str(exc.value)
    assert message and "\n" not in message.strip(), message
    assert MENTIONS.get(fault, "") in message, message


# One interpreter runs `tinyserve.cli.main(["run", ...])` (what the `tinyserve` script calls)
# for each broken checkpoint, capturing stdout and stderr (tracebacks from threads included).
DRIVER = """
import contextlib, io, json, sys
from tinyserve.cli import main
out = {}
for path, port in zip(sys.argv[1::2], sys.argv[2::2]):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = main(["run", path, "--device", "cpu", "--port", port, "--max-seqs", "1"])
        except SystemExit as exc:
            code = exc.code
    out[path] = [code, o.getvalue(), e.getvalue()]
print(json.dumps(out))
"""


def test_cli_run_prints_one_line_and_exits_1(broken):
    argv = [a for fault in CLI_FAULTS for a in (str(broken[fault]), str(free_port()))]
    proc = subprocess.run([sys.executable, "-c", DRIVER, *argv], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fault in CLI_FAULTS:
        code, out, err = results[str(broken[fault])]
        report.add("checkpoint_faults_tried")
        errors = [line for line in err.replace("\r", "\n").splitlines()
                  if line.startswith("tinyserve: error:")]
        assert code == 1, (fault, code, err[-2000:])
        assert "Traceback" not in err and "Traceback" not in out, (fault, err[-2000:])
        assert len(errors) == 1, (fault, err[-2000:])
        assert MENTIONS[fault] in errors[0], (fault, errors[0])
