"""Expert MLP forward+backward on one GPU, Qwen3-30B-A3B per-rank shape.

131,072 rows, hidden 2048, expert hidden 768, 16 experts, bf16; uniform counts and skewed
counts with one empty expert. Variants timed side by side in one run: moe_fn fused,
moe_fn separate, plain PyTorch (three ``torch._grouped_mm`` + eager ``silu(g) * u``) and
transformers' ``grouped_mm`` experts implementation (Qwen3MoeExperts).

    python bench/gpu_experts.py --out results.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._gpu import (
    copy_ceiling_gbs,
    cuda_time,
    environment,
    matmul_ceiling_tflops,
    print_table,
    write_json,
)
from moe_fn import functional


def counts_for(kind: str, rows: int, experts: int) -> list[int]:
    if kind == "uniform":
        return [rows // experts] * experts
    # Skewed: expert 0 empty, the rest rising linearly (rounded to 8 rows), last takes the rest.
    raw = [0] + [i for i in range(1, experts)]
    total = sum(raw)
    c = [r * rows // total // 8 * 8 for r in raw]
    c[-1] += rows - sum(c)
    return c


def plain_pytorch(x, w1, w3, w2, offs):
    g = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)


def hf_experts(num_experts, hidden, inter, gate_up, down):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                         num_experts=num_experts, num_experts_per_tok=1)
    cfg._experts_implementation = "grouped_mm"
    mod = Qwen3MoeExperts(cfg).to(device="cuda", dtype=torch.bfloat16)
    mod.gate_up_proj = gate_up
    mod.down_proj = down
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    n, h, i, e = a.rows, a.hidden, a.inter, a.experts
    env = environment()
    ceil = {"matmul_tflops": matmul_ceiling_tflops(), "copy_gbs": copy_ceiling_gbs()}
    print(env, ceil)
    gate_up = torch.nn.Parameter(torch.randn(e, 2 * i, h, device=dev, dtype=dt) * 0.02)
    down = torch.nn.Parameter(torch.randn(e, h, i, device=dev, dtype=dt) * 0.02)
    w1 = torch.nn.Parameter(gate_up.detach()[:, :i].contiguous())
    w3 = torch.nn.Parameter(gate_up.detach()[:, i:].contiguous())
    w2 = torch.nn.Parameter(down.detach().clone())
    hf = hf_experts(e, h, i, gate_up, down)
    flops_fwd = 2 * n * h * 3 * i
    rows = []
    for kind in ("uniform", "skewed"):
        counts = counts_for(kind, n, e)
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        x = torch.randn(n, h, device=dev, dtype=dt).requires_grad_()
        dy = torch.randn(n, h, device=dev, dtype=dt)
        expert_of_row = torch.repeat_interleave(torch.arange(e, device=dev),
                                                torch.tensor(counts, device=dev))
        ones = torch.ones(n, 1, device=dev, dtype=dt)
        variants = {
            "moe_fn fused": lambda x=x, offs=offs: functional.experts(
                x, gate_up, down, offs, gate_up_impl="fused"),
            "moe_fn separate": lambda x=x, offs=offs: functional.experts(
                x, gate_up, down, offs, gate_up_impl="separate"),
            "plain PyTorch": lambda x=x, offs=offs: plain_pytorch(x, w1, w3, w2, offs),
            "transformers grouped_mm": lambda x=x, eor=expert_of_row, ones=ones: hf(
                x, eor[:, None], ones),
        }
        ref = variants["plain PyTorch"]()
        for name, fn in variants.items():
            out = fn()
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            with torch.no_grad():
                t_nograd = cuda_time(fn, reps=a.reps)
            t_fwd = cuda_time(fn, reps=a.reps)

            def step(fn=fn, x=x, dy=dy):
                # As optimizer.zero_grad(set_to_none=True) leaves them: no accumulation pass.
                for p in (gate_up, down, w1, w3, w2, x):
                    p.grad = None
                fn().backward(dy)
            t_fb = cuda_time(step, reps=a.reps)
            rows.append({"counts": kind, "variant": name, "fwd_nograd_ms": t_nograd,
                         "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb,
                         "tflops_fwd_bwd": 3 * flops_fwd / t_fb / 1e9,
                         "max_rel_diff_vs_plain": err})
        base = next(r["fwd_bwd_ms"] for r in rows if r["counts"] == kind
                    and r["variant"] == "plain PyTorch")
        for r in rows:
            if r["counts"] == kind:
                r["speedup_vs_plain"] = base / r["fwd_bwd_ms"]
    print_table(rows, ["counts", "variant", "fwd_nograd_ms", "fwd_ms", "fwd_bwd_ms",
                       "tflops_fwd_bwd", "speedup_vs_plain", "max_rel_diff_vs_plain"])
    write_json(a.out, {"env": env, "ceilings": ceil, "shape": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
