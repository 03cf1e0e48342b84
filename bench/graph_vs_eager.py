"""Graph vs eager greedy decode of the full-size checkpoint.

Runs `tests/engine/test_fullsize_graph.run_case` (two sequences, one decoded through the CUDA
graphs, one eagerly on the same inputs) in this process, and prints how many tokens agree and
the largest logit difference.

    python bench/graph_vs_eager.py [as_is] [--ckpt DIR] [--kv bf16] [--steps 8]

Every kernel of the decode sums in a fixed order, so all tokens should be identical and the
largest logit difference 0.
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="as_is", choices=["as_is"])
    p.add_argument("--ckpt", default="/tmp/tinyserve-fullsize")
    p.add_argument("--kv", default="bf16")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    cfg = EngineConfig(model=args.ckpt, kv=args.kv, gpu_memory=None, max_seqs=2,
                       max_context=2 * (fg.PROMPT_LEN + args.steps + 64), prefix_cache=False)
    steps = fg.run_case(cfg, fg.PROMPT_LEN, args.steps)["steps"]
    same = sum(s["graph"] == s["eager"] for s in steps)
    print(f"{args.mode}: {same}/{len(steps)} tokens identical, max logit diff "
          f"{max(s['max_diff'] for s in steps):.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
