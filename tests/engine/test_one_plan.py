"""One config chain, one memory plan: `tinyserve plan`, `tinyserve run`, `tinyserve bench` and
the offline `LLM` make the same EngineConfig from the same settings, and `plan` and `run`
print the identical plan, on the Qwen3.5-35B-A3B geometry (a checkpoint of real headers over
sparse files: the planner reads config files and headers only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.fakes import free_port
from tinyserve.cli import build_parser, main
from tinyserve.engine import build, planner
from tinyserve.engine.bench import bench_config
from tinyserve.engine.config import EngineConfig, describe_size
from tinyserve.engine.device_memory import DeviceMemory

MiB = 1 << 20


@pytest.fixture(scope="module")
def geometry(tmp_path_factory) -> Path:
    from bench.fullsize import write_fullsize_checkpoint

    return write_fullsize_checkpoint(tmp_path_factory.mktemp("geom") / "Qwen3.5-35B-A3B-NVFP4",
                                     sparse=True)


@pytest.fixture
def measured_gpu(monkeypatch):
    """The device as a GPU machine measures it at start-up (fixed numbers here)."""
    def device_memory(config: EngineConfig, *, measure: bool = True) -> DeviceMemory:
        return DeviceMemory(device="cuda", name="Test GPU", budget=config.gpu_memory_bytes,
                            budget_source=f"--gpu-memory {describe_size(config.gpu_memory)}",
                            startup=472 * MiB,
                            startup_source="measured at start-up (NVML, this process)")

    monkeypatch.setattr(planner, "device_memory", device_memory)


class _Stop(Exception):
    pass


FLAGS = [["--kv", "iso3", "--gpu-memory", "6GiB"],
         ["--kv", "iso3", "--gpu-memory", "6G", "--max-context", "32768"],
         ["--kv", "bf16", "--gpu-memory", "8GiB", "--max-seqs", "2"]]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: " ".join(f[1::2]))
def test_plan_and_run_print_the_identical_plan(geometry, measured_gpu, monkeypatch, capsys,
                                               flags) -> None:
    assert main(["plan", str(geometry), *flags]) == 0
    planned = capsys.readouterr().out.strip()
    assert planned.startswith("memory plan for cuda (Test GPU)")

    def stop(config, *, plan=None, progress=None):
        raise _Stop("stopped after the plan")  # (loading the sparse checkpoint is not the point)

    monkeypatch.setattr(build, "build_engine", stop)
    assert main(["run", str(geometry), *flags, "--port", str(free_port())]) == 1
    out, err = capsys.readouterr()
    assert planned in out
    assert "stopped after the plan" in err
    if flags == FLAGS[0]:  # the laptop default: >= 128k tokens, the expert cache the rest
        assert "KV iso3, 131,072 tokens" in planned
        assert "context 131,072 tokens per sequence, 1 sequence at a time" in planned


def test_run_bench_and_llm_make_the_same_config(geometry, monkeypatch) -> None:
    from tinyserve.engine import llm

    flags = ["--kv", "iso3", "--gpu-memory", "6GiB", "--max-context", "65536"]
    parser = build_parser()
    run = EngineConfig.from_args(parser.parse_args(["run", str(geometry), *flags]))
    bench = bench_config(parser.parse_args(["bench", str(geometry), *flags]))
    made = []

    def capture(config, **kwargs):
        made.append(config)
        raise _Stop

    monkeypatch.setattr(llm, "build_engine", capture)
    with pytest.raises(_Stop):
        llm.LLM(str(geometry), kv="iso3", gpu_memory="6GiB", max_context=65536)
    assert run == bench == made[0]
    assert run.max_seqs is None  # the plan decides (one sequence when offloading)
    # a batch is asked for: as many sequences
    batch = bench_config(parser.parse_args(["bench", str(geometry), *flags, "--batch", "3"]))
    assert batch.max_seqs == 3
