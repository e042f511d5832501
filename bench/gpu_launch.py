"""Host time per call: moe_fn's fast Triton launch against Triton's own launch path.

The GPU is kept busy by a long matmul queued first, so the host never waits for it and
``time.perf_counter`` measures only host work: per kernel call (small shapes; the whole
wrapper: argument checks, output allocation and the launch), and per layer forward (the
Qwen3-30B-A3B layer, 8192 tokens) and forward+backward, with
``moe_fn.kernels._launch.ENABLED`` on and off in alternation (two rounds of each; the
lower of the two medians is reported).

    python bench/gpu_launch.py --out launch.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._gpu import environment, print_table, write_json
from moe_fn import MoEConfig, MoELayer, kernels
from moe_fn.kernels import _launch


def host_us(fn, n, busy):
    """Median host µs of ``fn()`` over rounds of ``n`` calls queued behind ``busy()``."""
    per = []
    for _ in range(7):
        torch.cuda.synchronize()
        busy()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def busy(n=12):  # ~15 ms of GPU work queued ahead of the timed launches
        for _ in range(n):
            big @ big

    rows16 = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, 256, (512,), device="cuda")
    gate = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(64, 128, device="cuda")
    idx = torch.randint(0, 128, (64, 8), device="cuda")
    cases = {
        "gather_sum (Triton)": lambda: kernels.gather_sum_fwd(rows16, index, 2),
        "activation fwd (Triton, autotuned)": lambda: kernels.swiglu_fwd(gate, gate, None, act_id=0,
                                                                    alpha=1.702, limit=7.0),
        "router (Triton)": lambda: kernels.router_fwd(logits, None, top_k=8),
        "dispatch layout (2 Triton launches)": lambda: kernels.layout(idx, 128),
        "torch.add (reference)": lambda: rows16.add(rows16),
    }
    cfg = MoEConfig(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)
    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def fwd_bwd():
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(dy)
    cases["layer forward (8192 tokens)"] = lambda: layer(x)
    cases["layer forward+backward"] = fwd_bwd
    rows = []
    for name, fn in cases.items():
        n = 4 if name.startswith("layer") else 50
        res = {}
        for enabled in (False, True, False, True):  # alternated: drift hits both
            _launch.ENABLED = enabled
            fn()  # compile / fill caches
            res.setdefault(enabled, []).append(host_us(fn, n, busy))
        _launch.ENABLED = True
        slow, fast = min(res[False]), min(res[True])
        rows.append({"case": name, "triton_path_us": slow, "fast_us": fast,
                     "saved_us": slow - fast})
    live = sum(e is not None for e in _launch._CACHE.values())
    print_table(rows, ["case", "triton_path_us", "fast_us", "saved_us"])
    print(f"fast-launch cache: {live} live of {len(_launch._CACHE)} entries")
    write_json(a.out, {"env": environment(), "rows": rows, "live_cache_entries": live})


if __name__ == "__main__":
    main()
