"""Typed environment variables. Every variable tinyserve reads is declared here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Env:
    name: str
    default: str
    help: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)


@dataclass(frozen=True)
class StrEnv(_Env):
    def get(self) -> str:
        return self.raw()


@dataclass(frozen=True)
class BoolEnv(_Env):
    def get(self) -> bool:
        return self.raw().strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class PathEnv(_Env):
    def get(self) -> Path:
        return Path(os.path.expanduser(self.raw()))


LOG_LEVEL = StrEnv("TINYSERVE_LOG_LEVEL", "INFO", "log level of the tinyserve loggers")
CACHE_DIR = PathEnv("TINYSERVE_CACHE_DIR", "~/.cache/tinyserve",
                    "compiled kernels and the demo checkpoint")
DISABLE_KERNELS = BoolEnv("TINYSERVE_DISABLE_KERNELS", "0",
                          "run the pure-torch references even on a GPU")
CUDA_ARCH = StrEnv("TINYSERVE_CUDA_ARCH", "",
                   "build the CUDA kernels as PTX for this older architecture (sm_80, sm_86, "
                   "sm_89, ...) and take its code paths (empty: the GPU's own)")
API_KEY = StrEnv("TINYSERVE_API_KEY", "",
                 "API key(s), comma-separated, when `tinyserve run` gets no --api-key")
FULLSIZE_DIR = StrEnv("TINYSERVE_FULLSIZE_DIR", "",
                      "tests and benches: the full-size random checkpoint (bench.fullsize)")
WRITE_RESULTS = BoolEnv("TINYSERVE_WRITE_RESULTS", "0",
                        "tests: also write their measured figures to bench/results/*.json")
BENCH_COMMIT = StrEnv("TINYSERVE_BENCH_COMMIT", "",
                      "commit recorded in bench results (empty: the checkout's git HEAD)")
