"""Data parallelism wider than expert parallelism on a 2-D mesh, with a distributed checkpoint.

    torchrun --nproc-per-node 4 examples/fsdp_ep_torchrun.py            # DP4 = 2 x EP2
    torchrun --nproc-per-node 4 examples/fsdp_ep_torchrun.py --ep 4     # 1-D: EP = DP

The mesh is ``(dp_shard_mod_ep, ep)``: the layer is built on ``mesh["ep"]``, so its expert
parameters are DTensors ``Shard(0)`` over it, and each expert has ``world / ep`` replicas
(the ranks of one ``dp_shard_mod_ep`` column). Every rank trains on its own batch. With
``moe_fn.parallel.fully_shard_moe`` (FSDP2) the experts are sharded over their replicas and
everything else over the whole mesh; without it this script reduces the gradients by hand
with the same factors: the replicated router's all-reduced over every rank, the experts'
over their replicas only (the exchange's backward already summed the EP ranks' tokens into
each expert's gradient), both divided by the whole data-parallel size. Then it saves model
and AdamW state with torch.distributed.checkpoint (each rank writes its own shards), loads
them into a fresh layer and checks that it computes the same outputs and that one more
training step of each gives the same layer again.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import moe_fn
import moe_fn.dcp

HIDDEN = 32


def batch(step: int, rank: int, n: int, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, HIDDEN, generator=g)
    return x.to(device), torch.tanh(x.roll(1, dims=-1) * x).to(device)


def numel_here(t) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel size (divides world)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory")
    args = ap.parse_args()

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                     and torch.cuda.device_count() >= ranks_here)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the {world} ranks")
    mesh = init_device_mesh(device.type, (world // args.ep, args.ep),
                            mesh_dim_names=("dp_shard_mod_ep", "ep"))

    config = moe_fn.MoEConfig(hidden_size=HIDDEN, intermediate_size=64, num_experts=8,
                              top_k=2, comm_backend="all_to_all", ep_size=args.ep)
    torch.manual_seed(0)
    layer = moe_fn.MoELayer(config, mesh["ep"], device=device)
    # Each EP rank drew its own experts; their replicas must start equal: take column 0's.
    with torch.no_grad():
        for p in layer.experts.parameters():
            dist.broadcast(p.to_local() if isinstance(p, DTensor) else p,
                           group=mesh["dp_shard_mod_ep"].get_group(), group_src=0)
    try:
        from moe_fn.parallel import fully_shard_moe
    except ImportError:
        fully_shard_moe = None
    if fully_shard_moe is not None:
        fully_shard_moe(layer, mesh)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)

    def reduce_by_hand(layer):
        for p in layer.router.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        for p in layer.experts.parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if world > args.ep:
                dist.all_reduce(g, group=mesh["dp_shard_mod_ep"].get_group())
            g.div_(world)

    for step in range(args.steps):
        x, target = batch(step, rank, args.tokens, device)
        loss = torch.nn.functional.mse_loss(layer(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if fully_shard_moe is None:
            reduce_by_hand(layer)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1:>3}  loss {mean.item() / world:.6f}", flush=True)

    experts = sum(numel_here(p) for p in layer.experts.parameters())
    adam = sum(numel_here(s) for p in layer.experts.parameters()
               for k, s in opt.state[p].items() if k != "step")
    full = sum(p.numel() for p in layer.experts.parameters())
    if rank == 0:
        print(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, "
              f"{'fully_shard_moe' if fully_shard_moe else 'gradients reduced by hand'}: "
              f"expert params per rank {experts} + Adam states {adam} "
              f"(all experts: {full} + {2 * full})", flush=True)

    probe = batch(99, rank, args.tokens, device)[0]
    with torch.no_grad():
        want = layer(probe)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint_dir or os.path.join(tmp, "ckpt")
        if args.checkpoint_dir is None:  # every rank writes into rank 0's directory
            box = [path]
            dist.broadcast_object_list(box, src=0)
            path = box[0]
        moe_fn.dcp.save(path, layer, opt)
        torch.manual_seed(1)
        fresh = moe_fn.MoELayer(config, mesh["ep"], device=device)
        if fully_shard_moe is not None:
            fully_shard_moe(fresh, mesh)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        moe_fn.dcp.load(path, fresh, fresh_opt)
        dist.barrier()
    with torch.no_grad():
        same = torch.equal(fresh(probe), want)
    # The same layout: one more step of each from the same state is the same computation.
    for model, optimizer in ((layer, opt), (fresh, fresh_opt)):
        x, target = batch(args.steps, rank, args.tokens, device)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), target).backward()
        if fully_shard_moe is None:
            reduce_by_hand(model)
        optimizer.step()
    with torch.no_grad():
        diff = (fresh(probe) - layer(probe)).abs().max()
    ok = torch.tensor(float(same), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    same_everywhere = bool(ok.item())
    # On the CPU every kernel is deterministic: bit for bit. GPU kernels that add with
    # atomics may sum in another order (the difference is then rounding).
    passed = same_everywhere and (device.type != "cpu" or diff.item() == 0)
    if rank == 0:
        after = "identical" if diff.item() == 0 else f"max |difference| {diff.item():.3g}"
        print(f"DCP save and load into a fresh layer: outputs "
              f"{'identical' if same_everywhere else 'DIFFERENT'} on every rank; after one "
              f"more step of each: {after}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
