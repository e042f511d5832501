"""Row gathers and packing on one GPU, against ``index_select`` and the copy ceiling.

The exchanges move (token, k) rows: a gather builds each send buffer, and where routing
weights travel with the rows, each row is packed as [row | weight bytes | padding]. Shape:
65,536 rows of 2048 bf16 gathered from 8192 (the Qwen3-30B-A3B layer's dispatch at EP1).
Bytes counted: rows read + written. Sweeps the packing kernel's rows per program, column
block and warps, and packed widths whose rows start 16- or 32-byte aligned.

    python bench/gpu_gather.py --out gather.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._gpu import copy_ceiling_gbs, cuda_time, environment, print_table, write_json
from moe_fn.kernels import gather_sum as gs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t, h, k = a.tokens, a.hidden, a.top_k
    n = t * k
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, t, (n,), device="cuda")
    w = torch.rand(n, 1, device="cuda")
    w_idx = torch.randperm(n, device="cuda")
    dense = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    packed = {pad: torch.empty(n, h + pad, device="cuda", dtype=torch.bfloat16)
              for pad in (8, 16, 64)}  # 16-, 32- and 128-byte tails
    gb = 2 * n * h * 2 / 1e9
    rows = []

    def add(name, fn, **cfg):
        ms = cuda_time(fn, reps=30)
        rows.append({"case": name, **cfg, "us": ms * 1e3, "tb_s": gb / ms})

    add("index_select", lambda: torch.index_select(x, 0, idx, out=dense))
    add("gather_sum kernel, K=1, dense", lambda: gs.launch_gather_sum(x, idx, 1, out=dense))
    add("gather_sum kernel, K=1, into packed", lambda: gs.launch_gather_sum(
        x, idx, 1, out=packed[8][:, :h]))
    for per in (1, 2, 4, 8):
        for block in (1024, 2048):
            for warps in (4, 8):
                cfg = dict(rows_per_program=per, block_c=block, num_warps=warps)
                add("gather_rows, dense", lambda: gs.launch_gather_rows(x, idx, dense, **cfg),
                    **cfg)
                add("gather_rows into packed, row stride 2056", lambda: gs.launch_gather_rows(
                    x, idx, packed[8][:, :h], **cfg), **cfg)
                for pad, buf in packed.items():
                    add(f"pack rows+weight, row stride {h + pad}", lambda buf=buf:
                        gs.launch_pack_rows(x, idx, w, w_idx, buf, 2 * h, **cfg), **cfg)
    ceiling = copy_ceiling_gbs() / 1e3
    for r in rows:
        r["of_copy"] = r["tb_s"] / ceiling
    best = {}
    for r in rows:
        if r["case"] not in best or r["us"] < best[r["case"]]["us"]:
            best[r["case"]] = r
    print(f"copy ceiling {ceiling:.2f} TB/s")
    print_table(list(best.values()), ["case", "rows_per_program", "block_c", "num_warps",
                                      "us", "tb_s", "of_copy"])
    write_json(a.out, {"env": environment(), "copy_tb_s": ceiling, "rows": rows,
                       "best": list(best.values())})


if __name__ == "__main__":
    main()
