"""The process's communication resources: DeepEP's buffers, symmetric memory, the recompute
skip's NaN sentinels and the side streams of overlapped moves, one owner per (process
group, device) (``moe_fn.comm.resources``), made at first use.

``release_comm_resources()`` frees them (call it on every rank, with nothing in flight,
before ``destroy_process_group``); it also runs at interpreter exit. Every MoELayer's
exchange draws on ``RESOURCES``.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from .comm.resources import ResourceRegistry

RESOURCES = ResourceRegistry(home=f"{__name__}:RESOURCES")


def release_comm_resources(group=None) -> None:
    """Free what the exchanges keep between moves, for ``group`` (every group when None):
    DeepEP's buffers (collectively), symmetric memory, sentinels, side streams. Call it on
    every rank of those groups with nothing in flight, before ``destroy_process_group``; the
    next move makes new ones."""
    RESOURCES.release(group)


def leave_after_last_collective(exit_code: int = 0, *, tear_down_nccl: bool = True) -> None:
    """The end of a spawned expert-parallel process, once every rank is past its last
    collective (after a barrier). Over NCCL (with ``tear_down_nccl``):
    ``release_comm_resources()`` while the communicator lives, then
    ``destroy_process_group``; the caller returns as usual. Over gloo (or NCCL without
    ``tear_down_nccl``): exit the process now with ``exit_code``, skipping the teardown.
    Tearing gloo down, or the interpreter's exit after it, has now and then aborted a
    finished rank ("terminate called without an active exception", in CI runs of the test
    harness and of the demo, after a barrier).

    Leaving at once flushes stdout, stderr and ``logging``'s handlers, and skips everything
    else an exit runs: atexit handlers, other open files' buffers, non-daemon threads, a
    ``multiprocessing.Queue``'s feeder thread. So call it only from a process that is done:
    its results delivered synchronously (a ``SimpleQueue.put`` or a written, closed file),
    nothing left to write."""
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    if gloo or not tear_down_nccl:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(exit_code)
    release_comm_resources()
    if dist.is_initialized():
        dist.destroy_process_group()
