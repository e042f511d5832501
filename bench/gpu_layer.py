"""MoE layer forward and backward on one GPU: the Qwen3-30B-A3B layer.

Hidden 2048, expert hidden 768, 128 experts, top-8, 8192 tokens, bf16. Timed side by side:
moe_fn MoELayer (local exchange), transformers' Qwen3MoeSparseMoeBlock with its
``grouped_mm`` experts, and a plain PyTorch layer (fp32 softmax router, stable argsort,
three ``torch._grouped_mm``, eager activation, weighted sum). FLOPs: 2*T*k*H*3I forward,
twice that backward.

    python bench/gpu_layer.py --out layer.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._gpu import cuda_time, environment, print_table, write_json
from moe_fn import MoEConfig, MoELayer
from moe_fn.kernels import _launch

TRITON_PATH = "moe_fn MoELayer (fused gate+up, Triton's launch path)"
PIPELINE = 8  # forwards queued back to back for the pipelined forward time


def hf_block(h, i, e, k):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                         num_experts_per_tok=k, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    return Qwen3MoeSparseMoeBlock(cfg).to(device="cuda", dtype=torch.bfloat16)


def plain_layer(x, router_w, w1, w3, w2, k):
    t, h = x.shape
    e = router_w.shape[0]
    probs = torch.softmax(F.linear(x, router_w).float(), -1)
    w, idx = torch.topk(probs, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    flat = idx.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    rows = x[perm // k]
    g = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    y = y * w.reshape(-1)[perm, None].to(y.dtype)
    out = torch.zeros_like(x)
    return out.index_add(0, perm // k, y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time the fused layer captured as CUDA graphs (experiment)")
    a = ap.parse_args()
    torch.manual_seed(0)
    t, h, i, e, k = a.tokens, a.hidden, a.inter, a.experts, a.top_k
    hf = hf_block(h, i, e, k)
    with torch.no_grad():
        hf.gate.weight.normal_(0, 0.02)
        hf.experts.gate_up_proj.normal_(0, 0.02)
        hf.experts.down_proj.normal_(0, 0.02)
    variants = {}
    for impl in ("fused", "separate"):
        cfg = MoEConfig(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k,
                        gate_up_impl=impl)
        layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer.router.weight.copy_(hf.gate.weight)
            layer.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
            layer.experts.down_proj.copy_(hf.experts.down_proj)
        variants[f"moe_fn MoELayer ({impl} gate+up)"] = layer
    # The same fused layer launching its Triton kernels through Triton's own launch path
    # (moe_fn.kernels._launch off): what the fast launch saves, measured in this run.
    variants[TRITON_PATH] = variants["moe_fn MoELayer (fused gate+up)"]
    w1 = hf.experts.gate_up_proj.detach()[:, :i].contiguous().requires_grad_()
    w3 = hf.experts.gate_up_proj.detach()[:, i:].contiguous().requires_grad_()
    w2 = hf.experts.down_proj.detach().clone().requires_grad_()
    rw = hf.gate.weight.detach().clone().requires_grad_()

    def hf_call(x):
        # The HF block takes (batch, seq, hidden); some versions also return router logits.
        o = hf(x[None])
        return (o[0] if isinstance(o, tuple) else o).reshape(x.shape)
    variants["transformers Qwen3MoeSparseMoeBlock grouped_mm"] = hf_call
    variants["plain PyTorch layer"] = lambda x: plain_layer(x, rw, w1, w3, w2, k)

    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    if a.cuda_graph:
        # The fused layer captured whole (forward and backward) as CUDA graphs, which
        # removes the host time the eager forward exposes (supported on the local
        # exchange: see the README).
        name = "moe_fn MoELayer (fused gate+up, CUDA graph)"
        try:
            g_layer = copy.deepcopy(variants["moe_fn MoELayer (fused gate+up)"])
            variants[name] = torch.cuda.make_graphed_callables(g_layer, (x,))
        except Exception as e:  # recorded, not fatal: the other rows still run
            print(f"{name}: capture failed: {type(e).__name__}: {e}")
    params = [p for v in variants.values() if isinstance(v, torch.nn.Module)
              for p in v.parameters()] + list(hf.parameters()) + [w1, w3, w2, rw]
    ref = variants["plain PyTorch layer"](x).float()
    flops = 2 * t * k * h * 3 * i
    rows = []
    for name, fn in variants.items():
        _launch.ENABLED = name != TRITON_PATH
        try:
            out = fn(x)
        except Exception as e:
            if "CUDA graph" not in name:
                raise
            print(f"{name}: replay failed: {type(e).__name__}: {e}")
            continue
        out = out[0] if isinstance(out, tuple) else out
        diff = ((out.float() - ref).abs().max() / ref.abs().max()).item()

        def fwd(fn=fn):
            return fn(x)

        def fwd_bwd(fn=fn):
            # As optimizer.zero_grad(set_to_none=True) leaves them: no accumulation pass.
            for p in params:
                p.grad = None
            x.grad = None
            o = fn(x)
            (o[0] if isinstance(o, tuple) else o).backward(dy)
        def fwd_pipelined(fn=fn):
            # Back to back, as in a training step where the previous layer's kernels are
            # still queued: host time before the first GEMM hides behind the GPU's work.
            for _ in range(PIPELINE):
                fn(x)
        def fwd_pipelined_3x(fn=fn):
            for _ in range(3 * PIPELINE):
                fn(x)
        t_f = cuda_time(fwd, reps=a.reps)
        t_p = cuda_time(fwd_pipelined, reps=a.reps)
        t_fp = t_p / PIPELINE
        # Steady state: the marginal time of a forward queued behind others (the first
        # forward's exposed host time cancels in the difference).
        t_fs = (cuda_time(fwd_pipelined_3x, reps=a.reps) - t_p) / (2 * PIPELINE)
        t_fb = cuda_time(fwd_bwd, reps=a.reps)
        t_b = t_fb - t_f
        rows.append({"variant": name, "fwd_ms": t_f, "bwd_ms": t_b, "fwd_bwd_ms": t_fb,
                     "fwd_pipelined_ms": t_fp, "tflops_fwd_pipelined": flops / t_fp / 1e9,
                     "fwd_steady_ms": t_fs, "tflops_fwd_steady": flops / t_fs / 1e9,
                     "tflops_fwd": flops / t_f / 1e9, "tflops_bwd": 2 * flops / t_b / 1e9,
                     "max_rel_diff_vs_plain": diff})
    _launch.ENABLED = True
    hf_row = next(r for r in rows if r["variant"].startswith("transformers"))
    for r in rows:
        r["speedup_vs_hf"] = hf_row["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    print_table(rows, ["variant", "fwd_ms", "bwd_ms", "tflops_fwd", "tflops_fwd_pipelined",
                       "tflops_fwd_steady", "tflops_bwd",
                       "speedup_vs_hf", "max_rel_diff_vs_plain"])
    write_json(a.out, {"env": environment(), "shape": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
