"""Expert parallelism over 2 ranks with torchrun: gloo on CPUs, NCCL on GPUs.

    torchrun --nproc-per-node 2 examples/ep_torchrun.py
    torchrun --nproc-per-node 2 examples/ep_torchrun.py --steps 20

Each rank builds the same MoELayer config with ``comm_backend="all_to_all"`` and
``ep_size=2``: rank r holds experts ``r*E/2 ... (r+1)*E/2 - 1`` and a copy of the router.
Every rank trains on batches of its own (data parallelism over the same group); the
dispatch brings each token to the rank that owns its experts, so an expert's gradient
already sums every rank's tokens. Gradients are therefore reduced thus before each step:
the replicated router's all-reduced and averaged, the experts' only divided by the number
of ranks. A single-process layer holding every expert trains beside it on all ranks'
batches at once; at the end the experts are gathered from the ranks and compared with it.
The script exits non-zero if they differ.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

import moe_fn

HIDDEN, LR = 64, 1e-3
# The exchange moves rows between ranks without changing them: the output matches one
# process; the router's gradient is a sum of the ranks' parts in another order, which one
# AdamW step can turn into up to a visible fraction of lr on an element whose gradient is
# near AdamW's eps: hence 0.1 * lr on parameters.
TOL_LOSS, TOL_PARAM = 1e-5, 0.1 * LR


def batch(step: int, rank: int, n: int, device):
    """Rank ``rank``'s batch of step ``step``: inputs and a fixed nonlinear target."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, HIDDEN, generator=g)
    target = torch.tanh(x.roll(1, dims=-1) * x)
    return x.to(device), target.to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: NCCL with one GPU per rank where there are enough, else gloo")
    args = ap.parse_args()

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                     and torch.cuda.device_count() >= ranks_here)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    sizes = dict(hidden_size=HIDDEN, intermediate_size=128, num_experts=8, top_k=2)
    # overlap_weight_grad: the experts' weight-gradient GEMMs run while the backward's
    # combine moves the input gradients home (torch warns, once per process, that the SM
    # carveout it uses is experimental).
    warnings.filterwarnings("ignore", message="Setting the SM carveout")
    config = moe_fn.MoEConfig(**sizes, comm_backend="all_to_all", ep_size=world,
                              overlap_weight_grad=True)
    layer = moe_fn.MoELayer(config, device=device)  # the world group by default
    torch.manual_seed(0)  # the same reference on every rank
    reference = moe_fn.MoELayer(moe_fn.MoEConfig(**sizes), device=device)
    n_local = config.num_local_experts
    lo = rank * n_local
    with torch.no_grad():  # start from the reference's weights: this rank's experts only
        layer.router.weight.copy_(reference.router.weight)
        layer.experts.gate_up_proj.copy_(reference.experts.gate_up_proj[lo:lo + n_local])
        layer.experts.down_proj.copy_(reference.experts.down_proj[lo:lo + n_local])
    for r in range(world):  # one line per rank, in rank order
        if r == rank:
            print(f"rank {rank}: experts {lo}-{lo + n_local - 1}, gate_up_proj "
                  f"{tuple(layer.experts.gate_up_proj.shape)}, on {device}", flush=True)
        dist.barrier()
    if rank == 0:
        print(f"EP{world} over {dist.get_backend()}: {args.steps} steps of {args.tokens} "
              f"tokens per rank", flush=True)

    opt = torch.optim.AdamW(layer.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    d_loss = 0.0
    for step in range(args.steps):
        x, target = batch(step, rank, args.tokens, device)
        loss = nn.functional.mse_loss(layer(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in layer.router.parameters():  # replicated: average over the ranks
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        for p in layer.experts.parameters():  # sharded: already summed over every rank
            p.grad.div_(world)
        opt.step()

        # The reference: every rank's batch in one process (equal batches, so the mean
        # loss over all of them is the mean of the ranks' losses).
        xs, targets = zip(*(batch(step, r, args.tokens, device) for r in range(world)))
        ref_loss = nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(targets))
        ref_opt.zero_grad(set_to_none=True)
        ref_loss.backward()
        ref_opt.step()

        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        d_loss = max(d_loss, abs(mean.item() - ref_loss.item()))
        if rank == 0:
            print(f"step {step + 1:>3}  loss {mean.item():.6f}  one process "
                  f"{ref_loss.item():.6f}", flush=True)

    # Gather every rank's experts into full tensors (a collective: every rank calls it).
    d_param = (layer.router.weight - reference.router.weight).abs().max().item()
    for name, p in layer.experts.named_parameters():
        parts = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(parts, p.detach().contiguous())
        full = torch.cat(parts)
        d_param = max(d_param, (full - getattr(reference.experts, name)).abs().max().item())
    ok = d_loss <= TOL_LOSS and d_param <= TOL_PARAM
    if rank == 0:
        print(f"exchange counters on rank 0: {dict(layer.exchange.counters)}")
        print(f"EP{world} vs one process: max |d loss| {d_loss:.2e} (tol {TOL_LOSS:.0e}), "
              f"max |d param| {d_param:.2e} (tol {TOL_PARAM:.0e})  "
              f"{'MATCH' if ok else 'MISMATCH'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
