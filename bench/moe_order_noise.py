"""CPU emulation: does the fp32 atomic order of the one-launch MoE decode alone make two decodes
of the random full-shape model disagree?

`SparseMoE.forward` at 1 token is replaced by the kernel's math (that kernel is removed now;
tiles 16 features per program): fp32 gate_up and silu * up, one [H] down partial per (pair,
16-feature chunk), times the routing weight (the shared expert: sigmoid(gate logit) rounded
to the model dtype), summed in fp32 in a random (`random`) or a fixed (`fixed`) order, rounded
to the model dtype. Both sequences of `tests/engine/test_fullsize_graph.run_case` then decode
eagerly (A teacher-forced on B's tokens), so only the sum order differs between them. Prints
per step the tokens, the largest logit difference and how many layers routed differently.

    python -c "from tinyserve.testing.fullsize import write_fullsize_checkpoint as w; \
        w('/tmp/fs8', layers=8, vocab_size=512)"
    python bench/moe_order_noise.py random /tmp/fs8 6    # MODE CKPT STEPS

Slow (dequantizes every expert it uses): 8 layers x 6 steps ~9 min, 16 x 6 ~14 min on 2
CPU cores; 3.9 / 7.6 GB of host RAM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

import test_fullsize_graph as fg  # noqa: E402

from tinyserve.engine.config import EngineConfig  # noqa: E402
from tinyserve.kernels.nvfp4_ref import dequantize_nvfp4  # noqa: E402
from tinyserve.model import moe as moe_mod  # noqa: E402
from tinyserve.model.linear import linear  # noqa: E402

BLOCK_F = 16  # features per program (the H200 table's tiles)


class _EagerOnly:
    """Stands in for the decode graphs: B decodes eagerly too."""

    failed = False
    num_graphs = 0

    def supports(self, seqs) -> bool:
        return False


def main() -> int:
    mode, ckpt = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    gen = torch.Generator().manual_seed(1234)
    orig = moe_mod.SparseMoE.forward
    routes: list[list[int]] = []
    cache: dict = {}

    def emulated(self, x):
        if x.shape[0] != 1:
            return orig(self, x)
        router_logits, gate_logit = linear(x, self.router), linear(x, self.shared_gate)
        ids, weights = moe_mod.topk_softmax(router_logits, self.top_k, x.dtype)
        routes.append(sorted(ids[0].tolist()))
        xf = x[0].float()
        pairs = [(*self.experts.experts[self.layer_id][int(e)], weights[0, j].float())
                 for j, e in enumerate(ids[0])]
        pairs.append((self.gate, self.up, self.down,
                      torch.sigmoid(gate_logit[0, 0].float()).to(x.dtype).float()))
        parts = []
        for g, u, d, w in pairs:
            key = (id(g), id(d))
            if key not in cache:
                if len(cache) > 120:
                    cache.pop(next(iter(cache)))
                cache[key] = tuple(dequantize_nvfp4(t) for t in (g, u, d))
            wg, wu, wd = cache[key]
            gv, uv = wg @ xf, wu @ xf
            h = gv * torch.sigmoid(gv) * uv  # [F] fp32
            for c in range(0, h.shape[0], BLOCK_F):
                parts.append((wd[:, c:c + BLOCK_F] @ h[c:c + BLOCK_F]) * w)
        order = (torch.randperm(len(parts), generator=gen) if mode == "random"
                 else torch.arange(len(parts)))
        acc = torch.zeros_like(parts[0])
        for i in order.tolist():
            acc += parts[i]
        return acc.to(x.dtype)[None]

    moe_mod.SparseMoE.forward = emulated
    fg.DecodeGraphs = lambda *a, **k: _EagerOnly()
    cfg = EngineConfig(model=ckpt, device="cpu", dtype="bfloat16", max_seqs=3,
                       max_num_batched_tokens=64, max_context=256, prefix_cache=False)
    res = fg.run_case(cfg, 24, steps, capture=False)
    n = res["layers"]
    differ = [sum(a != b for a, b in zip(routes[(2 * s + 1) * n:(2 * s + 2) * n],
                                         routes[2 * s * n:(2 * s + 1) * n], strict=True))
              for s in range(steps)]
    for s, st in enumerate(res["steps"]):
        print(f"step {s}: B {st['graph']} A {st['eager']} max_diff {st['max_diff']:.4g} "
              f"max_abs {st['max_abs']:.4g} layers routed differently {differ[s]}")
    print("SUMMARY", mode, json.dumps({
        "layers": n, "identical": sum(s["graph"] == s["eager"] for s in res["steps"]),
        "steps": steps, "max_diff": max(s["max_diff"] for s in res["steps"]),
        "routing_diff_layers": differ}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
