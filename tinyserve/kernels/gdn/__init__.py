"""Gated DeltaNet kernels: the causal conv and the gated delta rule, chunked for prefill
(`chunk`, settings in `config`) and recurrent for decode, in Triton (`triton`) beside the
torch references of `ref`; `ops` holds the public entry points."""

from tinyserve.kernels.gdn.chunk import chunk_configs_chosen
from tinyserve.kernels.gdn.ops import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    gdn_decode,
    gdn_prefill,
)

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update", "chunk_configs_chosen", "gdn_decode",
           "gdn_prefill"]
