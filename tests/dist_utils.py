"""Run a test body on several gloo processes on this CPU machine."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    # Every rank is past its last collective: leave at once. Tearing gloo down, or the
    # interpreter's exit after it, has now and then aborted a finished process ("terminate
    # called without an active exception", twice in CI runs, also after a barrier);
    # skipping both loses nothing a test checks (spawn reads the exit code).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world: int, *args, backend: str = "gloo") -> None:
    """Spawn ``world`` processes running ``fn(rank, world, *args)``; a failure in any raises.
    ``backend="nccl"``: one GPU per process (rank r on cuda:r)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, os.path.join(d, "init"), fn, args, backend),
                 nprocs=world, join=True)
