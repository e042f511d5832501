"""Process groups held by pickled and copied objects (layers, exchanges, balancing state).

A process group is a communicator of this process: it cannot be pickled, and a copy of a
layer in the same process must use the same one. ``HoldsProcessGroups`` gives a class
whose instances keep groups in their ``__dict__`` what a user of a layer expects, as
``DistributedDataParallel`` does for its own group:

- ``copy.deepcopy`` (and ``copy.copy``): the copy holds the same group objects;
- ``pickle`` / ``torch.save``: the default group (``dist.group.WORLD``) is saved as "the
  default group" and loads as the loading process's default group, which
  ``torch.distributed`` must have made before the load (as before the layer was built);
  any other group is refused, naming the attribute and the fix (its state dict, or a layer
  built on the default group).

``None`` (the default group, read at every collective) is pickled as it is.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["HoldsProcessGroups", "check_loaded_group"]

# Builds without torch.distributed have no ProcessGroup, and so no group to hold.
_GROUP_TYPES = (dist.ProcessGroup,) if dist.is_available() else ()


def _is_default(group) -> bool:
    return dist.is_initialized() and group is dist.group.WORLD


class _HeldGroup:
    """A group in a holder's pickled or copied state: copies share it; a pickle saves the
    default group by that name and refuses any other."""

    def __init__(self, group, where: str):
        self.group, self.where = group, where

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        if _is_default(self.group):
            return _default_group, (self.where,)
        raise TypeError(
            f"cannot pickle {self.where}: it is a process group other than the default one "
            "(dist.group.WORLD), which no other process can rebuild. Save the model's "
            "state_dict() instead (torch.save(model.state_dict()), or "
            "torch.distributed.checkpoint; moe_fn.hf.gather_expert_state_dict for a full HF "
            "one) and load it into a model built with its group, or build the layer on the "
            "default group (process_group=None), which pickles")


def _default_group(where: str) -> _HeldGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where} was saved holding the default process group: initialise "
            "torch.distributed (dist.init_process_group) before loading it, as before "
            "building it, or load its state_dict() into a model built here")
    return _HeldGroup(dist.group.WORLD, where)


class HoldsProcessGroups:
    """Mixin: the process groups among the instance's attributes are shared by copies and
    pickled as the module describes (``__getstate__`` / ``__setstate__``; nn.Module's
    run too)."""

    def __getstate__(self):
        parent = getattr(super(), "__getstate__", None)
        state = parent() if parent is not None else self.__dict__
        state = dict(state or {})
        for key, value in state.items():
            if isinstance(value, _GROUP_TYPES):
                state[key] = _HeldGroup(value, f"{type(self).__name__}.{key}")
        return state

    def __setstate__(self, state):
        state = {k: v.group if isinstance(v, _HeldGroup) else v for k, v in state.items()}
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)


def check_loaded_group(group, *, size: int, rank: int | None, what: str) -> None:
    """A loaded object that communicates over ``group`` (None: the default group) finds the
    group it was saved with: torch.distributed initialised, ``size`` ranks and, where the
    object belongs to one rank (an expert-parallel slice), that rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} communicates over torch.distributed: initialise it "
            "(dist.init_process_group) before loading it, as before building it, or load "
            "its state_dict() into a model built here")
    here_size, here_rank = dist.get_world_size(group), dist.get_rank(group)
    if here_size != size or (rank is not None and here_rank != rank):
        saved = f"rank {rank} of {size}" if rank is not None else f"a group of {size} ranks"
        raise RuntimeError(
            f"{what} was saved by {saved} but is loaded by rank {here_rank} of "
            f"{here_size}: each rank must load what it saved, in a job of the same size; "
            "to load elsewhere, load its state_dict() (moe_fn.hf.gather_expert_state_dict "
            "for a full HF one) into a model built there")
