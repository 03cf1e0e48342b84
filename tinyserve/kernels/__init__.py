"""GPU kernels, each beside its pure-torch reference. Nothing here imports triton or compiles
CUDA at import time."""
