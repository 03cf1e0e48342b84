"""The whole engine with each KV format side by side: `tinyserve bench CKPT --kv FMT
--prompt-len P --gen-len G --json` for every format and prompt length, each run in a fresh
process, the formats alternating, `--repeats` rounds.

Formats: the `--kv` values (iso3 and bf16 by default; iso4 on request).
Prompt lengths: 1024 (the decode graphs' capacity is 2048 for 1025..1088 tokens) and 32704
(capacity 32768 for 32705..32768).

Per (prompt length, format): the runs' decode tok/s and median step, the best-of; per prompt
length the step ratios of the formats to iso3 (the acceptance: bf16 within 5 % of iso3 at
1k). Peak memory and the KV bytes per token come from the bench's memory plan.

    python bench/kv_formats.py CKPT [--prompt-lens 1024 32704] [--formats iso3 bf16 iso4]
        [--repeats 2] [--gen-len 64] [--gpu-memory none] [--merge]
        -> bench/results/kv_formats.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Recorder, run_meta  # noqa: E402

OUT = ROOT / "bench" / "results" / "kv_formats.json"
FORMATS = ("iso3", "bf16", "iso4")
KEEP = ("prompt_len", "gen_len", "batch", "prefill_tok_s", "decode_tok_s", "decode_step_ms",
        "ttft_s", "steps", "graphs_captured", "peak_memory_bytes", "commit", "date")


def run_one(ckpt: str, fmt: str, prompt_len: int, gen_len: int, batch: int,
            gpu_memory: str | None) -> dict:
    """One `tinyserve bench` in a fresh process: its result (the plan's KV figures kept)."""
    cmd = [sys.executable, "-m", "tinyserve.cli", "bench", ckpt, "--kv", fmt, "--prompt-len",
           str(prompt_len), "--gen-len", str(gen_len), "--batch", str(batch), "--json"]
    if gpu_memory:
        cmd += ["--gpu-memory", gpu_memory]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"exit {res.returncode}: {res.stderr[-3000:]}")
    lines = res.stdout.splitlines()  # the JSON starts at the last line "{" (indent=2)
    out = json.loads("\n".join(lines[max(i for i, x in enumerate(lines) if x == "{"):]))
    plan = out.get("memory_plan") or {}
    row = {k: out[k] for k in KEEP if k in out}
    row.update(command="python " + " ".join(cmd[1:]),
               kv_bytes_per_token=plan.get("kv_bytes_per_token"),
               kv_bytes=plan.get("kv_bytes"), context_tokens=plan.get("context_tokens"))
    return row


def summarize(cases: dict) -> dict:
    """Per prompt length: per format the runs' decode step (ms) and tok/s, their best and
    median, and the step ratio of each format to iso3."""
    table: dict = {}
    for name, row in cases.items():
        p, fmt = name.split("/")[:2]  # p{P}/{fmt}/run{i}
        if row.get("decode_step_ms"):
            cell = table.setdefault(p, {}).setdefault(fmt, {"step_ms": [], "tok_s": []})
            cell["step_ms"].append(row["decode_step_ms"])
            cell["tok_s"].append(row["decode_tok_s"])
    for cells in table.values():
        for cell in list(cells.values()):
            cell.update(best_step_ms=min(cell["step_ms"]),
                        median_step_ms=statistics.median(cell["step_ms"]),
                        best_tok_s=max(cell["tok_s"]))
        step = {f: c["median_step_ms"] for f, c in cells.items()}
        for fmt in step.keys() - {"iso3"}:
            if "iso3" in step:
                cells[f"{fmt}_over_iso3"] = step[fmt] / step["iso3"]
        if "bf16_over_iso3" in cells:
            cells["bf16_within_5pct_of_iso3"] = cells["bf16_over_iso3"] <= 1.05
    return table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 32704])
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=["iso3", "bf16"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gpu-memory", default="none", help="none: every expert resident")
    ap.add_argument("--merge", action="store_true",
                    help="keep the cases already in the result file (runs split over calls)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    budget = None if args.gpu_memory == "none" else args.gpu_memory
    rec = Recorder(args.out, run_meta("kv_formats", checkpoint=args.ckpt, batch=args.batch,
                                      gpu_memory=args.gpu_memory, gen_len=args.gen_len))
    if args.merge and args.out.exists():
        rec.data["cases"].update(json.loads(args.out.read_text()).get("cases", {}))
    for p in args.prompt_lens:
        for i in range(args.repeats):
            order = args.formats if i % 2 == 0 else args.formats[::-1]
            for fmt in order:
                k = i
                while f"p{p}/{fmt}/run{k}" in rec.data["cases"]:  # --merge: a new name
                    k += args.repeats
                rec.run(f"p{p}/{fmt}/run{k}", run_one, args.ckpt, fmt, p, args.gen_len,
                        args.batch, budget)
    rec.data["summary"] = summarize(rec.data["cases"])
    rec.save()
    for p, cells in rec.data["summary"].items():
        line = ", ".join(f"{f} {c['median_step_ms']:.3f} ms ({c['best_tok_s']:.1f} tok/s)"
                         for f, c in cells.items() if isinstance(c, dict))
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in cells.items() if k.endswith("_over_iso3"))
        print(f"{p}: {line}\n    {ratios}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
