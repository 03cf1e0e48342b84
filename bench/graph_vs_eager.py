"""Graph vs eager greedy decode of the full-size checkpoint under one kernel setting.

Runs `tests/engine/test_fullsize_graph.run_case` (two sequences, one decoded through the CUDA
graphs, one eagerly on the same inputs) in this process after applying `--mode`, and prints
how many tokens agree and the largest logit difference. One mode per process (a fresh build);
used to find which kernel change made graph and eager disagree.

    python bench/graph_vs_eager.py MODE [--ckpt DIR] [--kv bf16] [--steps 8]
    modes: as_is | fused_on (the fused MoE decode on, as shipped) | fused_off (the fused MoE
           decode off: the gemv path + the separate shared expert) | fused_default_tile
           (the fused decode with `MoEFusedConfig()` instead of the table's tiles) |
           gemv_old (lm_head back on the non-persistent GEMV) | both_off (fused_off +
           gemv_old)

Every kernel of the decode sums in a fixed order, so every mode should give all tokens
identical and a largest logit difference of 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

import test_fullsize_graph as fg  # noqa: E402

from tinyserve.engine.config import EngineConfig  # noqa: E402
from tinyserve.kernels import fused_moe_decode as fmd  # noqa: E402
from tinyserve.kernels import nvfp4_tiles as nt  # noqa: E402

OLD_LM_HEAD = nt.GemvConfig(16, 128, 4, 0, vec=4, num_stages=3, decode="h2")


def apply(mode: str) -> None:
    if mode in ("fused_on", "fused_default_tile", "gemv_old"):
        fmd.MOE_FUSED_DECODE = True
    if mode in ("fused_off", "both_off"):
        fmd.MOE_FUSED_DECODE = False
    if mode == "fused_default_tile":
        fmd.MOE_FUSED_TILES.clear()
    if mode in ("gemv_old", "both_off"):
        nt.GEMV_TILES[(248320, 2048)] = OLD_LM_HEAD


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["as_is", "fused_off", "fused_on", "fused_default_tile",
                                    "gemv_old", "both_off"])
    p.add_argument("--ckpt", default="/tmp/tinyserve-fullsize")
    p.add_argument("--kv", default="bf16")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    apply(args.mode)
    cfg = EngineConfig(model=args.ckpt, kv=args.kv, gpu_memory=None, max_seqs=2,
                       max_context=2 * (fg.PROMPT_LEN + args.steps + 64), prefix_cache=False)
    steps = fg.run_case(cfg, fg.PROMPT_LEN, args.steps)["steps"]
    same = sum(s["graph"] == s["eager"] for s in steps)
    print(f"{args.mode}: {same}/{len(steps)} tokens identical, max logit diff "
          f"{max(s['max_diff'] for s in steps):.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
