"""The end of a spawned expert-parallel process, once every rank is past its last
collective (after a barrier)."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from .nccl_pool import release_registered_buffers
from .peer_memory import release_peer_memory


def release_exchange_buffers() -> None:
    """Free what the exchanges keep between moves: the registered pools (deregistered while
    their communicator lives) and the symmetric-memory buffers. Call on every rank with
    nothing in flight, before ``destroy_process_group``; the next move makes new ones."""
    release_registered_buffers()
    release_peer_memory()


def leave_after_last_collective(exit_code: int = 0) -> None:
    """Release what the exchanges hold and leave. Over NCCL: ``release_exchange_buffers()``
    while the communicator lives, then ``destroy_process_group``; the caller
    returns as usual. Over gloo: exit the process now with ``exit_code``, skipping the
    teardown. Tearing gloo down, or the interpreter's exit after it, has now and then
    aborted a finished rank ("terminate called without an active exception", in CI runs
    of the test harness and of the demo, after a barrier); a finished rank loses nothing
    by skipping it. Never call it from a process that must go on."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    release_exchange_buffers()
    if dist.is_initialized():
        dist.destroy_process_group()
