"""Load balancing: the in-layer losses' per-layer state, expert-load statistics, and
DeepSeek-V3's aux-loss-free bias update.

- In-layer losses (``MoEConfig.aux_loss_coef``, ``seq_aux_loss_coef``, ``z_loss_coef``,
  ``aux_loss_scope``): each layer adds their gradient in its own backward; their values are
  ``layer.balance_loss`` (the coefficient-weighted sum) and ``layer.balance_losses`` (each
  loss alone), detached 0-dim tensors set by every forward that trains (no host sync).
  :func:`set_loss_scale` says by how much the main loss is scaled before its backward.
- Expert load: every MoE layer counts its routed (token, expert) rows, in each forward that
  trains (autograd on, or the first forward of a checkpoint called with it), never in a
  recompute. :func:`end_load_step` closes a step (summing the counts over a process group);
  :func:`expert_load` reads them; :func:`update_expert_bias` closes a step and moves each
  score-correction bias by DeepSeek-V3's rule.

Functions taking ``model`` accept a module (every MoELayer in it, and the MoELayer of every
block ``moe_fn.hf.convert`` converted) or an iterable of MoELayers.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ._checks import debug_checks
from .comm.groups import HoldsProcessGroups, check_loaded_group
from .layer_checks import check_score_correction_bias
from .pure.activations import compute_dtype
from .pure.balance import (
    balance_probs,
    bias_update,
    prob_balance_fwd,
    sequence_weights,
    switch_weights,
    topk_counts,
    z_loss_fwd,
)
from .records import BalanceTerms

__all__ = ["BalanceLosses", "ExpertLoad", "end_load_step", "expert_load", "moe_layers",
           "set_loss_scale", "update_expert_bias"]


@attrs.frozen(kw_only=True, eq=False)
class BalanceLosses:
    """One forward's balancing losses, each without its coefficient (0-dim, detached,
    float32; float64 for a float64 layer; None where the config leaves it off): ``switch``
    (Switch/GShard), ``sequence`` (sequence-level), ``z`` (router z-loss)."""

    switch: torch.Tensor | None
    sequence: torch.Tensor | None
    z: torch.Tensor | None


@attrs.frozen(kw_only=True, eq=False)
class ExpertLoad:
    """Routed (token, expert) rows per expert of one layer, int64 ``(E,)`` on the layer's
    device. ``last``: in the last step :func:`end_load_step` closed (summed over its group);
    ``total``: over every closed step, ``steps`` of them; ``pending``: this rank's, since
    the last closed step."""

    last: torch.Tensor
    total: torch.Tensor
    steps: int
    pending: torch.Tensor

    @property
    def max_violation(self) -> torch.Tensor:
        """``max_e last_e / mean(last) - 1`` (DeepSeek's MaxVio; 0 for a perfectly balanced
        or empty step), a 0-dim float32 tensor."""
        last = self.last.to(torch.float32)
        mean = last.mean()
        return torch.where(mean > 0, last.max() / mean.clamp(min=1e-30) - 1, 0.0)


class LayerBalance(HoldsProcessGroups):
    """One MoELayer's balancing state: the config's losses (``terms`` builds them in a
    forward), the last values, the expert-load counters and the gradient scale. Copies
    share the group; a pickled one of the default group loads where it has as many
    ranks (``moe_fn.comm.groups``)."""

    def __init__(self, config, group=None):
        self.config = config
        self.group = group
        # aux_loss_scope="group": the loss is scaled by the group's size so that its mean
        # over the group (what data-parallel gradient averaging optimises) is the loss of
        # the group's whole batch.
        self.group_size = 1 if group is None else dist.get_world_size(group)
        self.grad_scale = 1.0
        self.loss: torch.Tensor | None = None
        self.losses: BalanceLosses | None = None
        self.pending: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.steps = 0
        # The group end_load_step sums the counts over by default (None: the world group);
        # moe_fn.parallel.fully_shard_moe sets the whole data-parallel mesh's.
        self.load_group = None

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.group is not None:  # its size scales the loss: it must be the same
            check_loaded_group(self.group, size=self.group_size, rank=None,
                               what="a layer's aux_loss_scope='group' balancing state")

    @property
    def active(self) -> bool:
        c = self.config
        return bool(c.aux_loss_coef or c.seq_aux_loss_coef or c.z_loss_coef)

    def count(self, counts: torch.Tensor) -> None:
        """Add one forward's routed rows per expert (no host sync)."""
        if self.pending is None or self.pending.device != counts.device:
            self.pending = (torch.zeros_like(counts) if self.pending is None
                            else self.pending.to(counts.device))
        self.pending += counts

    def terms(self, logits: torch.Tensor, seq_len: int, extra=()) -> BalanceTerms | None:
        """The forward of the config's losses on ``logits (T, E)`` whose tokens form
        sequences of ``seq_len``: their gradient's terms, and their values (kept)."""
        c = self.config
        if not (self.active or extra):
            return None
        with torch.no_grad():
            lg = logits.detach()
            t, e = lg.shape
            cd = compute_dtype(lg.dtype)
            switch = sequence = None
            values = dict.fromkeys(("switch", "sequence", "z"))
            total = lg.new_zeros((), dtype=cd)
            if c.aux_loss_coef:
                counts = topk_counts(balance_probs(lg, c.score_func), c.top_k)[0]
                tokens = t
                if self.group is not None:
                    # One all-reduce of E counts; every token has k of them, so the group's
                    # token count follows without another.
                    dist.all_reduce(counts, group=self.group)
                    tokens = counts.sum() // c.top_k
                w = switch_weights(counts, tokens, top_k=c.top_k, num_experts=e,
                                   scale=self.group_size, dtype=cd)
                switch = (float(c.aux_loss_coef), w)
                values["switch"] = prob_balance_fwd(lg, w, score_func=c.score_func)[0]
            if c.seq_aux_loss_coef:
                b = t // seq_len if t else 1
                counts = topk_counts(balance_probs(lg, c.score_func), c.top_k, groups=b)
                w = sequence_weights(counts, seq_len, top_k=c.top_k, num_experts=e, dtype=cd)
                sequence = (float(c.seq_aux_loss_coef), w)
                values["sequence"] = prob_balance_fwd(lg, w, score_func=c.score_func)[0]
            if c.z_loss_coef:
                values["z"] = z_loss_fwd(lg)[0]
            if self.active:
                for key, coef in (("switch", c.aux_loss_coef),
                                  ("sequence", c.seq_aux_loss_coef), ("z", c.z_loss_coef)):
                    if values[key] is not None:
                        total = total + coef * values[key]
                self.loss = total
                self.losses = BalanceLosses(**values)
        return BalanceTerms(score_func=c.score_func, switch=switch, sequence=sequence,
                            z=float(c.z_loss_coef), extra=tuple(extra))


