"""Memory registered with NCCL (``all_to_all_transport="registered"``).

NCCL user-buffer registration: a send or receive buffer that lies in memory registered with
the communicator is moved between the GPUs' buffers directly, without NCCL's staging copies
(less memory traffic and fewer SMs, by NCCL's documentation; on two H200s a raw transfer of
the layer's rows took 5-14% less time, bench/RESULTS.md). torch offers it as a CUDA memory
pool of NCCL's allocator, registered with ``ProcessGroupNCCL.register_mem_pool`` (segments
the pool gains later are registered as it grows). One pool per process group and device,
shared by every layer's moves.

A pool must be deregistered while its communicator lives: torch deregisters a freed pool's
segments through the communicator, and after ``destroy_process_group`` that aborts the
process. ``release_registered_buffers()`` does it (call it on every rank before
``destroy_process_group``); it also runs at exit, where a pool whose group is already
destroyed is left for the process's end to reclaim rather than freed.

What the pool holds: every row move's send and receive buffers, and so the returned rows a
weighted combine keeps for its backward (T·k × H per layer from forward to backward). Its
blocks, once free, serve the next moves; torch lends them to other allocations only when
those would otherwise run out of memory.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading

import torch
import torch.distributed as dist

_POOLS: dict = {}
_AT_EXIT = []
# torch refuses two threads allocating to one pool at once (a forward in one thread and
# an autograd backward in another): one lock around every registered allocation.
_LOCK = threading.Lock()


def _pool(group, device: torch.device):
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
    with torch.cuda.device(device):  # a pool belongs to the current device
        try:  # its free blocks lent to other allocations that would run out of memory
            pool = torch.cuda.MemPool(backend.mem_allocator, use_on_oom=True)
        except TypeError:  # a torch without the option
            pool = torch.cuda.MemPool(backend.mem_allocator)
        backend.register_mem_pool(pool)
    _POOLS[key] = pool
    if not _AT_EXIT:
        atexit.register(release_registered_buffers)
        _AT_EXIT.append(True)
    return pool


def registered_pool(group, device: torch.device):
    """The CUDA memory pool registered with ``group``'s NCCL communicator on ``device``
    (``None``: the default group), made at the first call, which needs the communicator
    made (by a first collective: every move follows its layout's)."""
    with _LOCK:
        return _pool(group, device)


@contextlib.contextmanager
def registered_memory(group, device: torch.device):
    """Allocations on ``device`` inside the block (keep it to allocations) go to the
    registered pool."""
    with _LOCK, torch.cuda.use_mem_pool(_pool(group, device), device):
        yield


def release_registered_buffers() -> None:
    """Deregister and forget every registered pool (call on every rank, after a barrier,
    with nothing in flight, before ``destroy_process_group``): its memory is freed once no
    tensor holds it, and the next move makes a new pool. A pool that cannot be
    deregistered (its group already destroyed, its communicator aborted) is kept, unfreed,
    until the process ends."""
    live = getattr(dist.distributed_c10d, "_world", None)
    with _LOCK:
        for (pg, index), pool in list(_POOLS.items()):
            del _POOLS[(pg, index)]
            try:
                if not (dist.is_initialized() and live is not None and pg in live.pg_map):
                    raise RuntimeError("the process group is destroyed")
                pg._get_backend(torch.device("cuda", index)).deregister_mem_pool(pool)
            except Exception:  # noqa: BLE001
                # Never freed: freeing it would deregister through a dead communicator,
                # which aborts the process.
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))
