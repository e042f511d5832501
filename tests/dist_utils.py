"""Run a test body on several gloo processes on this CPU machine."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_fn.resources import leave_after_last_collective


def _entry(rank, world, init_file, fn, args, backend="gloo"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave at once, GPU ranks too: the ranks skip the NCCL teardown (buffer release,
    # destroy_process_group), as the process exits anyway.
    leave_after_last_collective(tear_down_nccl=False)


def run_distributed(fn, world: int, *args, backend: str = "gloo") -> None:
    """Spawn ``world`` processes running ``fn(rank, world, *args)``; a failure in any raises.
    ``backend="nccl"``: one GPU per process (rank r on cuda:r)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, os.path.join(d, "init"), fn, args, backend),
                 nprocs=world, join=True)
