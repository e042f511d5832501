"""A custom training loop with moe_fn on a CPU: a small MoE model learns a toy task.

The task: each input comes from one of 8 clusters, and each cluster has its own target
function (a random linear map followed by tanh). A mixture of experts fits it by routing
each cluster to experts of its own. The model is two residual MoE blocks between an input
and an output projection; each block runs under ``moe_fn.checkpoint`` (activation
checkpointing that replays the forward's routing in the recompute, and skips the
recomputed combine, which only feeds the residual add).

    python examples/train_loop.py            # about 300 steps; the loss falls ~100x
    python examples/train_loop.py --steps 50

It prints the held-out loss as it falls, then which expert each cluster's inputs go to.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import moe_fn

DIM, CLUSTERS = 16, 8


class Task:
    """Inputs around one of ``CLUSTERS`` centres; targets ``tanh(A_c x)`` for cluster c."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.centres = 3 * torch.randn(CLUSTERS, DIM, generator=g)
        self.maps = torch.randn(CLUSTERS, DIM, DIM, generator=g) / DIM ** 0.5

    def sample(self, n: int, g: torch.Generator):
        cluster = torch.randint(0, CLUSTERS, (n,), generator=g)
        x = self.centres[cluster] + torch.randn(n, DIM, generator=g)
        y = torch.tanh(torch.einsum("nij,nj->ni", self.maps[cluster], x))
        return x, y, cluster


class Block(nn.Module):
    """``h + moe(norm(h))``: the MoE output feeds only the residual add, which is what
    ``skip_recompute_combine`` needs."""

    def __init__(self, config: moe_fn.MoEConfig):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size)
        self.moe = moe_fn.MoELayer(config)

    def forward(self, h):
        return h + self.moe(self.norm(h))


class Model(nn.Module):
    def __init__(self, config: moe_fn.MoEConfig, num_blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(DIM, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(num_blocks))
        self.out = nn.Linear(config.hidden_size, DIM)

    def forward(self, x):
        # The input projection makes h require grad, which a reentrant checkpoint needs
        # for the gradients to reach the blocks' parameters.
        h = self.inp(x)
        for block in self.blocks:
            h = moe_fn.checkpoint(block, h) if self.training else block(h)
        return self.out(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # The matrices here are tiny: on a CPU, more threads cost more than they save.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    config = moe_fn.MoEConfig(hidden_size=64, intermediate_size=128, num_experts=8, top_k=2,
                              skip_recompute_combine=True)
    model = Model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    task = Task(args.seed)
    data = torch.Generator().manual_seed(args.seed + 1)
    x_eval, y_eval, c_eval = task.sample(2048, torch.Generator().manual_seed(args.seed + 2))

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = nn.functional.mse_loss(model(x_eval), y_eval).item()
        model.train()
        return loss

    n_params = sum(p.numel() for p in model.parameters())
    print(f"training a {len(model.blocks)}-block MoE ({config.num_experts} experts, "
          f"top-{config.top_k}, {n_params / 1e3:.0f}k parameters) for {args.steps} steps "
          f"of {args.batch} samples on the CPU", flush=True)
    first = eval_loss()
    print(f"step {0:>5}  held-out loss {first:.4f}", flush=True)
    t0 = time.perf_counter()
    every = max(1, args.steps // 10)
    for step in range(1, args.steps + 1):
        x, y, _ = task.sample(args.batch, data)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == args.steps:
            print(f"step {step:>5}  held-out loss {eval_loss():.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    last = eval_loss()
    print(f"held-out loss fell from {first:.4f} to {last:.4f} ({first / last:.1f}x lower)")

    # Which expert the first block sends most of each cluster's inputs to (top-1).
    model.eval()
    with torch.no_grad():
        block = model.blocks[0]
        _, logits = block.moe(block.norm(model.inp(x_eval)), return_router_logits=True)
    top1 = logits.argmax(dim=-1)
    favourite = [int(torch.bincount(top1[c_eval == c], minlength=config.num_experts).argmax())
                 for c in range(CLUSTERS)]
    print(f"block 0's top-1 expert for clusters 0-{CLUSTERS - 1}: {favourite}")


if __name__ == "__main__":
    main()
