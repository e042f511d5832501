"""The small collectives the exchanges' layouts (and the layer's agreement check) run."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (and deprecates the old name); 2.11 lacks it.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_and_size(group, backend: str) -> tuple:
    """``(group, size, rank)`` of an expert-parallel group (None: the default group, kept
    as None so that a layer holding it can be copied), which torch.distributed must have
    made already."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"comm_backend={backend!r} needs torch.distributed initialised "
                           "(dist.init_process_group) before the layer is built")
    return group, dist.get_world_size(group), dist.get_rank(group)


def gather_counts(plan, ep_size: int, group, stamp=None):
    """``(ep, E)``: every rank's per-expert row counts (``plan.counts``), one collective
    without a host sync. With ``stamp`` (a small int64 tensor) every rank's stamp travels
    in the same collective: returns ``(counts (ep, E), stamps (ep, S))``."""
    mine = plan.counts.contiguous()
    if stamp is not None:
        mine = torch.cat([mine, stamp.to(mine.device, mine.dtype)])
    c = mine.new_empty(ep_size * mine.numel()).view(ep_size, -1)
    all_gather(c.view(-1), mine, group=group)
    if stamp is None:
        return c
    e = plan.counts.numel()
    return c[:, :e], c[:, e:]


def gather_stamps(stamp, ep_size: int, group) -> torch.Tensor:
    """``(ep, S)``: every rank's ``stamp``, for exchanges whose layout gathers nothing."""
    every = stamp.new_empty(ep_size * stamp.numel())
    all_gather(every, stamp.contiguous(), group=group)
    return every.view(ep_size, -1)
