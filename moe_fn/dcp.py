"""Distributed checkpoints (``torch.distributed.checkpoint``) of models holding expert-parallel
MoELayers, and of their optimizers: sharded (each rank writes its own experts, no rank
gathers them) and reshardable (a load into another expert-parallel size, or into one
process, takes each rank's rows).

A layer built on a DeviceMesh already holds its expert parameters, and so its optimizer's
states, as DTensors ``Shard(0)``; torch's ``get_state_dict`` / ``set_state_dict`` serve it
as they are. A layer built on a process group holds plain slices: its ``state_dict()``
gives them as DTensors (``moe_fn.placement``), and :func:`get_state_dict` does the same for
their optimizer states (AdamW's ``exp_avg``, ``exp_avg_sq``), which DCP would otherwise
take for one tensor replicated over the ranks, saving rank 0's only.

    state = moe_fn.dcp.get_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=path)
    ...
    state = moe_fn.dcp.get_state_dict(model, optimizer)   # the layout to load into
    moe_fn.dcp.check_checkpoint(path, state)               # a clear error on every rank
    dcp.load(state, checkpoint_id=path)
    moe_fn.dcp.set_state_dict(model, optimizer, state)

(:func:`save` and :func:`load` do exactly that.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .layer import MoELayer
from .placement import EXPERT_NAMES, DeviceMesh, DTensor, Shard, shard_experts

__all__ = ["check_checkpoint", "get_state_dict", "load", "save", "set_state_dict"]


def _plain_expert_params(model: nn.Module) -> dict[int, MoELayer]:
    """``id(parameter) -> layer`` of the plain-slice expert parameters (layers on a process
    group with ``ep_size > 1``)."""
    found = {}
    params = {id(p) for p in model.parameters()}
    for where, m in model.named_modules():
        # A converted HF block holds its layer outside its submodules (``moe_layer``).
        m = m if isinstance(m, MoELayer) else m.__dict__.get("_moe_fn_layer")
        if isinstance(m, MoELayer) and m.config.ep_size > 1 and m.ep_mesh is None:
            for name in EXPERT_NAMES:
                p = getattr(m.experts, name, None)
                if p is None:
                    continue
                if id(p) not in params:
                    # Views of another module's parameters (a converted HF block): their
                    # slices would be saved as one replicated tensor, rank 0's.
                    raise ValueError(
                        f"{where or 'the model'}: an expert-parallel layer on a process "
                        f"group whose experts.{name} is a view of another parameter, whose "
                        "placement moe_fn.dcp cannot give DCP: build it on a DeviceMesh "
                        "(the layer's expert parameters are then DTensors), or export full "
                        "tensors with moe_fn.hf.gather_expert_state_dict")
                found[id(p)] = m
    return found


def _group_mesh(layer: MoELayer, device_type: str, cache: dict):
    key = (id(layer.process_group), device_type)
    if key not in cache:
        group = layer.process_group if layer.process_group is not None else dist.group.WORLD
        cache[key] = DeviceMesh.from_group(group, device_type, mesh_dim_names=("ep",))
    return cache[key]


def _named_plain_experts(model):
    plain = _plain_expert_params(model)
    return {n: (p, plain[id(p)]) for n, p in model.named_parameters() if id(p) in plain}


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optim": ...}`` (``"optim"`` only with an optimizer) for
    ``torch.distributed.checkpoint``: torch's ``get_model_state_dict`` /
    ``get_optimizer_state_dict``, with the optimizer states of process-group layers' expert
    parameters given as DTensors ``Shard(0)`` over their group, as the parameters are
    (their local tensors: no copy)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    plain = _named_plain_experts(model)  # refuses layers it cannot place, before saving
    msd = get_model_state_dict(model)
    meshes = {}
    for name, (p, layer) in plain.items():
        # A module without moe_fn's state-dict hooks (a converted HF block) gives the slice.
        v = msd.get(name)
        if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.shape:
            msd[name] = shard_experts(v, _group_mesh(layer, v.device.type, meshes),
                                      layer.config.num_experts)
    out = {"model": msd}
    if optimizer is None:
        return out
    osd = get_optimizer_state_dict(model, optimizer)
    for name, (p, layer) in plain.items():
        # A copy of the entry: torch's dict may be the optimizer's own per-parameter state.
        entry = osd["state"][name] = dict(osd["state"].get(name, {}))
        for k, v in entry.items():
            if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0 \
                    and v.shape == p.shape:
                entry[k] = shard_experts(
                    v, _group_mesh(layer, v.device.type, meshes), layer.config.num_experts)
    out["optim"] = osd
    return out


def _this_ranks_rows(v, layer: MoELayer):
    """A DTensor expert state as this rank's plain slice: its local tensor where it is
    ``Shard(0)`` over the layer's own ranks, else this rank's rows of the full tensor."""
    group = layer.process_group if layer.process_group is not None else dist.group.WORLD
    if (v.device_mesh.ndim == 1 and tuple(v.placements) == (Shard(0),)
            and v.device_mesh.mesh.tolist() == dist.get_process_group_ranks(group)):
        return v.to_local()
    n, r = layer.config.num_local_experts, layer.ep_rank
    return v.full_tensor()[r * n:(r + 1) * n]


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   state: dict) -> None:
    """Load ``state`` (:func:`get_state_dict`'s form, filled by ``dcp.load``) into ``model``
    and ``optimizer``: torch's ``set_model_state_dict`` / ``set_optimizer_state_dict``, the
    process-group layers' expert optimizer states turned back into their plain slices."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    plain = _named_plain_experts(model)
    msd = dict(state["model"])
    for name, (_, layer) in plain.items():
        if isinstance(msd.get(name), DTensor):
            msd[name] = _this_ranks_rows(msd[name], layer)
    set_model_state_dict(model, msd)
    if optimizer is None:
        return
    if "optim" not in state:
        raise ValueError("set_state_dict: the state holds no optimizer ('optim'): pass "
                         "optimizer=None, or a state from get_state_dict(model, optimizer)")
    osd = state["optim"]
    for name, (_, layer) in plain.items():
        entry = osd["state"][name] = dict(osd["state"].get(name, {}))
        for k, v in entry.items():
            if isinstance(v, DTensor):
                entry[k] = _this_ranks_rows(v, layer)
    set_optimizer_state_dict(model, optimizer, osd)


def _global_shapes(state: dict, prefix: str = "") -> dict[str, tuple]:
    """DCP's flattened key (``model.experts.gate_up_proj``) -> global shape of each tensor."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_global_shapes(v, key + "."))
        elif torch.is_tensor(v):
            out[key] = tuple(v.shape)  # a DTensor's shape is the global one
    return out


def _culprit(key: str, want: tuple, got: tuple) -> str:
    """Which config field a shape difference points at."""
    if any(key.endswith(f".{n}") or f".{n}." in key for n in EXPERT_NAMES) and \
            want[1:] == got[1:] and want[0] != got[0]:
        return f"num_experts ({got[0]} in the checkpoint, {want[0]} here)"
    if key.endswith("router.weight") and len(want) == 2:
        if want[0] != got[0]:
            return f"num_experts ({got[0]} in the checkpoint, {want[0]} here)"
        return f"hidden_size ({got[1]} in the checkpoint, {want[1]} here)"
    return "the config"


def check_checkpoint(checkpoint_id, state: dict) -> None:
    """Raise ``ValueError`` where the checkpoint at ``checkpoint_id`` (a directory DCP wrote)
    holds a tensor of another global shape than ``state`` (what the model to load into
    expects: another ``num_experts``, ``hidden_size`` ...), or lacks one of its tensors.

    Every rank reads the same metadata file and no collective runs, so every rank raises
    the same error together (a DCP load of mismatched shapes fails inside its collective
    planning, naming no config)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    problems, fields = [], []
    for key, want in _global_shapes(state).items():
        entry = meta.get(key)
        if entry is None:
            problems.append(f"{key} is missing")
            continue
        got = tuple(getattr(entry, "size", ()))
        if got != want:
            problems.append(f"{key}: {got} in the checkpoint, {want} here")
            fields.append(_culprit(key, want, got))
    if problems:
        fields = sorted(set(fields)) or ["the saved model's keys"]
        raise ValueError(
            f"the checkpoint {checkpoint_id} was saved from another model: "
            f"{'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. It differs in "
            f"{', '.join(fields)}: build the model with the config it was saved from "
            "(the expert-parallel size may differ: a load reshards the experts)")


def save(checkpoint_id, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """``dcp.save`` of :func:`get_state_dict` (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(get_state_dict(model, optimizer), checkpoint_id=checkpoint_id)


def load(checkpoint_id, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Check, ``dcp.load`` and :func:`set_state_dict` into ``model`` (and ``optimizer``) as
    they are laid out now (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    state = get_state_dict(model, optimizer)
    check_checkpoint(checkpoint_id, state)
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_state_dict(model, optimizer, state)
