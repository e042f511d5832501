"""docs/expert_parallel.md's recipe for expert parallelism with data parallelism over the
same ranks: DDP ignores the expert parameters (so its start-up broadcast and gradient
averaging leave them alone), the expert gradients are divided by the group size; the
result equals one process training the unconverted model on every rank's batch (gloo,
2 ranks)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from moe_fn.hf import convert, expert_parameter_names
from tests.dist_utils import run_distributed
from tests.hf.models import Parity, batch, float64_twin, keep_float64, make_model


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False).loss


def _ddp_body(rank, world):
    ref = make_model("qwen3_moe")
    ref64 = float64_twin(ref)  # the oracle; the float32 one is plain PyTorch
    # Another seed on rank 1: without the exclusion, DDP's start-up broadcast would copy
    # rank 0's experts over these (and its averaging would mix different experts' grads).
    conv = convert(copy.deepcopy(ref) if rank == 0 else make_model("qwen3_moe", seed=rank),
                   ep_size=world)
    names = expert_parameter_names(conv)
    params = dict(conv.named_parameters())
    full = dict(ref.named_parameters())
    with torch.no_grad():  # replicated weights from rank 0's broadcast, experts by hand
        for n, p in params.items():
            if n in names:
                p.copy_(full[n].chunk(world)[rank])
    before = {n: params[n].detach().clone() for n in names}
    DDP._set_params_and_buffers_to_ignore_for_model(conv, names)
    ddp = DDP(conv)
    for n in names:
        assert torch.equal(params[n], before[n]), f"DDP overwrote expert parameter {n}"
    _loss(ddp, batch(seed=rank)[0]).backward()
    for n, p in params.items():
        if n in names:
            p.grad.div_(world)

    # One process, every rank's batch: the mean of the per-rank losses (what DDP averages).
    (sum(_loss(ref, batch(seed=r)[0]) for r in range(world)) / world).backward()
    with keep_float64():
        (sum(_loss(ref64, batch(seed=r)[0]) for r in range(world)) / world).backward()
    full64 = dict(ref64.named_parameters())
    parity = Parity(f"rank {rank}")
    for n, p in params.items():
        want, want64 = full[n].grad, full64[n].grad
        if n in names:
            want, want64 = want.chunk(world)[rank], want64.chunk(world)[rank]
        parity.add(f"grad {n}", p.grad, want, want64)
    parity.check()
    dist.barrier()


def test_ddp_ignoring_the_experts_equals_one_process_on_every_batch():
    run_distributed(_ddp_body, 2)
