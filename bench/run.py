"""The benchmark suite's one entry: each suite is a list of scripts run one after another, each
in its own process, with the arguments that reproduce the numbers docs/RESULTS.md cites.

    python bench/run.py --list                       the suites, their scripts and commands
    python bench/run.py SUITE [SUITE ...] [--ckpt DIR] [--dry]
    python bench/run.py SCRIPT [ARGS ...]            one script with its own arguments

Suites: kernels, step (the decode step and the whole engine), offload (memory, expert
offload and cache policy), serving, quality. Each script writes its JSON into bench/results/
(device, versions, date, commit and the baseline measured in the same run) and runs alone as
`python bench/<script>.py`. `--ckpt` (default $TINYSERVE_FULLSIZE_DIR, else
/tmp/tinyserve-fullsize) is the full-size checkpoint (`python -m bench.fullsize
DIR`; `DIR-realistic` with `--routing realistic`); a script that needs a GPU is skipped
without one, a script that needs the checkpoint is skipped while it is missing. A line per
script at the end: exit code and seconds. `bash bench/gpu_suite.sh` runs the CUDA tests with
the kernel and end-to-end benchmarks in one unattended GPU session.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Script:
    name: str
    args: tuple[str, ...] = ()  # "{ckpt}" stands for the full-size checkpoint
    gpu: bool = True
    ckpt: bool = False  # needs the checkpoint to be there already


SUITES: dict[str, tuple[Script, ...]] = {
    "kernels": (
        Script("kv_decode"),  # decode attention of each KV format vs bf16 SDPA
        Script("iso_attention"),  # ISO extend attention vs the bf16 cache's
        Script("nvfp4"),  # NVFP4 GEMV and MoE decode vs bf16 cuBLAS and the read time
        Script("gemv_floor"),
        Script("fp8_linear"),
        Script("gdn"),
        Script("small_ops"),
    ),
    "step": (
        Script("step_profile", ("{ckpt}", "--kv", "iso3", "--gpu-memory", "none", "6GiB"),
               ckpt=True),
        Script("decode_overhead"),
        Script("decode_modes", ("{ckpt}", "--kv", "iso3"), ckpt=True),
        Script("kv_formats", ("{ckpt}", "--prompt-lens", "1024", "--repeats", "2"), ckpt=True),
        Script("kernel_paths", ("{ckpt}", "--kv", "iso3"), ckpt=True),
    ),
    "offload": (
        Script("memory_budget", ("{ckpt}", "--budgets", "6GiB", "4GiB"), ckpt=True),
        Script("e2e_offload", ("--ckpt", "{ckpt}")),
        Script("hybrid_experts", ("--ckpt", "{ckpt}", "--gpu-memory", "6GiB", "--kv", "iso3",
                                  "--h2d-gbps", "12")),
        Script("realistic_decode", ("--ckpt", "{ckpt}-realistic", "--uniform-ckpt", "{ckpt}")),
        Script("offload_host", gpu=False),
        Script("cpu_call_phases", gpu=False),
        Script("cpu_expert_error", gpu=False),  # the int8 inputs against NVFP4's own error
        Script("cpu_round_trip"),  # the CPU expert call through the decode graph
        Script("cpu_worker_gil", gpu=False),  # the worker beside a Python thread holding the GIL
        Script("cache_policies", gpu=False),
        Script("routing_calibration", ("--layers", "2", "--tokens", "200"), gpu=False),
    ),
    "serving": (
        Script("prefix", gpu=False),
        Script("serve", gpu=False),
        Script("fairness", gpu=False),
    ),
    "quality": (
        Script("iso_quality", gpu=False),
    ),
}
# Runnable by name only: graph vs eager decode under one kernel setting (a debugging tool
# beside tests/engine/test_fullsize_graph.py, which is the check).
TOOLS = ("graph_vs_eager",)


def command(script: Script, ckpt: str) -> list[str]:
    return [sys.executable, str(BENCH / f"{script.name}.py"),
            *(a.replace("{ckpt}", ckpt) for a in script.args)]


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_suites(names: list[str], ckpt: str, dry: bool) -> int:
    gpu = dry or has_cuda()
    lines, worst = [], 0
    for suite in names:
        for script in SUITES[suite]:
            cmd = command(script, ckpt)
            shown = " ".join(["python", *(str(Path(c).relative_to(ROOT)) if c.startswith(
                str(BENCH)) else c for c in cmd[1:])])
            if script.gpu and not gpu:
                lines.append(f"{suite}/{script.name}: SKIPPED (no CUDA GPU)")
                continue
            if script.ckpt and not dry and not Path(ckpt, "config.json").exists():
                lines.append(f"{suite}/{script.name}: SKIPPED (no checkpoint at {ckpt})")
                continue
            print(f"== {suite}/{script.name}: {shown}", flush=True)
            if dry:
                continue
            t0 = time.perf_counter()
            rc = subprocess.call(cmd, cwd=ROOT)
            worst = max(worst, rc)
            lines.append(f"{suite}/{script.name}: exit {rc}, {time.perf_counter() - t0:.0f} s")
    print("\n".join(lines))
    return worst


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    scripts = {s.name for suite in SUITES.values() for s in suite} | set(TOOLS)
    if argv and argv[0] in scripts:  # one script, its own arguments
        return subprocess.call([sys.executable, str(BENCH / f"{argv[0]}.py"), *argv[1:]],
                               cwd=ROOT)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=", ".join(SUITES))
    ap.add_argument("--ckpt", default=os.environ.get("TINYSERVE_FULLSIZE_DIR",
                                                     "/tmp/tinyserve-fullsize"))
    ap.add_argument("--dry", action="store_true", help="print the commands only")
    ap.add_argument("--list", action="store_true", help="the suites and their scripts")
    args = ap.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite or script {unknown}: suites {', '.join(SUITES)}; scripts "
                 f"{', '.join(sorted(scripts))}")
    if args.list or not args.suites:
        for suite, entries in SUITES.items():
            print(f"{suite}:")
            for s in entries:
                need = "+".join(w for w, on in (("GPU", s.gpu), ("checkpoint", s.ckpt)) if on)
                print(f"  {s.name:20s} {need or 'CPU':15s} {' '.join(s.args)}")
        print(f"by name only: {', '.join(TOOLS)}")
        return 0
    return run_suites(args.suites, args.ckpt, args.dry)


if __name__ == "__main__":
    raise SystemExit(main())
