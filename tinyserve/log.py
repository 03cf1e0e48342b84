"""The one logger factory of tinyserve."""

from __future__ import annotations

import logging
import sys

from tinyserve import envs

_CONFIGURED = False


def get_logger(name: str) -> logging.Logger:
    """A logger under the `tinyserve` hierarchy, configured once from TINYSERVE_LOG_LEVEL."""
    global _CONFIGURED
    if not _CONFIGURED:
        root = logging.getLogger("tinyserve")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.LOG_LEVEL.get())
        root.propagate = False
        _CONFIGURED = True
    if not name.startswith("tinyserve"):
        name = f"tinyserve.{name}"
    return logging.getLogger(name)