def moe_layers(model) -> list[tuple[str, nn.Module]]:
    """``(name, MoELayer)`` of every MoE layer of ``model`` (see the module's doc)."""
    if isinstance(model, nn.Module):
        named = model.named_modules()
    else:
        try:
            named = [(str(i), m) for i, m in enumerate(model)]
        except TypeError:
            raise TypeError(f"model must be an nn.Module or an iterable of MoELayers, got "
                            f"{type(model).__name__}") from None
    found, seen = [], set()
    for name, m in named:
        layer = m if isinstance(getattr(m, "balance", None), LayerBalance) else \
            getattr(m, "moe_layer", None)
        if isinstance(getattr(layer, "balance", None), LayerBalance) and id(layer) not in seen:
            seen.add(id(layer))
            found.append((name, layer))
    if not found and not isinstance(model, nn.Module):
        raise TypeError("model must be an nn.Module or an iterable of MoELayers; the "
                        "iterable holds no MoELayer")
    return found


def _layers_or_refuse(model, what: str):
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{what}: the model has no MoE layer (an MoELayer, or a block "
                         "moe_fn.hf.convert converted)")
    return layers


def _zeros_like_load(layer) -> torch.Tensor:
    return torch.zeros(layer.config.num_experts, dtype=torch.int64,
                       device=layer.router.weight.device)


def expert_load(model) -> dict[str, ExpertLoad]:
    """Each layer's expert load as it stands (no communication, no host sync)."""
    out = {}
    for name, layer in moe_layers(model):
        s = layer.balance
        zero = _zeros_like_load(layer)
        out[name] = ExpertLoad(last=zero if s.last is None else s.last,
                               total=zero if s.total is None else s.total, steps=s.steps,
                               pending=zero if s.pending is None else s.pending)
    return out


