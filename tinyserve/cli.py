"""`tinyserve run | demo | plan | quantize | bench`.

Each subcommand is a thin layer over a function of the package that owns the work; those
modules load only when their subcommand runs, so `tinyserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from tinyserve import __version__
from tinyserve.engine.config import (
    DEFAULT_CONTEXT,
    DEFAULT_MAX_SEQS,
    EXPERT_MODES,
    SIZE_HELP,
    EngineConfig,
)
from tinyserve.kv.registry import KV_CHOICES


def _default(name: str) -> Any:
    """The EngineConfig field's default: the CLI's defaults are the config's."""
    return EngineConfig.__dataclass_fields__[name].default


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory, Hugging Face repo id, or 'demo' "
                                 "(the tiny random checkpoint `tinyserve demo` serves)")
    p.add_argument("--kv", choices=KV_CHOICES, default=_default("kv"), help="KV cache format")
    p.add_argument("--gpu-memory", default=_default("gpu_memory"),
                   help="device memory the whole process may use, as nvidia-smi counts it "
                        f"({SIZE_HELP}; default: what the device has free)")
    p.add_argument("--max-context", type=int, default=_default("max_context"),
                   help="longest sequence (prompt + output) in tokens (default: "
                        f"{DEFAULT_CONTEXT:,} when the experts are offloaded, else the "
                        "model's)")
    p.add_argument("--max-seqs", type=int, default=_default("max_seqs"),
                   help="most sequences decoded at once (default: 1 when the experts are "
                        f"offloaded, up to {DEFAULT_MAX_SEQS} when memory is spare; "
                        f"{DEFAULT_MAX_SEQS} on the CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=_default("device"),
                   help="where the model runs (default: cuda when available)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="decode eagerly instead of replaying CUDA graphs")
    p.add_argument("--expert-cache-slots", type=int, default=_default("expert_cache_slots"),
                   help="offload the routed experts behind a GPU cache of this many slots "
                        "(default: the memory plan decides)")
    p.add_argument("--experts", choices=EXPERT_MODES, default=_default("experts"),
                   help="offloaded experts missing from the GPU cache during decode: copied "
                        "(gpu), computed on the CPU (cpu), split by measured bandwidth "
                        "(hybrid) or, where the start-up probe predicts hybrid faster, whichever "
                        "mode decodes fastest when the engine starts (auto)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="model id clients use")
    p.add_argument("--cors-origin", action="append", default=None,
                   help="allow this browser origin (repeatable); CORS is off by default")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    p.add_argument("--always-include-usage", action="store_true",
                   help="end every stream with a usage chunk, even without "
                        "stream_options.include_usage")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM, how long running requests may take to finish before "
                        "they are aborted")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinyserve",
        description="Serve NVFP4 Qwen3.5-MoE checkpoints on small-VRAM GPUs.")
    parser.add_argument("--version", action="version", version=f"tinyserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="serve a checkpoint with an OpenAI-compatible API")
    _add_model_args(p)
    _add_server_args(p)
    p.set_defaults(handler="tinyserve.server.launch:run_command")

    p = sub.add_parser("demo", help="serve a tiny random model (its output is random text)")
    p.add_argument("--kv", choices=KV_CHOICES, default=_default("kv"))
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    _add_server_args(p)
    p.set_defaults(handler="tinyserve.server.launch:demo_command")

    p = sub.add_parser("plan", help="print the memory plan `run` makes with the same flags")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler="tinyserve.engine.planner:plan_command")

    p = sub.add_parser("quantize", help="turn a bf16 checkpoint into NVFP4")
    p.add_argument("src", help="bf16 checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--format", choices=("modelopt", "compressed-tensors"), default="modelopt")
    p.set_defaults(handler="tinyserve.model.quantize:quantize_command")

    p = sub.add_parser("bench", help="measure prefill and decode speed")
    _add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--bandwidth", action="store_true",
                   help="only probe the expert bandwidths (host read, H2D miss copy, CPU "
                        "expert kernel) on the model's expert geometry, and print the split")
    p.set_defaults(handler="tinyserve.engine.bench:bench_command")
    return parser


def _resolve_demo(args: argparse.Namespace) -> None:
    """MODEL 'demo' (when no such directory exists) is the demo's checkpoint, on the CPU
    unless --device says otherwise, as `tinyserve demo` serves it."""
    if getattr(args, "model", None) != "demo" or Path("demo").exists():
        return
    from tinyserve.testing.demo import demo_checkpoint

    args.model = str(demo_checkpoint())
    if args.device is None:
        args.device = "cpu"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = args.handler.split(":")
    try:
        _resolve_demo(args)
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        # Loader, planner and config errors are one-line messages meant for the user.
        print(f"tinyserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
