"""Memory registered with NCCL (``all_to_all_transport="registered"``).

NCCL user-buffer registration: a send or receive buffer that lies in memory registered with
the communicator is moved between the GPUs' buffers directly, without NCCL's staging copies
and on fewer SMs. torch offers it as a CUDA memory pool of NCCL's allocator, registered with
``ProcessGroupNCCL.register_mem_pool`` (segments the pool gains later are registered as it
grows). One pool per process group and device, shared by every layer's moves.

A pool must be deregistered while its communicator lives: torch deregisters a freed pool's
segments through the communicator, and after ``destroy_process_group`` that aborts the
process. ``release_registered_buffers()`` does it (call it on every rank before
``destroy_process_group``); it also runs at exit, where a pool whose group is already
destroyed is left for the process's end to reclaim rather than freed.
"""

from __future__ import annotations

import atexit
import ctypes

import torch
import torch.distributed as dist

_POOLS: dict = {}
_AT_EXIT = []


def registered_pool(group, device: torch.device):
    """The CUDA memory pool registered with ``group``'s NCCL communicator on ``device``
    (``None``: the default group), made at the first call."""
    pg = group if group is not None else dist.group.WORLD
    key = (pg, device.index)
    pool = _POOLS.get(key)
    if pool is not None:
        return pool
    backend = pg._get_backend(device)
    if not hasattr(backend, "register_mem_pool"):
        raise RuntimeError(
            f"all_to_all_transport='registered' registers buffers with NCCL, but this "
            f"group's backend on {device} is {type(backend).__name__}: use an NCCL process "
            "group, or all_to_all_transport='collective'")
    pool = torch.cuda.MemPool(backend.mem_allocator)
    backend.register_mem_pool(pool)
    _POOLS[key] = pool
    if not _AT_EXIT:
        atexit.register(release_registered_buffers)
        _AT_EXIT.append(True)
    return pool


def release_registered_buffers() -> None:
    """Deregister and forget every registered pool (call on every rank, with nothing in
    flight, before ``destroy_process_group``): its memory is freed once no tensor holds
    it, and the next move makes a new pool. A pool whose group is already destroyed cannot
    be deregistered; it is kept, unfreed, until the process ends."""
    live = getattr(dist.distributed_c10d, "_world", None)
    for (pg, index), pool in list(_POOLS.items()):
        del _POOLS[(pg, index)]
        if dist.is_initialized() and live is not None and pg in live.pg_map:
            pg._get_backend(torch.device("cuda", index)).deregister_mem_pool(pool)
        else:
            # Never freed: freeing it would deregister through the destroyed communicator.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))
