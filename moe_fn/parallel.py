"""FSDP2 over expert-parallel layers, and gradient clipping over their DTensors.

The recipe (data parallel over ``DP`` ranks, expert parallel over ``EP`` of them, ``DP`` a
multiple of ``EP``): a 2-D mesh ``(dp_shard_mod_ep, ep)`` of ``DP/EP x EP`` ranks, every
MoE layer built on ``mesh["ep"]`` (``MoELayer(config, mesh["ep"])``,
``moe_fn.hf.convert(model, ep_mesh=mesh["ep"])``), then :func:`fully_shard_moe`:

- each layer's experts are an FSDP unit of their own over ``dp_shard_mod_ep`` (the ranks
  holding the same experts), their gradients divided by the whole ``DP``: the exchange's
  backward already summed every expert-parallel rank's tokens into them;
- everything else is one unit over the whole data-parallel mesh (the flattened 2-D mesh),
  or, with ``dense_modules`` (a transformer's blocks), one unit per block and the root;
- each layer's expert-load counts (and so DeepSeek-V3's bias update) reduce over the whole
  data-parallel mesh by default: every replica of a layer holds the same bias.

With a 1-D mesh (``EP == DP``) the experts are not sharded further (each rank holds its own
and nothing else does); the library divides their gradients by ``DP``.

:func:`clip_grad_norm_` clips by the global norm of gradients that live on different meshes
(experts on the 2-D mesh, the rest on the data-parallel one), which torch's own cannot stack.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .balance import moe_layers
from .placement import _is_dtensor

__all__ = ["clip_grad_norm_", "experts_holder", "fully_shard_moe"]

REPLICA_DIM, EP_DIM = "dp_shard_mod_ep", "ep"


def experts_holder(layer) -> nn.Module:
    """The module holding a layer's expert parameters (its MoEExperts, or a converted HF
    block's experts module)."""
    return getattr(layer.experts, "holder", layer.experts)


def _ranks(mesh) -> list[int]:
    return sorted(mesh.mesh.flatten().tolist())


def fully_shard_moe(model: nn.Module, mesh, *, dense_modules=(), mp_policy=None,
                    reshard_after_forward: bool = True) -> nn.Module:
    """Apply the recipe above to ``model`` (in place; returns it). ``mesh``: the 2-D
    ``(dp_shard_mod_ep, ep)`` DeviceMesh, or a 1-D one when ``EP == DP``. ``dense_modules``:
    submodules of ``model`` (a transformer's blocks, say) that become units of their own
    over the data-parallel mesh, after the experts' units inside them (their all-gathers
    then overlap the previous block's compute); the rest of ``model`` is the root unit.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``, for every unit, the experts' included
    (they compute in its ``param_dtype``).

    Raises ValueError, on every rank before any collective, for a layer not built on
    ``mesh["ep"]`` (a process group, or another mesh), for a mesh of another shape, for a
    dense module that is not in ``model`` or is a layer's experts, and for a DTensor
    parameter over ranks of the data-parallel mesh that would land in a dense unit (expert
    parameters whose layer ``model`` does not hold: FSDP2 would fail on "overlapping
    meshes")."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if mesh.ndim == 2:
        if names != (REPLICA_DIM, EP_DIM):
            raise ValueError(f"the mesh's dimensions are {names}; fully_shard_moe takes "
                             f"({REPLICA_DIM!r}, {EP_DIM!r}): init_device_mesh(device, "
                             f"(dp // ep, ep), mesh_dim_names=({REPLICA_DIM!r}, {EP_DIM!r}))")
        ep_mesh, replica = mesh[EP_DIM], mesh[REPLICA_DIM]
        dp_mesh = mesh._flatten("dp")
    elif mesh.ndim == 1:
        ep_mesh = replica = None
        dp_mesh = mesh
    else:
        raise ValueError(f"mesh must be 1-D (EP == DP) or 2-D ({REPLICA_DIM!r}, {EP_DIM!r}), "
                         f"got {mesh.ndim}-D")
    dp = dp_mesh.size()
    layers = moe_layers(model)
    for name, layer in layers:
        ep = layer.config.ep_size
        if ep == 1:
            continue
        where = name or "the model"
        if layer.ep_mesh is None:
            raise ValueError(
                f"{where}: its layer is expert-parallel over a process group (plain slices "
                "FSDP cannot see as shards); build it on the mesh's expert dimension: "
                "MoELayer(config, mesh['ep']) or moe_fn.hf.convert(model, ep_mesh=mesh['ep'])")
        want = ep_mesh if ep_mesh is not None else mesh
        if layer.ep_mesh != want:
            raise ValueError(
                f"{where}: its expert-parallel mesh {layer.ep_mesh} (ranks "
                f"{_ranks(layer.ep_mesh)}) is not the FSDP mesh's expert dimension {want} "
                f"(ranks {_ranks(want)}): build the layers on "
                f"{'mesh[' + repr(EP_DIM) + ']' if ep_mesh is not None else 'mesh'} of the "
                "mesh passed here")
    holders = {id(experts_holder(layer)): name for name, layer in layers
               if layer.config.ep_size > 1}
    dense = _checked_dense_modules(model, dense_modules, holders)
    for where, unit in [*dense, ("", model)]:
        _refuse_dtensors_in_dense_unit(where, unit, holders, dense, dp_mesh)
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    gloo = dist.get_backend(dp_mesh.get_group()) == "gloo"
    expert_params = []
    for _, layer in layers:
        layer.balance.load_group = dp_mesh.get_group()
        if layer.config.ep_size == 1:
            continue
        holder = experts_holder(layer)
        params = [p for p in holder.parameters(recurse=False)]
        if replica is not None:
            fully_shard(holder, mesh=replica, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
            holder.set_gradient_divide_factor(float(dp))
            if gloo:  # gloo has no pre-scaled reduce-scatter: sum, then divide
                holder.set_force_sum_reduction_for_comms(True)
        else:
            expert_params += params
            for p in params:
                if p.requires_grad:
                    p.register_hook(_Divide(dp))
    for _, unit in dense:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward,
                    ignored_params=set(expert_params) or None)
        if gloo:
            unit.set_force_sum_reduction_for_comms(True)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
                ignored_params=set(expert_params) or None)
    if gloo:
        model.set_force_sum_reduction_for_comms(True)
    return model


def _checked_dense_modules(model, dense_modules, holders) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each dense module, the innermost first; refused where
    one is not a submodule of ``model`` (nor ``model`` itself: the root unit) or is a
    layer's experts module."""
    if isinstance(dense_modules, nn.Module):
        dense_modules = [dense_modules]
    names = {id(m): n for n, m in model.named_modules()}
    out, seen = [], set()
    for i, m in enumerate(dense_modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"dense_modules[{i}] must be an nn.Module, got {type(m).__name__}")
        if id(m) not in names or m is model:
            raise ValueError(f"dense_modules[{i}] ({type(m).__name__}) is not a submodule of "
                             "the model: pass the model's own blocks (model.model.layers, "
                             "say); the model itself is the root unit")
        if id(m) in holders:
            raise ValueError(f"dense_modules[{i}] ({names[id(m)]}) holds the experts of "
                             f"{holders[id(m)] or 'the model'}'s layer, which fully_shard_moe "
                             "shards in a unit of their own: pass the block around it")
        if id(m) not in seen:
            seen.add(id(m))
            out.append((names[id(m)], m))
    # Inner units before the units around them (FSDP2 skips what is already a unit).
    return sorted(out, key=lambda nm: -nm[0].count("."))


