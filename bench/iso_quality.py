"""ISO3/ISO4 KV quality against bf16 (runs on CPU; the references define the format).

1. Attention-output cosine of iso3/iso4 vs bf16 K/V for 35B-A3B head shapes (16 q heads,
   2 KV heads, head_dim 256) on gaussian K/V and on K with outlier channels (fixed channels
   with magnitudes 20-80, like Qwen K projections).
2. The tiny head_dim-128 model's next-token distribution with iso3/iso4 vs the bf16 backend:
   KL per position for chunked prefill (extend over a packed prefix) and one-token decode.

Writes bench/results/iso_quality.json; a failing part is recorded and the rest still runs.
Usage: python bench/iso_quality.py
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import run_meta, write_json  # noqa: E402  (bench/ on sys.path)

from tinyserve.kernels import iso  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "iso_quality.json"
HQ, HKV, D = 16, 2, 256
OUTLIERS = {3: 40.0, 77: -25.0, 101: 80.0, 130: -60.0, 200: 20.0, 255: 35.0}


def _roundtrip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return iso.dequantize_ref(iso.quantize_ref(x, fmt), fmt, x.shape[-1])


def attention_cosines(kind: str, ctx: int = 1024, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(ctx, HKV, D, generator=gen)
    v = torch.randn(ctx, HKV, D, generator=gen)
    if kind == "outlier_k":
        for ch, mag in OUTLIERS.items():
            k[:, :, ch] = mag * (1 + 0.1 * torch.randn(ctx, HKV, generator=gen))
    k, v = k.bfloat16().float(), v.bfloat16().float()
    q = torch.randn(4, HQ, D, generator=gen)  # 4 decode queries at the end of the context
    scale = D ** -0.5
    ref = iso.attention_oracle(q, k, v, ctx - 4, scale)
    row: dict = {"kind": kind, "context": ctx}
    for fmt in iso.FORMATS:
        out = iso.attention_oracle(q, _roundtrip(k, fmt), _roundtrip(v, fmt), ctx - 4, scale)
        cos = torch.nn.functional.cosine_similarity(out.reshape(-1, D), ref.reshape(-1, D),
                                                    dim=-1)
        kcos = torch.nn.functional.cosine_similarity(_roundtrip(k, fmt).reshape(-1, D),
                                                     k.reshape(-1, D), dim=-1)
        row[fmt] = dict(out_cos_mean=cos.mean().item(), out_cos_min=cos.min().item(),
                        k_roundtrip_cos_mean=kcos.mean().item())
    return row


def tiny_model_kl(n_tokens: int = 48) -> dict:
    from tinyserve.engine.runner import ModelRunner
    from tinyserve.kv.registry import create_kv_backend
    from tinyserve.kv.state_pool import GDNStatePool
    from tinyserve.model.config import load_config
    from tinyserve.model.loader import load_weights
    from tinyserve.model.qwen35 import Qwen35Model
    from tinyserve.testing.tiny import TINY_CONFIG_HD128, make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "hd128", fmt="bf16", **TINY_CONFIG_HD128)
        cfg = load_config(path)
        weights = load_weights(path, cfg, dtype=torch.float32)

    def logits(kv_name: str, chunk: int) -> torch.Tensor:
        kv = create_kv_backend(kv_name, layer_ids=list(cfg.full_attention_layers),
                               num_kv_heads=cfg.num_kv_heads,
                               num_q_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                               num_pages=32, page_size=4, device="cpu", dtype=torch.float32)
        states = GDNStatePool.for_config(cfg, 2, device="cpu", dtype=torch.float32)
        model = Qwen35Model(cfg, weights, kv=kv, states=states, device="cpu",
                            dtype=torch.float32)
        return ModelRunner(model, page_size=4).logits(ids, chunk_size=chunk)

    ids = torch.randint(0, 500, (n_tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    res: dict = {"tokens": n_tokens}
    with torch.no_grad():
        ref = logits("bf16", 16)
        lp = ref.log_softmax(-1)
        for fmt in iso.FORMATS:
            for mode, chunk in (("extend_chunk16", 16), ("decode", 1)):
                lq = logits(fmt, chunk).log_softmax(-1)
                kl = (lp.exp() * (lp - lq)).sum(-1)
                res[f"{fmt}_{mode}"] = dict(
                    kl_mean=kl.mean().item(), kl_max=kl.max().item(),
                    top1_agree=(lq.argmax(-1) == lp.argmax(-1)).float().mean().item())
    return res


def main() -> int:
    res = run_meta("iso_quality", baseline="bf16 K/V (attention in fp32)", attention=[],
                   tiny_model=None)
    res.setdefault("device", platform.machine())
    for kind in ("gaussian", "outlier_k"):
        try:
            row = attention_cosines(kind)
        except Exception as exc:  # noqa: BLE001
            row = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        res["attention"].append(row)
    try:
        res["tiny_model"] = tiny_model_kl()
    except Exception as exc:  # noqa: BLE001
        res["tiny_model"] = {"error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    print(json.dumps(res["tiny_model"]), flush=True)
    write_json(RESULTS, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
