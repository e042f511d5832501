"""Where a MoELayer forward (and backward) spends its GPU time: a torch.profiler kernel table,
plus the event-timed wall time against the sum of kernel times (a gap means the GPU waited
for the host: launch overhead or a host sync).

    python bench/profile_layer.py [--tokens 8192] [--experts 128] [--top-k 8] [--phase fwd]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._gpu import cuda_time
from moe_fn import MoEConfig, MoELayer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--phase", choices=("fwd", "fwd_bwd"), default="fwd_bwd")
    ap.add_argument("--gate-up-impl", choices=("fused", "separate"), default="fused")
    ap.add_argument("--trace", default=None, help="write a chrome trace here")
    a = ap.parse_args()
    cfg = MoEConfig(hidden_size=2048, intermediate_size=768, num_experts=a.experts,
                    top_k=a.top_k, gate_up_impl=a.gate_up_impl)
    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(a.tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)  # no gradient accumulation pass
        x.grad = None
        out = layer(x)
        if a.phase == "fwd_bwd":
            out.backward(dy)

    wall = cuda_time(step, reps=20)
    reps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"phase {a.phase}: event-timed {wall:.3f} ms, sum of kernel times "
          f"{kernel_us / reps / 1e3:.3f} ms per call")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows,
                                    max_name_column_width=70))
    if a.trace:
        prof.export_chrome_trace(a.trace)


if __name__ == "__main__":
    main()
