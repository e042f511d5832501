"""Where a MoELayer forward+backward spends its GPU time: a torch.profiler kernel table.

    python bench/profile_layer.py [--tokens 8192] [--experts 128] [--top-k 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_fn import MoEConfig, MoELayer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=30)
    a = ap.parse_args()
    cfg = MoEConfig(hidden_size=2048, intermediate_size=768, num_experts=a.experts,
                    top_k=a.top_k)
    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(a.tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for _ in range(5):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows,
                                    max_name_column_width=70))


if __name__ == "__main__":
    main()