def _refuse_dtensors_in_dense_unit(where, unit, holders, dense, dp_mesh) -> None:
    """A DTensor parameter over ranks of the data-parallel mesh among those ``unit``'s dense
    FSDP unit would manage (not in a nested unit: the experts' modules, the other dense
    modules, units applied before): sharding it over that mesh again is what FSDP2 refuses
    as "overlapping meshes"; here it is named, with the fix."""
    from torch.distributed.fsdp import fully_shard

    dp_ranks = set(_ranks(dp_mesh))
    nested = set(holders) | {id(m) for _, m in dense}

    def walk(prefix, m):
        if m is not unit and (id(m) in nested or fully_shard.state(m) is not None):
            return
        for pname, p in m._parameters.items():
            if not _is_dtensor(p):
                continue
            mesh = p.device_mesh
            if mesh.ndim == 1 and len(set(_ranks(mesh)) & dp_ranks) > 1:
                full = f"{where}.{prefix}{pname}".strip(".")
                raise ValueError(
                    f"{full}: a DTensor parameter {tuple(p.placements)} over {mesh} (ranks "
                    f"{_ranks(mesh)}) would be sharded in the dense FSDP unit of "
                    f"{where or 'the model'} over the data-parallel mesh (ranks "
                    f"{sorted(dp_ranks)}), which already spans those ranks: FSDP2 refuses "
                    "that as overlapping meshes. Expert parameters are sharded in a unit of "
                    f"their own over the replica dimension {REPLICA_DIM!r} (the ranks "
                    "holding the same experts): pass fully_shard_moe the model that holds "
                    "their MoE layers (MoELayer(config, mesh['ep']) or moe_fn.hf.convert("
                    "model, ep_mesh=mesh['ep'])), not a part of it without the layer")
        for cname, child in m._modules.items():
            if child is not None:
                walk(f"{prefix}{cname}.", child)

    walk("", unit)


class _Divide:
    """A gradient hook dividing by the data-parallel size (a class: the model pickles)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, grad):
        return grad / self.n


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradients that are DTensors on several meshes
    (and plain tensors, each counted as this rank's own): the norm of each mesh's gradients
    is computed over the whole mesh (each shard once), the norms combined, and every
    gradient scaled by ``min(1, max_norm / (norm + 1e-6))``. Collective over every mesh
    the gradients live on. Returns the total norm (a plain 0-dim tensor, the same on every
    rank)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if _is_dtensor(g) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, norm_type, foreach=False)
        if _is_dtensor(n):
            n = n.full_tensor()
        norms.append(n.to(torch.float64))
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        total = stacked.max()
    else:
        total = stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           "non-finite: pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if _is_dtensor(g) else g
            local.mul_(coef.to(local.dtype))
    return total.to(grads[0].dtype)