def _default_group(group):
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def end_load_step(model, *, group=None) -> dict[str, ExpertLoad]:
    """Close a step of expert-load counting: every layer's counts since the last closed step,
    summed over ``group`` (default: the world group when torch.distributed is initialised;
    pass the data-times-expert-parallel group when other ranks hold other layers, as with
    pipeline parallelism) in one all-reduce for all layers, become its ``last`` load.
    Collective over ``group``: every rank calls it with the same layers. Returns
    :func:`expert_load`."""
    layers = _layers_or_refuse(model, "end_load_step")
    if group is None:  # the group moe_fn.parallel.fully_shard_moe gave the layers
        given = {id(g): g for g in (getattr(layer.balance, "load_group", None)
                                    for _, layer in layers)}
        if len(given) == 1:
            group = next(iter(given.values()))
    group = _default_group(group)
    pending = [layer.balance.pending if layer.balance.pending is not None
               else _zeros_like_load(layer) for _, layer in layers]
    devices = {p.device for p in pending}
    if len(devices) > 1:
        raise ValueError(f"end_load_step: the layers' counts are on several devices "
                         f"({sorted(map(str, devices))}): move the model to one device")
    loads = torch.cat(pending)
    if group is not None:
        dist.all_reduce(loads, group=group)
    start = 0
    for (_, layer), p in zip(layers, pending):
        s = layer.balance
        s.last = loads[start:start + p.numel()].clone()
        start += p.numel()
        s.total = s.last.clone() if s.total is None else s.total.to(s.last.device) + s.last
        s.steps += 1
        s.pending = None
    return expert_load(model)


def update_expert_bias(model, rate: float, *, group=None) -> dict[str, ExpertLoad]:
    """DeepSeek-V3's aux-loss-free balancing; call it after ``optimizer.step()``.

    Closes the load step (:func:`end_load_step`, over ``group``) and moves the
    score-correction bias of every layer that has one (MoEConfig's
    ``score_correction_bias``, or a converted DeepSeek-V3, GLM-4-MoE, dots1, ERNIE-4.5,
    MiniMax or Step-3.7 block's) by ``b_e += rate * sign(mean load - load_e)``, the loads
    being the routed rows counted since the last step. Deterministic (integer counts,
    exact comparisons) and the same on every rank of ``group``. Returns the loads."""
    if (isinstance(rate, bool) or not isinstance(rate, (int, float))
            or not math.isfinite(rate) or rate <= 0
            or rate > torch.finfo(torch.float32).max):
        raise ValueError(f"rate must be a positive finite number (DeepSeek-V3's is 1e-3), "
                         f"got {rate!r}")
    layers = _layers_or_refuse(model, "update_expert_bias")
    biased = [(n, layer.router.e_score_correction_bias) for n, layer in layers
              if layer.router.e_score_correction_bias is not None]
    if not biased:
        raise ValueError("update_expert_bias: no MoE layer of the model has a "
                         "score-correction bias to update; build them with "
                         "MoEConfig(score_correction_bias=True)")
    for name, bias in biased:
        if bias.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name}: the score-correction bias is {bias.dtype}, whose "
                            f"rounding would swallow steps of {rate}: keep it in float32 "
                            "(e.g. buffer.data = buffer.data.float())")
    loads = end_load_step(model, group=group)
    with torch.no_grad():
        for name, bias in biased:
            bias.copy_(bias_update(bias, loads[name].last.to(bias.device), rate))
            if debug_checks():
                check_score_correction_bias(bias, f"{name}.router.e_score_correction_bias")
    return loads


def set_loss_scale(model, scale) -> None:
    """The factor by which the loss is scaled before its backward (a gradient-accumulation
    ``1/n``, a GradScaler's scale: a float or a 0-dim tensor, read in each backward): the
    balancing gradients the layers inject (their own losses, and transformers' loss of a
    converted model) are scaled alike. Default 1."""
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or not scale.is_floating_point():
            raise ValueError(f"scale must be a float or a 0-dim float tensor, got a "
                             f"{scale.dtype} tensor of shape {tuple(scale.shape)}")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or a 0-dim tensor, got {scale!r}")
    else:
        scale = float(scale)
    for _, layer in _layers_or_refuse(model, "set_loss_scale"):
        layer.balance.grad_scale = scale
