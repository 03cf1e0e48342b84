"""`tinyserve run | demo | plan | quantize | bench`.

Each subcommand is a thin layer over a function of the package that owns the work; those
modules load only when their subcommand runs, so `tinyserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tinyserve import __version__
from tinyserve.kv.registry import KV_BACKEND_NAMES as KV_CHOICES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--kv", choices=KV_CHOICES, default="bf16", help="KV cache format")
    p.add_argument("--gpu-memory", default=None,
                   help="GPU memory budget, e.g. 6GiB (default: what the device has free)")
    p.add_argument("--max-context", type=int, default=None,
                   help="longest sequence (prompt + output) in tokens")
    p.add_argument("--max-seqs", type=int, default=None, help="most sequences decoded at once")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="where the model runs (default: cuda when available)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="decode eagerly instead of replaying CUDA graphs")
    p.add_argument("--expert-cache-slots", type=int, default=None,
                   help="offload the routed experts behind a GPU cache of this many slots "
                        "(default: the memory plan decides)")


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
    p.add_argument("--kv", choices=KV_CHOICES, default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    _add_server_args(p)
    p.set_defaults(handler="tinyserve.server.launch:demo_command")

    p = sub.add_parser("plan", help="print the GPU memory plan for a checkpoint")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler="tinyserve.offload.planner:plan_command")

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
    p.set_defaults(handler="tinyserve.engine.bench:bench_command")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as exc:
        # Loader, planner and config errors are one-line messages meant for the user.
        print(f"tinyserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
