"""Programmatic dependent launch from Triton kernels (sm_90+; the launcher passes
`launch_pdl=True`): the kernel's programs may start while the previous kernel in the stream
still runs, and `dependent_launch_point` is where they wait for its writes.

Modes (`PDL` constexpr of the kernels that take it; `launch.PDL_MODES` names them):
- PDL_OFF: an ordinary launch, no wait;
- PDL_WAIT_FIRST: the wait comes first; only the launch and the programs' start overlap the
  previous kernel;
- PDL_WEIGHTS_FIRST: the kernel requests its weights, then waits. The weights must not be
  written by the kernel launched right before it (true of model weights, which no kernel of
  a step writes).
This module imports triton at the top (the kernel modules that use it do too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.launch import PDL_MODES

PDL_OFF = tl.constexpr(PDL_MODES["off"])
PDL_WAIT_FIRST = tl.constexpr(PDL_MODES["wait_first"])
PDL_WEIGHTS_FIRST = tl.constexpr(PDL_MODES["weights_first"])


@triton.jit
def dependent_launch_point():
    """Wait until the previous kernel's writes are visible, then let the next kernel launch
    (a no-op pair in an ordinary launch)."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
