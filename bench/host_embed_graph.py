"""Decode with the embedding table in host RAM (the small-VRAM plan) against the table on the
GPU, on Qwen3.5-35B-A3B layer shapes with the real 248k vocabulary (`--layers` layers, random
NVFP4 experts, all resident, bf16 KV, a `--context`-token cache), measured in the same run.

Per batch size, the wall-clock milliseconds of one decode step (host work included):
- eager, table on the GPU (reference);
- eager, table on the host, ids read back from the GPU (the former path: a device -> host
  synchronisation per forward);
- eager, table on the host, rows gathered from the runner's host ids (no synchronisation);
- CUDA graph, table on the GPU;
- CUDA graph, table on the host (rows gathered into the pinned packed input, one copy);
and the largest logit difference of the two graphs from the same states (should be 0).

    python bench/host_embed_graph.py [--layers 4] [--batch 1 8]
        -> bench/results/host_embed_graph.json
    python bench/host_embed_graph.py --smoke      (CPU, tiny shapes: the script itself)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, median_ms, run_meta  # noqa: E402
from model_step import _config, _weights  # noqa: E402

from tinyserve.core import ScheduledSeq  # noqa: E402
from tinyserve.engine.graph import DecodeGraphs  # noqa: E402
from tinyserve.engine.runner import ModelRunner  # noqa: E402
from tinyserve.kv.bf16 import BF16KVBackend  # noqa: E402
from tinyserve.kv.state_pool import GDNStatePool  # noqa: E402
from tinyserve.model.config import ModelConfig  # noqa: E402
from tinyserve.model.qwen35 import Qwen35Model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "host_embed_graph.json"
PAGE = 16
SMOKE = dict(vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4,
             num_kv_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, eos_token_ids=(1,))


def _model(cfg: ModelConfig, w: dict, batch: int, context: int, device: str,
           embed_device: str | None) -> Qwen35Model:
    """A model over fresh pools (the same random contents for the same arguments), one GDN
    slot more than `batch` for the padded rows of the graphs."""
    pages = batch * (context // PAGE + 2) + 1
    kv = BF16KVBackend(layer_ids=list(cfg.full_attention_layers), num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, num_pages=pages, page_size=PAGE, device=device,
                       dtype=torch.bfloat16)
    states = GDNStatePool.for_config(cfg, batch + 1, device=device, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(1)
    for t in (kv.k_cache, kv.v_cache, states.conv):
        t.normal_(0, 0.5, generator=g)
    states.recurrent.normal_(0, 0.05, generator=g)
    return Qwen35Model(cfg, w, kv=kv, states=states, device=device, dtype=torch.bfloat16,
                       embed_device=embed_device)


def _ms(fn, reps: int, device: str) -> float:
    if device == "cuda":
        return round(median_ms(fn, reps, warmup=2), 3)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def measure(cfg: ModelConfig, w: dict, batch: int, context: int, reps: int,
            device: str) -> dict:
    per = context // PAGE + 2
    vocab = cfg.vocab_size
    seqs = [ScheduledSeq(f"s{i}", [(7919 * (i + 1)) % vocab], context,
                         list(range(i * per, (i + 1) * per)), i, sample=True)
            for i in range(batch)]
    capture = device == "cuda"
    out: dict = {"batch": batch, "context": context}
    logits = {}
    runners = {}
    for name, embed_device in (("gpu_table", None), ("host_table", "cpu")):
        model = _model(cfg, w, batch, context, device, embed_device)
        graphs = DecodeGraphs(model, page_size=PAGE, pad_state_slot=batch, capture=capture,
                              host_embedding=embed_device is not None)
        logits[name] = graphs.run(seqs).float().cpu()  # first step from the same states
        runners[name] = (ModelRunner(model, page_size=PAGE), graphs)
        out[f"{name}_graphs_captured"] = graphs.num_graphs
    out["graph_logits_max_diff"] = (logits["gpu_table"] - logits["host_table"]).abs().max().item()
    (gpu, gpu_graphs), (host, host_graphs) = runners["gpu_table"], runners["host_table"]

    def synced_ids() -> None:  # the former host-table path: ids read back from the device
        host.run(dataclasses.replace(host.prepare(seqs), input_ids_cpu=None))

    out["eager_gpu_table_ms"] = _ms(lambda: gpu.run(gpu.prepare(seqs)), reps, device)
    out["eager_host_table_synced_ids_ms"] = _ms(synced_ids, reps, device)
    out["eager_host_table_ms"] = _ms(lambda: host.run(host.prepare(seqs)), reps, device)
    out["graph_gpu_table_ms"] = _ms(lambda: gpu_graphs.run(seqs), reps, device)
    out["graph_host_table_ms"] = _ms(lambda: host_graphs.run(seqs), reps, device)
    ids = torch.tensor([s.token_ids[0] for s in seqs])
    out["host_gather_only_ms"] = _ms(lambda: host.model.embed(ids), reps, device)
    out["graph_host_table_speedup_vs_eager"] = round(
        out["eager_host_table_synced_ids_ms"] / out["graph_host_table_ms"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no output file")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1
    cfg = _config(args.layers)
    if args.smoke:
        cfg = dataclasses.replace(cfg, **SMOKE, layer_types=cfg.layer_types)
        args.context, args.reps = 64, 2
    out = Path("/dev/null") if args.smoke else OUT
    rec = Recorder(out, run_meta("host_embed_graph", args=vars(args),
                                 model={"layers": cfg.num_layers, "vocab": cfg.vocab_size,
                                        "hidden": cfg.hidden_size, "kv": "bf16",
                                        "experts": "NVFP4 resident"}))
    w = _weights(cfg, device)
    for batch in args.batch:
        res = rec.run(f"decode_b{batch}", measure, cfg, w, batch, args.context, args.reps,
                      device)
        if device == "cuda":
            torch.cuda.empty_cache()
        if res:
            keys = ("eager_gpu_table_ms", "eager_host_table_synced_ids_ms",
                    "eager_host_table_ms", "graph_gpu_table_ms", "graph_host_table_ms")
            print(f"batch {batch}: " + "  ".join(f"{k[:-3]} {res[k]:.2f}" for k in keys)
                  + f"  ms; graph logits diff {res['graph_logits_max_diff']:.3g}", flush=True)
    return 0 if not rec.data["errors"] else 2


if __name__ == "__main__":
    raise SystemExit(main())
