"""Where a layer's expert parameters live: split on their expert dimension (dim 0) over the
expert-parallel group, rank r holding experts ``r*E/ep ... (r+1)*E/ep - 1``.

Two forms of the same placement:

- A layer built on a ``DeviceMesh`` (1-D, e.g. ``mesh["ep"]``) with ``ep_size > 1`` holds
  its expert parameters as DTensors ``Shard(0)`` over that mesh: FSDP2 shards them over the
  mesh's other dimensions, ``torch.distributed.checkpoint`` saves and reshards them, and
  gradient clipping counts each expert once (``moe_fn.parallel``). The layer computes on
  their local tensors (:func:`local`), so its kernels see plain tensors as before.
- A layer built on a process group (or the default group) keeps plain tensors holding this
  rank's slice (``p.copy_(full[slice])`` works). Its ``state_dict()`` says what they are:
  each expert entry is a DTensor ``Shard(0)`` over ``DeviceMesh.from_group(group)`` (the
  local tensor, not a copy), so that DCP does not take the ranks' slices, which share a key,
  for one replicated tensor; ``load_state_dict`` takes such DTensors and the plain local
  slice alike.

One device (``ep_size == 1``) is plain tensors either way: no DTensor on the hot path.

FSDP2 may shard the expert parameters only in a unit of their own, over the mesh dimension
orthogonal to the expert-parallel one (the experts' replicas), and their gradients are then
divided by the whole data-parallel size, because the exchange's backward already sums every
expert-parallel rank's tokens into each expert's gradient (:func:`prepare_fsdp_experts`
applies that factor where it was left at FSDP's default). Sharding them as part of another
module's unit, or a plain-tensor layer's experts at all, is refused when ``fully_shard``
registers the shards (:class:`GuardedExperts`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # builds without torch.distributed: no mesh, no DTensor
    DeviceMesh = DTensor = Shard = None

__all__ = ["EXPERT_NAMES", "GuardedExperts", "LoadExperts", "SaveExperts", "ep_group_and_mesh",
           "experts_module_setup", "local", "prepare_fsdp_experts",
           "register_expert_state_hooks", "shard_experts"]

#: The attributes of a layer's experts that are split over the expert-parallel group.
EXPERT_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")

_FIX_FSDP = ("shard the experts in a unit of their own over the mesh dimension orthogonal to "
             "the expert-parallel one, and everything else over the whole data-parallel mesh: "
             "moe_fn.parallel.fully_shard_moe(model, mesh) does both, for layers built on "
             "mesh['ep'] (MoELayer(config, mesh['ep']), moe_fn.hf.convert(model, "
             "ep_mesh=mesh['ep']))")


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def ep_group_and_mesh(arg, what: str = "process_group"):
    """``(process group or None, mesh or None)`` from a layer's group argument: a
    ``ProcessGroup``, a 1-D ``DeviceMesh`` (a mesh dimension: its group), or None (the
    default group)."""
    if arg is None:
        return None, None
    if DeviceMesh is not None and isinstance(arg, DeviceMesh):
        if arg.ndim != 1:
            names = arg.mesh_dim_names
            raise ValueError(
                f"{what}: the expert-parallel mesh must be 1-D, got a {arg.ndim}-D mesh of "
                f"shape {tuple(arg.shape)}{f' (dimensions {names})' if names else ''}: pass "
                "the expert-parallel dimension, e.g. mesh['ep']")
        if arg.get_coordinate() is None:
            raise ValueError(f"{what}: this rank ({dist.get_rank()}) is not in the mesh "
                             f"{arg.mesh.tolist()}: every rank builds its layer on the "
                             "mesh dimension it belongs to (mesh['ep'] on each rank)")
        return arg.get_group(), arg
    if dist.is_available() and isinstance(arg, dist.ProcessGroup):
        return arg, None
    raise TypeError(f"{what} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh (e.g. "
                    f"mesh['ep']) or None, got {type(arg).__name__} (device and dtype are "
                    "keyword arguments: MoELayer(config, device=..., dtype=...))")


def shard_experts(t: torch.Tensor, mesh, num_experts: int) -> torch.Tensor:
    """This rank's slice ``t (E/ep, ...)`` as the DTensor ``Shard(0)`` over ``mesh`` of the
    whole ``(E, ...)`` tensor (no copy, no communication)."""
    shape = (num_experts, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=stride)


def local(t):
    """The tensor this rank computes with: a DTensor expert parameter's local tensor
    (differentiably: its gradient reaches the DTensor), anything else as it is."""
    if not _is_dtensor(t):
        return t
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(
            f"an expert parameter is a DTensor over {t.device_mesh} with placements "
            f"{tuple(t.placements)}, where the layer computes on its expert-parallel shard "
            "(Shard(0) over the 1-D expert-parallel mesh). FSDP2 hands the layer that form "
            "inside the forward of the experts' own unit; sharded over another dimension, or "
            f"read outside that forward, it is not this rank's experts: {_FIX_FSDP}")
    return t.to_local()


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def register_expert_state_hooks(module: nn.Module, keys) -> None:
    """The state-dict hooks of a module holding the expert parameters of an expert-parallel
    layer (``keys``, below the module's prefix): the MoELayer itself, or a converted HF block
    (whose ``moe_layer`` is the layer).

    The post-hook (:class:`SaveExperts`) gives a plain-tensor layer's slices as DTensors over
    its group; the load pre-hook (:class:`LoadExperts`) turns what a state dict may hold into
    what the parameter takes: a DTensor into a plain slice (its local tensor where it is
    ``Shard(0)`` over the same ranks, else this rank's rows of its full tensor), a plain slice
    into a DTensor parameter's form."""
    keys = tuple(keys)  # read by both hooks: an iterator would serve only the first
    module.register_state_dict_post_hook(SaveExperts(keys))
    module.register_load_state_dict_pre_hook(LoadExperts(keys))


class _ExpertStateHook:
    """A class, not a closure, so that the module holding it pickles."""

    def __init__(self, keys):
        self.keys = tuple(keys)

    @staticmethod
    def _layer(module):
        return getattr(module, "moe_layer", module)


class SaveExperts(_ExpertStateHook):
    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        layer = self._layer(module)
        if layer.config.ep_size == 1:
            return
        meshes = {}
        for key in self.keys:
            v = state_dict.get(prefix + key)
            if v is None or _is_dtensor(v) or v.is_meta:
                continue
            kind = v.device.type
            if kind not in meshes:
                group = layer.process_group
                meshes[kind] = DeviceMesh.from_group(
                    group if group is not None else dist.group.WORLD, kind,
                    mesh_dim_names=("ep",))
            state_dict[prefix + key] = shard_experts(v, meshes[kind], layer.config.num_experts)


class LoadExperts(_ExpertStateHook):
    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        layer = self._layer(module)
        c = layer.config
        if c.ep_size == 1:
            return
        for key in self.keys:
            v = state_dict.get(prefix + key)
            if v is None:
                continue
            p = module.get_parameter(key)
            if _is_dtensor(p):
                if _is_dtensor(v):
                    continue  # DTensor to DTensor: copy_ places it
                if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                    raise ValueError(
                        f"state_dict[{prefix + key!r}] is a plain tensor but the parameter "
                        f"is sharded over {p.device_mesh} ({tuple(p.placements)}), by FSDP: "
                        "load the layer's own state dict before fully_shard, or a DTensor "
                        "state dict (torch.distributed.checkpoint) after it")
                if tuple(v.shape) == tuple(p.to_local().shape):
                    state_dict[prefix + key] = shard_experts(v, p.device_mesh, c.num_experts)
                continue
            if not _is_dtensor(v):
                continue
            mesh = v.device_mesh
            if (mesh.ndim == 1 and tuple(v.placements) == (Shard(0),)
                    and mesh.mesh.tolist() == _ranks(layer.process_group)):
                state_dict[prefix + key] = v.to_local()
            else:
                # Another layout (a DCP load into another placement): this rank's rows.
                n = c.num_local_experts
                r = layer.ep_rank
                state_dict[prefix + key] = v.full_tensor()[r * n:(r + 1) * n]


class GuardedExperts:
    """Mixin for the module that holds an expert-parallel layer's expert parameters
    (MoEExperts, a converted HF experts module): FSDP2 replacing one of them by its shard
    (``fully_shard`` registers each shard with ``setattr``) is refused unless the module is
    a unit of its own and the layer's parameters are DTensors over the expert-parallel mesh.
    Otherwise FSDP would take the ranks' different experts for one replicated tensor and
    all-gather a mix of them (plain slices), or fail on overlapping meshes (DTensors).

    The module's ``_moe_fn_ep_size`` (in its ``__dict__``; absent or 1: no check) says
    whether it is expert-parallel."""

    def __setattr__(self, name, value):
        if name in EXPERT_NAMES and _is_dtensor(value):
            _check_shard(self, name, value)
        super().__setattr__(name, value)


def _check_shard(module, name, value) -> None:
    d = module.__dict__
    if d.get("_moe_fn_ep_size", 1) == 1 or d.get("_moe_fn_fsdp_ok"):
        return
    current = module._parameters.get(name)
    if current is None:
        return
    if (_is_dtensor(current) and current.device_mesh == value.device_mesh
            and current.placements == value.placements):
        return  # the same placement: a parameter replaced by one like it
    from torch.distributed.fsdp import fully_shard

    own = fully_shard.state(module) is not None
    if own and _is_dtensor(current):
        d["_moe_fn_fsdp_ok"] = True
        return
    ep = d["_moe_fn_ep_size"]
    if not own:
        raise ValueError(
            f"{type(module).__name__}.{name}: fully_shard of an enclosing module would shard "
            f"an expert parameter of an expert-parallel layer (ep_size={ep}) over "
            f"{value.device_mesh}, as part of that module's unit: its ranks hold different "
            f"experts, which FSDP would treat as one replicated tensor. Either {_FIX_FSDP}; "
            "or, with the layers on a process group, leave the experts out "
            "(fully_shard(..., ignored_params=experts), docs/expert_parallel.md)")
    raise ValueError(
        f"{type(module).__name__}.{name}: fully_shard of the experts of a layer built on a "
        f"process group (ep_size={ep}): their parameters are plain slices, whose placement "
        "FSDP cannot see (its shards, and a distributed checkpoint of them, would take "
        "different ranks' experts for one tensor). Build the layer on a DeviceMesh "
        f"dimension instead: {_FIX_FSDP}")


def prepare_fsdp_experts(module, ep_size: int) -> None:
    """Called in the experts' forward: where FSDP2 shards them (``module`` a unit of its
    own), their gradient reduction divides by the whole data-parallel size (the unit's mesh
    times ``ep_size``: the exchange's backward already summed the expert-parallel ranks'
    tokens), set here where left at FSDP's default (its mean over the unit's mesh); another
    factor is refused. Over gloo, which has no pre-scaled sum, the reduction sums and then
    divides. Once per module."""
    d = module.__dict__
    if ep_size == 1 or d.get("_moe_fn_fsdp_ready"):
        return
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    state = module._get_fsdp_state()
    # torch 2.13 keeps a list of parameter groups, earlier versions one (or None).
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    if not groups:
        d["_moe_fn_fsdp_ready"] = True
        return
    mesh = groups[0].mesh_info.mesh
    want = float(mesh.size() * ep_size)
    factor = groups[0].gradient_divide_factor
    if factor is None:
        module.set_gradient_divide_factor(want)
    elif float(factor) != want:
        raise ValueError(
            f"the experts' FSDP unit ({type(module).__name__}, over {mesh}) divides their "
            f"gradients by {factor}, but the expert-parallel exchange already sums the "
            f"tokens of its {ep_size} ranks into each expert's gradient: divide by the whole "
            f"data-parallel size, module.set_gradient_divide_factor({want:g}) (what "
            "moe_fn.parallel.fully_shard_moe sets), for gradients equal to the mean over "
            "every rank's batch")
    if any(dist.get_backend(mesh.get_group(i)) == "gloo" for i in range(mesh.ndim)):
        module.set_force_sum_reduction_for_comms(True)
    d["_moe_fn_fsdp_ready"] = True


def experts_module_setup(module: nn.Module, ep_size: int) -> None:
    """Mark ``module`` (a :class:`GuardedExperts`) as holding an expert-parallel layer's
    experts (after its parameters are in place)."""
    module.__dict__["_moe_fn_ep_size"] = ep_size
