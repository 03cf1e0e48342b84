"""The decode layer's small ops: torch eager ops against the fused Triton kernels.

Per op, at decode sizes of Qwen3.5-35B-A3B (batch 1 and 8): the pure-torch reference (the
code the model ran before: `*_ref` in `model/norm.py` and `model/moe.py`) and the kernel
(`kernels/norm.py`, `kernels/moe/router.py`, `kernels/glue.py`), each timed inside one
CUDA graph of CALLS back-to-back calls (median of the replays, per call), with the max
relative difference of the outputs. The `moe_glue` case is one MoE block without its routed
experts (NVFP4 shared expert, bf16 router and shared gate): separate projections + torch glue
against the block `SparseMoE.forward` builds (concatenated gate_up and router|gate, kernels).
The summary scales each op by its count per decoded token (40 layers: 30 GDN, 10 attention).

    python bench/small_ops.py            -> bench/results/small_ops.json
    python bench/small_ops.py --dry      (CPU, Triton interpreter, tiny reps: plumbing only;
                                          JSON in the temp directory)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

if "--dry" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, rand_nvfp4, run_meta  # noqa: E402

from tinyserve.core import DenseWeight  # noqa: E402
from tinyserve.model import moe  # noqa: E402
from tinyserve.model import norm as model_norm  # noqa: E402
from tinyserve.model.attention import sigmoid_mul_ref  # noqa: E402
from tinyserve.model.experts_api import ExpertsProvider  # noqa: E402
from tinyserve.model.linear import linear  # noqa: E402
from tinyserve.model.rope import PartialRoPE, norm_rope_ref  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "small_ops.json"
H, E, TOPK, F = 2048, 256, 8, 512
HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM = 16, 2, 256, 64
GDN_HEADS, GDN_DIM = 32, 128
EPS = 1e-6
# occurrences per decoded token (40 layers: 30 GDN + 10 attention)
# (add_rms_norm: the post-attention norm with its residual add, once the layer code uses it)
PER_TOKEN = {"rms_norm": 81, "add_rms_norm": 40, "q_norm_rope": 10, "k_norm_rope": 10,
             "attn_gate": 10, "gated_rms_norm": 30, "router_topk": 40, "silu_mul": 40,
             "gated_add": 40, "moe_glue": 40}


def time_us(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of `fn` inside one CUDA graph of `calls` calls (on the
    CPU: wall clock of plain calls)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e6 / calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def rel_diff(a, b) -> float:
    if isinstance(a, tuple):
        return max(rel_diff(x, y) for x, y in zip(a, b, strict=True))
    if not a.is_floating_point():
        return float((a != b).float().mean())  # ids: the share that differ
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def compare(ref_fn, fused_fn, calls: int, replays: int) -> dict:
    diff = rel_diff(fused_fn(), ref_fn())
    ref_us = time_us(ref_fn, calls, replays)
    fused_us = time_us(fused_fn, calls, replays)
    return {"torch_us": round(ref_us, 2), "fused_us": round(fused_us, 2),
            "speedup": round(ref_us / fused_us, 2), "max_rel_diff": diff}


def cases(n: int, dev: str, dt: torch.dtype):
    """name -> (torch reference fn, fused fn) at batch n."""
    from tinyserve.kernels import glue as ks
    from tinyserve.kernels import norm as kn
    from tinyserve.kernels.moe import router as kr

    r = lambda *s: torch.randn(*s, device=dev).to(dt)  # noqa: E731
    x, res, w = r(n, H), r(n, H), 0.1 * r(H)
    qg, k = r(n, HEADS, 2 * HEAD_DIM), r(n, KV_HEADS, HEAD_DIM)
    q, gate, qw = qg[..., :HEAD_DIM], qg[..., HEAD_DIM:], 0.1 * r(HEAD_DIM)
    attn_o = r(n, HEADS, HEAD_DIM)
    rope = PartialRoPE(HEAD_DIM, ROTARY_DIM, 1e7, dev)
    cos, sin = rope.cos_sin(torch.arange(1000, 1000 + n, device=dev), dt)
    o, z = r(n, GDN_HEADS, GDN_DIM), r(n, GDN_HEADS, GDN_DIM)
    gw = 1 + 0.1 * torch.randn(GDN_DIM, device=dev)  # fp32, as the loader keeps it
    logits = r(n, E)
    gu, routed, shared, sg = r(n, 2 * F), r(n, H), r(n, H), r(n, 1)
    return {
        "rms_norm": (lambda: model_norm.rms_norm_ref(x, w, EPS), lambda: kn.rms_norm(x, w, EPS)),
        "add_rms_norm": (lambda: model_norm.add_rms_norm_ref(x, res, w, EPS),
                         lambda: kn.add_rms_norm(x, res, w, EPS)),
        "q_norm_rope": (lambda: norm_rope_ref(rope, q, qw, EPS, cos, sin),
                        lambda: kn.rms_norm_rope(q, qw, EPS, cos, sin)),
        "k_norm_rope": (lambda: norm_rope_ref(rope, k, qw, EPS, cos, sin),
                        lambda: kn.rms_norm_rope(k, qw, EPS, cos, sin)),
        "attn_gate": (lambda: sigmoid_mul_ref(attn_o, gate), lambda: ks.sigmoid_mul(attn_o, gate)),
        "gated_rms_norm": (lambda: model_norm.gated_rms_norm_ref(o, z, gw, EPS),
                           lambda: kn.gated_rms_norm(o, z, gw, EPS)),
        "router_topk": (lambda: moe.topk_softmax_ref(logits, TOPK, dt),
                        lambda: kr.topk_softmax(logits, TOPK, dt)),
        "silu_mul": (lambda: moe.silu_mul_ref(gu[:, :F], gu[:, F:]),
                     lambda: ks.silu_mul(gu[:, :F], gu[:, F:])),
        "gated_add": (lambda: moe.gated_add_ref(routed, sg, shared),
                      lambda: ks.gated_add(routed, sg, shared)),
        "moe_glue": moe_glue(n, dev, dt),
    }


def moe_glue(n: int, dev: str, dt: torch.dtype):
    """One MoE block minus its routed experts (a provider returning a fixed tensor)."""
    x = torch.randn(n, H, device=dev).to(dt)
    routed = torch.randn(n, H, device=dev).to(dt)
    gate, up, down = rand_nvfp4(F, H, dev), rand_nvfp4(F, H, dev), rand_nvfp4(H, F, dev)
    up.global_scale = gate.global_scale  # as ModelOpt writes a fusable pair
    router = DenseWeight(0.02 * torch.randn(E, H, device=dev).to(dt))
    sgate = DenseWeight(0.02 * torch.randn(1, H, device=dev).to(dt))
    class Provider(ExpertsProvider):
        def forward(self, layer_id, x, ids, weights):
            return routed

    provider = Provider()
    cfg = SimpleNamespace(num_experts_per_tok=TOPK, num_experts=E)
    block = moe.SparseMoE(0, cfg, {"gate": router, "shared_expert_gate": sgate,
                                   "shared_expert.gate_proj": gate, "shared_expert.up_proj": up,
                                   "shared_expert.down_proj": down}, provider)

    def ref():  # the block as it ran before: separate projections, torch glue
        h = moe.silu_mul_ref(linear(x, gate), linear(x, up))
        sh = linear(h, down)
        ids, weights = moe.topk_softmax_ref(linear(x, router), TOPK, dt)
        return moe.gated_add_ref(provider.forward(0, x, ids, weights), linear(x, sgate), sh)

    return ref, lambda: block.forward(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU plumbing check, no timing")
    ap.add_argument("--calls", type=int, default=200, help="calls per CUDA graph")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.dry:
        sys.exit("needs a CUDA GPU (or --dry)")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    if args.dry:  # run the glue kernels in the interpreter (the NVFP4 linear stays torch)
        moe.kernels_enabled = lambda device: True
    calls, replays = (2, 1) if args.dry else (args.calls, args.replays)
    out = Path(tempfile.gettempdir()) / "small_ops_dry.json" if args.dry else OUT
    rec = Recorder(out, run_meta("small_ops", calls=calls, replays=replays, dtype=str(dt),
                                 per_token=PER_TOKEN))
    torch.manual_seed(0)
    for n in (1, 8):
        for name, (ref_fn, fused_fn) in cases(n, dev, dt).items():
            rec.run(f"{name}/N{n}", compare, ref_fn, fused_fn, calls, replays)
    summary = {}
    for n in (1, 8):
        saved = 0.0
        for name, count in PER_TOKEN.items():
            c = rec.data["cases"].get(f"{name}/N{n}")
            # silu_mul, gated_add, router_topk are inside moe_glue; add_rms_norm needs the
            # layer change (its saving then replaces 40 of the rms_norm ones and 40 adds)
            if c and name not in ("silu_mul", "gated_add", "router_topk", "add_rms_norm"):
                saved += count * (c["torch_us"] - c["fused_us"])
        summary[f"N{n}_saved_ms_per_step"] = round(saved / 1e3, 3)
    rec.data["summary"] = summary
    rec.save()
    print(f"{'case':22s} {'torch us':>9s} {'fused us':>9s} {'speedup':>8s} {'max rel':>9s}")
    for name, c in rec.data["cases"].items():
        print(f"{name:22s} {c['torch_us']:9.2f} {c['fused_us']:9.2f} {c['speedup']:8.2f} "
              f"{c['max_rel_diff']:9.2e}")
    print(f"errors: {sorted(rec.data['errors'])}  summary: {summary}")


if __name__ == "__main__":
    main()
