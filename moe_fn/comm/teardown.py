"""The end of a spawned expert-parallel process, once every rank is past its last
collective (after a barrier)."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from .peer_memory import release_peer_memory


def release_exchange_buffers() -> None:
    """Free what the all_to_all exchanges keep between moves: the symmetric-memory
    buffers. Call on every rank with nothing in flight, before ``destroy_process_group``;
    the next move makes new ones. (DeepEP's ``Buffer``, built without
    ``explicitly_destroy``, stays until the process ends, as in DeepEP's own tests.)"""
    release_peer_memory()


def leave_after_last_collective(exit_code: int = 0, *, tear_down_nccl: bool = True) -> None:
    """Release what the exchanges hold and leave. Over NCCL (with ``tear_down_nccl``):
    ``release_exchange_buffers()`` while the communicator lives, then
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
    release_exchange_buffers()
    if dist.is_initialized():
        dist.destroy_process_group()
