"""Host time of the skip's contract check per checkpointed layer per step, against the
layer's backward.

A block ``h + moe(norm(h))`` (Qwen3-like: nothing after the layer but the residual add) and
``h + moe(norm(h)) + shared(norm(h))`` (DeepSeek-like: a SwiGLU shared expert runs after
the routed layer, so a dozen nodes come after the skipped combine) are checkpointed with
``moe_fn.checkpoint`` and ``skip_recompute_combine=True``. Per step: the host time of
``SkipWatch.check`` (the whole check: one layer per region has no input check), the
backward of the checkpointed block (recompute included) with the check and with it
replaced by a no-op (what the check adds to a step where it does not hide), and the MoE
layer's own backward (not checkpointed, its output's gradient only). ``check_us`` is wall
time, ``check_cpu_us`` the thread's CPU time (the same on an idle host; less where other
processes share its cores).
The check reads autograd's graph on the host and never waits for the device, so where the
GPU is busy with the recompute it hides behind it.

    python bench/skip_check_cost.py                      # CUDA: the Qwen3-30B-A3B layer
    python bench/skip_check_cost.py --device cpu --tokens 512 --hidden 256 --inter 128 \\
        --experts 8 --top-k 2 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._gpu import environment, print_table, write_json
from moe_fn import MoEConfig, MoELayer, checkpoint, skip_check


class Block(nn.Module):
    def __init__(self, cfg, shared: bool, device, dtype):
        super().__init__()
        h = cfg.hidden_size
        self.norm = nn.RMSNorm(h, device=device, dtype=dtype)
        self.moe = MoELayer(cfg, device=device, dtype=dtype)
        self.moe.reset_parameters()
        self.has_shared = shared
        if shared:
            self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False, device=device,
                                     dtype=dtype)
            self.down = nn.Linear(cfg.intermediate_size, h, bias=False, device=device,
                                  dtype=dtype)

    def forward(self, x):
        n = self.norm(x)
        out = x + self.moe(n)
        if self.has_shared:
            gate, up = self.gate_up(n).chunk(2, dim=-1)
            out = out + self.down(F.silu(gate) * up)
        return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _backward_ms(block, x, g, device):
    a = x.detach().requires_grad_()
    out = checkpoint(block, a)
    _sync(device)
    start = time.perf_counter()
    out.backward(g)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _layer_backward_ms(block, x, g, device):
    n = block.norm(x).detach().requires_grad_()
    y = block.moe(n)
    _sync(device)
    start = time.perf_counter()
    y.backward(g)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def measure(block, x, device, steps, warmup):
    """Medians over ``steps``: the check's host time, the checkpointed block's backward
    with the check and with it replaced by a no-op (steps interleaved), and the layer's
    own backward."""
    g = torch.randn_like(x)
    checks = []
    real_check = skip_check.SkipWatch.check

    def timed_check(self, outputs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return real_check(self, outputs)
        finally:
            checks.append((time.perf_counter() - start, time.thread_time() - cpu))

    rows = []
    try:
        for step in range(warmup + steps):
            checks.clear()
            skip_check.SkipWatch.check = timed_check
            checked_ms = _backward_ms(block, x, g, device)
            assert len(checks) == 1, "the recompute did not skip its combine"
            skip_check.SkipWatch.check = lambda self, outputs: None
            unchecked_ms = _backward_ms(block, x, g, device)
            skip_check.SkipWatch.check = real_check
            layer_ms = _layer_backward_ms(block, x, g, device)
            if step >= warmup:
                rows.append((checks[0][0] * 1e6, checks[0][1] * 1e6, layer_ms, checked_ms,
                             unchecked_ms))
    finally:
        skip_check.SkipWatch.check = real_check
    check_us, check_cpu_us, layer_ms, checked_ms, unchecked_ms = (
        statistics.median(c) for c in zip(*rows))
    return {"check_us": check_us, "check_cpu_us": check_cpu_us, "layer_backward_ms": layer_ms,
            "block_backward_ms": checked_ms, "block_backward_unchecked_ms": unchecked_ms,
            "check_pct_of_layer_backward": 100 * check_us / 1e3 / layer_ms}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=args.hidden, intermediate_size=args.inter,
                    num_experts=args.experts, top_k=args.top_k, skip_recompute_combine=True)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    rows = []
    for name, shared in (("residual add only", False), ("shared expert after", True)):
        block = Block(cfg, shared, device, dtype)
        rows.append({"block": name, **measure(block, x, device, args.steps, args.warmup)})
    print_table(rows, ["block", "check_us", "check_cpu_us", "layer_backward_ms",
                       "block_backward_ms", "block_backward_unchecked_ms",
                       "check_pct_of_layer_backward"])
    write_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
